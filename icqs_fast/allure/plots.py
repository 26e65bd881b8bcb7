"""PNG pictures of an audit (matplotlib, Agg backend): metrics per round, metrics against the
number of examples, the failure-mode t-SNE map and the cluster-ablation bars."""

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


def _save(fig, plt, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
