"""Metrics on scipy / scikit-learn: correlations, classification scores and bootstrap intervals.

Correlations (Pearson, Spearman, Kendall tau-b) compare feature values with reference scores;
``accuracy``, ``f1``, ``auc`` and ``cohen_kappa`` score labels; ``bootstrap_ci`` puts a
percentile interval on any of them by resampling items. Every bootstrap interval of the package
comes from :func:`bootstrap_distribution` (``scipy.stats.bootstrap``'s resamples, paired or per
stratum) and :func:`percentile_interval`.

Every metric returns NaN with a ``RuntimeWarning`` instead of raising when it is undefined
(too few items, a constant input, a single class, ...). For the correlations and ``auc``,
pairs where either value is NaN / inf are dropped first. Different input lengths raise
``ValueError``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy import stats
from sklearn import metrics as skm

METRICS = ("pearson", "spearman", "kendall")


def _warn_nan(name: str, why: str) -> float:
    # stacklevel 3: the warning points at the caller of the public metric.
    warnings.warn(f"{name}: {why}; returning NaN", RuntimeWarning, stacklevel=3)
    return math.nan


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


def _clip(r: float) -> float:
    # scipy can return 1.0000000000000002 from rounding; a correlation is in [-1, 1].
    return max(-1.0, min(1.0, float(r)))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r of two equal-length float sequences (non-finite pairs dropped)."""
    a, b = _clean(x, y, "pearson")
    if _undefined(a, b, "pearson"):
        return math.nan
    return _clip(stats.pearsonr(a, b).statistic)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho: Pearson's r of the average ranks (ties share their mean rank)."""
    a, b = _clean(x, y, "spearman")
    if _undefined(a, b, "spearman"):
        return math.nan
    return _clip(stats.spearmanr(a, b).statistic)


def kendall(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (tie-corrected), scipy's O(n log n) algorithm."""
    a, b = _clean(x, y, "kendall")
    if _undefined(a, b, "kendall"):
        return math.nan
    return _clip(stats.kendalltau(a, b, variant="b").statistic)


def correlations(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """``{"pearson", "spearman", "kendall"}`` of x against y."""
    return {"pearson": pearson(x, y), "spearman": spearman(x, y), "kendall": kendall(x, y)}


def _labels(y_true: Sequence[Any], y_pred: Sequence[Any], name: str
            ) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(list(y_true)).reshape(-1)
    b = np.asarray(list(y_pred)).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"{name}: inputs have different lengths ({a.size} and {b.size})")
    return a, b


def accuracy(y_true: Sequence[Any], y_pred: Sequence[Any]) -> float:
    """Fraction of items whose predicted label equals the true one (labels of any type)."""
    a, b = _labels(y_true, y_pred, "accuracy")
    if a.size == 0:
        return _warn_nan("accuracy", "no items")
    return float(skm.accuracy_score(a, b))


def f1(y_true: Sequence[Any], y_pred: Sequence[Any], positive: Any = 1) -> float:
    """F1 of the class ``positive`` (the other labels are the negative class).

    ``2 tp / (2 tp + fp + fn)``; 0 when there are positives but none is found, NaN (with a
    warning) when ``positive`` occurs in neither input.
    """
    a, b = _labels(y_true, y_pred, "f1")
    if not np.any(a == positive) and not np.any(b == positive):
        return _warn_nan("f1", f"label {positive!r} occurs in neither y_true nor y_pred")
    # labels=[positive] + micro averaging: the binary F1 of one class even with >2 labels.
    return float(skm.f1_score(a, b, labels=[positive], average="micro", zero_division=0.0))


def auc(y_true: Sequence[Any], scores: Sequence[float], positive: Any = 1) -> float:
    """ROC AUC of ``scores`` for telling items with ``y_true == positive`` from the others.

    ``y_true`` may be bool, 0/1 or any labels (``positive`` names the positive class). Items
    with a non-finite score are dropped; NaN (with a warning) when only one class is left.
    """
    a, _ = _labels(y_true, scores, "auc")
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    pos = a == positive if a.dtype != bool else a == bool(positive)
    ok = np.isfinite(s)
    pos, s = pos[ok], s[ok]
    if pos.all() or not pos.any():
        return _warn_nan("auc", "only one class among items with a finite score")
    return float(skm.roc_auc_score(pos, s))


def cohen_kappa(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Cohen's kappa of two raters' labels for the same items (unweighted).

    NaN (with a warning) when undefined: no items, or both raters give one and the same label
    to every item (chance agreement 1).
    """
    x, y = _labels(a, b, "cohen_kappa")
    if x.size == 0:
        return _warn_nan("cohen_kappa", "no items")
    if np.all(x == x[0]) and np.all(y == x[0]):
        return _warn_nan("cohen_kappa", "both raters give one and the same label; undefined")
    return float(skm.cohen_kappa_score(x, y))


# Item indices drawn per batch of resamples (int64: 32 MiB): a million items x 1000 resamples
# would otherwise be 8 GB of indices at once.
BOOTSTRAP_BATCH_INDICES = 1 << 22


def bootstrap_distribution(statistic: Callable[..., Any], *samples: Sequence[Any],
                           paired: bool = True, vectorized: bool = False,
                           n_resamples: int = 1000, seed: int = 0,
                           batch: int | None = None) -> np.ndarray:
    """The statistic on ``n_resamples`` bootstrap resamples, drawn by ``scipy.stats.bootstrap``.

    Args:
        statistic: ``statistic(*resampled_samples) -> float``; with ``vectorized`` it gets
            arrays with a leading resample axis (sample ``k`` of shape ``(b, n_k, ...)``) and
            returns shape ``(b,)``.
        samples: arrays whose axis 0 is the items (any dtype, e.g. labels or an ``(n, 2)``
            array of two scorings of the same items).
        paired: True: all samples have the same length and one draw of item indices resamples
            them all (items stay paired); False: each sample is resampled on its own (strata,
            e.g. the positives and the negatives of an AUC, so each keeps its size).
        vectorized: whether ``statistic`` takes a batch of resamples (much faster).
        n_resamples, seed: the resamples, from ``numpy.random.default_rng(seed)``: the same
            seed and sizes give the same item indices, whatever the statistic.
        batch: resamples drawn and evaluated at a time (None: as many as keep about
            :data:`BOOTSTRAP_BATCH_INDICES` item indices at once, which bounds the memory).

    Returns:
        float64 array of shape ``(n_resamples,)`` (NaN where the statistic is).

    scipy resamples item indices (``scipy.stats.bootstrap`` with ``method="percentile"``, its
    ``bootstrap_distribution``); the statistic indexes the samples with them. A sample of one
    item cannot be handed to scipy (it needs two), but resamples it to itself anyway, so it is
    kept fixed here.
    """
    if not samples:
        raise ValueError("bootstrap_distribution: at least one sample is needed")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_distribution: n_resamples must be >= 1, got {n_resamples}")
    arrs = [a if isinstance(a, np.ndarray) else np.asarray(list(a)) for a in samples]
    sizes = [len(a) for a in arrs]
    if paired and len(set(sizes)) > 1:
        raise ValueError("bootstrap_distribution: paired samples have different lengths "
                         f"({', '.join(str(s) for s in sizes)})")
    if min(sizes) == 0:
        raise ValueError("bootstrap_distribution: a sample has no items")
    # One index stratum per independently resampled group of samples.
    strata = [sizes[0]] if paired else sizes
    moving = [k for k, n in enumerate(strata) if n > 1]
    if batch is None:
        batch = max(1, BOOTSTRAP_BATCH_INDICES // sum(strata))

    def indexed(*idx: np.ndarray) -> np.ndarray:
        # idx[m]: the (b, n) indices of stratum moving[m]; fixed strata are their own item.
        b = idx[0].shape[0] if idx else 1
        full = [np.zeros((b, 1), dtype=np.int64)] * len(strata)
        for k, i in zip(moving, idx, strict=True):
            full[k] = i
        picks = [a[full[0 if paired else k]] for k, a in enumerate(arrs)]
        if vectorized:
            return np.asarray(statistic(*picks), dtype=np.float64).reshape(b)
        return np.fromiter((statistic(*(p[r] for p in picks)) for r in range(b)),
                           dtype=np.float64, count=b)

    if not moving:  # every stratum has one item: every resample is the data itself
        return np.repeat(indexed()[:1], n_resamples)
    with warnings.catch_warnings():
        # Warnings of the statistic on degenerate resamples (NaN results) are the caller's
        # to summarise; scipy's own interval of them is not used.
        warnings.simplefilter("ignore")
        res = stats.bootstrap([np.arange(strata[k]) for k in moving],
                              lambda *idx, axis=-1: indexed(*idx), vectorized=True,
                              paired=False, n_resamples=n_resamples, batch=batch,
                              method="percentile", rng=np.random.default_rng(seed))
    return np.asarray(res.bootstrap_distribution, dtype=np.float64).reshape(n_resamples)


def percentile_interval(values: np.ndarray, level: float = 0.95) -> tuple[float, float, int]:
    """``(lo, hi, n)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's
    linear rule) of the finite ``values`` (a bootstrap distribution) and how many there are;
    ``(nan, nan, 0)`` when none is."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, 0
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(v, [tail, 1.0 - tail])
    return float(lo), float(hi), int(v.size)


def bootstrap_ci(statistic: Callable[..., float], *arrays: Sequence[Any],
                 n_resamples: int = 1000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic(*arrays)`` over items.

    The resamples are :func:`bootstrap_distribution`'s, paired: one draw of n item indices
    (``numpy.random.default_rng(seed)``) applies to every array, so paired inputs stay paired.
    The statistic gets numpy arrays. Resamples where it is NaN (e.g. a constant resample for a
    correlation) are skipped - warnings raised inside resamples are silenced and summarised
    once. Returns ``(lo, hi)`` at the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles
    (:func:`percentile_interval`); ``(nan, nan)`` with a warning when no resample gives a
    finite value.
    """
    if not arrays:
        raise ValueError("bootstrap_ci: at least one array is needed")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_ci: level must be in (0, 1), got {level}")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_ci: n_resamples must be >= 1, got {n_resamples}")
    arrs = [np.asarray(list(a) if not isinstance(a, np.ndarray) else a) for a in arrays]
    n = len(arrs[0])
    if any(len(a) != n for a in arrs):
        raise ValueError("bootstrap_ci: arrays have different lengths "
                         f"({', '.join(str(len(a)) for a in arrs)})")
    if n == 0:
        warnings.warn("bootstrap_ci: no items; returning (NaN, NaN)", RuntimeWarning,
                      stacklevel=2)
        return math.nan, math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = bootstrap_distribution(statistic, *arrs, n_resamples=n_resamples, seed=seed)
    lo, hi, kept = percentile_interval(values, level)
    if kept == 0:
        warnings.warn("bootstrap_ci: the statistic is NaN on every resample; "
                      "returning (NaN, NaN)", RuntimeWarning, stacklevel=2)
        return math.nan, math.nan
    if kept < values.size:
        warnings.warn(f"bootstrap_ci: {values.size - kept} of {values.size} resamples "
                      "gave a non-finite statistic and were skipped", RuntimeWarning,
                      stacklevel=2)
    return lo, hi


# --------------------------------------------------------------------------- probabilities


def _binary_probs(y_true: Sequence[Any], p: Sequence[float], name: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(list(y_true) if not isinstance(y_true, np.ndarray) else y_true,
                   dtype=np.float64).reshape(-1)
    q = np.asarray(list(p) if not isinstance(p, np.ndarray) else p,
                   dtype=np.float64).reshape(-1)
    if y.shape != q.shape:
        raise ValueError(f"{name}: inputs have different lengths ({y.size} and {q.size})")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError(f"{name}: y_true must be 0/1 (or bool)")
    ok = np.isfinite(q)
    return y[ok], q[ok]


def brier(y_true: Sequence[Any], p: Sequence[float]) -> float:
    """Brier score ``mean((p - y)^2)`` of probabilities ``p`` for 0/1 outcomes ``y_true``
    (items with a non-finite ``p`` dropped; NaN with a warning when none is left). A constant
    0.5 scores 0.25 on any data."""
    y, q = _binary_probs(y_true, p, "brier")
    if y.size == 0:
        return _warn_nan("brier", "no items with a finite probability")
    return float(np.mean((q - y) ** 2))


def reliability_bins(y_true: Sequence[Any], p: Sequence[float], n_bins: int = 10
                     ) -> list[dict[str, float]]:
    """The equal-width bins of a reliability diagram: ``n_bins`` bins over [0, 1] (bin b holds
    ``b / n_bins <= p < (b + 1) / n_bins``, the last one closed at 1), each ``{"lo", "hi",
    "count", "mean_p", "frac_pos"}`` (the means NaN for an empty bin)."""
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"reliability_bins: n_bins must be an int >= 1, got {n_bins!r}")
    y, q = _binary_probs(y_true, p, "reliability_bins")
    idx = np.clip(np.floor(np.clip(q, 0.0, 1.0) * n_bins).astype(np.int64), 0, n_bins - 1)
    out = []
    for b in range(n_bins):
        m = idx == b
        c = int(m.sum())
        out.append({"lo": b / n_bins, "hi": (b + 1) / n_bins, "count": c,
                    "mean_p": float(q[m].mean()) if c else math.nan,
                    "frac_pos": float(y[m].mean()) if c else math.nan})
    return out


def ece(y_true: Sequence[Any], p: Sequence[float], n_bins: int = 10) -> float:
    """Expected calibration error: ``sum_b (n_b / n) |frac_pos_b - mean_p_b|`` over the
    equal-width bins of :func:`reliability_bins` (``n_bins`` over [0, 1], empty bins add
    nothing). NaN with a warning when no item has a finite ``p``."""
    bins = reliability_bins(y_true, p, n_bins)
    n = sum(b["count"] for b in bins)
    if n == 0:
        return _warn_nan("ece", "no items with a finite probability")
    return float(sum(b["count"] / n * abs(b["frac_pos"] - b["mean_p"])
                     for b in bins if b["count"]))


def auc_resampler(pos: np.ndarray, neg: np.ndarray) -> Callable[[np.ndarray, np.ndarray],
                                                               np.ndarray]:
    """``f(pos_idx, neg_idx)``: the ROC AUC (ties count half) of the resamples of ``pos`` over
    ``neg`` that the item indices ``pos_idx`` ``(b, n_pos)`` and ``neg_idx`` ``(b, n_neg)``
    draw, shape ``(b,)``. ``pos`` / ``neg``: finite float scores ``(n_pos,)`` / ``(n_neg,)``.

    Linear per resample instead of a sort: the negatives are sorted once, each positive's
    count of negatives below (and at) it is a slot in that order, and a resample only counts
    its negatives per slot (a bincount and a cumulative sum), so ``b`` resamples cost
    ``O(b (n_pos + n_neg))``.
    """
    n1, n2 = pos.size, neg.size
    order = np.argsort(neg, kind="stable")
    slot = np.empty(n2, dtype=np.int64)
    slot[order] = np.arange(n2)
    below = np.searchsorted(neg[order], pos, side="left")  # negatives < each positive
    upto = np.searchsorted(neg[order], pos, side="right")  # negatives <= each positive

    def auc_of(pos_idx: np.ndarray, neg_idx: np.ndarray) -> np.ndarray:
        b = pos_idx.shape[0]
        # cum[r, m]: resample r's negatives in the m lowest slots.
        flat = (np.arange(b)[:, None] * (n2 + 1) + slot[neg_idx] + 1).reshape(-1)
        cum = np.bincount(flat, minlength=b * (n2 + 1)).reshape(b, n2 + 1).cumsum(axis=1)
        lt = np.take_along_axis(cum, below[pos_idx], axis=1).sum(axis=1)
        le = np.take_along_axis(cum, upto[pos_idx], axis=1).sum(axis=1)
        return (lt + le) / (2.0 * n1 * n2)

    return auc_of


def auc_stratified_ci(y_true: Sequence[Any], scores: Sequence[float], *,
                      n_resamples: int = 1000, level: float = 0.95, seed: int = 0
                      ) -> tuple[float, float, float]:
    """``(auc, lo, hi)``: ROC AUC of ``scores`` for 0/1 ``y_true`` (ties count half;
    scikit-learn's ``roc_auc_score``) with a percentile bootstrap interval that resamples each
    class on its own (:func:`bootstrap_distribution` with ``paired=False``: every resample has
    both classes and the class sizes of the data). Seeded: the same seed gives the same
    interval. Items with a non-finite score are dropped; NaN (with a warning) when a class is
    empty."""
    y, s = _binary_probs(y_true, scores, "auc_stratified_ci")
    pos, neg = s[y == 1], s[y == 0]
    if pos.size == 0 or neg.size == 0:
        v = _warn_nan("auc_stratified_ci", "only one class among items with a finite score")
        return v, v, v
    if not 0.0 < level < 1.0:
        raise ValueError(f"auc_stratified_ci: level must be in (0, 1), got {level}")
    vals = bootstrap_distribution(auc_resampler(pos, neg), np.arange(pos.size),
                                  np.arange(neg.size), paired=False, vectorized=True,
                                  n_resamples=n_resamples, seed=seed)
    lo, hi, _ = percentile_interval(vals, level)
    return float(skm.roc_auc_score(y, s)), lo, hi
