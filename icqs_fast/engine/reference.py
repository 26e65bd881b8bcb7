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
from typing import Any

import torch

from icqs_fast.backends import torch_ref
from icqs_fast.engine.checks import model_max_length, parse_response
from icqs_fast.engine.prompts import build_demo_sets
from icqs_fast.engine.scorer import ICQSResult, summarise
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.types import TokenStats


@torch.no_grad()
def icqs_naive(
    model: Any,
    tokenizer: Any,
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

    Returns:
        one :class:`ICQSResult` per response; ``loglik`` ``[M+1, L]`` fp32 (summed in float64).
    """
    # No check_model here: this path scores the model's own logits, so it is right for models
    # whose head the engine refuses.
    st = ScoringSettings.build(settings, **options)
    template = st.template
    num_ratios, sets_per_ratio = st.num_ratios, st.sets_per_ratio
    drop_oldest_demos = st.drop_oldest_demos
    sets = build_demo_sets(good, bad, **st.demo_set_options())
    ratios = [row[0].ratio for row in sets]
    flat = [s for row in sets for s in row]
    max_len = model_max_length(model, st.max_length)
    dev = next(model.parameters()).device
    n_ctx = num_ratios * sets_per_ratio
    out = []
    for i, item in enumerate(responses):
        x, y = parse_response(i, item)
        ll = torch.zeros(n_ctx, dtype=torch.float64)
        n_prompt, n_drop, stats, n_resp = [], [], [], []
        for c in range(n_ctx):
            demos = flat[c].examples
            for d in range(len(demos)):  # drop the oldest demonstrations until it fits
                before = template.format_prefix(demos[d:]) + template.format_query(x)
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
            ll[c] = logp[pos, tgt].double().sum()
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
        out.append(summarise(i, ll.float().reshape(shape), ratios, n_resp[0],
                             torch.tensor(n_prompt).reshape(shape),
                             torch.tensor(n_drop).reshape(shape), st))
    return out


def _whole_text_ids(tokenizer: Any, before: str, response: str) -> tuple[list[int], int]:
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
