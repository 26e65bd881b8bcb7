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

It applies to every model whose layers all run softmax attention through transformers'
``AttentionInterface`` with ``module.layer_idx`` set, positions in the queries/keys or the input
(RoPE, NoPE, absolute position embeddings), as the capability check finds
(:func:`icqs_fast.engine.capability.model_plan`). Each layer's mask comes from its
:class:`~icqs_fast.engine.layout.LayerAttention` on absolute positions (full causal, a sliding
window, fixed chunks); score softcapping (Gemma 2), attention sinks (gpt-oss: ``s_aux``, their
share of the softmax denominator added at the merge) and value heads of another size than the
query/key heads (multi-head latent attention) are handled here too. Other models keep the
per-row KV-copy path of :func:`icqs_fast.engine.batching.suffix_hidden` or a plain forward.

Exactness: both parts use fp32 accumulation (the fused kernels, the CPU flash kernel, or a
float32 math path), so results match a plain attention over ``[prefix; suffix]`` to rounding.

Where a fused kernel takes the layer (:func:`icqs_fast.ops.attention_lse`'s ``"auto"`` choice: the
triton backend on CUDA, the cpp backend, ``csrc/attention.cpp``, on the CPU; the fused attention
with its log-sum-exp output, no entropy state), both parts run through it: scores live in registers
/ cache-sized tiles only, never as a ``[.., rows, prefix]`` fp32 tensor; prefix padding is its key
mask, the suffix's grouped causal mask is its causal GQA mode, and a local layer's window / chunk
comes from token positions (:meth:`CascadePlan.kernel_positions`) where the backend takes them.
:data:`ATTENTION_ENV` forces the path (e.g. ``torch`` to time PyTorch's kernel against ours).
Accumulation stays fp32; with 16-bit inputs the probabilities enter the PV product in the input
dtype, as in any flash attention. PyTorch's SDPA ops that return a log-sum-exp were not used: the
flash op takes no mask (padded prefixes would need one call per length), neither op takes fewer key
heads than query heads (the suffix part would need a ``repeat_kv`` copy), and the memory-efficient
op pads its LSE's query dimension (to a multiple of 32 in some versions). Which layers a kernel
takes is the backends' support table (:mod:`icqs_fast.backends.support`). This module holds no
kernel code.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import backends, ops
from icqs_fast.backends import support
from icqs_fast.engine.layout import DeviceCopies, LayerAttention
from icqs_fast.engine.one_pass import (
    OnePassIndices,
    QueryPart,
    kernel_out,
    local_args,
    one_pass,
)
from icqs_fast.exact_forwards import ATTENTION_OUT_DTYPE
from icqs_fast.models import register_attention, uses_bf16_products

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL_NAME = "icqs_cascade"
# The positional-mask attention of prefix-bank builds and KV-copy suffix forwards of models with
# local (sliding-window / chunked) layers: transformers' masks count cache slots, and the bank
# keeps padding inside sequences, so those forwards get their masks from token positions here.
POSITIONAL_IMPL = "icqs_positional"

_ACTIVE = threading.local()


@dataclass
class CascadePlan:
    """What the attention function needs besides q/k/v.

    Rows of the forward are ordered entry-major: rows ``starts[g] : starts[g] + counts[g]`` use
    prefix entry ``entries[g]``.

    Attributes:
        keys, values: the bank's per-layer ``[E_bank, H_kv, P_bank, D]`` tensors (never written;
            values may have another head size than keys: multi-head latent attention).
        entries, starts, counts: the row groups.
        lengths: prefix length of each group's entry (suffix token ``t`` of its rows is at
            position ``lengths[g] + t``).
        layers: each layer's :class:`~icqs_fast.engine.layout.LayerAttention` (masks, softcap);
            None = every layer full causal attention.
        capture: a dict the forward fills with each layer's suffix keys/values (``{layer: (k,
            v)}``), for a later forward's :attr:`query`; None: not kept.
        query: the shared query tokens each row continues after its entry (their keys/values
            captured by an earlier forward; one-pass layers only); None: none.
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    entries: list[int]
    starts: list[int]
    counts: list[int]
    lengths: list[int]
    layers: Sequence[LayerAttention] | None = None
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    query: QueryPart | None = None

    def __post_init__(self) -> None:
        self.uniform = len(set(self.counts)) == 1
        # The entries' index, copied once to each layer's device: a model split over GPUs
        # (``--device-map auto``) keeps each layer's bank states on that layer's device.
        self._idx = DeviceCopies(torch.tensor(self.entries, dtype=torch.long))
        # Contiguous run of bank entries: a plain slice view, no copy at all.
        e0 = self.entries[0]
        self._slice = self.entries == list(range(e0, e0 + len(self.entries)))
        self.p_max = max(self.lengths)
        self._mask: dict[str, Mask] = {}  # per device (a split model's layers)
        self._key_ok: dict[str, torch.Tensor] = {}
        self._local: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._expanded: dict[tuple, Mask] = {}
        self._positions: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._one_pass: dict[tuple, OnePassIndices] = {}
        self._query_rows = None if self.query is None else DeviceCopies(
            torch.tensor(self.query.rows, dtype=torch.long))

    def layer(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention description (full causal when none was given)."""
        if self.layers is None:
            return _FULL_LAYER
        return self.layers[layer]

    def one_pass_indices(self, s: int, device: torch.device) -> OnePassIndices:
        """:func:`~icqs_fast.engine.one_pass.one_pass`'s positions and gather indices for
        suffixes of ``s`` tokens: the same for every layer, so made once."""
        key = (s, str(device))
        got = self._one_pass.get(key)
        if got is None:
            got = self._one_pass[key] = OnePassIndices.of(
                self.lengths, self.counts, s, device,
                None if self.query is None else self.query.lengths)
        return got

    def query_rows(self, device: torch.device) -> torch.Tensor:
        """Each row's row of :attr:`query`'s captured states, on ``device``."""
        return self._query_rows.on(device)

    def prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The used entries' keys/values ``[G, H_kv, P_max, D]`` (a view when possible)."""
        k, v = self.keys[layer], self.values[layer]
        if self._slice:
            e0 = self.entries[0]
            sl = slice(e0, e0 + len(self.entries))
            return k[sl, :, : self.p_max], v[sl, :, : self.p_max]
        idx = self._idx.on(k.device)
        return (k.index_select(0, idx)[:, :, : self.p_max],
                v.index_select(0, self._idx.on(v.device))[:, :, : self.p_max])

    def prefix_allow(self, device: torch.device) -> Mask | None:
        """Key mask ``[G, 1, 1, P_max]`` (False on padded slots), None if no padding."""
        if all(p == self.p_max for p in self.lengths):
            return None
        m = self._mask.get(str(device))
        if m is None:
            lens = torch.tensor(self.lengths, device=device)
            ok = torch.arange(self.p_max, device=device)[None, :] < lens[:, None]
            m = self._mask[str(device)] = Mask(ok[:, None, None, :])
        return m

    def prefix_key_ok(self, device: torch.device) -> torch.Tensor | None:
        """Key mask ``[G, P_max]`` bool (False on padded slots) for the fused path, None if no
        padding."""
        if all(p == self.p_max for p in self.lengths):
            return None
        ok = self._key_ok.get(str(device))
        if ok is None:
            lens = torch.tensor(self.lengths, device=device)
            ok = self._key_ok[str(device)] = (torch.arange(self.p_max, device=device)[None, :]
                                              < lens[:, None])
        return ok

    def expanded(self, key: tuple, build: Any, device: torch.device | None = None) -> Mask:
        """The :class:`Mask` of ``key``, built once per plan (one suffix forward) and device:
        every layer of the same kind on that device reuses it instead of expanding and
        converting it again."""
        key = (*key, str(device))
        m = self._expanded.get(key)
        if m is None:
            m = self._expanded[key] = Mask(build())
        return m

    def kernel_positions(self, part: str, s: int, rows: int, device: torch.device,
                         gi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token positions ``(q_pos, k_pos)`` for a fused kernel's local-layer masks (the rows
        of :meth:`local_masks`, as positions instead of masks), built once per forward:

        * ``part="pre"``: the prefix part's ``rows = n * group * s`` stacked queries of each
          group (query row ``r`` is suffix token ``r % s``, at ``lengths[g] + r % s``) against
          its entry's ``P_max`` slots (``-1`` on padded ones); ``gi``: only group ``gi``,
          against its own ``lengths[gi]`` slots.
        * ``part="suf"``: each row's ``s`` suffix tokens, queries and keys alike.
        """
        key = (part, s, rows, gi, str(device))
        got = self._positions.get(key)
        if got is None:
            lens = torch.tensor(self.lengths if gi is None else [self.lengths[gi]],
                                device=device)
            t = torch.arange(s, device=device)
            if part == "pre":
                q_pos = lens[:, None] + torch.arange(rows, device=device)[None, :] % s
                j = torch.arange(self.p_max if gi is None else self.lengths[gi], device=device)
                k_pos = torch.where(j[None, :] < lens[:, None], j[None, :], -1)
            else:
                rows_g = torch.repeat_interleave(torch.arange(len(self.counts), device=device),
                                                 torch.tensor(self.counts, device=device))
                q_pos = k_pos = lens[rows_g][:, None] + t[None, :]
            got = self._positions[key] = (q_pos, k_pos)
        return got

    def local_masks(self, la: LayerAttention, s: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks of a local (sliding / chunked) layer on absolute positions: ``prefix [G, 1, S,
        P_max]`` (suffix query ``t`` of group ``g`` at ``lengths[g] + t`` against prefix key
        ``j``, padded slots off) and ``suffix [G, 1, S, S]`` (against suffix key ``t'``)."""
        key = (la.kind, la.window, la.chunk, s, str(device))
        got = self._local.get(key)
        if got is None:
            lens = torch.tensor(self.lengths, device=device)
            t = torch.arange(s, device=device)
            j = torch.arange(self.p_max, device=device)
            q_pos = lens[:, None] + t[None, :]  # [G, S]
            k_pre = torch.where(j[None, :] < lens[:, None], j[None, :], -1)  # [G, P]
            pre = la.allowed(q_pos, k_pre)[:, None]
            suf = la.allowed(q_pos, q_pos)[:, None]
            got = self._local[key] = (pre, suf)
        return got


_FULL_LAYER = LayerAttention("full")


# --------------------------------------------------------------------------- attention with LSE


class Mask:
    """A boolean attention mask (True = attend) with its derived forms computed once: the
    additive float mask the CPU flash kernel takes (per dtype) and the rows with any allowed
    key. A plan builds each layer kind's masks once per forward and every layer reuses them."""

    def __init__(self, allow: torch.Tensor) -> None:
        self.allow = allow
        self._add: dict[torch.dtype, torch.Tensor] = {}
        self._live: torch.Tensor | None = None

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        m = self._add.get(dtype)
        if m is None:
            m = self._add[dtype] = torch.zeros(self.allow.shape, dtype=dtype,
                                               device=self.allow.device).masked_fill(
                ~self.allow, float("-inf"))
        return m

    @property
    def live(self) -> torch.Tensor:
        if self._live is None:
            self._live = self.allow.any(-1)
        return self._live


def attn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             allow: torch.Tensor | Mask | None, scale: float, softcap: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``q [B, H, L, D]`` x ``k [B, H, T, D]`` -> ``v [B, H, T, Dv]``, returning
    the output ``[B, H, L, Dv]`` (q's dtype) and the fp32 log-sum-exp ``[B, H, L]`` of the scaled
    (then softcapped: ``c * tanh(s / c)``), masked scores. ``allow`` is bool (or a :class:`Mask`
    of one), broadcastable to ``[B, H, L, T]``, True = attend. A row with no allowed key has LSE
    ``-inf`` and output 0, so it drops out of an LSE merge exactly."""
    if allow is not None and not isinstance(allow, Mask):
        allow = Mask(allow)
    if q.device.type == "cpu" and softcap is None and v.shape[-1] == q.shape[-1]:
        try:
            mask = None if allow is None else allow.additive(q.dtype)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
            lse = lse.float()
            if allow is not None:
                # The CPU kernel gives a fully masked row LSE 0 and output 0: make it -inf.
                lse = lse.masked_fill(~allow.live.expand(lse.shape), float("-inf"))
            return out, lse
        except (RuntimeError, AttributeError, NotImplementedError):  # pragma: no cover
            pass
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if allow is not None:
        s = s.masked_fill(~allow.allow, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.matmul(p, v.float()).to(q.dtype), lse


ATTENTION_ENV = "ICQS_FAST_CASCADE_ATTENTION"
"""Environment variable (read at every layer call) forcing cascade attention's path:
``auto`` or unset (the fused kernel :func:`icqs_fast.ops.attention_lse`'s ``"auto"`` picks for
the layer: cpp on the CPU, triton on CUDA; else the torch path), ``torch`` (the torch path of
this module: PyTorch's CPU flash kernel, or the fp32 math path; for side-by-side timings), or
a backend of ``ops.attention_lse`` (``cpp``, ``triton``) named for every layer (an error where
it lacks a layer's variant or the device)."""


def _kernel_backend(device: torch.device, dtype: torch.dtype, softcap: float | None,
                    value_dim: bool, local: LayerAttention | None = None,
                    bf16_dots: bool = False, positions: bool = False) -> str | None:
    """The backend of :func:`icqs_fast.ops.attention_lse` whose fused kernel takes a layer with
    this score softcap, value head size (``value_dim``: ``Dv != D``) and local mask (``local``:
    a sliding / chunked layer, whose masks need token positions) and ``bf16_dots`` (bf16
    products of fp32 inputs: ``dot_dtype``; ``positions``: masks from token positions) on
    ``device``, as ``"auto"``
    would pick it (the triton backend on CUDA, cpp on the CPU) or as :data:`ATTENTION_ENV`
    forces it; None: the torch path here."""
    opts = set(support.requested(softcap=softcap, value_dim=value_dim, dot_dtype=bf16_dots,
                                 positions=positions))
    if local is not None:
        opts |= support.requested(window=local.kind == "sliding" and local.window is not None,
                                  chunk=local.kind == "chunked" and local.chunk is not None,
                                  positions=True)
    forced = os.environ.get(ATTENTION_ENV, "").strip().lower() or "auto"
    if forced == "torch":
        return None
    if forced == "auto":
        return backends.kernel_backend("attention_lse", device, dtype, opts)
    try:
        return backends.choose("attention_lse", forced, device, dtype, opts)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{ATTENTION_ENV}={forced}: {exc}") from exc


def one_pass_kernel(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`cascade_attention` runs a model's layers on ``device`` in ``dtype`` as one
    softmax pass (:func:`~icqs_fast.engine.one_pass.one_pass`: the kernel continues its running
    state, and takes every variant): the path a :class:`QueryPart` needs."""
    kernel = _kernel_backend(torch.device(device), dtype, None, False, positions=True)
    return kernel is not None and \
        support.entry("attention_lse", kernel).options >= {"state", "positions"}


def bf16_products(module: Any, dtype: torch.dtype,
                  bank_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """``torch.bfloat16`` when a layer's attention products should take bf16 inputs (fp32
    accumulation): mixed precision, i.e. fp32 activations (``dtype``) with the layer's weights
    (or the prefix bank, ``bank_dtype``) in bf16, as its linear layers' products do; else None
    (fp32 models stay exact, bf16 ones are bf16 already)."""
    if dtype != torch.float32:
        return None
    if bank_dtype == torch.bfloat16 or uses_bf16_products(module):
        return torch.bfloat16
    weight = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
    return torch.bfloat16 if weight is not None and weight.dtype == torch.bfloat16 else None


def _fused_attn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    backend: str, *, causal: bool = False, key_ok: torch.Tensor | None = None,
                    la: LayerAttention | None = None,
                    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                    dot: torch.dtype | None = None, softcap: float | None = None,
                    out_dtype: torch.dtype | None = None, with_lse: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused attention with log-sum-exp on ``backend``: ``q [B, Hq, L, D]`` against ``k/v [B, Hk, T,
    D]`` (``Hq`` a multiple of ``Hk``; causal: query i at position ``T - L + i``, or at
    ``positions``; ``key_ok [B, T]`` bool, False = masked key; a local layer ``la``'s window /
    chunk on ``positions``; ``dot``: the products' input dtype, as ``dot_dtype``; the layer's
    score ``softcap``). Returns the output in q's dtype (or ``out_dtype``) and the fp32
    natural-log LSE ``[B, Hq, L]`` (None without ``with_lse``)."""
    return ops.attention_lse(q, k, v, scale=scale, causal=causal, attention_mask=key_ok,
                             positions=positions, dot_dtype=dot, softcap=softcap,
                             backend=backend, out_dtype=out_dtype, with_lse=with_lse,
                             **local_args(la))


_CAUSAL: dict[tuple, Mask] = {}


def grouped_causal_allow(group: int, s: int, device: torch.device) -> Mask:
    """``[1, 1, group * s, s]``: query ``g * s + i`` sees suffix keys ``j <= i``."""
    key = (group, s, str(device))
    m = _CAUSAL.get(key)
    if m is None:
        i = torch.arange(s, device=device)
        m = Mask((i[None, :] <= i[:, None]).repeat(group, 1)[None, None])
        if len(_CAUSAL) > 64:
            _CAUSAL.clear()
        _CAUSAL[key] = m
    return m


def _runtime_checks(la: LayerAttention, kwargs: dict, where: str) -> float | None:
    """The layer's score softcap, after checking that what the model passes at run time agrees
    with the description read from its config (a disagreement would mean a wrong mask)."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"{where}: position_bias is not supported")
    sc = kwargs.get("softcap")
    if sc is not None and la.softcap is not None and abs(float(sc) - la.softcap) > 1e-6:
        raise ValueError(f"{where}: the layer passes softcap={sc} but its config says "
                         f"{la.softcap}")
    sw = kwargs.get("sliding_window")
    if sw is not None and la.kind == "full":
        raise ValueError(f"{where}: the layer passes sliding_window={sw} but its config "
                         "describes it as full attention")
    return float(sc) if sc is not None else la.softcap


def _sinks(kwargs: dict) -> torch.Tensor | None:
    """Attention-sink logits ``[Hq]`` (gpt-oss passes them as ``s_aux``), or None."""
    s = kwargs.get("s_aux")
    if s is None:
        s = kwargs.get("sinks")
    return s


def _active_layer(attr: str, impl: str, block: str, module: Any, kwargs: dict
                  ) -> tuple[Any, int, LayerAttention, float | None, torch.Tensor | None]:
    """The active plan of an attention implementation (``_ACTIVE.<attr>``), the calling layer's
    index and description, its score softcap and its sinks."""
    plan = getattr(_ACTIVE, attr, None)
    if plan is None:
        raise RuntimeError(f"attention implementation {impl!r} is only usable inside "
                           f"icqs_fast.engine.cascade.{block}(...)")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"{impl} attention needs module.layer_idx")
    la = plan.layer(int(layer))
    return plan, int(layer), la, _runtime_checks(la, kwargs, f"{impl} attention"), _sinks(kwargs)


def cascade_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):
    """``AttentionInterface`` function (contract of transformers' ``sdpa_attention_forward``:
    ``query [R, Hq, S, D]``, ``key [R, Hk, S, D]``, ``value [R, Hk, S, Dv]`` of the suffix tokens
    only; returns ``[R, S, Hq, Dv]``, None). The mask transformers passes is not used: suffix rows
    are right-padded, so causality alone keeps real queries off padded keys, and the layer's
    window / chunk comes from the plan's layer description, on absolute positions. The
    output is in ``query``'s dtype, or in ``icqs_out_dtype`` when that keyword asks for one."""
    out_dtype = kwargs.pop(ATTENTION_OUT_DTYPE, None)
    plan, layer, la, softcap, sinks = _active_layer("plan", IMPL_NAME, "cascade_plan", module,
                                                    kwargs)
    r, hq, s, d = query.shape
    hk = key.shape[1]
    dv = value.shape[-1]
    group = hq // hk
    scale = float(scaling) if scaling is not None else d ** -0.5
    dt, dev = query.dtype, query.device
    if plan.capture is not None:  # a later forward's shared query part (one_pass.QueryPart)
        plan.capture[layer] = (key, value)
    kp, vp = plan.prefix_kv(int(layer))
    if kp.shape[1] != hk or kp.shape[-1] != d or vp.shape[-1] != dv:
        # e.g. DeepSeek V2's cache holds its compressed latent, not the attention keys.
        raise ValueError(f"cascade attention: the bank holds keys {list(kp.shape[1::2])} / values "
                         f"{list(vp.shape[1::2])} (heads, dim) but layer {layer} attends with "
                         f"keys ({hk}, {d}) / values ({hk}, {dv}): the model caches something "
                         "other than its attention keys/values")
    dot = bf16_products(module, dt, kp.dtype)
    if kp.dtype != dt:
        kp, vp = kp.to(dt), vp.to(dt)
    local = la.local
    pre_m = suf_m = None
    # A fused kernel takes key padding and causality, and local layers (masks on each entry's
    # own positions) through token positions where its backend has them; what the support
    # table says it lacks takes the torch path.
    kernel = _kernel_backend(dev, dt, softcap, dv != d, la if local else None, dot is not None)
    if kernel is None and dot is not None:  # no bf16-product kernel here: fp32 products
        dot = None
        kernel = _kernel_backend(dev, dt, softcap, dv != d, la if local else None)
    fused = kernel is not None
    lay = la if local and fused else None
    if fused and support.entry("attention_lse", kernel).options >= {"state", "positions"}:
        return one_pass(plan, query, key, value, kp, vp, scale, kernel, lay, dot, softcap,
                        sinks, layer, out_dtype)
    if plan.query is not None:
        raise RuntimeError(f"layer {layer}: shared query states need the one-pass cascade "
                           "(a kernel that continues its softmax state)")
    if local and not fused:
        pre_m, suf_m = plan.local_masks(la, s, dev)  # [G, 1, S, P], [G, 1, S, S]
    # ---- prefix part, grouped by entry: [G, Hk, n * group * S, D] against [G, Hk, P, D]
    if plan.uniform:
        n = plan.counts[0]
        g_n = len(plan.counts)
        qg = query.reshape(g_n, n, hk, group, s, d).permute(0, 2, 1, 3, 4, 5)
        qg = qg.reshape(g_n, hk, n * group * s, d)
        if fused:
            pos = None if lay is None else plan.kernel_positions("pre", s, n * group * s, dev)
            o1, l1 = _fused_attn_lse(qg, kp, vp, scale, kernel, causal=lay is not None,
                                     key_ok=None if lay else plan.prefix_key_ok(dev), la=lay,
                                     positions=pos, dot=dot, softcap=softcap)
        else:
            allow = plan.prefix_allow(dev)
            if pre_m is not None:  # the same [S, P] mask for each row and head of the group
                allow = plan.expanded(("pre", la.kind, la.window, la.chunk, s, n * group),
                                      lambda: pre_m[:, :, None].expand(
                                          g_n, 1, n * group, s, plan.p_max).reshape(
                                          g_n, 1, n * group * s, plan.p_max), dev)
            o1, l1 = attn_lse(qg, kp, vp, allow, scale, softcap)
        # -> row layout [R, S, Hk, group, Dv] / [R, S, Hk, group]
        o1 = o1.view(g_n, hk, n, group, s, dv).permute(0, 2, 4, 1, 3, 5).reshape(
            r, s, hk, group, dv)
        l1 = l1.view(g_n, hk, n, group, s).permute(0, 2, 4, 1, 3).reshape(r, s, hk, group)
    else:
        o1 = torch.empty(r, s, hk, group, dv, dtype=dt, device=dev)
        l1 = torch.empty(r, s, hk, group, dtype=torch.float32, device=dev)
        for gi, (r0, n, p) in enumerate(zip(plan.starts, plan.counts, plan.lengths,
                                            strict=True)):
            qg = query[r0:r0 + n].reshape(n, hk, group, s, d).transpose(0, 1)
            qg = qg.reshape(1, hk, n * group * s, d)
            kg, vg = kp[gi:gi + 1, :, :p], vp[gi:gi + 1, :, :p]
            if fused:
                pos = (None if lay is None else
                       plan.kernel_positions("pre", s, n * group * s, dev, gi=gi))
                og, lg = _fused_attn_lse(qg, kg, vg, scale, kernel, causal=lay is not None,
                                         la=lay, positions=pos, dot=dot, softcap=softcap)
            else:
                allow = None
                if pre_m is not None:
                    allow = plan.expanded(
                        ("pre", gi, la.kind, la.window, la.chunk, s, n * group),
                        lambda gi=gi, n=n, p=p: pre_m[gi:gi + 1, :, None, :, :p].expand(
                            1, 1, n * group, s, p).reshape(1, 1, n * group * s, p), dev)
                og, lg = attn_lse(qg, kg, vg, allow, scale, softcap)
            o1[r0:r0 + n] = og.view(hk, n, group, s, dv).permute(1, 3, 0, 2, 4)
            l1[r0:r0 + n] = lg.view(hk, n, group, s).permute(1, 3, 0, 2)

    # ---- suffix part: causal within each row, query heads grouped per key head
    if fused:
        # Causal GQA in the kernel: query head h reads key head h // group (transformers'
        # repeat_kv order), as the grouped reshape below does.
        pos = None if lay is None else plan.kernel_positions("suf", s, s, dev)
        o2, l2 = _fused_attn_lse(query, key, value, scale, kernel, causal=True, la=lay,
                                 positions=pos, dot=dot, softcap=softcap)
        o2 = o2.permute(0, 2, 1, 3).reshape(r, s, hk, group, dv)
        l2 = l2.permute(0, 2, 1).reshape(r, s, hk, group)
    else:
        q2 = query.reshape(r, hk, group * s, d)
        if suf_m is None:
            allow = grouped_causal_allow(group, s, dev)
        else:  # per group of rows (chunk boundaries depend on the prefix length): [R, 1, gS, S]
            def build() -> torch.Tensor:
                rows_g = torch.repeat_interleave(
                    torch.arange(len(plan.counts), device=dev),
                    torch.tensor(plan.counts, device=dev))
                m = suf_m.index_select(0, rows_g)[:, :, None].expand(r, 1, group, s, s)
                return m.reshape(r, 1, group * s, s)

            allow = plan.expanded(("suf", la.kind, la.window, la.chunk, s, group), build,
                                  dev)
        o2, l2 = attn_lse(q2, key.contiguous(), value.contiguous(), allow, scale, softcap)
        o2 = o2.view(r, hk, group, s, dv).permute(0, 3, 1, 2, 4)
        l2 = l2.view(r, hk, group, s).permute(0, 3, 1, 2)

    # ---- exact merge of the two partial softmaxes (and the sinks' share of the denominator)
    if sinks is not None:
        ls = sinks.float().view(1, 1, hk, group).expand_as(l1)
        lt = torch.logsumexp(torch.stack([l1, l2, ls]), dim=0)
        out = (torch.exp(l1 - lt)[..., None] * o1.float()
               + torch.exp(l2 - lt)[..., None] * o2.float())
        return out.to(out_dtype or dt).reshape(r, s, hq, dv), None
    w1 = torch.sigmoid(l1 - l2)[..., None]
    out = o2.float() + w1 * (o1.float() - o2.float()) if dt != torch.float32 else \
        torch.lerp(o2, o1, w1)
    return out.to(out_dtype or dt).reshape(r, s, hq, dv), None


# --------------------------------------------------------------------------- positional masks


@dataclass
class PositionPlan:
    """Token positions of one forward whose keys are ``[past slots; new tokens]``: ``q_pos [B,
    Lq]`` of the new tokens and ``k_pos [B, Tk]`` of every key slot (-1 = a padding slot), with
    each layer's description. The attention mask is rebuilt from them per layer."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    layers: Sequence[LayerAttention]

    def __post_init__(self) -> None:
        self._allow: dict[tuple, Mask] = {}
        self._compact: tuple[torch.Tensor, torch.Tensor, int] | None | bool = False
        self._copies: dict[str, PositionPlan] = {}

    def on(self, device: torch.device) -> PositionPlan:
        """This plan with its positions on ``device``: itself when they are there, else a copy
        made once (with its own masks). A model split over GPUs (``--device-map auto``) runs
        each layer on its own device."""
        if self.q_pos.device == device:
            return self
        got = self._copies.get(str(device))
        if got is None:
            got = self._copies[str(device)] = PositionPlan(
                self.q_pos.to(device), self.k_pos.to(device), self.layers)
        return got

    def layer(self, layer: int) -> LayerAttention:
        """Layer ``layer``'s attention description."""
        return self.layers[layer]

    def compaction(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """None when every key slot holds its own position (or is masked); else ``(dest [B,
        Tk], k_pos [B, P], P)``: the slot each key moves to so that slot = position (``P``
        for a masked one, a spare slot dropped after), and the positions after the move. A
        kernel's key blocks then fall on the same positions as in a plain forward of the
        sequence, whatever padding the keys had (the bank's padded pasts)."""
        if self._compact is False:
            k_pos = self.k_pos
            slot = torch.arange(k_pos.shape[1], device=k_pos.device)
            if bool(((k_pos == slot[None]) | (k_pos < 0)).all()):
                self._compact = None
            else:
                p = int(k_pos.max()) + 1
                dest = torch.where(k_pos >= 0, k_pos, p)
                filled = torch.zeros(k_pos.shape[0], p + 1, dtype=torch.bool,
                                     device=k_pos.device)
                filled.scatter_(1, dest, k_pos >= 0)
                pos = torch.arange(p, device=k_pos.device)[None].expand(k_pos.shape[0], p)
                self._compact = (dest, torch.where(filled[:, :p], pos, -1), p)
        return self._compact

    def allow(self, la: LayerAttention, tk: int, group: int = 1) -> Mask:
        """``[B, 1, group * Lq, Tk]`` for a layer like ``la`` whose ``group`` query heads per key
        head are stacked along the queries (built once per forward and layer kind)."""
        key = (la.kind, la.window, la.chunk, tk, group)
        m = self._allow.get(key)
        if m is None:
            if self.k_pos.shape[1] != tk:
                raise ValueError(f"positional attention: {tk} keys, but the plan describes "
                                 f"{self.k_pos.shape[1]}")
            a = la.allowed(self.q_pos, self.k_pos)[:, None]
            b, _, lq, _ = a.shape
            m = self._allow[key] = Mask(a[:, :, None].expand(b, 1, group, lq, tk).reshape(
                b, 1, group * lq, tk))
        return m


def positional_kernel(model: PreTrainedModel, device: torch.device | str) -> bool:
    """Whether :func:`positional_attention` runs ``model``'s full layers through a fused kernel
    on ``device`` (token positions in the kernel, no mask tensors): then the prefix bank's trie
    forwards and the KV-copy suffix forwards of every such model take it, not only of models
    with local layers (the cpp backend on the CPU, unless :data:`ATTENTION_ENV` says ``torch``).
    False as well for a model that cannot switch its attention implementation (it keeps its
    own attention, e.g. ALiBi in Bloom's)."""
    if _kernel_backend(torch.device(device), torch.float32, None, False, positions=True) is None:
        return False
    # Whether the model can switch is its own fact: tried once per model, not at every plain
    # forward or prefill chunk that asks.
    ok = _SWITCHES.get(model)
    if ok is None:
        _register()
        previous = model.config._attn_implementation
        try:
            model.set_attn_implementation(POSITIONAL_IMPL)
            ok = model.config._attn_implementation == POSITIONAL_IMPL
        except Exception:  # noqa: BLE001 - any refusal means: keep the model's own attention
            ok = False
        finally:  # always: a composite model sets its sub-models' configs too
            model.set_attn_implementation(previous)
        _SWITCHES[model] = ok
    return ok


_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> can it switch


def positional_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         **kwargs):
    """``AttentionInterface`` function for forwards with padding inside the sequence (prefix-bank
    builds, KV-copy suffix forwards) of models with local layers (and of every model where
    :func:`positional_kernel` says so): the mask comes from the active :class:`PositionPlan` and
    the layer's description (window, chunk, softcap) rather than from transformers' slot-based
    masks, as token positions in a fused kernel where one takes the layer; sinks (``s_aux``)
    take their share of the denominator. The output is in ``query``'s dtype, or in
    ``icqs_out_dtype`` when that keyword asks for one."""
    out_dtype = kwargs.pop(ATTENTION_OUT_DTYPE, None)
    plan, _, la, softcap, sinks = _active_layer("positions", POSITIONAL_IMPL, "position_plan",
                                                module, kwargs)
    plan = plan.on(query.device)  # a split model's layer on another device
    b, hq, lq, d = query.shape
    hk, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
    group = hq // hk
    scale = float(scaling) if scaling is not None else d ** -0.5
    dot = bf16_products(module, query.dtype)
    lay = la if la.local else None
    kernel = _kernel_backend(query.device, query.dtype, softcap, dv != d, lay, dot is not None,
                             positions=True)
    if kernel is None and dot is not None:  # no bf16-product kernel here: fp32 products
        dot = None
        kernel = _kernel_backend(query.device, query.dtype, softcap, dv != d, lay,
                                 positions=True)
    if kernel is not None and plan.k_pos.shape[1] == tk:
        k_pos = plan.k_pos
        # Slot = position is what makes the CPU's forwards batch-invariant; a GPU kernel keeps
        # the slots (the check reads the host).
        moved = plan.compaction() if key.device.type == "cpu" else None
        if moved is not None:  # slot = position, as in a plain forward (see compaction)
            dest, k_pos, p = moved
            idx = dest[:, None, :, None]
            key = key.new_zeros(b, hk, p + 1, d).scatter_(2, idx.expand(b, hk, tk, d), key)
            value = value.new_zeros(b, hk, p + 1, dv).scatter_(2, idx.expand(b, hk, tk, dv),
                                                               value)
            key, value = key[:, :, :p], value[:, :, :p]
        direct = out_dtype if sinks is None and kernel_out(kernel, out_dtype) else None
        out, lse = _fused_attn_lse(query, key, value, scale, kernel, causal=True, la=lay,
                                   softcap=softcap, positions=(plan.q_pos, k_pos), dot=dot,
                                   out_dtype=direct, with_lse=sinks is not None)
    else:
        allow = plan.allow(la, tk, group)
        out, lse = attn_lse(query.reshape(b, hk, group * lq, d), key.contiguous(),
                            value.contiguous(), allow, scale, softcap)
    out = out.view(b, hq, lq, dv)
    if sinks is not None:
        lse = lse.view(b, hq, lq)
        keep = torch.exp(lse - torch.logaddexp(lse, sinks.float().view(1, hq, 1)))
        out = (out.float() * keep[..., None]).to(out.dtype)
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out.transpose(1, 2).contiguous(), None


# Both take the bf16 output a Llama attention's projection reads in place.
setattr(cascade_attention, ATTENTION_OUT_DTYPE, True)
setattr(positional_attention, ATTENTION_OUT_DTYPE, True)


def _register() -> None:
    register_attention(IMPL_NAME, cascade_attention)
    register_attention(POSITIONAL_IMPL, positional_attention)


@contextlib.contextmanager
def _attention_impl(model: PreTrainedModel, name: str, attr: str, value) -> Iterator[None]:
    if getattr(_ACTIVE, attr, None) is not None:
        raise RuntimeError(f"{name} blocks cannot be nested")
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        model.set_attn_implementation(previous)
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation")
    setattr(_ACTIVE, attr, value)
    try:
        yield
    finally:
        setattr(_ACTIVE, attr, None)
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def cascade_plan(model: PreTrainedModel, plan: CascadePlan) -> Iterator[None]:
    """Run the model's attention through :func:`cascade_attention` with ``plan`` inside the
    block (one suffix forward, no KV cache); the previous implementation is restored on exit."""
    with _attention_impl(model, IMPL_NAME, "plan", plan):
        yield


@contextlib.contextmanager
def position_plan(model: PreTrainedModel, plan: PositionPlan) -> Iterator[None]:
    """Run the model's attention through :func:`positional_attention` with ``plan`` inside the
    block; the previous implementation is restored on exit."""
    with _attention_impl(model, POSITIONAL_IMPL, "positions", plan):
        yield
