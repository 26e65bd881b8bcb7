"""One description of a model's attention, read once from its config: what each layer attends
(full causal, a sliding window, fixed chunks, or no attention at all), with which score softcap
and whether it has attention sinks, plus the LM head's logit epilogue (scale, final softcap).

The prefix bank, the cascade attention, the attention-entropy capture and the capability check
(:mod:`icqs_fast.engine.capability`) all read this one object instead of each reading the config.
The rule of each kind is transformers' own mask rule, on absolute positions (never cache slots, so
padding inside a sequence cannot shift a window):

* ``full``: key position ``k <= q``;
* ``sliding``: ``k <= q`` and ``q - k < window`` (``sliding_window_overlay``);
* ``chunked``: ``k <= q`` and ``k // chunk == q // chunk`` (``chunked_overlay``, no left padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# transformers' ``layer_types`` values of attention layers, by the mask they use.
_FULL = {"full_attention", "attention", "global_attention", "full"}
_SLIDING = {"sliding_attention", "sliding_window_attention", "local_attention", "sliding",
            "local"}
_CHUNKED = {"chunked_attention"}


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer attends.

    Attributes:
        kind: ``"full"``, ``"sliding"``, ``"chunked"`` or ``"none"`` (the layer is not softmax
            attention: a recurrent / SSM / convolution layer; named by ``mixer``).
        window: tokens a query sees (itself included) for ``"sliding"``.
        chunk: chunk length for ``"chunked"``.
        softcap: attention-score softcapping ``c * tanh(s / c)`` (Gemma 2), or None.
        mixer: the config's name of the layer type (``layer_types`` entry) when given.
    """

    kind: str = "full"
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None
    mixer: str | None = None

    @property
    def local(self) -> bool:
        """Whether the layer sees less than everything before it (a window or a chunk)."""
        return self.kind in ("sliding", "chunked")

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean mask ``[..., Lq, Tk]``: key at position ``k_pos [..., Tk]`` (negative = a
        padding slot) is visible to the query at ``q_pos [..., Lq]`` (the two broadcast over the
        leading dimensions)."""
        q = q_pos[..., :, None]
        k = k_pos[..., None, :]
        ok = (k >= 0) & (k <= q)
        if self.kind == "sliding" and self.window is not None:
            ok = ok & (q - k < self.window)
        elif self.kind == "chunked" and self.chunk is not None:
            ok = ok & (torch.div(k, self.chunk, rounding_mode="floor")
                       == torch.div(q, self.chunk, rounding_mode="floor"))
        return ok


def _num_layers(cfg: Any) -> int:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def _positive(cfg: Any, *names: str) -> float | None:
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return float(v)
    return None


def text_config(cfg: Any) -> Any:
    """The text decoder's config (``text_config`` of composite configs, else ``cfg``)."""
    sub = getattr(cfg, "text_config", None)
    return sub if sub is not None and sub is not cfg else cfg


def layer_attention(cfg: Any) -> tuple[LayerAttention, ...]:
    """Each decoder layer's :class:`LayerAttention`, from the config alone.

    ``layer_types`` (transformers' per-layer list) decides when present; otherwise a
    ``sliding_window`` that is switched on (``use_sliding_window`` not False) makes every layer
    ``sliding`` (Mistral, Mixtral, Phi-3, Starcoder2: one window for the whole model), an
    ``attention_chunk_size`` every layer ``chunked``, and else every layer is ``full``. The
    attention softcap is ``attn_logit_softcapping`` where set."""
    cfg = text_config(cfg)
    n = _num_layers(cfg)
    window = getattr(cfg, "sliding_window", None)
    window = int(window) if isinstance(window, int) and window > 0 else None
    chunk = getattr(cfg, "attention_chunk_size", None)
    chunk = int(chunk) if isinstance(chunk, int) and chunk > 0 else None
    softcap = _positive(cfg, "attn_logit_softcapping", "attention_logit_softcapping")
    types = getattr(cfg, "layer_types", None)
    out = []
    if isinstance(types, (list, tuple)) and types:
        for t in types:
            name = str(t)
            if name in _FULL:
                out.append(LayerAttention("full", softcap=softcap, mixer=name))
            elif name in _SLIDING:
                out.append(LayerAttention("sliding", window=window, softcap=softcap,
                                          mixer=name) if window else
                           LayerAttention("full", softcap=softcap, mixer=name))
            elif name in _CHUNKED:
                out.append(LayerAttention("chunked", chunk=chunk, softcap=softcap, mixer=name)
                           if chunk else LayerAttention("full", softcap=softcap, mixer=name))
            else:
                out.append(LayerAttention("none", mixer=name))
        return tuple(out)
    if window and getattr(cfg, "use_sliding_window", True) is not False:
        return tuple(LayerAttention("sliding", window=window, softcap=softcap) for _ in range(n))
    if chunk:
        return tuple(LayerAttention("chunked", chunk=chunk, softcap=softcap) for _ in range(n))
    return tuple(LayerAttention("full", softcap=softcap) for _ in range(n))


def final_softcap(cfg: Any) -> float | None:
    """The final-logit softcap ``c`` of ``c * tanh(z / c)`` the model applies to its logits
    (Gemma 2/3 ``final_logit_softcapping``, RecurrentGemma ``logits_soft_cap``), or None."""
    return _positive(text_config(cfg), "final_logit_softcapping", "logits_soft_cap",
                     "final_logit_softcap", "output_softcapping")


@dataclass(frozen=True)
class HeadEpilogue:
    """What the model does to ``h @ W.T + b`` before its logits: ``z * logit_scale``, then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set (the arguments of
    :func:`icqs_fast.ops.linear_token_stats`). ``source`` names where the scale came from."""

    logit_scale: float = 1.0
    softcap: float | None = None
    source: str = ""

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The epilogue on logits ``z`` (any shape), in z's dtype."""
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def describe(self) -> list[str]:
        parts = []
        if self.logit_scale != 1.0:
            src = f" ({self.source})" if self.source else ""
            parts.append(f"logit scale {self.logit_scale:.6g}{src}")
        if self.softcap is not None:
            parts.append(f"final-logit softcapping {self.softcap:g}")
        return parts


def describe_layers(layers: tuple[LayerAttention, ...]) -> list[str]:
    """Short phrases for the path message: the local masks and softcaps in use."""
    parts = []
    n = len(layers)
    slid = [la for la in layers if la.kind == "sliding"]
    chunked = [la for la in layers if la.kind == "chunked"]
    none = [la for la in layers if la.kind == "none"]
    if slid:
        parts.append(f"sliding-window masks ({slid[0].window} tokens, {len(slid)} of {n} layers)")
    if chunked:
        parts.append(f"chunked masks ({chunked[0].chunk} tokens, {len(chunked)} of {n} layers)")
    if any(la.softcap for la in layers):
        parts.append("attention softcapping")
    if none:
        kinds = sorted({la.mixer or "?" for la in none})
        parts.append(f"{len(none)} of {n} layers without attention ({', '.join(kinds)})")
    return parts


class DeviceCopies:
    """One small tensor (an index, built on the host) and its copy on each device that asks
    for it, made once: a model split over GPUs (``--device-map auto``) keeps each layer's
    states on that layer's device, so an index into them must be on that device too."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self._on: dict[str, torch.Tensor] = {}

    def on(self, device: torch.device | str) -> torch.Tensor:
        """The tensor on ``device`` (copied at the first call for that device)."""
        key = str(device)
        t = self._on.get(key)
        if t is None:
            t = self._on[key] = self.host.to(device)
        return t
