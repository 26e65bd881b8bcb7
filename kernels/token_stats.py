"""One-pass softmax statistics per row of logits: the Triton side of ``ops.token_stats``.

One program reduces one row of ``z [N, V]`` (any float dtype, unit column stride) to the
mergeable state of :mod:`icqs_fast.backends.state` (``m, s0, s1, s2, n, u1, u2`` and the two rank
counts), reading each logit once. Moments are kept relative to the running max ``m`` (the
*shifted* form): when a block raises the max from ``m`` to ``m'`` the sums are moved to the new
origin with ``d = m - m'``, ``a = e^d``::

    s0 <- a s0,    s1 <- a (s1 + d s0),    s2 <- a (s2 + 2 d s1 + d^2 s0)

so a large common offset on every logit never meets fp32 rounding. Accumulators are fp32 (per
block, then per row); offsets are int64 so ``N * V`` above 2^31 is fine. Non-finite logits are
left out of every sum, as in the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launch, ptr

STATE_WIDTH = 7  # m, s0, s1, s2, n, u1, u2 (see icqs_fast.backends.state)


@triton.jit
def _rescale(m_old, s0, s1, s2, m_new):
    """Move (s0, s1, s2) from origin m_old to m_new >= m_old (both may be -inf)."""
    m_new_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    d = tl.where(m_old > float("-inf"), m_old - m_new_safe, 0.0)
    a = tl.exp(d)
    s2 = a * (s2 + 2.0 * d * s1 + d * d * s0)
    s1 = a * (s1 + d * s0)
    s0 = a * s0
    return s0, s1, s2


@triton.jit
def _token_stats_kernel(
    Z, T, ZT, SHIFT, STATE, COUNTS,
    V, stride_row, inv_temp,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_row
    t = tl.load(T + row)
    z_t = tl.load(ZT + row)
    k = tl.load(SHIFT + row)

    m = tl.full((), float("-inf"), tl.float32)
    s0 = tl.zeros((), tl.float32)
    s1 = tl.zeros((), tl.float32)
    s2 = tl.zeros((), tl.float32)
    n = tl.zeros((), tl.float32)
    u1 = tl.zeros((), tl.float32)
    u2 = tl.zeros((), tl.float32)
    greater = tl.zeros((), tl.int64)
    eq_before = tl.zeros((), tl.int64)

    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        inb = cols < V
        z = tl.load(z_row + cols, mask=inb, other=float("-inf")).to(tl.float32)
        x = z * inv_temp
        fin = inb & (x == x) & (tl.abs(x) < float("inf"))
        xf = tl.where(fin, x, float("-inf"))

        m_new = tl.maximum(m, tl.max(xf, axis=0))
        s0, s1, s2 = _rescale(m, s0, s1, s2, m_new)
        m = m_new
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        d = tl.where(fin, x - m_safe, 0.0)
        e = tl.where(fin, tl.exp(d), 0.0)
        ed = e * d
        s0 += tl.sum(e, axis=0)
        s1 += tl.sum(ed, axis=0)
        s2 += tl.sum(ed * d, axis=0)
        u = tl.where(fin, x - k, 0.0)
        u1 += tl.sum(u, axis=0)
        u2 += tl.sum(u * u, axis=0)
        n += tl.sum(fin.to(tl.float32), axis=0)
        # Ranks compare the raw logits (exact in fp32 for every input dtype).
        greater += tl.sum((inb & (z > z_t) & (cols != t)).to(tl.int64), axis=0)
        eq_before += tl.sum((inb & (z == z_t) & (cols < t)).to(tl.int64), axis=0)

    out = STATE + row * 7
    tl.store(out + 0, m)
    tl.store(out + 1, s0)
    tl.store(out + 2, s1)
    tl.store(out + 3, s2)
    tl.store(out + 4, n)
    tl.store(out + 5, u1)
    tl.store(out + 6, u2)
    tl.store(COUNTS + row * 2, greater)
    tl.store(COUNTS + row * 2 + 1, eq_before)


@dataclass(frozen=True)
class TokenStatsSettings:
    """Launch settings of :func:`launch_token_stats` for one shape (chosen in one place)."""

    block_v: int
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]

    @property
    def label(self) -> str:
        return f"bv{self.block_v}_w{self.num_warps}_s{self.num_stages}"


def token_stats_settings(n: int, v: int, dtype: torch.dtype,
                         block_v: int | None = None) -> TokenStatsSettings:
    """Block size, warps, stages and grid for ``z [n, v]`` of ``dtype`` (``block_v`` overrides
    the vocabulary block; tests use small ones to exercise the rescaling)."""
    if block_v is None:
        # Big blocks keep a 150k row at ~37 iterations on a GPU; the interpreter's cost is per
        # element, so the block size does not matter there beyond padding waste.
        block_v = min(4096, triton.next_power_of_2(max(v, 16)))
    return TokenStatsSettings(block_v=block_v, num_warps=8 if block_v >= 2048 else 4,
                              num_stages=3, grid=(n, 1, 1))


def _signature(dtype: torch.dtype) -> dict[str, str]:
    return {"Z": ptr(dtype), "T": "*i64", "ZT": "*fp32", "SHIFT": "*fp32", "STATE": "*fp32",
            "COUNTS": "*i64", "V": "i32", "stride_row": "i32", "inv_temp": "fp32",
            "BLOCK_V": "constexpr"}


def gpu_launches(n: int, v: int, dtype: torch.dtype) -> list[Launch]:
    """The launches :func:`launch_token_stats` issues on a CUDA device for contiguous
    ``logits [n, v]`` of ``dtype`` (fp32/fp16/bf16), as :class:`~.launch.Launch` data.

    ``extra["divisible_by_16"]`` names the arguments the Triton runtime specialises as
    multiples of 16 (aligned pointers; ``V`` and the row stride when ``v % 16 == 0``), so a
    static compile sees the same alignment (vector loads) as the real launch.
    """
    cfg = token_stats_settings(n, v, dtype)
    elsize = torch.empty((), dtype=dtype).element_size()
    # Compulsory traffic: logits once; targets, z_t, shift in; state and counts out.
    hbm = n * v * elsize + n * (8 + 4 + 4) + n * (STATE_WIDTH * 4 + 2 * 8)
    div16 = ["Z", "T", "ZT", "SHIFT", "STATE", "COUNTS"]
    if v % 16 == 0:
        div16 += ["V", "stride_row"]
    return [Launch(
        kernel="token_stats", fn=_token_stats_kernel, signature=_signature(dtype),
        constexprs={"BLOCK_V": cfg.block_v}, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=cfg.grid, hbm_bytes=hbm, elements=n * v, loop_iters=float(triton.cdiv(v, cfg.block_v)),
        loop_elements=cfg.block_v, label=cfg.label, extra={"divisible_by_16": div16},
    )]


def launch_token_stats(z, targets, z_t, shift, temperature: float, state, counts,
                       block_v: int | None = None) -> None:
    """Reduce each row of ``z`` to its state, one program per row.

    Args:
        z: ``[N, V]`` fp32/fp16/bf16 with unit column stride.
        targets: ``[N]`` int64 (in range; masked rows carry any valid index).
        z_t: ``[N]`` fp32 target logits; shift: ``[N]`` fp32 shift K (x units).
        state: ``[N, 7]`` fp32 output; counts: ``[N, 2]`` int64 output.
        block_v: vocabulary block override (tests).
    """
    n, v = z.shape
    if n == 0:
        return
    cfg = token_stats_settings(n, v, z.dtype, block_v)
    stride = z.stride(0) if n > 1 else v
    _token_stats_kernel[cfg.grid](
        z, targets, z_t, shift, state, counts, v, stride, 1.0 / temperature,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
