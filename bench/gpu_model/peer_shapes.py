"""Compute-bound validation kernels for ``bench static``: minimal re-implementations of the
*shape* of two public Triton kernels with published timings, written here from their published
descriptions (no code copied), so the static model can be checked on tensor-core-bound work.

* :func:`lse_head_fwd` -- the shape of Apple's Cut Cross-Entropy forward
  (``apple/ml-cross-entropy``, ``cut_cross_entropy/cce_lse_forward.py``, paper arXiv 2411.09009):
  one program per ``BLOCK_B x BLOCK_V`` tile of ``E @ C^T``, a K loop of ``tl.dot`` over the hidden
  dimension, then in registers the logit soft-cap ``softcap * tanh(x / softcap)``, the per-column
  mean logit (an fp32 ``atomic_add`` per column: CCE's ``HAS_LA`` path, on whenever an input
  needs a gradient, as in its ``loss-fw`` benchmark) and the tile's row log-sum-exp merged into
  the row's running value under a per-row-block spin lock. Launch settings are CCE's
  non-autotuned default (``_cce_forward_best_config``: 256 x 128 x 32, 8 warps, 3 stages,
  ``GROUP_B`` = 8).
* :func:`fa_fwd` -- the shape of Triton's ``python/tutorials/06-fused-attention.py`` forward
  (FlashAttention-2 algorithm, non-TMA path): one program per ``(query block, batch*head)``,
  the query tile kept in registers, a loop over key blocks with the online softmax in base 2;
  causal runs the off-diagonal blocks without a mask and the diagonal blocks in a second,
  masked loop. The tutorial autotunes over ``BLOCK_M`` in {64, 128}, ``BLOCK_N`` in {32, 64},
  stages in {3, 4, 7} and 4 or 8 warps but keeps 8 warps only for tiles of at least 128 x 128,
  so every configuration it can pick at these shapes has 4 warps; the records use 128 x 64,
  4 warps, 3 stages (the largest tile it can pick).

They exist only to be compiled for sm_80 / sm_90 by :mod:`bench.gpu_model.static`; they
are not used by the package and have no CPU path.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# ----------------------------------------------------------------------------------------------
# Linear head + log-sum-exp (the Cut Cross-Entropy forward shape)


@triton.jit
def lse_head_fwd(E, C, LSE, LA, Locks, softcap, B, V, D, stride_eb, stride_cv, inv_b,
                 BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 GROUP_B: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LA: tl.constexpr):
    """Row log-sum-exp of ``softcap(E @ C^T)`` for ``E [B, D]``, ``C [V, D]`` (D a multiple of
    BLOCK_D), accumulated into ``LSE [B]`` (initialised to -inf); ``LA [V]`` += column means."""
    pid = tl.program_id(0)
    n_b = tl.cdiv(B, BLOCK_B)
    n_v = tl.cdiv(V, BLOCK_V)
    # Grouped order: GROUP_B row blocks sweep the vocabulary together, so a C tile is reused
    # from L2 by GROUP_B programs in flight.
    group = pid // (GROUP_B * n_v)
    first_b = group * GROUP_B
    size_b = min(n_b - first_b, GROUP_B)
    pid_b = first_b + (pid % (GROUP_B * n_v)) % size_b
    pid_v = (pid % (GROUP_B * n_v)) // size_b
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_D)
    e_ptrs = E + rows.to(tl.int64)[:, None] * stride_eb + ks[None, :]
    c_ptrs = C + cols.to(tl.int64)[None, :] * stride_cv + ks[:, None]
    row_ok = rows < B
    col_ok = cols < V
    acc = tl.zeros((BLOCK_B, BLOCK_V), tl.float32)
    for _ in range(0, tl.cdiv(D, BLOCK_D)):
        a = tl.load(e_ptrs, mask=row_ok[:, None], other=0.0)
        b = tl.load(c_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        e_ptrs += BLOCK_D
        c_ptrs += BLOCK_D
    x = tl.where(col_ok[None, :], acc, float("-inf"))
    if HAS_SOFTCAP:
        x = libdevice.tanh(x / softcap) * softcap
    if HAS_LA:
        tl.atomic_add(LA + cols, tl.sum(x, 0) * inv_b, mask=col_ok)
    mx = tl.max(x, 1)
    tile_lse = mx + tl.log(tl.sum(tl.exp(x - mx[:, None]), 1))
    # Merge into the running value of these rows; row blocks share one lock each.
    lock = Locks + pid_b
    while tl.atomic_cas(lock, 0, 1) == 1:
        pass
    old = tl.load(LSE + rows, mask=row_ok, other=float("-inf"))
    hi = tl.maximum(old, tile_lse)
    lo = tl.minimum(old, tile_lse)
    tl.store(LSE + rows, hi + tl.log(1.0 + tl.exp(lo - hi)), mask=row_ok)
    tl.debug_barrier()
    tl.atomic_xchg(lock, 0)


# ----------------------------------------------------------------------------------------------
# Flash-attention forward (the Triton 06-fused-attention tutorial shape)


@triton.jit
def _fa_blocks(acc, l_i, m_i, q, K, V, lo, hi, offs_m, stride_kn, stride_vn, qk_scale,
               DIAG: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks ``[lo, hi)`` of one query tile; ``DIAG`` applies the causal mask."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt_ptrs = K + (lo + offs_n)[None, :] * stride_kn + offs_d[:, None]
    v_ptrs = V + (lo + offs_n)[:, None] * stride_vn + offs_d[None, :]
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        s = tl.dot(q, tl.load(kt_ptrs))
        if DIAG:
            s = s * qk_scale + tl.where(offs_m[:, None] >= start + offs_n[None, :], 0.0, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s = s * qk_scale - m_new[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vb = tl.load(v_ptrs)
        acc = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None])
        m_i = m_new
        kt_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def fa_fwd(Q, K, V, Out, M, sm_scale, stride_h, stride_m, H, N_CTX,
           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           CAUSAL: tl.constexpr):
    """``softmax(Q K^T * sm_scale) V`` for contiguous ``[Z, H, N_CTX, HEAD_DIM]`` tensors;
    ``M`` gets each row's log2-sum-exp (the tutorial stores it for the backward)."""
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    base = off_hz.to(tl.int64) * stride_h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + offs_m[:, None] * stride_m + offs_d[None, :])
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.44269504
    if CAUSAL:
        acc, l_i, m_i = _fa_blocks(acc, l_i, m_i, q, K + base, V + base, 0, start_m * BLOCK_M,
                                   offs_m, stride_m, stride_m, qk_scale, False, HEAD_DIM,
                                   BLOCK_N)
        acc, l_i, m_i = _fa_blocks(acc, l_i, m_i, q, K + base, V + base, start_m * BLOCK_M,
                                   (start_m + 1) * BLOCK_M, offs_m, stride_m, stride_m,
                                   qk_scale, True, HEAD_DIM, BLOCK_N)
    else:
        acc, l_i, m_i = _fa_blocks(acc, l_i, m_i, q, K + base, V + base, 0, N_CTX, offs_m,
                                   stride_m, stride_m, qk_scale, False, HEAD_DIM, BLOCK_N)
    tl.store(M + off_hz * N_CTX + offs_m, m_i + tl.math.log2(l_i))
    tl.store(Out + base + offs_m[:, None] * stride_m + offs_d[None, :],
             (acc / l_i[:, None]).to(Out.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Launch descriptions


def _launch_cls():
    from bench.gpu_model.launches import Launch
    return Launch


def cce_launch(n: int = 8192, d: int = 2304, v: int = 256000, softcap: float = 30.0):
    """:func:`lse_head_fwd` at CCE's ``loss-fw`` benchmark shape (Gemma-2-2B: ``n`` tokens,
    hidden ``d``, vocabulary ``v``, logit soft-cap 30), bf16, CCE's default settings."""
    Launch = _launch_cls()
    bb, bv, bd = 256, 128, 32
    sig = {"E": "*bf16", "C": "*bf16", "LSE": "*fp32", "LA": "*fp32", "Locks": "*i32",
           "softcap": "fp32", "B": "i32", "V": "i32", "D": "i32", "stride_eb": "i32",
           "stride_cv": "i32", "inv_b": "fp32", "BLOCK_B": "constexpr",
           "BLOCK_V": "constexpr", "BLOCK_D": "constexpr", "GROUP_B": "constexpr",
           "HAS_SOFTCAP": "constexpr", "HAS_LA": "constexpr"}
    progs = triton.cdiv(n, bb) * triton.cdiv(v, bv)
    return Launch(
        kernel="cce_lse_forward (re-implemented shape)", fn=lse_head_fwd, signature=sig,
        constexprs={"BLOCK_B": bb, "BLOCK_V": bv, "BLOCK_D": bd, "GROUP_B": 8,
                    "HAS_SOFTCAP": softcap is not None, "HAS_LA": True},
        num_warps=8, num_stages=3, grid=(progs, 1, 1),
        # Compulsory: E and C read once, LSE written, LA updated (read + write, fp32).
        hbm_bytes=(n * d + v * d) * 2 + n * 4 + v * 8, tensor_flops=2 * n * v * d,
        elements=n * v, loop_iters=float(triton.cdiv(d, bd)), loop_elements=bb * bv,
        label=f"b{bb}_v{bv}_d{bd}_w8_s3",
        extra={"divisible_by_16": ["E", "C", "LSE", "LA", "Locks", "B", "V", "D",
                                   "stride_eb", "stride_cv"]})


def fa_launch(z: int, h: int, n: int, d: int, causal: bool, dtype: str = "fp16",
              block_m: int = 128, block_n: int = 64, num_warps: int = 4, num_stages: int = 3):
    """:func:`fa_fwd` on ``[z, h, n, d]`` q/k/v of ``dtype`` (``"fp16"``/``"bf16"``).

    ``tensor_flops`` is the tutorial's own count (``4 z h n^2 d``, halved when causal), so
    predicted TFLOP/s compare with its published ones; ``loop_iters`` counts every key block a
    program visits (both loops when causal) against the model's single hot loop, which is the
    larger, masked one: slightly pessimistic for causal.
    """
    Launch = _launch_cls()
    flops = 4 * z * h * n * n * d // (2 if causal else 1)
    qblocks = triton.cdiv(n, block_m)
    if causal:
        visits = [(i + 1) * block_m // block_n for i in range(qblocks)]
    else:
        visits = [triton.cdiv(n, block_n)] * qblocks
    el = 2
    sig = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Out": f"*{dtype}",
           "M": "*fp32", "sm_scale": "fp32", "stride_h": "i32", "stride_m": "i32", "H": "i32",
           "N_CTX": "i32", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "CAUSAL": "constexpr"}
    return Launch(
        kernel="triton 06-fused-attention forward (re-implemented shape)", fn=fa_fwd,
        signature=sig,
        constexprs={"HEAD_DIM": d, "BLOCK_M": block_m, "BLOCK_N": block_n,
                    "CAUSAL": bool(causal)},
        num_warps=num_warps, num_stages=num_stages, grid=(qblocks, z * h, 1),
        hbm_bytes=4 * z * h * n * d * el + z * h * n * 4, tensor_flops=flops,
        elements=z * h * n * n // (2 if causal else 1),
        loop_iters=sum(visits) / len(visits), loop_elements=block_m * block_n,
        label=f"bm{block_m}_bn{block_n}_w{num_warps}_s{num_stages}",
        extra={"divisible_by_16": ["Q", "K", "V", "Out", "M", "stride_h", "stride_m", "N_CTX"]})
