"""Correlation metrics between feature values and reference scores (e.g. GPT-4 judgments).

All three handle ties (average ranks; Kendall's tau-b) and return NaN with a ``RuntimeWarning``
instead of raising when a correlation is undefined: fewer than two finite pairs or a constant
input. Pairs where either value is NaN / inf are dropped first.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
from scipy import stats

METRICS = ("pearson", "spearman", "kendall")


def _clean(x: Sequence[float], y: Sequence[float], name: str) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    b = np.asarray(y, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"{name}: inputs have different lengths ({a.size} and {b.size})")
    ok = np.isfinite(a) & np.isfinite(b)
    return a[ok], b[ok]


def _undefined(a: np.ndarray, b: np.ndarray, name: str) -> bool:
    if a.size < 2:
        warnings.warn(f"{name}: fewer than 2 finite pairs; returning NaN", RuntimeWarning,
                      stacklevel=3)
        return True
    if np.all(a == a[0]) or np.all(b == b[0]):
        warnings.warn(f"{name}: constant input; correlation undefined, returning NaN",
                      RuntimeWarning, stacklevel=3)
        return True
    return False


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r."""
    a, b = _clean(x, y, "pearson")
    if _undefined(a, b, "pearson"):
        return math.nan
    a = a - a.mean()
    b = b - b.mean()
    r = float((a * b).sum() / math.sqrt(float((a * a).sum()) * float((b * b).sum())))
    return max(-1.0, min(1.0, r))


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson's r of the average ranks (ties share their mean rank)."""
    a, b = _clean(x, y, "spearman")
    if _undefined(a, b, "spearman"):
        return math.nan
    return pearson(stats.rankdata(a), stats.rankdata(b))


def kendall(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (tie-corrected), O(n^2) pair count (fine for thousands of items)."""
    a, b = _clean(x, y, "kendall")
    if _undefined(a, b, "kendall"):
        return math.nan
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    iu = np.triu_indices(a.size, 1)
    da, db = da[iu], db[iu]
    s = float((da * db).sum())
    n1 = float((da != 0).sum())
    n2 = float((db != 0).sum())
    return s / math.sqrt(n1 * n2)


def correlations(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """``{"pearson", "spearman", "kendall"}`` of x against y."""
    return {"pearson": pearson(x, y), "spearman": spearman(x, y), "kendall": kendall(x, y)}
