"""PNG pictures of an audit (matplotlib, Agg backend): metrics per round, metrics against the
number of examples, the failure-mode t-SNE map, the cluster-ablation bars and the judge-bias
statistics with their bootstrap intervals."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_METRICS = ("accuracy", "f1", "auc", "kappa")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rounds(rounds: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Held-out metrics per round (``rounds``: the JSON report's rows)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["round"] for r in rounds]
    for m in _METRICS:
        ax.plot(xs, [r["heldout"][m] for r in rounds], marker="o", label=m)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out value")
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    ax.set_title("ALLURE: held-out metrics per round")
    return _save(fig, plt, path)


def plot_sweep(sweep: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Held-out accuracy / F1 / AUC against the number of in-context examples (mean +- std
    over seeds)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["n_examples"] for r in sweep]
    for m in ("accuracy", "f1", "auc"):
        ax.errorbar(xs, [r[m] for r in sweep], yerr=[r.get(m + "_std", 0.0) for r in sweep],
                    marker="o", capsize=3, label=m)
    ax.set_xlabel("in-context examples")
    ax.set_ylabel("held-out value")
    ax.legend(fontsize=8)
    ax.set_title("metric vs number of examples")
    return _save(fig, plt, path)


def plot_tsne(xy: np.ndarray, assignment: Sequence[int], names: Sequence[str],
              path: str | os.PathLike) -> Path:
    """The failures' t-SNE map, coloured by failure-mode cluster."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    a = np.asarray(assignment)
    for c, name in enumerate(names):
        sel = a == c
        ax.scatter(xy[sel, 0], xy[sel, 1], s=30, label=name[:50])
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(fontsize=6, loc="best")
    ax.set_title("failure modes (all-MiniLM-L6-v2, t-SNE)")
    return _save(fig, plt, path)


def plot_ablation(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Accuracy and kappa against the full prompt with each cluster's examples removed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = len(rows)
    x = np.arange(n)
    ax.bar(x - 0.2, [r["accuracy"] for r in rows], 0.4, label="accuracy")
    ax.bar(x + 0.2, [r["kappa_vs_full"] for r in rows], 0.4, label="kappa vs full prompt")
    ax.set_xticks(x)
    ax.set_xticklabels([f"-c{i}" for i in range(n)])
    ax.set_xlabel("cluster removed")
    ax.legend(fontsize=8)
    ax.set_title("cluster ablation (held-out)")
    return _save(fig, plt, path)


def _bias_points(bias: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    rows: list[tuple[str, dict[str, Any] | None]] = []
    s, ln, a = bias.get("swap"), bias.get("length"), bias["agreement"]
    if s is not None:
        rows += [("swap flip rate", s["flip_rate"]),
                 ("first position chosen", s["first_position_rate"])]
        if s.get("debiased") is not None:
            rows.append(("kappa, order-averaged", s["debiased"]["kappa"]))
    rows += [("kappa vs human", a["kappa"]), ("accuracy vs human", a["accuracy"])]
    if ln is not None:
        rows += [("length r (verdict)", ln["point_biserial"]),
                 ("length Spearman (P)", ln.get("spearman")),
                 ("length r (human)", ln["human_point_biserial"]),
                 ("longer output chosen", ln.get("longer_preferred_rate"))]
    return [(k, v) for k, v in rows if v is not None]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and np.isfinite(x)


def plot_bias(bias: dict[str, Any], rounds: Sequence[dict[str, Any]],
              path: str | os.PathLike) -> Path:
    """Judge bias: left, the last round's statistics with their bootstrap intervals (undefined
    ones marked); right, the swap flip rate and kappa per round with intervals (``bias``: the
    JSON report's ``judge_bias``; ``rounds``: its rows, each with ``bias``)."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4),
                                  gridspec_kw={"width_ratios": [3, 2]})
    pts = _bias_points(bias)
    ys = np.arange(len(pts))[::-1]
    for y, (_, v) in zip(ys, pts, strict=True):
        est, lo, hi = v.get("estimate"), v.get("lo"), v.get("hi")
        if not _finite(est):
            ax.text(0.0, y, "undefined", va="center", fontsize=8, color="gray")
            continue
        if _finite(lo) and _finite(hi):
            ax.errorbar([est], [y], xerr=[[est - lo], [hi - est]], fmt="o", capsize=3,
                        color="C0")
        else:
            ax.plot([est], [y], "o", color="C0")
    ax.axvline(0.0, color="gray", lw=0.6)
    ax.axvline(0.5, color="gray", lw=0.6, ls=":")
    ax.set_yticks(ys)
    ax.set_yticklabels([k for k, _ in pts], fontsize=8)
    ax.set_xlim(-1.05, 1.05)
    ax.set_title(f"judge bias, round {bias.get('round', '?')} (n={bias['n']}, "
                 f"{100 * bias['level']:g}% bootstrap)", fontsize=9)
    xs = [r["round"] for r in rounds]
    for key, label, c in (("flip_rate", "swap flip rate", "C1"), ("kappa", "kappa", "C2")):
        vals = [r.get("bias", {}).get(key) for r in rounds]
        pts2 = [(x, v) for x, v in zip(xs, vals, strict=True) if v is not None and _finite(v[0])]
        if not pts2:
            continue
        e = np.array([v[0] for _, v in pts2], dtype=float)
        lo = np.array([v[1] if _finite(v[1]) else v[0] for _, v in pts2], dtype=float)
        hi = np.array([v[2] if _finite(v[2]) else v[0] for _, v in pts2], dtype=float)
        ax2.errorbar([x for x, _ in pts2], e, yerr=[e - lo, hi - e], marker="o", capsize=3,
                     label=label, color=c)
    ax2.set_xlabel("round")
    ax2.set_xticks(xs)
    ax2.set_ylim(-1.05, 1.05)
    ax2.legend(fontsize=8)
    ax2.set_title("held-out, per round", fontsize=9)
    return _save(fig, plt, path)


def _save(fig, plt, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
