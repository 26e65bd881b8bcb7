"""LM-head product fused with the softmax statistics: the Triton side of
``ops.linear_token_stats``.

Program ``(i, c)`` computes the logits tile ``hidden[rows_i] @ weight[cols].T (+ bias)`` for each
``BLOCK_N``-wide tile of vocabulary chunk ``c`` in registers, folds it into per-row shifted states
(the same ``m, s0, s1, s2, n, u1, u2`` + rank counts as ``kernels.token_stats``) and writes one
partial state per (chunk, row). The ``[N, V]`` logits never reach memory: the only extra storage
is ``[chunks, N, 7]`` fp32 + ``[chunks, N, 2]`` int64, merged afterwards by the caller.

``target_logits`` computes each row's target logit ``hidden[r] . weight[t_r] (+ bias[t_r])`` in
fp32 straight from the inputs (``[N]`` out, no ``[N, H]`` gather).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .token_stats import _rescale


@triton.jit
def _linear_token_stats_kernel(
    HID, W, BIAS, T, ZT, SHIFT, PSTATE, PCOUNTS,
    N, V, H,
    s_hn, s_hh, s_wv, s_wh,
    inv_temp,
    HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    t = tl.load(T + rows, mask=row_ok, other=0)
    z_t = tl.load(ZT + rows, mask=row_ok, other=0.0)
    k = tl.load(SHIFT + rows, mask=row_ok, other=0.0)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s0 = tl.zeros((BLOCK_M,), tl.float32)
    s1 = tl.zeros((BLOCK_M,), tl.float32)
    s2 = tl.zeros((BLOCK_M,), tl.float32)
    n = tl.zeros((BLOCK_M,), tl.float32)
    u1 = tl.zeros((BLOCK_M,), tl.float32)
    u2 = tl.zeros((BLOCK_M,), tl.float32)
    greater = tl.zeros((BLOCK_M,), tl.int64)
    eq_before = tl.zeros((BLOCK_M,), tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(TILES):
        cols = (chunk * TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < V
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < H
            h = tl.load(HID + rows64[:, None] * s_hn + kk[None, :] * s_hh,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols64[None, :] * s_wv + kk[:, None] * s_wh,
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if FP32_DOT:
                acc += tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
            else:
                acc += tl.dot(h, w, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        z = acc
        x = z * inv_temp
        fin = col_ok[None, :] & (x == x) & (tl.abs(x) < float("inf"))
        xf = tl.where(fin, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(xf, axis=1))
        s0, s1, s2 = _rescale(m, s0, s1, s2, m_new)
        m = m_new
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        d = tl.where(fin, x - m_safe[:, None], 0.0)
        e = tl.where(fin, tl.exp(d), 0.0)
        ed = e * d
        s0 += tl.sum(e, axis=1)
        s1 += tl.sum(ed, axis=1)
        s2 += tl.sum(ed * d, axis=1)
        u = tl.where(fin, x - k[:, None], 0.0)
        u1 += tl.sum(u, axis=1)
        u2 += tl.sum(u * u, axis=1)
        n += tl.sum(fin.to(tl.float32), axis=1)
        in_tile = col_ok[None, :]
        greater += tl.sum((in_tile & (z > z_t[:, None]) & (cols[None, :] != t[:, None]))
                          .to(tl.int64), axis=1)
        eq_before += tl.sum((in_tile & (z == z_t[:, None]) & (cols[None, :] < t[:, None]))
                            .to(tl.int64), axis=1)

    base = (chunk.to(tl.int64) * N + rows64) * 7
    tl.store(PSTATE + base + 0, m, mask=row_ok)
    tl.store(PSTATE + base + 1, s0, mask=row_ok)
    tl.store(PSTATE + base + 2, s1, mask=row_ok)
    tl.store(PSTATE + base + 3, s2, mask=row_ok)
    tl.store(PSTATE + base + 4, n, mask=row_ok)
    tl.store(PSTATE + base + 5, u1, mask=row_ok)
    tl.store(PSTATE + base + 6, u2, mask=row_ok)
    cbase = (chunk.to(tl.int64) * N + rows64) * 2
    tl.store(PCOUNTS + cbase, greater, mask=row_ok)
    tl.store(PCOUNTS + cbase + 1, eq_before, mask=row_ok)


def launch(hidden, weight, bias, targets, z_t, shift, temperature: float, pstate, pcounts, *,
           block_m: int, block_n: int, block_k: int, tiles: int, fp32_dot: bool,
           num_warps: int = 4, num_stages: int = 3) -> None:
    """Fill ``pstate [chunks, N, 7]`` fp32 and ``pcounts [chunks, N, 2]`` int64, where
    ``chunks = cdiv(V, block_n * tiles)``.

    Args:
        hidden: ``[N, H]``; weight: ``[V, H]`` (same dtype); bias: ``[V]`` or None.
        targets: ``[N]`` int64 in range; z_t: ``[N]`` fp32 target logits; shift: ``[N]`` fp32.
        fp32_dot: cast tiles to fp32 before ``tl.dot`` (fp32 inputs, or the CPU interpreter,
            which has no half-precision dot).
    """
    n, hdim = hidden.shape
    v = weight.shape[0]
    chunks = pstate.shape[0]
    precision = "ieee" if fp32_dot or hidden.dtype.itemsize == 4 else "tf32"
    grid = (triton.cdiv(n, block_m), chunks)
    _linear_token_stats_kernel[grid](
        hidden, weight, bias if bias is not None else hidden, targets, z_t, shift,
        pstate, pcounts, n, v, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        1.0 / temperature,
        HAS_BIAS=bias is not None, FP32_DOT=fp32_dot, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, TILES=tiles,
        num_warps=num_warps, num_stages=num_stages,
    )


@triton.jit
def _target_logits_kernel(
    HID, W, BIAS, T, ZT,
    N, H,
    s_hn, s_hh, s_wv, s_wh,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    t = tl.load(T + rows, mask=row_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (kk < H)[None, :]
        h = tl.load(HID + rows64[:, None] * s_hn + kk[None, :] * s_hh, mask=ok, other=0.0)
        w = tl.load(W + t[:, None] * s_wv + kk[None, :] * s_wh, mask=ok, other=0.0)
        acc += h.to(tl.float32) * w.to(tl.float32)
    z = tl.sum(acc, axis=1)
    if HAS_BIAS:
        z += tl.load(BIAS + t, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(ZT + rows, z, mask=row_ok)


def target_logits(hidden, weight, bias, targets, out, *, block_m: int = 16,
                  block_k: int = 64) -> None:
    """Fill ``out [N]`` fp32 with ``hidden[r] . weight[targets[r]] (+ bias[targets[r]])``,
    accumulated in fp32; ``targets`` int64, in range."""
    n, hdim = hidden.shape
    if n == 0:
        return
    grid = (triton.cdiv(n, block_m),)
    _target_logits_kernel[grid](
        hidden, weight, bias if bias is not None else hidden, targets, out, n, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_K=block_k,
    )
