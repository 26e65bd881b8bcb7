"""A verl-shaped fused LM-head forward: per-token log-probabilities and entropies from hidden
states, without the ``[N, V]`` logits.

:func:`linear_logprobs_entropy` takes the arguments of verl's
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels,
temperature, reduction)`` and returns what it returns, ``(logprobs, entropy)`` of
``softmax(hidden @ weight.T / temperature)``, for the no-grad uses in RL training: the
reference-policy and old-policy log-probabilities (and entropies) of rollout tokens. It is
built on :func:`icqs_fast.ops.linear_token_stats` (through its ``torch.library`` op, so it also
runs inside ``torch.compile``), on every device it supports: Triton on CUDA, the C++ extension
on CPU.

Usage, where verl calls ``linear_cross_entropy`` for log-probabilities only::

    from icqs_fast.compat.verl import linear_logprobs_entropy

    with torch.no_grad():
        log_probs, entropy = linear_logprobs_entropy(hidden_states, lm_head.weight,
                                                     rolled_labels, temperature)

Differences from verl's kernel, all deliberate:

* no gradient (verl's has a fused backward): calling it with grad enabled on inputs that
  require grad raises, instead of returning a result that silently cuts the graph;
* the outputs keep ``labels``' shape (verl's Triton kernel returns them flattened to
  ``[N]``; ``.reshape(-1)`` gives that; verl's torch fallback keeps the shape, as here);
* no ``dist_process_group`` (vocabulary-parallel heads): pass the full ``[V, H]`` weight;
* labels outside ``[0, V)`` raise a ValueError (verl's kernel reads out of bounds), and
  ``hidden_size`` need not be a multiple of 128.
"""

from __future__ import annotations

import torch

from icqs_fast import torch_ops

# verl has no ignore_index: every label is scored, so use a sentinel no label can equal.
_NO_IGNORE = -(2**62)
_REDUCTIONS = ("none", "sum", "mean")


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``labels`` and entropies under ``softmax(hidden @ weight.T / T)``.

    Args:
        hidden: ``[..., H]`` (e.g. ``[B, T, H]`` or ``[N, H]``) float32/float16/bfloat16 hidden
            states before the LM head.
        weight: ``[V, H]`` LM-head weight (promoted with ``hidden`` to their common dtype).
        labels: ``[...]`` int64 token ids in ``[0, V)``, ``hidden``'s leading shape (or any
            shape with as many elements, as verl flattens both).
        temperature: T > 0; logits are divided by it before the softmax (verl's
            ``logits *= 1 / temperature``).
        reduction: ``"none"`` (per-token log-probabilities), ``"sum"`` or ``"mean"`` (over all
            tokens, a 0-dim tensor), as in verl; the entropy is always per token.
        backend: ``"auto"``, ``"triton"``, ``"cpp"`` or ``"torch"`` (see
            :func:`icqs_fast.ops.linear_token_stats`).

    Returns:
        ``(logprobs, entropy)``, float32: ``logprobs`` shaped like ``labels`` (or 0-dim when
        reduced), ``entropy`` shaped like ``labels``. Computed in fp32 from the inputs' values,
        block by block over the vocabulary; never an ``[N, V]`` tensor.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        raise RuntimeError(
            "linear_logprobs_entropy has no backward; call it under torch.no_grad() (it is for "
            "reference/old-policy log-probabilities), or use verl's linear_cross_entropy to train"
        )
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be [..., H] and weight [V, H]; got {list(hidden.shape)} "
                         f"and {list(weight.shape)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    if labels.numel() != h.shape[0]:
        raise ValueError(f"labels {list(labels.shape)} must have one id per hidden row "
                         f"({h.shape[0]} rows in hidden {list(hidden.shape)})")
    s = torch_ops.linear_token_stats(h, weight, labels.reshape(-1), ignore_index=_NO_IGNORE,
                                     temperature=temperature, backend=backend)
    entropy = s.entropy.reshape(labels.shape)
    if reduction == "sum":
        return s.logprob.sum(), entropy
    if reduction == "mean":
        return s.logprob.mean(), entropy
    return s.logprob.reshape(labels.shape), entropy


__all__ = ["linear_logprobs_entropy"]
