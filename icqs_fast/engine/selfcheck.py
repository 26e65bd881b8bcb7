"""Self-check from the demonstration pools: how well the scorer separates good from bad answers
on the user's own task, and a calibrated probability of "good" for every score.

The good and bad pools are labelled data. :func:`crossfit_heldout` scores up to
``max_heldout`` of their members (class-balanced, seeded) as responses with the run's own
:class:`~icqs_fast.engine.scorer.ICQSScorer` (same settings, same demonstration sets, the prefix
bank it already holds), then, per held-out item, keeps only the contexts ``(j, l)`` whose
demonstration set holds no demonstration with the item's input (:func:`clean_contexts`) and
recomputes the item's score from them with the engine's own score function
(:func:`crossfit_score`): no item is judged by demonstrations that contain it. An item with a
ratio left without a clean set has no score; it is skipped and counted.

:func:`fit_self_check` turns the cross-fitted scores into a :class:`SelfCheck`: the AUC with a
stratified bootstrap interval, a monotone :class:`CalibrationMap` from score to P(good), the
Brier score and the ECE of that map's probabilities (out of fold: each fold's probabilities come
from a map fitted on the other folds; averaged over :data:`CV_REPEATS` partitions into folds),
an equal-error threshold with its expected accuracy (out of fold, averaged the same way), and a
plain "too small" verdict when either class has fewer than :data:`MIN_PER_CLASS` items.

The held-out items are drawn class-balanced, so the calibrated probability is P(good) for a
response drawn from an even mix of good and bad answers; the equal-error threshold's accuracy
does not depend on the mix (both error rates are equal there).

It also says when not to trust it: an estimate whose AUC interval holds 0.5, or whose Brier
score is no better than a constant 0.5's, carries a plain :attr:`SelfCheck.warning` with what
to try (:func:`distrust`). With a target accuracy it holds the abstain band
(:mod:`icqs_fast.engine.abstain`), and :meth:`SelfCheck.verdict` gives each record "good" /
"bad" / "abstain" (without a target: good / bad at the equal-error threshold).

Its cost follows the job: :func:`run_self_check` scores no more held-out items than the job
has records (:func:`sized_max_heldout`), and reuses the cross-fitted scores of the same pools,
settings, model and dtype from a cache (:mod:`icqs_fast.engine.selfcheck_cache`).

A :class:`SelfCheck` is JSON-able (:meth:`SelfCheck.to_dict` / :meth:`SelfCheck.from_dict`): the
map is stored as its knots (isotonic) or its two coefficients (Platt), and applied with numpy
alone, so a run's meta file can hold it and a resumed run, a Ray worker or the server can apply
it without scikit-learn.

Its declared choices (``--self-check-max``, ``--calibration-map``, ``--self-check-leak``) live
in :mod:`icqs_fast.engine.settings`, which the command line reads while building its parser;
torch, scipy and scikit-learn are imported where used, so a report or a Ray worker applies a
:class:`SelfCheck` with numpy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from icqs_fast.engine.abstain import AbstainBand, abstain_band
from icqs_fast.engine.crossfit import (  # the cross-fitting step, also exported from here
    DEFAULT_MAX_HELDOUT,
    cached_baselines,
    cached_crossfit,
    heldout_per_class,
)
from icqs_fast.engine.crossfit import (
    LEAKS as LEAKS,
)
from icqs_fast.engine.crossfit import (
    CrossFit as CrossFit,
)
from icqs_fast.engine.crossfit import (
    clean_contexts as clean_contexts,
)
from icqs_fast.engine.crossfit import (
    crossfit_heldout as crossfit_heldout,
)
from icqs_fast.engine.crossfit import (
    crossfit_items as crossfit_items,
)
from icqs_fast.engine.crossfit import (
    crossfit_score as crossfit_score,
)
from icqs_fast.engine.crossfit import (
    heldout_items as heldout_items,
)
from icqs_fast.engine.crossfit import (
    select_heldout as select_heldout,
)
from icqs_fast.engine.prompts import check_pool
from icqs_fast.engine.selfcheck_pairs import (
    instruction_heldout,
    pairwise_lines,
    pairwise_self_check,
)
from icqs_fast.engine.settings import SELF_CHECK_MAPS as METHODS
from icqs_fast.io.strict_json import finite_or_none

if TYPE_CHECKING:
    from icqs_fast.engine.scorer import ICQSScorer

# The per-record field of the calibrated probability, beside the raw score. Named like
# ICQSResult.p_good / loglik_calibrated: the same quantity, passed through the fitted map.
FIELD = "p_good_calibrated"
# Below this many usable held-out items in either class, no estimate is given (the AUC interval
# is wider than +-0.15 at AUC 0.75, and a calibration map from fewer points is mostly noise).
MIN_PER_CLASS = 20
# Platt scaling below this many items per class, isotonic regression from it on: isotonic
# regression overfits small samples (Niculescu-Mizil & Caruana 2005 found it worse than Platt
# below roughly a thousand points in all; its steps follow each point's noise).
ISOTONIC_MIN_PER_CLASS = 100
ECE_BINS = 10
# The Brier score of a constant 0.5 on the even mix of held-out items: what a calibrated
# probability must beat to say anything.
BRIER_CONSTANT = 0.25
N_BOOT = 1000
LEVEL = 0.95
CV_FOLDS = 5
# Stratified partitions into CV_FOLDS folds whose out-of-fold accuracy, Brier and ECE are
# averaged. One partition's figures move with where its fold boundaries fall, on top of the
# sampling noise of ~64 items; averaging partitions removes that part (repeated k-fold
# cross-validation). Bias study (docs/DECISIONS.md, "Self-check folds and repeats"): mean
# |expected - test accuracy| 0.053 with one partition, 0.049 with 20 (first 18 runs; 0.046 on
# 12 later ones); the rest is the held-out items' own sampling error, which no resampling
# removes.
CV_REPEATS = 20
VERSION = 1


# --------------------------------------------------------------------------- the map


def _platt_targets(y: np.ndarray) -> np.ndarray:
    """Platt's (1999) smoothed targets: ``(n+ + 1) / (n+ + 2)`` for a positive,
    ``1 / (n- + 2)`` for a negative, so that a separable sample does not give a step."""
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    return np.where(y == 1, (n_pos + 1) / (n_pos + 2), 1.0 / (n_neg + 2))


@dataclass(frozen=True)
class CalibrationMap:
    """A non-decreasing map from a score to P(good).

    ``method="platt"``: ``sigmoid(a * score + b)`` (``a >= 0``; a fit that came out decreasing
    is replaced by the constant base rate: the score then says nothing usable). ``"isotonic"``:
    the piecewise-linear interpolation of the knots ``(x, y)``, clipped to the end values outside
    them (scikit-learn's ``IsotonicRegression(out_of_bounds="clip")`` prediction).
    """

    method: str
    a: float = 0.0
    b: float = 0.0
    x: tuple[float, ...] = ()
    y: tuple[float, ...] = ()

    @classmethod
    def fit(cls, scores: Sequence[float], labels: Sequence[int], method: str = "platt"
            ) -> CalibrationMap:
        """Fit on finite ``scores`` ``[n]`` with 0/1 ``labels`` ``[n]`` (both classes needed),
        against Platt's smoothed targets (:func:`_platt_targets`; for the isotonic fit too, so
        that its end steps are not exactly 0 or 1)."""
        s = np.asarray(scores, dtype=np.float64).reshape(-1)
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        if s.shape != y.shape or not np.all(np.isfinite(s)):
            raise ValueError("CalibrationMap.fit: scores must be finite and as many as labels")
        if not (y == 1).any() or not (y == 0).any():
            raise ValueError("CalibrationMap.fit: both classes are needed")
        t = _platt_targets(y)
        if method == "isotonic":
            from sklearn.isotonic import IsotonicRegression

            iso = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True,
                                     out_of_bounds="clip").fit(s, t)
            return cls("isotonic", x=tuple(float(v) for v in iso.X_thresholds_),
                       y=tuple(float(v) for v in iso.y_thresholds_))
        if method != "platt":
            raise ValueError(f"method must be 'platt' or 'isotonic', got {method!r}")
        from sklearn.linear_model import LogisticRegression

        mu, sd = float(s.mean()), float(s.std())
        if sd == 0.0:  # a constant score: only the base rate can be said
            return cls("platt", a=0.0, b=float(np.log(t.mean() / (1.0 - t.mean()))))
        z = (s - mu) / sd
        # Soft targets as two weighted copies of each point: the exact likelihood of Platt's
        # fit; C large = (nearly) no regularisation, as Platt's method has none.
        lr = LogisticRegression(C=1e6, max_iter=1000).fit(
            np.concatenate([z, z])[:, None], np.concatenate([np.ones_like(z), np.zeros_like(z)]),
            sample_weight=np.concatenate([t, 1.0 - t]))
        coef, icpt = float(lr.coef_[0, 0]), float(lr.intercept_[0])
        if coef <= 0.0:
            return cls("platt", a=0.0, b=float(np.log(t.mean() / (1.0 - t.mean()))))
        return cls("platt", a=coef / sd, b=icpt - coef * mu / sd)

    def apply(self, score: Any) -> Any:
        """P(good) of ``score``: a float for a scalar, a float64 array for an array-like (NaN
        where the score is NaN)."""
        s = np.asarray(score, dtype=np.float64)
        if self.method == "platt":
            with np.errstate(over="ignore"):
                p = 1.0 / (1.0 + np.exp(-(self.a * s + self.b)))
        else:
            p = np.interp(s, np.asarray(self.x), np.asarray(self.y))
            p = np.where(np.isnan(s), np.nan, p)
        return float(p) if p.ndim == 0 else p

    def to_dict(self) -> dict[str, Any]:
        if self.method == "platt":
            return {"method": "platt", "a": self.a, "b": self.b}
        return {"method": "isotonic", "x": list(self.x), "y": list(self.y)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationMap:
        if d.get("method") == "platt":
            return cls("platt", a=float(d["a"]), b=float(d["b"]))
        if d.get("method") == "isotonic":
            x, y = tuple(float(v) for v in d["x"]), tuple(float(v) for v in d["y"])
            if not x or len(x) != len(y) or np.any(np.diff(x) < 0) or np.any(np.diff(y) < 0):
                raise ValueError("calibration map: the isotonic knots must be non-empty, as "
                                 "many x as y, both non-decreasing")
            return cls("isotonic", x=x, y=y)
        raise ValueError(f"calibration map: unknown method {d.get('method')!r}")


def choose_method(method: str, n_per_class: int) -> str:
    """``"auto"`` -> Platt below :data:`ISOTONIC_MIN_PER_CLASS` items per class, else isotonic."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "isotonic" if n_per_class >= ISOTONIC_MIN_PER_CLASS else "platt"


# --------------------------------------------------------------------------- thresholds


def equal_error_threshold(scores: Sequence[float], labels: Sequence[int]) -> float:
    """The threshold ``t`` ("good when score >= t") whose false-negative and false-positive
    rates are closest (ties: the lowest total error, then the lowest ``t``), midway between
    two observed scores."""
    from sklearn.metrics import roc_curve

    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    if not ((y == 1).any() and (y == 0).any()):
        return math.nan  # one class only: no rates to balance
    # roc_curve's thresholds are the distinct scores (descending, after a leading +inf): "score
    # >= u_i" is "score >= the midpoint below u_i", so each rate pair belongs to one candidate.
    fpr, tpr, thr = roc_curve(y == 1, s, drop_intermediate=False)
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    # As whole counts scaled to a common denominator (P N), so equal rates tie exactly.
    fp = np.rint(fpr[1:][::-1] * n_neg).astype(np.int64) * n_pos  # ascending scores
    fn = np.rint((1.0 - tpr[1:][::-1]) * n_pos).astype(np.int64) * n_neg
    u = thr[1:][::-1]
    cand = np.concatenate([u[:1], (u[1:] + u[:-1]) / 2])
    # Closest rates, then the lowest total error, then the lowest t.
    best = np.lexsort((cand, fn + fp, np.abs(fn - fp)))[0]
    return float(cand[best])


def precision_threshold(scores: Sequence[float], labels: Sequence[int], target: float
                        ) -> tuple[float, float, float]:
    """``(t, precision, recall)``: among the thresholds whose precision (good among those with
    score >= t, at the sample's class mix) reaches ``target``, the one with the highest recall
    (ties: the lowest t); NaNs when none does."""
    from sklearn.metrics import precision_recall_curve

    if not 0.0 < target <= 1.0:
        raise ValueError(f"target precision must be in (0, 1], got {target!r}")
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    if not (y == 1).any():
        return math.nan, math.nan, math.nan  # no good item: precision 0 at every threshold
    # One sort: precision and recall of "score >= u" for every distinct score u, ascending,
    # then sklearn's end point (precision 1, recall 0: no threshold), dropped. "score >= u_i"
    # is "score >= the midpoint below u_i", the threshold reported.
    prec, rec, u = precision_recall_curve(y == 1, s)
    prec, rec = prec[:-1], rec[:-1]
    ok = np.flatnonzero(prec >= target)
    if ok.size == 0:
        return math.nan, math.nan, math.nan
    i = ok[np.argmax(rec[ok])]  # the first maximum: recall falls as t rises, so the lowest t
    t = u[0] if i == 0 else (u[i] + u[i - 1]) / 2
    return float(t), float(prec[i]), float(rec[i])


# --------------------------------------------------------------------------- trust


ADVICE = ("try a larger --model, more or cleaner pool items (--good / --bad), or more "
          "demonstrations per set (--demos-per-set)")


# The opening words of every "do not trust" warning (a page giving them as its own heading
# strips them from the warning: :func:`warning_reason`).
DISTRUST = "do not trust these scores on this task"


def warning_reason(warning: str) -> str:
    """A :func:`distrust` warning without its opening :data:`DISTRUST` words (the reason and
    the advice), for a page or table that says those words itself."""
    rest = warning[len(DISTRUST):] if warning.startswith(DISTRUST) else warning
    return rest.lstrip(":; ").strip()


def distrust(auc_lo: float, auc_hi: float, brier: float, brier_constant: float) -> str:
    """Why the self-check's scores should not be trusted on this task, in plain words with what
    to try (:data:`ADVICE`); "" when nothing says so. Untrusted: the AUC interval holds 0.5 (or
    lies below it), or the calibrated probability's Brier score is no better than a
    constant's."""
    why = []
    if auc_lo <= 0.5:
        why.append(f"its AUC interval [{auc_lo:.3f}, {auc_hi:.3f}] "
                   f"{'holds' if auc_hi >= 0.5 else 'lies below'} 0.5, chance")
    if brier >= brier_constant:
        why.append(f"its Brier score {brier:.3f} is no better than a constant 0.5's "
                   f"({brier_constant:.3f})")
    if not why:
        return ""
    return (f"{DISTRUST}: the scorer does not separate the held-out "
            f"good and bad demonstrations: {'; '.join(why)}; {ADVICE}")


# --------------------------------------------------------------------------- the result

# The self-check's fields a scoring response carries (:meth:`SelfCheck.summary_dict`).
SUMMARY_FIELDS = ("status", "message", "auc", "auc_lo", "auc_hi", "level", "warning",
                  "baselines", "length_matched", "beaten", "pairwise")


@dataclass
class SelfCheck:
    """What the pools say about the scorer on this task (see the module docstring).

    Attributes:
        status: "ok" (estimates below), "too_small" (fewer than :data:`MIN_PER_CLASS` usable
            items in a class: no estimate) or "off" (not run).
        message: one plain line for the log / summary.
        n_good, n_bad: held-out items used (with a score); n_skipped: held out but skipped (a
            ratio had no set without the item).
        needed_per_class: the usable items per class an estimate needs (``MIN_PER_CLASS``).
        auc, auc_lo, auc_hi: ROC AUC of the cross-fitted scores and its bootstrap interval
            (``level``, ``n_boot`` stratified resamples, ``seed``).
        brier, ece: of the calibrated probabilities, out of fold (``folds`` stratified folds,
            each fold's probabilities from a map fitted on the others), averaged over
            ``cv_repeats`` partitions (:data:`CV_REPEATS`); ECE over ``ece_bins`` equal-width
            bins of [0, 1], weighted by count. A constant 0.5 has Brier 0.25.
        calibration: the map fitted on every usable item (None unless "ok").
        threshold: the equal-error threshold on the raw score; p_at_threshold its calibrated
            probability; expected_accuracy: the accuracy of "good when score >= threshold",
            out of fold (the threshold fitted on the other folds), averaged over the same
            partitions.
        target_precision, precision_threshold, precision, recall: the threshold for a target
            precision when one was asked (at an even class mix), with what it reached.
        reliability: the first partition's out-of-fold probabilities' reliability bins
            (:func:`icqs_fast.metrics.reliability_bins`), for the diagram; score_range: the
            lowest and highest cross-fitted score.
        config: the self-check's own options (max_heldout, seed, method, leak, n_boot, level,
            folds, cv_repeats), for a resumed run to check it would compute the same.
        warning: "" or, when the estimate says the scorer does not separate this task (AUC
            interval holding 0.5, Brier no better than a constant), that in plain words with
            what to try (:func:`distrust`).
        target_accuracy, band: the accuracy asked for (``--target-accuracy``) and its
            :class:`AbstainBand` (None without a target or an estimate).
        pairwise: the pairwise self-check over held-out pairs (whole instructions held
            out; :func:`icqs_fast.engine.selfcheck_pairs.pairwise_self_check`), None when
            not asked or when the held-out items make no pair.
    """

    status: str
    message: str
    n_good: int = 0
    n_bad: int = 0
    n_skipped: int = 0
    needed_per_class: int = MIN_PER_CLASS
    auc: float = math.nan
    auc_lo: float = math.nan
    auc_hi: float = math.nan
    level: float = LEVEL
    brier: float = math.nan
    brier_constant: float = BRIER_CONSTANT
    ece: float = math.nan
    ece_bins: int = ECE_BINS
    calibration: CalibrationMap | None = None
    threshold: float = math.nan
    p_at_threshold: float = math.nan
    expected_accuracy: float = math.nan
    target_precision: float | None = None
    precision_threshold: float = math.nan
    precision: float = math.nan
    recall: float = math.nan
    reliability: list[dict[str, float]] = field(default_factory=list)
    score_range: tuple[float, float] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    warning: str = ""
    target_accuracy: float | None = None
    band: AbstainBand | None = None
    baselines: list[dict[str, Any]] = field(default_factory=list)
    length_matched: dict[str, Any] | None = None
    beaten: str = ""
    pairwise: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def trusted(self) -> bool:
        """An estimate that does not say the scorer fails on this task (:attr:`warning`)."""
        return self.ok and not self.warning

    def apply(self, score: Any) -> Any:
        """P(good) of a score (float) or of an array of scores (float64 array); NaN without an
        estimate."""
        if self.calibration is None:
            s = np.asarray(score, dtype=np.float64)
            out = np.full(s.shape, np.nan)
            return float(out) if out.ndim == 0 else out
        return self.calibration.apply(score)

    def verdict(self, score: float) -> str | None:
        """The per-record verdict of ``score``: with an abstain band its verdict ("good",
        "bad", "abstain"); else "good" at or above the equal-error threshold, "bad" below;
        None without an estimate (or, without a band, for a NaN score)."""
        if not self.ok:
            return None
        if self.band is not None:
            return self.band.verdict(score)
        if not math.isfinite(score) or not math.isfinite(self.threshold):
            return None
        return "good" if score >= self.threshold else "bad"

    def record_value(self, score: float) -> float | None:
        """The per-record :data:`FIELD` value: the calibrated probability, None (JSON null)
        when there is no estimate or the score is NaN."""
        p = self.apply(float(score))
        return None if not math.isfinite(p) else p

    @classmethod
    def off(cls, reason: str = "turned off (--no-self-check)") -> SelfCheck:
        """A self-check that did not run."""
        return cls(status="off", message=f"self-check: {reason}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (NaN as None)."""
        def num(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        d = {k: num(getattr(self, k)) for k in (
            "status", "message", "n_good", "n_bad", "n_skipped", "needed_per_class", "auc",
            "auc_lo", "auc_hi", "level", "brier", "brier_constant", "ece", "ece_bins",
            "threshold", "p_at_threshold", "expected_accuracy", "target_precision",
            "precision_threshold", "precision", "recall", "warning", "target_accuracy",
            "beaten")}
        d["baselines"] = [{k: num(v) for k, v in b.items()} for b in self.baselines]
        d["length_matched"] = (None if self.length_matched is None else
                               {k: num(v) for k, v in self.length_matched.items()})
        d["band"] = None if self.band is None else self.band.to_dict()
        d["pairwise"] = finite_or_none(self.pairwise)
        d["calibration"] = None if self.calibration is None else self.calibration.to_dict()
        d["reliability"] = [{k: num(v) for k, v in b.items()} for b in self.reliability]
        d["score_range"] = None if self.score_range is None else list(self.score_range)
        d["config"] = dict(self.config)
        d["version"] = VERSION
        return d

    def summary_dict(self) -> dict[str, Any]:
        """What a response that carries the self-check gives (``/v1/score``): the
        :data:`SUMMARY_FIELDS` of :meth:`to_dict` - ICQS's AUC and interval beside the
        baselines', the warnings."""
        d = self.to_dict()
        return {k: d[k] for k in SUMMARY_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelfCheck:
        """Inverse of :meth:`to_dict` (ValueError naming what is wrong)."""
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"self-check: expected a dict with version {VERSION}")
        if d.get("status") not in ("ok", "too_small", "off"):
            raise ValueError(f"self-check: unknown status {d.get('status')!r}")
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            if f.name in d and f.name not in ("calibration", "config", "reliability",
                                               "score_range", "band", "pairwise"):
                v = d[f.name]
                kw[f.name] = math.nan if v is None and f.type == "float" else v
        cal = d.get("calibration")
        rng = d.get("score_range")
        bins = [{k: math.nan if v is None else v for k, v in b.items()}
                for b in d.get("reliability") or []]
        band = d.get("band")
        kw["warning"] = kw.get("warning") or ""
        kw["pairwise"] = d.get("pairwise")  # absent: written before the pairwise self-check
        kw["beaten"] = kw.get("beaten") or ""  # absent: written before the baselines
        kw["baselines"] = [{k: math.nan if v is None else v for k, v in b.items()}
                           for b in kw.get("baselines") or []]
        if "warning" not in d and d["status"] == "ok":  # written before the warning existed
            kw["warning"] = distrust(*(math.nan if d.get(k) is None else float(d[k])
                                       for k in ("auc_lo", "auc_hi", "brier")), BRIER_CONSTANT)
        return cls(**kw, calibration=None if cal is None else CalibrationMap.from_dict(cal),
                   band=None if band is None else AbstainBand.from_dict(band),
                   reliability=bins, score_range=None if rng is None else (rng[0], rng[1]),
                   config=dict(d.get("config") or {}))

    def lines(self) -> list[str]:
        """The summary: the message, then the warning, the abstain band and the precision
        target when there are."""
        if not self.ok:
            return [self.message]
        out = [self.message]
        if self.baselines:
            out.append(f"self-check: {self.baselines_text()}")
        if self.beaten:
            out.append(f"self-check WARNING: {self.beaten}")
        if self.warning:
            out.append(f"self-check WARNING: {self.warning}")
        if self.band is not None:
            out.append(f"self-check: {self.band.text()}")
        if self.target_precision is not None:
            out.append(f"self-check: {self.precision_text()}")
        out += [f"self-check: {line}" for line in pairwise_lines(self.pairwise)]
        return out

    def baselines_text(self) -> str:
        """The baselines' AUCs beside ICQS's in one line ("" without baselines)."""
        if not self.baselines:
            return ""
        def iv(d: dict[str, Any]) -> str:
            return f"{_fmt(d['auc'])} [{_fmt(d['auc_lo'])}, {_fmt(d['auc_hi'])}]"

        text = ("baselines on the same held-out items (AUC, direction fitted out of fold): "
                + ", ".join(f"{b['name']} {iv(b)}" for b in self.baselines)
                + f"; ICQS {iv(self.__dict__)}")
        if self.length_matched is not None:
            lm = self.length_matched
            word = "stratum" if lm["strata"] == 1 else "strata"
            text += f", within {lm['strata']} length {word} {iv(lm)}"
        return text

    def precision_text(self) -> str:
        """The precision target's threshold in one line ("" without a target)."""
        if self.target_precision is None:
            return ""
        if math.isnan(self.precision_threshold):
            return (f"no threshold reaches precision {self.target_precision:g} on the held-out "
                    "items")
        return (f"precision >= {self.target_precision:g}: score >= "
                f"{self.precision_threshold:.4f} (held-out precision {self.precision:.2f}, "
                f"recall {self.recall:.2f})")


def _fmt(v: Any) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.3f}"


def auc_sample_size(auc: float = 0.75, half_width: float = 0.1, level: float = LEVEL) -> int:
    """Items per class for an AUC interval of about ``+-half_width`` at ``auc`` (Hanley &
    McNeil 1982 variance, equal class sizes, normal approximation)."""
    a = min(max(auc, 0.5), 0.99)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    z = float(np.sqrt(2) * _erfinv(level))
    for n in range(2, 100000):
        var = (a * (1 - a) + (n - 1) * (q1 - a * a) + (n - 1) * (q2 - a * a)) / (n * n)
        if z * math.sqrt(var) <= half_width:
            return n
    return 100000


def _erfinv(level: float) -> float:
    from scipy.special import erfinv

    return float(erfinv(level))


def _out_of_fold(scores: np.ndarray, labels: np.ndarray, method: str, folds: int, seed: int,
                 repeats: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per partition (``repeats`` stratified partitions into ``folds`` folds, the ``r``-th
    shuffled with ``seed + r``) the out-of-fold ``(p, correct)``: each fold's calibrated
    probabilities and its "score >= equal-error threshold" verdicts' correctness, from a map
    and a threshold fitted on the other folds."""
    from sklearn.model_selection import StratifiedKFold

    k = min(folds, int((labels == 1).sum()), int((labels == 0).sum()))
    out = []
    for r in range(repeats):
        p = np.full(scores.shape, np.nan)
        correct = np.zeros(scores.shape, dtype=bool)
        for tr, te in StratifiedKFold(n_splits=k, shuffle=True, random_state=seed + r).split(
                scores, labels):
            cmap = CalibrationMap.fit(scores[tr], labels[tr], method)
            p[te] = cmap.apply(scores[te])
            t = equal_error_threshold(scores[tr], labels[tr])
            correct[te] = (scores[te] >= t) == (labels[te] == 1)
        out.append((p, correct))
    return out


def fit_self_check(scores: Sequence[float], labels: Sequence[int], *, n_skipped: int = 0,
                   method: str = "auto", seed: int = 0, n_boot: int = N_BOOT,
                   level: float = LEVEL, folds: int = CV_FOLDS, n_bins: int = ECE_BINS,
                   cv_repeats: int = CV_REPEATS,
                   target_precision: float | None = None,
                   target_accuracy: float | None = None,
                   config: dict[str, Any] | None = None,
                   baseline_values: Sequence[dict[str, float]] | None = None,
                   pair_items: Sequence[Any] | None = None,
                   tie_margin: float = 0.0) -> SelfCheck:
    """The :class:`SelfCheck` of cross-fitted ``scores`` ``[n]`` (NaN: a skipped item, counted
    with ``n_skipped``) and their 0/1 ``labels`` ``[n]`` (1 = good pool).

    ``baseline_values``: per item, the values of the trivial scorers
    (:func:`icqs_fast.engine.selfcheck_baselines.item_values`); their AUCs on the same items,
    folds and intervals, ICQS's length-matched AUC and the sentence when one beats ICQS go
    into :attr:`SelfCheck.baselines`, ``length_matched`` and ``beaten``.

    ``pair_items``: the ``(x, y)`` of each item (aligned with ``scores``): also the pairwise
    self-check over the good / bad items of one instruction (:attr:`SelfCheck.pairwise`,
    :func:`icqs_fast.engine.selfcheck_pairs.pairwise_self_check`, ties within
    ``tie_margin``).

    Everything is seeded by ``seed`` (bootstrap, folds), so the same input gives the same
    result. Fewer than :data:`MIN_PER_CLASS` usable items in a class gives ``status
    "too_small"`` and no estimate. ``target_accuracy``: also the :class:`AbstainBand` for it
    (:func:`abstain_band`). An estimate that says the scorer does not separate the task gets
    a :attr:`SelfCheck.warning` (:func:`distrust`).
    """
    from icqs_fast import metrics

    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"fit_self_check: {s.size} scores for {y.size} labels")
    whole = (s, y, baseline_values)  # the pairwise part pairs items before any is dropped
    ok = np.isfinite(s)
    n_skipped += int((~ok).sum())
    s, y = s[ok], y[ok]
    values = ([v for v, keep in zip(baseline_values, ok, strict=True) if keep]
              if baseline_values is not None else None)
    n_good, n_bad = int((y == 1).sum()), int((y == 0).sum())
    cfg = {"method": method, "seed": seed, "n_boot": n_boot, "level": level, "folds": folds,
           "cv_repeats": cv_repeats, **(config or {})}
    if target_accuracy is not None and not 0.0 < target_accuracy <= 1.0:
        raise ValueError(f"target accuracy must be in (0, 1], got {target_accuracy!r}")
    common = dict(n_good=n_good, n_bad=n_bad, n_skipped=n_skipped, level=level,
                  ece_bins=n_bins, target_precision=target_precision,
                  target_accuracy=target_accuracy, config=cfg)
    skipped = (f"; {n_skipped} skipped: every set of some ratio held them" if n_skipped
               else "")
    if min(n_good, n_bad) < MIN_PER_CLASS:
        return SelfCheck(
            status="too_small", message=(
                f"self-check: pools too small for an estimate: {n_good} good and {n_bad} bad "
                f"held-out demonstrations{skipped}; it needs at least {MIN_PER_CLASS} of each "
                f"(about {auc_sample_size()} of each for an AUC interval of +-0.1)"),
            **common)
    used = choose_method(method, min(n_good, n_bad))
    auc, lo, hi = metrics.auc_stratified_ci(y, s, n_resamples=n_boot, level=level, seed=seed)
    parts = _out_of_fold(s, y, used, folds, seed, cv_repeats)
    p_oof = parts[0][0]  # the reliability diagram's: one real partition's probabilities
    cmap = CalibrationMap.fit(s, y, used)
    t = equal_error_threshold(s, y)
    br = float(np.mean([metrics.brier(y, p) for p, _ in parts]))
    ec = float(np.mean([metrics.ece(y, p, n_bins) for p, _ in parts]))
    acc = float(np.mean([c.mean() for _, c in parts]))
    pt, prec, rec = (precision_threshold(s, y, target_precision) if target_precision
                     else (math.nan, math.nan, math.nan))
    msg = (f"self-check ({n_good} good + {n_bad} bad held-out demonstrations{skipped}): AUC "
           f"{auc:.3f} [{lo:.3f}, {hi:.3f}], Brier {br:.3f} (constant 0.5: 0.250), ECE "
           f"{ec:.3f}; threshold score >= {t:.4f} (equal error, P(good) "
           f"{cmap.apply(t):.2f}), expected accuracy {acc:.2f}; {FIELD} by {used} map")
    band = (abstain_band(s, y, target_accuracy, folds=folds, seed=seed, n_boot=n_boot,
                         level=level) if target_accuracy is not None else None)
    base: list[dict[str, Any]] = []
    matched = None
    if values:
        from icqs_fast.engine.selfcheck_baselines import (
            baseline_aucs,
            beaten_by,
            length_matched_auc,
        )

        base = baseline_aucs(values, y, folds=folds, seed=seed, n_boot=n_boot, level=level)
        matched = length_matched_auc(s, y, np.array([v["length_tokens"] for v in values]),
                                     n_boot=n_boot, level=level, seed=seed)
    pairwise = None
    if pair_items is not None:
        pairwise = pairwise_self_check(*whole[:2], pair_items, whole[2],
                                       tie_margin=tie_margin, target_accuracy=target_accuracy,
                                       folds=folds, seed=seed, n_boot=n_boot, level=level)
    return SelfCheck(status="ok", message=msg, auc=auc, auc_lo=lo, auc_hi=hi, brier=br,
                     baselines=base, length_matched=matched,
                     beaten=beaten_by(base, auc, lo, hi) if base else "", pairwise=pairwise,
                     warning=distrust(lo, hi, br, BRIER_CONSTANT), band=band,
                     ece=ec, calibration=cmap, threshold=t, p_at_threshold=cmap.apply(t),
                     expected_accuracy=acc, precision_threshold=pt, precision=prec,
                     recall=rec, reliability=metrics.reliability_bins(y, p_oof, n_bins),
                     score_range=(float(s.min()), float(s.max())),
                     **{**common, "config": {**cfg, "method_used": used}})


def too_small_without_scoring(n_good: int, n_bad: int, max_heldout: int) -> bool:
    """Whether the pools cannot give :data:`MIN_PER_CLASS` held-out items per class whatever
    the scores (the self-check is then skipped before scoring anything)."""
    return heldout_per_class(n_good, n_bad, max_heldout) < MIN_PER_CLASS


def sized_max_heldout(max_heldout: int, job_records: int | None) -> int:
    """The held-out items a job's self-check may score: ``max_heldout``, and no more than the
    job's own record count when that is known (each held-out item costs about what a record
    does, 0.92x measured; so a self-check never costs more than scoring the job itself: a
    30-record job's self-check scores at most 30 items, too few for an estimate, and is
    skipped at no cost; ``check`` alone, with no job, is not capped)."""
    if job_records is None:
        return max_heldout
    return min(max_heldout, max(0, int(job_records)))


def run_self_check(scorer: ICQSScorer | None, good: Sequence, bad: Sequence, *,
                   max_heldout: int = DEFAULT_MAX_HELDOUT, seed: int = 0,
                   method: str = "auto", leak: str = "input",
                   target_precision: float | None = None,
                   target_accuracy: float | None = None, n_boot: int = N_BOOT,
                   job_records: int | None = None, cache: Any = None,
                   progress: Callable[[Iterable, int], Iterable] | None = None,
                   baselines: bool = True, pairwise: bool = False,
                   tie_margin: float = 0.0) -> SelfCheck:
    """Cross-fit the held-out pool members (:func:`crossfit_heldout`) and fit the
    :class:`SelfCheck` (:func:`fit_self_check`). Pools that cannot give :data:`MIN_PER_CLASS`
    items per class are not scored at all ("too_small" at no cost); ``max_heldout=0`` gives
    "off".

    Args:
        scorer: None only where nothing is scored (pools too small, or ``max_heldout=0``).
        job_records: the job's record count when known: at most that many held-out items
            (:func:`sized_max_heldout`).
        cache: an :class:`icqs_fast.io.cache.JsonCache` (None: none): the cross-fitted scores
            of the same pools, scorer (settings, model, dtype) and held-out options are read
            from it instead of scored, and stored there when scored; fitting the map, the
            intervals and the band (seconds) is always done again, so a new target or map
            method reuses them too. ``config["cache"]`` says "hit" or "stored".
        baselines: also score the held-out items with the trivial scorers
            (:mod:`icqs_fast.engine.selfcheck_baselines`: lengths, log-probs with no
            demonstrations) and compare them with ICQS.
        pairwise: hold out whole instructions (each with its good and bad answers:
            :func:`icqs_fast.engine.selfcheck_pairs.instruction_heldout`) and add the
            pairwise self-check over them (:attr:`SelfCheck.pairwise`; ties within
            ``tie_margin``); pools with no instruction answered in both keep the usual draw
            and have none (``config["draw"]`` says which).
    """
    if max_heldout == 0:
        return SelfCheck.off("turned off (--self-check-max 0)")
    choose_method(method, 0)  # a bad method fails before any scoring
    n_good, n_bad = len(check_pool(good, "good")), len(check_pool(bad, "bad"))
    asked, max_heldout = max_heldout, sized_max_heldout(max_heldout, job_records)
    cfg: dict[str, Any] = {"max_heldout": max_heldout, "leak": leak}
    if max_heldout < asked:
        cfg["sized_by_job"] = {"asked": asked, "job_records": job_records}
    if too_small_without_scoring(n_good, n_bad, max_heldout):
        if min(n_good, n_bad) < MIN_PER_CLASS:
            why = f"the pools hold {n_good} good and {n_bad} bad demonstrations"
        elif max_heldout < asked:
            why = (f"the job has {job_records} records and a self-check scores no more "
                   f"held-out items than that (it would cost more than the job); run "
                   f"'icqs-fast check' for an estimate of its own")
        else:
            why = f"--self-check-max {max_heldout} allows {max_heldout // 2} per class"
        return SelfCheck(
            status="too_small", config={"method": method, "seed": seed, **cfg},
            target_precision=target_precision, target_accuracy=target_accuracy,
            message=(f"self-check skipped: {why}; an estimate needs at least {MIN_PER_CLASS} "
                     f"held-out demonstrations of each class (about {auc_sample_size()} of "
                     "each for an AUC interval of +-0.1)"))
    drawn = None
    if pairwise:
        drawn = instruction_heldout(good, bad, max_heldout, seed)
        cfg["draw"] = "instructions" if drawn is not None else "items (no instruction has " \
            "answers in both pools)"
    items, scores, labels, reused, free = cached_crossfit(
        scorer, good, bad, max_heldout=max_heldout, seed=seed, leak=leak, cache=cache,
        progress=progress, config=cfg, drawn=drawn)
    values = ([{**v, **f} for v, f in zip(
        cached_baselines(scorer, good, bad, items, leak=leak, cache=cache), free, strict=True)]
              if baselines else None)
    check = fit_self_check(scores, labels, method=method, seed=seed, n_boot=n_boot,
                           target_precision=target_precision,
                           target_accuracy=target_accuracy, config=cfg,
                           baseline_values=values,
                           pair_items=items if drawn is not None else None,
                           tie_margin=tie_margin)
    if reused == len(labels):
        check.message += " (held-out scores reused from the cache)"
    elif reused:
        check.message += f" ({reused} of {len(labels)} held-out scores reused from the cache)"
    return check
