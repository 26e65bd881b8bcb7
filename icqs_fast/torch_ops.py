"""``torch.library`` registrations of the public ops, so they compose with ``torch.compile``
(``fullgraph=True``) and ``torch.export``.

Importing this module registers, in the ``icqs_fast`` namespace:

* ``torch.ops.icqs_fast.token_stats`` and ``torch.ops.icqs_fast.linear_token_stats``: the
  :func:`icqs_fast.ops` functions (same backends, same checks), returning the eight
  :class:`~icqs_fast.types.TokenStats` fields as a tuple in field order (no autograd: they are
  statistics for scoring, not training losses);
* ``torch.ops.icqs_fast.selective_log_softmax`` / ``entropy_from_logits`` and their backward
  ops: the differentiable pieces behind :mod:`icqs_fast.compat.trl`.

Each op has a fake (meta) implementation giving only shapes and dtypes, so the compiler and
``torch.export`` trace through it without running a kernel; the real implementation calls the
``ops`` functions, so no kernel logic lives here. Compiled graphs see each op as one opaque call
(the Triton/C++ kernels are not fused further). Data-dependent checks (targets outside the
vocabulary) run in the real implementation, at run time.

:func:`token_stats` and :func:`linear_token_stats` below are the convenience wrappers that
return a :class:`TokenStats` and are safe to call from compiled code.
"""

# No ``from __future__ import annotations``: torch.library infers each op's schema from the
# annotations' runtime values.
import math

import torch
from torch import Tensor

from icqs_fast import ops
from icqs_fast.types import TokenStats

_STATS = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
# Field order of the op outputs; the fake implementations give the same dtypes in this order.
_FIELDS = ("logprob", "entropy", "varentropy", "logprob_var", "max_logprob", "is_greedy",
           "target_rank", "valid")
_DTYPES = (torch.float32,) * 5 + (torch.bool, torch.int64, torch.bool)
# TRL's helpers never ignore a row: a target id nothing can equal.
_NO_IGNORE = -(2**62)
_BACKWARD_CHUNK_ROWS = 128


def _as_tuple(s: TokenStats) -> _STATS:
    # contiguous(): the compiler assumes the fake implementations' (contiguous) strides.
    return tuple(getattr(s, f).contiguous() for f in _FIELDS)  # type: ignore[return-value]


def _fake_stats(shape, device) -> _STATS:
    return tuple(torch.empty(shape, dtype=d, device=device) for d in _DTYPES)  # type: ignore


# --- token_stats -------------------------------------------------------------------------------


@torch.library.custom_op("icqs_fast::token_stats", mutates_args=())
def _token_stats_op(logits: Tensor, targets: Tensor, ignore_index: int, temperature: float,
                    backend: str) -> _STATS:
    return _as_tuple(ops.token_stats(logits, targets, ignore_index=ignore_index,
                                     temperature=temperature, backend=backend))


@_token_stats_op.register_fake
def _(logits, targets, ignore_index, temperature, backend):
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets shape {list(targets.shape)} does not match logits' leading "
                         f"shape {list(logits.shape[:-1])}")
    return _fake_stats(targets.shape, logits.device)


# --- linear_token_stats ------------------------------------------------------------------------


@torch.library.custom_op("icqs_fast::linear_token_stats", mutates_args=())
def _linear_token_stats_op(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                           ignore_index: int, temperature: float, backend: str, chunk_tokens: int,
                           chunk_vocab: int, logit_scale: float = 1.0,
                           softcap: float | None = None) -> _STATS:
    return _as_tuple(ops.linear_token_stats(
        hidden, weight, targets, bias=bias, ignore_index=ignore_index, temperature=temperature,
        backend=backend, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
        logit_scale=logit_scale, softcap=softcap))


@_linear_token_stats_op.register_fake
def _(hidden, weight, targets, bias, ignore_index, temperature, backend, chunk_tokens,
      chunk_vocab, logit_scale=1.0, softcap=None):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V, H]; got {list(hidden.shape)} and "
                         f"{list(weight.shape)}")
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"targets must have shape [{hidden.shape[0]}], got "
                         f"{list(targets.shape)}")
    return _fake_stats(targets.shape, hidden.device)


# --- TRL helpers: selective log-softmax --------------------------------------------------------


@torch.library.custom_op("icqs_fast::selective_log_softmax", mutates_args=())
def _selective_log_softmax_op(flat: Tensor, idx: Tensor, temperature: float
                              ) -> tuple[Tensor, Tensor]:
    # flat [R, V], idx [R, K] -> (log-probs [R, K] fp32, log-normaliser [R] fp32). The statistics
    # kernel reads each row once for the first index, which gives the log-normaliser; the other
    # K-1 are gathers.
    s = ops.token_stats(flat.detach(), idx[:, 0].contiguous(), temperature=temperature,
                        ignore_index=_NO_IGNORE)
    x_first = flat.gather(-1, idx[:, :1]).float()[:, 0] / temperature
    lse = x_first - s.logprob
    out = flat.gather(-1, idx).float() / temperature - lse[:, None]
    return out, lse


@_selective_log_softmax_op.register_fake
def _(flat, idx, temperature):
    if flat.dim() != 2 or idx.dim() != 2 or idx.shape[0] != flat.shape[0]:
        raise ValueError(f"expected flat [R, V] and idx [R, K]; got {list(flat.shape)} and "
                         f"{list(idx.shape)}")
    return (flat.new_empty(idx.shape, dtype=torch.float32),
            flat.new_empty(flat.shape[:1], dtype=torch.float32))


@torch.library.custom_op("icqs_fast::selective_log_softmax_backward", mutates_args=())
def _selective_log_softmax_backward_op(grad_out: Tensor, flat: Tensor, idx: Tensor, lse: Tensor,
                                       temperature: float) -> Tensor:
    """Gradient wrt ``flat [R, V]`` (in its dtype), recomputing the softmax in row chunks."""
    grad = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    for r0 in range(0, flat.shape[0], _BACKWARD_CHUNK_ROWS):
        r1 = min(flat.shape[0], r0 + _BACKWARD_CHUNK_ROWS)
        p = torch.exp(flat[r0:r1].float() / temperature - lse[r0:r1, None])
        g = grad_out[r0:r1].float()
        # d/dz_v sum_k g_k (z_{i_k}/T - lse) = (sum_k g_k [v == i_k] - p_v sum_k g_k) / T
        blk = -p * g.sum(-1, keepdim=True)
        blk.scatter_add_(-1, idx[r0:r1], g)
        grad[r0:r1] = blk / temperature
    return grad.to(flat.dtype)


@_selective_log_softmax_backward_op.register_fake
def _(grad_out, flat, idx, lse, temperature):
    return torch.empty_like(flat, memory_format=torch.contiguous_format)


def _sls_setup_context(ctx, inputs, output):
    flat, idx, temperature = inputs
    ctx.save_for_backward(flat, idx, output[1])
    ctx.temperature = temperature


def _sls_backward(ctx, grad_out, _grad_lse):
    # The log-normaliser output is internal (the compat wrapper never returns it): no gradient
    # flows through it.
    flat, idx, lse = ctx.saved_tensors
    grad = _selective_log_softmax_backward_op(grad_out, flat, idx, lse, ctx.temperature)
    return grad, None, None


_selective_log_softmax_op.register_autograd(_sls_backward, setup_context=_sls_setup_context)


# --- TRL helpers: entropy ----------------------------------------------------------------------


@torch.library.custom_op("icqs_fast::entropy_from_logits", mutates_args=())
def _entropy_op(flat: Tensor) -> tuple[Tensor, Tensor]:
    # flat [R, V] -> (entropy [R] fp32, log-normaliser [R] fp32), one read of each row.
    idx = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    s = ops.token_stats(flat.detach(), idx, ignore_index=_NO_IGNORE)
    lse = flat[:, 0].float() - s.logprob
    return s.entropy.contiguous(), lse


@_entropy_op.register_fake
def _(flat):
    if flat.dim() != 2:
        raise ValueError(f"expected flat [R, V], got {list(flat.shape)}")
    return (flat.new_empty(flat.shape[:1], dtype=torch.float32),
            flat.new_empty(flat.shape[:1], dtype=torch.float32))


@torch.library.custom_op("icqs_fast::entropy_from_logits_backward", mutates_args=())
def _entropy_backward_op(grad_out: Tensor, flat: Tensor, lse: Tensor, ent: Tensor) -> Tensor:
    """Gradient wrt ``flat [R, V]`` (in its dtype), recomputing the softmax in row chunks."""
    grad = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    for r0 in range(0, flat.shape[0], _BACKWARD_CHUNK_ROWS):
        r1 = min(flat.shape[0], r0 + _BACKWARD_CHUNK_ROWS)
        logp = flat[r0:r1].float() - lse[r0:r1, None]
        p = torch.exp(logp)
        # dH/dz_v = -p_v (log p_v + H); 0 * (-inf) for masked entries is 0.
        d = torch.where(p > 0, -p * (logp + ent[r0:r1, None]), torch.zeros_like(p))
        grad[r0:r1] = d * grad_out[r0:r1, None].float()
    return grad.to(flat.dtype)


@_entropy_backward_op.register_fake
def _(grad_out, flat, lse, ent):
    return torch.empty_like(flat, memory_format=torch.contiguous_format)


def _ent_setup_context(ctx, inputs, output):
    (flat,) = inputs
    ctx.save_for_backward(flat, output[1], output[0])


def _ent_backward(ctx, grad_ent, _grad_lse):
    flat, lse, ent = ctx.saved_tensors
    return _entropy_backward_op(grad_ent, flat, lse, ent)


_entropy_op.register_autograd(_ent_backward, setup_context=_ent_setup_context)


# --- wrappers ----------------------------------------------------------------------------------


def _check_temperature(temperature: float) -> float:
    # Checked here too, not only in the real implementation, so compiled code fails at trace
    # time with the same message as eager code.
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_epilogue(logit_scale: float, softcap: float | None) -> tuple[float, float | None]:
    # The messages of ops.linear_token_stats, raised at trace time as well.
    def real(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not (real(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite number != 0, got {logit_scale!r}")
    if softcap is not None and not (real(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    return float(logit_scale), None if softcap is None else float(softcap)


def token_stats(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                temperature: float = 1.0, backend: str = "auto") -> TokenStats:
    """:func:`icqs_fast.ops.token_stats` through ``torch.ops.icqs_fast.token_stats``.

    Same arguments, shapes and dtypes (``logits [..., V]``, ``targets [...]`` int64; every
    field shaped like ``targets``), usable inside ``torch.compile(fullgraph=True)`` and
    ``torch.export``. Not differentiable.
    """
    out = torch.ops.icqs_fast.token_stats(logits, targets, int(ignore_index),
                                          _check_temperature(temperature), backend)
    return TokenStats(*out)


def linear_token_stats(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                       bias: Tensor | None = None, ignore_index: int = -100,
                       temperature: float = 1.0, backend: str = "auto", chunk_tokens: int = 256,
                       chunk_vocab: int = 16384, logit_scale: float = 1.0,
                       softcap: float | None = None) -> TokenStats:
    """:func:`icqs_fast.ops.linear_token_stats` through ``torch.ops.icqs_fast.linear_token_stats``.

    ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` int64, optional ``bias [V]``; every
    field ``[N]``; ``logit_scale`` / ``softcap`` as in the ops function. Usable inside
    ``torch.compile(fullgraph=True)`` and ``torch.export``. Not differentiable.
    """
    logit_scale, softcap = _check_epilogue(logit_scale, softcap)
    out = torch.ops.icqs_fast.linear_token_stats(
        hidden, weight, targets, bias, int(ignore_index), _check_temperature(temperature),
        backend, int(chunk_tokens), int(chunk_vocab), logit_scale, softcap)
    return TokenStats(*out)


__all__ = ["token_stats", "linear_token_stats"]
