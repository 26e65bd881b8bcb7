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
    """Reference statistics; see :func:`icqs_fast.ops.token_stats` for the contract.

    Non-finite logits (-inf, +inf, NaN) are masked vocabulary entries, as in every backend
    (:mod:`icqs_fast.backends.state`): left out of the softmax and its moments; ``target_rank``
    still counts entries that compare larger; ``is_greedy`` needs a finite target logit."""
    z = logits.to(compute_dtype)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long()
    x = z / temperature
    finite = torch.isfinite(x)
    has = finite.any(-1)
    xf = x.masked_fill(~finite, float("-inf"))
    lse = torch.logsumexp(xf, dim=-1)  # -inf for a row with no finite entry
    logp = torch.log_softmax(xf, dim=-1).masked_fill(~finite, 0.0)
    p = logp.exp().masked_fill(~finite, 0.0)
    entropy = -(p * logp).sum(-1)
    # Var_p[-log p] in two passes (E[x^2] - E[x]^2 cancels badly in fp32).
    varentropy = (p * (logp + entropy[:, None]).square()).sum(-1)
    n_fin = finite.sum(-1)
    mean = logp.sum(-1) / n_fin.clamp_min(1)
    dev = torch.where(finite, logp - mean[:, None], torch.zeros_like(logp))
    logprob_var = (dev * dev).sum(-1) / (n_fin - 1).clamp_min(1)
    tgt_logit = z.gather(-1, safe_t[:, None])[:, 0]
    logprob = tgt_logit / temperature - lse
    zero = torch.zeros_like(lse)
    max_logprob = torch.where(has, xf.amax(-1) - lse, zero)
    cols = torch.arange(z.shape[-1], device=z.device)[None, :]
    target_rank = (z > tgt_logit[:, None]).sum(-1)
    tie_before = ((z == tgt_logit[:, None]) & (cols < safe_t[:, None])).sum(-1)
    is_greedy = torch.isfinite(tgt_logit) & (target_rank == 0) & (tie_before == 0)
    out = TokenStats(
        logprob=logprob,
        entropy=torch.where(has, entropy, zero),
        varentropy=torch.where(has, varentropy, zero),
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
