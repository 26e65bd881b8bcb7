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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Launch, ptr
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


@dataclass(frozen=True)
class Settings:
    """Launch settings of the fused kernel for one problem, chosen by :func:`launch_settings`
    (the only place block sizes, warps and stages are picked)."""

    block_m: int
    block_n: int
    block_k: int
    tiles: int  # BLOCK_N-wide vocabulary tiles per program
    num_warps: int
    num_stages: int
    fp32_dot: bool  # cast tiles to fp32 before tl.dot (fp32 inputs or the CPU interpreter)
    precision: str
    row_blocks: int
    chunks: int  # vocabulary chunks = partial states per row

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.row_blocks, self.chunks, 1)

    @property
    def label(self) -> str:
        return (f"m{self.block_m}_n{self.block_n}_k{self.block_k}_t{self.tiles}"
                f"_w{self.num_warps}_s{self.num_stages}")


def launch_settings(n: int, h: int, v: int, dtype: torch.dtype, *, interpret: bool = False,
                    block_m: int | None = None, block_n: int | None = None,
                    block_k: int | None = None, tiles: int | None = None) -> Settings:
    """Block sizes, warps, stages and grid of the fused kernel for ``[N, H] x [V, H]``.

    ``interpret``: the CPU interpreter (small blocks for speed, fp32 dots); the explicit block
    arguments override the choice (tests use small ones to exercise the chunk merge).
    """
    fp32_dot = interpret or dtype == torch.float32
    precision = "ieee" if fp32_dot else "tf32"
    if block_m is None:
        block_m = 16 if interpret else (64 if n >= 64 else 16)
    if block_n is None:
        block_n = 128
    if block_k is None:
        block_k = min(64, max(16, 1 << (max(h, 1) - 1).bit_length()))
    if tiles is None:
        # Enough vocabulary per program to amortise the state write; enough programs to fill
        # the GPU when N is small.
        tiles = 1 if interpret else max(1, min(16, v // (block_n * 64)))
    chunks = triton.cdiv(v, block_n * tiles) if v else 0
    return Settings(block_m=block_m, block_n=block_n, block_k=block_k, tiles=tiles,
                    num_warps=4, num_stages=3, fp32_dot=fp32_dot, precision=precision,
                    row_blocks=triton.cdiv(n, block_m), chunks=chunks)


def launch(hidden, weight, bias, targets, z_t, shift, temperature: float, pstate, pcounts,
           cfg: Settings) -> None:
    """Fill ``pstate [chunks, N, 7]`` fp32 and ``pcounts [chunks, N, 2]`` int64
    (``chunks = cfg.chunks``).

    Args:
        hidden: ``[N, H]``; weight: ``[V, H]`` (same dtype); bias: ``[V]`` or None.
        targets: ``[N]`` int64 in range; z_t: ``[N]`` fp32 target logits; shift: ``[N]`` fp32.
        cfg: from :func:`launch_settings` for this shape and dtype.
    """
    n, hdim = hidden.shape
    v = weight.shape[0]
    _linear_token_stats_kernel[cfg.grid[:2]](
        hidden, weight, bias if bias is not None else hidden, targets, z_t, shift,
        pstate, pcounts, n, v, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        1.0 / temperature,
        HAS_BIAS=bias is not None, FP32_DOT=cfg.fp32_dot, PRECISION=cfg.precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TILES=cfg.tiles,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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


TARGET_BLOCK_M, TARGET_BLOCK_K, TARGET_WARPS, TARGET_STAGES = 16, 64, 4, 3


def target_logits(hidden, weight, bias, targets, out) -> None:
    """Fill ``out [N]`` fp32 with ``hidden[r] . weight[targets[r]] (+ bias[targets[r]])``,
    accumulated in fp32; ``targets`` int64, in range."""
    n, hdim = hidden.shape
    if n == 0:
        return
    grid = (triton.cdiv(n, TARGET_BLOCK_M),)
    _target_logits_kernel[grid](
        hidden, weight, bias if bias is not None else hidden, targets, out, n, hdim,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=TARGET_BLOCK_M, BLOCK_K=TARGET_BLOCK_K,
        num_warps=TARGET_WARPS, num_stages=TARGET_STAGES,
    )


def _signature(params: dict[str, str], ints: dict[str, int], consts: dict
               ) -> tuple[dict[str, str], dict, list[str]]:
    """Signature, constexprs and 16-divisible parameters as Triton's JIT specialises them for
    these argument values: an int equal to 1 becomes a constexpr; pointers (torch allocations
    are 256-byte aligned) and ints that are multiples of 16 get ``tt.divisibility`` 16, which
    lets loads vectorise (pass them as ``attrs`` to ``ASTSource`` to compile the same code)."""
    sig, const, div16 = {}, {}, []
    for name, kind in params.items():
        if kind == "i32" and ints[name] == 1:
            sig[name], const[name] = "constexpr", 1
            continue
        sig[name] = kind
        if kind.startswith("*") or (kind == "i32" and ints[name] % 16 == 0):
            div16.append(name)
    for name, value in consts.items():
        sig[name], const[name] = "constexpr", value
    return sig, const, div16


def gpu_launches(n: int, h: int, v: int, dtype: torch.dtype, has_bias: bool = False
                 ) -> list[Launch]:
    """The launches :func:`icqs_fast.backends.triton_backend.linear_token_stats` issues on a
    CUDA device for contiguous ``hidden [N, H]`` and ``weight [V, H]`` of ``dtype``: the
    target-logits kernel, then the fused kernel (settings from :func:`launch_settings`).

    ``loop_iters`` of the fused launch counts its innermost (K) loop per program
    (``tiles * cdiv(H, BLOCK_K)``); ``loop_elements`` is the logits finished per K iteration
    on average (``BLOCK_M * BLOCK_N / cdiv(H, BLOCK_K)``, rounded). ``extra`` has the exact
    tile figures and ``divisible_by_16`` (the parameters the JIT marks 16-divisible).
    """
    s = torch.empty(0, dtype=dtype).element_size()
    p = ptr(dtype)
    ints = {"N": n, "V": v, "H": h, "s_hn": h, "s_hh": 1, "s_wv": h, "s_wh": 1}
    strides = {"s_hn": "i32", "s_hh": "i32", "s_wv": "i32", "s_wh": "i32"}
    tsig, tconst, tdiv = _signature(
        {"HID": p, "W": p, "BIAS": p, "T": "*i64", "ZT": "*fp32", "N": "i32", "H": "i32",
         **strides},
        ints, {"HAS_BIAS": has_bias, "BLOCK_M": TARGET_BLOCK_M, "BLOCK_K": TARGET_BLOCK_K})
    target = Launch(
        kernel="linear_token_stats.target_logits", fn=_target_logits_kernel,
        signature=tsig, constexprs=tconst, num_warps=TARGET_WARPS, num_stages=TARGET_STAGES,
        grid=(triton.cdiv(n, TARGET_BLOCK_M), 1, 1),
        hbm_bytes=2 * n * h * s + n * (8 + 4) + (n * s if has_bias else 0),
        elements=n, loop_iters=triton.cdiv(h, TARGET_BLOCK_K),
        loop_elements=TARGET_BLOCK_M * TARGET_BLOCK_K,
        label=f"m{TARGET_BLOCK_M}_k{TARGET_BLOCK_K}_w{TARGET_WARPS}",
        extra={"divisible_by_16": tdiv},
    )
    cfg = launch_settings(n, h, v, dtype)
    msig, mconst, mdiv = _signature(
        {"HID": p, "W": p, "BIAS": p, "T": "*i64", "ZT": "*fp32", "SHIFT": "*fp32",
         "PSTATE": "*fp32", "PCOUNTS": "*i64", "N": "i32", "V": "i32", "H": "i32", **strides,
         "inv_temp": "fp32"},
        ints, {"HAS_BIAS": has_bias, "FP32_DOT": cfg.fp32_dot, "PRECISION": cfg.precision,
               "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
               "TILES": cfg.tiles})
    k_iters = triton.cdiv(h, cfg.block_k)
    main = Launch(
        kernel="linear_token_stats", fn=_linear_token_stats_kernel,
        signature=msig, constexprs=mconst, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=cfg.grid,
        hbm_bytes=((n + v) * h * s + (v * s if has_bias else 0) + n * (8 + 4 + 4)
                   + cfg.chunks * n * (28 + 16)),
        tensor_flops=2 * n * v * h, elements=n * v,
        loop_iters=cfg.tiles * k_iters,
        loop_elements=round(cfg.block_m * cfg.block_n / k_iters),
        label=cfg.label,
        extra={"tiles": cfg.tiles, "k_iters_per_tile": k_iters,
               "tile_elements": cfg.block_m * cfg.block_n, "chunks": cfg.chunks,
               "divisible_by_16": mdiv},
    )
    return [target, main]
