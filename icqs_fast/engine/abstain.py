"""The abstain band: the scores to send to a person so that the verdicts on the rest reach a
target accuracy, from the self-check's cross-fitted held-out scores
(:mod:`icqs_fast.engine.selfcheck`).

Verdicts: "bad" below ``lo``, "abstain" in ``[lo, hi)``, "good" from ``hi`` on. Among all bands
(every pair of cuts between distinct held-out scores, counted at once from prefix sums:
O(k^2) for k distinct scores, k <= the held-out items), :func:`fit_band` takes the one whose
outside reaches the target with the largest coverage. :func:`abstain_band` measures that rule
out of fold - each fold judged by a band fitted on the other folds, so the fitted band's own
optimism is not reported - with seeded percentile bootstrap intervals
(:func:`icqs_fast.metrics.bootstrap_distribution`, ``scipy.stats.bootstrap`` underneath).

scipy and scikit-learn are imported where used (see selfcheck's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MIN_COVERED", "AbstainBand", "abstain_band", "band_verdicts", "coverage_curve",
           "fit_band"]


def _cut_values(u: np.ndarray) -> np.ndarray:
    """``[k+1]`` cut points of ``k`` sorted distinct scores ``u``: -inf, the midpoints, +inf
    (cut ``i`` has the ``i`` lowest scores below it)."""
    return np.concatenate([[-np.inf], (u[1:] + u[:-1]) / 2, [np.inf]])


def _band_counts(scores: np.ndarray, labels: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every band at once: ``(cuts [k+1], a [P], b [P], covered [P], correct [P])`` over the
    ``P`` pairs of cuts ``a <= b`` ("bad" below cut ``a``, "good" from cut ``b`` on, abstain
    between), from prefix counts of each class over the sorted distinct scores (O(k^2) numpy,
    k <= the held-out items)."""
    u, inv = np.unique(scores, return_inverse=True)
    k = u.size
    n0 = np.bincount(inv[labels == 0], minlength=k)
    n1 = np.bincount(inv[labels == 1], minlength=k)
    c0 = np.concatenate([[0], np.cumsum(n0)])  # [k+1]: bad-pool items below each cut
    c1 = np.concatenate([[0], np.cumsum(n1)])
    a, b = np.triu_indices(k + 1)
    covered = c0[a] + c1[a] + (c0[-1] - c0[b]) + (c1[-1] - c1[b])
    correct = c0[a] + (c1[-1] - c1[b])
    return _cut_values(u), a, b, covered, correct


def fit_band(scores: Sequence[float], labels: Sequence[int], target: float
             ) -> tuple[float, float] | None:
    """``(lo, hi)``: the band of scores to abstain on (``lo <= score < hi``; "bad" below
    ``lo``, "good" from ``hi`` on) whose outside reaches accuracy ``target`` on
    ``scores`` ``[n]`` / 0/1 ``labels`` ``[n]`` with the largest coverage (ties: the higher
    accuracy); ``lo = -inf`` says nothing is "bad", ``hi = +inf`` nothing "good"; ``lo == hi``:
    no abstention. None when no band with any coverage reaches ``target``."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    cuts, a, b, covered, correct = _band_counts(s, y)
    ok = (covered > 0) & (correct >= target * covered - 1e-9)
    if not ok.any():
        return None
    # Largest coverage, then most correct; lexsort's last key is the primary one.
    i = np.flatnonzero(ok)[np.lexsort((-correct[ok], -covered[ok]))[0]]
    return float(cuts[a[i]]), float(cuts[b[i]])


def band_verdicts(scores: Any, lo: float, hi: float) -> np.ndarray:
    """``[n]`` str: "bad" below ``lo``, "good" at or above ``hi``, "abstain" between or for a
    NaN score."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    return np.where(s < lo, "bad", np.where(s >= hi, "good", "abstain"))


def coverage_curve(scores: Sequence[float], labels: Sequence[int], max_points: int = 64
                   ) -> list[tuple[float, float]]:
    """The best accuracy outside a band at each coverage, ``[(coverage, accuracy), ...]`` by
    rising coverage (accuracy at coverage >= c: non-increasing), at most ``max_points`` points;
    on the given items (in sample)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    n = s.size
    if n == 0:
        return []
    _, _, _, covered, correct = _band_counts(s, y)
    best = np.full(n + 1, -1.0)
    np.maximum.at(best, covered, correct.astype(np.float64))
    m = np.arange(n + 1)
    acc = np.where((best >= 0) & (m > 0), best / np.maximum(m, 1), -1.0)
    acc = np.maximum.accumulate(acc[::-1])[::-1]  # accuracy reachable at coverage >= m
    keep = np.unique(np.linspace(1, n, min(max_points, n)).round().astype(int))
    return [(float(k / n), float(acc[k])) for k in keep if acc[k] >= 0]


@dataclass(frozen=True)
class AbstainBand:
    """The band of scores to send to a person so that the rest reaches a target accuracy.

    Attributes:
        target: the accuracy asked for (``--target-accuracy``).
        lo, hi: "bad" below ``lo``, "abstain" in ``[lo, hi)``, "good" from ``hi`` on (fitted on
            every held-out item; ``-inf`` / ``+inf``: no "bad" / "good" side). Without a band
            reaching the target (``reached`` False) every score is "abstain".
        coverage, coverage_lo, coverage_hi: the share of items outside the band, out of fold
            (each fold's verdicts from a band fitted on the other folds), with its bootstrap
            interval (``level``, seeded).
        accuracy, accuracy_lo, accuracy_hi: the accuracy of the verdicts outside the band, out
            of fold, with its interval (NaN when too few items were outside it).
        curve: the in-sample ``(coverage, best accuracy)`` curve (:func:`coverage_curve`).
        aim: the in-sample accuracy the band was fitted for: the lowest, from ``target`` up,
            whose bands reach ``target`` out of fold (see :func:`abstain_band`).
    """

    target: float
    lo: float
    hi: float
    reached: bool
    coverage: float = math.nan
    coverage_lo: float = math.nan
    coverage_hi: float = math.nan
    accuracy: float = math.nan
    accuracy_lo: float = math.nan
    accuracy_hi: float = math.nan
    level: float = math.nan
    curve: tuple[tuple[float, float], ...] = ()
    aim: float = math.nan

    def verdict(self, score: float) -> str:
        """"good", "bad" or "abstain" of one score (NaN: "abstain")."""
        return str(band_verdicts([score], self.lo, self.hi)[0])

    def text(self) -> str:
        """One plain line for the log / summary."""
        if not self.reached:
            return (f"abstain band: no band of scores reaches accuracy {self.target:g} on the "
                    "held-out items; every record is 'abstain'")

        lo, hi = math.isfinite(self.lo), math.isfinite(self.hi)
        if lo and hi and self.lo == self.hi:
            rule = f"bad when score < {self.lo:.4f}, good from it (no abstention)"
        elif lo and hi:
            rule = (f"bad when score < {self.lo:.4f}, good when score >= {self.hi:.4f}, "
                    "abstain between")
        elif hi:
            rule = f"good when score >= {self.hi:.4f}, abstain below (no 'bad' verdict)"
        else:
            rule = f"bad when score < {self.lo:.4f}, abstain above (no 'good' verdict)"
        acc = ("n/a" if math.isnan(self.accuracy) else
               f"{self.accuracy:.2f} [{_fmt(self.accuracy_lo)}, {_fmt(self.accuracy_hi)}]")
        short = ("" if math.isnan(self.accuracy) or self.accuracy >= self.target else
                 f"; out of fold it reaches only {self.accuracy:.2f}, under the target: do not "
                 "rely on it")
        return (f"abstain band for accuracy {self.target:g}: {rule}; coverage "
                f"{self.coverage:.2f} [{_fmt(self.coverage_lo)}, {_fmt(self.coverage_hi)}], "
                f"accuracy outside the band {acc} (held-out items, out of fold, "
                f"{self.level:.0%} bootstrap intervals){short}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: non-finite numbers as None (``lo`` None: -inf, ``hi`` None: +inf)."""
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        d: dict[str, Any] = {k: num(getattr(self, k)) for k in (
            "target", "lo", "hi", "coverage", "coverage_lo", "coverage_hi", "accuracy",
            "accuracy_lo", "accuracy_hi", "level", "aim")}
        d["reached"] = self.reached
        d["curve"] = [list(p) for p in self.curve]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbstainBand:
        def num(k: str, none: float = math.nan) -> float:
            v = d.get(k)
            return none if v is None else float(v)

        return cls(target=num("target"), lo=num("lo", -math.inf), hi=num("hi", math.inf),
                   reached=bool(d.get("reached")), coverage=num("coverage"),
                   coverage_lo=num("coverage_lo"), coverage_hi=num("coverage_hi"),
                   accuracy=num("accuracy"), accuracy_lo=num("accuracy_lo"),
                   accuracy_hi=num("accuracy_hi"), level=num("level"), aim=num("aim"),
                   curve=tuple((float(c), float(a)) for c, a in d.get("curve") or ()))


def _fmt(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:.2f}"


# Fewer covered out-of-fold verdicts than this: no accuracy interval (a bootstrap of a handful
# of verdicts says little, and resamples with none covered have no accuracy at all).
MIN_COVERED = 10



def lowest_aim(target: float, out_of_fold: Callable[[float], tuple[np.ndarray, np.ndarray]]
               ) -> tuple[float, np.ndarray, np.ndarray]:
    """``(aim, covered, correct)``: the lowest in-sample accuracy ``aim`` (``target`` up by 0.01)
    whose per-fold bands (``out_of_fold(aim)``, ``[n]`` bool) reach ``target``; else ``target``."""
    aim, (covered, correct) = target, out_of_fold(target)
    for a in np.arange(target, 1.0 + 1e-9, 0.01):
        cov_a, cor_a = out_of_fold(float(a)) if a > target else (covered, correct)
        if cov_a.any() and cor_a.sum() >= target * cov_a.sum() - 1e-9:
            return float(min(a, 1.0)), cov_a, cor_a
    return aim, covered, correct


def band_intervals(covered: np.ndarray, correct: np.ndarray, *, n_boot: int, seed: int,
                   level: float) -> tuple[float, float, float, float]:
    """Percentile bootstrap intervals of a band's coverage and of its accuracy on what it
    covers, resampling the items (``covered``, ``correct``: ``[n]`` bool, out of fold):
    ``(coverage_lo, coverage_hi, accuracy_lo, accuracy_hi)``; the accuracy's are NaN with
    fewer than :data:`MIN_COVERED` items covered."""
    from icqs_fast import metrics  # scipy: only once a band is fitted

    def ci(stat: Callable[..., Any]) -> tuple[float, float]:
        vals = metrics.bootstrap_distribution(stat, covered.astype(float),
                                              correct.astype(float), vectorized=True,
                                              n_resamples=n_boot, seed=seed)
        lo, hi, _ = metrics.percentile_interval(vals, level)
        return lo, hi

    def coverage_stat(c: np.ndarray, _: np.ndarray) -> np.ndarray:
        return c.mean(axis=-1)

    def accuracy_stat(c: np.ndarray, r: np.ndarray) -> np.ndarray:
        den = c.sum(axis=-1)
        # A resample with nothing covered (only possible far below MIN_COVERED) has no
        # accuracy: NaN, left out of the percentiles.
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, r.sum(axis=-1) / den, np.nan)

    c_lo, c_hi = ci(coverage_stat)
    enough = int(covered.sum()) >= MIN_COVERED
    a_lo, a_hi = ci(accuracy_stat) if enough else (math.nan, math.nan)
    return c_lo, c_hi, a_lo, a_hi


def abstain_band(scores: Sequence[float], labels: Sequence[int], target: float, *,
                 folds: int, seed: int, n_boot: int, level: float) -> AbstainBand:
    """The :class:`AbstainBand` of cross-fitted ``scores`` ``[n]`` (finite) with 0/1
    ``labels`` ``[n]`` for accuracy ``target`` in (0, 1].

    The band is fitted on every item (:func:`fit_band`) for the lowest in-sample accuracy
    (``aim``, from ``target`` up in steps of 0.01) whose bands reach ``target`` out of fold,
    since a band fitted to just reach the target reads under it on new items. Its coverage
    and accuracy are measured out of fold - the items of each of ``folds`` stratified folds
    judged by a band fitted on the others - so they are not the fitted band's own optimism,
    and their intervals are
    percentile bootstraps of those out-of-fold verdicts
    (:func:`icqs_fast.metrics.bootstrap_distribution`, paired over items, ``n_boot``
    resamples, seeded by ``seed``).
    """
    from sklearn.model_selection import StratifiedKFold


    if not 0.0 < target <= 1.0:
        raise ValueError(f"target accuracy must be in (0, 1], got {target!r}")
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if s.shape != y.shape or not np.all(np.isfinite(s)):
        raise ValueError("abstain_band: scores must be finite and as many as labels")
    curve = tuple(coverage_curve(s, y))
    if fit_band(s, y, target) is None:
        return AbstainBand(target, -math.inf, math.inf, False, coverage=0.0, level=level,
                           curve=curve)
    k = min(folds, int((y == 1).sum()), int((y == 0).sum()))
    splits = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(s, y))

    def out_of_fold(aim: float) -> tuple[np.ndarray, np.ndarray]:
        """``(covered, correct)`` ``[n]`` bool: each fold's verdicts from the band fitted on
        the other folds for in-sample accuracy ``aim``."""
        covered = np.zeros(s.shape, dtype=bool)
        correct = np.zeros(s.shape, dtype=bool)
        for tr, te in splits:
            b = fit_band(s[tr], y[tr], aim)
            v = band_verdicts(s[te], *(b if b is not None else (-math.inf, math.inf)))
            covered[te] = v != "abstain"
            correct[te] = ((v == "good") & (y[te] == 1)) | ((v == "bad") & (y[te] == 0))
        return covered, correct

    # A band fitted to reach exactly the target on the items it is fitted on reads about 0.03
    # under it on new ones (its edges follow those items' noise). So the band is fitted for the
    # lowest in-sample accuracy ("aim", from the target up in steps of 0.01) whose bands reach
    # the target out of fold; none does: the target itself, and the shortfall is reported.
    aim, covered, correct = lowest_aim(target, out_of_fold)
    band = fit_band(s, y, aim)
    if band is None:  # (cannot happen: aim is reached out of fold, so in sample on all)
        band = (-math.inf, math.inf)
    cov, n_cov = float(covered.mean()), int(covered.sum())
    acc = float(correct.sum() / n_cov) if n_cov else math.nan
    c_lo, c_hi, a_lo, a_hi = band_intervals(covered, correct, n_boot=n_boot, seed=seed,
                                            level=level)
    return AbstainBand(target, band[0], band[1], True, coverage=cov, coverage_lo=c_lo,
                       coverage_hi=c_hi, accuracy=acc, accuracy_lo=a_lo, accuracy_hi=a_hi,
                       level=level, curve=curve, aim=aim)
