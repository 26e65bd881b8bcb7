"""linear_token_stats: same numbers as materialising the logits, without materialising them."""

import os
import subprocess
import sys

import pytest
import torch
from _helpers import DEVICE, ref_token_stats64
from test_token_stats import compare, logit_refs, refs

from icqs_fast import ops


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(backend, with_bias):
    dev = "cpu" if backend == "cpp" else DEVICE
    n, h, v = 37, 24, 1031
    hid = torch.randn(n, h)
    w = torch.randn(v, h) / h**0.5 * 3
    b = torch.randn(v) if with_bias else None
    t = torch.randint(0, v, (n,))
    t[3] = -100
    out = ops.linear_token_stats(hid.to(dev), w.to(dev), t.to(dev),
                                 bias=None if b is None else b.to(dev), backend=backend,
                                 chunk_tokens=8, chunk_vocab=300)
    compare(out, *logit_refs(hid, w, t, b))


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_bf16_and_temperature(backend):
    dev = "cpu" if backend == "cpp" else DEVICE
    n, h, v = 9, 16, 777
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / 4).bfloat16()
    t = torch.randint(0, v, (n,))
    out = ops.linear_token_stats(hid.to(dev), w.to(dev), t.to(dev), temperature=0.7,
                                 backend=backend, chunk_vocab=100)
    compare(out, *logit_refs(hid, w, t, temperature=0.7))


@pytest.mark.parametrize("tiles,block_m", [(1, 16), (3, 16), (2, 32)])
@pytest.mark.slow
def test_triton_chunk_merge(tiles, block_m):
    """Several tiles per program and several chunks to merge; one row (N = 1) and N not a
    multiple of the row block; a strided hidden view."""
    from icqs_fast.backends import triton_backend

    for n in (1, 19):
        hid = torch.randn(n, 2 * 20)[:, ::2].to(DEVICE)  # column stride 2
        w = (torch.randn(1000, 20) / 3).to(DEVICE)
        t = torch.randint(0, 1000, (n,)).to(DEVICE)
        out = triton_backend.linear_token_stats(hid, w, t, None, tiles=tiles, block_m=block_m,
                                                block_n=64)
        compare(out, *logit_refs(hid, w, t))


_MEM_SCRIPT = r"""
import sys, torch
from icqs_fast import ops

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

torch.set_num_threads(1)
backend, dtype = sys.argv[1], getattr(torch, sys.argv[2])
n, h, v, ct, cv = 4096, 512, 4096, 128, 2048
hid = torch.randn(n, h).to(dtype); w = (torch.randn(v, h) / 8).to(dtype)
t = torch.randint(0, v, (n,))
# Warm up at the measured chunk shapes (two token chunks, the whole vocabulary): lazy imports,
# BLAS workspaces and the code pages of the kernels used are then resident, so the reading below
# is the call's own allocations, not one-time library costs that vary with the page cache.
ops.linear_token_stats(hid[:2 * ct], w, t[:2 * ct], chunk_tokens=ct, chunk_vocab=cv,
                       backend=backend)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before, file_before = status("VmRSS:"), status("RssFile:")
ops.linear_token_stats(hid, w, t, chunk_tokens=ct, chunk_vocab=cv, backend=backend)
# File-backed pages (shared-library code first touched now) are not allocations; they stay
# resident, so their growth is read after the call and taken off.
print(status("VmHWM:") - before - max(0, status("RssFile:") - file_before))
# The same reading of a known allocation (16 MiB, touched, then freed): shows the measurement
# itself works, so a broken reading of ~0 cannot pass the bound above.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
x = torch.ones(4 << 20)
del x
print(status("VmHWM:") - before)
"""


def documented_peak(backend, dtype, n=4096, h=512, v=4096, c=128, b=2048):
    """The bound stated in ``ops.linear_token_stats``' docstring, in bytes."""
    s = torch.empty(0, dtype=dtype).element_size()
    up = 0 if dtype == torch.float32 else 4  # the [...] terms: fp32 copies of non-fp32 inputs
    r = 72 * c if backend == "cpp" else 18 * c * b
    return 72 * n + up * c * h + max(4 * c * b + max(up * b * h, r), c * h * (s + up))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("backend,dtype", [("cpp", torch.float32), ("cpp", torch.bfloat16),
                                           ("torch", torch.float32)])
@pytest.mark.subprocess
def test_peak_memory_is_bounded(backend, dtype):
    """Extra peak memory within the documented bound (1.3-6 MiB here), far below the [N, V]
    fp32 logits (64 MiB) and the [N, H] copies (8 MiB each) a full-N gather would make:
    measured as the growth of the peak RSS of a fresh process, which counts every allocation
    torch makes. Large allocations go straight to mmap so freed memory leaves the RSS, and the
    margin covers the BLAS workspace and interpreter noise."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, backend, str(dtype).split(".")[1]],
                         capture_output=True, text=True, check=True, env=env)
    grew, known = (int(x) for x in out.stdout.strip().splitlines()[-2:])
    assert 15.5 * 2**20 <= known <= 18 * 2**20, f"a 16 MiB allocation read as {known / 2**20} MiB"
    bound = documented_peak(backend, dtype)
    allowed = 1.25 * bound + 2 * 2**20
    assert grew <= allowed, (f"peak grew {grew / 2**20:.2f} MiB; documented bound "
                             f"{bound / 2**20:.2f} MiB (allowed {allowed / 2**20:.2f} MiB)")


# ----------------------------------------------------------------------------------------------
# The fused Triton kernel's own paths (interpreter: fp32 dots, small forced blocks)


def _triton_linear(hid, w, t, b=None, temperature=1.0, **blocks):
    from icqs_fast.backends import triton_backend

    return triton_backend.linear_token_stats(hid.to(DEVICE), w.to(DEVICE), t.to(DEVICE),
                                             None if b is None else b.to(DEVICE),
                                             temperature=temperature, **blocks)


@pytest.mark.slow
def test_triton_grouped_grid_many_row_blocks_and_chunks():
    """10 row blocks (two groups of the grouped program order, the second partial) x 5 chunks
    of 2 tiles, the last tile padded; targets only in the first tile, so the other full tiles
    take the unmasked path and the first and last the masked one."""
    n, h, v = 150, 12, 300
    hid = torch.randn(n, h)
    w = torch.randn(v, h) / 2
    t = torch.randint(0, 32, (n,))
    t[7] = -100
    out = _triton_linear(hid, w, t, block_m=16, block_n=32, tiles=2)
    compare(out, *logit_refs(hid, w, t))


@pytest.mark.slow
def test_triton_non_finite_logits():
    """Non-finite logits from the bias (-inf, +inf, NaN columns, some in tiles without targets,
    which must fall back from the unmasked path; a -inf target logit, whose log-prob must be
    -inf as the reference's)."""
    n, h, v = 20, 8, 256
    hid = torch.randn(n, h)
    w = torch.randn(v, h) / 2
    t = torch.randint(0, 32, (n,))
    for special in ({100: float("-inf"), 140: float("nan")}, {200: float("inf")},
                    {3: float("-inf"), 150: float("-inf")}):
        b = torch.randn(v)
        for col, val in special.items():
            b[col] = val
        tt = t.clone()
        if 3 in special:
            tt[:4] = 3  # target logit -inf
        out = _triton_linear(hid, w, tt, b, block_m=16, block_n=32, tiles=3)
        keep = tt != 3
        compare(out, *logit_refs(hid, w, tt, b))  # -inf where the reference is -inf
        assert torch.isneginf(out.logprob[~keep]).all()


def test_triton_exact_ties_and_temperature():
    """Integer-valued inputs make every logit exact in any summation order, so ties with the
    target logit are exact: duplicated weight rows before and after the target column give
    eq_before > 0 (not greedy) or only later ties (greedy when nothing is larger). With a common
    offset of 2^14 on every logit (still exact in fp32) the statistics must not move."""
    n, h, v = 6, 4, 130
    hid = torch.randint(-2, 3, (n, h)).float()
    w = torch.randint(-2, 3, (v, h)).float()
    t = torch.tensor([40, 40, 70, 100, 5, 129])
    w[10] = w[40]    # a tie before target 40 (rows 0, 1)
    w[90] = w[70]    # a tie after target 70 (row 2)
    w[100] = 50.0    # target 100 has the largest logit for some rows
    for temperature, b in ((1.0, None), (0.6, None), (1.0, torch.full((v,), 16384.0)),
                           (0.6, torch.full((v,), 16384.0))):
        out = _triton_linear(hid, w, t, b, temperature=temperature, block_m=16, block_n=32,
                             tiles=2)
        compare(out, *logit_refs(hid, w, t, b, temperature=temperature))


def test_gpu_launches_match_the_launch_settings():
    """gpu_launches describes the CUDA launches (never the interpreter's small blocks, although
    this test runs under TRITON_INTERPRET) from the same settings function as the launcher."""
    from icqs_fast.kernels import linear_token_stats as k

    from bench.gpu_model.launches import linear_token_stats as kl

    for n, h, v in ((8192, 4096, 151936), (16, 2048, 128256), (512, 8192, 151936)):
        target, main = kl.gpu_launches(n, h, v, torch.bfloat16)
        cfg = k.launch_settings(n, h, v, torch.bfloat16)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (128, 64, 8)
        assert main.constexprs["BLOCK_M"] == cfg.block_m and main.constexprs["TILES"] == cfg.tiles
        assert main.grid == (cfg.row_blocks * cfg.chunks, 1, 1)
        per_chunk = cfg.tiles * cfg.block_n
        assert cfg.chunks * per_chunk >= v > (cfg.chunks - 1) * per_chunk
        assert main.programs >= 0.9 * k.SMS  # small N still fills the GPU (vocabulary chunks)
        assert main.tensor_flops == 2 * n * v * h
        assert main.hbm_bytes >= 2 * (n + v) * h
        assert list(main.signature) == list(k._linear_token_stats_kernel.arg_names)
        assert list(target.signature) == list(k._target_logits_kernel.arg_names)
        assert target.grid[0] * k.TARGET_BLOCK_M >= n


def test_triton_cold_tiles_between_unmasked_ones():
    """The two-loop tile walk: one program of 7 tiles (the last padded) where masked tiles
    (a target column, a NaN and a -inf column, two masked tiles in a row) sit between unmasked
    ones, so the tile loop stops and resumes several times; exact ranks, the rest within the
    rule of tests/tolerance.py. Also a softcapped run of the same walk (ranks on the uncapped
    logits)."""
    n, h, v = 12, 8, 7 * 32 - 5
    hid = torch.randn(n, h)
    w = torch.randn(v, h) / 2
    t = torch.tensor([40, 41, 150, 40, 3, 150, 40, 41, 150, 100, 101, 130])  # tiles 0, 1, 3, 4
    b = torch.zeros(v)
    b[70] = float("nan")      # tile 2: masked, no target
    b[105] = float("-inf")    # tile 3 (holds targets 100, 101 too)
    out = _triton_linear(hid, w, t, b, block_m=16, block_n=32, tiles=7)
    compare(out, *logit_refs(hid, w, t, b))
    # Same walk, finite logits, with the soft cap (c tanh(z / c) at T = 1 is tanh(z / c) at
    # T = 1 / c, the mapping of ops.linear_token_stats): the reference caps float64 logits.
    from icqs_fast.backends import triton_backend

    b[70], b[105] = 0.0, 0.0
    cap = 2.0
    got = triton_backend.linear_token_stats(hid.to(DEVICE), w.to(DEVICE), t.to(DEVICE),
                                            b.to(DEVICE), temperature=1 / cap,
                                            tanh_scale=1 / cap, block_m=16, block_n=32, tiles=7)
    capped = {}
    for dtype in (torch.float64, torch.float32):
        z = hid.to(dtype) @ w.to(dtype).t() + b.to(dtype)
        capped[dtype] = cap * torch.tanh(z / cap)
    compare(got, refs(capped[torch.float64], t)[0],
            ref_token_stats64(capped[torch.float32], t, dtype=torch.float32))


def test_gpu_launches_declare_the_cold_path():
    """The fused launch charges the masked fold (outside the tile loop) once per cold tile:
    each of the block's rows with its target in a tile of its own, plus the padded last tile."""
    from icqs_fast.kernels import linear_token_stats as k

    from bench.gpu_model.launches import linear_token_stats as kl

    for n, v in ((8192, 151936), (8192, 131072), (16, 151936)):
        main = kl.gpu_launches(n, 4096, v, torch.bfloat16)[1]
        cfg = k.launch_settings(n, 4096, v, torch.bfloat16)
        tiles = -(-v // cfg.block_n)
        cold = min(cfg.tiles, -(-min(n, cfg.block_m) * cfg.tiles // tiles)) + (v % 64 != 0)
        assert main.extra["cold_tiles"] == cold and main.outer2_iters == 1 + cold
        assert main.outer_iters == cfg.tiles
