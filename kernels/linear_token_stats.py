"""LM-head product fused with the softmax statistics: the Triton side of
``ops.linear_token_stats``.

Program ``(i, c)`` computes the logits tile ``hidden[rows_i] @ weight[cols].T (+ bias)`` for each
``BLOCK_N``-wide tile of vocabulary chunk ``c`` with ``tl.dot`` (wgmma on Hopper once
``BLOCK_M >= 64`` per warpgroup), and folds each finished tile, still in registers, into per-row
shifted states (the ``m, s0, s1, s2, n, u1, u2`` + rank counts of
:mod:`icqs_fast.backends.state`). The ``[N, V]`` logits never reach memory: the only extra
storage is one partial state per (chunk, row), ``[chunks, N, 7]`` fp32 + ``[chunks, N, 2]``
int64 (counted in int32 in registers), merged afterwards in float64 by the caller.

Partial states are in log2 units relative to the row's reference logit ``zref`` (the target logit
when finite, else 0): the kernel reduces ``y = (z - zref) * log2(e) / T``, so ``exp2`` needs no
extra scaling, a large common offset on the logits cancels exactly in ``z - zref``, the ``u``
sums are ``y`` itself (``x - K`` with ``K = zref / T``), and the rank tests are sign tests on
``y`` (``y > 0`` iff ``z > z_t``). :func:`icqs_fast.backends.triton_backend.merge_partials`
turns them back into natural units.

Small N uses the same 128-row block with the rows beyond N masked (wgmma needs 64 rows per
warpgroup): the padded product is still far below the weight's HBM read (N = 16, H = 4096,
V = 151936: 0.16 ms of tensor time vs 0.42 ms to stream the weight), and the vocabulary-parallel
grid (``chunks`` programs per row block) fills the GPU.

Two loops over a program's tiles keep the rare masked fold out of the hot tile loop:
the inner loop runs each tile's matmul and the unmasked fold, and stops at a tile that needs
masks (the partial last tile, a row's target column, non-finite logits: a few per program), whose
logits stay in registers for the outer loop's masked fold. Compiled, the tile loop holds 840
SASS instructions besides the K loop instead of 1826 on sm_90 (both folds were in it), for 72
more registers (254, no spills: the carried tile). The arithmetic is unchanged (the unmasked
fold skips a clamp that finite logits never hit), so results are bit for bit those of the one-loop
kernel.

``target_logits`` computes each row's target logit ``hidden[r] . weight[t_r] (+ bias[t_r])`` in
fp32 straight from the inputs (``[N]`` out, no ``[N, H]`` gather).

Soft cap (``HAS_SOFTCAP``, a constexpr: the default variant compiles without it): the fused
kernel counts each finished tile's ranks on the uncapped logits against the uncapped target
logit (tanh is increasing: the order of the exact capped logits, with no ties made by rounding
where the cap saturates), then replaces the tile by ``tanh(a z)`` (:func:`_tanh_scaled`, ``a``
a runtime fp32) for the sums; ``target_logits`` writes both the uncapped and the capped target
logit (the same epilogue code). The caller divides the temperature by the cap
(``ops.linear_token_stats``' mapping). It costs one MUFU.EX2, a division and a short
polynomial per logit, on the tile in registers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .token_stats import shift_origin

LOG2E = 1.4426950408889634


@triton.jit
def _tanh_scaled(z, a):
    """``tanh(a z)`` to ~2 ulp, the formula of ``csrc/token_stats.cpp``'s ``tanh_scaled``:
    Cephes' odd polynomial for ``|u| < 0.625``, else ``(1 - e) / (1 + e)``, ``e = 2^(-2|u|
    log2 e)``, sign restored; +-inf gives +-1 and NaN stays NaN."""
    u = z * a
    au = tl.abs(u)
    u2 = u * u
    p = u2 * -5.70498872745e-3 + 2.06390887954e-2
    p = p * u2 - 5.37397155531e-2
    p = p * u2 + 1.33314422036e-1
    p = p * u2 - 3.33332819422e-1
    small = p * u2 * u + u
    e = tl.exp2(au * -2.8853900817779268)  # e^(-2|u|)
    big = (1.0 - e) / (1.0 + e)
    big = tl.where(u < 0, -big, big)
    return tl.where(au < 0.625, small, big)


@triton.jit
def _fold_exp(y, m, m_tile, s0, s1, s2, CLAMP: tl.constexpr):
    """Fold ``y`` (-inf where left out) into ``(s0, s1, s2)`` at the new max ``max(m,
    m_tile)``."""
    m_new = tl.maximum(m, m_tile)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    # m == -inf only while the sums are still 0: no shift then.
    s0, s1, s2 = shift_origin(s0, s1, s2, tl.where(m > float("-inf"), m - m_safe, 0.0))
    d = y - m_safe[:, None]  # -inf where left out: e = 0 there
    e = tl.exp2(d)
    if CLAMP:  # y may be -inf: then e * d = 0, not NaN (finite y and m need no clamp)
        d = tl.maximum(d, -1e30)
    ed = e * d
    s0 += tl.sum(e, axis=1)
    s1 += tl.sum(ed, axis=1)
    s2 += tl.sum(ed * d, axis=1)
    return m_new, s0, s1, s2


@triton.jit
def _count_ranks(z, col_ok, t_rel, thr, greater, eq_before, BLOCK_N: tl.constexpr):
    """Rank counts of any tile ``z`` against per-row ``thr`` (padded columns never count; the
    target's own column is not "greater" and only columns before it count as ties)."""
    z = tl.where(col_ok[None, :], z, float("nan"))  # NaN compares false
    lane = tl.arange(0, BLOCK_N)[None, :]
    gt = ((z > thr[:, None]) & (lane != t_rel[:, None])).to(tl.int32)
    eq = ((z == thr[:, None]) & (lane < t_rel[:, None])).to(tl.int32)
    return greater + tl.sum(gt, axis=1), eq_before + tl.sum(eq, axis=1)


@triton.jit
def _fold_masked(y, col_ok, t_rel, thr, m, s0, s1, s2, n, u1, u2, greater, eq_before,
                 BLOCK_N: tl.constexpr, COUNT: tl.constexpr):
    """Fold any tile: entries of padded columns (``col_ok`` False) and non-finite ``y`` are
    left out of the sums; the target's own column (``lane == t_rel``) is not counted as greater
    and only columns before it count as ties (``COUNT`` False: the caller counted the ranks).
    Written so that one ``[BLOCK_M, BLOCK_N]`` value at a time stays live (registers)."""
    y = tl.where(col_ok[None, :], y, float("nan"))  # NaN compares false and is not finite
    if COUNT:
        lane = tl.arange(0, BLOCK_N)[None, :]
        gt = ((y > thr[:, None]) & (lane != t_rel[:, None])).to(tl.int32)
        eq = ((y == thr[:, None]) & (lane < t_rel[:, None])).to(tl.int32)
    fin = tl.abs(y) < float("inf")
    yz = tl.where(fin, y, 0.0)
    y = tl.where(fin, y, float("-inf"))
    if COUNT:  # (this order keeps the default variant's compiled code as it was)
        greater += tl.sum(gt, axis=1)
        eq_before += tl.sum(eq, axis=1)
    u1 += tl.sum(yz, axis=1)
    u2 += tl.sum(yz * yz, axis=1)
    n += tl.sum(fin.to(tl.int32), axis=1)
    m, s0, s1, s2 = _fold_exp(y, m, tl.max(y, axis=1), s0, s1, s2, True)
    return m, s0, s1, s2, n, u1, u2, greater, eq_before


@triton.jit
def _tile_logits(
    h_base,
    w_ptr,
    bias_ptr,
    chunk,
    tile,
    V,
    H,
    stride_hh,
    stride_wv,
    stride_wh,
    offs_k,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
):
    """``hidden[rows] @ weight[cols].T (+ bias)`` of vocabulary tile ``tile`` of ``chunk``,
    fp32. Columns past V load column V-1 (no masks in the K loop); the caller masks them."""
    col0 = (chunk * TILES + tile) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    cols64 = tl.minimum(cols, V - 1).to(tl.int64)
    h_ptrs = h_base
    w_ptrs = w_ptr + cols64[None, :] * stride_wv + offs_k[:, None] * stride_wh
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k) < H
            h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if FP32_DOT:
            acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K * stride_hh
        w_ptrs += BLOCK_K * stride_wh
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols64).to(tl.float32)[None, :]
    return acc


# N is not specialised (no N == 1 / N % 16 == 0 variants: it only bounds rows) and TILES takes
# at most TILE_CANDIDATES values up to N = 16,384 (_tiles_per_program): a few compiles per model,
# not ~31 x 2 (~3 s each for sm_90, again in every Ray actor).
@triton.jit(do_not_specialize=["N"])
def _linear_token_stats_kernel(
    hid_ptr,
    w_ptr,
    bias_ptr,
    target_ptr,
    zt_ptr,
    zraw_ptr,
    pstate_ptr,
    pcounts_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    scale,
    tanh_scale,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row blocks run against the same vocabulary chunks at a time, so the
    # weight tiles they share and their hidden rows both stay in L2.
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(N, BLOCK_M)
    chunks = tl.cdiv(V, BLOCK_N * TILES)
    per_group = GROUP_M * chunks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    chunk = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    # Rows past N load row N-1 (no masks in the K loop); their results are never stored.
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    t = tl.load(target_ptr + rows64).to(tl.int32)
    zt = tl.load(zt_ptr + rows64)
    if HAS_SOFTCAP:
        zraw = tl.load(zraw_ptr + rows64)  # uncapped target logit, for the ranks
    zt_fin = tl.abs(zt) < float("inf")
    zref = tl.where(zt_fin, zt, 0.0)
    # y > thr iff z > z_t and y == thr iff z == z_t, also for a non-finite z_t (zref = 0 then).
    thr = tl.where(zt_fin, 0.0, zt)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s0 = tl.zeros((BLOCK_M,), tl.float32)
    s1 = tl.zeros((BLOCK_M,), tl.float32)
    s2 = tl.zeros((BLOCK_M,), tl.float32)
    u1 = tl.zeros((BLOCK_M,), tl.float32)
    u2 = tl.zeros((BLOCK_M,), tl.float32)
    n = tl.zeros((BLOCK_M,), tl.int32)
    greater = tl.zeros((BLOCK_M,), tl.int32)
    eq_before = tl.zeros((BLOCK_M,), tl.int32)

    offs_k = tl.arange(0, BLOCK_K)
    h_base = hid_ptr + rows64[:, None] * stride_hn + offs_k[None, :] * stride_hh
    tile = chunk * 0  # an i32 tensor: the loops below carry it
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Two loops so that the masked fold sits outside the tile loop: the inner loop runs the
    # matmul and the unmasked fold of every tile that needs no masks (full, no row's target
    # column, finite: nearly all of them) and stops at the first tile that does, leaving its
    # logits in ``acc``; the outer loop folds that tile with the masks and goes on. The hot tile
    # loop holds only the code every tile runs.
    while tile < TILES:
        cold = tile < 0  # False: no tile waiting for the masked fold
        while (tile < TILES) & (cold == 0):
            acc = _tile_logits(h_base, w_ptr, bias_ptr, chunk, tile, V, H, stride_hh,
                               stride_wv, stride_wh, offs_k, HAS_BIAS, FP32_DOT, PRECISION,
                               EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, TILES)
            col0 = (chunk * TILES + tile) * BLOCK_N
            cols = col0 + tl.arange(0, BLOCK_N)
            if HAS_SOFTCAP:
                # Ranks on the uncapped logits first (exact also for non-finite ones), then the
                # cap; a tile holding a target column leaves the loop before its ranks count.
                t_rel = t - col0
                targets_here = tl.sum(((t_rel >= 0) & (t_rel < BLOCK_N)).to(tl.int32), axis=0)
                easy = (col0 + BLOCK_N <= V) & (targets_here == 0)
                if easy:
                    gt_raw = tl.sum((acc > zraw[:, None]).to(tl.int32), axis=1)
                    eq_raw = tl.sum((acc == zraw[:, None]).to(tl.int32), axis=1)
                else:
                    gt_raw = tl.zeros((BLOCK_M,), tl.int32)
                    eq_raw = tl.zeros((BLOCK_M,), tl.int32)
                capped = _tanh_scaled(acc, tanh_scale)
            else:
                capped = acc
            y = (capped - zref[:, None]) * scale
            t_rel = t - col0
            targets_here = tl.sum(((t_rel >= 0) & (t_rel < BLOCK_N)).to(tl.int32), axis=0)
            easy = (col0 + BLOCK_N <= V) & (targets_here == 0)
            if easy:
                u1_tile = tl.sum(y, axis=1)
                u2_tile = tl.sum(y * y, axis=1)
                if HAS_SOFTCAP:
                    gt_tile = gt_raw
                    eq_tile = eq_raw
                else:
                    gt_tile = tl.sum((y > thr[:, None]).to(tl.int32), axis=1)
                    eq_tile = tl.sum((y == thr[:, None]).to(tl.int32), axis=1)
                m_tile = tl.max(y, axis=1)
                # A NaN or an infinity anywhere in a row makes its sums non-finite.
                finite_rows = (tl.abs(u1_tile) < float("inf")) & (tl.abs(u2_tile) < float("inf"))
                easy = tl.sum(finite_rows.to(tl.int32), axis=0) == BLOCK_M
            else:
                u1_tile = tl.zeros((BLOCK_M,), tl.float32)
                u2_tile = tl.zeros((BLOCK_M,), tl.float32)
                gt_tile = tl.zeros((BLOCK_M,), tl.int32)
                eq_tile = tl.zeros((BLOCK_M,), tl.int32)
                m_tile = tl.zeros((BLOCK_M,), tl.float32)
            if easy:
                u1 += u1_tile
                u2 += u2_tile
                n += BLOCK_N
                greater += gt_tile
                # The whole tile lies before or after each row's target column.
                eq_before += tl.where(t_rel >= BLOCK_N, eq_tile, 0)
                m, s0, s1, s2 = _fold_exp(y, m, m_tile, s0, s1, s2, False)
                tile += 1
            else:
                cold = tile >= 0  # True: acc holds this tile's logits for the masked fold
        if cold:
            col0 = (chunk * TILES + tile) * BLOCK_N
            cols = col0 + tl.arange(0, BLOCK_N)
            t_rel = t - col0
            if HAS_SOFTCAP:
                greater, eq_before = _count_ranks(acc, cols < V, t_rel, zraw, greater,
                                                  eq_before, BLOCK_N)
                acc = _tanh_scaled(acc, tanh_scale)
            y = (acc - zref[:, None]) * scale
            m, s0, s1, s2, n, u1, u2, greater, eq_before = _fold_masked(
                y, cols < V, t_rel, thr, m, s0, s1, s2, n, u1, u2, greater, eq_before,
                BLOCK_N, not HAS_SOFTCAP)
            tile += 1

    base = (chunk.to(tl.int64) * N + rows64) * 7
    tl.store(pstate_ptr + base + 0, m, mask=row_ok)
    tl.store(pstate_ptr + base + 1, s0, mask=row_ok)
    tl.store(pstate_ptr + base + 2, s1, mask=row_ok)
    tl.store(pstate_ptr + base + 3, s2, mask=row_ok)
    tl.store(pstate_ptr + base + 4, n.to(tl.float32), mask=row_ok)
    tl.store(pstate_ptr + base + 5, u1, mask=row_ok)
    tl.store(pstate_ptr + base + 6, u2, mask=row_ok)
    cbase = (chunk.to(tl.int64) * N + rows64) * 2
    tl.store(pcounts_ptr + cbase, greater.to(tl.int64), mask=row_ok)
    tl.store(pcounts_ptr + cbase + 1, eq_before.to(tl.int64), mask=row_ok)


@dataclass(frozen=True)
class Settings:
    """Launch settings of the fused kernel for one problem, chosen by :func:`launch_settings`
    (the only place block sizes, warps, stages and the grid are picked)."""

    block_m: int
    block_n: int
    block_k: int
    tiles: int  # BLOCK_N-wide vocabulary tiles per program
    group_m: int  # row blocks that walk the vocabulary chunks together (L2 reuse)
    num_warps: int
    num_stages: int
    fp32_dot: bool  # cast tiles to fp32 before tl.dot (fp32 inputs or the CPU interpreter)
    precision: str
    even_k: bool  # H % BLOCK_K == 0: no K masks
    row_blocks: int
    chunks: int  # vocabulary chunks = partial states per row

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.row_blocks * self.chunks, 1, 1)

    @property
    def label(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_k{self.block_k}_t{self.tiles}"
                f"_g{self.group_m}_w{self.num_warps}_s{self.num_stages}")


SMS = 132  # H100 SXM; the grid is sized for it (more SMs only shorten the last wave)


PARTIAL_PEAK_BYTES = 140  # per chunk and row while merge_partials folds them in float64
PARTIAL_BUDGET = 64 << 20  # most extra memory the partial states may take (unless 64 tiles)


# TILES is a constexpr: each value is a compile. Up to TILE_BUCKET_N rows it is one of the
# best counts at these row counts (in row blocks), so a model compiles at most len(...) fused
# kernels there (tests/test_compile_keys.py); longer inputs search every count.
TILE_BUCKET_N = 16384
TILE_CANDIDATE_BLOCKS = (1, 4)  # and TILE_BUCKET_N rows: predicted <= 1.12x the best time


def _tiles_per_program(n: int, h: int, row_blocks: int, vocab_tiles: int, block_m: int,
                       block_n: int, max_tiles: int = 64,
                       candidates: tuple[int, ...] | None = None) -> int:
    """Tiles per program with the least predicted time at one program per SM: whole waves of
    ``tiles`` tile-times, a tile-time being the larger of its product at tensor peak and its
    weight tile at a per-SM share of HBM bandwidth, plus writing and merging ``chunks x N``
    partial states; their peak memory stays within :data:`PARTIAL_BUDGET` (unless 64 tiles
    cannot). Ties go to more tiles. Up to :data:`TILE_BUCKET_N` rows the choice is among
    :func:`_tile_candidates` (each is the best at one row count; the best of them at this
    one); ``candidates`` given: among those."""
    tile_s = max(2 * block_m * block_n * max(h, 1) / (989e12 / SMS),
                 block_n * max(h, 1) * 2 / (3.0e12 / SMS))

    def cost(t: int) -> tuple[float, int]:
        chunks = triton.cdiv(vocab_tiles, t)
        waves = triton.cdiv(row_blocks * chunks, SMS)
        return waves * t * tile_s + chunks * n * (44 + PARTIAL_PEAK_BYTES) / 3.0e12, -t

    top = max(1, min(max_tiles, vocab_tiles))
    if candidates is None and n <= TILE_BUCKET_N:
        candidates = _tile_candidates(h, vocab_tiles, block_m, block_n, max_tiles)
    ok = [t for t in (candidates or range(1, top + 1))
          if triton.cdiv(vocab_tiles, t) * n * PARTIAL_PEAK_BYTES <= PARTIAL_BUDGET]
    return min(ok or [top], key=cost)


@functools.lru_cache(maxsize=256)
def _tile_candidates(h: int, vocab_tiles: int, block_m: int, block_n: int,
                     max_tiles: int) -> tuple[int, ...]:
    """The best tile counts (full search) at 1 and 4 row blocks and at
    :data:`TILE_BUCKET_N` rows: every one is within the partial-state budget at any smaller
    row count, the last at every row count up to the bucket's end."""
    ns = [b * block_m for b in TILE_CANDIDATE_BLOCKS if b * block_m < TILE_BUCKET_N]
    return tuple(sorted({
        _tiles_per_program(n, h, triton.cdiv(n, block_m), vocab_tiles, block_m, block_n,
                           max_tiles, candidates=tuple(range(1, max(1, min(max_tiles,
                                                                           vocab_tiles)) + 1)))
        for n in (*ns, TILE_BUCKET_N)}))


def launch_settings(n: int, h: int, v: int, dtype: torch.dtype, *, interpret: bool = False,
                    block_m: int | None = None, block_n: int | None = None,
                    block_k: int | None = None, tiles: int | None = None) -> Settings:
    """Block sizes, warps, stages and grid of the fused kernel for ``[N, H] x [V, H]``.

    16-bit inputs, every N: 128 x 64 tiles, 8 warps (two wgmma warpgroups of 64 rows on
    Hopper), BLOCK_K 64, 4 stages (96 KiB of shared memory). Compiled, that is ~182 registers
    and no spills on sm_90 (HGMMA 64x64x16) and ~221 registers, no spills on sm_80 (HMMA);
    128 x 128 spills on sm_80 (its mma layout puts 4 warps across the columns: 8 rows of state
    per thread) and 128 x 256 on both. N < 128 pads the row block: at N = 16, H = 4096,
    V = 151936 the padded product is 0.16 ms of tensor time against 0.42 ms to stream the
    weight, so the vocabulary-parallel grid (``chunks`` programs) keeps it memory-bound.
    fp32 inputs (exact fp32 FMA dots, no tensor cores): 64 x 64 x 32, 8 warps, 2 stages (no
    spills on either; 4 warps spill). The CPU interpreter uses small tiles. ``tiles`` (at
    most 64 per program) is chosen by :func:`_tiles_per_program` against wave quantisation
    (one program per SM at these register counts). The explicit block arguments override the
    choice (tests use small ones to exercise the chunk merge).
    """
    fp32_dot = interpret or dtype == torch.float32
    precision = "ieee" if fp32_dot else "tf32"
    if interpret:
        bm, bn, warps, stages = 16, 128, 4, 1
    elif dtype == torch.float32:
        bm, bn, warps, stages = 64, 64, 8, 2  # fp32 FMA dot, BLOCK_K 32: 170-190 regs, 0 spills
    else:
        bm, bn, warps, stages = 128, 64, 8, 4
    block_m = block_m or bm
    block_n = block_n or bn
    if block_k is None:
        cap = 32 if dtype == torch.float32 and not interpret else 64
        block_k = min(cap, max(16, 1 << (max(h, 1) - 1).bit_length()))
    row_blocks = triton.cdiv(n, block_m)
    vocab_tiles = triton.cdiv(v, block_n)
    if tiles is None:
        tiles = 1 if interpret else _tiles_per_program(n, h, row_blocks, vocab_tiles, block_m,
                                                       block_n)
    chunks = triton.cdiv(vocab_tiles, tiles) if v else 0
    return Settings(block_m=block_m, block_n=block_n, block_k=block_k, tiles=tiles,
                    group_m=8, num_warps=warps, num_stages=stages, fp32_dot=fp32_dot,
                    precision=precision, even_k=h % block_k == 0, row_blocks=row_blocks,
                    chunks=chunks)


def launch(hidden, weight, bias, targets, z_t, temperature: float, pstate, pcounts,
           cfg: Settings, tanh_scale: float | None = None, z_raw=None) -> None:
    """Fill ``pstate [chunks, N, 7]`` fp32 and ``pcounts [chunks, N, 2]`` int64 with partial
    states (log2 units relative to each row's reference logit, see the module docstring).

    Args:
        hidden: ``[N, H]``; weight: ``[V, H]`` (same dtype); bias: ``[V]`` or None.
        targets: ``[N]`` int64 in range; z_t: ``[N]`` fp32 target logits (capped, from
            :func:`target_logits` with the same ``tanh_scale``).
        cfg: from :func:`launch_settings` for this shape and dtype.
        tanh_scale: ``a`` of the soft-cap epilogue ``z -> tanh(a z)`` (the ``HAS_SOFTCAP``
            variant), or None.
        z_raw: with ``tanh_scale``, ``[N]`` fp32 uncapped target logits (the ranks').
    """
    n, hdim = hidden.shape
    v = weight.shape[0]
    _linear_token_stats_kernel[cfg.grid](
        hidden, weight, bias if bias is not None else hidden, targets, z_t,
        z_raw, pstate, pcounts, n, v, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        # None (the default variant) makes both soft-cap arguments constexprs: no extra kernel
        # parameters, so it compiles exactly as the kernel without them.
        LOG2E / temperature, None if tanh_scale is None else float(tanh_scale),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=tanh_scale is not None, FP32_DOT=cfg.fp32_dot,
        PRECISION=cfg.precision, EVEN_K=cfg.even_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, TILES=cfg.tiles, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


@triton.jit(do_not_specialize=["N"])  # one compile for every N (see the fused kernel)
def _target_logits_kernel(
    HID, W, BIAS, T, ZT, ZRAW,
    N, H,
    s_hn, s_hh, s_wv, s_wh,
    tanh_scale,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    if HAS_SOFTCAP:
        tl.store(ZRAW + rows, z, mask=row_ok)
        z = _tanh_scaled(z, tanh_scale)
    tl.store(ZT + rows, z, mask=row_ok)


TARGET_BLOCK_M, TARGET_BLOCK_K, TARGET_WARPS, TARGET_STAGES = 16, 64, 4, 3


def target_logits(hidden, weight, bias, targets, out, tanh_scale: float | None = None,
                  raw_out=None) -> None:
    """Fill ``out [N]`` fp32 with ``hidden[r] . weight[targets[r]] (+ bias[targets[r]])``,
    accumulated in fp32; ``targets`` int64, in range. With ``tanh_scale``, ``raw_out [N]``
    fp32 gets that value and ``out`` its ``tanh(tanh_scale z)`` (the fused kernel's soft-cap
    epilogue)."""
    n, hdim = hidden.shape
    if n == 0:
        return
    grid = (triton.cdiv(n, TARGET_BLOCK_M),)
    _target_logits_kernel[grid](
        hidden, weight, bias if bias is not None else hidden, targets, out, raw_out, n, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        None if tanh_scale is None else float(tanh_scale),  # None: constexpr, no parameter
        HAS_BIAS=bias is not None, HAS_SOFTCAP=tanh_scale is not None,
        BLOCK_M=TARGET_BLOCK_M, BLOCK_K=TARGET_BLOCK_K,
        num_warps=TARGET_WARPS, num_stages=TARGET_STAGES,
    )

