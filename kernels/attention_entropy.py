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

Offsets: batch / head / row offsets are int64 (``B * H * T * D`` may pass 2^31); offsets within
a tile are int32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launch, ptr, triton_interpreting

_MASKED = tl.constexpr(-1.0e30)  # masked score (log2 units): finite, far below any real score
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attn_block(
    acc, m_i, l_i, l_r, t_r,
    q, k_base, v_base, keyok_ptr,
    qpos0, k0, width, Tk,
    n_start, n_stop,
    stride_kn, stride_vn, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEYOK: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    D_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Key blocks ``[n_start, n_stop)`` (scalar ``k_base`` / ``v_base`` point at key 0 of this
    batch and key head). MASKED=False: every key of every block is allowed for every row (no
    mask work); True: causal / padding / ``Tk`` masks. The pointer tiles are built here, not
    passed in: live across the first loop they cost registers (spills on sm_80)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    # 64-bit scalar step to the first key; the per-element offsets within a tile stay int32.
    k_ptrs = (k_base + n_start.to(tl.int64) * stride_kn
              + (offs_n0[None, :] * stride_kn + offs_d[:, None]))
    v_ptrs = (v_base + n_start.to(tl.int64) * stride_vn
              + (offs_n0[:, None] * stride_vn + offs_d[None, :]))
    for n0 in range(n_start, n_stop, BLOCK_N):
        offs_n = n0 + offs_n0
        if MASKED:
            n_ok = offs_n < Tk
            if D_MASK:
                kt = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                vb = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
                vb = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            if D_MASK:
                kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
                vb = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs)
                vb = tl.load(v_ptrs)
        if FP32_DOT:
            kt = kt.to(tl.float32)
            vb = vb.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            allowed = n_ok[None, :]
            if HAS_KEYOK:
                kok = tl.load(keyok_ptr + offs_n, mask=n_ok, other=0) != 0
                allowed = allowed & kok[None, :]
            if CAUSAL:
                qpos = qpos0 + tl.arange(0, BLOCK_M)
                allowed = allowed & (offs_n[None, :] <= qpos[:, None])
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
    q_ptr, k_ptr, v_ptr, out_ptr, ent_ptr, lse_ptr, keyok_ptr, qmask_ptr, krange_ptr,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    Tq, Tk, HQ, GROUP, qk_scale,
    CAUSAL: tl.constexpr, HAS_KEYOK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    RETURN_LSE: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Causal: the last query blocks have the most keys; launch them first (less tail).
    n_mblocks = tl.num_programs(0)
    pid_m = (n_mblocks - 1 - tl.program_id(0)) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    hk = h // GROUP
    D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM

    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM

    q_rows = q_ptr + b * stride_qb + h * stride_qh + m_start.to(tl.int64) * stride_qm
    q_ptrs = q_rows + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :]
    if D_MASK:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    if WITH_ENTROPY:
        # Clip the range to [0, Tk] (int32 from here on: positions are < Tk).
        k0 = tl.minimum(tl.maximum(tl.load(krange_ptr + b * 2), 0), Tk)
        k1 = tl.minimum(tl.maximum(tl.load(krange_ptr + b * 2 + 1), k0), Tk)
        width = (k1 - k0).to(tl.uint32)
        k0 = k0.to(tl.int32)
    else:
        k0 = 0
        width = 0

    # Absolute position of query i is Tk - Tq + i (queries are the last Tq positions).
    qpos0 = Tk - Tq + m_start
    if CAUSAL:
        n_stop = tl.minimum(Tk, Tk - Tq + m_start + BLOCK_M)
        # Key blocks every row of this query block fully sees: no mask work there.
        n_full = ((Tk - Tq + m_start + 1) // BLOCK_N) * BLOCK_N
    else:
        n_stop = Tk
        n_full = (Tk // BLOCK_N) * BLOCK_N
    if HAS_KEYOK:  # padding masks every block
        n_full = n_stop * 0

    m_i = tl.full([BLOCK_M], _MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    l_r = tl.zeros([BLOCK_M], tl.float32)
    t_r = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    keyok_row = keyok_ptr + b * Tk
    if not HAS_KEYOK:  # with a padding mask every block is masked: no unmasked loop at all
        acc, m_i, l_i, l_r, t_r = _attn_block(
            acc, m_i, l_i, l_r, t_r, q, k_base, v_base, keyok_row, qpos0, k0, width, Tk,
            n_full * 0, n_full, stride_kn, stride_vn, qk_scale,
            False, CAUSAL, HAS_KEYOK, WITH_ENTROPY, FP32_DOT, PRECISION, D_MASK, HEAD_DIM,
            BLOCK_M, BLOCK_N, BLOCK_D)
    if not EVEN_N:  # EVEN_N: not causal, no padding mask, Tk % BLOCK_N == 0: no masked tail
        acc, m_i, l_i, l_r, t_r = _attn_block(
            acc, m_i, l_i, l_r, t_r, q, k_base, v_base, keyok_row, qpos0, k0, width, Tk,
            n_full, n_stop, stride_kn, stride_vn, qk_scale,
            True, CAUSAL, HAS_KEYOK, WITH_ENTROPY, FP32_DOT, PRECISION, D_MASK, HEAD_DIM,
            BLOCK_M, BLOCK_N, BLOCK_D)

    # A row with no allowed key keeps m_i at _MASKED (its l_i counts masked junk): output 0.
    has_key = m_i > 0.5 * _MASKED
    out = tl.where(has_key[:, None], acc / tl.where(has_key, l_i, 1.0)[:, None], 0.0)
    o_rows = out_ptr + b * stride_ob + h * stride_oh + m_start.to(tl.int64) * stride_om
    o_ptrs = o_rows + tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_d[None, :]
    if D_MASK:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    row_out = pid_bh.to(tl.int64) * Tq + offs_m
    if RETURN_LSE:
        # natural-log log-sum-exp of the scaled scores: (m + log2 l) * ln 2
        lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * _LN2,
                       float("-inf"))
        tl.store(lse_ptr + row_out, lse, mask=row_ok)
    if WITH_ENTROPY:
        flag = tl.load(qmask_ptr + b * Tq + offs_m, mask=row_ok, other=0) != 0
        ok = has_key & (l_r > 0)
        l_safe = tl.where(ok, l_r, 1.0)
        ent = tl.where(ok, tl.log(l_safe) - _LN2 * t_r / l_safe, 0.0)
        ent = tl.where(flag, tl.maximum(ent, 0.0), 0.0)
        tl.store(ent_ptr + row_out, ent, mask=row_ok)


@dataclass(frozen=True)
class AttentionSettings:
    """Launch settings of :func:`attention_entropy` for one shape (chosen in one place)."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    fp32_dot: bool
    precision: str
    even_n: bool
    grid: tuple[int, int, int]

    @property
    def label(self) -> str:
        return (f"bm{self.block_m}_bn{self.block_n}_bd{self.block_d}_w{self.num_warps}"
                f"_s{self.num_stages}")


def attention_settings(b: int, hq: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                       interpret: bool = False, has_keyok: bool = False,
                       causal: bool = True) -> AttentionSettings:
    """Tiles, warps, stages and grid for ``q [b, hq, tq, d]`` against ``tk`` keys of ``dtype``.

    16-bit inputs, head dim <= 128: 128 x 64 tiles, 8 warps, 3 stages: each warpgroup (4 warps)
    owns 64 query rows, so sm_90 issues wgmma (HGMMA); the fp32 accumulator takes 64 (d=128) or
    32 (d=64) registers a thread; no spills on sm_90 or sm_80 (4 warps spill at d=64). fp32
    inputs run full-precision ("ieee") FMA dots, not Triton's default TF32 (10-bit mantissa on
    Ampere/Hopper), as in kernels/linear_token_stats.py: small tiles (32 x 32 at d <= 64, 16 x 16
    above; larger ones spill).
    ``has_keyok``: a padding mask is given (every key block is masked); ``causal``: with
    ``not causal``, no padding mask and ``tk % block_n == 0`` (``even_n``) the kernel compiles no
    masked key loop.
    ``interpret``: the CPU interpreter's settings (small tiles, fp32 dots: it has no bf16/fp16
    ``tl.dot``); :func:`gpu_launches` always describes the CUDA path (``interpret=False``).
    """
    block_d = max(16, triton.next_power_of_2(d))
    fp32_dot = interpret or dtype == torch.float32
    if interpret:
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif fp32_dot:
        block_m, block_n, warps, stages = (32, 32, 4, 2) if block_d <= 64 else (16, 16, 4, 2)
    elif block_d <= 128:
        # At d=128 with 64-key blocks, a masked loop without the causal split (padding mask;
        # not causal with a ragged last block) spills 16-24 B on sm_80: 32-key blocks there.
        ragged = not causal and tk % 64 != 0
        block_n = 32 if block_d > 64 and (has_keyok or ragged) else 64
        block_m, warps, stages = 128, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    even_n = not causal and not has_keyok and tk % block_n == 0
    return AttentionSettings(block_m=block_m, block_n=block_n, block_d=block_d,
                             num_warps=warps, num_stages=stages, fp32_dot=fp32_dot,
                             even_n=even_n,
                             precision="ieee" if fp32_dot else "tf32",
                             grid=(triton.cdiv(tq, block_m), b * hq, 1))


def _int_type(v: int) -> str:
    # The Triton runtime passes an int argument as i64 once it no longer fits in i32.
    return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"


def _signature(dtype: torch.dtype, strides: dict[str, int], scalars: dict[str, int]
               ) -> dict[str, str]:
    sig = {"q_ptr": ptr(dtype), "k_ptr": ptr(dtype), "v_ptr": ptr(dtype), "out_ptr": ptr(dtype),
           "ent_ptr": "*fp32", "lse_ptr": "*fp32", "keyok_ptr": "*i8", "qmask_ptr": "*i8",
           "krange_ptr": "*i64"}
    sig.update({name: _int_type(v) for name, v in strides.items()})
    # The Triton runtime specialises an int argument equal to 1 into a constexpr (GROUP = 1
    # when Hq == Hk), as the launch on a GPU compiles it.
    sig.update({name: "constexpr" if v == 1 else _int_type(v) for name, v in scalars.items()})
    sig["qk_scale"] = "fp32"
    for c in ("CAUSAL", "HAS_KEYOK", "WITH_ENTROPY", "RETURN_LSE", "FP32_DOT", "PRECISION",
              "EVEN_N", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "BLOCK_D"):
        sig[c] = "constexpr"
    return sig


def _allowed_pairs(tq: int, tk: int, causal: bool) -> int:
    """(query, key) pairs a causal / full attention allows (queries at the last tq positions)."""
    if not causal:
        return tq * tk
    # query i sees keys 0 .. tk - tq + i: sum over i of (tk - tq + i + 1)
    return tq * (tk - tq) + tq * (tq + 1) // 2


def _key_blocks(cfg: AttentionSettings, tq: int, tk: int, causal: bool) -> list[int]:
    """Key blocks each query block visits (the kernel's loop bounds)."""
    out = []
    for i in range(cfg.grid[0]):
        stop = min(tk, tk - tq + (i + 1) * cfg.block_m) if causal else tk
        out.append(triton.cdiv(max(stop, 0), cfg.block_n))
    return out


def gpu_launches(b: int, hq: int, hk: int, tq: int, tk: int, d: int, dtype: torch.dtype,
                 causal: bool, entropy: bool = True) -> list[Launch]:
    """The launch :func:`attention_entropy` issues on a CUDA device for contiguous
    ``q [b, hq, tq, d]``, ``k/v [b, hk, tk, d]`` of ``dtype``, no padding mask, as
    :class:`~.launch.Launch` data.

    ``entropy=False`` describes the same kernel built without the entropy state
    (``WITH_ENTROPY=False``), the baseline the entropy build is judged against.
    ``tensor_flops`` = 4 d x the allowed (query, key) pairs (QK^T and PV, exact for causal);
    the kernel's MMAs also run the masked halves of diagonal blocks, which this does not count.
    ``hbm_bytes`` reads q, k, v once and writes out (and the entropy, the query mask and the key
    range) once: k/v are re-read by every query block of a head and by the ``hq / hk`` heads of
    a group, served by L2, not counted.
    """
    cfg = attention_settings(b, hq, tq, tk, d, dtype, causal=causal)
    el = torch.empty((), dtype=dtype).element_size()
    pairs = _allowed_pairs(tq, tk, causal)
    hbm = (2 * b * hq * tq * d + 2 * b * hk * tk * d) * el
    if entropy:
        hbm += b * hq * tq * 4 + b * tq + b * 16
    blocks = _key_blocks(cfg, tq, tk, causal)
    sq, sk = (hq * tq * d, tq * d, d), (hk * tk * d, tk * d, d)
    strides = dict(zip(("stride_qb", "stride_qh", "stride_qm", "stride_kb", "stride_kh",
                        "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob",
                        "stride_oh", "stride_om"), sq + sk + sk + sq, strict=True))
    div16 = ["q_ptr", "k_ptr", "v_ptr", "out_ptr", "ent_ptr", "lse_ptr", "keyok_ptr",
             "qmask_ptr", "krange_ptr"]
    scalars = {"Tq": tq, "Tk": tk, "HQ": hq, "GROUP": hq // hk}
    # ... and marks the int arguments divisible by 16 (strides and sizes alike).
    div16 += [n for n, v in (strides | scalars).items() if v % 16 == 0]
    ones = {n: 1 for n, v in scalars.items() if v == 1}
    return [Launch(
        kernel="attention_entropy", fn=_attn_entropy_fwd,
        signature=_signature(dtype, strides, scalars),
        constexprs={**ones, "CAUSAL": bool(causal), "HAS_KEYOK": False,
                    "WITH_ENTROPY": bool(entropy),
                    "RETURN_LSE": False, "FP32_DOT": cfg.fp32_dot, "PRECISION": cfg.precision,
                    "EVEN_N": cfg.even_n, "HEAD_DIM": d, "BLOCK_M": cfg.block_m,
                    "BLOCK_N": cfg.block_n, "BLOCK_D": cfg.block_d},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=cfg.grid, hbm_bytes=hbm,
        tensor_flops=4 * d * b * hq * pairs, elements=b * hq * pairs,
        loop_iters=sum(blocks) / len(blocks), loop_elements=cfg.block_m * cfg.block_n,
        label=cfg.label, extra={"variant": "entropy" if entropy else "no_entropy",
                                "divisible_by_16": div16},
    )]


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the fused forward once (inputs already validated by the caller).

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hk, Tk, D]`` (any strides; a last dim that is not
            contiguous is copied), same float dtype and device, ``Hq`` a multiple of ``Hk``.
        causal: query i sits at absolute position ``Tk - Tq + i``; scale: score multiplier.
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        key_range, query_mask: ``[B, 2]`` int ``(start, end)`` and ``[B, Tq]`` bool, both given
            to compute the entropy (the kernel is built with the entropy state only then).
        return_lse: also return the natural-log log-sum-exp of each row's scaled, masked scores.

    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype, ``entropy [B, Hq, Tq]`` fp32 or None,
        ``lse [B, Hq, Tq]`` fp32 (-inf for a row with no allowed key) or None.
    """
    bsz, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    with_entropy = key_range is not None
    if with_entropy != (query_mask is not None):
        raise ValueError("key_range and query_mask go together")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    dev = q.device
    out = torch.empty(bsz, hq, tq, d, device=dev, dtype=q.dtype)
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
    cfg = attention_settings(bsz, hq, tq, tk, d, q.dtype, interpret=triton_interpreting(),
                             has_keyok=attention_mask is not None, causal=bool(causal))
    _attn_entropy_fwd[cfg.grid](
        q, k, v, out, ent if with_entropy else dummy_f, lse if return_lse else dummy_f,
        keyok, qm, kr,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        tq, tk, hq, hq // hk, float(scale) * math.log2(math.e),
        CAUSAL=bool(causal), HAS_KEYOK=attention_mask is not None, WITH_ENTROPY=with_entropy,
        RETURN_LSE=bool(return_lse), FP32_DOT=cfg.fp32_dot, PRECISION=cfg.precision,
        EVEN_N=cfg.even_n, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning the output and the log-sum-exp (no entropy state).

    Args:
        q: ``[B, Hq, Tq, D]``; k, v: ``[B, Hk, Tk, D]``, same float dtype and device.
        scale: score multiplier; causal: query i at absolute position ``Tk - Tq + i``.
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.

    Returns:
        ``out [B, Hq, Tq, D]`` in q's dtype and ``lse [B, Hq, Tq]`` fp32 (natural log of the sum
        of ``exp(q.k * scale)`` over allowed keys; -inf for a row with none).
    """
    out, _, lse = launch_attention(q, k, v, causal=causal, scale=scale,
                                   attention_mask=attention_mask, return_lse=True)
    return out, lse
