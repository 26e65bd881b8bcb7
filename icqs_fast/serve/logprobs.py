"""Prompt log-probabilities with top-N alternatives, the shared leading tokens computed once.

``/v1/completions`` with ``echo=True`` asks for ``log P(t_i | t_<i)`` at every prompt position
and the ``N`` most likely tokens there. The prompts of one batch (requests that arrive
together) form a token trie: each prompt is cut at the depths where it branches off another
prompt (or another prompt ends), and every distinct segment ``[d, e)`` of a path runs once - as
a plain forward when ``d == 0``, else as a suffix continuing the KV states of ``path[:d]`` held
in a :class:`icqs_fast.engine.batching.PrefixBank` (whose own trie computes the stored parents'
shared runs once). The LM head is applied to each segment's hidden states in fp32, and every
number of a position (its token's log-prob, its top-N) comes from the same ``log_softmax`` row,
so a token that is the argmax has exactly the top value (lm-eval reads ``is_greedy`` that way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import backends, ops
from icqs_fast.engine.batching import (
    PrefixBank,
    cache_kwarg,
    last_hidden,
    model_device,
    plain_hidden,
    plain_logits,
    suffix_hidden,
)
from icqs_fast.engine.capability import ModelPlan, dense_head_weight, model_plan
from icqs_fast.engine.cascade import PositionPlan, position_plan, positional_kernel
from icqs_fast.engine.scorer import DEFAULT_TOKEN_BUDGET, SUFFIX_CHUNK_CPU
from icqs_fast.invariant_linears import exact_bf16_products
from icqs_fast.models import is_bf16_mixed

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Rows of fp32 logits materialised at once (x vocabulary size).
HEAD_ROWS = 256


@dataclass
class PromptLogprobs:
    """Log-probs of one prompt of ``n`` tokens.

    Attributes:
        token_logprobs: ``n - 1`` floats, ``log P(t_i | t_<i)`` for ``i = 1 .. n-1``.
        top: ``n - 1`` lists of ``(token id, log-prob)``, the ``top_n`` most likely tokens at
            those positions, best first.
        next_top: the ``top_n`` most likely next tokens after the whole prompt.
        next_token, next_logprob: the argmax next token and its log-prob (greedy decoding).
    """

    token_logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    next_top: list[tuple[int, float]] = field(default_factory=list)
    next_token: int = 0
    next_logprob: float = 0.0


@dataclass
class _Segment:
    start: int
    path: tuple[int, ...]  # tokens [0, end) of the prompts that hold this segment
    in_lp: list[float] = field(default_factory=list)  # positions start .. end-2
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # start .. end-1
    last: torch.Tensor | None = None  # log_softmax row at position end-1, fp32 [V]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prompt_cuts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per prompt, the sorted depths ``0 < c_1 < ... < c_m = len`` at which it branches off
    another prompt of the batch or another prompt ends inside it (its trie nodes)."""
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    adj = [_lcp(prompts[order[k]], prompts[order[k + 1]]) for k in range(len(order) - 1)]
    cuts: list[list[int]] = [[] for _ in prompts]
    for k, i in enumerate(order):
        found = {len(prompts[i])}
        for rng in (range(k, len(adj)), range(k - 1, -1, -1)):
            m = None
            for j in rng:  # LCP with the prompt |j - k| + 1 places away: a running minimum
                m = adj[j] if m is None else min(m, adj[j])
                if m == 0:
                    break
                found.add(m)
        cuts[i] = sorted(found)
    return cuts


def _batches(items: list, length, budget: int) -> list[list]:
    """Consecutive items with rows x longest <= budget (at least one item per batch)."""
    out: list[list] = []
    cur: list = []
    longest = 0
    for it in items:
        ln = max(longest, length(it))
        if cur and (len(cur) + 1) * ln > budget:
            out.append(cur)
            cur, ln = [], length(it)
        cur.append(it)
        longest = ln
    if cur:
        out.append(cur)
    return out


def _head(model: PreTrainedModel, plan: ModelPlan, seg: _Segment, hidden: torch.Tensor, top_n: int
          ) -> None:
    """LM head (fp32, with the model's logit epilogue) over one segment's hidden states
    ``[len, H]``, or the model's own logits ``[len, V]`` when the plan scores from those."""
    head = model.get_output_embeddings()
    w = dense_head_weight(head)  # a quantised head's dense copy, made once per model
    bias = getattr(head, "bias", None)
    n = hidden.shape[0]
    # On the CPU the head multiplies through ops.linear (packed once per weight): a prompt's
    # log-probs are then the same bits alone and inside any batch; torch's product elsewhere.
    packed = (None if plan.own_logits or w.device.type != "cpu"
              or not backends.available("cpp")[0]
              else ops.pack_linear(w, exact_bf16_products() if is_bf16_mixed(head) else "fp32",
                                   backend="cpp", cache=True))
    wf = None
    for a in range(0, n, HEAD_ROWS):
        h = hidden[a: a + HEAD_ROWS].float()
        if not plan.own_logits:
            h = h.to(w.device)  # a split model (--device-map auto): the head's own device
        if plan.own_logits:
            logits = h
        elif packed is not None:
            logits = plan.head.apply(ops.linear(h, packed, bias))
        else:
            if wf is None:
                wf = w.float().t()  # once per call, not once per chunk
            logits = h @ wf
            if bias is not None:
                logits = logits + bias.float()
            logits = plan.head.apply(logits)
        lp = torch.log_softmax(logits, dim=-1)
        rows = range(a, a + h.shape[0])
        inner = [r for r in rows if seg.start + r + 1 < len(seg.path)]
        if inner:
            tgt = torch.tensor([seg.path[seg.start + r + 1] for r in inner], device=lp.device)
            vals = lp[torch.tensor(inner, device=lp.device) - a, tgt]
            seg.in_lp.extend(vals.cpu().tolist())
        if top_n > 0:
            tv, ti = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
            for ids, vs in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True):
                seg.top.append(list(zip(ids, vs, strict=True)))
        else:
            seg.top.extend([] for _ in rows)
        if a + h.shape[0] == n:
            seg.last = lp[-1].cpu()


@torch.no_grad()
def prompt_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    top_n: int = 0,
    pad_id: int = 0,
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    cascade: bool | None = None,
) -> list[PromptLogprobs]:
    """Echo log-probs of ``prompts`` (token id lists, each non-empty), in order; see the module
    docstring for how shared leading tokens are computed once."""
    prompts = [tuple(int(t) for t in p) for p in prompts]
    if any(not p for p in prompts):
        raise ValueError("a prompt must hold at least one token")
    if not prompts:
        return []
    plan = model_plan(model)
    cascade = plan.path == "cascade" and cascade is not False
    dev = model_device(model)
    budget = token_budget
    if (cascade or not plan.bank) and dev.type == "cpu":
        budget = min(budget, SUFFIX_CHUNK_CPU)
    # Without a bank (the plain path) every prompt is one segment of its own.
    cuts = prompt_cuts(prompts) if plan.bank else [[len(p)] for p in prompts]
    segs: dict[tuple[int, ...], _Segment] = {}
    for p, cs in zip(prompts, cuts, strict=True):
        d = 0
        for e in cs:
            segs.setdefault(p[:e], _Segment(d, p[:e]))
            d = e
    plain = [s for s in segs.values() if s.start == 0]
    stored = sorted((s for s in segs.values() if s.start > 0), key=lambda s: s.path)
    for batch in _batches(plain, lambda s: len(s.path), budget):
        seqs = [s.path for s in batch]
        out = plain_logits(model, seqs, pad_id, dev, plan.pad_safe, plan.positional_layers) \
            if plan.own_logits else \
            plain_hidden(plan.body, seqs, pad_id, dev, plan.pad_safe, plan.positional_layers)
        for b, s in enumerate(batch):
            _head(model, plan, s, out[b, : len(s.path)], top_n)
    if stored:
        bank = PrefixBank(model, pad_id, token_budget, body=plan.body, layers=plan.layers)
        parents = list(dict.fromkeys(s.path[: s.start] for s in stored))
        entry = dict(zip(parents, bank.add([list(p) for p in parents]), strict=True))
        for batch in _batches(stored, lambda s: len(s.path) - s.start, budget):
            hidden, _ = suffix_hidden(model, bank, [entry[s.path[: s.start]] for s in batch],
                                      [list(s.path[s.start:]) for s in batch], pad_id,
                                      cascade=cascade)
            for b, s in enumerate(batch):
                _head(model, plan, s, hidden[b, : len(s.path) - s.start], top_n)
        del bank
    return [_assemble(p, [segs[p[:e]] for e in cs]) for p, cs in zip(prompts, cuts, strict=True)]


def _assemble(p: tuple[int, ...], path_segs: list[_Segment]) -> PromptLogprobs:
    """The log-probs of prompt ``p`` from the segments of its path, in order."""
    res = PromptLogprobs()
    for s in path_segs:
        e = len(s.path)
        res.token_logprobs.extend(s.in_lp)
        res.top.extend(s.top)
        if e < len(p):  # the segment's last position predicts the next segment's first token
            res.token_logprobs.append(float(s.last[p[e]]))
        else:
            res.next_top = s.top[-1]
            res.next_token = int(torch.argmax(s.last))
            res.next_logprob = float(s.last[res.next_token])
            res.top.pop()
    return res


class PromptPrefill:
    """The echo log-probs of one prompt computed a chunk of tokens at a time (chunked prefill:
    the server's worker runs a long prompt over several steps, between generated tokens). Each
    :meth:`step` runs the next tokens through the model's body against the KV cache of those
    before (a transformers cache, kept between steps), and the same fp32 head as
    :func:`prompt_logprobs`; the chunks are the segments of a path cut at the chunk ends, so
    :meth:`result` equals ``prompt_logprobs(model, [prompt], top_n=top_n)[0]`` within the
    dtype's rounding of the attention's shapes.

    Args:
        model: a causal LM for which :meth:`supported` is True.
        prompt: its token ids (non-empty).
        top_n: alternatives kept per position.
    """

    def __init__(self, model: PreTrainedModel, prompt: Sequence[int], top_n: int = 0) -> None:
        from transformers import DynamicCache

        self.model = model
        self.plan = model_plan(model)
        self.prompt = tuple(int(t) for t in prompt)
        if not self.prompt:
            raise ValueError("a prompt must hold at least one token")
        self.top_n = int(top_n)
        self.dev = model_device(model)
        self.cache: Any = DynamicCache()
        self.segs: list[_Segment] = []
        self.pos = 0

    @staticmethod
    def supported(model: PreTrainedModel) -> bool:
        """True when a prompt of ``model`` can be run in chunks: the prefix bank serves it (a
        KV cache continues a prefix exactly), its head is the engine's and no layer is local (a
        sliding window over cache slots)."""
        plan = model_plan(model)
        return plan.bank and not plan.own_logits and not any(la.local for la in plan.layers)

    @property
    def done(self) -> bool:
        """Every token ran."""
        return self.pos >= len(self.prompt)

    @torch.no_grad()
    def step(self, tokens: int) -> bool:
        """Run the next ``tokens`` (>= 1) tokens; True once the whole prompt ran."""
        if self.cache is None:
            raise RuntimeError("the prefill was closed")
        a, b = self.pos, min(len(self.prompt), self.pos + max(1, int(tokens)))
        ids = torch.tensor([self.prompt[a:b]], dtype=torch.long, device=self.dev)
        body = self.plan.body
        pos = torch.arange(a, b, device=self.dev)[None]
        run = lambda: body(  # noqa: E731
            input_ids=ids, position_ids=pos,
            attention_mask=torch.ones((1, b), dtype=torch.long, device=self.dev),
            use_cache=True, **cache_kwarg(body, self.cache))
        if self.plan.layers and self.dev.type == "cpu" and positional_kernel(body, self.dev):
            # The kernel the whole prompt's forward takes, on positions: the chunks' numbers
            # are then that forward's bits.
            keys = torch.arange(b, device=self.dev)[None]
            with position_plan(body, PositionPlan(pos, keys, tuple(self.plan.layers))):
                out = run()
        else:
            out = run()
        seg = _Segment(a, self.prompt[:b])
        _head(self.model, self.plan, seg, last_hidden(out)[0], self.top_n)
        self.segs.append(seg)
        self.pos = b
        if self.done:
            self.cache = None
        return self.done

    def result(self) -> PromptLogprobs:
        """The prompt's log-probs (after :meth:`step` returned True)."""
        if not self.done:
            raise RuntimeError("the prompt has not run whole yet")
        return _assemble(self.prompt, self.segs)

    def close(self) -> None:
        """Drop the KV cache."""
        self.cache = None


__all__ = ["PromptLogprobs", "PromptPrefill", "prompt_cuts", "prompt_logprobs"]
