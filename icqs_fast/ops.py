"""Public operations, one function each, dispatching to the ``triton``, ``cpp`` or ``torch``
backend.

Kernels hold no model logic and model code holds no kernel code: everything the scoring methods
need from the softmax goes through these functions.
"""

from __future__ import annotations

import math

import torch

from . import backends
from .backends import state as _state
from .types import TokenStats

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_common(targets: torch.Tensor, n: int, v: int, ignore_index: int, temperature: float):
    ok = isinstance(temperature, (int, float)) and math.isfinite(temperature)
    if not (ok and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape [{n}], got {list(targets.shape)}")
    if n:
        valid = targets != ignore_index
        bad = valid & ((targets < 0) | (targets >= v))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"targets[{i}] = {int(targets[i])} is outside the vocabulary [0, {v}) "
                f"and is not ignore_index ({ignore_index})"
            )


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    backend: str = "auto",
) -> TokenStats:
    """Per-token statistics of softmax(logits / temperature) in one read of each row.

    Args:
        logits: ``[N, V]`` (or ``[..., V]``, flattened) float32, float16 or bfloat16; rows may be
            strided (the last dimension must be contiguous for the cpp and triton backends,
            otherwise it is copied).
        targets: ``[N]`` (or ``[...]``) int64 target ids; ``ignore_index`` marks rows to skip.
        ignore_index: target value of masked rows; their outputs are 0 and ``valid`` False.
        temperature: T > 0; statistics are of softmax(z / T).
        backend: ``"auto"`` (triton on CUDA, cpp on CPU when built, torch otherwise),
            ``"triton"``, ``"cpp"`` or ``"torch"``.

    Returns:
        :class:`TokenStats` with fields shaped like ``targets``: fp32 ``logprob``, ``entropy``,
        ``varentropy``, ``logprob_var``, ``max_logprob``; bool ``is_greedy``; int64
        ``target_rank``; bool ``valid``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise TypeError("logits must be a tensor of shape [N, V]")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    lead = logits.shape[:-1]
    if targets.shape != lead:
        raise ValueError(
            f"targets shape {list(targets.shape)} does not match logits' leading shape {list(lead)}"
        )
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    t = targets.reshape(-1)
    _check_common(t, z.shape[0], v, ignore_index, temperature)
    if targets.device != logits.device:
        raise ValueError(f"logits on {logits.device} but targets on {targets.device}")
    name = backends.resolve(backend, logits.device)
    out = backends.module(name).token_stats(z, t.long(), ignore_index, float(temperature))
    return out.map(lambda x: x.reshape(lead)) if len(lead) != 1 else out


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    backend: str = "auto",
    chunk_tokens: int = 256,
    chunk_vocab: int = 16384,
) -> TokenStats:
    """Token statistics of ``softmax((hidden @ weight.T + bias) / T)``, never building ``[N, V]``.

    The product is computed block by block (``chunk_tokens`` x ``chunk_vocab``); each block is
    reduced to a mergeable per-row state and dropped. Peak extra memory on the cpp/torch backends
    is about ``chunk_tokens * chunk_vocab * 4`` bytes for the fp32 logits block (x ~6 on the torch
    backend, whose block reduction makes temporaries; 16 MiB x ~1 on cpp with the defaults), plus
    ``O(N)`` for the states - independent of N x V. The triton backend fuses the product and the
    reduction and keeps only ``O(N * V / BLOCK_V)`` partial states.

    Args:
        hidden: ``[N, H]`` float32/float16/bfloat16 hidden states (e.g. before the LM head).
        weight: ``[V, H]`` LM-head weight, same dtype as ``hidden``.
        targets: ``[N]`` int64 target ids; ``ignore_index`` rows are skipped.
        bias: optional ``[V]`` bias.
        temperature, ignore_index, backend: as in :func:`token_stats`.
        chunk_tokens, chunk_vocab: block sizes of the cpp/torch path.

    Returns:
        :class:`TokenStats` as in :func:`token_stats`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got {list(hidden.shape)} and "
            f"{list(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    n, v = hidden.shape[0], weight.shape[0]
    _check_common(targets, n, v, ignore_index, temperature)
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError("chunk_tokens and chunk_vocab must be >= 1")
    name = backends.resolve(backend, hidden.device)
    mod = backends.module(name)
    if name == "triton":
        return mod.linear_token_stats(hidden, weight, targets.long(), bias, ignore_index,
                                      float(temperature))
    return _chunked_linear(hidden, weight, targets.long(), bias, ignore_index, float(temperature),
                           chunk_tokens, chunk_vocab, mod.reduce_block)


def _chunked_linear(hidden, weight, targets, bias, ignore_index, temperature, ct, cv, reduce_block):
    n, v = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    # Target logits once, from the same fp32 product as the blocks use (row-wise dot product).
    w_t = weight.index_select(0, safe_t)
    z_t = (hidden.float() * w_t.float()).sum(-1).double()
    if bias is not None:
        z_t = z_t + bias.float().index_select(0, safe_t).double()
    shift = torch.where(torch.isfinite(z_t), z_t / temperature, torch.zeros_like(z_t))
    parts = []
    wf = weight
    for r0 in range(0, n, ct):
        r1 = min(n, r0 + ct)
        h = hidden[r0:r1].float()
        acc = _state.empty(r1 - r0, hidden.device)
        for c0 in range(0, v, cv):
            c1 = min(v, c0 + cv)
            z = h @ wf[c0:c1].float().t()
            if bias is not None:
                z += bias[c0:c1].float()
            blk = reduce_block(z, safe_t[r0:r1] - c0, z_t[r0:r1], shift[r0:r1], temperature)
            acc = _state.merge(acc, blk)
            del z
        parts.append(_state.finalize(*acc, z_t[r0:r1], valid[r0:r1], temperature))
    if not parts:
        return _state.finalize(*_state.empty(0, hidden.device), z_t, valid, temperature)
    return TokenStats.cat(parts)
