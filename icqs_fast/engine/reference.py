"""ICQS as usually written: one full forward per (response, demonstration set), full logits,
``torch.log_softmax``, gather and sum over the response tokens. Slow on purpose; it is what the
engine is checked and timed against. Same settings object and demo sets as
:class:`ICQSScorer` (:class:`~icqs_fast.engine.settings.ScoringSettings`).

Tokenization is its own, on purpose: each prompt is the whole text (prefix + query + response as
one string) tokenized by one plain ``tokenizer(text)`` call (BOS as the tokenizer adds it), and
the response is every token from the first one that holds a character of the response (a token
straddling the query/response seam is scored with the response). It shares no tokenization code
with the engine, so a seam difference between the engine's ids and the full text's shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast.backends import torch_ref
from icqs_fast.engine.calibration import calibration_queries
from icqs_fast.engine.checks import model_max_length, parse_response
from icqs_fast.engine.prompts import build_demo_sets
from icqs_fast.engine.scorer import ICQSResult, summarise
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.types import TokenStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@torch.no_grad()
def icqs_naive(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    good: Sequence,
    bad: Sequence,
    responses: Iterable,
    settings: ScoringSettings | None = None,
    *,
    return_token_stats: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    **options: Any,
) -> list[ICQSResult]:
    """Naive ICQS / ICQS-Epistemic with the SAME settings as :class:`icqs_fast.ICQSScorer`: a
    :class:`~icqs_fast.engine.settings.ScoringSettings`, or its field names as keywords (which
    build it, or replace fields of ``settings``). Every result option is honoured (demonstration
    sets incl. ``stratify`` and ``strata_order``, template, ``max_length``,
    ``drop_oldest_demos``); the engine-only ``backend``, ``token_budget``, ``cascade`` and
    ``deterministic`` are
    accepted and have no effect here; any other unknown argument is a TypeError.

    ``compute_dtype`` is the dtype of the full-vocabulary ``log_softmax`` (the logits are cast
    to it): float32 as usually written, float64 for an accuracy reference (fp32 log_softmax over
    a 49k vocabulary is off by ~5e-6 per token, which adds up over long responses).

    Calibration (``calibration="content_free"`` / ``"pmi"``) is computed independently too: for
    every context, one more plain forward per baseline query (each content-free input in the
    template's query, or the bare premise) over its whole text, no caching; the result's
    ``loglik_baseline`` is their mean.

    Returns:
        one :class:`ICQSResult` per response; ``loglik`` ``[M+1, L]`` fp32 (summed in float64).
    """
    # No check_model here: this path scores the model's own logits, so it is right for models
    # whose head the engine refuses.
    st = settings_ = ScoringSettings.build(settings, **options)
    template = st.template
    num_ratios, sets_per_ratio = st.num_ratios, st.sets_per_ratio
    drop_oldest_demos = st.drop_oldest_demos
    sets = build_demo_sets(good, bad, **st.demo_set_options())
    ratios = [row[0].ratio for row in sets]
    flat = [s for row in sets for s in row]
    max_len = model_max_length(model, st.max_length)
    n_ctx = num_ratios * sets_per_ratio
    queries = [(tpl.format_query(xq), tpl) for tpl, xq in calibration_queries(st)]
    out = []
    for i, item in enumerate(responses):
        x, y = parse_response(i, item)
        ll = torch.zeros(n_ctx, dtype=torch.float64)
        base = torch.zeros(n_ctx, dtype=torch.float64)
        n_prompt, n_drop, stats, n_resp = [], [], [], []
        for c in range(n_ctx):
            demos = flat[c].examples
            for query, tpl in queries:  # the calibration baseline: the same, another query
                cal = _plain_loglik(model, tokenizer, demos, tpl, query, y, max_len,
                                    drop_oldest_demos, compute_dtype, i, c)[0]
                base[c] += cal / len(queries)
            ll[c], logits, pos, tgt, k0, d, ids = _plain_loglik(
                model, tokenizer, demos, template, template.format_query(x), y, max_len,
                drop_oldest_demos, compute_dtype, i, c, full=True)
            if return_token_stats:
                stats.append(torch_ref.token_stats(logits[pos], tgt, compute_dtype=compute_dtype)
                             .map(lambda t: t.cpu()))
            n_prompt.append(k0)
            n_drop.append(d)
            n_resp.append(len(ids) - k0)
        if len(set(n_resp)) != 1:
            raise ValueError(f"response {i}: different response token counts across contexts "
                             f"{n_resp}")
        st = None
        if return_token_stats:
            st = TokenStats(**{k: torch.stack([getattr(s, k) for s in stats])
                               .reshape(num_ratios, sets_per_ratio, -1)
                               for k in stats[0].as_dict()})
        shape = (num_ratios, sets_per_ratio)
        out.append(summarise(i, (ll if queries else ll.float()).reshape(shape), ratios,
                             n_resp[0], torch.tensor(n_prompt).reshape(shape),
                             torch.tensor(n_drop).reshape(shape), st,
                             base.reshape(shape) if queries else None,
                             calibration=settings_.calibration, score_kind=settings_.score,
                             tie_epsilon=settings_.tie_epsilon))
    return out


def _plain_loglik(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, demos: Sequence,
                  template: Any, query: str,
                  y: str, max_len: int | None, drop_oldest_demos: bool, compute_dtype: Any,
                  i: int, c: int, full: bool = False) -> tuple:
    """``log P(response(y) | prefix(demos) + query)`` by one plain forward over the whole text
    (dropping the oldest demonstrations until it fits when allowed): ``(loglik, logits,
    positions, targets, k0, drop, ids)`` (logits etc. only when ``full``)."""
    dev = next(model.parameters()).device
    for d in range(len(demos)):  # drop the oldest demonstrations until it fits
        before = template.format_prefix(demos[d:]) + query
        ids, k0 = _whole_text_ids(tokenizer, before, template.format_response(y))
        if max_len is None or len(ids) <= max_len or not drop_oldest_demos:
            break
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"response {i}: prompt of {len(ids)} tokens exceeds the max "
                         f"length {max_len} (context {c})")
    if k0 == len(ids) or k0 == 0:
        raise ValueError(f"response {i}: no response tokens or no prompt tokens")
    t_ids = torch.tensor([ids], device=dev)
    logits = model(input_ids=t_ids).logits[0].to(compute_dtype)  # [len, V]
    logp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(k0 - 1, len(ids) - 1, device=dev)  # position t predicts t + 1
    tgt = t_ids[0, k0:]
    ll = logp[pos, tgt].double().sum()
    if not full:
        return ll, None, None, None, k0, d, ids
    return ll, logits, pos, tgt, k0, d, ids


def _whole_text_ids(tokenizer: PreTrainedTokenizerBase, before: str,
                    response: str) -> tuple[list[int], int]:
    """Ids of ``before + response`` tokenized as one string (special tokens as the tokenizer
    adds them; ones it appends after the text, such as an EOS, are dropped: they are not part of
    the response) and the index of the first response token: the first token whose span ends
    inside the response (or starts at or after it)."""
    enc = tokenizer(before + response, return_offsets_mapping=True,
                    return_special_tokens_mask=True)
    ids, spans, special = enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"]
    while special and special[-1]:  # added after the text
        ids, spans, special = ids[:-1], spans[:-1], special[:-1]
    start = len(before)
    k0 = len(ids)
    for k, (a, b) in enumerate(spans):
        if not special[k] and (b > start or a >= start):
            k0 = k
            break
    return list(ids), k0
