"""Flash-attention forward that also returns the attention entropy of flagged query rows over a
key range (and, optionally, each row's log-sum-exp), without materialising ``[heads, Tq, Tk]``.

One program handles one (batch, query head, query block). It loops over key blocks with the usual
online softmax (scores in log2 units, ``s = q.k * scale * log2 e``, running max ``m``,
``p = 2^(s - m)``, ``l = sum p``). The entropy state shares that running max and that ``p`` (no
second exponential per score): over the keys of the row's range ``[k0, k1)`` it keeps
``l_r = sum p`` and ``t_r = sum p (s - m)``; when the max grows from m to m' both are rescaled
by ``a = 2^(m - m')``: ``l_r <- a l_r``, ``t_r <- a (t_r + l_r (m - m'))``. At the end
``H = ln l_r - ln 2 * t_r / l_r`` (in nats). The range is a per-column mask, not a branch: the
key loop has no data-dependent control flow (its bounds come from the query block only).

Accuracy limit of the shared reference: in-range terms are ``2^(s - m)`` with m the max over ALL
allowed keys, so an in-range score more than 126 log2 units (87.3 nats of scaled score) below the
row's max underflows to 0 (fp32 ``ex2`` flushes denormals). While the range's own max is within
about 100 log2 units (~69 nats) of the row max, every dropped term weighs < 2^-26 of the range's
largest term and the entropy is exact to fp32 rounding; beyond that it degrades, and when every
in-range term underflows (range max > 87.3 nats below the row max, e.g. a range that only an
extreme attention sink outweighs) the row's entropy is reported as 0, like an empty range. Real
attention sinks sit a few tens of nats above the rest (tests cover a 60-nat sink).

Masked scores are set to -1e30 (finite, so ``0 * (s - m)`` is never ``0 * inf``); the running max
starts there too, so a row whose keys so far are all masked accumulates junk that the first real
key's rescale ``2^(-1e30 - m)`` = 0 wipes out; a row with no allowed key at all (max still
-1e30) gets output 0, log-sum-exp -inf and entropy 0. A row with no allowed key in the range
gets entropy 0.

Layer variants are constexpr switches (soft cap, window, chunks, given positions, ``Dv != D``,
sinks, bf16 products; docs/BACKENDS.md); loop bounds come from the query block's positions on
the device: no key block below every row's window, masked edge blocks in a loop of their own.

Offsets: batch / head / row offsets are int64 (``B * H * T * D`` may pass 2^31); offsets within
a tile are int32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import triton_interpreting

_MASKED = tl.constexpr(-1.0e30)  # masked score (log2 units): finite, far below any real score
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _capped(x, cap_out, PRECISE: tl.constexpr):
    """``cap_out * tanh(x)`` (``c tanh(s / c)`` in log2 units: ``1 / c`` folded into ``x``).
    16-bit builds: ``1 - 2 / (1 + e^(2x))``, abs. error ~2e-7 (below the inputs' rounding); PRECISE
    (fp32): ~2 ulp, Cephes' polynomial for ``|x| < 0.625`` (else fp32 scores move ~1e-5 c)."""
    if PRECISE:
        ax = tl.abs(x)
        x2 = x * x
        p = x2 * -5.70498872745e-3 + 2.06390887954e-2
        p = p * x2 - 5.37397155531e-2
        p = p * x2 + 1.33314422036e-1
        p = p * x2 - 3.33332819422e-1
        e = tl.math.exp2(ax * -2.8853900817779268)  # e^(-2|x|)
        big = tl.fdiv(1.0 - e, 1.0 + e)
        big = tl.where(x < 0, -big, big)
        return cap_out * tl.where(ax < 0.625, p * x2 * x + x, big)
    e = tl.math.exp2(x * 2.8853900817779268)  # e^(2x)
    return cap_out - tl.fdiv(2.0 * cap_out, 1.0 + e)


@triton.jit
def _bf16_rne(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept in fp32: the products of
    the rounded values are exact in fp32, as a bf16 MMA's. For the interpreter, whose fp32 ->
    bf16 cast truncates (on a GPU the cast itself rounds to nearest)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _attn_block(
    acc,
    m_i,
    l_i,
    l_r,
    t_r,
    q,
    k_base,
    v_base,
    keyok_ptr,
    kpos_ptr,
    qpos,
    k0,
    width,
    Tk,
    n_start,
    n_stop,
    stride_kn,
    stride_vn,
    qk_scale,
    cap_out,
    window,
    chunk,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_KEYOK: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Key blocks ``[n_start, n_stop)`` (scalar ``k_base`` / ``v_base`` point at key 0 of this
    batch and key head; ``qpos [BLOCK_M]`` the rows' positions; key positions are read from
    ``kpos_ptr`` with HAS_POS, else the key index). MASKED=False: every key of every block is
    allowed for every row (no mask work); True: causal / window / chunk / padding / ``Tk``
    masks. The pointer tiles are built here, not passed in: live across the
    first loop they cost registers (spills on sm_80)."""
    D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
    DV_MASK: tl.constexpr = BLOCK_DV != HEAD_DV
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DV
    # 64-bit scalar step to the first key; the per-element offsets within a tile stay int32.
    k_ptrs = (k_base + n_start.to(tl.int64) * stride_kn
              + (offs_n0[None, :] * stride_kn + offs_d[:, None]))
    v_ptrs = (v_base + n_start.to(tl.int64) * stride_vn
              + (offs_n0[:, None] * stride_vn + offs_dv[None, :]))
    for n0 in range(n_start, n_stop, BLOCK_N):
        offs_n = n0 + offs_n0
        if MASKED:
            n_ok = offs_n < Tk
            if D_MASK:
                kt = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            else:
                kt = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
            if DV_MASK:
                vb = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
            else:
                vb = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            if D_MASK:
                kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            else:
                kt = tl.load(k_ptrs)
            if DV_MASK:
                vb = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
            else:
                vb = tl.load(v_ptrs)
        if FP32_DOT:
            kt = kt.to(tl.float32)
            vb = vb.to(tl.float32)
            if DOT_BF16:  # mixed precision: bf16 products, fp32 accumulation
                kt = _bf16_rne(kt)
                vb = _bf16_rne(vb)
        elif DOT_BF16:
            kt = kt.to(tl.bfloat16)
            vb = vb.to(tl.bfloat16)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = _capped(s, cap_out, FP32_DOT and not DOT_BF16)
        if MASKED:
            allowed = n_ok[None, :]
            if HAS_KEYOK:
                kok = tl.load(keyok_ptr + offs_n, mask=n_ok, other=0) != 0
                allowed = allowed & kok[None, :]
            if HAS_POS:  # a negative key position marks a padded slot
                kpos = tl.load(kpos_ptr + offs_n, mask=n_ok, other=-1)
                allowed = allowed & (kpos[None, :] >= 0)
            else:
                kpos = offs_n
            if CAUSAL:
                allowed = allowed & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                # q - k < window: the key is one of the last `window` positions up to q.
                allowed = allowed & (qpos[:, None] - kpos[None, :] < window)
            if HAS_CHUNK:
                # Same chunk: k in [q - q % c, q - q % c + c). Only q >= 0 (no key k >= 0
                # shares a negative q's chunk), where % means the same in every lowering.
                c0 = qpos - qpos % chunk
                allowed = allowed & ((qpos >= 0)[:, None] & (kpos[None, :] >= c0[:, None])
                                     & (kpos[None, :] < (c0 + chunk)[:, None]))
            s = tl.where(allowed, s, _MASKED)

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        x = s - m_new[:, None]
        p = tl.math.exp2(x)
        if WITH_ENTROPY:
            # k0 <= n < k0 + width as one unsigned compare per column.
            in_r = (offs_n - k0).to(tl.uint32) < width
            w = tl.where(in_r[None, :], p, 0.0)
            t_r = alpha * (t_r + l_r * (m_i - m_new)) + tl.sum(w * x, axis=1)
            l_r = alpha * l_r + tl.sum(w, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if FP32_DOT:
            acc += tl.dot(p, vb, input_precision=PRECISION)
        else:
            acc += tl.dot(p.to(vb.dtype), vb)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i, l_r, t_r


@triton.jit
def _attn_entropy_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    ent_ptr,
    lse_ptr,
    keyok_ptr,
    qmask_ptr,
    krange_ptr,
    qpos_ptr,
    kpos_ptr,
    sinks_ptr,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    Tq,
    Tk,
    HQ,
    GROUP,
    window,
    chunk,
    qk_scale,
    cap_out,
    CAUSAL: tl.constexpr,
    HAS_KEYOK: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # One flat grid axis (CUDA caps y at 65,535: rows x heads pass it), query blocks fastest.
    n_mblocks = tl.cdiv(Tq, BLOCK_M)
    pid_bh, pid_m = tl.program_id(0) // n_mblocks, tl.program_id(0) % n_mblocks
    pid_m = (n_mblocks - 1 - pid_m) if CAUSAL else pid_m  # causal: most keys first (less tail)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    hk = h // GROUP
    D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
    DV_MASK: tl.constexpr = BLOCK_DV != HEAD_DV

    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DV

    q_rows = q_ptr + b * stride_qb + h * stride_qh + m_start.to(tl.int64) * stride_qm
    q_ptrs = q_rows + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    if D_MASK:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
        if DOT_BF16:
            q = _bf16_rne(q)
    elif DOT_BF16:
        q = q.to(tl.bfloat16)

    if WITH_ENTROPY:
        # Clip the range to [0, Tk] (int32 from here on: positions are < Tk).
        k0 = tl.minimum(tl.maximum(tl.load(krange_ptr + b * 2), 0), Tk)
        k1 = tl.minimum(tl.maximum(tl.load(krange_ptr + b * 2 + 1), k0), Tk)
        width = (k1 - k0).to(tl.uint32)
        k0 = k0.to(tl.int32)
    else:
        k0 = 0
        width = 0

    # Positions: given (the cascade's parts: each entry's own offsets, padded slots at -1), or
    # query i at Tk - Tq + i and key j at j. The loop bounds come from the query block's lowest
    # / highest position, on the device (no host round trip); with given positions every key
    # block is visited, masked (key positions need not grow with the slot).
    MASK_ALL: tl.constexpr = HAS_KEYOK or HAS_POS or HAS_CHUNK
    if HAS_POS:
        qpos = tl.load(qpos_ptr + b * Tq + offs_m, mask=row_ok, other=0)
    else:
        qpos = Tk - Tq + offs_m
    q_lo = Tk - Tq + m_start
    q_hi = q_lo + BLOCK_M - 1
    if HAS_POS:
        n_stop = Tk
        n_full = n_stop * 0
    elif CAUSAL:
        n_stop = tl.minimum(Tk, tl.maximum(q_hi + 1, 0))
        # Key blocks every row of this query block fully sees: no mask work there.
        n_full = tl.minimum((tl.maximum(q_lo + 1, 0) // BLOCK_N) * BLOCK_N, n_stop)
    else:
        n_stop = Tk
        n_full = (Tk // BLOCK_N) * BLOCK_N
    # [n_lo, n_in): masked blocks at the lower edge of a window or chunk; below n_lo no row
    # sees a key, from n_in on every row sees every key a window allows.
    n_lo = n_stop * 0
    n_in = n_lo
    if HAS_WINDOW and not HAS_POS:
        n_lo = tl.minimum((tl.maximum(q_lo - window + 1, 0) // BLOCK_N) * BLOCK_N, n_stop)
        n_in = tl.maximum(tl.minimum(
            tl.cdiv(tl.maximum(q_hi - window + 1, 0), BLOCK_N) * BLOCK_N, n_stop), n_lo)
    if HAS_CHUNK and not HAS_POS:
        c_lo = tl.maximum(q_lo, 0)
        n_lo = tl.maximum(n_lo, tl.minimum(((c_lo - c_lo % chunk) // BLOCK_N) * BLOCK_N, n_stop))
        n_in = tl.maximum(n_in, n_lo)
        if not CAUSAL:  # nothing past the end of the last row's chunk
            n_stop = tl.where(q_hi >= 0, tl.minimum(n_stop, q_hi - q_hi % chunk + chunk),
                              n_stop)
    if MASK_ALL:
        n_mid = n_in
    else:
        n_mid = tl.maximum(n_full, n_in)

    m_i = tl.full([BLOCK_M], _MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    l_r = tl.zeros([BLOCK_M], tl.float32)
    t_r = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    keyok_row = keyok_ptr + b * Tk
    kpos_row = kpos_ptr + b * Tk
    if HAS_WINDOW or HAS_CHUNK:
        acc, m_i, l_i, l_r, t_r = _attn_block(
            acc, m_i, l_i, l_r, t_r, q, k_base, v_base, keyok_row, kpos_row, qpos, k0, width, Tk,
            n_lo, n_in, stride_kn, stride_vn, qk_scale, cap_out, window, chunk,
            True, CAUSAL, HAS_KEYOK, HAS_POS, HAS_WINDOW, HAS_CHUNK, HAS_SOFTCAP,
            WITH_ENTROPY, FP32_DOT, DOT_BF16, PRECISION,
            HEAD_DIM, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    if not MASK_ALL:  # padding, positions, chunks: every block masked, no unmasked loop
        acc, m_i, l_i, l_r, t_r = _attn_block(
            acc, m_i, l_i, l_r, t_r, q, k_base, v_base, keyok_row, kpos_row, qpos, k0, width, Tk,
            n_in, n_mid, stride_kn, stride_vn, qk_scale, cap_out, window, chunk,
            False, CAUSAL, HAS_KEYOK, HAS_POS, HAS_WINDOW, HAS_CHUNK, HAS_SOFTCAP,
            WITH_ENTROPY, FP32_DOT, DOT_BF16,
            PRECISION, HEAD_DIM, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    if not EVEN_N:  # EVEN_N: not causal, no mask at all, Tk % BLOCK_N == 0: no masked tail
        acc, m_i, l_i, l_r, t_r = _attn_block(
            acc, m_i, l_i, l_r, t_r, q, k_base, v_base, keyok_row, kpos_row, qpos, k0, width, Tk,
            n_mid, n_stop, stride_kn, stride_vn, qk_scale, cap_out, window, chunk,
            True, CAUSAL, HAS_KEYOK, HAS_POS, HAS_WINDOW, HAS_CHUNK, HAS_SOFTCAP,
            WITH_ENTROPY, FP32_DOT, DOT_BF16, PRECISION,
            HEAD_DIM, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV)

    # A row with no allowed key keeps m_i at _MASKED (its l_i counts masked junk): output 0.
    has_key = m_i > 0.5 * _MASKED
    l_safe = tl.where(has_key, l_i, 1.0)
    denom = l_safe
    if HAS_SINKS:
        # The sink's share of the denominator, 2^(sink log2 e - m), on the same running max:
        # the output shrinks by it, the log-sum-exp below stays that of the keys alone.
        sink = tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
        denom = l_safe + tl.math.exp2(tl.where(has_key, sink - m_i, 0.0))
    out = tl.where(has_key[:, None], acc / denom[:, None], 0.0)
    o_rows = out_ptr + b * stride_ob + h * stride_oh + m_start.to(tl.int64) * stride_om
    o_ptrs = o_rows + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_dv[None, :]
    if DV_MASK:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    row_out = pid_bh.to(tl.int64) * Tq + offs_m
    if RETURN_LSE:
        # natural-log log-sum-exp of the scaled scores: (m + log2 l) * ln 2
        lse = tl.where(has_key, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))
        tl.store(lse_ptr + row_out, lse, mask=row_ok)
    if WITH_ENTROPY:
        flag = tl.load(qmask_ptr + b * Tq + offs_m, mask=row_ok, other=0) != 0
        ok = has_key & (l_r > 0)
        l_rs = tl.where(ok, l_r, 1.0)
        ent = tl.where(ok, tl.log(l_rs) - _LN2 * t_r / l_rs, 0.0)
        ent = tl.where(flag, tl.maximum(ent, 0.0), 0.0)
        tl.store(ent_ptr + row_out, ent, mask=row_ok)


@dataclass(frozen=True)
class AttentionSettings:
    """Launch settings of :func:`launch_attention` for one shape (chosen in one place)."""

    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int
    fp32_dot: bool
    precision: str
    even_n: bool
    grid: tuple[int, int, int]

    @property
    def label(self) -> str:
        dv = "" if self.block_dv == self.block_d else f"_bdv{self.block_dv}"
        return (f"bm{self.block_m}_bn{self.block_n}_bd{self.block_d}{dv}_w{self.num_warps}"
                f"_s{self.num_stages}")


def attention_settings(b: int, hq: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                       interpret: bool = False, has_keyok: bool = False,
                       causal: bool = True, dv: int | None = None,
                       local: bool = False, dot_bf16: bool = False,
                       softcap: bool = False) -> AttentionSettings:
    """Tiles, warps, stages and grid for ``q [b, hq, tq, d]`` against ``tk`` keys of ``dtype``
    (values of head size ``dv``, ``d`` if None).

    16-bit inputs, head dims <= 128: 128 x 64 tiles, 8 warps, 3 stages: each warpgroup (4 warps)
    owns 64 query rows, so sm_90 issues wgmma (HGMMA); the fp32 accumulator takes 64 (d=128) or
    32 (d=64) registers a thread; no spills on sm_90 or sm_80 (4 warps spill at d=64). fp32
    inputs run full-precision ("ieee") FMA dots, not Triton's default TF32 (10-bit mantissa on
    Ampere/Hopper), as in kernels/linear_token_stats.py: small tiles (32 x 32 at d <= 64, 16 x 16
    above; larger ones spill). The tiles follow the larger of the two head sizes (q and the
    accumulator are both live across the key loop).
    ``has_keyok``: every key block is masked (a padding mask, given positions, chunks);
    ``local``: a window or chunk (masked blocks at its edge); ``softcap``: the tanh of every
    score (more live registers in the score tile); ``causal``: with ``not causal``,
    none of these and ``tk % block_n == 0`` (``even_n``) the kernel compiles no masked key
    loop.
    ``dot_bf16``: bf16 products of fp32 inputs (the 16-bit tiles; the loads stay fp32).
    ``interpret``: the CPU interpreter's settings (small tiles, fp32 dots: it has no bf16/fp16
    ``tl.dot``); :func:`gpu_launches` always describes the CUDA path (``interpret=False``).
    """
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(d if dv is None else dv))
    wide = max(block_d, block_dv)
    fp32_dot = interpret or (dtype == torch.float32 and not dot_bf16)
    if interpret:
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif fp32_dot:
        block_m, block_n, warps, stages = (32, 32, 4, 2) if wide <= 64 else (16, 16, 4, 2)
    elif wide <= 128:
        # At d=128 with 64-key blocks, a masked loop without the causal split (padding mask;
        # not causal with a ragged last block) spills 16-24 B on sm_80, a window's edge loop
        # 48 B, the soft cap 32 B, fp32 loads for bf16 products 8 B on sm_90: 32-key blocks.
        ragged = not causal and tk % 64 != 0
        heavy = has_keyok or ragged or local or softcap or dot_bf16
        block_n = 32 if wide > 64 and heavy else 64
        block_m, warps, stages = 128, 8, 3
    elif local or softcap or block_dv > 128:
        # d = 256 (Gemma 2), plain or with a window / soft cap: 64 x 32 tiles spill 8-16 B on
        # sm_80; 64 x 16 do not and keep wgmma on sm_90 (32 x 32 would fall back to mma).
        block_m, block_n, warps, stages = 64, 16, 4, 2
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    even_n = not causal and not has_keyok and not local and tk % block_n == 0
    return AttentionSettings(block_m=block_m, block_n=block_n, block_d=block_d,
                             block_dv=block_dv, num_warps=warps, num_stages=stages,
                             fp32_dot=fp32_dot, even_n=even_n,
                             precision="ieee" if fp32_dot else "tf32",
                             grid=(triton.cdiv(tq, block_m) * b * hq, 1, 1))


def launch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    key_range: torch.Tensor | None = None,
    query_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    window: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    dot_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the fused forward once (inputs already validated by the caller; nothing here reads
    a device value on the host).

    Args:
        q: ``[B, Hq, Tq, D]``; k: ``[B, Hk, Tk, D]``; v: ``[B, Hk, Tk, Dv]`` (any strides; a
            last dim that is not contiguous is copied), same float dtype and device, ``Hq`` a
            multiple of ``Hk``.
        causal: key j is allowed for query i when ``kpos_j <= qpos_i``; scale: score
            multiplier.
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        key_range, query_mask: ``[B, 2]`` int ``(start, end)`` and ``[B, Tq]`` bool, both given
            to compute the entropy (the kernel is built with the entropy state only then).
        return_lse: also return the natural-log log-sum-exp of each row's scaled, masked scores.
        window: a sliding window ``w``: key j also needs ``qpos_i - kpos_j < w``.
        chunk: chunked attention ``c``: key j also needs ``kpos_j // c == qpos_i // c``.
        softcap: scores ``c tanh(s / c)`` with ``c = softcap``.
        sinks: ``[Hq]`` sink logits: each adds ``exp(sink_h)`` to its head's softmax
            denominator (the output shrinks; the log-sum-exp stays that of the keys alone).
        positions: ``(q_pos [B, Tq], k_pos [B, Tk])`` int token positions (< 2^31; a
            negative key position masks the key), or None: ``qpos_i = Tk - Tq + i``,
            ``kpos_j = j``.
        dot_bf16: q, k, v enter both products as bf16 (fp32 accumulation; with 16-bit inputs
            the probabilities enter the PV product in that dtype), e.g. fp32 activations
            against a bf16 bank.

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype, ``entropy [B, Hq, Tq]`` fp32 or None,
        ``lse [B, Hq, Tq]`` fp32 (-inf for a row with no allowed key) or None.
    """
    bsz, hq, tq, d = q.shape
    hk, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    with_entropy = key_range is not None
    if with_entropy != (query_mask is not None):
        raise ValueError("key_range and query_mask go together")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dev = q.device
    out = torch.empty(bsz, hq, tq, dv, device=dev, dtype=q.dtype)
    ent = torch.empty(bsz, hq, tq, device=dev, dtype=torch.float32) if with_entropy else None
    lse = torch.empty(bsz, hq, tq, device=dev, dtype=torch.float32) if return_lse else None
    if bsz * hq * tq == 0:
        return out, ent, lse
    # Unused pointer arguments get a small placeholder (never read: constexpr-gated).
    dummy_f = torch.empty(1, device=dev, dtype=torch.float32)
    dummy_i8 = torch.zeros(1, device=dev, dtype=torch.int8)
    if with_entropy:
        kr = key_range.to(device=dev, dtype=torch.int64).contiguous()
        qm = query_mask.to(device=dev, dtype=torch.int8).contiguous()
    else:
        kr, qm = torch.zeros(2, device=dev, dtype=torch.int64), dummy_i8
    keyok = (attention_mask.to(device=dev, dtype=torch.int8).contiguous()
             if attention_mask is not None else dummy_i8)
    if positions is not None:
        qpos, kpos = (p.to(device=dev, dtype=torch.int32).contiguous() for p in positions)
    else:
        qpos = kpos = torch.zeros(1, device=dev, dtype=torch.int32)
    sk = (sinks.to(device=dev, dtype=torch.float32).contiguous() if sinks is not None
          else dummy_f)
    cfg = attention_settings(bsz, hq, tq, tk, d, q.dtype, interpret=triton_interpreting(),
                             has_keyok=(attention_mask is not None or positions is not None
                                        or chunk is not None),
                             causal=bool(causal), dv=dv,
                             local=window is not None or chunk is not None,
                             dot_bf16=dot_bf16, softcap=softcap is not None)
    # Scores in log2 units; with a cap, s = (c log2 e) tanh(q.k scale / c).
    qk_scale = float(scale) * (math.log2(math.e) if softcap is None else 1.0 / float(softcap))
    cap_out = 1.0 if softcap is None else float(softcap) * math.log2(math.e)
    _attn_entropy_fwd[cfg.grid](
        q, k, v, out, ent if with_entropy else dummy_f, lse if return_lse else dummy_f,
        keyok, qm, kr, qpos, kpos, sk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tq, tk, hq, hq // hk, 0 if window is None else int(window),
        0 if chunk is None else int(chunk), qk_scale, cap_out,
        CAUSAL=bool(causal), HAS_KEYOK=attention_mask is not None,
        HAS_POS=positions is not None, HAS_WINDOW=window is not None,
        HAS_CHUNK=chunk is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, WITH_ENTROPY=with_entropy,
        RETURN_LSE=bool(return_lse), FP32_DOT=cfg.fp32_dot, DOT_BF16=bool(dot_bf16),
        PRECISION=cfg.precision,
        EVEN_N=cfg.even_n, HEAD_DIM=d, HEAD_DV=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d, BLOCK_DV=cfg.block_dv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, ent, lse


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_range: torch.Tensor,
    query_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward with entropy (inputs already validated by ``icqs_fast.ops``).

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hk, Tk, D]`` (any strides), same float dtype.
        key_range: ``[B, 2]`` int64 ``(start, end)``; query_mask: ``[B, Tq]`` bool;
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        causal: query i sits at absolute position ``Tk - Tq + i``; scale: score multiplier.

    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype and ``entropy [B, Hq, Tq]`` fp32.
    """
    out, ent, _ = launch_attention(q, k, v, causal=causal, scale=scale,
                                   attention_mask=attention_mask, key_range=key_range,
                                   query_mask=query_mask)
    return out, ent


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    dot_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning the output and the log-sum-exp (no entropy state).

    Args:
        q: ``[B, Hq, Tq, D]``; k: ``[B, Hk, Tk, D]``; v: ``[B, Hk, Tk, Dv]``, same float dtype
            and device.
        scale: score multiplier; causal: key j allowed for query i when ``kpos_j <= qpos_i``.
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        window, chunk, softcap, sinks, positions, dot_bf16: the layer variants of
            :func:`launch_attention`.

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype and ``lse [B, Hq, Tq]`` fp32 (natural log of the
        sum of ``exp(score)`` over allowed keys, the sinks not included; -inf for a row with
        none, whose output is 0).
    """
    out, _, lse = launch_attention(q, k, v, causal=causal, scale=scale,
                                   attention_mask=attention_mask, return_lse=True,
                                   window=window, chunk=chunk, softcap=softcap, sinks=sinks,
                                   positions=positions, dot_bf16=dot_bf16)
    return out, lse
