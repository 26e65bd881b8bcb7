"""C++/OpenMP CPU backend: ``token_stats`` and the block reduction on the ``icqs_fast._C`` module.

The extension takes raw pointers (no torch headers): this wrapper checks dtypes, devices and
layouts, allocates the outputs, and turns the per-row state into :class:`TokenStats` with
:func:`state.finalize`. Each row of logits is read once (see ``csrc/token_stats.cpp``).

The kernel runs the best ISA level the CPU has unless ``ICQS_FAST_CPP_ISA`` (:data:`ISA_ENV`)
names a lower one: the machines this project runs on are either AVX2-only or AVX-512, so an
AVX-512 machine can run (and test) the AVX2 path the other kind runs.
"""

from __future__ import annotations

import os
import threading

import torch

from icqs_fast.backends import state as _state
from icqs_fast.types import PRODUCTS, TokenStats

try:
    from icqs_fast import _C
except ImportError as exc:  # not built (no compiler, or ICQS_FAST_NO_EXT=1)
    _C = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

ISA_ENV = "ICQS_FAST_CPP_ISA"
"""Environment variable forcing the kernel's ISA level (read at every call)."""

ISA_LEVELS = {"sse4": 0, "x86-64-v2": 0, "avx2": 1, "x86-64-v3": 1, "avx512": 2, "x86-64-v4": 2}
"""Values of :data:`ISA_ENV` besides ``auto`` (the CPU's best), by the extension's level
number: 0 the 4-lane SSE4.2 baseline, 1 AVX2+FMA (8 lanes), 2 AVX-512 (16 lanes)."""


def isa_setting() -> int:
    """The kernel ISA level :data:`ISA_ENV` asks for: -1 for ``auto`` or unset (the CPU's best),
    else a level of :data:`ISA_LEVELS`.

    Raises:
        ValueError: an unknown value, or a level above what this CPU (or this build) can run.
    """
    raw = os.environ.get(ISA_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return -1
    if raw not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={raw!r} is not one of auto, {', '.join(ISA_LEVELS)}")
    level = ISA_LEVELS[raw]
    if _C is not None and level > _C.best_isa():
        raise ValueError(f"{ISA_ENV}={raw}: this CPU runs at most {_C.simd_level()}")
    return level


def available() -> tuple[bool, str]:
    """(True, kernel ISA level) when ``icqs_fast._C`` is importable and :data:`ISA_ENV` is
    valid, else (False, why)."""
    if _C is None:
        return False, (f"icqs_fast._C is not built ({_IMPORT_ERROR}); rebuild with "
                       "`pip install --no-build-isolation -e .`")
    try:
        level = isa_setting()
    except ValueError as exc:
        return False, str(exc)
    omp = "OpenMP" if _C.openmp else "no OpenMP"
    if level < 0:
        return True, f"ok ({_C.simd_level()}, {omp})"
    return True, f"ok ({_C.isa_name(level)}, forced by {ISA_ENV}; {omp})"


def _rows(z: torch.Tensor) -> torch.Tensor:
    """A 2-D CPU view with unit column stride (copied only when the last dim is strided)."""
    if z.device.type != "cpu":
        raise ValueError(f"the cpp backend needs CPU tensors, got {z.device}")
    if z.dim() != 2:
        raise ValueError(f"expected a 2-D [N, V] tensor, got shape {list(z.shape)}")
    if z.shape[1] > 1 and z.stride(1) != 1:
        z = z.contiguous()
    return z


def _reduce(z: torch.Tensor, t: torch.Tensor, z_t: torch.Tensor, shift: torch.Tensor,
            temperature: float, tanh_scale: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    n, v = z.shape
    state = _state.new_buffer(n, _state.STATE_WIDTH, dtype=torch.float64)
    counts = _state.new_buffer(n, 2, dtype=torch.int64)
    if n == 0:
        return state, counts
    # The kernel reads raw pointers: check every per-row input really is [N] on the CPU.
    for name, x in (("targets", t), ("z_t", z_t), ("shift", shift)):
        if x.shape != (n,) or x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor of shape [{n}], got "
                             f"{list(x.shape)} on {x.device}")
    t = t.to(torch.int64).contiguous()
    z_t = z_t.to(torch.float64).contiguous()
    shift = shift.to(torch.float64).contiguous()
    _C.reduce_rows(z.data_ptr(), z.stride(0) if n > 1 else v, n, v, _DTYPE_CODES[z.dtype],
                   t.data_ptr(), z_t.data_ptr(), shift.data_ptr(), float(temperature),
                   state.data_ptr(), counts.data_ptr(), torch.get_num_threads(), isa_setting(),
                   0.0 if tanh_scale is None else float(tanh_scale))
    return state, counts


def reduce_block(
    z: torch.Tensor,
    t_local: torch.Tensor,
    z_t: torch.Tensor,
    shift: torch.Tensor,
    temperature: float,
    tanh_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C++ version of :func:`icqs_fast.backends.state.reduce_block` (same semantics).

    Args:
        z: ``[N, Vb]`` fp32/fp16/bf16 logits of one vocabulary block (float64 goes to the torch
            version, since the kernel reads 32/16-bit floats).
        t_local: ``[N]`` int64 target index relative to the block (may lie outside it).
        z_t: ``[N]`` float64 target logits (uncapped); shift: ``[N]`` float64 shift K (x
            units).
        temperature: T > 0.
        tanh_scale: soft-cap epilogue ``z -> tanh(tanh_scale z)``, fused into the C++ pass
            (applied to each logit as it is read, after its rank comparisons; the block is not
            rewritten); None = none. Semantics as in the torch version.

    Returns:
        ``(state [N, 7] float64, counts [N, 2] int64)``.
    """
    if z.dtype not in _DTYPE_CODES:
        return _state.reduce_block(z, t_local, z_t, shift, temperature, tanh_scale)
    return _reduce(_rows(z), t_local, z_t, shift, temperature, tanh_scale)


def tanh_logits(z: torch.Tensor, tanh_scale: float) -> torch.Tensor:
    """``tanh(tanh_scale * z)`` of CPU logits (any float dtype, any shape) as a new fp32 tensor,
    by the C++ epilogue code :func:`reduce_block` applies to every logit (same ISA)."""
    x = z.float().contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _C.tanh_rows(x.data_ptr(), out.data_ptr(), x.numel(), float(tanh_scale), isa_setting())
    return out


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> TokenStats:
    """Token statistics of ``logits [N, V]`` (fp32/fp16/bf16, CPU) at ``targets [N]`` int64.

    One read of each row in C++ to the [N, 7] state, then :func:`state.finalize`. See
    :func:`icqs_fast.ops.token_stats` for the contract; float64 logits use the torch reference.
    """
    if logits.dtype not in _DTYPE_CODES:
        from icqs_fast.backends import torch_ref

        return torch_ref.token_stats(logits, targets, ignore_index, temperature,
                                     compute_dtype=logits.dtype)
    z = _rows(logits)
    n, v = z.shape
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long()
    if v == 0 and n:
        raise ValueError("logits have an empty vocabulary dimension (V = 0)")
    z_t = z.gather(1, safe_t[:, None])[:, 0].double()
    ok = torch.isfinite(z_t) & valid
    shift = torch.where(ok, z_t / temperature, torch.zeros_like(z_t))
    st, counts = _reduce(z, safe_t, z_t, shift, temperature)
    return _state.finalize(st, counts, z_t, valid, temperature)


# ------------------------------------------------------------------ attention with LSE (C++)


BF16_DOT = True
"""bf16 attention inputs on AVX-512 CPUs with AVX512_BF16 run on its dot products (False: they
are widened to fp32 and run the fp32 kernel, as on CPUs without it; tests cover both)."""


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit last-dim stride (the kernels take element strides of dims 0..2)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_mask: torch.Tensor | None, causal: bool, scale: float, *,
                  softcap: float | None = None, window: int | None = None,
                  chunk: int | None = None,
                  positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                  dot_dtype: torch.dtype | None = None, state: torch.Tensor | None = None,
                  return_state: bool = False, key_batch: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, with_lse: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """C++ flash attention with log-sum-exp (``csrc/attention.cpp``) for CPU tensors: the cpp
    backend of :func:`icqs_fast.ops.attention_lse` (arguments validated there).

    Args:
        q: ``[B, Hq, Tq, D]`` fp32/fp16/bf16; k ``[B, Hk, Tk, D]``; v ``[B, Hk, Tk, Dv]`` (any
            strides; a strided last dim is copied); attention_mask ``[B, Tk]`` bool or None.
        causal, scale, softcap, window, chunk: as in ``ops.attention_lse``.
        positions: ``(q_pos [B, Tq], k_pos [B, Tk])`` integer token positions (negative key
            position = masked key) that causal / window / chunk compare; None: queries at the
            last ``Tq`` key slots.
        dot_dtype: ``torch.bfloat16``: q, k, v rounded to bf16 for both products (fp32
            accumulation; the AVX512_BF16 dot products where the CPU has them), or None.
        state: a running softmax state ``[B, Hq, Tq, 17 + Dv]`` fp32 (of a call with
            ``return_state``) to continue from, or None.
        return_state: return ``(state, None)`` instead of normalising.
        key_batch: ``[B]`` int64: query batch b reads batch ``key_batch[b]`` of k, v, the mask
            and the key positions (``[Bk, ...]``), in place; or None.
        out_dtype: ``torch.bfloat16``: the output written in bf16 (each fp32 output rounded
            to nearest even, as a bf16-products linear rounds its input), or None (q's dtype).
        with_lse: False: no log-sum-exp (the kernel skips its log per row; None returned).

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype (fp32 accumulation; token-major strides, i.e.
        ``[B, Tq, Hq, Dv]`` transposed) and ``lse [B, Hq, Tq]`` fp32 (-inf and output 0 for a
        row with no allowed key), or None without ``with_lse``.
    """
    if _C is None or not hasattr(_C, "attention_lse"):
        raise RuntimeError("icqs_fast._C has no attention_lse: rebuild the extension")
    bsz, hq, tq, d = q.shape
    bk, hk, tk, dv = k.shape[0], k.shape[1], k.shape[2], v.shape[3]
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    kbatch = None if key_batch is None else key_batch.to(torch.int64).contiguous()
    width = _C.attention_state_lanes + 1 + dv
    if state is not None and (state.shape != (bsz, hq, tq, width) or state.dtype != torch.float32
                              or not state.is_contiguous()):
        raise ValueError(f"state must be a contiguous fp32 [{bsz}, {hq}, {tq}, {width}] tensor")
    st_out = torch.empty(bsz, hq, tq, width, dtype=torch.float32) if return_state else None
    bf16_out = out_dtype == torch.bfloat16
    out = torch.empty(0 if return_state else bsz * hq * tq * dv,
                      dtype=torch.bfloat16 if bf16_out else torch.float32)
    lse = torch.empty(bsz * hq * tq if with_lse and not return_state else 0,
                      dtype=torch.float32)
    q_pos = k_pos = None
    if positions is not None:
        q_pos = positions[0].to(torch.int64).contiguous()
        k_pos = positions[1].to(torch.int64)
    if attention_mask is not None:
        base = k_pos if k_pos is not None else torch.arange(tk).expand(bk, tk)
        k_pos = torch.where(attention_mask, base, -1)
    if k_pos is not None:
        k_pos = k_pos.contiguous()
    _C.attention_lse(q.data_ptr(), q.stride()[:3], k.data_ptr(), k.stride()[:3], v.data_ptr(),
                     v.stride()[:3], out.data_ptr(), lse.data_ptr() if lse.numel() else 0,
                     0 if q_pos is None else q_pos.data_ptr(),
                     0 if k_pos is None else k_pos.data_ptr(), bsz, hq, hk, tq, tk, d, dv,
                     _DTYPE_CODES[q.dtype], bool(causal), int(window or 0), int(chunk or 0),
                     float(scale), float(softcap or 0.0), torch.get_num_threads(), isa_setting(),
                     BF16_DOT, dot_dtype == torch.bfloat16,
                     0 if state is None else state.data_ptr(),
                     0 if st_out is None else st_out.data_ptr(), True,
                     0 if kbatch is None else kbatch.data_ptr(), bk, bf16_out)
    if st_out is not None:
        return st_out, None
    # Written token-major ([B, Tq, Hq, Dv] in memory): what a model's attention turns its
    # output into next (``out.transpose(1, 2).contiguous()`` is then a view, not a copy).
    out = out.view(bsz, tq, hq, dv).transpose(1, 2)
    return ((out if q.dtype == torch.float32 or bf16_out else out.to(q.dtype)),
            lse.view(bsz, hq, tq) if with_lse else None)


# ------------------------------------------------------------------ attention entropy (C++)


ROUNDING_FLOOR = 16
"""Entropies up to this many fp32 epsilons of the magnitudes they are the difference of (the
range's LSE, and the mean score's bound ``scale |q| |mean key|``) are rounding, and read 0."""


def attention_entropy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_range: torch.Tensor, query_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None, causal: bool, scale: float, *,
                      window: int | None = None, chunk: int | None = None,
                      sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cpp backend of :func:`icqs_fast.ops.attention_entropy` (arguments validated there):
    two calls of the C++ flash kernel (:func:`attention_lse`), never the attention matrix.

    A score is linear in its key (``s_ij = scale q_i . k_j``), so the mean score of a row's
    distribution over the key range is ``scale q_i . sum_j p_ij k_j``: the kernel, given the
    values ``[v, k]`` and only the range's keys, returns the range's output, its log-sum-exp
    ``lse_r`` and that mean, and the entropy is ``lse_r - mean``. A second call over the other
    allowed keys gives their output and LSE, and the two outputs merge exactly by their LSEs
    (as cascade attention's parts; sinks join the merge's denominator). Cost: one attention
    plus ``D`` value columns more on the range's keys. A soft cap makes the score non-linear in
    the key, so it is not supported (the support table sends it to the torch backend).

    Arithmetic is fp32 throughout (16-bit inputs widened: the bf16 kernel rounds the
    probabilities to bf16, too coarse for the mean score). The entropy's error is fp32
    rounding of ``lse_r`` and the mean, ~1e-7 of the scores' magnitude; an entropy below
    :data:`ROUNDING_FLOOR` times that rounding reads 0 (a row with one key in the range is
    exactly 0, as on the other backends).

    Args:
        q: ``[B, Hq, Tq, D]`` fp32/fp16/bf16; k ``[B, Hk, Tk, D]``; v ``[B, Hk, Tk, Dv]``;
            key_range ``[B, 2]`` int64; query_mask ``[B, Tq]`` bool; attention_mask ``[B, Tk]``
            bool or None; causal; scale; window / chunk (a local layer) or None; sinks ``[Hq]``
            or None.

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype and ``entropy [B, Hq, Tq]`` fp32 (0 where
        ``query_mask`` is False or no allowed key lies in the range).
    """
    bsz, hq, tq, d = q.shape
    tk, dv = k.shape[2], v.shape[3]
    qf, kf, vf = (x.float() for x in (q, k, v))
    slots = torch.arange(tk)
    span = key_range.clamp(0, tk)
    in_range = (slots[None] >= span[:, :1]) & (slots[None] < span[:, 1:])
    allowed = torch.ones(bsz, tk, dtype=torch.bool) if attention_mask is None else \
        attention_mask.bool()
    local = {"window": window, "chunk": chunk}
    o_r, l_r = attention_lse(qf, kf, torch.cat([vf, kf], dim=-1), allowed & in_range, causal,
                             scale, **local)
    out = o_r[..., :dv]
    rest = allowed & ~in_range
    lse = l_r
    if bool(rest.any()):  # merge the other keys' part by the two LSEs (both -inf: output 0)
        o_c, l_c = attention_lse(qf, kf, vf, rest, causal, scale, **local)
        out = torch.lerp(o_c, out, torch.sigmoid(l_r - l_c).nan_to_num_(0.0)[..., None])
        lse = torch.logaddexp(l_r, l_c)
    if sinks is not None:  # the sinks' share of the denominator
        out = out * torch.sigmoid(lse - sinks.float().view(1, hq, 1))[..., None]
    # lse_r - mean score; a difference within fp32 rounding of its terms (the kernel's LSE, the
    # dot product; bounded by |lse_r| + scale |q| |mean key|) is no information: it reads 0, as
    # one key in the range must.
    mean_key = o_r[..., dv:]
    mean = torch.linalg.vecdot(qf, mean_key) * scale
    floor = (torch.linalg.vector_norm(qf, dim=-1) * torch.linalg.vector_norm(mean_key, dim=-1)
             * scale + l_r.abs()) * (ROUNDING_FLOOR * torch.finfo(torch.float32).eps)
    ent = l_r - mean
    keep = (ent > floor) & query_mask[:, None, :]  # False where l_r = -inf (no key in range)
    ent = torch.where(keep, ent, torch.zeros((), dtype=ent.dtype))
    return out.to(q.dtype).contiguous(), ent


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` fp32 CPU rotated by ``cos`` / ``sin`` (``[B, T, D]``, broadcast
    over the batch when their batch is 1) in one pass (``csrc/rotary.cpp``): transformers'
    bits. The output keeps ``x``'s layout."""
    b, h, t, d = x.shape
    if x.stride(3) != 1:
        x = x.contiguous()
    cos, sin = (c.expand(b, t, d) for c in (cos, sin))
    if cos.stride() != sin.stride() or cos.stride(2) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    _C.rotary(x.data_ptr(), x.stride()[:3], cos.data_ptr(), sin.data_ptr(), cos.stride()[:2],
              out.data_ptr(), out.stride()[:3], b, h, t, d, torch.get_num_threads(), isa_setting())
    return out


def concat_slots(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 width: int) -> torch.Tensor:
    """:func:`icqs_fast.ops.concat_slots` in one C++ pass (``csrc/concat_slots.cpp``): a
    memcpy per (row, head, part); indices are checked before anything is copied."""
    srcs = [_unit_last_stride(p[0]) for p in parts]
    idx = [[t.contiguous() for t in p[1:]] for p in parts]
    s0 = srcs[0]
    r, h, d = idx[0][0].shape[0], s0.shape[1], s0.shape[3]
    out = torch.empty(r, h, width, d, dtype=s0.dtype)
    _C.concat_slots(out.data_ptr(), r, h, width, d, s0.element_size(),
                    [s.data_ptr() for s in srcs], [x for s in srcs for x in s.stride()[:3]],
                    [s.shape[0] for s in srcs], [s.shape[2] for s in srcs],
                    [i[0].data_ptr() for i in idx], [i[1].data_ptr() for i in idx],
                    [i[2].data_ptr() for i in idx], torch.get_num_threads())
    return out


def _rows2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, D]`` rows with a unit column stride (copied only when it must be)."""
    return _unit_last_stride(x.reshape(-1, x.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`icqs_fast.ops.rms_norm` of fp32 CPU rows in one C++ pass (``csrc/rowwise.cpp``),
    in ``out_dtype`` (bf16: rounded as a bf16-products linear rounds its x)."""
    rows, w = _rows2d(x), weight.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype)
    _C.rms_norm(rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0),
                rows.shape[0], rows.shape[1], eps, torch.get_num_threads(), isa_setting(),
                out_dtype == torch.bfloat16)
    return out.reshape(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 normed_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`icqs_fast.ops.add_rms_norm` of fp32 CPU rows in one C++ pass (the normed rows
    in ``normed_dtype``: bf16 rounded as a bf16-products linear rounds its x)."""
    rows, res, w = _rows2d(x), _rows2d(residual), weight.contiguous()
    total = torch.empty(rows.shape, dtype=x.dtype)
    out = torch.empty(rows.shape, dtype=normed_dtype)
    _C.add_rms_norm(rows.data_ptr(), rows.stride(0), res.data_ptr(), res.stride(0), w.data_ptr(),
                    total.data_ptr(), total.stride(0), out.data_ptr(), out.stride(0),
                    rows.shape[0], rows.shape[1], eps, torch.get_num_threads(), isa_setting(),
                    normed_dtype == torch.bfloat16)
    return total.reshape(x.shape), out.reshape(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`icqs_fast.ops.silu_mul` of fp32 CPU tensors in one C++ pass
    (``csrc/rowwise.cpp``)."""
    g, u = _rows2d(gate), _rows2d(up)
    out = torch.empty(g.shape, dtype=gate.dtype)
    _C.silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(),
                out.stride(0), g.shape[0], g.shape[1], torch.get_num_threads(), isa_setting())
    return out.reshape(gate.shape)


def linear_level(products: str) -> str:
    """The ISA level :func:`linear` runs ``products`` at on this CPU (``"amx"``, ``"avx512"``,
    ``"avx2"`` or ``"generic"``), after :data:`ISA_ENV`."""
    return _C.linear_level_name(_C.linear_level(PRODUCTS.index(products), isa_setting()))


def pack_linear(weight: torch.Tensor, products: str) -> torch.Tensor:
    """``weight [N, K]`` (fp32 / bf16 / fp16, CPU) in the C++ kernel's packed layout for
    ``products`` (``csrc/linear.cpp``): fp32 panels for ``fp32``, bf16 pair panels else."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_linear needs a 2-D CPU weight, got {list(weight.shape)} on "
                         f"{weight.device}")
    kind = 0 if products == PRODUCTS[0] else 1
    w = weight
    if w.dtype not in (torch.float32, torch.bfloat16) or w.stride(1) != 1:
        # fp16 widens exactly; for bf16 products an fp32 copy is rounded by the packer.
        w = w.float().contiguous()
    n, k = w.shape
    out = torch.empty(_C.linear_packed_size(n, k, kind),
                      dtype=torch.float32 if kind == 0 else torch.bfloat16)
    _C.linear_pack(w.data_ptr(), w.stride(0), _DTYPE_CODES[w.dtype], n, k, kind, out.data_ptr())
    return out


def unpack_linear(packed: torch.Tensor, n: int, k: int, products: str) -> torch.Tensor:
    """The ``[n, k]`` weight back out of its :func:`pack_linear` layout (a copy: fp32 for
    ``fp32`` products, bf16 values otherwise; exact, the layout only moves elements)."""
    if products == PRODUCTS[0]:  # [Np/32][K][32]
        panels = packed.view(-1, k, 32).permute(0, 2, 1)
        return panels.reshape(-1, k)[:n].clone()
    kp = -(-k // 32) * 32  # [Np/32][Kp/2][32][2]
    panels = packed.view(-1, kp // 2, 32, 2).permute(0, 2, 1, 3)
    return panels.reshape(-1, kp)[:n, :k].clone()


# The calling thread's previous linear input (held: its memory cannot be reused meanwhile) and
# its key. The q / k / v (and gate / up) projections take one input: its bf16 terms are reused.
_LAST = threading.local()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, products: str,
           bias: torch.Tensor | None, up: torch.Tensor | None = None,
           residual: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32,
           rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x [M, K]`` fp32 (or bf16: read in place for bf16 products) CPU times a
    :func:`pack_linear` weight (+ ``bias [N]``, then + ``residual [M, N]`` fp32): ``[M, N]``
    fp32, each element in one fixed order (``csrc/linear.cpp``). With ``up`` (a second weight
    packed alike, no bias, no residual): ``silu(x @ W^T) * (x @ up^T)`` in one call, in
    ``out_dtype`` (bf16: rounded as a bf16-products x is). ``rotary``: ``(cos, sin)`` fp32
    ``[B or 1, T, D]`` (``M = B T``): each D-wide head of the output rotated as
    :func:`rotary` does, in the same pass."""
    m, k = x.shape
    mode = PRODUCTS.index(products)
    x_bf16 = x.dtype == torch.bfloat16 and mode == 1  # its own bf16 term, as it is
    if x.dtype != torch.float32 and not x_bf16:
        x = x.float()
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    b = None if bias is None else bias.float().contiguous()
    r = None if residual is None else _unit_last_stride(residual)
    out = torch.empty(m, out_features, dtype=out_dtype)
    rot: tuple = (0, 0, 0, 1, 0, 0)
    if rotary is not None:
        cos, sin = rotary
        if cos.stride() != sin.stride() or cos.stride(2) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        t, d = cos.shape[1], cos.shape[2]
        rot = (cos.data_ptr(), sin.data_ptr(), d, t, cos.stride(0) if cos.shape[0] > 1 else 0,
               cos.stride(1))
    # The same memory, layout and version as the previous input, which is held (so no other
    # tensor can live at its address): the same values (an in-place change bumps the version
    # counter every view shares), so its terms can be reused. A bf16 x has no terms to reuse.
    key = (x.data_ptr(), tuple(x.shape), x.stride(), x._version, mode)
    same = getattr(_LAST, "x", None) is not None and _LAST.key == key
    _LAST.x, _LAST.key = (x, key) if mode != 0 and not x_bf16 else (None, ())
    _C.linear(x.data_ptr(), x.stride(0) if m > 1 else k, m, k, packed.data_ptr(), out_features,
              0 if b is None else b.data_ptr(), out.data_ptr(), out_features, mode,
              # ICQS_FAST_CPP_ISA caps this kernel too: "avx512" leaves AMX out (the AVX-512
              # BF16 path of CPUs without AMX).
              torch.get_num_threads(), isa_setting(), same, 0 if up is None else up.data_ptr(),
              0 if r is None else r.data_ptr(),
              0 if r is None else r.stride(0) if m > 1 else out_features,
              x_bf16, out_dtype == torch.bfloat16, *rot)
    return out
