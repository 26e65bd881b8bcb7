"""ICQS / ICQS-Epistemic scoring engine with a prefix-sharing batcher.

For every response (x, y) and every demonstration set (ratio j, set l),
``l_{j,l} = log P(y | demos_{j,l}, x)``; ICQS on set l is ``r_k``, ``k = argmax_j l_{j,l}``, and
ICQS-Epistemic is ``r_k`` with ``k = argmax_j mean_l l_{j,l}``.

The engine computes the KV caches of the ``(M+1) L`` demonstration prefixes once, then runs the
rest of many (response, context) prompts in padded forwards against them, and applies the LM
head only at the response positions, through :func:`icqs_fast.ops.linear_token_stats` (no
``[T, V]`` logits tensor).

Token ids are those of the whole prompt text (prefix + query + response as one string, BOS as
the tokenizer adds it), as a plain forward over the full text sees them; the response tokens
are found by character offsets (:func:`first_response_token`). The bank holds each prefix up to
a token boundary that the whole-text tokenization shares (:meth:`PromptTokens.entry_ids`,
checked per prompt), and the prefix's remaining tokens run with the query and response.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import ops
from icqs_fast.engine.batching import (
    PrefixBank,
    forward_cost_tokens,
    plain_hidden,
    plain_logits,
    suffix_hidden,
)
from icqs_fast.engine.calibration import (
    calibration_queries,
    icqs_margins,
    icqs_scores,
    implied_slope,
)
from icqs_fast.engine.capability import model_plan
from icqs_fast.engine.cascade import one_pass_kernel
from icqs_fast.engine.checks import model_max_length, parse_response
from icqs_fast.engine.one_pass import QueryPart
from icqs_fast.engine.prompt_tokens import PromptLayout, PromptTokens, common_prefix
from icqs_fast.engine.prompts import build_demo_sets
from icqs_fast.engine.settings import DEFAULT_TOKEN_BUDGET, ScoringSettings
from icqs_fast.engine.shared_query import QuerySegment, length_runs, query_runs, segment_group
from icqs_fast.types import TokenStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_TOKEN_BUDGET", "ICQSResult", "ICQSScorer", "ScoringSettings", "summarise"]
# Suffix forwards with cascade attention on the CPU: at most this many rows x suffix tokens per
# forward. bench icqs (auto, 8 responses x 20 contexts, 2 threads, 3 alternations): 2.81-2.85 s
# at 1024, 2.62-2.78 s at 2048, 2.86-2.93 s at 4096 (bigger forwards push the elementwise work
# out of the caches); float32 7.9-8.1 s at 1024, 7.7-7.9 s at 2048. Peak RSS growth scoring 16
# responses: 52 MB at 1024, 128 MB at 2048. The GPU uses the full token budget.
SUFFIX_CHUNK_CPU = 2048
# Batch-invariant mode (``deterministic=True``): the prefix bank's first (trie) build runs in
# chunks of this many tokens whatever ``token_budget`` says, so the stored prefix states - and
# every score computed against them - do not depend on the budget.
DETERMINISTIC_PREFIX_BUDGET = 1024

# Calibration baselines kept per (query, y) (each an [M+1 L] tensor): label-like answers hit it
# almost always; the oldest finished entries go first beyond this many.
CALIBRATION_CACHE = 65536


class Stage(enum.Enum):
    """Where a :class:`ResponseState` is in the engine."""

    QUEUED = "queued"  # prepared; some of its (response, context) rows have not run yet
    SCORED = "scored"  # every context's row ran: its log-likelihoods are complete
    # A scored calibration baseline whose row inputs were dropped: only ``loglik`` is kept
    # (the baseline cache holds many of them).
    RELEASED = "released"


@dataclass(eq=False)
class ResponseState:
    """One response's (or one calibration baseline's) rows in the engine, from
    :meth:`ICQSScorer._prepare_layouts` to its result; one row per context ``c`` (``n`` of them).

    Attributes:
        index: the response's position in the input stream.
        resp: the response's token ids (the tokens scored).
        suffix: per context, the ids run after the row's bank entry (the whole prompt on the
            plain path).
        rstart: per context, the suffix position that predicts the first response token.
        n_prompt, drops: per context, prompt tokens before the response and demonstrations
            dropped to fit the max length.
        entries, plen: per context, the prefix-bank entry (None: none) and its length.
        join: the response's first token merges with the text before it (some context).
        loglik: ``[n]`` float64, each context's summed response log-probability, as rows run.
        stats: per context, the rows' :class:`TokenStats` (responses with token stats only).
        baseline: a calibration baseline (an answer after a content-free / PMI query), shared
            by every response with that answer, not a response of the input.
        cal: a response's baselines (one per calibration query; empty without calibration).
        rows_done: the contexts whose row has run.
        stage: see :class:`Stage`.
        seg: per context, the :class:`QuerySegment` the row continues after its entry (its
            ``suffix`` then starts after the segment), or None.
        group: the first response of the group sharing its query segments (None: itself).
    """

    index: int
    resp: list[int]
    suffix: list[list[int]]
    rstart: list[int]
    n_prompt: list[int]
    drops: list[int]
    entries: list[int | None]
    plen: list[int]
    join: bool
    loglik: torch.Tensor
    stats: list[TokenStats | None]
    baseline: bool = False
    cal: list[ResponseState] = field(default_factory=list)
    rows_done: int = 0
    stage: Stage = Stage.QUEUED
    seg: list[QuerySegment | None] = field(default_factory=list)
    group: ResponseState | None = None

    def row_ran(self, n_contexts: int) -> None:
        """Count one more context's row as run; the last one makes the state
        :attr:`Stage.SCORED` (a baseline then :attr:`Stage.RELEASED`: its row inputs are not
        needed again)."""
        self.rows_done += 1
        if self.rows_done == n_contexts:
            self.stage = Stage.SCORED
            if self.baseline:
                self.suffix, self.rstart, self.entries, self.plen, self.stats = [], [], [], [], []
                self.seg = []
                self.stage = Stage.RELEASED

    @property
    def scored(self) -> bool:
        """Every row ran (:attr:`Stage.SCORED` or :attr:`Stage.RELEASED`)."""
        return self.stage is not Stage.QUEUED


@dataclass
class ICQSResult:
    """Scores of one response.

    Attributes:
        score: ICQS-Epistemic score of :attr:`loglik_calibrated`: ``ratios[argmax_j mean_l
            loglik_calibrated[j, l]]`` (``score="argmax"``) or the posterior mean
            ``sum_j q_j r_j`` (``score="mean"``; :func:`icqs_fast.engine.calibration.icqs_scores`).
        score_per_set: ``L`` floats, plain ICQS on each set l (argmax or posterior mean of
            column l).
        loglik: ``[M+1, L]`` fp32, the raw ``log P(y | demos_{j,l}, x)`` summed over y's tokens
            (whatever the calibration).
        ratios: ``M+1`` floats ``j / M``.
        n_response_tokens: number of scored tokens of y.
        n_prompt_tokens: ``[M+1, L]`` int64, prompt tokens before y (prefix + query) per context.
        n_dropped_demos: ``[M+1, L]`` int64, demonstrations dropped to fit the max length.
        token_stats: per-token statistics, each field ``[M+1, L, T]``, when requested.
        index: the response's position in the input stream.
        join: the response's first token merges with the text before it under whole-text
            tokenization (after some context; :attr:`PromptLayout.join`): that token is scored
            with the response, and holds characters of the query too.
        loglik_baseline: ``[M+1, L]`` fp32, what ``calibration`` subtracts: the mean over the
            content-free inputs of ``log P(y | demos_{j,l}, x_cf)``, or ``log P(y |
            demos_{j,l}, premise)`` for "pmi"; None for "none".
        calibration: "none", "content_free" or "pmi"; score_kind: "argmax", "tied" or "mean".
        margin: stability diagnostic: the gap in nats between the best and the second mixture
            ratio of ``mean_l loglik_calibrated`` (what ICQS-Epistemic's argmax decides on).
        margins: ``L`` floats, the same gap per set.
        tie_epsilon: the noise level (nats) of :attr:`near_ties` and of the "tied" score.
        p_good_calibrated: P(good) of :attr:`score` through the map the self-check fitted on
            the demonstration pools (:mod:`icqs_fast.engine.selfcheck`), when the scorer has
            one (:attr:`ICQSScorer.self_check`); None otherwise.
        verdict: "good", "bad" or "abstain" from that self-check's threshold or abstain band
            (:meth:`~icqs_fast.engine.selfcheck.SelfCheck.verdict`); None without one.
    """

    score: float
    score_per_set: list[float]
    loglik: torch.Tensor
    ratios: list[float]
    n_response_tokens: int
    n_prompt_tokens: torch.Tensor
    n_dropped_demos: torch.Tensor
    token_stats: TokenStats | None = None
    index: int = 0
    join: bool = False

    @property
    def truncated(self) -> bool:
        """Whether some context's prompt was cut to fit the max length (demonstrations dropped,
        ``drop_oldest_demos``; the engine never cuts a prompt otherwise, it refuses it)."""
        return bool(int(self.n_dropped_demos.sum()) > 0)

    loglik_baseline: torch.Tensor | None = None
    calibration: str = "none"
    score_kind: str = "argmax"
    margin: float = float("nan")
    margins: list[float] | None = None
    tie_epsilon: float = 0.1
    p_good_calibrated: float | None = None
    verdict: str | None = None

    @property
    def slope(self) -> float:
        """The readable scale of the posterior-mean score of ICQS-Epistemic (whatever
        ``score_kind``): the log-likelihood slope over the mixture ratio, in nats from all-bad to
        all-good demonstrations, that gives that posterior mean
        (:func:`icqs_fast.engine.calibration.implied_slope`; strictly increasing in it)."""
        ll = self.loglik_calibrated.double().mean(dim=1)
        r = torch.tensor(self.ratios, dtype=torch.float64)
        mean = float((torch.softmax(ll, 0) * r).sum())
        return implied_slope(mean, self.ratios)

    @property
    def p_good(self) -> float:
        """``sigmoid(slope)``: the posterior probability of the all-good context against the
        all-bad one; in (0, 1), ranks as the posterior-mean score does."""
        b = self.slope
        return 1.0 / (1.0 + math.exp(-b)) if math.isfinite(b) else float("nan")

    @property
    def near_ties(self) -> int:
        """Sets whose argmax lies within :attr:`tie_epsilon` of the second ratio (a change of
        dtype, backend or batch may flip their plain ICQS score)."""
        return sum(1 for m in (self.margins or []) if m < self.tie_epsilon)

    @property
    def loglik_calibrated(self) -> torch.Tensor:
        """``[M+1, L]`` fp32: ``loglik - loglik_baseline`` (``loglik`` when uncalibrated); the
        scores are made from it."""
        if self.loglik_baseline is None:
            return self.loglik
        return (self.loglik.double() - self.loglik_baseline.double()).float()


def summarise(index: int, loglik: torch.Tensor, ratios: list[float], n_resp: int,
              n_prompt: torch.Tensor, n_drop: torch.Tensor, stats: TokenStats | None,
              baseline: torch.Tensor | None = None, *, join: bool = False,
              calibration: str = "none", score_kind: str = "argmax",
              tie_epsilon: float = 0.1) -> ICQSResult:
    """Build an :class:`ICQSResult` from the raw ``loglik`` ``[M+1, L]`` and, when calibrated,
    its ``baseline`` ``[M+1, L]`` (the scores and margins come from their difference, in
    float64)."""
    ll = loglik.double()
    if baseline is not None:
        ll = ll - baseline.double()
    score, per_set = icqs_scores(ll, ratios, score_kind, tie_epsilon)
    margin, margins = icqs_margins(ll)
    return ICQSResult(score=score, score_per_set=per_set, loglik=loglik.float(), ratios=ratios,
                      n_response_tokens=n_resp, n_prompt_tokens=n_prompt,
                      n_dropped_demos=n_drop, token_stats=stats, index=index, join=join,
                      loglik_baseline=None if baseline is None else baseline.float(),
                      calibration=calibration, score_kind=score_kind, margin=margin,
                      margins=margins, tie_epsilon=tie_epsilon)


# --------------------------------------------------------------------------- the engine


class ICQSScorer:
    """ICQS / ICQS-Epistemic scorer with cached demonstration prefixes.

    Args:
        model: a causal LM (Llama-like or GPT-2-like: ``base_model`` body + linear
            ``get_output_embeddings()`` head), in eval mode.
        tokenizer: its tokenizer (needs a pad or eos token).
        good, bad: demonstration pools of (x, y) str pairs.
        settings: a :class:`~icqs_fast.engine.settings.ScoringSettings` (the defaults if None);
            the keywords below, when given, build it (or replace its fields). Stored as
            ``self.settings``; the same object drives the reference
            :func:`icqs_fast.engine.reference.icqs_naive`.
        num_ratios, demos_per_set, sets_per_ratio, seed, mixing, replacement, stratify,
            strata_order: see :func:`icqs_fast.engine.prompts.build_demo_sets` (``M+1``, ``N``,
            ``L``; default ``stratify="auto"``: when the answers are labels, every set holds the
            same labels in the same positions at every ratio, so only correctness changes with
            the ratio (on FPB / SST-2 with the embedded model the correct-vs-incorrect AUC rose
            0.43 -> 0.60 and 0.56 -> 0.71, means of 3 seeds); ``"y"``: always by the answer;
            ``None``: unstratified).
        template: prompt formats; the default "Sentence/Answer" :class:`Template` if None.
        backend: backend of :func:`icqs_fast.ops.linear_token_stats`.
        token_budget: tokens per forward: rows x suffix tokens with cascade attention
            (Llama family, GPT-2: the prefix states are shared, not copied per row), rows x
            (prefix + suffix) tokens on the KV-copy fallback path; also the prefix forwards'
            rows x prefix tokens (capped at ``PREFIX_CHUNK_CPU`` on the CPU).
        cascade: suffix forwards with cascade attention (:mod:`icqs_fast.engine.cascade`); None =
            when the model supports it, False = always the per-row KV-copy path.
        max_length: prompt length limit (default: the model's max positions).
        drop_oldest_demos: when a prompt is too long, drop that set's oldest demonstrations
            until it fits instead of raising.
        calibration, content_free, pmi_premise, score: see :mod:`icqs_fast.engine.calibration`
            ("none" / "content_free" / "pmi"; "argmax" / "mean"). The baseline prompts (content-
            free queries, the PMI premise) continue from the same prefix-bank entries; each
            (query, y) pair is scored once per context and cached.
        return_token_stats: attach per-token :class:`TokenStats` to each result.
        deterministic: batch-invariant mode. Each response runs in suffix forwards of its own
            (all its ``(M+1) L`` contexts in one forward, whatever ``token_budget``; no row of
            another response in it, so the padding, the row count and every matmul's shape
            depend on the response alone), its LM-head statistics in a call of its own, and the
            prefix bank is built in chunks of ``DETERMINISTIC_PREFIX_BUDGET`` tokens: a
            response's log-likelihoods and statistics are then bit-identical whatever else is in
            the input, its position, the order and ``token_budget`` (tests/
            test_batch_invariance.py). The prefix bank is still shared. Slower (see
            docs/ARCHITECTURE.md, *Batch-invariant mode*, for the cost and what a GPU needs).

    Token ids are those of each whole prompt text (:class:`PromptTokens`; a fast tokenizer is
    needed, for the offsets). ``seam_fallbacks`` counts the (response, context) prompts whose ids
    did not start with their context's cached prefix entry; each such prompt runs against an
    entry of its own (still exact, slower; a warning the first time).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        good: Sequence,
        bad: Sequence,
        settings: ScoringSettings | None = None,
        *,
        return_token_stats: bool = False,
        sets: list | None = None,
        **options: Any,
    ) -> None:
        st = ScoringSettings.build(settings, **options)
        # A fitted self-check (engine.selfcheck.SelfCheck) whose map gives each result its
        # p_good_calibrated; set by the job, the Ray actors or the server once it has run.
        self.self_check: Any = None
        # The capability check: the path (prefix bank with cascade attention or KV copies, or a
        # plain forward per prompt), the decoder body and the head's epilogue.
        self.plan = model_plan(model)
        if getattr(model, "training", False):
            warnings.warn("the model is in training mode (dropout is active); call model.eval() "
                          "for deterministic scores", stacklevel=2)
        self.settings = st
        self.model = model
        self.tokenizer = tokenizer
        self.template = st.template
        # ``sets``: what build_demo_sets gives for these pools and settings, from a caller that
        # built them already (the score job, before the model loads); built here otherwise.
        self.sets = sets if sets is not None else build_demo_sets(good, bad,
                                                                  **st.demo_set_options())
        self.ratios = [row[0].ratio for row in self.sets]
        self.num_ratios, self.sets_per_ratio = st.num_ratios, st.sets_per_ratio
        self.n_contexts = st.num_ratios * st.sets_per_ratio
        self.backend = st.backend
        self.token_budget = st.token_budget
        self.max_length = model_max_length(model, st.max_length)
        self.drop_oldest_demos = st.drop_oldest_demos
        self.return_token_stats = return_token_stats
        # cascade=False forces the KV-copy path on a bank model; cascade attention runs only
        # where the check verified it.
        self.cascade = self.plan.path == "cascade" and st.cascade is not False
        self.plain = not self.plan.bank
        self.deterministic = st.deterministic
        self.tokens = PromptTokens(tokenizer, self.template, self.sets)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._bank: PrefixBank | None = None
        self._entry: dict[tuple[int, int], int | None] = {}
        # Bank entries computed per response where the whole-text ids did not start with the
        # context's cached entry (keyed by their ids), and how often that happened.
        self._fallback_entry: dict[tuple[int, ...], int] = {}
        self.seam_fallbacks = 0
        # Calibration: the baseline (template, x) queries, their tokenizers (the content-free
        # queries use the settings' template: the same PromptTokens), and the baseline rows of
        # each (query, y) pair, keyed by (query index, y): scored once per context, shared by
        # every response with that answer. Never keyed by context: a row is one context's.
        self.calibration, self.score_kind = st.calibration, st.score
        self._cal_queries = [
            (self.tokens if tpl == self.template else PromptTokens(tokenizer, tpl, self.sets), x)
            for tpl, x in calibration_queries(st)]
        self._cal_cache: OrderedDict[tuple[int, str], ResponseState] = OrderedDict()
        self.calibration_rows = 0  # baseline (query, y, context) rows scored (not cached)
        # Tokens run through suffix forwards (padding not counted), shared query segments'
        # included: what ``score(share_query=True)`` saves shows here.
        self.suffix_tokens = 0

    @property
    def _budget(self) -> int:
        """Tokens per suffix forward (see ``token_budget``)."""
        if (self.cascade or self.plain) and \
                next(self.model.parameters()).device.type == "cpu":
            return min(self.token_budget, SUFFIX_CHUNK_CPU)
        return self.token_budget

    # -- prefix caches --------------------------------------------------------------------
    @property
    def prefix_bank(self) -> PrefixBank:
        """The stored prefix KV states, computed on first use (all contexts, batched)."""
        if self._bank is None:
            budget = DETERMINISTIC_PREFIX_BUDGET if self.deterministic else self.token_budget
            bank = PrefixBank(self.model, self.pad_id, budget, body=self.plan.body,
                              layers=self.plan.layers)
            ids = [self.tokens.entry_ids(c, 0) for c in range(self.n_contexts)]
            keep = [c for c in range(self.n_contexts) if ids[c]]
            for c in range(self.n_contexts):
                self._entry[(c, 0)] = None
            for c, e in zip(keep, bank.add([ids[c] for c in keep]), strict=True):
                self._entry[(c, 0)] = e
            self._bank = bank
        return self._bank

    def _entry_of(self, i: int, c: int, lay: PromptLayout) -> int:
        """The bank entry prompt ``lay`` (response i, context c) continues from: the context's
        cached entry when ``lay.ids`` starts with it (and it ends before the response), else
        an entry for the longest such common start, computed now (and kept for reuse)."""
        bank = self.prefix_bank
        key = (c, lay.drop)
        if key not in self._entry:
            ids = self.tokens.entry_ids(c, lay.drop)
            self._entry[key] = bank.add([ids])[0] if ids else None
        e = self._entry[key]
        if e is not None:
            n = bank.lengths[e]
            if n < lay.n_prompt and lay.ids[:n] == self.tokens.entry_ids(c, lay.drop):
                return e
            n = common_prefix(lay.ids, self.tokens.entry_ids(c, lay.drop))
        else:  # no cached entry for this context: the first token alone (bounded, slow)
            n = 1
        # The entry must end before the response's first prediction (position n_prompt - 1).
        n = max(1, min(n, lay.n_prompt - 1))
        fkey = tuple(lay.ids[:n])
        if fkey not in self._fallback_entry:
            if not self._fallback_entry:
                warnings.warn(
                    f"response {i}: its whole-text token ids after context {c} do not start "
                    "with the cached prefix tokens (a tokenizer seam inside the demonstrations); "
                    "such prompts get a prefix entry of their own (exact, slower)", stacklevel=4)
            self._fallback_entry[fkey] = bank.add([list(fkey)])[0]
        self.seam_fallbacks += 1
        return self._fallback_entry[fkey]

    # -- scoring --------------------------------------------------------------------------
    def score_one(self, x: str, y: str) -> ICQSResult:
        """Score a single response (x, y)."""
        return next(iter(self.score([(x, y)])))

    def score(self, responses: Iterable, *, share_query: bool = False
              ) -> Iterator[ICQSResult]:
        """Score a stream of responses lazily, in order.

        Args:
            responses: iterable of (x, y) str pairs or dicts with "x" and "y".
            share_query: consecutive responses with the same ``x`` (both outputs of a pair;
                :mod:`icqs_fast.engine.shared_query`) compute the query's states once per
                context: the tokens their prompts share after the context's bank entry run in
                one row, and each response's row continues from it with its own tokens.
                The same bits as without (the one-pass cascade: :attr:`shares_query`; elsewhere,
                and in ``deterministic`` mode, the flag changes nothing).

        Yields:
            one :class:`ICQSResult` per response, in input order; input is pulled only as far
            as the current batch needs (one response further with ``share_query``).
        """
        c_n = self.n_contexts
        if self.deterministic:  # one response per forward (see the class docstring)
            for i, item in enumerate(responses):
                rec, new = self._prepare(i, item)
                self._run_all([*new, rec])
                yield self._finish(rec)
            return
        share = share_query and self.shares_query
        pending: list[ResponseState] = []  # prepared responses not yet scored
        rows: list[tuple[ResponseState, int]] = []  # queued (response, context) rows
        it = query_runs(responses) if share else ([item] for item in enumerate(responses))
        exhausted = False
        while True:
            # Fill the row queue until one forward's budget is reached (or the input ends).
            while not exhausted and self._row_cost(rows) < self._budget:
                try:
                    run = next(it)
                except StopIteration:
                    exhausted = True
                    break
                recs, fresh = [], []
                for i, item in run:
                    rec, new = self._prepare(i, item)
                    recs.append(rec)
                    fresh.extend(new)
                if share:
                    segment_group(recs)
                pending.extend(recs)
                # A group's rows context-major: the rows sharing a query segment side by side
                # (the batch cut keeps them together when it can).
                rows.extend((rec, c) for c in range(c_n) for rec in recs)
                for child in fresh:  # baseline rows not scored or queued before
                    rows.extend((child, c) for c in range(c_n))
            if not rows:
                break
            take = self._take(rows)
            batch, rows = rows[:take], rows[take:]
            self._run(batch)
            while pending and self._ready(pending[0]):
                yield self._finish(pending.pop(0))
        while pending:  # only reached when every row ran
            yield self._finish(pending.pop(0))

    @property
    def shares_query(self) -> bool:
        """Whether ``score(share_query=True)`` shares the query's states here: cascade attention
        whose every layer runs as one softmax pass (the C++ kernel on the CPU), the path on which
        a row continuing another forward's states gives the same bits."""
        p = next(self.model.parameters())
        return self.cascade and one_pass_kernel(p.device, p.dtype)

    @staticmethod
    def _ready(rec: ResponseState) -> bool:
        return rec.scored and all(ch.scored for ch in rec.cal)

    def _prepare(self, i: int, item: Any) -> tuple[ResponseState, list[ResponseState]]:
        """Response ``i``'s state and its baselines that are new (their rows to be queued)."""
        x, y = parse_response(i, item)
        self.tokens.response_parts(i, x, y)  # both parts must give tokens (clear errors)
        lays = self.tokens.layouts(i, x, y, self.max_length, self.drop_oldest_demos)
        rec = self._prepare_layouts(i, lays)
        rec.cal, new = self._baseline_recs(i, y)
        return rec, new

    def _baseline_recs(self, i: int, y: str
                       ) -> tuple[list[ResponseState], list[ResponseState]]:
        """The baseline states of answer ``y`` (one per calibration query; cached ones reused)
        and those of them that are new (their rows still to be queued)."""
        cal: list[ResponseState] = []
        new: list[ResponseState] = []
        for q, (tokens, xq) in enumerate(self._cal_queries):
            key = (q, y)
            child = self._cal_cache.get(key)
            if child is None:
                child = self._prepare_layouts(i, tokens.layouts(
                    i, xq, y, self.max_length, self.drop_oldest_demos), baseline=True)
                self._cal_cache[key] = child
                new.append(child)
                self.calibration_rows += self.n_contexts
                self._trim_cal_cache()
            else:
                self._cal_cache.move_to_end(key)
            cal.append(child)
        return cal, new

    def baselines(self, answers: Iterable[str]) -> list[torch.Tensor]:
        """The calibration baseline ``[M+1, L]`` (fp32) of each answer ``y`` alone: what
        ``score`` subtracts for any response with that answer (it does not depend on ``x``),
        computing only the baseline rows (cached as in ``score``). ValueError when the settings'
        calibration is "none"."""
        if not self._cal_queries:
            raise ValueError("baselines: this scorer's calibration is 'none'")
        ys = [parse_response(i, ("", y))[1] for i, y in enumerate(answers)]
        cals, new = [], []
        for i, y in enumerate(ys):
            cal, fresh = self._baseline_recs(i, y)
            cals.append(cal)
            new.extend(fresh)
        self._run_all(new)
        m1, ls = self.num_ratios, self.sets_per_ratio
        return [torch.stack([ch.loglik for ch in cal]).mean(dim=0).reshape(m1, ls).float()
                for cal in cals]

    def _run_all(self, states: list[ResponseState]) -> None:
        """Run every row of ``states``: in forwards within the token budget, or in
        batch-invariant mode each state's rows in a forward of their own (a baseline depends on
        its answer alone, so it may be computed once and shared there too)."""
        if self.deterministic:
            for st in states:
                self._run([(st, c) for c in range(self.n_contexts)])
            return
        rows = [(st, c) for st in states for c in range(self.n_contexts)]
        while rows:
            take = self._take(rows)
            self._run(rows[:take])
            rows = rows[take:]

    def _trim_cal_cache(self) -> None:
        while len(self._cal_cache) > CALIBRATION_CACHE:
            key, oldest = next(iter(self._cal_cache.items()))
            if not oldest.scored:
                break  # still queued: kept (responses in flight hold it anyway)
            del self._cal_cache[key]

    def _prepare_layouts(self, i: int, lays: list[PromptLayout], *, baseline: bool = False
                         ) -> ResponseState:
        if self.plain:  # no bank: each row is its whole prompt
            entries: list = [None] * len(lays)
            plen = [0] * len(lays)
        else:
            entries = [self._entry_of(i, c, lay) for c, lay in enumerate(lays)]
            plen = [self.prefix_bank.lengths[e] for e in entries]
        # Row c runs ids[plen:-1] against its entry; suffix position n_prompt - 1 - plen + t
        # predicts response token t.
        # The plain path runs the whole text, last token included: the same forward as the
        # model's own over the prompt (a model that is not causal, XLNet, sees it too).
        cut = None if self.plain else -1
        return ResponseState(
            index=i, resp=lays[0].ids[lays[0].n_prompt:],
            suffix=[lay.ids[p:cut] for lay, p in zip(lays, plen, strict=True)],
            rstart=[lay.n_prompt - 1 - p for lay, p in zip(lays, plen, strict=True)],
            n_prompt=[lay.n_prompt for lay in lays], drops=[lay.drop for lay in lays],
            entries=entries, plen=plen, join=any(lay.join for lay in lays),
            loglik=torch.zeros(self.n_contexts, dtype=torch.float64),
            stats=[None] * self.n_contexts, baseline=baseline, seg=[None] * self.n_contexts)

    def _row_cost(self, rows: list[tuple[ResponseState, int]]) -> int:
        if not rows:
            return 0
        p = 0 if self.cascade or self.plain else max(rec.plen[c] for rec, c in rows)
        s = max(len(rec.suffix[c]) for rec, c in rows)
        # The query segments' own forward (each once) counts against the budget too.
        segs = {id(sg): len(sg.ids) for sg in (rec.seg[c] for rec, c in rows) if sg is not None}
        return max(len(rows) * (p + s), len(segs) * max(segs.values(), default=0))

    def _take(self, rows: list[tuple[ResponseState, int]]) -> int:
        """Largest leading run of rows within the token budget (at least one); with cascade
        attention cut at a response boundary when one fits, so every prefix entry gets the same
        number of rows (the attention then runs as one batched call per layer)."""
        p = s = q = 0
        segs: set[int] = set()
        take = len(rows)
        for n, (rec, c) in enumerate(rows):
            p2 = 0 if self.cascade or self.plain else max(p, rec.plen[c])
            s2 = max(s, len(rec.suffix[c]))
            sg = rec.seg[c]
            new = sg is not None and id(sg) not in segs
            q2 = max(q, len(sg.ids)) if new else q
            if n > 0 and max((n + 1) * (p2 + s2), (len(segs) + new) * q2) > self._budget:
                take = n
                break
            p, s, q = p2, s2, q2
            if new:
                segs.add(id(sg))
        if self.cascade and take < len(rows):
            # Between responses (groups sharing query segments), else between segments: each
            # segment then runs once.
            bounds = [n for n in range(1, take + 1)
                      if _group(rows[n][0]) is not _group(rows[n - 1][0])] or \
                [n for n in range(1, take + 1) if rows[n][0].seg[rows[n][1]] is None
                 or rows[n][0].seg[rows[n][1]] is not rows[n - 1][0].seg[rows[n - 1][1]]]
            if bounds:
                take = bounds[-1]
        return take

    @torch.no_grad()
    def _run(self, batch: list[tuple[ResponseState, int]]) -> None:
        if self.cascade:  # entry-major rows: the cascade attention groups rows by entry
            batch = sorted(batch, key=lambda rc: rc[0].entries[rc[1]])
        entries = [rec.entries[c] for rec, c in batch]
        suffixes = [rec.suffix[c] for rec, c in batch]
        dev = next(self.model.parameters()).device
        if self.plain:
            if self.plan.own_logits:
                out = plain_logits(self.model, suffixes, self.pad_id, dev,
                                   self.plan.pad_safe, self.plan.positional_layers)
            else:
                out = plain_hidden(self.plan.body, suffixes, self.pad_id, dev,
                                   self.plan.pad_safe, self.plan.positional_layers)
        else:
            query = self._query_part(batch) if self.cascade else None
            if query is not None:
                out = self._continue_query(entries, suffixes, query, dev)
            else:
                out, _ = suffix_hidden(self.model, self.prefix_bank, entries, suffixes,
                                       self.pad_id, cascade=self.cascade)
        self.suffix_tokens += sum(map(len, suffixes))
        rows_idx, pos_idx, targets, seg = [], [], [], []
        for b, (rec, c) in enumerate(batch):
            r0, nr = rec.rstart[c], len(rec.resp)
            rows_idx.extend([b] * nr)
            pos_idx.extend(range(r0, r0 + nr))
            targets.extend(rec.resp)
            seg.append(nr)
        dev = out.device
        h = out[torch.tensor(rows_idx, device=dev), torch.tensor(pos_idx, device=dev)]
        tgt = torch.tensor(targets, device=dev)
        if self.plain and self.plan.own_logits:
            st = ops.token_stats(h, tgt, backend=self.backend)
        else:
            st = self.plan.head_stats(h, tgt, self.backend)
        # One device-to-host copy per batch (every field asked for, and the deferred input
        # checks, packed together), sliced on the host: no sync per field or per segment.
        host = st.to_host(None if self.return_token_stats else ("logprob",))
        lp = host.logprob.double()
        st_host = host if self.return_token_stats else None
        start = 0
        for (rec, c), nr in zip(batch, seg, strict=True):
            rec.loglik[c] = lp[start:start + nr].sum()
            if st_host is not None and not rec.baseline:
                rec.stats[c] = st_host.map(lambda t, a=start, b=start + nr: t[a:b])
            rec.row_ran(self.n_contexts)
            start += nr

    def _query_part(self, batch: list[tuple[ResponseState, int]]) -> QueryPart | None:
        """The batch's query segments run in one forward of their own (each once, rows in
        entry order), their keys/values kept for the batch's rows to continue; None when no
        row has one."""
        segs: dict[int, QuerySegment] = {}
        for rec, c in batch:
            if rec.seg[c] is not None:
                segs.setdefault(id(rec.seg[c]), rec.seg[c])
        if not segs:
            return None
        order = sorted(segs.values(), key=lambda sg: sg.entry)
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        suffix_hidden(self.model, self.prefix_bank, [sg.entry for sg in order],
                      [sg.ids for sg in order], self.pad_id, capture=kv)
        self.suffix_tokens += sum(len(sg.ids) for sg in order)
        row = {id(sg): n for n, sg in enumerate(order)}
        segs_of = [rec.seg[c] for rec, c in batch]
        return QueryPart(kv, [0 if sg is None else row[id(sg)] for sg in segs_of],
                         [0 if sg is None else len(sg.ids) for sg in segs_of])

    def _continue_query(self, entries: list[int], suffixes: list[list[int]], query: QueryPart,
                        dev: torch.device) -> torch.Tensor:
        """Hidden states ``[R, S, H]`` of rows continuing shared query states, in forwards by
        length: a pair's outputs may differ by hundreds of tokens, and one forward would pad the
        short ones to the long (another forward costs :func:`forward_cost_tokens`)."""
        runs = length_runs([len(x) for x in suffixes], forward_cost_tokens(self.model, dev))
        if len(runs) == 1:  # one forward, in the batch's (entry) order
            return suffix_hidden(self.model, self.prefix_bank, entries, suffixes, self.pad_id,
                                 query=query)[0]
        out = None
        for run in runs:
            sub = QueryPart(query.kv, [query.rows[i] for i in run],
                            [query.lengths[i] for i in run])
            h, _ = suffix_hidden(self.model, self.prefix_bank, [entries[i] for i in run],
                                 [suffixes[i] for i in run], self.pad_id, query=sub)
            if out is None:
                out = h.new_zeros(len(suffixes), max(map(len, suffixes)), h.shape[-1])
            out[torch.tensor(run, device=h.device), :h.shape[1]] = h
        return out

    def _finish(self, rec: ResponseState) -> ICQSResult:
        m1, ls = self.num_ratios, self.sets_per_ratio
        ll = rec.loglik.reshape(m1, ls)
        if not rec.cal:
            ll = ll.float()  # the uncalibrated scores from fp32 log-likelihoods, as always
        n_prompt = torch.tensor(rec.n_prompt, dtype=torch.long).reshape(m1, ls)
        n_drop = torch.tensor(rec.drops, dtype=torch.long).reshape(m1, ls)
        stats = None
        if self.return_token_stats:
            parts = rec.stats
            stats = TokenStats(**{
                k: torch.stack([getattr(p, k) for p in parts]).reshape(m1, ls, -1)
                for k in parts[0].as_dict()
            })
        base = None
        if rec.cal:
            base = torch.stack([ch.loglik for ch in rec.cal]).mean(dim=0).reshape(m1, ls)
        res = summarise(rec.index, ll, self.ratios, len(rec.resp), n_prompt, n_drop,
                        stats, join=rec.join, baseline=base, calibration=self.calibration,
                        score_kind=self.score_kind, tie_epsilon=self.settings.tie_epsilon)
        if self.self_check is not None:
            res.p_good_calibrated = self.self_check.record_value(res.score)
            res.verdict = self.self_check.verdict(res.score)
        return res


def _group(rec: ResponseState) -> ResponseState:
    return rec if rec.group is None else rec.group
