"""One-pass softmax statistics per row of logits: the Triton side of ``ops.token_stats``.

One program reduces one row of ``z [N, V]`` (fp32/fp16/bf16, unit column stride), or one chunk of
it when N is small (vocabulary-parallel; the caller merges the partial states), to the mergeable
state of :mod:`icqs_fast.backends.state` (``m, s0, s1, s2, n, u1, u2`` and the two rank counts),
reading each logit once. Moments are kept relative to a running max ``m`` (the *shifted* form):
when the max moves from ``m`` to ``m'`` the sums are moved to the new origin with
``d = m - m'``, ``a = e^d``::

    s0 <- a s0,    s1 <- a (s1 + d s0),    s2 <- a (s2 + 2 d s1 + d^2 s0)

so a large common offset on every logit never meets fp32 rounding.

Built for bandwidth (about 17.6 SASS instructions per logit in the hot loop on sm_90, 80
registers): the tile is ``[BLOCK_V / R, R]``; each lane (tile row) owns R consecutive logits
(16-byte loads) and keeps its own state across the whole loop, in base-2 units (one FFMA and one
MUFU.EX2 per logit), moving its max once per R logits; the lanes are combined once per program.
Rank counts are fp32 sums of compares; ties before the target are counted for whole tiles before
it in the loop and for the target's own tile once after it. The loop assumes finite logits; a
row holding -inf / +inf / NaN (seen as non-finite sums) is read again with masks, leaving
non-finite logits out of every sum as the torch reference does. Row offsets are int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Reductions are spelled tl.reduce(x, axis, <standard combine>) rather than tl.sum / tl.max:
# same code on a GPU, but Triton's CPU interpreter runs these combines with numpy directly while
# every call of a jit function such as tl.sum re-patches triton.language (~8 ms per call, which
# made the interpreter tests 10x slower).
try:
    from triton.language.standard import _elementwise_max as _max_combine
    from triton.language.standard import _elementwise_min as _min_combine
    from triton.language.standard import _sum_combine

    COMBINE_NOTE = ""
except ImportError as _exc:  # another Triton version: the same combines of our own, said once
    import warnings

    COMBINE_NOTE = (f"triton {triton.__version__} lacks the private combines "
                    f"(triton.language.standard: {_exc}); kernels/token_stats.py uses its own "
                    "(the same code on a GPU; slower under the interpreter)")
    warnings.warn(COMBINE_NOTE, RuntimeWarning, stacklevel=2)

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min_combine(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _sum_combine(a, b):
        return a + b


STATE_WIDTH = 7  # m, s0, s1, s2, n, u1, u2 (see icqs_fast.backends.state)


@triton.jit
def shift_origin(s0, s1, s2, dm):
    """Move (s0, s1, s2) by ``dm = m_old - m_new <= 0`` (finite, base-2 units)."""
    a = tl.exp2(dm)
    s2 = a * (s2 + dm * (2.0 * s1 + dm * s0))
    s1 = a * (s1 + dm * s0)
    s0 = a * s0
    return s0, s1, s2


@triton.jit
def _step_fast(z, mz, s0, s1, s2, n, u1, u2, greater, eq_tile_before, zt, c):
    """One tile ``z [L, R]`` (fp32, every entry in range) into the per-lane state ``[L]``.

    ``mz`` is the lane max logit; every moment is in base-2 units ``y = z c``
    (``c = log2(e) / T``) relative to the lane max ``m = mz c``, so each logit costs one FFMA
    (``d = y - m``) and one MUFU.EX2, and ``d`` serves the plain sums ``u1, u2`` too (``n``:
    logits in the lane). Assumes finite logits: a non-finite one makes ``u1`` non-finite and
    the caller redoes the chunk with :func:`_step_masked`. The lane max moves once per R logits
    (one extra exp2 per R); the R-wide sums stay inside one thread.
    ``eq_tile_before`` (scalar bool) says the whole tile lies before the target column, so its
    ties count toward ``eq_before``; the tile holding the target is counted by the caller."""
    mz_new = tl.maximum(mz, tl.reduce(z, 1, _max_combine))
    m_new = mz_new * c
    dm = mz * c - m_new
    s0, s1, s2 = shift_origin(s0, s1, s2, dm)
    u2 += dm * (2.0 * u1 + n * dm)
    u1 += n * dm
    # An explicit fma: z c is exact inside it, so d keeps its bits at a large offset.
    d = tl.fma(z, c, -m_new[:, None])
    e = tl.exp2(d)
    t = e * d
    s0 += tl.reduce(e, 1, _sum_combine)
    s1 += tl.reduce(t, 1, _sum_combine)
    s2 += tl.reduce(t * d, 1, _sum_combine)
    u1 += tl.reduce(d, 1, _sum_combine)
    u2 += tl.reduce(d * d, 1, _sum_combine)
    n += z.shape[1]
    # Ranks compare the raw logits (exact in fp32 for every input dtype); z_t itself is not > z_t.
    # Counted in fp32 (exact below 2^24 per lane): FSET + FADD per logit and count.
    greater += tl.reduce((z > zt).to(tl.float32), 1, _sum_combine)
    eq = tl.reduce((z == zt).to(tl.float32), 1, _sum_combine)
    return mz_new, s0, s1, s2, n, u1, u2, greater, tl.where(eq_tile_before, eq, 0.0)


@triton.jit
def _step_masked(z, inb, mz, s0, s1, s2, n, u1, u2, greater, eq_before, zt, below_t, c,
                 ONLY_INB: tl.constexpr):
    """:func:`_step_fast` for any tile: entries outside ``inb`` are skipped; with ``ONLY_INB``
    False non-finite logits are skipped too (the torch reference's rule) and counted out of
    ``n``. Lanes may be empty (mz = -inf). ``below_t``: columns before the target."""
    if ONLY_INB:
        fin = inb
    else:
        fin = inb & (z == z) & (tl.abs(z) < float("inf"))
    mz_new = tl.maximum(mz, tl.reduce(tl.where(fin, z, float("-inf")), 1, _max_combine))
    m_new_safe = tl.where(mz_new > float("-inf"), mz_new * c, 0.0)
    dm = tl.where(mz > float("-inf"), mz * c - m_new_safe, 0.0)
    s0, s1, s2 = shift_origin(s0, s1, s2, dm)
    u2 += dm * (2.0 * u1 + n * dm)
    u1 += n * dm
    d = tl.where(fin, tl.fma(z, c, -m_new_safe[:, None]), 0.0)
    e = tl.where(fin, tl.exp2(d), 0.0)
    t = e * d
    s0 += tl.reduce(e, 1, _sum_combine)
    s1 += tl.reduce(t, 1, _sum_combine)
    s2 += tl.reduce(t * d, 1, _sum_combine)
    u1 += tl.reduce(d, 1, _sum_combine)
    u2 += tl.reduce(d * d, 1, _sum_combine)
    n += tl.reduce(fin.to(tl.float32), 1, _sum_combine)
    greater += tl.reduce((inb & (z > zt)).to(tl.float32), 1, _sum_combine)
    eq_before += tl.reduce((inb & (z == zt) & below_t).to(tl.float32), 1, _sum_combine)
    return mz_new, s0, s1, s2, n, u1, u2, greater, eq_before


@triton.jit
def _combine_lanes(mz, s0, s1, s2, n, u1, u2, greater, eq_before, c, kz):
    """Fold the per-lane states ``[L]`` into one (same algebra as ``state.merge``), at the
    program's max ``y = max(mz) c``; the u sums move from each lane's max to the target's ``y``
    (lanes without entries add nothing). Returns the max logit and scalar sums (base-2 units)."""
    mzp = tl.reduce(mz, 0, _max_combine)
    my_safe = tl.where(mzp > float("-inf"), mzp * c, 0.0)
    m = mz * c
    nonempty = s0 > 0
    dm = tl.where(nonempty, m - my_safe, 0.0)
    w = tl.where(nonempty, tl.exp2(dm), 0.0)
    S0 = tl.reduce(w * s0, 0, _sum_combine)
    S1 = tl.reduce(w * (s1 + dm * s0), 0, _sum_combine)
    S2 = tl.reduce(w * (s2 + dm * (2.0 * s1 + dm * s0)), 0, _sum_combine)
    du = tl.where(n > 0, m - kz * c, 0.0)
    U1 = tl.reduce(u1 + n * du, 0, _sum_combine)
    U2 = tl.reduce(u2 + du * (2.0 * u1 + n * du), 0, _sum_combine)
    N = tl.reduce(n, 0, _sum_combine)
    G = tl.reduce(greater.to(tl.int32), 0, _sum_combine)
    E = tl.reduce(eq_before.to(tl.int32), 0, _sum_combine)
    return mzp, S0, S1, S2, N, U1, U2, G, E


@triton.jit
def _token_stats_kernel(
    z_ptr,
    targets_ptr,
    z_target_ptr,
    state_ptr,
    counts_ptr,
    n_rows,
    V,
    stride_row,
    chunk,
    inv_temp,
    inv_temp_lo,
    BLOCK_V: tl.constexpr,
    R: tl.constexpr,
    SLOW_BLOCK: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
):
    # Program (row, split) reduces columns [split * chunk, (split + 1) * chunk) of its row to one
    # partial state; splits > 1 only for small N (vocabulary-parallel), merged by the caller.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    z_row = z_ptr + row * stride_row
    t = tl.load(targets_ptr + row).to(tl.int32)
    zt = tl.load(z_target_ptr + row)
    # The u sums end relative to the target's logit (moderate sizes whatever the offset).
    kz = tl.where(tl.abs(zt) < float("inf"), zt, 0.0)
    c = tl.cast(inv_temp * 1.4426950408889634, tl.float32)  # exp(x) ~ exp2(z c)
    c0 = split * chunk
    c1 = tl.minimum(c0 + chunk, V)
    n_full = (c1 - c0) // BLOCK_V
    full_end = c0 + n_full * BLOCK_V

    L: tl.constexpr = BLOCK_V // R
    # [L, R] tiles: each lane (row of the tile) owns R consecutive logits (16-byte loads) and
    # keeps its own running state across the loop; lanes are combined once at the end.
    offs = tl.arange(0, L)[:, None] * R + tl.arange(0, R)[None, :]

    # Fast path: every logit finite. The lane max starts at the first tile's max, so the loop
    # never meets -inf origins (that tile is read twice, the second time from cache).
    first = tl.load(z_row + c0 + offs, mask=c0 + offs < c1, other=float("-inf")).to(tl.float32)
    mz = tl.reduce(first, 1, _max_combine)
    s0 = tl.zeros((L,), tl.float32)
    s1 = tl.zeros((L,), tl.float32)
    s2 = tl.zeros((L,), tl.float32)
    u1 = tl.zeros((L,), tl.float32)
    u2 = tl.zeros((L,), tl.float32)
    n = tl.zeros((L,), tl.float32)
    greater = tl.zeros((L,), tl.float32)
    eq_before = tl.zeros((L,), tl.float32)
    if BF16_PAIRS:
        # bf16 read as 32-bit words: each word's two logits become fp32 with one shift / one
        # mask (the bf16 bits are the top half of an fp32), cheaper than the generic convert.
        w_row = z_row.to(tl.pointer_type(tl.int32))
        offs_w = tl.arange(0, L)[:, None] * (R // 2) + tl.arange(0, R // 2)[None, :]
    for i in range(0, n_full):
        start = c0 + i * BLOCK_V
        if BF16_PAIRS:
            wd = tl.load(w_row + start // 2 + offs_w)
            lo = (wd << 16).to(tl.float32, bitcast=True)
            hi = (wd & -65536).to(tl.float32, bitcast=True)
            z = tl.reshape(tl.join(lo, hi), (L, R))
        else:
            z = tl.load(z_row + start + offs).to(tl.float32)
        mz, s0, s1, s2, n, u1, u2, greater, eq = _step_fast(
            z, mz, s0, s1, s2, n, u1, u2, greater, start + BLOCK_V <= t, zt, c)
        eq_before += eq
    if (t >= c0) & (t < full_end):
        # The full tile holding the target: its ties before the target column (cache hit).
        start = c0 + ((t - c0) // BLOCK_V) * BLOCK_V
        z = tl.load(z_row + start + offs).to(tl.float32)
        eq_before += tl.reduce(((z == zt) & (offs < t - start)).to(tl.float32), 1, _sum_combine)
    if full_end < c1:  # the partial tail tile, masked
        inb = full_end + offs < c1
        z = tl.load(z_row + full_end + offs, mask=inb, other=0.0).to(tl.float32)
        mz, s0, s1, s2, n, u1, u2, greater, eq_before = _step_masked(
            z, inb, mz, s0, s1, s2, n, u1, u2, greater, eq_before, zt, offs < t - full_end,
            c, ONLY_INB=True)
    ok = (tl.abs(u1) < float("inf")) & (tl.abs(u2) < float("inf")) \
        & (tl.abs(s1) < float("inf")) & (tl.abs(s2) < float("inf"))
    if tl.reduce(ok.to(tl.int32), 0, _min_combine) == 1:
        mzp, S0, S1, S2, N, U1, U2, G, E = _combine_lanes(
            mz, s0, s1, s2, n, u1, u2, greater, eq_before, c, kz)
    else:
        # Some logit is -inf / +inf / NaN (or a sum overflowed): redo the chunk skipping
        # non-finite entries, as the torch reference does (a second read of such rows only).
        # Smaller tiles than the fast loop: this loop is cold, so it need not be wide.
        SL: tl.constexpr = SLOW_BLOCK // R
        offs_s = tl.arange(0, SL)[:, None] * R + tl.arange(0, R)[None, :]
        # (own names: the slow tiles' lane vectors have another shape than the fast ones)
        mz2 = tl.full((SL,), float("-inf"), tl.float32)
        a0 = tl.zeros((SL,), tl.float32)
        a1 = tl.zeros((SL,), tl.float32)
        a2 = tl.zeros((SL,), tl.float32)
        v1 = tl.zeros((SL,), tl.float32)
        v2 = tl.zeros((SL,), tl.float32)
        cnt = tl.zeros((SL,), tl.float32)
        gt = tl.zeros((SL,), tl.float32)
        eq = tl.zeros((SL,), tl.float32)
        for start in range(c0, c1, SLOW_BLOCK):
            inb = start + offs_s < c1
            z = tl.load(z_row + start + offs_s, mask=inb, other=0.0).to(tl.float32)
            mz2, a0, a1, a2, cnt, v1, v2, gt, eq = _step_masked(
                z, inb, mz2, a0, a1, a2, cnt, v1, v2, gt, eq, zt, offs_s < t - start, c,
                ONLY_INB=False)
        mzp, S0, S1, S2, N, U1, U2, G, E = _combine_lanes(
            mz2, a0, a1, a2, cnt, v1, v2, gt, eq, c, kz)
    my_safe = tl.where(mzp > float("-inf"), mzp * c, 0.0)
    # To x = z / T units: 2^d = e^(d ln 2). The origin my is exactly x = ln2 my - mz (ln2 c - 1/T)
    # (c carries the fp32 rounding of log2(e) / T; float64 here, 1/T = inv_temp + inv_temp_lo).
    # The stored fp32 origin mx misses it by up to half an ulp (5e-4 at 1e4), so the moments
    # move onto mx: a large common offset costs nothing beyond the logits' own rounding.
    ln2 = tl.full((), 0.6931471805599453, tl.float64)  # a float64 tensor, not an fp32 literal
    mzp_safe = tl.where(mzp > float("-inf"), mzp, 0.0)
    o64 = ln2 * tl.cast(my_safe, tl.float64) - tl.cast(mzp_safe, tl.float64) * (
        ln2 * tl.cast(c, tl.float64) - (tl.cast(inv_temp, tl.float64)
                                         + tl.cast(inv_temp_lo, tl.float64)))
    mx = o64.to(tl.float32)
    S0, S1, S2 = shift_origin(S0, S1, S2, ((o64 - mx.to(tl.float64)) / ln2).to(tl.float32))
    mx = tl.where(mzp > float("-inf"), mx, float("-inf"))
    r = 0.6931471805599453
    out = state_ptr + (split * n_rows + row) * 7
    tl.store(out + 0, mx)
    tl.store(out + 1, S0)
    tl.store(out + 2, S1 * r)
    tl.store(out + 3, S2 * (r * r))
    tl.store(out + 4, N)
    tl.store(out + 5, U1 * r)
    tl.store(out + 6, U2 * (r * r))
    counts_out = counts_ptr + (split * n_rows + row) * 2
    tl.store(counts_out, G.to(tl.int64))
    tl.store(counts_out + 1, E.to(tl.int64))


# Programs that keep every SM of an H100 (132 SMs) busy a few times over; below this many rows
# each row's vocabulary is split over several programs (a fixed figure, so the static model and a
# GPU run pick the same launch; on an A100's 108 SMs it still fills the machine).
_TARGET_PROGRAMS = 4 * 132
_BLOCK_V_MAX = 4096


@dataclass(frozen=True)
class TokenStatsSettings:
    """Launch settings of :func:`launch_token_stats` for one shape (chosen in one place).

    Attributes:
        block_v: logits per program per loop iteration (a ``[block_v // lane, lane]`` tile).
        lane: consecutive logits one lane owns (16 bytes: 8 fp16/bf16, 4 fp32).
        slow_block: tile of the masked re-read for rows holding non-finite logits (a quarter
            of ``block_v``: a cold loop, kept smaller than the hot one).
        splits: programs per row (vocabulary-parallel for small N); ``chunk`` columns each.
        grid: ``(n, splits, 1)``.
    """

    block_v: int
    lane: int
    slow_block: int
    num_warps: int
    num_stages: int
    splits: int
    chunk: int
    grid: tuple[int, int, int]

    @property
    def label(self) -> str:
        return (f"bv{self.block_v}_r{self.lane}_w{self.num_warps}_s{self.num_stages}"
                f"_split{self.splits}")


def token_stats_settings(n: int, v: int, dtype: torch.dtype, block_v: int | None = None,
                         splits: int | None = None) -> TokenStatsSettings:
    """Block size, lane width, warps, stages, splits and grid for ``z [n, v]`` of ``dtype``.

    ``block_v`` and ``splits`` override the choice (tests force small blocks and a split row
    to exercise the rescaling and the partial-state merge in the interpreter)."""
    lane = 16 // torch.empty((), dtype=dtype).element_size()
    if block_v is None:
        block_v = min(_BLOCK_V_MAX, max(triton.next_power_of_2(max(v, 1)), 32 * lane))
        # Few rows: smaller tiles give more programs to spread over the SMs.
        while block_v > 1024 and n * triton.cdiv(v, block_v) < _TARGET_PROGRAMS:
            block_v //= 2
    if block_v < lane or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= {lane}, got {block_v}")
    if splits is None:
        splits = 1 if n >= _TARGET_PROGRAMS else triton.cdiv(_TARGET_PROGRAMS, max(n, 1))
    splits = max(1, min(splits, triton.cdiv(v, block_v)))
    chunk = triton.cdiv(triton.cdiv(v, splits), block_v) * block_v  # whole tiles per split
    splits = triton.cdiv(v, chunk)
    # Two lanes per thread: 16 logits of 16-bit (32 bytes) in flight per thread per iteration.
    num_warps = max(1, min(8, block_v // (lane * 32 * 2)))
    return TokenStatsSettings(block_v=block_v, lane=lane, slow_block=max(block_v // 4, lane),
                              num_warps=num_warps, num_stages=1,
                              splits=splits, chunk=chunk, grid=(n, splits, 1))


def _bf16_pairs(dtype: torch.dtype, row_stride: int, data_ptr: int) -> bool:
    """bf16 rows readable as aligned 32-bit words (even row stride, 4-byte aligned base)."""
    return dtype == torch.bfloat16 and row_stride % 2 == 0 and data_ptr % 4 == 0


def launch_token_stats(z: torch.Tensor, targets: torch.Tensor, z_t: torch.Tensor,
                       temperature: float, state: torch.Tensor, counts: torch.Tensor,
                       cfg: TokenStatsSettings) -> None:
    """Reduce each row of ``z`` to its (partial) states with the settings ``cfg`` (from
    :func:`token_stats_settings` for this shape).

    Args:
        z: ``[N, V]`` fp32/fp16/bf16 with unit column stride, ``N >= 1``.
        targets: ``[N]`` int64 (in range; masked rows carry any valid index).
        z_t: ``[N]`` fp32 target logits (contiguous).
        temperature: T > 0.
        state: ``[S, N, 7]`` fp32 output, ``counts``: ``[S, N, 2]`` int64 output, one partial
            state per split of the vocabulary (``S = cfg.splits``). The ``u`` sums are relative
            to ``K = z_t / T`` (0 where z_t is not finite).
    """
    n, v = z.shape
    stride = z.stride(0) if n > 1 else v
    # 1/T as an fp32 pair (hi + lo): the origin of a row with a large offset needs its bits.
    inv_temp = 1.0 / temperature
    inv_temp_hi = torch.tensor(inv_temp, dtype=torch.float32).item()
    _token_stats_kernel[cfg.grid](
        z, targets, z_t, state, counts, n, v, stride, cfg.chunk, inv_temp_hi,
        inv_temp - inv_temp_hi,
        BLOCK_V=cfg.block_v, R=cfg.lane, SLOW_BLOCK=cfg.slow_block,
        BF16_PAIRS=_bf16_pairs(z.dtype, stride, z.data_ptr()), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
