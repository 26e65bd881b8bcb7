"""linear_token_stats: same numbers as materialising the logits, without materialising them."""

import pytest
import torch
from _helpers import DEVICE
from test_token_stats import compare

from icqs_fast import ops
from icqs_fast.backends import torch_ref


def ref64(h, w, t, b=None, temperature=1.0):
    z = h.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    return torch_ref.token_stats(z, t, temperature=temperature, compute_dtype=torch.float64)


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
    compare(out, ref64(hid, w, t, b), 2e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_bf16_and_temperature(backend):
    dev = "cpu" if backend == "cpp" else DEVICE
    n, h, v = 9, 16, 777
    hid = torch.randn(n, h).bfloat16()
    w = (torch.randn(v, h) / 4).bfloat16()
    t = torch.randint(0, v, (n,))
    out = ops.linear_token_stats(hid.to(dev), w.to(dev), t.to(dev), temperature=0.7,
                                 backend=backend, chunk_vocab=100)
    compare(out, ref64(hid.float(), w.float(), t, temperature=0.7), 2e-4)


@pytest.mark.parametrize("tiles,block_m", [(1, 16), (3, 16), (2, 32)])
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
        compare(out, ref64(hid.cpu(), w.cpu(), t.cpu()), 2e-4)


_MEM_SCRIPT = r"""
import resource, sys, torch
from icqs_fast import ops
torch.set_num_threads(1)
n, h, v = 4096, 64, 16384
hid = torch.randn(n, h); w = torch.randn(v, h) / 8; t = torch.randint(0, v, (n,))
ops.linear_token_stats(hid[:2], w[:100], t[:2] % 100, backend=sys.argv[1])  # warm up lazy imports
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ops.linear_token_stats(hid, w, t, chunk_tokens=128, chunk_vocab=2048, backend=sys.argv[1])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_peak_memory_is_bounded(backend):
    """The [N, V] fp32 logits (256 MiB here) must never exist at once: measured as the growth of
    the peak RSS of a fresh process, which counts every allocation torch makes."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, backend], capture_output=True,
                         text=True, check=True)
    grew = int(out.stdout.strip().splitlines()[-1])
    full = 4096 * 16384 * 4
    # Documented bound: ~chunk_tokens * chunk_vocab * 4 bytes x small factor (+ O(N) states).
    assert grew < full / 4, f"peak grew {grew / 2**20:.1f} MiB; full logits {full / 2**20:.0f} MiB"
