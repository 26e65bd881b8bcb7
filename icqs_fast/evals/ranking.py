"""Ranking models by their mean score, with bootstrap intervals and agreement with a known truth.

A scores file has one record per (model, item): a group field naming the model and a numeric
score field (e.g. the output of ``icqs-fast score`` with the model as ``--label-field``, or any
JSONL/CSV/TSV/Parquet table). :func:`read_group_scores` groups the scores by model,
:func:`rank_models` gives each model its mean, a percentile bootstrap interval over its items
(:func:`icqs_fast.metrics.bootstrap_ci`) and its rank (1 = highest mean; tied means share the
best rank of the tie), :func:`ranking_correlations` compares the means with true qualities
(Spearman / Kendall tau-b of the ranking, Pearson of the means against the truth values), and
:func:`plot_ranking` draws the means with their intervals in rank order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from icqs_fast.io.readers import read_rows
from icqs_fast.io.records import (
    InputError,
    PathLike,
    RecordError,
    detect_format,
    display_name,
    field_keys,
    field_of,
    get_field,
)


def _number(v: Any, *, path: str, line: int, index: int, field: str, text_ok: bool) -> float:
    """A score value as a float: a JSON number, or (CSV/TSV) a numeric string."""
    if isinstance(v, bool) or v is None:
        ok = False
    elif isinstance(v, (int, float)):
        return float(v)
    elif isinstance(v, str) and text_ok:
        try:
            return float(v)
        except ValueError:
            ok = False
    else:
        ok = False
    if not ok and (v is None or v == ""):
        raise RecordError(path, line, field, "missing (empty)", index=index)
    shown = repr(v) if isinstance(v, str) else f"{type(v).__name__} {json.dumps(v)[:40]}"
    raise RecordError(path, line, field, f"must be a number, got {shown}", index=index)


def _group(v: Any, *, path: str, line: int, index: int, field: str) -> str:
    if v is None or v == "":
        raise RecordError(path, line, field, "missing (empty)", index=index)
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise RecordError(path, line, field,
                          f"must be a string or an integer, got {type(v).__name__}", index=index)
    return str(v)


def read_group_scores(path: PathLike, *, group_field: str = "model", score_field: str = "score",
                      format: str | None = None, encoding: str = "utf-8",
                      progress: Any = None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Scores grouped by model, in first-seen order.

    Records of a results file that stand for a skipped bad input record (an ``error`` field and
    no score) are left out and counted. Scores may be NaN (kept; :func:`rank_models` leaves
    them out of the mean).

    Args:
        path: JSONL/CSV/TSV/Parquet file or dataset folder.
        group_field, score_field: the fields (dotted paths allowed in JSON/Parquet).
        progress: an optional callable wrapping the row iterator (e.g. a progress bar).

    Returns:
        ``({model: float64 array [n_items]}, {"records": n, "error_records": n})``.

    Raises:
        RecordError: a record whose group is missing / not a string or an integer, or whose
            score is missing / not a number (the message names file, line and field).
        InputError: a missing column, no scored record at all.
    """
    name = display_name(path)
    fmt = detect_format(path, format)
    text = fmt in ("csv", "tsv")
    # Columns must exist in a table (a JSONL record is checked one by one); "error" marks a
    # results file's skipped records.
    rows = read_rows(path, fields=[] if fmt == "jsonl" else [group_field, score_field],
                     optional=("error",), format=format, encoding=encoding)
    if progress is not None:
        rows = progress(rows)
    groups: dict[str, list[float]] = {}
    n, n_err = 0, 0
    for index, line, row in rows:
        found_s, s = get_field(row, score_field)
        if "error" in row and row["error"] is not None and (not found_s or s is None):
            n_err += 1
            continue
        found_g, g = get_field(row, group_field)
        if not found_g:
            raise RecordError(name, line, group_field,
                              f"missing (this record's keys: {field_keys(row)})", index=index)
        if not found_s:
            raise RecordError(name, line, score_field,
                              f"missing (this record's keys: {field_keys(row)})", index=index)
        model = _group(g, path=name, line=line, index=index, field=group_field)
        groups.setdefault(model, []).append(
            _number(s, path=name, line=line, index=index, field=score_field, text_ok=text))
        n += 1
    if n == 0:
        raise InputError(name, None, score_field, "no scored records")
    return ({k: np.asarray(v, dtype=np.float64) for k, v in groups.items()},
            {"records": n, "error_records": n_err})


def rank_models(groups: Mapping[str, Sequence[float]], *, n_boot: int = 1000,
                level: float = 0.95, seed: int = 0,
                truth: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Mean score, bootstrap interval and rank of each model.

    Args:
        groups: ``{model: scores}`` (non-finite scores are left out and counted in ``n_nan``).
        n_boot, level, seed: the percentile bootstrap over each model's items (resampled with
            ``numpy.random.default_rng(seed)``, the same seed for every model).
        truth: optional ``{model: true quality}`` copied into the rows (``truth``: None when a
            model has none).

    Returns:
        One dict per model, best first: ``model``, ``rank`` (1 = highest mean; ties share the
        best rank, ``1, 2, 2, 4``; None for a model without a finite score, listed last),
        ``n`` (finite scores), ``n_nan``, ``mean``, ``ci_low``, ``ci_high`` and, with
        ``truth``, ``truth``.
    """
    from scipy import stats

    from icqs_fast.metrics import bootstrap_ci

    rows: list[dict[str, Any]] = []
    for model, scores in groups.items():
        arr = np.asarray(scores, dtype=np.float64).reshape(-1)
        fin = arr[np.isfinite(arr)]
        if fin.size:
            mean = float(fin.mean())
            lo, hi = bootstrap_ci(np.mean, fin, n_resamples=n_boot, level=level, seed=seed)
        else:
            mean = lo = hi = math.nan
        row = {"model": model, "rank": None, "n": int(fin.size), "n_nan": int(arr.size - fin.size),
               "mean": mean, "ci_low": lo, "ci_high": hi}
        if truth is not None:
            t = truth.get(model)
            row["truth"] = None if t is None else float(t)
        rows.append(row)
    ranked = [r for r in rows if math.isfinite(r["mean"])]
    if ranked:
        ranks = stats.rankdata([-r["mean"] for r in ranked], method="min")
        for r, k in zip(ranked, ranks, strict=True):
            r["rank"] = int(k)
    rows.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["model"]))
    return rows


def ranking_correlations(rows: Iterable[Mapping[str, Any]],
                         truth: Mapping[str, float]) -> dict[str, Any]:
    """Agreement of the models' mean scores with their true qualities, over the models that
    have both: Spearman's rho and Kendall's tau-b (of the ranking; higher truth = better) and
    Pearson's r of the means against the truth values. NaN (with a warning) below two models
    or for a constant input. ``n_models`` counts the models compared, ``missing`` lists the
    ranked models without a truth value."""
    from icqs_fast.metrics import kendall, pearson, spearman

    both = [(r["mean"], float(truth[r["model"]])) for r in rows
            if r["model"] in truth and math.isfinite(r["mean"])]
    missing = [r["model"] for r in rows if r["model"] not in truth]
    means = [m for m, _ in both]
    true = [t for _, t in both]
    return {"n_models": len(both), "spearman": spearman(means, true),
            "kendall": kendall(means, true), "pearson": pearson(means, true),
            "missing": missing}


def read_truth(path: PathLike, *, group_field: str = "model", truth_field: str = "truth",
               encoding: str = "utf-8") -> dict[str, float]:
    """``{model: true quality}`` from a JSON object (``{"model-a": 0.9, ...}``), a JSON list of
    objects, or a JSONL/CSV/TSV/Parquet table with ``group_field`` and ``truth_field``.

    Raises:
        InputError / RecordError: not a mapping of names to numbers, a missing or non-numeric
            value, a model named twice (the message names file, line and field).
    """
    name = display_name(path)
    p = os.fspath(path)
    if p.lower().endswith(".json"):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such truth file: {name}")
        try:
            with open(p, encoding=encoding) as f:
                doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise InputError(name, exc.lineno, None, f"invalid JSON ({exc.msg})") from None
        if isinstance(doc, dict):
            out = {}
            for k, v in doc.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise InputError(name, None, k, "must be a number (a JSON truth file maps "
                                     "model names to true qualities)")
                out[str(k)] = float(v)
            return out
        if not isinstance(doc, list):
            raise InputError(name, None, None, "a JSON truth file holds an object "
                             "{model: quality} or a list of objects")
        items = [(i, None, obj) for i, obj in enumerate(doc)]
    else:
        text = detect_format(path) in ("csv", "tsv")
        items = read_rows(path, fields=[group_field, truth_field] if text else [],
                          encoding=encoding)
    out = {}
    for index, line, obj in items:
        if not isinstance(obj, dict):
            raise InputError(name, None, None, f"item {index} is not an object")
        where = dict(path=name, line=line if line is not None else index + 1, index=index)
        model = _group(field_of(obj, group_field, (str, int), **where), field=group_field,
                       **where)
        v = _number(field_of(obj, truth_field, (int, float, str), **where), field=truth_field,
                    text_ok=True, **where)
        if model in out:
            raise RecordError(name, where["line"], group_field, f"model {model!r} appears twice",
                              index=index)
        out[model] = v
    if not out:
        raise InputError(name, None, None, "no truth values")
    return out


def plot_ranking(rows: Sequence[Mapping[str, Any]], path: PathLike, *, title: str | None = None,
                 score_label: str = "mean score", level: float = 0.95) -> Path:
    """Draw the ranked models' means with their bootstrap intervals (best at the top) into a PNG
    at ``path`` (matplotlib, Agg backend); a model's true quality, when the rows have one, is
    written beside its name. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("rank") is not None]
    if not shown:
        raise ValueError("nothing to plot: no model has a finite mean score")
    n = len(shown)
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.45 * n))
    try:
        y = np.arange(n)[::-1]  # rank 1 on top
        means = np.array([r["mean"] for r in shown])
        lo = np.array([r["ci_low"] for r in shown])
        hi = np.array([r["ci_high"] for r in shown])
        err = np.vstack([np.clip(means - lo, 0, None), np.clip(hi - means, 0, None)])
        ax.errorbar(means, y, xerr=err, fmt="o", color="tab:blue", ecolor="tab:gray",
                    capsize=4, label=f"mean, {level:.0%} bootstrap interval")
        labels = [f"{r['rank']}. {r['model']}" + (f"  (truth {r['truth']:g})"
                                                   if r.get("truth") is not None else "")
                  for r in shown]
        ax.set_yticks(y, labels)
        ax.set_xlabel(score_label)
        ax.set_title(title or f"Models ranked by {score_label}")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out
