"""Cascade attention for suffix forwards against shared prefix KV states.

In a suffix forward of the ICQS engine, ``R`` rows (one per (response, context)) each continue
one stored demonstration prefix. Many rows share a prefix (every response in the batch uses the
same ``(M+1) L`` prefixes), so instead of copying each row's prefix keys/values into a per-row
KV cache (and repeating them for grouped-query attention), the suffix forward runs *without* a
cache, through an attention function registered with transformers' ``AttentionInterface``:

* prefix part: the queries of all rows that use prefix entry ``e`` attend to that entry's stored
  keys/values once: ``q [E, H_kv, n * group * S, D]`` against ``k/v [E, H_kv, P, D]`` (no per-row
  copy, no ``repeat_kv``; padded prefix slots are masked);
* suffix part: causal attention of each row's suffix queries to its own suffix keys;
* the two partial softmaxes are merged exactly through their log-sum-exps.

It applies to models whose positional information is in the queries/keys or the input (RoPE,
absolute position embeddings) and whose attention is plain causal softmax attention with a
scale: the Llama family (Llama, SmolLM2, ...) and GPT-2 (see :func:`supports_cascade`). Other
models keep the per-row KV-copy path of :func:`icqs_fast.engine.batching.suffix_hidden`.

Exactness: both parts use fp32 accumulation (the CPU flash kernel, or a float32 math path), so
results match a plain attention over ``[prefix; suffix]`` to rounding.

On CUDA both parts run the fused Triton attention of :mod:`icqs_fast.kernels.attention_entropy`
built with its log-sum-exp output (``RETURN_LSE``, no entropy state): scores live in registers
only, never as a ``[.., rows, prefix]`` fp32 tensor; prefix padding is its key mask, the suffix's
grouped causal mask is its causal GQA mode. Accumulation stays fp32; with 16-bit inputs the
probabilities enter the PV product in the input dtype, as in any flash attention. PyTorch's SDPA
ops that return a log-sum-exp were not used: the flash op takes no mask (padded prefixes would
need one call per length), neither op takes fewer key heads than query heads (the suffix part
would need a ``repeat_kv`` copy), and the memory-efficient op pads its LSE's query dimension
(to a multiple of 32 in some versions). The CPU path is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

IMPL_NAME = "icqs_cascade"
# Model types whose attention is plain causal softmax attention over RoPE'd / absolute-position
# queries and keys, called through ALL_ATTENTION_FUNCTIONS with module.layer_idx set.
CASCADE_MODEL_TYPES = ("llama", "gpt2")

_ACTIVE = threading.local()


@dataclass
class CascadePlan:
    """What the attention function needs besides q/k/v.

    Rows of the forward are ordered entry-major: rows ``starts[g] : starts[g] + counts[g]`` use
    prefix entry ``entries[g]``.

    Attributes:
        keys, values: the bank's per-layer ``[E_bank, H_kv, P_bank, D]`` tensors (never written).
        entries, starts, counts: the row groups.
        lengths: prefix length of each group's entry.
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    entries: list[int]
    starts: list[int]
    counts: list[int]
    lengths: list[int]

    def __post_init__(self) -> None:
        self.uniform = len(set(self.counts)) == 1
        dev = self.keys[0].device
        self._idx = torch.tensor(self.entries, dtype=torch.long, device=dev)
        # Contiguous run of bank entries: a plain slice view, no copy at all.
        e0 = self.entries[0]
        self._slice = self.entries == list(range(e0, e0 + len(self.entries)))
        self.p_max = max(self.lengths)
        self._mask: torch.Tensor | None = None
        self._key_ok: torch.Tensor | None = None

    def prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The used entries' keys/values ``[G, H_kv, P_max, D]`` (a view when possible)."""
        k, v = self.keys[layer], self.values[layer]
        if self._slice:
            e0 = self.entries[0]
            sl = slice(e0, e0 + len(self.entries))
            return k[sl, :, : self.p_max], v[sl, :, : self.p_max]
        return (k.index_select(0, self._idx)[:, :, : self.p_max],
                v.index_select(0, self._idx)[:, :, : self.p_max])

    def prefix_mask(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Additive mask ``[G, 1, 1, P_max]`` (-inf on padded slots), None if no padding."""
        if all(p == self.p_max for p in self.lengths):
            return None
        if self._mask is None or self._mask.dtype != dtype:
            lens = torch.tensor(self.lengths, device=device)
            pad = torch.arange(self.p_max, device=device)[None, :] >= lens[:, None]
            m = torch.zeros(len(self.lengths), 1, 1, self.p_max, dtype=dtype, device=device)
            self._mask = m.masked_fill(pad[:, None, None, :], float("-inf"))
        return self._mask


    def prefix_key_ok(self, device: torch.device) -> torch.Tensor | None:
        """Key mask ``[G, P_max]`` bool (False on padded slots) for the fused path, None if no
        padding."""
        if all(p == self.p_max for p in self.lengths):
            return None
        if self._key_ok is None:
            lens = torch.tensor(self.lengths, device=device)
            self._key_ok = torch.arange(self.p_max, device=device)[None, :] < lens[:, None]
        return self._key_ok


def supports_cascade(model) -> bool:
    """True when :func:`cascade_attention` can run this model's suffix forwards."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in CASCADE_MODEL_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None):
        return False
    can = getattr(model, "_can_set_attn_implementation", None)
    return bool(can()) if callable(can) else True


# --------------------------------------------------------------------------- attention with LSE


def _attn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``[B, H, L, D]`` x ``[B, H, T, D]`` returning the output (q's dtype) and
    the fp32 log-sum-exp ``[B, H, L]`` of the scaled, masked scores. ``mask`` is additive and
    broadcastable to ``[B, H, L, T]``."""
    if q.device.type == "cpu":
        try:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask, scale=scale)
            return out, lse.float()
        except (RuntimeError, AttributeError, NotImplementedError):  # pragma: no cover
            pass
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.matmul(p, v.float()).to(q.dtype), lse


def _use_fused(device: torch.device) -> bool:
    """Whether cascade attention runs the fused Triton kernel (CUDA; tests force it on CPU under
    ``TRITON_INTERPRET=1``)."""
    return device.type == "cuda"


def _fused_attn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                    causal: bool = False, key_ok: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention with log-sum-exp: ``q [B, Hq, L, D]`` against ``k/v [B, Hk, T, D]``
    (``Hq`` a multiple of ``Hk``; causal: query i at position ``T - L + i``; ``key_ok [B, T]``
    bool, False = masked key). Returns the output in q's dtype and the fp32 natural-log LSE
    ``[B, Hq, L]``."""
    from icqs_fast.kernels.attention_entropy import attention_lse

    return attention_lse(q, k, v, scale=scale, causal=causal, attention_mask=key_ok)


_CAUSAL: dict[tuple, torch.Tensor] = {}


def _grouped_causal_mask(group: int, s: int, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    """Additive ``[1, 1, group * s, s]``: query ``g * s + i`` sees suffix keys ``j <= i``."""
    key = (group, s, dtype, str(device))
    m = _CAUSAL.get(key)
    if m is None:
        i = torch.arange(s, device=device)
        bad = (i[None, :] > i[:, None]).repeat(group, 1)
        m = torch.zeros(group * s, s, dtype=dtype, device=device).masked_fill(bad, float("-inf"))
        m = m[None, None]
        if len(_CAUSAL) > 64:
            _CAUSAL.clear()
        _CAUSAL[key] = m
    return m


def cascade_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):
    """``AttentionInterface`` function (contract of transformers' ``sdpa_attention_forward``:
    ``query [R, Hq, S, D]``, ``key/value [R, Hk, S, D]`` of the suffix tokens only; returns
    ``[R, S, Hq, D]``, None). The causal mask transformers passes is not needed (suffix rows are
    right-padded, so causality alone keeps real queries off padded keys) and is ignored."""
    plan: CascadePlan | None = getattr(_ACTIVE, "plan", None)
    if plan is None:
        raise RuntimeError(f"attention implementation {IMPL_NAME!r} is only usable inside "
                           "icqs_fast.engine.cascade.cascade_plan(...)")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("cascade attention: softcap / position_bias are not supported")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError("cascade attention needs module.layer_idx")
    r, hq, s, d = query.shape
    hk = key.shape[1]
    group = hq // hk
    scale = float(scaling) if scaling is not None else d ** -0.5
    dt, dev = query.dtype, query.device
    kp, vp = plan.prefix_kv(int(layer))
    if kp.dtype != dt:
        kp, vp = kp.to(dt), vp.to(dt)

    fused = _use_fused(dev)
    # ---- prefix part, grouped by entry: [G, Hk, n * group * S, D] against [G, Hk, P, D]
    if plan.uniform:
        n = plan.counts[0]
        g_n = len(plan.counts)
        qg = query.reshape(g_n, n, hk, group, s, d).permute(0, 2, 1, 3, 4, 5)
        qg = qg.reshape(g_n, hk, n * group * s, d)
        if fused:
            key_ok = plan.prefix_key_ok(dev)
            o1, l1 = _fused_attn_lse(qg, kp, vp, scale, key_ok=key_ok)
        else:
            o1, l1 = _attn_lse(qg, kp, vp, plan.prefix_mask(dt, dev), scale)
        # -> row layout [R, S, Hk, group, D] / [R, S, Hk, group]
        o1 = o1.view(g_n, hk, n, group, s, d).permute(0, 2, 4, 1, 3, 5).reshape(r, s, hk, group, d)
        l1 = l1.view(g_n, hk, n, group, s).permute(0, 2, 4, 1, 3).reshape(r, s, hk, group)
    else:
        o1 = torch.empty(r, s, hk, group, d, dtype=dt, device=dev)
        l1 = torch.empty(r, s, hk, group, dtype=torch.float32, device=dev)
        for gi, (r0, n, p) in enumerate(zip(plan.starts, plan.counts, plan.lengths,
                                            strict=True)):
            qg = query[r0:r0 + n].reshape(n, hk, group, s, d).transpose(0, 1)
            qg = qg.reshape(1, hk, n * group * s, d)
            if fused:
                og, lg = _fused_attn_lse(qg, kp[gi:gi + 1, :, :p], vp[gi:gi + 1, :, :p], scale)
            else:
                og, lg = _attn_lse(qg, kp[gi:gi + 1, :, :p], vp[gi:gi + 1, :, :p], None, scale)
            o1[r0:r0 + n] = og.view(hk, n, group, s, d).permute(1, 3, 0, 2, 4)
            l1[r0:r0 + n] = lg.view(hk, n, group, s).permute(1, 3, 0, 2)

    # ---- suffix part: causal within each row, query heads grouped per key head
    if fused:
        # Causal GQA in the kernel: query head h reads key head h // group (transformers'
        # repeat_kv order), as the grouped reshape below does.
        o2, l2 = _fused_attn_lse(query, key, value, scale, causal=True)
        o2 = o2.permute(0, 2, 1, 3).reshape(r, s, hk, group, d)
        l2 = l2.permute(0, 2, 1).reshape(r, s, hk, group)
    else:
        q2 = query.reshape(r, hk, group * s, d)
        o2, l2 = _attn_lse(q2, key.contiguous(), value.contiguous(),
                           _grouped_causal_mask(group, s, dt, dev), scale)
        o2 = o2.view(r, hk, group, s, d).permute(0, 3, 1, 2, 4)
        l2 = l2.view(r, hk, group, s).permute(0, 3, 1, 2)

    # ---- exact merge of the two partial softmaxes
    w1 = torch.sigmoid(l1 - l2)[..., None]
    out = o2.float() + w1 * (o1.float() - o2.float()) if dt != torch.float32 else \
        torch.lerp(o2, o1, w1)
    return out.to(dt).reshape(r, s, hq, d), None


def _register() -> None:
    from icqs_fast.models import register_attention

    register_attention(IMPL_NAME, cascade_attention)


@contextlib.contextmanager
def cascade_plan(model, plan: CascadePlan) -> Iterator[None]:
    """Run the model's attention through :func:`cascade_attention` with ``plan`` inside the
    block (one suffix forward, no KV cache); the previous implementation is restored on exit."""
    if getattr(_ACTIVE, "plan", None) is not None:
        raise RuntimeError("cascade_plan blocks cannot be nested")
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPL_NAME)
    if model.config._attn_implementation != IMPL_NAME:
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation")
    _ACTIVE.plan = plan
    try:
        yield
    finally:
        _ACTIVE.plan = None
        model.set_attn_implementation(previous)
