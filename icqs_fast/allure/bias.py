"""Judge bias statistics: position-swap consistency, length bias and agreement with human labels,
each with a seeded percentile bootstrap interval.

Pure library code (numpy, scipy, scikit-learn; no torch): give it the verdicts of a judge as a
:class:`Verdicts` and get a :class:`JudgeBias` back.

* **Position swap** (pairwise judges): every pair is judged twice, as ``(a, b)`` and as
  ``(b, a)``; the swapped verdict is mapped back to the original meaning (the swapped order's
  first option names the original second output). The *flip rate* is the share of pairs whose
  two verdicts disagree (the judge picked the same position, not the same output); the
  *first-position rate* is the share of all ``2 n`` verdicts that chose whichever output was
  shown first (0.5 for a judge without position bias). The *order-averaged* verdict
  (:func:`order_average`) sums the two orders' probabilities of each output, so it
  does not depend on the order the pair was given in.
* **Length bias**: the point-biserial correlation between the verdict (1 when it is the first /
  positive option) and a per-record length (pairwise: length of output 1 minus length of
  output 2; single responses: the response's length), the Spearman correlation of the judge's
  probability of that option with the length, the same point-biserial correlation for the human
  labels (how much of it the data itself has), and for pairs the share of verdicts for the
  longer output.
* **Agreement**: Cohen's kappa and accuracy against the human labels, and the confusion matrix
  (rows: human label, columns: verdict; scikit-learn).

Every statistic's interval resamples the records (pairs) with replacement, ``n_resamples``
times from ``numpy.random.default_rng(seed)`` (:func:`icqs_fast.metrics.bootstrap_distribution`,
paired: the same resamples for every statistic), and takes the ``(1 - level) / 2`` and
``(1 + level) / 2`` quantiles of the resampled values
(:func:`icqs_fast.metrics.percentile_interval`).
Resamples where a statistic is undefined (a constant verdict for a correlation, one label for
kappa) are left out of its interval and counted (:attr:`Interval.n_resamples`); a statistic
undefined on the data itself is NaN with a NaN interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from icqs_fast.metrics import bootstrap_distribution, percentile_interval

__all__ = ["Agreement", "Interval", "JudgeBias", "LengthBias", "SwapConsistency", "Verdicts",
           "judge_bias", "order_average"]


@dataclass(frozen=True)
class Interval:
    """A statistic with its percentile bootstrap interval.

    Attributes:
        estimate: the statistic on all records (NaN when undefined).
        lo, hi: the interval's bounds (NaN when no resample gave a value).
        level: the interval's coverage (0.95: a 95% interval).
        n_resamples: the resamples the interval is made of (those where the statistic is
            defined).
    """

    estimate: float
    lo: float
    hi: float
    level: float
    n_resamples: int

    def finite(self) -> bool:
        """Whether the estimate and both bounds are finite numbers."""
        return all(math.isfinite(v) for v in (self.estimate, self.lo, self.hi))

    def text(self, fmt: str = ".3f") -> str:
        """``0.125 [0.050, 0.225]`` (``undefined`` when the estimate is NaN)."""
        if not math.isfinite(self.estimate):
            return "undefined"
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return f"{self.estimate:{fmt}} [interval undefined]"
        return f"{self.estimate:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"


@dataclass(frozen=True)
class Verdicts:
    """A judge's verdicts on ``n`` records, the input of :func:`judge_bias`.

    Attributes:
        truth: the human label of each record (an element of ``labels``).
        verdict: the judge's label of each record (the verdict the evaluator reports).
        labels: the options, in order; ``labels[0]`` is the *first* option: for a pairwise
            judge, "the first output is better"; for others, the option the length bias and
            ``score`` refer to (e.g. the positive class).
        score: the judge's probability of ``labels[0]`` per record (None: not known).
        pairwise: whether the records are pairs of outputs (``labels`` then has two options:
            first better, second better).
        forward, forward_score: pairwise: the verdict and its probability of ``labels[0]`` with
            the pair in its given order (None: ``verdict`` / ``score`` are the given order's).
        swapped, swapped_score: pairwise: the verdict and its probability of ``labels[0]`` with
            the pair's outputs swapped, mapped back to the original meaning (``labels[0]``
            still names the original first output); None: not judged swapped.
        length: one number per record for the length bias (pairwise: length of the first
            output minus that of the second; else the response's length), or None.
        length_unit: what ``length`` counts (for reports), e.g. ``"characters"``.
    """

    truth: Sequence[str]
    verdict: Sequence[str]
    labels: Sequence[str]
    score: Sequence[float] | None = None
    pairwise: bool = False
    forward: Sequence[str] | None = None
    forward_score: Sequence[float] | None = None
    swapped: Sequence[str] | None = None
    swapped_score: Sequence[float] | None = None
    length: Sequence[float] | None = None
    length_unit: str = "characters"

    def __post_init__(self) -> None:
        n = len(self.truth)
        labels = list(self.labels)
        if len(labels) < 2 or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be at least two distinct options, got {labels}")
        if self.pairwise and len(labels) != 2:
            raise ValueError(f"a pairwise judge has two options, got {labels}")
        for name in ("verdict", "score", "forward", "forward_score", "swapped", "swapped_score",
                     "length"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"{name} has {len(v)} items, truth has {n}")
        for name in ("truth", "verdict", "forward", "swapped"):
            v = getattr(self, name)
            bad = [x for x in (v or []) if x not in labels]
            if bad:
                raise ValueError(f"{name} holds {bad[0]!r}, which is not one of {labels}")
        if (self.swapped is not None or self.swapped_score is not None) and not self.pairwise:
            raise ValueError("swapped verdicts need a pairwise judge (pairwise=True)")
        if self.swapped_score is not None and self.swapped is None:
            raise ValueError("swapped_score needs swapped")


@dataclass(frozen=True)
class Agreement:
    """Agreement of verdicts with the human labels.

    Attributes:
        kappa: Cohen's kappa (unweighted; scikit-learn's ``cohen_kappa_score``).
        accuracy: the share of verdicts equal to the human label.
        confusion: counts, ``confusion[i][j]`` = records with human label ``labels[i]`` and
            verdict ``labels[j]`` (scikit-learn's ``confusion_matrix``).
        labels: the order of the confusion matrix's rows and columns.
    """

    kappa: Interval
    accuracy: Interval
    confusion: list[list[int]]
    labels: list[str]


@dataclass(frozen=True)
class SwapConsistency:
    """Position-swap consistency of a pairwise judge.

    Attributes:
        n_pairs: pairs judged in both orders.
        flips: pairs whose two verdicts disagree (after mapping the swapped one back).
        flip_rate: ``flips / n_pairs``.
        first_position_rate: share of the ``2 n`` verdicts that chose the output shown first.
        debiased: agreement of the order-averaged verdict (:func:`order_average`; an exact tie
            counts as ``labels[0]``) with the human labels (None without both orders'
            probabilities).
        forward: agreement of the given order's verdict alone with the human labels.
    """

    n_pairs: int
    flips: int
    flip_rate: Interval
    first_position_rate: Interval
    forward: Agreement
    debiased: Agreement | None = None


@dataclass(frozen=True)
class LengthBias:
    """Correlation of the verdict with length.

    Attributes:
        what: what the length is (e.g. ``"length(output 1) - length(output 2), characters"``).
        point_biserial: point-biserial correlation of ``verdict == labels[0]`` (0/1) with the
            length (scipy ``pointbiserialr``); positive: the judge prefers ``labels[0]`` when
            it is longer.
        spearman: Spearman correlation of the judge's probability of ``labels[0]`` with the
            length (None without scores).
        human_point_biserial: the same point-biserial correlation for the human labels.
        longer_preferred_rate: pairwise: share of verdicts for the longer output, over pairs of
            unequal length (None otherwise).
    """

    what: str
    point_biserial: Interval
    spearman: Interval | None
    human_point_biserial: Interval
    longer_preferred_rate: Interval | None = None


@dataclass(frozen=True)
class JudgeBias:
    """What :func:`judge_bias` returns.

    Attributes:
        n: records.
        agreement: the reported verdicts against the human labels.
        swap: position-swap consistency (None: not a pairwise judge or not judged swapped;
            ``notes`` says which).
        length: length bias (None without lengths).
        notes: why a statistic is absent or undefined, in words.
        n_resamples, level, seed: the bootstrap's settings.
    """

    n: int
    agreement: Agreement
    swap: SwapConsistency | None
    length: LengthBias | None
    notes: list[str] = field(default_factory=list)
    n_resamples: int = 1000
    level: float = 0.95
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        """A plain dict (intervals as ``{estimate, lo, hi, level, n_resamples}``; NaN kept:
        the caller decides how to write it)."""
        return asdict(self)


def order_average(forward: Sequence[float], swapped: Sequence[float], labels: Sequence[str],
                  *, first_wins_tie: bool = True) -> tuple[str, float]:
    """The order-averaged verdict of a pair judged in both orders.

    ``forward``: the probabilities of ``(labels[0], labels[1])`` (first output better, second
    better) with the pair as given; ``swapped``: the same two with the outputs swapped, mapped
    back to the original meaning (its ``[0]`` is the swapped order's probability of
    ``labels[1]``). Each output's evidence is the sum of its two probabilities; returns ``(label,
    p)`` with the label of the output with more evidence and ``p`` the first output's share
    (the mean of the two orders' probabilities when each order's sum to 1).

    Swapping the pair exchanges the two outputs' sums, and floating-point addition is
    commutative, so the verdict names the same output in either order, exactly. An exact tie
    (e.g. a judge that goes by position only) goes to ``labels[0]`` when ``first_wins_tie``,
    else ``labels[1]``: pass a rule that follows the outputs, not their order
    (:func:`icqs_fast.allure.evaluators.order_averaged` compares the two texts), to keep ties
    order-invariant too.
    """
    e1 = float(forward[0]) + float(swapped[0])
    e2 = float(forward[1]) + float(swapped[1])
    p = e1 / (e1 + e2) if e1 + e2 > 0 else 0.5
    if e1 == e2:
        return (labels[0] if first_wins_tie else labels[1]), p
    return (labels[0] if e1 > e2 else labels[1]), p


# --------------------------------------------------------------------------- statistics


def _codes(values: Sequence[str], labels: Sequence[str]) -> np.ndarray:
    pos = {x: i for i, x in enumerate(labels)}
    return np.asarray([pos[v] for v in values], dtype=np.int64)


def _kappa_rows(t: np.ndarray, p: np.ndarray, k: int) -> np.ndarray:
    """Cohen's kappa of each row of ``t`` / ``p`` (codes ``0..k-1``, shape ``(B, n)``); NaN
    where the chance agreement is 1."""
    b, n = t.shape
    flat = (np.arange(b)[:, None] * k * k + t * k + p).reshape(-1)
    conf = np.bincount(flat, minlength=b * k * k).reshape(b, k, k).astype(np.float64)
    po = np.trace(conf, axis1=1, axis2=2) / n
    pe = (conf.sum(2) * conf.sum(1)).sum(1) / (n * n)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (po - pe) / (1.0 - pe)
    out[np.isclose(pe, 1.0)] = np.nan
    return out


def _pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row pair; NaN where a row is constant."""
    xc = x - x.mean(1, keepdims=True)
    yc = y - y.mean(1, keepdims=True)
    sxx, syy = (xc * xc).sum(1), (yc * yc).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (xc * yc).sum(1) / np.sqrt(sxx * syy)
    scale_x = np.maximum(np.abs(x).max(1), 1e-300)
    scale_y = np.maximum(np.abs(y).max(1), 1e-300)
    const = (np.sqrt(sxx) <= 1e-12 * scale_x * x.shape[1]) | \
            (np.sqrt(syy) <= 1e-12 * scale_y * y.shape[1])
    r[const] = np.nan
    return np.clip(r, -1.0, 1.0)


def _spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    from scipy.stats import rankdata

    return _pearson_rows(rankdata(x, axis=1), rankdata(y, axis=1))


@dataclass(frozen=True)
class _Bootstrap:
    """The resamples every statistic of one :func:`judge_bias` call shares (same seed, same
    record count: the same record indices)."""

    n_resamples: int
    level: float
    seed: int

    def interval(self, estimate: float, stat: Callable[..., np.ndarray],
                 *arrays: np.ndarray) -> Interval:
        """``estimate`` with the interval of ``stat`` over the resampled records: ``stat``
        takes each array's resampled rows, shape ``(b, n)``, and returns ``(b,)``."""
        values = bootstrap_distribution(stat, *arrays, vectorized=True,
                                        n_resamples=self.n_resamples, seed=self.seed)
        lo, hi, kept = percentile_interval(values, self.level)
        if not math.isfinite(estimate) or kept == 0:
            return Interval(float(estimate) if math.isfinite(estimate) else math.nan, math.nan,
                            math.nan, self.level, kept)
        return Interval(float(estimate), lo, hi, self.level, kept)


def _mean_rows(x: np.ndarray) -> np.ndarray:
    return x.mean(-1)


def _point_biserial(binary: np.ndarray, x: np.ndarray) -> float:
    from scipy.stats import pointbiserialr

    if np.all(binary == binary[0]) or np.all(x == x[0]):
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(pointbiserialr(binary, x)[0])


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if np.all(x == x[0]) or np.all(y == y[0]):
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(spearmanr(x, y)[0])


def _agreement(t: np.ndarray, p: np.ndarray, labels: list[str], boot: _Bootstrap
               ) -> Agreement:
    from sklearn.metrics import cohen_kappa_score, confusion_matrix

    k = len(labels)
    ks = list(range(k))
    if np.all(t == t[0]) and np.all(p == t[0]):
        kappa = math.nan  # chance agreement 1: undefined (sklearn would divide by zero)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kappa = float(cohen_kappa_score(t, p, labels=ks))
    conf = confusion_matrix(t, p, labels=ks).tolist()
    return Agreement(boot.interval(kappa, lambda a, b: _kappa_rows(a, b, k), t, p),
                     boot.interval(float(np.mean(t == p)), _mean_rows, t == p),
                     conf, list(labels))


def judge_bias(v: Verdicts, *, n_resamples: int = 1000, level: float = 0.95,
               seed: int = 0) -> JudgeBias:
    """Bias statistics of a judge's verdicts (see the module docstring).

    Args:
        v: the verdicts (with, for a pairwise judge, those of the swapped order).
        n_resamples: bootstrap resamples (of records / pairs, with replacement).
        level: the intervals' coverage.
        seed: seed of the resamples (the same resamples for every statistic).

    Returns:
        a :class:`JudgeBias`; statistics that do not apply are None and ``notes`` says why.

    Raises:
        ValueError: no records, inputs of different lengths or labels outside ``v.labels``,
            ``n_resamples < 1`` or ``level`` outside (0, 1).
    """
    n = len(v.truth)
    if n == 0:
        raise ValueError("judge_bias: no records")
    if n_resamples < 1:
        raise ValueError(f"judge_bias: n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"judge_bias: level must be in (0, 1), got {level}")
    labels = list(v.labels)
    boot = _Bootstrap(n_resamples, level, seed)
    t = _codes(v.truth, labels)
    p = _codes(v.verdict, labels)
    notes: list[str] = []
    agreement = _agreement(t, p, labels, boot)
    if not math.isfinite(agreement.kappa.estimate):
        notes.append("kappa undefined: the verdicts and the human labels are one and the same "
                     "single label")

    swap = None
    if not v.pairwise:
        notes.append("position swap: not a pairwise judge (no order to swap)")
    elif v.swapped is None:
        notes.append("position swap: the pairs were not judged in the swapped order")
    else:
        fwd = _codes(v.forward if v.forward is not None else v.verdict, labels)
        swp = _codes(v.swapped, labels)
        flip = (fwd != swp).astype(np.float64)
        # First position chosen: labels[0] in the given order; in the swapped order the first
        # output shown is the original second one, so a mapped-back labels[1].
        first = 0.5 * ((fwd == 0).astype(np.float64) + (swp == 1).astype(np.float64))
        debiased = None
        fs = v.forward_score if v.forward_score is not None else v.score
        if fs is not None and v.swapped_score is not None:
            avg = [order_average((a, 1.0 - a), (b, 1.0 - b), labels)[0]
                   for a, b in zip(fs, v.swapped_score,
                                                                    strict=True)]
            debiased = _agreement(t, _codes(avg, labels), labels, boot)
        swap = SwapConsistency(
            n_pairs=n, flips=int(flip.sum()),
            flip_rate=boot.interval(float(flip.mean()), _mean_rows, flip),
            first_position_rate=boot.interval(float(first.mean()), _mean_rows, first),
            forward=_agreement(t, fwd, labels, boot), debiased=debiased)

    length = None
    if v.length is None:
        notes.append("length bias: no lengths given")
    else:
        x = np.asarray(v.length, dtype=np.float64)
        chose = (p == 0).astype(np.float64)
        human = (t == 0).astype(np.float64)
        what = (f"length(output 1) - length(output 2), {v.length_unit}" if v.pairwise
                else f"response length, {v.length_unit}")
        pb = boot.interval(_point_biserial(chose, x), _pearson_rows, chose, x)
        if not math.isfinite(pb.estimate):
            notes.append(f"length bias: point-biserial undefined (every verdict is "
                         f"{v.verdict[0]!r})" if np.all(chose == chose[0])
                         else "length bias: point-biserial undefined (constant length)")
        sp = None
        if v.score is not None:
            s = np.asarray(v.score, dtype=np.float64)
            sp = boot.interval(_spearman(s, x), _spearman_rows, s, x)
        hp = boot.interval(_point_biserial(human, x), _pearson_rows, human, x)
        longer = None
        if v.pairwise:
            ok = x != 0
            if ok.any():
                # The verdict names the longer output: labels[0] when output 1 is longer.
                hit = np.where(ok, (chose == (x > 0)).astype(np.float64), np.nan)

                def longer_rate(h: np.ndarray, m: np.ndarray) -> np.ndarray:
                    # Over the resample's pairs of unequal length (NaN when it has none).
                    with np.errstate(invalid="ignore", divide="ignore"):
                        return np.where(m, h, 0.0).sum(1) / m.sum(1)

                longer = boot.interval(float(np.nanmean(hit)), longer_rate, hit, ok)
            else:
                notes.append("length bias: every pair has outputs of equal length")
        length = LengthBias(what, pb, sp, hp, longer)
    return JudgeBias(n, agreement, swap, length, notes, n_resamples, level, seed)
