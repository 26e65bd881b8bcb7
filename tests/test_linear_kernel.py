"""The cpp backend of ``ops.linear`` (``csrc/linear.cpp``): every mode at every ISA level this
CPU runs (``auto`` reaches the AMX tiles), a row's bits independent of the rows beside it, the
result against a float64 reference of the same rounded terms (tests/tolerance.py's rule), and
the reuse of the previous call's bf16 terms (the q / k / v projections share their input):
only for the very same, unchanged input."""

import pytest
import torch
from tolerance import assert_within_torch_error

from icqs_fast import ops
from icqs_fast.backends import cpp_backend
from icqs_fast.types import PRODUCTS

pytestmark = pytest.mark.skipif(not cpp_backend.available()[0],
                                reason=f"cpp backend unavailable: {cpp_backend.available()[1]}")

ISAS = ("sse4", "avx2", "avx512", "auto")


def _isa(name):
    from icqs_fast import _C

    runs = cpp_backend.available()[0] and (
        name == "auto" or cpp_backend.ISA_LEVELS[name] <= _C.best_isa())
    return pytest.param(name, id=name, marks=pytest.mark.skipif(not runs,
                                                                reason=f"CPU lacks {name}"))


def _terms(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x as n bf16 terms, each the rounding of what the previous ones left (the kernel's split)."""
    out, rest = [], x.clone()
    for _ in range(n):
        t = rest.to(torch.bfloat16).float()
        out.append(t)
        rest = rest - t
    return out


@pytest.mark.parametrize("isa", [_isa(n) for n in ISAS])
@pytest.mark.parametrize("products", PRODUCTS)
def test_rows_alone_equal_rows_in_a_batch_and_match_float64(isa, products, monkeypatch):
    """Awkward K (not a multiple of 32) and N (not of 32); row counts around the kernels'
    tiles (12, 32) and tasks (96). Each row is the same bits alone and inside any batch."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    g = torch.Generator().manual_seed(7)
    k, n = 83, 45
    x = torch.randn(130, k, generator=g) * 3
    w = torch.randn(n, k, generator=g)
    packed = ops.pack_linear(w, products, backend="cpp")
    full = ops.linear(x, packed)
    for m in (1, 2, 11, 13, 31, 33, 97):
        assert torch.equal(ops.linear(x[:m], packed), full[:m]), m
        assert torch.equal(ops.linear(x[m:m + 1], packed), full[m:m + 1]), m
    wq = w if products == "fp32" else w.to(torch.bfloat16).float()
    xq = x if products == "fp32" else sum(_terms(x, PRODUCTS.index(products)))
    ref = xq.double() @ wq.double().T
    assert_within_torch_error(full, ref, xq @ wq.T, name=f"{products}/{isa}")


@pytest.mark.parametrize("products", ["bf16", "bf16x3"])
def test_reused_terms_only_for_the_same_unchanged_input(products):
    """Two products of one input in a row reuse its bf16 terms; the results are those of a
    fresh input. A changed input (in place: its version moves), another tensor of the same
    shape, a view of another shape, and the same memory at another row count are converted
    anew."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 64, generator=g)
    wa, wb = torch.randn(40, 64, generator=g), torch.randn(24, 64, generator=g)
    pa, pb = (ops.pack_linear(w, products, backend="cpp") for w in (wa, wb))

    def fresh(t: torch.Tensor, p) -> torch.Tensor:
        ops.linear(torch.zeros(3, 64), pa)  # another input in between: nothing to reuse
        return ops.linear(t.clone(), p)

    ops.linear(x, pa)
    assert torch.equal(ops.linear(x, pb), fresh(x, pb))  # reused
    ops.linear(x, pa)
    x.mul_(-2.0)  # in place, same memory
    assert torch.equal(ops.linear(x, pb), fresh(x, pb))
    y = torch.randn(70, 64, generator=g)
    ops.linear(x, pa)
    assert torch.equal(ops.linear(y, pb), fresh(y, pb))
    ops.linear(x, pa)
    assert torch.equal(ops.linear(x[:30], pb), fresh(x[:30], pb))  # same pointer, fewer rows
    ops.linear(x, pa)
    col = x[:, :32]  # same pointer, another K
    w32 = torch.randn(8, 32, generator=g)
    p32 = ops.pack_linear(w32, products, backend="cpp")
    assert torch.equal(ops.linear(col, p32), fresh(col, p32))
