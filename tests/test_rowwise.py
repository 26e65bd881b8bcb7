"""``ops.rms_norm``, ``ops.add_rms_norm`` and ``ops.silu_mul`` (the bf16-products forward's
one-pass row-wise work): the C++ passes against the float64 reference on awkward shapes, their
error bounded by torch's own fp32 error on the same input; each row's bits alone equal to its
bits among others, at 1 and 2 threads and every ISA level; bad arguments refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import isa_param, isa_runs
from tolerance import assert_within_torch_error

from icqs_fast import ops
from icqs_fast.backends import cpp_backend

pytestmark = pytest.mark.skipif(not cpp_backend.available()[0], reason="needs icqs_fast._C")

# The kernels' 4-, 8- and 16-lane builds.
ISAS = ("sse4", "avx2", "avx512")


def _rows(g: torch.Generator, r: int, d: int) -> torch.Tensor:
    """``[r, d]`` fp32 rows of scales 1e-3 to 1e3 (a norm's input spans them)."""
    scale = torch.logspace(-3, 3, max(r, 1), dtype=torch.float64)[:r, None]
    return (torch.randn(r, d, generator=g, dtype=torch.float64) * scale).float()


@pytest.mark.parametrize("d", [1, 15, 16, 17, 576, 1000])
def test_rms_norm_against_float64(d):
    g = torch.Generator().manual_seed(d)
    x, w = _rows(g, 37, d), torch.randn(d, generator=g)
    got = ops.rms_norm(x, w, 1e-5, backend="cpp")
    ref = ops.rms_norm(x.double(), w.double(), 1e-5, backend="torch")
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert_within_torch_error(got, ref, F.rms_norm(x, (d,), w, 1e-5), name=f"rms_norm D={d}")
    # The torch backend in fp32 is the float64 value rounded once.
    assert torch.equal(ops.rms_norm(x, w, 1e-5, backend="torch"), ref.float())
    # In bf16 (a bf16-products linear's input): the fp32 norm rounded to nearest even.
    for backend, fp32 in (("cpp", got), ("torch", ref.float())):
        b16 = ops.rms_norm(x, w, 1e-5, out_dtype=torch.bfloat16, backend=backend)
        assert b16.dtype == torch.bfloat16 and torch.equal(b16, fp32.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype must be x's dtype"):
        ops.rms_norm(x, w, 1e-5, out_dtype=torch.float16)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("d", [1, 17, 576])
def test_add_rms_norm_is_the_add_then_the_norm(isa, d, monkeypatch):
    """``add_rms_norm`` (a layer's residual add and the next norm, one pass) gives the bits of
    torch's ``residual + x`` and of ``rms_norm`` of that sum, for strided rows too; the torch
    backend is the same add, then the float64 norm."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    g = torch.Generator().manual_seed(d)
    x, w = _rows(g, 37, d), torch.randn(d, generator=g)
    r = _rows(g, 37, d + 2)[:, 2:]  # strided rows
    total, out = ops.add_rms_norm(x, r, w, 1e-5, backend="cpp")
    assert torch.equal(total, r + x) and total.is_contiguous() and out.is_contiguous()
    assert torch.equal(out, ops.rms_norm(r + x, w, 1e-5, backend="cpp"))
    t_ref, o_ref = ops.add_rms_norm(x, r, w, 1e-5, backend="torch")
    assert torch.equal(t_ref, total)
    assert torch.equal(o_ref, ops.rms_norm(total, w, 1e-5, backend="torch"))
    with pytest.raises(ValueError, match="x and residual must match"):
        ops.add_rms_norm(x, r[:3], w, 1e-5)
    # The normed rows in bf16 (a bf16-products linear's input): the fp32 norm rounded to
    # nearest even, the sum unchanged, on both backends.
    for backend in ("cpp", "torch"):
        t16, o16 = ops.add_rms_norm(x, r, w, 1e-5, normed_dtype=torch.bfloat16, backend=backend)
        want = out if backend == "cpp" else o_ref
        assert torch.equal(t16, total) and o16.dtype == torch.bfloat16
        assert torch.equal(o16, want.to(torch.bfloat16)), backend
    for bad in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match="normed_dtype must be x's dtype"):
            ops.add_rms_norm(x, r, w, 1e-5, normed_dtype=bad)


@pytest.mark.parametrize("n", [1, 7, 16, 33, 1536])
def test_silu_mul_against_float64(n):
    g = torch.Generator().manual_seed(n)
    gate, up = torch.randn(29, n, generator=g) * 8, torch.randn(29, n, generator=g)
    got = ops.silu_mul(gate, up, backend="cpp")
    ref = ops.silu_mul(gate.double(), up.double(), backend="torch")
    assert got.dtype == torch.float32 and got.shape == gate.shape
    assert_within_torch_error(got, ref, F.silu(gate) * up, name=f"silu_mul N={n}")


def test_silu_mul_special_values():
    """inf, NaN and gates far past e^-87 (where the kernels' e^x is 0) as torch gives them,
    up to the subnormal that torch keeps at -88."""
    gate = torch.tensor([[-float("inf"), -1e4, -100.0, -88.0, -87.0, -20.0, -1e-30, -0.0, 0.0,
                          1e-30, 20.0, 88.0, 1e4, float("inf"), float("nan")]])
    up = torch.ones_like(gate)
    got, want = ops.silu_mul(gate, up, backend="cpp"), F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.allclose(got[keep], want[keep], rtol=1e-6, atol=1e-36)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_alone_has_its_bits_among_others(isa, threads, monkeypatch):
    """Each row computed alone, or inside a batch of 1-300 rows at another offset, gives the
    same bits: the norm's sum runs in one order per row whatever the call."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    g = torch.Generator().manual_seed(5)
    x, w = _rows(g, 300, 576), torch.randn(576, generator=g)
    gate, up = torch.randn(300, 1536, generator=g) * 4, torch.randn(300, 1536, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        norm_all, silu_all = ops.rms_norm(x, w, 1e-6), ops.silu_mul(gate, up)
        for i, j in [(0, 1), (7, 8), (299, 300), (3, 67), (100, 300)]:
            assert torch.equal(ops.rms_norm(x[i:j].clone(), w, 1e-6), norm_all[i:j])
            assert torch.equal(ops.silu_mul(gate[i:j].clone(), up[i:j].clone()), silu_all[i:j])
    finally:
        torch.set_num_threads(before)


def test_the_norm_bits_do_not_depend_on_the_isa(monkeypatch):
    """16 partial sums and no fused multiply-add on every level: one set of bits."""
    g = torch.Generator().manual_seed(9)
    x, w = _rows(g, 50, 577), torch.randn(577, generator=g)
    outs = []
    for isa in filter(isa_runs, ISAS):
        monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
        outs.append(ops.rms_norm(x, w, 1e-5))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_strided_and_batched_inputs():
    """A 3-D input, rows of a wider buffer and a transposed gate: the same values as the
    contiguous rows."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 6, 40, generator=g)
    x, w = wide[..., 3:35], torch.randn(32, generator=g)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), ops.rms_norm(x.contiguous(), w, 1e-5))
    gate = torch.randn(24, 10, generator=g).t()  # unit stride along the rows, not the columns
    up = torch.randn(10, 24, generator=g)
    assert torch.equal(ops.silu_mul(gate, up), ops.silu_mul(gate.contiguous(), up))
    assert ops.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-5).shape == (0, 8)


def test_bad_arguments_are_refused():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(TypeError, match="weight is torch.float64"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="gate and up must match"):
        ops.silu_mul(x, torch.randn(3, 9))
    with pytest.raises(TypeError, match="takes float32 inputs, got bfloat16"):
        ops.rms_norm(x.bfloat16(), torch.ones(8, dtype=torch.bfloat16), 1e-5, backend="cpp")
