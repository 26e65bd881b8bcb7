"""One settings object for ICQS scoring: :class:`ScoringSettings`.

Both :class:`icqs_fast.engine.scorer.ICQSScorer` and the independent reference
:func:`icqs_fast.engine.reference.icqs_naive` take it (or the same keywords, which build it), so
the two cannot be given different demonstration sets by accident. Its :meth:`fingerprint` is a
JSON-able dict of every option that changes a result (a resume fingerprint for jobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from icqs_fast.engine.prompts import Template

DEFAULT_TOKEN_BUDGET = 16384

# Options that change an ICQS result (demonstration sets, prompt text, truncation).
RESULT_FIELDS = ("num_ratios", "demos_per_set", "sets_per_ratio", "seed", "mixing", "replacement",
                 "stratify", "strata_order", "template", "max_length", "drop_oldest_demos",
                 "calibration", "content_free", "pmi_premise", "score", "tie_epsilon")
# Engine-only options: how the engine computes, not what (the reference ignores them).
ENGINE_FIELDS = ("backend", "token_budget", "cascade", "deterministic")
TEMPLATE_FIELDS = ("demo", "query", "response", "separator", "system")
CALIBRATIONS = ("none", "content_free", "pmi")
SCORE_KINDS = ("argmax", "tied", "mean")
# Ratios whose log-likelihood lies within this many nats of the best count as tied in the
# "tied" score (tie-aware argmax), and the noise level of the near_ties diagnostic. From the
# measured rounding noise (docs/RESULTS.md, "Scores across dtypes and backends"): the p99 of the
# fp32 -> bf16 change of the gap between two ratios' log-likelihoods, embedded model, default
# settings, was 0.13 (SST-2) and 0.16 (FPB) nats.
TIE_EPSILON = 0.15
# The default score: the posterior mean, the only kind that met the stability goal (>= 99 % of
# records within 0.01 between fp32 and bf16: 100 % on FPB and SST-2, max change 0.007, against
# 83-87 % for the argmax and 78-87 % for the tied score) with no AUC loss (docs/RESULTS.md).
DEFAULT_SCORE = "mean"
# Content-free inputs of contextual calibration (Zhao et al. 2021 average "N/A", "" and
# "[MASK]"); each is put in the template's query in place of x.
DEFAULT_CONTENT_FREE = ("N/A", "", "[MASK]")


def _int_at_least(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _strata_tuple(v: Any) -> Any:
    """``stratify`` as a hashable value: None, "auto", "y", a tuple of str, or a pair of such."""
    if v is None or (isinstance(v, str) and v in ("auto", "y")):
        return v
    if isinstance(v, str) or not isinstance(v, Sequence):
        raise ValueError(f"stratify must be 'auto', 'y', None, a sequence of str or a pair of "
                         f"such sequences, got {v!r}")
    items = list(v)
    if len(items) == 2 and all(not isinstance(s, str) and isinstance(s, Sequence)
                               for s in items):
        return tuple(tuple(s) for s in items)
    # The strata themselves are checked by build_demo_sets (naming the bad one).
    return tuple(items)


@dataclass(frozen=True)
class ScoringSettings:
    """Every option of an ICQS run. Frozen and validated on construction (ValueError / TypeError
    naming the field).

    Result options (see :func:`icqs_fast.engine.prompts.build_demo_sets` and
    :class:`icqs_fast.engine.scorer.ICQSScorer`): ``num_ratios`` (``M+1 >= 2``),
    ``demos_per_set`` (``N >= 1``), ``sets_per_ratio`` (``L >= 1``), ``seed``, ``mixing``
    ("exact" / "bernoulli"), ``replacement``, ``stratify`` ("auto", "y", None, or explicit
    strata, kept as tuples), ``strata_order`` ("fixed" / "shuffled"), ``template`` (a
    :class:`Template`; None gives the default one), ``max_length`` (None: the model's),
    ``drop_oldest_demos``.

    Calibration and the score (:mod:`icqs_fast.engine.calibration`): ``calibration`` "none"
    (the paper's ``log P(y | demos, x)``), "content_free" (contextual calibration, Zhao et al.
    2021: minus the mean over ``content_free`` inputs x_cf of ``log P(y | demos, x_cf)``, each
    x_cf in the template's query) or "pmi" (domain-conditional PMI, Holtzman et al. 2021: minus
    ``log P(y | demos, premise)``, the premise replacing the whole query; ``pmi_premise`` None =
    the template's query text after ``{x}`` without leading whitespace, e.g. "Answer:");
    ``score`` "mean" (the default: the posterior mean ``sum_j q_j r_j``, stable across dtypes
    and backends), "argmax" (the paper's ratio of the most likely context) or "tied" (tie-aware
    argmax: the mean ratio of the contexts within ``tie_epsilon`` nats of the most likely one,
    so a rounding difference between two near-equal ratios cannot flip the score).

    Engine-only options (no effect on the reference, not in :meth:`fingerprint`): ``backend``,
    ``token_budget``, ``cascade``, ``deterministic`` (batch-invariant mode: each response runs in
    forwards whose shapes depend on that response alone, so its numbers are bit-identical
    whatever else is scored with it; see :class:`icqs_fast.engine.scorer.ICQSScorer`).
    """

    num_ratios: int = 5
    demos_per_set: int = 8
    sets_per_ratio: int = 4
    seed: int = 0
    mixing: str = "exact"
    replacement: bool = False
    stratify: Any = "auto"
    strata_order: str = "fixed"
    template: Template = field(default_factory=Template)
    max_length: int | None = None
    drop_oldest_demos: bool = False
    calibration: str = "none"
    content_free: tuple[str, ...] = DEFAULT_CONTENT_FREE
    pmi_premise: str | None = None
    score: str = DEFAULT_SCORE
    tie_epsilon: float = TIE_EPSILON
    # -- engine-only
    backend: str = "auto"
    token_budget: int = DEFAULT_TOKEN_BUDGET
    cascade: bool | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        _int_at_least("num_ratios", self.num_ratios, 2)
        _int_at_least("demos_per_set", self.demos_per_set, 1)
        _int_at_least("sets_per_ratio", self.sets_per_ratio, 1)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.mixing not in ("exact", "bernoulli"):
            raise ValueError(f"mixing must be 'exact' or 'bernoulli', got {self.mixing!r}")
        for name in ("replacement", "drop_oldest_demos", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "stratify", _strata_tuple(self.stratify))
        if self.strata_order not in ("fixed", "shuffled"):
            raise ValueError(f"strata_order must be 'fixed' or 'shuffled', got "
                             f"{self.strata_order!r}")
        if self.template is None:
            object.__setattr__(self, "template", Template())
        elif not isinstance(self.template, Template):
            raise TypeError(f"template must be a Template or None, got "
                            f"{type(self.template).__name__}")
        if self.max_length is not None:
            _int_at_least("max_length", self.max_length, 1)
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got "
                             f"{self.calibration!r}")
        if self.score not in SCORE_KINDS:
            raise ValueError(f"score must be one of {SCORE_KINDS}, got {self.score!r}")
        te = self.tie_epsilon
        if isinstance(te, bool) or not isinstance(te, (int, float)) or not te >= 0 \
                or te == float("inf"):
            raise ValueError(f"tie_epsilon must be a finite float >= 0 (nats), got {te!r}")
        object.__setattr__(self, "tie_epsilon", float(te))
        cf = self.content_free
        if isinstance(cf, str) or not isinstance(cf, Sequence) or not cf \
                or not all(isinstance(t, str) for t in cf):
            raise ValueError(f"content_free must be a non-empty sequence of str, got {cf!r}")
        object.__setattr__(self, "content_free", tuple(cf))
        if self.pmi_premise is not None and not isinstance(self.pmi_premise, str):
            raise ValueError(f"pmi_premise must be None or a str, got {self.pmi_premise!r}")
        if not isinstance(self.backend, str):
            raise ValueError(f"backend must be a str, got {self.backend!r}")
        _int_at_least("token_budget", self.token_budget, 1)
        if self.cascade is not None and not isinstance(self.cascade, bool):
            raise ValueError(f"cascade must be None or a bool, got {self.cascade!r}")

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def build(cls, settings: ScoringSettings | None = None, **options: Any) -> ScoringSettings:
        """``settings`` (the defaults if None) with ``options`` (field names) replacing its
        fields; TypeError naming an unknown option."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown scoring option(s) {unknown}; the options are "
                            f"{sorted(names)}")
        if settings is None:
            return cls(**options)
        if not isinstance(settings, cls):
            raise TypeError(f"settings must be a ScoringSettings or None, got "
                            f"{type(settings).__name__}")
        return dataclasses.replace(settings, **options) if options else settings

    def replace(self, **options: Any) -> ScoringSettings:
        """A copy with ``options`` changed (validated again)."""
        return ScoringSettings.build(self, **options)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScoringSettings:
        """Inverse of :meth:`asdict` / :meth:`fingerprint` (a missing field takes its default;
        ``template`` may be a dict of its fields)."""
        d = dict(d)
        if isinstance(d.get("template"), Mapping):
            d["template"] = Template(**d["template"])
        return cls.build(**d)

    # -- reading -----------------------------------------------------------------------------
    def demo_set_options(self) -> dict[str, Any]:
        """The keywords of :func:`icqs_fast.engine.prompts.build_demo_sets`."""
        return {k: getattr(self, k) for k in ("num_ratios", "demos_per_set", "sets_per_ratio",
                                              "seed", "mixing", "replacement", "stratify",
                                              "strata_order")}

    def _json_value(self, name: str) -> Any:
        v = getattr(self, name)
        if name == "template":
            return {k: getattr(v, k) for k in TEMPLATE_FIELDS}
        if name == "stratify" and isinstance(v, tuple):
            return [list(s) if isinstance(s, tuple) else s for s in v]
        if name == "content_free":
            return list(v)
        return v

    def fingerprint(self) -> dict[str, Any]:
        """Every option that changes a result, as a JSON-able dict (the template as a dict of
        its fields, explicit strata as lists), in a fixed key order: two settings give the same
        fingerprint exactly when they give the same results. ``tie_epsilon`` is in it only for
        ``score="tied"`` (the only score it changes; outputs of other scores written before it
        existed still resume)."""
        return {k: self._json_value(k) for k in RESULT_FIELDS
                if k != "tie_epsilon" or self.score == "tied"}

    def engine_options(self) -> dict[str, Any]:
        """The engine-only options (JSON-able)."""
        return {k: getattr(self, k) for k in ENGINE_FIELDS}

    def premise(self) -> str:
        """The domain premise of ``calibration="pmi"``: ``pmi_premise``, or the template's
        query text after ``{x}`` without its leading whitespace ("Answer:" for the default
        template)."""
        if self.pmi_premise is not None:
            return self.pmi_premise
        return self.template.query.split("{x}", 1)[1].lstrip()

    def asdict(self) -> dict[str, Any]:
        """Every field as a JSON-able dict: :meth:`fingerprint` then :meth:`engine_options`."""
        return {**self.fingerprint(), **self.engine_options()}
