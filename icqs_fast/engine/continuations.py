"""Log-likelihoods of continuations after contexts that share prefixes.

The shared primitive behind the lm-eval model, the study's baselines (Ask LLM, ICL labels) and
the ALLURE evaluators: many ``(context, continuation)`` token-id pairs whose contexts share long
leading runs (a few-shot prefix, a judge template, an example memory, the question every answer
option shares). Each request's context minus its last token goes into a :class:`PrefixBank`,
whose token trie computes every shared run once; the last context token and the continuation
then run as a short suffix against it, and the LM head is applied only at the continuation
positions through :func:`icqs_fast.ops.linear_token_stats` (no ``[tokens, vocab]`` logits).

Contexts are taken as given: add BOS yourself when the tokenizer uses one, and truncate to the
model's length limit before calling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from icqs_fast import ops
from icqs_fast.engine.batching import (
    PrefixBank,
    model_device,
    plain_hidden,
    plain_logits,
    suffix_hidden,
)
from icqs_fast.engine.capability import ModelPlan, dense_head_weight, model_plan
from icqs_fast.engine.memory_plan import bank_cap_bytes
from icqs_fast.engine.scorer import DEFAULT_TOKEN_BUDGET, SUFFIX_CHUNK_CPU
from icqs_fast.types import TokenStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# KV memory one chunk's prefix bank may hold when ``max_bank_tokens`` is not given, on the CPU
# (a GPU's scales with its free memory: memory_plan.bank_cap_bytes). Requests are processed in
# chunks of consecutive (sorted) contexts whose stored prefixes fit this; a chunk boundary only
# costs recomputing the runs shared across it. Pass ``max_bank_tokens`` to change it.
DEFAULT_BANK_BYTES = 512 * 2**20


@dataclass
class ContinuationResult:
    """Scores of one continuation.

    Attributes:
        loglik: ``sum_t log P(cont_t | context, cont_<t)`` (float64 sum of fp32 log-probs).
        is_greedy: every continuation token is the argmax of its next-token distribution.
        n_tokens: number of continuation tokens.
        token_logprobs: the ``n_tokens`` per-token log-probs.
        stats: per-token :class:`TokenStats` (every field ``[n_tokens]``, CPU) when requested.
    """

    loglik: float
    is_greedy: bool
    n_tokens: int
    token_logprobs: list[float]
    stats: TokenStats | None = None


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of keys + values one token takes in a prefix bank (all layers), from the config."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None) or 1
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or 1
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or 64 * heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    elem = next(model.parameters()).element_size()
    return int(layers * 2 * kv_heads * head_dim * elem)


def _check_requests(requests: Sequence) -> list[tuple[list[int], list[int]]]:
    out = []
    for i, req in enumerate(requests):
        try:
            ctx, cont = req
        except (TypeError, ValueError):
            raise ValueError(f"request {i}: expected a (context_ids, continuation_ids) pair, "
                             f"got {type(req).__name__}") from None
        ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
        if not ctx:
            raise ValueError(f"request {i}: empty context (a continuation needs at least one "
                             "context token to be predicted from, e.g. BOS)")
        if not cont:
            raise ValueError(f"request {i}: empty continuation")
        out.append((ctx, cont))
    return out


@torch.no_grad()
def score_continuations(
    model: PreTrainedModel,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_id: int | None = None,
    backend: str = "auto",
    token_budget: int = DEFAULT_TOKEN_BUDGET,
    return_token_stats: bool = False,
    max_bank_tokens: int | None = None,
    cascade: bool | None = None,
    deterministic: bool = False,
) -> list[ContinuationResult]:
    """Score ``R`` continuations, computing the contexts' shared leading tokens once.

    Args:
        model: a causal LM, in eval mode; the capability check
            (:func:`icqs_fast.engine.capability.model_plan`) decides once whether the prefix bank
            serves it (else every request runs as one plain forward of context + continuation).
        requests: ``R`` pairs ``(context_ids, continuation_ids)`` of token ids; the context
            holds at least one token, the continuation at least one.
        pad_id: id used for padding (any valid id: padded positions are masked); default the
            config's pad / eos id, else 0.
        backend: backend of :func:`icqs_fast.ops.linear_token_stats`.
        token_budget: tokens per forward (rows x suffix tokens; capped at ``SUFFIX_CHUNK_CPU``
            on the CPU with cascade attention, as in the ICQS engine).
        return_token_stats: attach per-token :class:`TokenStats` to each result.
        max_bank_tokens: most prefix tokens one chunk's bank holds (default:
            ``DEFAULT_BANK_BYTES`` of KV states for this model on the CPU, a quarter of a
            GPU's free memory: :func:`icqs_fast.engine.memory_plan.bank_cap_bytes`).
        cascade: as in :func:`icqs_fast.engine.batching.suffix_hidden`.
        deterministic: batch-invariant mode: every distinct context's stored prefix is computed
            in a prefix forward of its own (no trie split that depends on the other contexts;
            requests with the same context still share it), and every request's suffix runs in
            a forward of its own, with an LM-head call of its own. A request's results are then
            bit-identical whatever else is in ``requests``, their order, ``token_budget`` and
            ``max_bank_tokens`` (the same as scoring it alone). Slower: one suffix forward per
            request.

    Returns:
        ``R`` :class:`ContinuationResult`, in request order.
    """
    reqs = _check_requests(requests)
    if not reqs:
        return []
    plan = model_plan(model)
    if pad_id is None:
        cfg = model.config
        pad = getattr(cfg, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else getattr(cfg, "eos_token_id", None)
        vocab = int(dense_head_weight(model.get_output_embeddings()).shape[0])
        pad_id = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    cascade = plan.path == "cascade" and cascade is not False
    budget = token_budget
    if (cascade or not plan.bank) and model_device(model).type == "cpu":
        budget = min(budget, SUFFIX_CHUNK_CPU)
    if max_bank_tokens is None:
        max_bank_tokens = max(1, bank_cap_bytes(model_device(model), DEFAULT_BANK_BYTES)
                              // kv_bytes_per_token(model))

    results: list[ContinuationResult | None] = [None] * len(reqs)
    # Rows: (request index, stored prefix, suffix). The suffix starts with the context's last
    # token, whose hidden state predicts the first continuation token.
    rows = [(i, tuple(ctx[:-1]), ctx[-1:] + cont[:-1]) for i, (ctx, cont) in enumerate(reqs)]
    batches = (lambda rs, _b: [[r] for r in rs]) if deterministic else _batches
    if not plan.bank:  # the plain path: context + continuation in one forward, no bank
        rows = [(i, (), ctx + cont[:-1]) for i, (ctx, cont) in enumerate(reqs)]
        for batch in batches(rows, budget):
            score_plain(model, batch, reqs, results, pad_id, backend, return_token_stats, plan)
        return results  # type: ignore[return-value]
    bare = [r for r in rows if not r[1]]  # one-token contexts: nothing to store
    stored = sorted((r for r in rows if r[1]), key=lambda r: r[1])  # shared runs adjacent
    for batch in batches(bare, budget):
        score_plain(model, batch, reqs, results, pad_id, backend, return_token_stats, plan)
    for chunk in _bank_chunks(stored, max_bank_tokens):
        bank = PrefixBank(model, pad_id, token_budget, body=plan.body, layers=plan.layers)
        uniq = list(dict.fromkeys(r[1] for r in chunk))
        if deterministic:  # one prefix per add: a single trie edge, one forward of its own
            entry = {p: bank.add([list(p)])[0] for p in uniq}
        else:
            entry = dict(zip(uniq, bank.add([list(p) for p in uniq]), strict=True))
        for batch in batches(chunk, budget):
            hidden, _ = suffix_hidden(model, bank, [entry[r[1]] for r in batch],
                                      [r[2] for r in batch], pad_id, cascade=cascade)
            _head(plan, hidden, batch, reqs, results, backend, return_token_stats)
        del bank
    return results  # type: ignore[return-value]


def _bank_chunks(rows: list, max_tokens: int) -> list[list]:
    """Consecutive rows whose distinct stored prefixes hold at most ``max_tokens`` tokens (at
    least one prefix per chunk); rows of one prefix never straddle two chunks."""
    chunks: list[list] = []
    cur: list = []
    held = 0
    last = None
    for r in rows:
        if r[1] != last:
            if cur and held + len(r[1]) > max_tokens:
                chunks.append(cur)
                cur, held = [], 0
            held += len(r[1])
            last = r[1]
        cur.append(r)
    if cur:
        chunks.append(cur)
    return chunks


def _batches(rows: list, budget: int) -> list[list]:
    """Consecutive rows with rows x longest suffix <= ``budget`` (at least one row)."""
    out: list[list] = []
    cur: list = []
    longest = 0
    for r in rows:
        ln = max(longest, len(r[2]))
        if cur and (len(cur) + 1) * ln > budget:
            out.append(cur)
            cur, ln = [], len(r[2])
        cur.append(r)
        longest = ln
    if cur:
        out.append(cur)
    return out


def score_plain(model: PreTrainedModel, batch, reqs, results, pad_id, backend, want_stats,
                plan: ModelPlan | None = None) -> None:
    """Rows with nothing stored (one-token contexts, or every row on the plain path): a plain
    right-padded forward of each row's tokens."""
    plan = model_plan(model) if plan is None else plan
    dev = model_device(model)
    seqs = [r[2] for r in batch]
    out = plain_logits(model, seqs, pad_id, dev, plan.pad_safe, plan.positional_layers) \
        if plan.own_logits else \
        plain_hidden(plan.body, seqs, pad_id, dev, plan.pad_safe, plan.positional_layers)
    _head(plan, out, batch, reqs, results, backend, want_stats)


def _head(plan, hidden, batch, reqs, results, backend, want_stats) -> None:
    """LM-head statistics at each row's continuation positions: the last ``len(cont)`` positions
    of its suffix (which ends with ``cont[:-1]``) predict the continuation. ``hidden`` is the
    body's states (fused head + epilogue) or, for a model scored from its own logits, those."""
    dev = hidden.device
    rows_idx, pos_idx, targets, seg = [], [], [], []
    for b, r in enumerate(batch):
        cont = reqs[r[0]][1]
        start = len(r[2]) - len(cont)
        rows_idx.extend([b] * len(cont))
        pos_idx.extend(range(start, start + len(cont)))
        targets.extend(cont)
        seg.append(len(cont))
    h = hidden[torch.tensor(rows_idx, device=dev), torch.tensor(pos_idx, device=dev)]
    tgt = torch.tensor(targets, device=dev)
    st = ops.token_stats(h, tgt, backend=backend) if plan.own_logits else \
        plan.head_stats(h, tgt, backend)
    # One device-to-host copy per batch (every field asked for, packed), sliced on the host:
    # not one per request nor one per field.
    host = st.to_host(None if want_stats else ("logprob", "is_greedy"))
    lp, greedy = host.logprob.float(), host.is_greedy
    st_host = host if want_stats else None
    start = 0
    for r, n in zip(batch, seg, strict=True):
        tok = lp[start:start + n]
        stats = None
        if st_host is not None:
            stats = st_host.map(lambda t, a=start, b=start + n: t[a:b])
        results[r[0]] = ContinuationResult(
            loglik=float(tok.double().sum()), is_greedy=bool(greedy[start:start + n].all()),
            n_tokens=n, token_logprobs=tok.tolist(), stats=stats)
        start += n
