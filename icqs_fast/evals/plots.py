"""The ICQS study's figures (matplotlib, Agg backend, PNG files).

* :func:`plot_loglik_curves` - log-likelihood against the mixture ratio, one curve per group, with
  a band over the ``L`` demonstration sets (the study's Figures 5-8);
* :func:`plot_score_histograms` - score histograms per group;
* :func:`plot_metric_curve` - a metric against the number of in-context examples, with intervals.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from icqs_fast.io.datasets import eval_dataset


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never a window, whatever the environment
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    _pyplot().close(fig)
    return p


def plot_loglik_curves(loglik: Mapping[str, Any], ratios: Sequence[float],
                       path: str | os.PathLike, *, title: str = "") -> Path:
    """Mean log-likelihood of each group's responses against the mixture ratio.

    Args:
        loglik: group -> ``[n_items, M+1, L]`` log-likelihoods ``log P(y | demos_{j,l}, x)``.
        ratios: the ``M+1`` ratios (x axis).
        path: PNG file to write.

    For each group and set ``l`` the curve ``mean_items loglik[:, j, l]`` is computed; the line is
    its mean over the sets and the band spans the sets' minimum to maximum.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    r = np.asarray(ratios, dtype=np.float64)
    drawn = 0
    for name, ll in loglik.items():
        a = np.asarray(ll, dtype=np.float64)
        if a.size == 0:
            continue
        if a.ndim != 3 or a.shape[1] != len(r):
            raise ValueError(f"loglik[{name!r}] must be [n, M+1={len(r)}, L], got {a.shape}")
        per_set = a.mean(axis=0)  # [M+1, L]
        line, = ax.plot(r, per_set.mean(axis=1), marker="o", label=f"{name} (n={a.shape[0]})")
        ax.fill_between(r, per_set.min(axis=1), per_set.max(axis=1), alpha=0.2,
                        color=line.get_color())
        drawn += 1
    if not drawn:
        raise ValueError("no group has items to plot")
    ax.set_xlabel("mixture ratio r (fraction of good demonstrations)")
    ax.set_ylabel("mean log P(y | demos, x)")
    ax.set_title(title or "log-likelihood vs mixture ratio (band: min-max over sets)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_score_histograms(scores: Mapping[str, Sequence[float]], path: str | os.PathLike, *,
                          bins: Sequence[float] | int = 11, title: str = "",
                          xlabel: str = "ICQS-Epistemic score") -> Path:
    """Histograms of the scores per group (one panel per group, shared x axis).

    Args:
        scores: group -> scores.
        bins: histogram bins (count or edges).
    """
    plt = _pyplot()
    names = [k for k, v in scores.items() if len(v)]
    if not names:
        raise ValueError("no group has scores to plot")
    fig, axes = plt.subplots(len(names), 1, figsize=(6, 1.6 * len(names) + 0.8), sharex=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        v = np.asarray(scores[name], dtype=np.float64)
        ax.hist(v[np.isfinite(v)], bins=bins, range=(0.0, 1.0) if isinstance(bins, int) else None,
                color="tab:blue", alpha=0.8)
        ax.set_ylabel("count")
        ax.set_title(f"{name} (n={v.size}, mean {np.nanmean(v):.3f})", fontsize=9)
    axes[-1, 0].set_xlabel(xlabel)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_metric_curve(ns: Sequence[int], series: Mapping[str, Sequence[Sequence[float]]],
                      path: str | os.PathLike, *, ylabel: str = "accuracy", title: str = ""
                      ) -> Path:
    """A metric against the number of in-context examples, one line per series.

    Args:
        ns: the numbers of demonstrations per set (x axis).
        series: name -> one ``(value, lo, hi)`` per ``N`` (the interval drawn as error bars;
            NaN/None bounds are skipped).
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.asarray(ns, dtype=np.float64)
    for name, pts in series.items():
        a = np.asarray([[np.nan if v is None else v for v in p] for p in pts], dtype=np.float64)
        if a.shape != (len(x), 3):
            raise ValueError(f"series {name!r}: expected {len(x)} (value, lo, hi) triples")
        lo = np.where(np.isfinite(a[:, 1]), a[:, 0] - a[:, 1], 0.0)
        hi = np.where(np.isfinite(a[:, 2]), a[:, 2] - a[:, 0], 0.0)
        ax.errorbar(x, a[:, 0], yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], marker="o",
                    capsize=3, label=name)
    ax.set_xlabel("demonstrations per set (N)")
    ax.set_xticks(x)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def triple(v: dict[str, float]) -> tuple[float, float, float]:
    """``(value, lo, hi)`` of a metric with its interval."""
    return v["value"], v["lo"], v["hi"]


def write_plots(dataset: str, out: dict[str, Any], ns: list[int], folder: str) -> list[Path]:
    """The study's PNGs for one run (see the module docstring), by the data set's registry
    kind (:data:`icqs_fast.io.datasets.EVAL_DATASETS`); returns their paths."""
    ds = eval_dataset(dataset)
    if ds.kind not in _WRITERS:
        raise ValueError(f"no study figures for {ds.name} ({ds.kind} data)")
    return _WRITERS[ds.kind](ds, out, ns, Path(folder))


def _common(ds: Any, out: dict[str, Any], ns: list[int], d: Path, ll: dict[str, Any],
            sc: dict[str, Any]) -> list[Path]:
    """The log-likelihood curves and the score histograms of the largest N."""
    return [plot_loglik_curves(ll, out["ratios"], d / f"{ds.name}_loglik.png",
                               title=f"{ds.title}: N={max(ns)}"),
            plot_score_histograms(sc, d / f"{ds.name}_hist.png", bins=_bins(out["ratios"]))]


def _label_plots(ds: Any, out: dict[str, Any], ns: list[int], d: Path) -> list[Path]:
    """``labels``: one curve per response group and one accuracy-vs-N figure per group."""
    top = out["items"][max(ns)]
    files = _common(ds, out, ns, d, {g: v["loglik"] for g, v in top.items()},
                    {g: v["score"] for g, v in top.items()})
    for g in top:
        series = {m: [triple(out["per_n"][n]["groups"][g][m]) for n in ns]
                  for m in out["per_n"][ns[0]]["groups"][g]}
        files.append(plot_metric_curve(ns, series, d / f"{ds.name}_curve_{g}.png",
                                       ylabel=f"accuracy ({g})", title=ds.title))
    return files


_MAJORITY = {"e": "majority entailment", "n": "majority neutral", "c": "majority contradiction"}


def _distribution_plots(ds: Any, out: dict[str, Any], ns: list[int], d: Path) -> list[Path]:
    """``distributions``: one curve per human majority label and one figure per metric."""
    top = out["items"][max(ns)]
    groups: dict[str, list[int]] = {g: [] for g in _MAJORITY}
    for k, maj in enumerate(top["majority"]):
        groups[maj].append(k)
    ll = {_MAJORITY[g]: top["loglik"][idx] for g, idx in groups.items() if idx}
    sc = {_MAJORITY[g]: [top["score"][k] for k in idx] for g, idx in groups.items() if idx}
    files = _common(ds, out, ns, d, ll, sc)
    for metric in ds.metrics:
        series = {m: [triple(out["per_n"][n][m][metric]) for n in ns]
                  for m in out["per_n"][ns[0]] if m != "compare"}
        files.append(plot_metric_curve(ns, series, d / f"{ds.name}_curve_{metric}.png",
                                       ylabel=metric, title=ds.title))
    return files


_WRITERS = {"labels": _label_plots, "distributions": _distribution_plots}


def _bins(ratios: list[float]) -> list[float]:
    # One bin centred on each ratio: the scores only take these values.
    h = 0.5 / max(1, len(ratios) - 1)
    return [r - h for r in ratios] + [ratios[-1] + h]
