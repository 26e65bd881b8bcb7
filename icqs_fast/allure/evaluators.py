"""ALLURE evaluators: label a record with one of a task's options, with the probability of the
label (for AUC) and glass-box features of the same forward.

* :class:`LikelihoodEvaluator` - an LLM judge without generation. Its prompt is the evaluation
  instructions (system turn), the memory's in-context examples as earlier chat turns (user:
  the restated record, assistant: its correct label) and the record's query; each option's
  tokens are scored as a continuation after the assistant header. All of a round's prompts
  start with the same instructions + memory tokens and all options of a record share the
  record's prompt, so :func:`icqs_fast.engine.continuations.score_continuations` computes the
  memory's
  KV states once per round (once per bank chunk, :attr:`LikelihoodEvaluator.bank_mib`) and each
  record's prompt once, whatever the number of options.
* :class:`ICQSEvaluator` - thresholds an ICQS-Epistemic score (:class:`icqs_fast.engine.scorer.
  ICQSScorer`), with the memory's records as good / bad demonstrations.

Both return :class:`Judgment` s and take the memory as a sequence of :class:`MemoryItem`
(anything with ``.example`` and ``.record``; :class:`icqs_fast.allure.memory.MemoryEntry`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from icqs_fast.allure.data import AuditRecord, TaskSpec
from icqs_fast.engine.batching import model_device
from icqs_fast.engine.capability import model_plan
from icqs_fast.engine.checks import model_max_length
from icqs_fast.engine.continuations import kv_bytes_per_token, score_continuations
from icqs_fast.engine.prompts import adds_bos
from icqs_fast.engine.scorer import ICQSScorer
from icqs_fast.features.attention import capture_attention_entropy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class Example:
    """One in-context example: a user turn restating a record (and, for regex-truth tasks, the
    expected correct answer) and the assistant turn with the correct label."""

    user: str
    assistant: str


class MemoryItem(Protocol):
    example: Example
    record: AuditRecord


@dataclass
class Judgment:
    """An evaluator's verdict on one record.

    Attributes:
        label: the chosen option.
        probs: probability of each option, normalised over the options.
        logprobs: each option's log-likelihood (summed over its tokens; for ICQS, unused: {}).
        features: glass-box features of the forward that scored the record.
        orders: a pairwise record judged in both orders: ``(given order, swapped order)``, the
            swapped one mapped back to the original meaning (its labels name the same outputs
            as the given order's); None when judged in one order only.
    """

    label: str
    probs: dict[str, float]
    logprobs: dict[str, float] = field(default_factory=dict)
    features: dict[str, float] = field(default_factory=dict)
    orders: tuple[Judgment, Judgment] | None = None

    def confidence(self) -> float:
        """Probability of the chosen label."""
        return self.probs[self.label]


class Evaluator(Protocol):
    """What the audit loop needs from an evaluator."""

    spec: TaskSpec

    def evaluate(self, records: Sequence[AuditRecord], memory: Sequence[MemoryItem], *,
                 progress: Callable | None = None) -> list[Judgment]: ...

    def describe(self) -> str: ...


def make_example(spec: TaskSpec, rec: AuditRecord) -> Example:
    """The in-context example built from ``rec``: its restated query, answered with its truth."""
    return Example(spec.example_user(rec), rec.truth)


def _softmax(values: dict[str, float]) -> dict[str, float]:
    m = max(values.values())
    e = {k: math.exp(v - m) for k, v in values.items()}
    s = sum(e.values())
    return {k: v / s for k, v in e.items()}


# --------------------------------------------------------------------------- position swap


def _unswap(spec: TaskSpec, j: Judgment) -> Judgment:
    """A judgment of the swapped pair, relabelled to the original order's meaning."""
    return Judgment(spec.swap_label(j.label), {spec.swap_label(k): v for k, v in j.probs.items()},
                    {spec.swap_label(k): v for k, v in j.logprobs.items()}, dict(j.features))


def _halving(progress: Callable | None) -> Callable | None:
    """A progress callback for ``2 n`` scored records that advances ``progress`` by ``n``."""
    if progress is None:
        return None
    state = {"done": 0, "told": 0}

    def tick(k: int) -> None:
        state["done"] += k
        new = state["done"] // 2 - state["told"]
        if new > 0:
            state["told"] += new
            progress(new)

    return tick


def evaluate_both_orders(evaluator: Evaluator, records: Sequence[AuditRecord],
                         memory: Sequence[MemoryItem], *, progress: Callable | None = None
                         ) -> list[Judgment]:
    """Judge each pair of a pairwise task as given and with its outputs swapped
    (:meth:`TaskSpec.swapped`), in one ``evaluate`` call (so the likelihood judge computes the
    memory prefix once for both orders). Returns the given order's judgments, each with
    :attr:`Judgment.orders` set (the swapped one mapped back to the original labels).

    Raises:
        ValueError: the evaluator's task is not pairwise.
    """
    spec = evaluator.spec
    if not spec.pairwise:
        raise ValueError(f"task {spec.name!r} is not pairwise: no order to swap")
    recs = list(records)
    js = evaluator.evaluate(recs + [spec.swapped(r) for r in recs], memory,
                            progress=_halving(progress))
    n = len(recs)
    out = []
    for fwd, swp in zip(js[:n], js[n:], strict=True):
        fwd = Judgment(fwd.label, fwd.probs, fwd.logprobs, fwd.features)
        fwd.orders = (Judgment(fwd.label, fwd.probs, fwd.logprobs, fwd.features),
                      _unswap(spec, swp))
        out.append(fwd)
    return out


def order_averaged(spec: TaskSpec, rec: AuditRecord, j: Judgment) -> Judgment:
    """The order-averaged judgment of pair ``rec`` judged in both orders (``j.orders`` set):
    each option's probability is the mean of the two orders' (:func:`icqs_fast.allure.bias.
    order_average`), the label the more probable option, log-likelihoods and features the two
    orders' means. It names the same output whichever order the pair came in; an exact tie
    goes to the output whose text sorts first (the first option for identical texts), which
    does not depend on the order either."""
    from icqs_fast.allure.bias import order_average

    if j.orders is None:
        raise ValueError("order_averaged needs a judgment of both orders (evaluate_both_orders)")
    a, b = j.orders
    first, second = spec.options
    f1, f2 = spec.pair_fields
    label, p = order_average((a.probs[first], a.probs[second]),
                             (b.probs[first], b.probs[second]), spec.options,
                             first_wins_tie=rec.fields[f1] <= rec.fields[f2])
    lp = {k: 0.5 * (a.logprobs[k] + b.logprobs[k]) for k in a.logprobs if k in b.logprobs}
    feats = {k: 0.5 * (a.features[k] + b.features[k]) for k in a.features if k in b.features}
    return Judgment(label, {first: p, second: 1.0 - p}, lp, feats, j.orders)


class OrderAveragedEvaluator:
    """A pairwise evaluator debiased for position (``audit --debias``): every pair is judged in
    both orders (:func:`evaluate_both_orders`) and its verdict is the order-averaged one
    (:func:`order_averaged`), for the loop's mistakes, its metrics and the studies alike. Costs
    twice the wrapped evaluator's scoring."""

    both_orders = True  # its judgments carry both orders (Judgment.orders)

    def __init__(self, base: Evaluator) -> None:
        if not base.spec.pairwise:
            raise ValueError(f"--debias needs a pairwise task; {base.spec.name!r} is not")
        self.base = base
        self.spec = base.spec

    def describe(self) -> str:
        return f"{self.base.describe()}, averaged over both orders of each pair"

    def evaluate(self, records: Sequence[AuditRecord], memory: Sequence[MemoryItem], *,
                 progress: Callable | None = None) -> list[Judgment]:
        js = evaluate_both_orders(self.base, records, memory, progress=progress)
        return [order_averaged(self.spec, r, j) for r, j in zip(records, js, strict=True)]

    def __getattr__(self, name: str) -> Any:
        # attention_entropy and the counters of the wrapped evaluator.
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


# --------------------------------------------------------------------------- likelihood judge


@dataclass
class Encoded:
    """Token ids of one record's prompt.

    Attributes:
        context: the whole prompt (BOS if used, instructions + memory, the record's turn, the
            assistant header); the options are scored after it.
        n_shared: leading tokens that are the instructions + memory (the same for every record
            of a round).
        response_span: ``[start, end)`` token positions of the response(s) under evaluation.
    """

    context: list[int]
    n_shared: int
    response_span: tuple[int, int]


class LikelihoodEvaluator:
    """Label a record by the log-probability of each option after the evaluation prompt.

    Args:
        model, tokenizer: a causal LM (plain linear LM head, full attention) and its tokenizer;
            the tokenizer's chat template builds the turns when it has one, else a plain
            ``### System / ### User / ### Assistant`` layout.
        spec: the task.
        backend: backend of the fused LM head.
        bank_mib: KV memory (MiB) one scoring call may hold; a round's records are scored in
            as few calls as fit it, each computing the shared memory prefix once.
        max_length: prompt length limit (default: the model's).

    Raises (from :meth:`evaluate`):
        ValueError: a prompt longer than the model takes (naming the record and the lengths).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: TaskSpec,
                 *, backend: str = "auto",
                 bank_mib: int = 1024, max_length: int | None = None,
                 use_chat_template: bool | None = None) -> None:
        self.model, self.tok, self.spec = model, tokenizer, spec
        self.backend = backend
        self.bank_mib = bank_mib
        self.max_length = model_max_length(model, max_length)
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if use_chat_template is None \
            else use_chat_template
        self.bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        self.option_ids = {o: self._ids(o) for o in spec.options}
        for o, ids in self.option_ids.items():
            if not ids:
                raise ValueError(f"option {o!r} encodes to no tokens")
        self._shared_cache: dict[tuple, list[int]] = {}
        # Counters of the last evaluate() call (for reports and tests).
        self.last_calls = 0
        self.last_requests = 0

    def describe(self) -> str:
        return "likelihood judge (option log-probabilities after instructions + memory)"

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    # -- prompt -----------------------------------------------------------------------------

    def _messages(self, memory: Sequence[MemoryItem]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.spec.instructions}]
        for m in memory:
            msgs += [{"role": "user", "content": m.example.user},
                     {"role": "assistant", "content": m.example.assistant}]
        return msgs

    def _render(self, msgs: list[dict[str, str]], generation: bool) -> str:
        if self.chat:
            return self.tok.apply_chat_template(msgs, tokenize=False,
                                                add_generation_prompt=generation)
        names = {"system": "System", "user": "User", "assistant": "Assistant"}
        text = "".join(f"### {names[m['role']]}:\n{m['content']}\n\n" for m in msgs)
        return text + ("### Assistant:\n" if generation else "")

    def prompt_parts(self, rec: AuditRecord, memory: Sequence[MemoryItem]) -> tuple[str, str]:
        """``(shared, own)``: the text of the instructions + memory turns, and of the record's
        user turn with the assistant header; the prompt is ``shared + own``."""
        msgs = self._messages(memory)
        shared = self._render(msgs, False)
        full = self._render(msgs + [{"role": "user", "content": self.spec.query(rec)}], True)
        if not full.startswith(shared):
            raise ValueError("the chat template renders the earlier turns differently once a "
                             "user turn follows; cannot share the memory prefix")
        return shared, full[len(shared):]

    def encode(self, rec: AuditRecord, memory: Sequence[MemoryItem]) -> Encoded:
        """Token ids of ``rec``'s prompt (the shared part tokenised once per memory)."""
        shared_text, own = self.prompt_parts(rec, memory)
        key = (shared_text,)
        if key not in self._shared_cache:
            self._shared_cache = {key: self.bos + self._ids(shared_text)}
        shared = self._shared_cache[key]
        enc = self.tok(own, add_special_tokens=False, return_offsets_mapping=True)
        own_ids = list(enc["input_ids"])
        span = self._span(rec, own, enc.get("offset_mapping"))
        n = len(shared)
        return Encoded(shared + own_ids, n, (n + span[0], n + span[1]))

    def _span(self, rec: AuditRecord, own: str, offsets) -> tuple[int, int]:
        """Token range of the response fields inside the record's own text (by character
        offsets; the whole turn when the tokenizer gives no offsets)."""
        starts, ends, pos = [], [], 0
        for f in self.spec.response_fields:
            v = rec.fields.get(f, "")
            at = own.find(v, pos) if v else -1
            if at >= 0:
                starts.append(at)
                ends.append(at + len(v))
                pos = at + len(v)
        if not starts or offsets is None:
            return 0, len(self._ids(own))
        c0, c1 = min(starts), max(ends)
        toks = [i for i, (a, b) in enumerate(offsets) if b > c0 and a < c1]
        return (toks[0], toks[-1] + 1) if toks else (0, len(offsets))

    # -- scoring ----------------------------------------------------------------------------

    def _check_length(self, rec: AuditRecord, enc: Encoded) -> None:
        longest = max(len(v) for v in self.option_ids.values())
        if self.max_length is not None and len(enc.context) + longest > self.max_length:
            raise ValueError(
                f"record {rec.id!r} (line {rec.line}): its prompt is {len(enc.context)} tokens "
                f"({enc.n_shared} of instructions + memory) + {longest} option tokens, over the "
                f"model's {self.max_length}; use fewer examples (--max-new) or shorter ones")

    @torch.no_grad()
    def evaluate(self, records: Sequence[AuditRecord], memory: Sequence[MemoryItem], *,
                 progress: Callable | None = None) -> list[Judgment]:
        """Judgments of ``records`` with ``memory`` as the in-context examples, in order.

        ``progress(n)`` is called after each scoring call with the records it finished."""
        encs = [self.encode(r, memory) for r in records]
        for r, e in zip(records, encs, strict=True):
            self._check_length(r, e)
        budget = max(1, self.bank_mib * 2**20 // kv_bytes_per_token(self.model))
        out: list[Judgment] = []
        self.last_calls = self.last_requests = 0
        start = 0
        while start < len(encs):
            # As many records as the bank budget holds: the shared memory prefix is computed
            # once per call. The bank stores every entry's whole prefix, padded to the longest.
            end, longest = start, 0
            while end < len(encs):
                ln = max(longest, len(encs[end].context))
                if end > start and ln * (end - start + 1) > budget:
                    break
                longest, end = ln, end + 1
            reqs = [(e.context, self.option_ids[o]) for e in encs[start:end]
                    for o in self.spec.options]
            res = score_continuations(self.model, reqs, pad_id=self._pad_id(),
                                      backend=self.backend, return_token_stats=True,
                                      max_bank_tokens=budget)
            self.last_calls += 1
            self.last_requests += len(reqs)
            k = len(self.spec.options)
            for i in range(end - start):
                out.append(self._judge(res[i * k:(i + 1) * k]))
            if progress is not None:
                progress(end - start)
            start = end
        return out

    def _pad_id(self) -> int:
        pid = self.tok.pad_token_id if self.tok.pad_token_id is not None else \
            self.tok.eos_token_id
        return int(pid) if pid is not None else 0

    def _judge(self, res: Sequence[Any]) -> Judgment:
        opts = self.spec.options
        lp = {o: float(r.loglik) for o, r in zip(opts, res, strict=True)}
        probs = _softmax(lp)
        label = max(opts, key=lambda o: (lp[o], -opts.index(o)))
        st = res[0].stats  # every option's first token is predicted at the same position
        ranked = sorted(lp.values(), reverse=True)
        feats = {
            # Entropy / top log-prob of the full next-token distribution at the decision point.
            "decision_entropy": float(st.entropy[0]),
            "decision_varentropy": float(st.varentropy[0]),
            "decision_max_logprob": float(st.max_logprob[0]),
            # How much of that distribution the options take (single-token options: exact).
            "option_mass": float(math.exp(_logsumexp(list(lp.values())))),
            "option_margin": float(ranked[0] - ranked[1]),
            "label_is_greedy": float(all(r.is_greedy for o, r in zip(opts, res, strict=True)
                                         if o == label)),
        }
        return Judgment(label, probs, lp, feats)

    # -- attention entropy ------------------------------------------------------------------

    @torch.no_grad()
    def attention_entropy(self, records: Sequence[AuditRecord], memory: Sequence[MemoryItem],
                          *, backend: str = "auto") -> list[float]:
        """Attention entropy of the decision position (the last prompt token, whose state
        predicts the label) over the response tokens: its attention renormalised over the
        response span, averaged over layers and heads, per record (nats).

        One plain forward of each whole prompt with the package's fused attention entropy
        (:func:`icqs_fast.features.attention.capture_attention_entropy`): that capture needs a full
        forward without a KV cache, so it is not the bank's forward and costs one more prompt
        forward per record; the studies run it on a few held-out records."""
        dev = model_device(self.model)
        # The capture only needs the attention layers to run: the body, or the whole model
        # where the capability check found no separate body.
        body = model_plan(self.model).body or self.model
        # Each record's value and mask check stay on the device; one device-to-host copy for
        # the whole call (not a sync per record).
        vals, bads = [], []
        for r in records:
            enc = self.encode(r, memory)
            self._check_length(r, enc)
            ids = torch.tensor([enc.context], device=dev)
            t = ids.shape[1]
            qm = torch.zeros((1, t), dtype=torch.bool, device=dev)
            qm[0, t - 1] = True
            kr = torch.tensor([list(enc.response_span)], dtype=torch.long, device=dev)
            with capture_attention_entropy(self.model, qm, kr, backend=backend,
                                           check_mask=False) as cap:
                body(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            vals.append(cap.entropy[0, :, :, t - 1].double().mean())
            if cap.mask_bad is not None:
                bads.append(cap.mask_bad.double())
        if not vals:
            return []
        host = torch.stack(vals + bads).tolist()
        if bads:
            cap.check_mask(any(host[len(vals):]))
        return host[:len(vals)]


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


# --------------------------------------------------------------------------- ICQS threshold


class ICQSEvaluator:
    """Label by thresholding the ICQS-Epistemic score of the record's response: ``good`` when
    the score is >= ``threshold``, else ``bad`` (a binary task's two options).

    The demonstration pools are ``seed_good`` / ``seed_bad`` plus the memory's records, each a
    good demonstration when its truth is ``good`` and a bad one otherwise, with ``x`` the
    task fields and ``y`` the response fields; the scorer is rebuilt when the memory changes.
    The label probability is the score itself (the share of good demonstrations that best
    explains the response), so AUC ranks records by it.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 spec: TaskSpec, *,
                 seed_good: Sequence[AuditRecord], seed_bad: Sequence[AuditRecord],
                 good: str | None = None, threshold: float = 0.5, num_ratios: int = 3,
                 demos_per_set: int = 2, sets_per_ratio: int = 2, seed: int = 0,
                 backend: str = "auto", calibration: str = "none",
                 score: str = "argmax") -> None:
        if len(spec.options) != 2:
            raise ValueError("the ICQS evaluator labels binary tasks only")
        self.model, self.tok, self.spec = model, tokenizer, spec
        self.good = good if good is not None else spec.positive
        self.bad = [o for o in spec.options if o != self.good][0]
        self.threshold = threshold
        self.kw = dict(num_ratios=num_ratios, demos_per_set=demos_per_set,
                       sets_per_ratio=sets_per_ratio, seed=seed, replacement=True,
                       backend=backend, drop_oldest_demos=True, calibration=calibration,
                       score=score)
        from icqs_fast.engine.settings import ScoringSettings

        ScoringSettings.build(**self.kw)  # a bad option fails here, not at the first round
        self.seed_good, self.seed_bad = list(seed_good), list(seed_bad)
        self._key: tuple | None = None
        self._scorer = None

    def describe(self) -> str:
        cal = "" if self.kw["calibration"] == "none" else f", calibration {self.kw['calibration']}"
        kind = "" if self.kw["score"] == "argmax" else f", {self.kw['score']} score"
        return f"ICQS-Epistemic score >= {self.threshold} -> {self.good!r}{cal}{kind}"

    def xy(self, rec: AuditRecord) -> tuple[str, str]:
        """The record as an ICQS (x, y) pair: task fields, then response fields."""
        resp = set(self.spec.response_fields)
        x = "\n\n".join(v for k, v in rec.fields.items() if k not in resp and k != "reference")
        y = "\n\n".join(rec.fields[k] for k in self.spec.response_fields if k in rec.fields)
        return x, y

    def _scorer_for(self, memory: Sequence[MemoryItem]):
        key = tuple(m.record.id for m in memory)
        if self._scorer is None or key != self._key:
            recs = self.seed_good + self.seed_bad + [m.record for m in memory]
            good = [self.xy(r) for r in recs if r.truth == self.good]
            bad = [self.xy(r) for r in recs if r.truth != self.good]
            if not good or not bad:
                raise ValueError("the ICQS evaluator needs at least one good and one bad "
                                 "demonstration (seed_good / seed_bad)")
            self._scorer = ICQSScorer(self.model, self.tok, good, bad, **self.kw)
            self._key = key
        return self._scorer

    def evaluate(self, records: Sequence[AuditRecord], memory: Sequence[MemoryItem], *,
                 progress: Callable | None = None) -> list[Judgment]:
        scorer = self._scorer_for(memory)
        out = []
        for res in scorer.score([self.xy(r) for r in records]):
            s = float(res.score)
            label = self.good if s >= self.threshold else self.bad
            ll = res.loglik.double()
            feats = {"icqs_score": s, "loglik_best": float(ll.mean(1).max()),
                     "loglik_spread": float(ll.mean(1).max() - ll.mean(1).min()),
                     "n_response_tokens": float(res.n_response_tokens),
                     # Stability diagnostics: the argmax's distance from a tie.
                     "icqs_margin": float(res.margin), "icqs_near_ties": float(res.near_ties)}
            out.append(Judgment(label, {self.good: s, self.bad: 1.0 - s}, {}, feats))
            if progress is not None:
                progress(1)
        return out
