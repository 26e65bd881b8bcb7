"""ICQS as usually written: one full forward per (response, demonstration set), full logits,
``torch.log_softmax``, gather and sum over the response tokens. Slow on purpose; it is what the
engine is checked and timed against. Same demo sets and token ids as :class:`ICQSScorer`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .backends import torch_ref
from .icqs import (
    ICQSResult,
    PromptTokens,
    model_max_length,
    parse_response,
    summarise,
)
from .prompts import Template, build_demo_sets
from .types import TokenStats


@torch.no_grad()
def icqs_naive(
    model: Any,
    tokenizer: Any,
    good: Sequence,
    bad: Sequence,
    responses: Iterable,
    *,
    num_ratios: int = 5,
    demos_per_set: int = 8,
    sets_per_ratio: int = 4,
    template: Template | None = None,
    seed: int = 0,
    mixing: str = "exact",
    replacement: bool = False,
    max_length: int | None = None,
    drop_oldest_demos: bool = False,
    return_token_stats: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    token_budget: int | None = None,
    cascade: bool | None = None,
) -> list[ICQSResult]:
    """Naive ICQS / ICQS-Epistemic; arguments as :class:`icqs_fast.ICQSScorer`. The engine-only
    ``backend``, ``token_budget`` and ``cascade`` are accepted (so one settings dict drives both)
    and have no effect here; any other unknown argument is a TypeError.

    ``compute_dtype`` is the dtype of the full-vocabulary ``log_softmax`` (the logits are cast
    to it): float32 as usually written, float64 for an accuracy reference (fp32 log_softmax over
    a 49k vocabulary is off by ~5e-6 per token, which adds up over long responses).

    Returns:
        one :class:`ICQSResult` per response; ``loglik`` ``[M+1, L]`` fp32 (summed in float64).
    """
    # No check_model here: this path scores the model's own logits, so it is right for models
    # whose head the engine refuses.
    template = template if template is not None else Template()
    sets = build_demo_sets(good, bad, num_ratios=num_ratios, demos_per_set=demos_per_set,
                           sets_per_ratio=sets_per_ratio, seed=seed, mixing=mixing,
                           replacement=replacement)
    ratios = [row[0].ratio for row in sets]
    toks = PromptTokens(tokenizer, template, sets)
    max_len = model_max_length(model, max_length)
    dev = next(model.parameters()).device
    n_ctx = num_ratios * sets_per_ratio
    out = []
    for i, item in enumerate(responses):
        x, y = parse_response(i, item)
        q, r = toks.response_parts(i, x, y)
        ll = torch.zeros(n_ctx, dtype=torch.float64)
        n_prompt, n_drop, stats = [], [], []
        for c in range(n_ctx):
            d = toks.fit(i, c, len(q) + len(r), max_len, drop_oldest_demos)
            prompt = toks.prefix_ids(c, d) + q
            ids = torch.tensor([prompt + r], device=dev)
            logits = model(input_ids=ids).logits[0].to(compute_dtype)  # [len, V]
            logp = torch.log_softmax(logits, dim=-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(r), device=dev)
            tgt = torch.tensor(r, device=dev)
            ll[c] = logp[pos, tgt].double().sum()
            if return_token_stats:
                stats.append(torch_ref.token_stats(logits[pos], tgt, compute_dtype=compute_dtype)
                             .map(lambda t: t.cpu()))
            n_prompt.append(len(prompt))
            n_drop.append(d)
        st = None
        if return_token_stats:
            st = TokenStats(**{k: torch.stack([getattr(s, k) for s in stats])
                               .reshape(num_ratios, sets_per_ratio, -1)
                               for k in stats[0].as_dict()})
        shape = (num_ratios, sets_per_ratio)
        out.append(summarise(i, ll.float().reshape(shape), ratios, len(r),
                             torch.tensor(n_prompt).reshape(shape),
                             torch.tensor(n_drop).reshape(shape), st))
    return out
