"""token_stats on every backend against a float64 reference, on awkward inputs."""

import pytest
import torch
from _helpers import DEVICE

from icqs_fast import ops
from icqs_fast.backends import torch_ref
from icqs_fast.types import FLOAT_FIELDS

# Tolerances per input dtype (the outputs are fp32; inputs are cast exactly, so the error is in
# the accumulation). Absolute on entropy-like values of size ~log V.
TOL = {torch.float32: 2e-4, torch.float16: 2e-4, torch.bfloat16: 2e-4}


def ref64(logits, targets, ignore_index=-100, temperature=1.0):
    return torch_ref.token_stats(logits.double(), targets, ignore_index, temperature,
                                 compute_dtype=torch.float64)


def poison_outputs_check(out, n):
    for name, v in out.as_dict().items():
        assert v.shape == (n,), name
        if name in FLOAT_FIELDS:
            assert v.dtype == torch.float32, name
            assert torch.isfinite(v).all(), f"{name} has non-finite values: {v}"


def compare(out, ref, tol, rel=1e-5):
    assert torch.equal(out.valid.cpu(), ref.valid.cpu())
    for name in FLOAT_FIELDS:
        a, b = getattr(out, name).double().cpu(), getattr(ref, name).double().cpu()
        scale = tol + rel * b.abs()
        err = (a - b).abs()
        assert (err <= scale).all(), f"{name}: max err {err.max():.3e}\n{a}\n{b}"
    assert torch.equal(out.target_rank.cpu(), ref.target_rank.cpu())
    assert torch.equal(out.is_greedy.cpu(), ref.is_greedy.cpu())


def backends_for(n_elems):
    out = ["torch", "cpp"]
    # The Triton interpreter does ~1M elements/s: keep its shapes small.
    if DEVICE == "cuda" or n_elems <= 300_000:
        out.append("triton")
    return out


def dev_for(backend):
    return "cpu" if backend == "cpp" else DEVICE


CASES = [
    # (N, V) - V deliberately not a multiple of any power-of-two block
    (1, 1),
    (1, 50),
    (7, 1000),
    (33, 4099),
    (5, 8192),
]


@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_random(shape, dtype, backend):
    n, v = shape
    dev = dev_for(backend)
    logits = (torch.randn(n, v) * 4).to(dtype).to(dev)
    targets = torch.randint(0, v, (n,)).to(dev)
    out = ops.token_stats(logits, targets, backend=backend)
    poison_outputs_check(out, n)
    compare(out, ref64(logits.cpu(), targets.cpu()), TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_awkward_rows(backend):
    """Masked rows, -inf entries, all-negative rows, a +1000 offset, ties, temperature."""
    dev = dev_for(backend)
    n, v = 8, 3001
    z = torch.randn(n, v) * 3
    z[1] = z[1] - 500.0  # all-negative row
    z[2, ::3] = float("-inf")  # masked vocabulary entries
    z[3] = z[3] + 1000.0  # large common offset
    z[4, :] = 0.5  # all ties: argmax is index 0
    z[5, 10] = z[5].max() + 1
    z[5, 20] = z[5, 10]  # tie for the max at 10 and 20
    targets = torch.randint(0, v, (n,))
    targets[0] = -100
    targets[2] = 4  # target on a finite entry (4 % 3 != 0)
    targets[4] = 0
    targets[5] = 20  # tied with an earlier index: not greedy
    targets[6] = 7
    out = ops.token_stats(z.to(dev), targets.to(dev), backend=backend)
    ref = ref64(z, targets)
    compare(out, ref, 2e-4)
    assert out.logprob[0] == 0 and not out.valid[0] and out.entropy[0] == 0
    assert bool(out.is_greedy[4]) and not bool(out.is_greedy[5])
    assert int(out.target_rank[5]) == 0
    for t in (0.5, 2.0):
        compare(ops.token_stats(z.to(dev), targets.to(dev), temperature=t, backend=backend),
                ref64(z, targets, temperature=t), 2e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_offset_precision(backend):
    """A +1000 offset on every logit must not change any statistic (shifted accumulation)."""
    dev = dev_for(backend)
    z = torch.randn(4, 5003) * 2
    t = torch.randint(0, 5003, (4,))
    a = ops.token_stats(z.to(dev), t.to(dev), backend=backend)
    b = ops.token_stats((z + 1000).to(dev), t.to(dev), backend=backend)
    for name in ("entropy", "varentropy", "logprob_var", "max_logprob"):
        assert torch.allclose(getattr(a, name), getattr(b, name), atol=5e-4), name
    # logprob loses only the offset's ulp (1000 in fp32 has ulp 6e-5) in the target logit.
    assert torch.allclose(a.logprob, b.logprob, atol=5e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_strided_rows(backend):
    dev = dev_for(backend)
    big = torch.randn(6, 2 * 777)
    z = big[:, ::1][:, :777]  # row stride 1554, unit column stride
    t = torch.randint(0, 777, (6,))
    out = ops.token_stats(z.to(dev) if dev != "cpu" else z, t.to(dev), backend=backend)
    compare(out, ref64(z, t), 2e-4)


@pytest.mark.parametrize("block_v", [16, 64])
def test_triton_small_blocks(block_v):
    """Many vocabulary blocks per row: the max moves between blocks (rescaling), whole blocks
    are -inf, the row starts with -inf blocks, and every logit carries a +1000 offset."""
    from icqs_fast.backends import triton_backend

    z = torch.randn(6, 517) * 3
    z[0, :200] = float("-inf")  # leading -inf blocks
    z[1, 100:300] = float("-inf")
    z[2] += 1000.0
    z[3] = torch.linspace(-20, 20, 517)  # max grows in every block
    z[4] = torch.linspace(20, -20, 517)  # max found in the first block
    t = torch.tensor([300, 50, 7, 516, 0, -100])
    out = triton_backend.token_stats(z.to(DEVICE), t.to(DEVICE), block_v=block_v)
    compare(out, ref64(z, t), 2e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_large_vocab(backend):
    """Qwen-sized vocabulary."""
    z = torch.randn(3, 151936) * 5
    t = torch.randint(0, 151936, (3,))
    compare(ops.token_stats(z, t, backend=backend), ref64(z, t), 5e-4)


def test_leading_dims_and_errors():
    z = torch.randn(2, 3, 11)
    t = torch.randint(0, 11, (2, 3))
    out = ops.token_stats(z, t)
    assert out.logprob.shape == (2, 3)
    with pytest.raises(ValueError, match=r"targets\[1\] = 11"):
        ops.token_stats(torch.randn(2, 11), torch.tensor([0, 11]))
    with pytest.raises(ValueError, match="temperature"):
        ops.token_stats(torch.randn(2, 11), torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(TypeError, match="int64"):
        ops.token_stats(torch.randn(2, 11), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="unknown backend"):
        ops.token_stats(torch.randn(2, 11), torch.tensor([0, 1]), backend="cuda-magic")


def test_empty():
    out = ops.token_stats(torch.randn(0, 11), torch.zeros(0, dtype=torch.long))
    assert out.logprob.shape == (0,)
