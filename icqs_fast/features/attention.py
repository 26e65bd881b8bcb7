"""Attention entropy without the attention matrix: the plain-torch (CPU) path and a Hugging Face
hook that captures per-layer, per-head entropies during a normal forward.

Definition (see :func:`icqs_fast.ops.attention_entropy`): for query row i with scores
``s_ij = q_i . k_j * scale`` over its allowed keys (causal, not padded) restricted to the key range
``[k0, k1)``, the entropy of ``softmax_j(s_ij)`` renormalised over that range. A row with no
allowed key in the range has entropy 0 (an empty distribution carries no uncertainty, and 0 keeps
downstream features finite); a row with no allowed key at all has output 0.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from icqs_fast.engine.layout import layer_attention
from icqs_fast.models import register_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL_NAME = "icqs_entropy"


# --------------------------------------------------------------------------- HF hook


class _Capture:
    """State of one :func:`capture_attention_entropy` block; ``entropy`` is set on exit."""

    def __init__(self, query_mask: torch.Tensor, key_range: torch.Tensor, backend: str,
                 layers: tuple = (), model: PreTrainedModel | None = None):
        self.query_mask = query_mask
        self.key_range = key_range
        self.backend = backend
        self.layers_desc = layers  # each layer's LayerAttention (window, chunk, softcap)
        self.model = model
        self.layers: dict[int, torch.Tensor] = {}
        self.entropy: torch.Tensor | None = None
        # The 4D masks seen in this forward, each analysed once for all layers that share it
        # and rule: [(mask, rule, key_ok [B, Tk] bool, causal)].
        self.masks: list[tuple[torch.Tensor, tuple, torch.Tensor, bool]] = []
        # 0-d bool on the device: some mask seen did NOT reproduce causal + key padding + its
        # layer's own window / chunk (checked once per forward, not per layer: check_mask).
        self.mask_bad: torch.Tensor | None = None

    def check_mask(self, bad: bool | None = None) -> None:
        """Raise the mask ValueError if a mask of the forward failed; ``bad`` is
        ``cap.mask_bad`` as the caller already read it (else it is read here: a host sync)."""
        if self.mask_bad is None:
            return
        if bool(self.mask_bad) if bad is None else bad:
            raise ValueError(MASK_ERROR)

    def finish(self) -> None:
        if not self.layers:
            self.entropy = None
            return
        order = sorted(self.layers)
        self.entropy = torch.stack([self.layers[i] for i in order], dim=1)


_ACTIVE = threading.local()

MASK_ERROR = ("capture_attention_entropy: the model's attention mask is not causal + key "
              "padding + the layer's own window / chunk (per-head masks, packed sequences and "
              "bidirectional parts are not supported)")

# Per model and layer rule: whether its masks are causal. Decided once per model from the first
# forward's mask (one host sync); later forwards only check it on the device.
_CAUSAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rule(la) -> tuple:
    return ("full",) if la is None or not la.local else (la.kind, la.window, la.chunk)


def _mask_checks(mask: torch.Tensor, tq: int, tk: int, la=None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4D mask the model passes (``[B or 1, 1 or H, Tq, Tk]``, bool with True = attend or
    additive float with 0 = attend) as a key-padding mask ``key_ok [B, Tk]`` bool, and two 0-d
    bool tensors on the mask's device, no host sync: whether key padding + causality + the
    layer's own window / chunk rule (``la``, a
    :class:`~icqs_fast.engine.layout.LayerAttention`) reproduce the mask exactly on every row
    that attends to something, and the same without causality."""
    allow = mask if mask.dtype == torch.bool else mask == 0
    same_heads = (allow == allow[:, :1]).all() if allow.shape[1] != 1 else None
    allow = allow[:, 0]  # [B, Tq, Tk]
    dev = allow.device
    qpos = tk - tq + torch.arange(tq, device=dev)
    kpos = torch.arange(tk, device=dev)
    causal_m = kpos[None, :] <= qpos[:, None]
    local = torch.ones_like(causal_m)
    if la is not None and la.local:
        local = la.allowed(qpos, kpos)  # includes causality
    # Padded keys are the keys no query attends to; real keys are attended at least by the
    # query at their own position (the last query without a cache).
    key_ok = allow.any(1)
    dead = ~allow.any(-1, keepdim=True)  # rows with no allowed key (pad-query rows may be)
    oks = []
    for causal in (True, False):
        pred = key_ok[:, None, :] & (causal_m[None] if causal else True) & local[None]
        ok = ((pred == allow) | dead).all()
        oks.append(ok if same_heads is None else ok & same_heads)
    return key_ok, oks[0], oks[1]


def mask_causality(model: PreTrainedModel | None, rule: tuple, ok_causal: torch.Tensor,
                   ok_full: torch.Tensor) -> bool:
    """Whether ``model``'s masks for layers of ``rule`` are causal: read from the first mask
    (one host sync per model and rule, like the capability check), remembered after."""
    known = _CAUSAL.get(model, {}) if model is not None else {}
    if rule in known:
        return known[rule]
    oc = bool(ok_causal)
    if not (oc or bool(ok_full)):  # a second sync only for a model whose masks are not causal
        raise ValueError(MASK_ERROR)
    if model is not None:
        _CAUSAL.setdefault(model, {})[rule] = bool(oc)
    return bool(oc)


def _mask_to_padding(cap: _Capture, mask: torch.Tensor, tq: int, tk: int, la=None
                     ) -> tuple[torch.Tensor, bool]:
    """``(key_ok [B, Tk] bool, causal)`` for this layer's mask, analysed once per forward for
    all layers that share the mask object and rule; its check joins ``cap.mask_bad``."""
    rule = _rule(la)
    for m, r, key_ok, causal in cap.masks:
        if m is mask and r == rule:
            return key_ok, causal
    key_ok, ok_causal, ok_full = _mask_checks(mask, tq, tk, la)
    causal = mask_causality(cap.model, rule, ok_causal, ok_full)
    bad = ~(ok_causal if causal else ok_full)
    cap.mask_bad = bad if cap.mask_bad is None else cap.mask_bad | bad
    cap.masks.append((mask, rule, key_ok, causal))
    return key_ok, causal


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
    """``AttentionInterface`` function: same contract as transformers' ``sdpa_attention_forward``
    (``query [B, Hq, Tq, D]``, ``key/value [B, Hk, Tk, D]``; returns ``[B, Tq, Hq, D]``, None).
    No host sync per layer: the mask is analysed once per forward (:func:`_mask_to_padding`)
    and an all-True key mask is passed as it is rather than tested for being all True."""
    from icqs_fast import backends, ops
    from icqs_fast.backends import support

    cap: _Capture | None = getattr(_ACTIVE, "cap", None)
    if cap is None:
        raise RuntimeError(f"attention implementation {IMPL_NAME!r} is only usable inside "
                           "capture_attention_entropy(...)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("capture_attention_entropy: position_bias is not supported")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        layer = len(cap.layers)
    la = cap.layers_desc[int(layer)] if int(layer) < len(cap.layers_desc) else None
    softcap = kwargs.get("softcap")
    if softcap is None and la is not None:
        softcap = la.softcap
    sinks = kwargs.get("s_aux")
    tq, tk = query.shape[2], key.shape[2]
    if cap.query_mask.shape[1] != tq:
        raise ValueError(f"capture_attention_entropy: query_mask has {cap.query_mask.shape[1]} "
                         f"positions but the forward has {tq} queries (run without a KV cache)")
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        key_ok = None
    else:
        key_ok, causal = _mask_to_padding(cap, attention_mask, tq, tk, la)
    bsz = query.shape[0]
    if key_ok is not None and key_ok.shape[0] != bsz:
        key_ok = key_ok.expand(bsz, -1)
    local = la is not None and la.local
    window = la.window if local and la.kind == "sliding" else None
    chunk = la.chunk if local and la.kind == "chunked" else None
    # The capture's backend runs the layers it supports; a layer variant it lacks (or a backend
    # without attention entropy at all) goes to "auto" (the support table decides).
    backend = backends.fallback("attention_entropy", cap.backend, support.requested(
        window=window, chunk=chunk, softcap=softcap, sinks=sinks,
        value_dim=value.shape[-1] != key.shape[-1]))
    out, ent = ops.attention_entropy(
        query, key, value, key_range=cap.key_range.to(query.device),
        query_mask=cap.query_mask.to(query.device), attention_mask=key_ok,
        causal=bool(causal), scale=scaling, backend=backend, window=window, chunk=chunk,
        softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else sinks.to(query.device),
    )
    cap.layers[int(layer)] = ent
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    register_attention(IMPL_NAME, _attention_forward)


@contextlib.contextmanager
def capture_attention_entropy(
    model: PreTrainedModel,
    query_mask: torch.Tensor,
    key_range: torch.Tensor,
    *,
    backend: str = "auto",
    check_mask: bool = True,
) -> Iterator[_Capture]:
    """Capture attention entropies during a normal forward of a Hugging Face model.

    Inside the block the model's attention runs through :func:`icqs_fast.ops.attention_entropy`
    (registered with transformers' ``AttentionInterface``); run exactly one full forward
    ``model(input_ids, attention_mask=..., use_cache=False)`` over ``T`` tokens. On exit,
    ``cap.entropy`` is ``[B, layers, heads, T]`` fp32: for each flagged query row, the entropy of
    its attention renormalised over the key positions ``key_range[b] = (start, end)``, 0 where
    ``query_mask`` is False or no allowed key lies in the range. The previous attention
    implementation is restored on exit, also on error.

    Args:
        model: a transformers model whose layers call its attention through the
            ``AttentionInterface`` (e.g. Llama / SmolLM2); each layer's own mask (sliding
            window, chunks), softcap and sinks are honoured (from its
            :class:`~icqs_fast.engine.layout.LayerAttention` and the call's arguments).
        query_mask: ``[B, T]`` bool, rows whose entropy is wanted.
        key_range: ``[B, 2]`` int64, positions in the (padded) input sequence.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; a layer whose variant (window,
            chunk, softcap, sinks, value head size) the named backend lacks, and every layer
            when it has no attention entropy at all (``"cpp"``), runs on ``"auto"``'s choice.
        check_mask: check on exit (one host sync per block) that every layer's mask was
            causal (or, for a model whose masks are not, bidirectional) + key padding + its
            own window / chunk, else ValueError. False: the caller reads ``cap.mask_bad``
            (a 0-d bool on the device, None when the forward passed no mask) in its own
            device-to-host copy and calls ``cap.check_mask(value)``. The layers themselves never
            sync: the mask is analysed once per forward, its causality once per model.

    Yields:
        the capture object; read ``cap.entropy`` after the block.
    """
    if query_mask.dim() != 2 or query_mask.dtype != torch.bool:
        raise ValueError(f"query_mask must be [B, T] bool, got {list(query_mask.shape)} "
                         f"{query_mask.dtype}")
    if key_range.shape != (query_mask.shape[0], 2):
        raise ValueError(f"key_range must be [{query_mask.shape[0]}, 2], got "
                         f"{list(key_range.shape)}")
    if getattr(_ACTIVE, "cap", None) is not None:
        raise RuntimeError("capture_attention_entropy blocks cannot be nested")
    _register()

    previous = model.config._attn_implementation
    cap = _Capture(query_mask, key_range.long(), backend, layer_attention(model.config), model)
    model.set_attn_implementation(IMPL_NAME)
    if model.config._attn_implementation != IMPL_NAME:
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation "
                         "(it does not use transformers' AttentionInterface)")
    _ACTIVE.cap = cap
    try:
        yield cap
    finally:
        _ACTIVE.cap = None
        model.set_attn_implementation(previous)
        cap.finish()
    if check_mask:
        cap.check_mask()


def eager_range_entropy(attn: torch.Tensor, key_range: torch.Tensor,
                        query_mask: torch.Tensor) -> torch.Tensor:
    """Entropies from materialised attention probabilities (the slow baseline / reference).

    Args:
        attn: ``[B, H, Tq, Tk]`` attention probabilities (e.g. ``output_attentions=True``).
        key_range: ``[B, 2]`` int64; query_mask: ``[B, Tq]`` bool.

    Returns:
        ``[B, H, Tq]`` fp32 entropy of each row renormalised over its key range (0 for rows not
        flagged or with no mass in the range).
    """
    bsz, h, tq, tk = attn.shape
    out = torch.zeros(bsz, h, tq, dtype=torch.float32, device=attn.device)
    for b in range(bsz):
        k0, k1 = max(0, int(key_range[b, 0])), min(tk, int(key_range[b, 1]))
        rows = query_mask[b].nonzero()[:, 0]
        if k1 <= k0 or rows.numel() == 0:
            continue
        p = attn[b][:, rows, k0:k1].double()
        z = p.sum(-1, keepdim=True)
        pn = p / torch.where(z > 0, z, torch.ones_like(z))
        e = -(pn * torch.log(torch.where(pn > 0, pn, torch.ones_like(pn)))).sum(-1)
        out[b][:, rows] = e.float()
    return out

