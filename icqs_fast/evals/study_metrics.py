"""The study's metrics: accuracy with intervals, ICQS distributions and distribution metrics
(MAE, cross-entropy, polar Spearman) against human label distributions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from icqs_fast.evals.study_data import FLIP, SYNTHETIC_ACCURACIES, synthetic_answers

CE_EPS = 0.01


# An ICQS score at or above this judges a response correct.
ICQS_THRESHOLD = 0.5


# --------------------------------------------------------------------------- rules and metrics


def accuracy_with_ci(correct: Sequence[float], *, n_boot: int = 1000, seed: int = 0
                     ) -> dict[str, float]:
    """Mean of per-item correctness values in [0, 1] with a percentile bootstrap 95 % interval
    over items: ``{"value", "lo", "hi", "n"}`` (NaN when there are no items)."""
    from icqs_fast.metrics import bootstrap_ci

    a = np.asarray(correct, dtype=np.float64)
    if a.size == 0:
        return {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    lo, hi = bootstrap_ci(np.mean, a, n_resamples=n_boot, seed=seed)
    return {"value": float(a.mean()), "lo": lo, "hi": hi, "n": int(a.size)}


def icqs_item_accuracy(score_per_set: Sequence[float], expected: bool,
                       threshold: float = ICQS_THRESHOLD) -> float:
    """Fraction of the L sets whose verdict (``score >= threshold`` = correct) is ``expected``."""
    v = [(s >= threshold) == expected for s in score_per_set]
    return sum(v) / len(v)


def tent(s: float | np.ndarray) -> np.ndarray:
    """``(e, n, c)`` of a score ``s`` in [0, 1]: ``e = max(0, 2s-1)``, ``c = max(0, 1-2s)``,
    ``n = 1 - e - c``; shape ``[..., 3]`` float64."""
    s = np.asarray(s, dtype=np.float64)
    if np.any((s < 0) | (s > 1)) or not np.all(np.isfinite(s)):
        raise ValueError("tent: scores must be finite and in [0, 1]")
    e = np.maximum(0.0, 2 * s - 1)
    c = np.maximum(0.0, 1 - 2 * s)
    return np.stack([e, 1 - e - c, c], axis=-1)


def icqs_distribution(score_per_set: Sequence[float]) -> np.ndarray:
    """ICQS (per set) three-way distribution: the mean of ``tent`` over the sets; ``[3]``."""
    return tent(np.asarray(score_per_set, dtype=np.float64)).mean(axis=0)


def epistemic_distribution(loglik: Any, ratios: Sequence[float]) -> np.ndarray:
    """ICQS-Epistemic three-way distribution ``sum_j q_j tent(r_j)`` with the posterior
    ``q_j = softmax_j(mean_l loglik[j, l])``.

    Args:
        loglik: ``[M+1, L]`` log-likelihoods (tensor or array).
        ratios: the ``M+1`` ratios.

    Returns:
        ``[3]`` float64 (e, n, c).
    """
    ll = np.asarray(loglik, dtype=np.float64)
    if ll.ndim != 2 or ll.shape[0] != len(ratios):
        raise ValueError(f"loglik must be [M+1={len(ratios)}, L], got shape {ll.shape}")
    m = ll.mean(axis=1)
    q = np.exp(m - m.max())
    q /= q.sum()
    return q @ tent(np.asarray(ratios, dtype=np.float64))


def mae(p: np.ndarray, h: np.ndarray) -> float:
    return float(np.abs(p - h).mean())


def ce(p: np.ndarray, h: np.ndarray, eps: float = CE_EPS) -> float:
    ps = (1 - eps) * p + eps / 3
    return float(-(h * np.log(ps)).sum(axis=1).mean())


def polar_spearman(p: np.ndarray, h: np.ndarray) -> float:
    from icqs_fast.metrics import spearman

    return spearman(p[:, 0] - p[:, 2], h[:, 0] - h[:, 2])


def distribution_metrics(pred: Any, human: Any, *, n_boot: int = 1000, seed: int = 0
                         ) -> dict[str, dict[str, float]]:
    """MAE, cross-entropy and Spearman of predicted against human distributions (rules in
    :data:`NLI_RULES`), each ``{"value", "lo", "hi"}`` with a bootstrap 95 % interval over items.

    Args:
        pred, human: ``[n, 3]`` (e, n, c) distributions.
    """
    from icqs_fast.metrics import bootstrap_ci

    p = np.asarray(pred, dtype=np.float64)
    h = np.asarray(human, dtype=np.float64)
    if p.shape != h.shape or p.ndim != 2 or p.shape[1] != 3:
        raise ValueError(f"pred and human must both be [n, 3], got {p.shape} and {h.shape}")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("pred holds negative or non-finite probabilities")
    out = {}
    for name, fn in NLI_METRICS.items():
        if len(p) == 0:
            out[name] = {"value": math.nan, "lo": math.nan, "hi": math.nan}
            continue
        lo, hi = bootstrap_ci(fn, p, h, n_resamples=n_boot, seed=seed)
        out[name] = {"value": fn(p, h), "lo": lo, "hi": hi}
    return out


def synthetic_ranking(polar: Sequence[tuple[str, str, dict]],
                      score: Callable[[Sequence[tuple[str, str]]], Sequence[float]], *,
                      accuracies: Sequence[float] = SYNTHETIC_ACCURACIES, seed: int = 0,
                      n_boot: int = 1000) -> dict[str, Any]:
    """Rank synthetic LLMs of known accuracy by their mean ICQS score.

    Args:
        polar: (sentence, gold label, vocabulary) triples the models answer.
        score: maps (x, y) responses to scores (higher = better); called once with every
            distinct answer (each sentence's right and wrong answer).
        accuracies: the models' true accuracies.

    Returns:
        ``{"spearman", "spearman_lo", "spearman_hi", "models": [{"accuracy", "mean_score"}]}``;
        the interval resamples sentences (each model keeps its answers to the drawn ones).
    """
    from icqs_fast.metrics import bootstrap_ci, spearman

    if len(accuracies) < 2:
        raise ValueError("need at least two synthetic models")
    right = [(x, v[g]) for x, g, v in polar]
    wrong = [(x, v[FLIP[g]]) for x, g, v in polar]
    s = np.asarray(list(score(right + wrong)), dtype=np.float64)
    if s.shape != (2 * len(polar),):
        raise ValueError(f"score returned {s.shape[0]} values for {2 * len(polar)} responses")
    s_right, s_wrong = s[: len(polar)], s[len(polar):]
    ans = synthetic_answers(polar, accuracies=accuracies, seed=seed)
    acc = np.asarray(accuracies, dtype=np.float64)

    def stat(sr: np.ndarray, sw: np.ndarray, *cols: np.ndarray) -> float:
        a = np.stack(cols)  # [models, n]
        means = np.where(a, sr[None, :], sw[None, :]).mean(axis=1)
        return spearman(acc, means)

    cols = [ans[m] for m in range(len(acc))]
    means = np.where(ans, s_right[None, :], s_wrong[None, :]).mean(axis=1)
    rho = spearman(acc, means)
    lo, hi = bootstrap_ci(stat, s_right, s_wrong, *cols, n_resamples=n_boot, seed=seed)
    return {"spearman": rho, "spearman_lo": lo, "spearman_hi": hi,
            "models": [{"accuracy": float(a), "mean_score": float(m)}
                       for a, m in zip(acc, means, strict=True)]}


NLI_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "mae": mae, "ce": ce, "spearman": polar_spearman}
