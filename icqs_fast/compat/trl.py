"""Drop-in replacements for TRL's ``trl.trainer.utils`` softmax helpers (TRL 1.16 semantics).

``selective_log_softmax`` and ``entropy_from_logits`` take the same arguments, accept any leading
dimensions and return the same shapes and dtypes as TRL's, but read the logits once through
:func:`icqs_fast.ops.token_stats` instead of materialising ``log_softmax`` over the vocabulary.
Both are differentiable: the backward recomputes the softmax in row chunks (forward-only users
pay nothing for that).

Usage in a package that imports TRL's helpers::

    from icqs_fast.compat.trl import entropy_from_logits, selective_log_softmax
"""

from __future__ import annotations

import torch

from .. import ops

_BACKWARD_CHUNK_ROWS = 128


def _stats(flat: torch.Tensor, idx: torch.Tensor, temperature: float):
    return ops.token_stats(flat.detach(), idx, temperature=temperature, ignore_index=-(2**62))


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat: torch.Tensor, idx: torch.Tensor, temperature: float):
        # idx: [R, K]; the statistics kernel reads each row once for the first index, which
        # gives the log-normaliser; the other K-1 are gathers.
        s = _stats(flat, idx[:, 0].contiguous(), temperature)
        x_first = flat.gather(-1, idx[:, :1]).float()[:, 0] / temperature
        lse = x_first - s.logprob
        out = flat.gather(-1, idx).float() / temperature - lse[:, None]
        ctx.save_for_backward(flat, idx, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, idx, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
        for r0 in range(0, flat.shape[0], _BACKWARD_CHUNK_ROWS):
            r1 = min(flat.shape[0], r0 + _BACKWARD_CHUNK_ROWS)
            p = torch.exp(flat[r0:r1].float() / t - lse[r0:r1, None])
            g = grad_out[r0:r1].float()
            # d/dz_v sum_k g_k (z_{i_k}/T - lse) = (sum_k g_k [v == i_k] - p_v sum_k g_k) / T
            blk = -p * g.sum(-1, keepdim=True)
            blk.scatter_add_(-1, idx[r0:r1], g)
            grad[r0:r1] = blk / t
        return grad.to(flat.dtype), None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat: torch.Tensor):
        idx = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        s = _stats(flat, idx, 1.0)
        lse = flat[:, 0].float() - s.logprob
        ctx.save_for_backward(flat, lse, s.entropy)
        return s.entropy

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, lse, ent = ctx.saved_tensors
        grad = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
        for r0 in range(0, flat.shape[0], _BACKWARD_CHUNK_ROWS):
            r1 = min(flat.shape[0], r0 + _BACKWARD_CHUNK_ROWS)
            logp = flat[r0:r1].float() - lse[r0:r1, None]
            p = torch.exp(logp)
            # dH/dz_v = -p_v (log p_v + H); 0 * (-inf) for masked entries is 0.
            d = torch.where(p > 0, -p * (logp + ent[r0:r1, None]), torch.zeros_like(p))
            grad[r0:r1] = d * grad_out[r0:r1, None].float()
        return grad.to(flat.dtype)


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gather(log_softmax(logits / temperature), -1, index)`` in one read of the logits.

    Args:
        logits: ``[..., V]`` float32, float16 or bfloat16.
        index: ``[...]`` (one id per row) or ``[..., K]`` int64 ids.
        temperature: T > 0.
        row_mask: optional, same shape as ``index``; entries where it is 0 return 0.

    Returns:
        Log-probabilities shaped like ``index``, in ``logits.dtype`` (as TRL returns them).
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    squeeze = index.ndim == logits.ndim - 1
    idx = index.unsqueeze(-1) if squeeze else index
    if idx.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"index shape {list(index.shape)} does not match logits shape {list(logits.shape)}"
        )
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    flat_idx = idx.reshape(flat.shape[0], idx.shape[-1]).long()
    out = _SelectiveLogSoftmax.apply(flat, flat_idx, float(temperature))
    out = out.reshape(idx.shape).to(logits.dtype)
    if squeeze:
        out = out.squeeze(-1)
    if row_mask is not None:
        out = out.masked_fill(row_mask == 0, 0.0)
    return out


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last axis, one read of the logits.

    Args:
        logits: ``[..., V]`` float32, float16 or bfloat16.
        chunk_size: accepted for signature compatibility with TRL; the kernels need no row
            chunking in the forward (it bounds the backward's row chunks instead).

    Returns:
        ``logits.shape[:-1]`` entropies in ``logits.dtype``.
    """
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _Entropy.apply(flat).reshape(lead).to(logits.dtype)


__all__ = ["selective_log_softmax", "entropy_from_logits"]
