"""Torch reference backend: small and obviously correct; what the tests compare the others to.

It materialises ``[N, V]`` intermediates, so it is the slow, memory-hungry path: use it to check,
not to run.
"""

from __future__ import annotations

import torch

from ..types import TokenStats


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> TokenStats:
    """Reference statistics; see :func:`icqs_fast.ops.token_stats` for the contract."""
    z = logits.to(compute_dtype)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = torch.log_softmax(z / temperature, dim=-1)
    p = logp.exp()
    # 0 * log 0 = 0 for masked (-inf) entries.
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    entropy = -plogp.sum(-1)
    second = torch.where(p > 0, p * logp * logp, torch.zeros_like(p)).sum(-1)
    varentropy = (second - entropy * entropy).clamp_min(0)
    finite = torch.isfinite(logp)
    n_fin = finite.sum(-1)
    lp0 = torch.where(finite, logp, torch.zeros_like(logp))
    mean = lp0.sum(-1) / n_fin.clamp_min(1)
    dev = torch.where(finite, logp - mean[:, None], torch.zeros_like(logp))
    logprob_var = (dev * dev).sum(-1) / (n_fin - 1).clamp_min(1)
    tgt_logit = z.gather(-1, safe_t[:, None])[:, 0]
    logprob = logp.gather(-1, safe_t[:, None])[:, 0]
    max_logprob = logp.max(-1).values
    is_greedy = z.argmax(-1) == safe_t
    target_rank = (z > tgt_logit[:, None]).sum(-1)
    out = TokenStats(
        logprob=logprob,
        entropy=entropy,
        varentropy=varentropy,
        logprob_var=logprob_var,
        max_logprob=max_logprob,
        is_greedy=is_greedy,
        target_rank=target_rank.long(),
        valid=valid,
    )
    return _zero_invalid(out, valid)


def _zero_invalid(s: TokenStats, valid: torch.Tensor) -> TokenStats:
    def z(x: torch.Tensor) -> torch.Tensor:
        x = x.float() if x.is_floating_point() else x
        return torch.where(valid, x, torch.zeros_like(x))

    res = s.map(z)
    res.valid = valid
    return res


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> TokenStats:
    """Reference: materialise the logits in fp32, then :func:`token_stats`."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return token_stats(logits, targets, ignore_index=ignore_index, temperature=temperature)
from .state import reduce_block  # noqa: E402,F401  (the torch block reduction for chunked ops)
