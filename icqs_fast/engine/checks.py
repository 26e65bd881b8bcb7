"""Checks on a model and on the responses given to the engine: a causal LM with a linear head,
its context length, and one response's type.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# --------------------------------------------------------------------------- shared helpers
# (the naive reference uses model_max_length, parse_response and summarise; it tokenizes the
# prompts with its own code, so a seam difference in the engine's tokenization shows in tests)


def model_max_length(model: Any, max_length: int | None) -> int | None:
    """The longest prompt the model takes: ``max_length`` if given, capped by the config's
    ``max_position_embeddings`` / ``n_positions``; None if neither is known."""
    cfg = model.config
    lim = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if max_length is not None:
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        return min(max_length, lim) if lim else max_length
    return int(lim) if lim else None


# Largest |log_softmax difference| accepted between the fused head and the model's own logits,
# relative to max(1, max |logit|): the fused head computes in fp32 from the body's hidden states
# while the model's lm_head rounds its logits to the model dtype (bf16: 2^-8 relative), so the
# tolerance follows the dtype. A logit scale or a softcap changes them by a whole factor.
HEAD_CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 8e-3,
                   torch.bfloat16: 4e-2}
# Models already checked, with what they were checked in: (dtype, device, head weight storage).
_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _head_signature(model: Any) -> tuple:
    w = model.get_output_embeddings().weight
    return (w.dtype, w.device, w.data_ptr(), tuple(w.shape))


@torch.no_grad()
def check_model(model: Any) -> None:
    """Refuse models whose logits are not what the fused head computes.

    The engine (and the glass-box features) never run the model's LM head: they take the
    decoder body's final (normed) hidden states ``h`` and compute ``log_softmax(h @ W.T + b)``
    with :func:`icqs_fast.ops.linear_token_stats`. Any logit post-processing in the model's own
    ``forward`` (final-logit softcapping, a logit scale, a temperature baked into the head, ...)
    would then be dropped silently. So one short forward (4 tokens: BOS + 3 fixed ids) of the
    model itself is compared with the fused head on the body's hidden states of that same
    forward (captured by a hook: one forward in all); log-softmax is compared, so a per-row
    additive shift, which changes no statistic, passes. Cached per model object (and its head
    weight's dtype, device and storage), so repeated constructions cost nothing.

    Raises:
        NotImplementedError: naming the model class, the largest difference and the likely
            cause, when the two differ by more than ``HEAD_CHECK_RTOL[dtype] * max(1, max|z|)``.
        TypeError: when the model has no separate decoder body or no output embeddings.
    """
    from icqs_fast.engine.batching import decoder_body, model_device

    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"{type(model).__name__} has no linear output embeddings (LM head)")
    sig = _head_signature(model)
    if _HEAD_CHECKED.get(model) == sig:
        return
    body = decoder_body(model)
    v = int(head.weight.shape[0])
    bos = getattr(model.config, "bos_token_id", None)
    first = int(bos) if isinstance(bos, int) and 0 <= bos < v else 0
    ids = torch.tensor([[first, 1 % v, v // 2, v - 1]], device=model_device(model))
    seen: list[torch.Tensor] = []
    hook = body.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        hook.remove()
    if len(seen) != 1:
        raise TypeError(f"{type(model).__name__}: its decoder body ran {len(seen)} times in one "
                        "forward; the engine needs body -> LM head")
    h = seen[0][0]
    z = h.float() @ head.weight.float().t()
    if getattr(head, "bias", None) is not None:
        z = z + head.bias.float()
    diff = float((torch.log_softmax(z, -1) - torch.log_softmax(logits, -1)).abs().max())
    scale = max(1.0, float(logits.abs().max()), float(z.abs().max()))
    tol = HEAD_CHECK_RTOL.get(head.weight.dtype, 4e-2) * scale
    if not diff <= tol:  # also refuses NaN
        cfg = model.config
        hints = [f"{a}={getattr(cfg, a)}" for a in
                 ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
                 if getattr(cfg, a, None) not in (None, 1, 1.0)]
        likely = (f" (its config sets {', '.join(hints)})" if hints else
                  " (e.g. final-logit softcapping, a logit scale or temperature, or a head "
                  "other than one linear layer)")
        raise NotImplementedError(
            f"{type(model).__name__} post-processes its logits{likely}: its own logits differ "
            f"from the fused LM head (final hidden state @ lm_head.weight.T + bias) by up to "
            f"{diff:.3g} in log-probability (tolerance {tol:.2g} for {head.weight.dtype}); the "
            "engine only supports a plain linear LM head"
        )
    _HEAD_CHECKED[model] = sig


def parse_response(i: int, item: Any, *, noun: str = "response", allow_empty: bool = False
                   ) -> tuple[str, str]:
    """Validate the i-th response: an (x, y) pair or a dict with "x" and "y", both str, y
    non-empty unless ``allow_empty``; errors start with ``"{noun} {i}: "``."""
    if isinstance(item, dict):
        missing = [k for k in ("x", "y") if k not in item]
        if missing:
            raise ValueError(f"{noun} {i}: missing field(s) {missing} (need 'x' and 'y')")
        x, y = item["x"], item["y"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x, y = item
    else:
        raise TypeError(f"{noun} {i}: expected an (x, y) pair or a dict with 'x'/'y', "
                        f"got {type(item).__name__}")
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, str):
            raise TypeError(f"{noun} {i}: field '{name}' must be a str, got {type(v).__name__}")
    if y == "" and not allow_empty:
        raise ValueError(f"{noun} {i}: field 'y' is empty (nothing to score)")
    return x, y
