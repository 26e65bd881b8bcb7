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
import math
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

IMPL_NAME = "icqs_entropy"


# --------------------------------------------------------------------------- torch backend


def _entropy_rows(s: torch.Tensor, allow: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax over the last dim of fp32 scores ``s [..., K]``, restricted to
    ``allow`` (bool, broadcastable to ``s``; None = every key); 0 for rows with no allowed key.
    Shifted form ``H = log l - t / l`` with ``l = sum e^z``, ``t = sum e^z z``, ``z = s - max``.
    ``s`` is overwritten (in place keeps the CPU path at two score-sized buffers)."""
    if allow is not None:
        s.masked_fill_(~allow, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if allow is not None:
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = s.sub_(m)
    e = torch.exp(z)
    l_ = e.sum(-1)
    if allow is not None:
        z.masked_fill_(~allow, 0.0)  # e = 0 there; avoid 0 * -inf
    t = e.mul_(z).sum(-1)
    ok = l_ > 0
    safe = torch.where(ok, l_, torch.ones_like(l_))
    return torch.where(ok, (torch.log(safe) - t / safe).clamp_min(0.0), torch.zeros_like(l_))


def attention_entropy_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_range: torch.Tensor,
    query_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    chunk: int = 512,
    ent_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch forward with entropy (inputs already validated by ``icqs_fast.ops``).

    The output comes from ``scaled_dot_product_attention`` one block of ``chunk`` query rows at a
    time (its mask block is ``[B, 1, chunk, Tk]`` bool); the entropy is computed only for the
    flagged rows and only over the key range, ``ent_chunk`` rows at a time (scores
    ``[Hq, ent_chunk, k1 - k0]`` fp32; by default about 1M scores, at most ``chunk`` rows).
    Memory is O(B * Hq * chunk * Tk), never ``[B, Hq, Tq, Tk]`` for ``Tq > chunk``.

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hk, Tk, D]``; key_range ``[B, 2]`` int64;
        query_mask ``[B, Tq]`` bool; attention_mask ``[B, Tk]`` bool or None; causal; scale;
        chunk: query rows per masked SDPA block; ent_chunk: flagged rows per entropy block
        (None = automatic).

    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype and ``entropy [B, Hq, Tq]`` fp32.
    """
    bsz, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    group = hq // hk
    off = tk - tq
    dev = q.device
    kpos = torch.arange(tk, device=dev)

    # ---- output
    if attention_mask is None and (not causal or tq == tk):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and tq > 1, scale=scale,
                                             enable_gqa=group > 1)
    else:
        out = torch.empty(bsz, hq, tq, v.shape[-1], device=dev, dtype=q.dtype)
        for r0 in range(0, tq, chunk):
            r1 = min(tq, r0 + chunk)
            allow = torch.ones(bsz, 1, r1 - r0, tk, dtype=torch.bool, device=dev)
            if attention_mask is not None:
                allow = allow & attention_mask[:, None, None, :].bool()
            if causal:
                qpos = off + torch.arange(r0, r1, device=dev)
                allow = allow & (kpos[None, :] <= qpos[:, None])[None, None]
            o = F.scaled_dot_product_attention(q[:, :, r0:r1], k, v, attn_mask=allow,
                                               scale=scale, enable_gqa=group > 1)
            # Rows with no allowed key: SDPA may return NaN there; the contract is 0.
            o = torch.where(allow.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype,
                                                                         device=dev))
            out[:, :, r0:r1] = o

    # ---- entropy of the flagged rows over their key range
    ent = torch.zeros(bsz, hq, tq, device=dev, dtype=torch.float32)
    kr = key_range.tolist()
    for b in range(bsz):
        k0, k1 = max(0, int(kr[b][0])), min(tk, int(kr[b][1]))
        rows = query_mask[b].nonzero()[:, 0]
        if k1 <= k0 or rows.numel() == 0:
            continue
        kb = k[b, :, k0:k1].float()  # [Hk, K, D]
        key_ok = (attention_mask[b, k0:k1].bool() if attention_mask is not None
                  else torch.ones(k1 - k0, dtype=torch.bool, device=dev))
        all_keys_ok = bool(key_ok.all())
        # About 1M scores (4 MB) per block: cache-friendly on the CPU and a small peak.
        step = ent_chunk or min(chunk, max(16, (1 << 20) // (hq * (k1 - k0))))
        for r0 in range(0, rows.numel(), step):
            idx = rows[r0:r0 + step]
            n = idx.numel()
            qb = q[b][:, idx].float()  # [Hq, n, D]
            # GQA: query head h uses key head h // group, so group the query heads per key head.
            s = torch.matmul(qb.reshape(hk, group * n, d), kb.transpose(1, 2)) * scale
            s = s.reshape(hq, n, k1 - k0)
            # A mask only where some key of the range is hidden from some row of the chunk
            # (the common case, response rows over instruction keys, needs none).
            allow = None
            if not all_keys_ok or (causal and off + int(idx[0]) < k1 - 1):
                allow = key_ok[None, :].expand(n, -1)
                if causal:
                    allow = allow & (kpos[None, k0:k1] <= (off + idx)[:, None])
                allow = allow[None]
            ent[b][:, idx] = _entropy_rows(s, allow)
    return out, ent


# --------------------------------------------------------------------------- HF hook


class _Capture:
    """State of one :func:`capture_attention_entropy` block; ``entropy`` is set on exit."""

    def __init__(self, query_mask: torch.Tensor, key_range: torch.Tensor, backend: str):
        self.query_mask = query_mask
        self.key_range = key_range
        self.backend = backend
        self.layers: dict[int, torch.Tensor] = {}
        self.entropy: torch.Tensor | None = None

    def finish(self) -> None:
        if not self.layers:
            self.entropy = None
            return
        order = sorted(self.layers)
        self.entropy = torch.stack([self.layers[i] for i in order], dim=1)


_ACTIVE = threading.local()
_LOCK = threading.Lock()
_REGISTERED = False


def _mask_to_padding(mask: torch.Tensor, tq: int, tk: int) -> tuple[torch.Tensor, bool]:
    """Turn the 4D mask the model passes (``[B or 1, 1 or H, Tq, Tk]``, bool with True = attend or
    additive float with 0 = attend) into a key-padding mask ``[B, Tk]`` and a causal flag, and
    check that they reproduce the mask exactly on every row that attends to something."""
    allow = mask if mask.dtype == torch.bool else mask == 0
    if allow.shape[1] != 1:
        if not bool((allow == allow[:, :1]).all()):
            raise ValueError("capture_attention_entropy: per-head attention masks are not "
                             "supported")
        allow = allow[:, :1]
    allow = allow[:, 0]  # [B, Tq, Tk]
    dev = allow.device
    qpos = tk - tq + torch.arange(tq, device=dev)
    causal_m = torch.arange(tk, device=dev)[None, :] <= qpos[:, None]
    # Padded keys are the keys no query attends to; real keys are attended by the last query.
    key_ok = allow.any(1)
    live = allow.any(-1, keepdim=True)  # rows with some allowed key (pad-query rows may be empty)
    for causal in (True, False):
        pred = key_ok[:, None, :] & (causal_m[None] if causal else True)
        if bool(((pred == allow) | ~live).all()):
            return key_ok, causal
    raise ValueError(
        "capture_attention_entropy: the model's attention mask is neither causal + key padding "
        "nor key padding alone (sliding windows and packed sequences are not supported)"
    )


def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
    """``AttentionInterface`` function: same contract as transformers' ``sdpa_attention_forward``
    (``query [B, Hq, Tq, D]``, ``key/value [B, Hk, Tk, D]``; returns ``[B, Tq, Hq, D]``, None)."""
    from . import ops

    cap: _Capture | None = getattr(_ACTIVE, "cap", None)
    if cap is None:
        raise RuntimeError(f"attention implementation {IMPL_NAME!r} is only usable inside "
                           "capture_attention_entropy(...)")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("capture_attention_entropy: softcap / position_bias are not supported")
    tq, tk = query.shape[2], key.shape[2]
    if cap.query_mask.shape[1] != tq:
        raise ValueError(f"capture_attention_entropy: query_mask has {cap.query_mask.shape[1]} "
                         f"positions but the forward has {tq} queries (run without a KV cache)")
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        key_ok = None
    else:
        key_ok, causal = _mask_to_padding(attention_mask, tq, tk)
        if bool(key_ok.all()):
            key_ok = None
    bsz = query.shape[0]
    if key_ok is not None and key_ok.shape[0] != bsz:
        key_ok = key_ok.expand(bsz, -1)
    out, ent = ops.attention_entropy(
        query, key, value, key_range=cap.key_range.to(query.device),
        query_mask=cap.query_mask.to(query.device), attention_mask=key_ok,
        causal=bool(causal), scale=scaling, backend=cap.backend,
    )
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        layer = len(cap.layers)
    cap.layers[int(layer)] = ent
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(IMPL_NAME, _attention_forward)
        # Same 4D bool mask (or None + is_causal) as sdpa gets.
        ALL_MASK_ATTENTION_FUNCTIONS.register(IMPL_NAME, sdpa_mask)
        _REGISTERED = True


@contextlib.contextmanager
def capture_attention_entropy(
    model,
    query_mask: torch.Tensor,
    key_range: torch.Tensor,
    *,
    backend: str = "auto",
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
        model: a transformers model that supports ``sdpa`` (e.g. Llama / SmolLM2).
        query_mask: ``[B, T]`` bool, rows whose entropy is wanted.
        key_range: ``[B, 2]`` int64, positions in the (padded) input sequence.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

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
    cap = _Capture(query_mask, key_range.long(), backend)
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


def default_scale(d: int) -> float:
    """The usual ``1 / sqrt(D)`` score scale."""
    return 1.0 / math.sqrt(d)
