"""Drop-in replacements for TRL's ``trl.trainer.utils`` softmax helpers (TRL 1.16 semantics).

``selective_log_softmax`` and ``entropy_from_logits`` take the same arguments, accept any leading
dimensions and return the same shapes and dtypes as TRL's, but read the logits once through
:func:`icqs_fast.ops.token_stats` instead of materialising ``log_softmax`` over the vocabulary.
Both are differentiable: the backward recomputes the softmax in row chunks (forward-only users
pay nothing for that). They go through the ``torch.library`` ops of :mod:`icqs_fast.torch_ops`
(``icqs_fast::selective_log_softmax``, ``icqs_fast::entropy_from_logits`` and their backward
ops), so they also run inside ``torch.compile(fullgraph=True)``, forward and backward.

Usage in a package that imports TRL's helpers::

    from icqs_fast.compat.trl import entropy_from_logits, selective_log_softmax
"""

from __future__ import annotations

import torch

from icqs_fast import torch_ops  # noqa: F401 - registers torch.ops.icqs_fast.*


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
    out, _ = torch.ops.icqs_fast.selective_log_softmax(flat, flat_idx, float(temperature))
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
    ent, _ = torch.ops.icqs_fast.entropy_from_logits(flat)
    return ent.reshape(lead).to(logits.dtype)


__all__ = ["selective_log_softmax", "entropy_from_logits"]
