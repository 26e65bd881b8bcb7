"""token_stats on every backend against a float64 reference, on awkward inputs."""

import pytest
import torch
from _helpers import DEVICE, ref_token_stats64
from tolerance import assert_within_torch_error

from icqs_fast import ops
from icqs_fast.types import FLOAT_FIELDS


def ref64(logits, targets, ignore_index=-100, temperature=1.0):
    # Independent of every backend (the torch one included): written out in tests/_helpers.py.
    return ref_token_stats64(logits, targets, ignore_index, temperature)


def refs(logits, targets, ignore_index=-100, temperature=1.0):
    """``(float64 reference, the same code in float32)``: what :func:`compare` takes. float32 is
    the kernels' output dtype (every input dtype is read exactly and accumulated in fp32)."""
    return (ref64(logits, targets, ignore_index, temperature),
            ref_token_stats64(logits, targets, ignore_index, temperature, torch.float32))


def row_scale(logits, temperature=1.0):
    """[N] the largest finite |logit / T| of each row (:func:`compare`'s offset allowance)."""
    x = logits.cpu().double() / temperature
    return x.abs().masked_fill(~torch.isfinite(x), 0.0).amax(-1)


def logit_refs(h, w, t, b=None, temperature=1.0):
    """:func:`refs` of the logits ``h @ w.T + b`` (linear_token_stats' contract): float64
    logits for the reference, float32 ones (the kernels' matmul dtype; every input dtype casts
    to it exactly) for the same code in float32."""
    def logits(dtype):
        z = h.cpu().to(dtype) @ w.cpu().to(dtype).t()
        return z if b is None else z + b.cpu().to(dtype)

    return (ref64(logits(torch.float64), t.cpu(), temperature=temperature),
            ref_token_stats64(logits(torch.float32), t.cpu(), temp=temperature,
                              dtype=torch.float32))


def poison_outputs_check(out, n):
    for name, v in out.as_dict().items():
        assert v.shape == (n,), name
        if name in FLOAT_FIELDS:
            assert v.dtype == torch.float32, name
            assert torch.isfinite(v).all(), f"{name} has non-finite values: {v}"


def compare(out, ref, same_dtype, offset_scale=None):
    """Every float field of TokenStats ``out`` within flash-attention's rule
    (tests/tolerance.py) of the float64 TokenStats ``ref``, ``same_dtype`` being the same
    reference code in float32; valid, target_rank and is_greedy exactly. With ``offset_scale``
    [N] (:func:`row_scale`, for rows that carry a common offset), the log-probabilities may
    also be one fp32 eps of it off: the torch backend forms ``lse`` in fp32 and the Triton
    kernel keeps the row max in fp32, so at +1000 they pay a rounding of the offset's scale
    (1.3e-5 and 6.1e-5) that the reference code, working relative to the max, does not.
    logprob_var gets 4x, not 2x: the Triton kernel's fp32 u sums (one pass, as the
    reference's) run in tile order and measure 3.4-3.8x the error of torch's pairwise sums of
    the same terms."""
    assert torch.equal(out.valid.cpu(), ref.valid.cpu())
    for name in FLOAT_FIELDS:
        slack = 0.0
        if name in ("logprob", "max_logprob") and offset_scale is not None:
            slack = torch.finfo(torch.float32).eps * offset_scale
        assert_within_torch_error(getattr(out, name), getattr(ref, name),
                                  getattr(same_dtype, name),
                                  factor=4.0 if name == "logprob_var" else 2.0, slack=slack,
                                  name=name)
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
    # (N, V) - V deliberately not a multiple of any power-of-two block; the rows of several
    # blocks in the slow group (test_cpp_backend.py and the hypothesis properties reach them too)
    (1, 1),
    (1, 50),
    (7, 1000),
    pytest.param((33, 4099), marks=pytest.mark.slow),
    pytest.param((5, 8192), marks=pytest.mark.slow),
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
    compare(out, *refs(logits.cpu(), targets.cpu()))


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
    compare(out, *refs(z, targets), row_scale(z))  # row 3: +1000
    assert out.logprob[0] == 0 and not out.valid[0] and out.entropy[0] == 0
    assert bool(out.is_greedy[4]) and not bool(out.is_greedy[5])
    assert int(out.target_rank[5]) == 0
    for t in (0.5, 2.0):
        compare(ops.token_stats(z.to(dev), targets.to(dev), temperature=t, backend=backend),
                *refs(z, targets, temperature=t), row_scale(z, t))


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
    compare(out, *refs(z, t))


@pytest.mark.parametrize("block_v", [16, 64])
@pytest.mark.slow
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
    compare(out, *refs(z, t), row_scale(z))  # row 2: +1000


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_large_vocab(backend):
    """Qwen-sized vocabulary."""
    z = torch.randn(3, 151936) * 5
    t = torch.randint(0, 151936, (3,))
    out = ops.token_stats(z, t, backend=backend)
    compare(out, *refs(z, t))


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


def _hard_rows(v: int, dtype: torch.dtype):
    """Rows that take every path of the Triton kernel: finite rows (fast path) with ties to the
    target before, inside and after its tile, a +1e4 offset, and rows with -inf / NaN / +inf
    (the masked re-read)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(9, v, generator=g) * 3
    z[1] += 1e4  # large common offset (the fast path's shifted moments)
    z[2] = 0.5  # all ties: eq_before counts every column before the target
    z[3] = torch.linspace(-20, 20, v)  # the max grows in every tile
    z[4, ::5] = float("-inf")
    z[5, 7] = float("nan")
    z[6, v // 2] = float("inf")
    z[7] = float("-inf")  # nothing finite
    z = z.to(dtype)
    z[8] = z[8, 3]  # ties with the target logit everywhere, in the input dtype
    z[8, ::3] = z[8, ::3] - 1
    t = torch.tensor([0, v - 1, v // 2 + 3, v // 3, 1, 7, v // 2, 2, v - 5])
    return z, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v,splits", [(32, 1), (64, 4), (32, 40)])
def test_triton_state_and_counts(dtype, block_v, splits):
    """The kernel's merged state and rank counts against the float64 block reduction: every
    field (m, shifted moments, finite count, u sums) and both counts exactly, for one program
    per row and for rows split over several programs (vocabulary-parallel path)."""
    from icqs_fast.kernels import token_stats as _k

    from icqs_fast.backends import state as _state
    from icqs_fast.backends import triton_backend

    # Not a multiple of any block: every split ends in a partial tile (even for bf16: its hot
    # loop then reads 32-bit words; odd V takes the plain loads, covered by test_random).
    v = 212 if dtype == torch.bfloat16 else 211
    z, t = _hard_rows(v, dtype)
    z_t = z.gather(1, t[:, None])[:, 0].float()
    temperature = 0.7
    cfg = _k.token_stats_settings(z.shape[0], v, dtype, block_v, splits)
    assert cfg.splits == min(splits, -(-v // block_v))
    # Poisoned outputs: every element must be written.
    st = torch.full((cfg.splits, z.shape[0], 7), float("nan"), device=DEVICE)
    counts = torch.full((cfg.splits, z.shape[0], 2), -7, dtype=torch.int64, device=DEVICE)
    _k.launch_token_stats(z.to(DEVICE), t.to(DEVICE), z_t.to(DEVICE), temperature, st, counts,
                          cfg)
    got, got_counts = triton_backend.merge_partials(st.cpu(), counts.cpu())
    shift = torch.where(torch.isfinite(z_t), z_t / temperature, torch.zeros_like(z_t)).double()
    want, want_counts = _state.reduce_block(z, t, z_t.double(), shift, temperature)
    assert torch.equal(got_counts, want_counts), (got_counts, want_counts)
    m, w = got[:, 0], want[:, 0]
    assert torch.equal(torch.isfinite(m), torch.isfinite(w))
    fin = torch.isfinite(w)
    assert torch.allclose(m[fin], w[fin], rtol=1e-7, atol=0), (m, w)
    assert torch.equal(got[:, 4], want[:, 4])  # finite entries
    # Moments, moved to the reference's origin (the kernel's fp32 m may sit half an ulp off;
    # its moments are then relative to that m): the +1e4 row must be as exact as the others.
    d = torch.where(fin, m - w, torch.zeros_like(m))
    a = torch.exp(d)
    s0, s1, s2 = got[:, 1], got[:, 2], got[:, 3]
    aligned = (a * s0, a * (s1 + d * s0), a * (s2 + 2 * d * s1 + d * d * s0))
    for j, (name, g) in enumerate(zip(("s0", "s1", "s2"), aligned, strict=True), start=1):
        err = (g - want[:, j]).abs()
        assert (err <= 1e-5 * want[:, j].abs() + 1e-5).all(), (name, err)
    # u sums: relative to K = z_t / T up to its fp32 rounding, so compare the variance they
    # give (what finalize uses) and u1 to the shift's rounding.
    n = want[:, 4].clamp_min(2)
    var_got = (got[:, 6] - got[:, 5] ** 2 / n) / (n - 1)
    var_want = (want[:, 6] - want[:, 5] ** 2 / n) / (n - 1)
    assert torch.allclose(var_got, var_want, rtol=1e-4, atol=1e-4), (var_got, var_want)
    assert torch.allclose(got[:, 5], want[:, 5], rtol=1e-4, atol=1e-3 * n.max())


@pytest.mark.parametrize("splits", [None, 3])
def test_triton_split_rows_end_to_end(splits):
    """ops-level results with the vocabulary split over programs (and without) on the rows of
    _hard_rows, bf16 input, against the float64 reference."""
    from icqs_fast.backends import triton_backend

    z, t = _hard_rows(1000, torch.bfloat16)
    # The reference's log-probs are NaN on rows holding NaN / +inf or nothing finite (the
    # state test covers those rows); the -inf row still takes the masked re-read.
    keep = [0, 1, 2, 3, 4, 8]
    z, t = z[keep], t[keep]
    t[0] = -100
    out = triton_backend.token_stats(z.to(DEVICE), t.to(DEVICE), block_v=128, splits=splits)
    compare(out, *refs(z, t))


def test_offset_1e4_precision():
    """+1e4 on every fp32 logit: entropy-like statistics as without it, logprob to the input's
    own rounding (the stored fp32 origin is made exact, not left half an ulp off)."""
    from icqs_fast.backends import triton_backend

    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 700, generator=g) * 2
    t = torch.tensor([5, 600, 99])
    zo = z + 1e4
    out = triton_backend.token_stats(zo.to(DEVICE), t.to(DEVICE), block_v=64)
    compare(out, *refs(zo, t))


def test_gpu_launches_match_settings():
    """gpu_launches describes the launch token_stats_settings picks: one row per program for
    large N, a split vocabulary for small N, whole tiles in the hot loop, compulsory bytes."""
    from icqs_fast.kernels import token_stats as _k

    from bench.gpu_model.launches import token_stats as _kl

    v = 151936
    for n, dtype in ((8192, torch.bfloat16), (1024, torch.float32), (64, torch.float16),
                     (1, torch.bfloat16)):
        (launch,) = _kl.gpu_launches(n, v, dtype)
        cfg = _k.token_stats_settings(n, v, dtype)
        assert launch.grid == (n, cfg.splits, 1) == cfg.grid
        assert launch.constexprs == {"BLOCK_V": cfg.block_v, "R": cfg.lane,
                                     "SLOW_BLOCK": cfg.slow_block,
                                     "BF16_PAIRS": dtype == torch.bfloat16}
        assert launch.num_warps == cfg.num_warps and launch.label == cfg.label
        assert cfg.splits * cfg.chunk >= v > (cfg.splits - 1) * cfg.chunk
        assert cfg.chunk % cfg.block_v == 0
        assert launch.programs >= min(n, 4 * 132)  # small N still fills the SMs
        assert launch.loop_iters * cfg.block_v * cfg.splits <= v
        elsize = torch.empty((), dtype=dtype).element_size()
        assert launch.hbm_bytes == n * v * elsize + n * 12 + cfg.splits * n * 44
        assert launch.elements == n * v and launch.loop_elements == cfg.block_v
    assert _kl.gpu_launches(8192, v, torch.bfloat16)[0].grid == (8192, 1, 1)
    # The bf16 word-pair loads need an even row stride and a 4-byte aligned base.
    assert _k._bf16_pairs(torch.bfloat16, 212, 0) and not _k._bf16_pairs(torch.bfloat16, 211, 0)
    assert not _k._bf16_pairs(torch.bfloat16, 212, 2)
    assert not _k._bf16_pairs(torch.float16, 212, 0)


def test_triton_bf16_unaligned_view():
    """A bf16 view starting at an odd element (base 2 bytes off a 4-byte boundary) takes the
    plain loads; the result matches the reference."""
    from icqs_fast.backends import triton_backend

    g = torch.Generator().manual_seed(5)
    big = (torch.randn(3, 301, generator=g) * 3).to(torch.bfloat16)
    z = big[:, 1:]  # row stride 301 (odd) and base offset 2 bytes
    t = torch.tensor([0, 150, 299])
    compare(triton_backend.token_stats(z.to(DEVICE), t.to(DEVICE), block_v=64), *refs(z, t))


def test_deferred_checks_settle_in_one_host_copy():
    """What the GPU path defers instead of a host sync per op call (each sync drains the GPU
    queue): the target-range error and the float64 ``logprob_var`` fix are settled by
    ``to_host`` (one packed copy, here on CPU tensors), or by any read that resolves them
    (``map``, ``logprob_var``)."""
    z = torch.randn(5, 11)
    t = torch.tensor([1, 2, 3, 4, 5])

    def fresh():
        return ops.token_stats(z, t, backend="torch")

    base = fresh()
    rows = torch.tensor([False, True, False, False, True])
    s = fresh()
    s.defer_var_fix(rows, lambda idx: torch.full((len(idx),), 7.0, dtype=torch.float64))
    host, (extra,) = s.to_host_with([torch.arange(6).reshape(2, 3)])
    assert host.logprob_var.tolist() == pytest.approx(
        [7.0 if r else v for r, v in zip(rows.tolist(), base.logprob_var.tolist(),
                                            strict=True)])
    assert extra.tolist() == [[0, 1, 2], [3, 4, 5]]
    for name in ("logprob", "entropy", "is_greedy", "target_rank", "valid"):
        got = getattr(host, name)
        assert got.dtype == getattr(base, name).dtype and torch.equal(got, getattr(base, name))
    s = fresh()
    s.defer_var_fix(rows, lambda idx: torch.full((len(idx),), 7.0, dtype=torch.float64))
    assert s.logprob_var[1] == 7.0  # a plain read resolves it
    s = fresh()
    s.defer_error(rows, t * 10, "targets[{i}] = {value} is outside")
    with pytest.raises(ValueError, match=r"targets\[1\] = 20 is outside"):
        s.to_host(("logprob",))
    s = fresh()
    s.defer_error(rows, t * 10, "targets[{i}] = {value} is outside")
    with pytest.raises(ValueError, match=r"targets\[1\]"):
        s.map(lambda x: x)
    s = fresh()
    s.defer_error(torch.zeros(5, dtype=torch.bool), t, "never")
    assert s.to_host(("logprob",)).logprob.shape == (5,)
