"""One settings object for ICQS scoring: :class:`ScoringSettings`.

Both :class:`icqs_fast.engine.scorer.ICQSScorer` and the independent reference
:func:`icqs_fast.engine.reference.icqs_naive` take it (or the same keywords, which build it), so
the two cannot be given different demonstration sets by accident. Its :meth:`fingerprint` is a
JSON-able dict of every option that changes a result (a resume fingerprint for jobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from icqs_fast.engine.prompts import Template
from icqs_fast.options import check_declared, declared, option

DEFAULT_TOKEN_BUDGET = 16384
# The largest --token-budget: rows x tokens of one forward. At 2^22 tokens and up to 256 query
# heads the attention grid (rows x heads x query blocks <= tokens x heads) stays within CUDA's
# 2^31 - 1 programs on grid x (kernels/attention_entropy.py folds rows x heads there).
MAX_TOKEN_BUDGET = 1 << 22

TEMPLATE_FIELDS = ("demo", "query", "response", "separator", "system")
CALIBRATIONS = ("none", "content_free", "pmi")
SCORE_KINDS = ("argmax", "tied", "mean")
MIXINGS = ("exact", "bernoulli")
STRATA_ORDERS = ("fixed", "shuffled")
# Ratios whose log-likelihood lies within this many nats of the best count as tied in the
# "tied" score (tie-aware argmax), and the noise level of the near_ties diagnostic. From the
# measured rounding noise (docs/DECISIONS.md, "Tie epsilon"): the p99 of the
# fp32 -> bf16 change of the gap between two ratios' log-likelihoods, embedded model, default
# settings, was 0.13 (SST-2) and 0.16 (FPB) nats.
TIE_EPSILON = 0.15
# The default score: the posterior mean, the only kind that met the stability goal (>= 99 % of
# records within 0.01 between fp32 and bf16: 100 % on FPB and SST-2, max change 0.007, against
# 83-87 % for the argmax and 78-87 % for the tied score) with no AUC loss (docs/DECISIONS.md,
# "Score kind").
DEFAULT_SCORE = "mean"
# Content-free inputs of contextual calibration (Zhao et al. 2021 average "N/A", "" and
# "[MASK]"); each is put in the template's query in place of x.
DEFAULT_CONTENT_FREE = ("N/A", "", "[MASK]")

# The self-check's declared choices (icqs_fast.engine.selfcheck / crossfit), here so that the job
# config and the command line read them without loading the numerical modules.
# Held-out items scored by default (class-balanced: at most half from each pool). Each costs what
# one record costs (it is scored as a response against the same prefix bank: 0.92x a record,
# measured); 256 cost 2.4 % of a 10,000-record job (docs/DECISIONS.md, "Self-check size",
# bench/selfcheck_cost.py), under the 5 % asked of it with room for longer pool items.
DEFAULT_MAX_HELDOUT = 256
SELF_CHECK_LEAKS = ("input", "pair")
SELF_CHECK_MAPS = ("auto", "platt", "isotonic")


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
    """Every option of an ICQS run, each declared once (:func:`icqs_fast.options.option`: its
    flag, default, help, bounds, and whether it changes a result). Frozen and validated on
    construction (ValueError / TypeError naming the option's flag, else its field).

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

    num_ratios: int = option(5, ge=2, request=True, help="M+1: the ratios j/M of good "
                             "demonstrations, j = 0..M")
    demos_per_set: int = option(8, ge=1, request=True, help="N: demonstrations per set")
    sets_per_ratio: int = option(4, ge=1, request=True, help="L: demonstration sets per ratio")
    seed: int = option(0, request=True, help="seed of the demonstration sets")
    mixing: str = option("exact", choices=MIXINGS, help="good demonstrations per set: exact "
                         "(round(r N)) or bernoulli (each one good with probability r)")
    replacement: bool = option(False, help="draw demonstrations with replacement (small pools)")
    # The engine's value ("auto", "y", None or explicit strata); a job gives --stratify-field,
    # a field of the demonstration files, which the command resolves into this.
    stratify: Any = option("auto", kind="any", flag=False, help="label-balanced demonstration "
                           "sets: 'auto', 'y', None or explicit strata")
    strata_order: str = option("fixed", choices=STRATA_ORDERS, help="with --stratify-field: "
                               "fixed puts the same stratum at each position of every set (the "
                               "last demonstration's label included); shuffled does not")
    template: Template = option(kind="any", flag=False, default_factory=Template,
                                help="the prompt template (None: the default one)")
    max_length: int | None = option(None, kind="int", ge=1, help="prompt length limit in "
                                    "tokens (none: the model's)")
    drop_oldest_demos: bool = option(False, help="drop a set's oldest demonstrations when a "
                                     "prompt is too long")
    calibration: str = option("none", choices=CALIBRATIONS, flag="--calibrate", request=True,
                              help="calibrate the ICQS log-likelihoods: content_free = minus "
                              "log P(y | demos, content-free input) (Zhao et al. 2021), pmi = "
                              "minus log P(y | demos, domain premise) (Holtzman et al. 2021)")
    content_free: tuple[str, ...] = option(
        DEFAULT_CONTENT_FREE, metavar="TEXT", help="a content-free input of --calibrate "
        "content_free, put in the template's query in place of x; repeat for several "
        "(averaged). For free-text answers each input adds one row per context and response")
    pmi_premise: str | None = option(None, kind="str", metavar="TEXT", help="the domain "
                                     "premise of --calibrate pmi, replacing the whole query "
                                     "(none: the template's query text after {x}, e.g. "
                                     "'Answer:')")
    score: str = option(DEFAULT_SCORE, choices=SCORE_KINDS, request=True, help="ICQS score: "
                        "the posterior mean of the ratio (mean: stable across dtypes and "
                        "backends), the ratio of the most likely context (argmax, the paper's), "
                        "or the mean ratio of the contexts within --tie-epsilon nats of it "
                        "(tied)")
    tie_epsilon: float = option(TIE_EPSILON, ge=0, unit="nats", metavar="NATS", request=True,
                                help="--score tied: contexts within this many nats of the most "
                                "likely one count as tied (from the measured fp32/bf16 noise); "
                                "also the noise level of the near_ties diagnostic")
    # -- engine-only
    backend: str = option("auto", result=False, help="the engine's backend: auto, "
                          "torch, cpp, triton")
    token_budget: int = option(DEFAULT_TOKEN_BUDGET, ge=1, le=MAX_TOKEN_BUDGET, result=False,
                               help="max rows x tokens per forward")
    cascade: bool | None = option(None, kind="bool", result=False, flag=False,
                                  help="cascade attention (None: the model's plan decides)")
    deterministic: bool = option(False, result=False, help="batch-invariant mode (one "
                                 "response per forward; slower)")

    def __post_init__(self) -> None:
        if self.template is None:
            object.__setattr__(self, "template", Template())
        check_declared(self)
        object.__setattr__(self, "stratify", _strata_tuple(self.stratify))
        if not isinstance(self.template, Template):
            raise TypeError(f"template must be a Template or None, got "
                            f"{type(self.template).__name__}")

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def build(cls, settings: ScoringSettings | Mapping[str, Any] | None = None,
              **options: Any) -> ScoringSettings:
        """``settings`` (the defaults if None; a Mapping: a :meth:`fingerprint` /
        :meth:`asdict` read back, ``template`` as a dict of its fields) with ``options``
        (field names) replacing its fields; TypeError naming an unknown option."""
        if isinstance(settings, Mapping):
            options, settings = {**settings, **options}, None
        if isinstance(options.get("template"), Mapping):
            options["template"] = Template(**options["template"])
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
        return cls.build(d)

    # -- reading -----------------------------------------------------------------------------
    def demo_set_options(self) -> dict[str, Any]:
        """The keywords of :func:`icqs_fast.engine.prompts.build_demo_sets`."""
        return {k: getattr(self, k) for k in ("num_ratios", "demos_per_set", "sets_per_ratio",
                                              "seed", "mixing", "replacement", "stratify",
                                              "strata_order")}

    @staticmethod
    def json_value(name: str, value: Any) -> Any:
        """The option ``name``'s ``value`` as the fingerprint holds it (JSON-able: the template
        as a dict of its fields, tuples as lists)."""
        if name == "template":
            return {k: getattr(value, k) for k in TEMPLATE_FIELDS}
        if name == "stratify" and isinstance(value, (tuple, list)):
            return [list(s) if isinstance(s, (tuple, list)) else s for s in value]
        if isinstance(value, tuple):
            return list(value)
        return value

    def fingerprint(self) -> dict[str, Any]:
        """Every option that changes a result (declared ``result=True``), as a JSON-able dict
        (the template as a dict of its fields, explicit strata as lists), in field order: two
        settings give the same fingerprint exactly when they give the same results. This is
        the resume fingerprint of a ``score`` job (with the record fields, see
        :meth:`icqs_fast.jobs.config.ScoreJobConfig.resume_key`). ``tie_epsilon`` is in it
        only for ``score="tied"``, the only score it changes."""
        return {d.name: self.json_value(d.name, getattr(self, d.name)) for d in declared(self)
                if d.option.result and (d.name != "tie_epsilon" or self.score == "tied")}

    def engine_options(self) -> dict[str, Any]:
        """The engine-only options (declared ``result=False``), JSON-able."""
        return {d.name: getattr(self, d.name) for d in declared(self) if not d.option.result}

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


# The result options (in the fingerprint) and the engine-only ones, read from the declarations.
RESULT_FIELDS = tuple(d.name for d in declared(ScoringSettings) if d.option.result)
ENGINE_FIELDS = tuple(d.name for d in declared(ScoringSettings) if not d.option.result)
