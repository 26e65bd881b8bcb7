"""The cpp backend of ``ops.linear`` (``csrc/linear.cpp``): every mode at every ISA level this
CPU runs (``auto`` reaches the AMX tiles), a row's bits independent of the rows beside it, the
result against a float64 reference of the same rounded terms (tests/tolerance.py's rule), and
the reuse of the previous call's bf16 terms (the q / k / v projections share their input):
only for the very same, unchanged input."""

import pytest
import torch
from _helpers import ISAS, isa_param
from tolerance import assert_within_torch_error

from icqs_fast import ops
from icqs_fast.backends import cpp_backend
from icqs_fast.types import PRODUCTS

pytestmark = pytest.mark.skipif(not cpp_backend.available()[0],
                                reason=f"cpp backend unavailable: {cpp_backend.available()[1]}")


def _terms(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """x as n bf16 terms, each the rounding of what the previous ones left (the kernel's split)."""
    out, rest = [], x.clone()
    for _ in range(n):
        t = rest.to(torch.bfloat16).float()
        out.append(t)
        rest = rest - t
    return out


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
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


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("products", PRODUCTS)
def test_the_gated_product_is_silu_mul_of_the_two(isa, products, monkeypatch):
    """``linear(x, g, up=u)`` (the MLP's gate and up projections in one call) gives the bits of
    ``silu_mul(linear(x, g), linear(x, u))`` at every row count (around the tiles and tasks),
    alone or in a batch, at 1 and 2 threads; within torch's error of the float64 product."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(12)
    k, n = 83, 300  # N over a task's 256 columns, not a multiple of 32
    x = torch.randn(130, k, generator=gen)
    wg, wu = (torch.randn(n, k, generator=gen) for _ in range(2))
    g, u = (ops.pack_linear(w, products, backend="cpp") for w in (wg, wu))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = ops.linear(x, g, up=u)
            assert torch.equal(full, ops.silu_mul(ops.linear(x, g), ops.linear(x, u)))
            for m in (1, 13, 33, 97):
                assert torch.equal(ops.linear(x[m:m + 1], g, up=u), full[m:m + 1]), m
                assert torch.equal(ops.linear(x[:m], g, up=u), full[:m]), m
    finally:
        torch.set_num_threads(before)
    ref = ops.linear(x.double(), ops.pack_linear(wg, products, backend="torch"),
                     up=ops.pack_linear(wu, products, backend="torch")).double()
    xq = x if products == "fp32" else sum(_terms(x, PRODUCTS.index(products)))
    wgq, wuq = ((w if products == "fp32" else w.to(torch.bfloat16).float()) for w in (wg, wu))
    same = torch.nn.functional.silu(xq @ wgq.T) * (xq @ wuq.T)
    assert_within_torch_error(full, ref, same, name=f"gated {products}/{isa}")


def test_a_gated_product_needs_two_weights_packed_alike():
    g = torch.Generator().manual_seed(1)
    a = ops.pack_linear(torch.randn(8, 16, generator=g), "bf16", backend="cpp")
    x = torch.randn(3, 16, generator=g)
    for other in (ops.pack_linear(torch.randn(9, 16, generator=g), "bf16", backend="cpp"),
                  ops.pack_linear(torch.randn(8, 16, generator=g), "fp32", backend="cpp")):
        with pytest.raises(ValueError, match="up must be packed like the weight"):
            ops.linear(x, a, up=other)
    with pytest.raises(ValueError, match="no bias"):
        ops.linear(x, a, torch.zeros(8), up=a)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("products", PRODUCTS)
def test_a_residual_is_added_last_with_the_bits_of_torchs_add(isa, products, monkeypatch):
    """``linear(x, w, b, residual=r)`` (a decoder layer's projection and its residual add in
    one call) gives the bits of ``r + linear(x, w, b)`` at every row count, alone or in a
    batch, at 1 and 2 threads, with a strided residual too."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(13)
    k, n = 70, 290
    x = torch.randn(2, 65, k, generator=gen)
    w = ops.pack_linear(torch.randn(n, k, generator=gen), products, backend="cpp")
    b = torch.randn(n, generator=gen)
    r = torch.randn(2, 65, n + 3, generator=gen)[..., 3:]  # rows 293 apart
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = ops.linear(x, w, b, residual=r)
            assert full.shape == (2, 65, n)
            assert torch.equal(full, r + ops.linear(x, w, b))
            assert torch.equal(ops.linear(x, w, residual=r), r + ops.linear(x, w))
            for m in (1, 13, 33):
                assert torch.equal(ops.linear(x[1, m:m + 1], w, b, residual=r[1, m:m + 1]),
                                   full[1, m:m + 1]), m
    finally:
        torch.set_num_threads(before)


def test_a_residual_must_fit_the_output():
    g = torch.Generator().manual_seed(2)
    a = ops.pack_linear(torch.randn(8, 16, generator=g), "bf16", backend="cpp")
    x = torch.randn(3, 16, generator=g)
    for bad in (torch.zeros(3, 9), torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"residual must be float32 \[3, 8\]"):
            ops.linear(x, a, residual=bad)
    with pytest.raises(ValueError, match="no residual"):
        ops.linear(x, a, up=a, residual=torch.zeros(3, 8))


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("k", [64, 83])
def test_a_bf16_input_of_bf16_products_is_its_own_term(isa, k, monkeypatch):
    """A bf16 ``x`` of bf16 products (the MLP's inputs the fused layer writes in bf16) gives
    the bits of its fp32 widening: read in place when K is a multiple of 32, the rows past the
    last whole block of 32 from a padded copy (row counts around it), copied otherwise; strided
    rows too, at 1 and 2 threads. The other products widen it first."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(130, k + 5, generator=gen) * 4).to(torch.bfloat16)
    w = torch.randn(300, k, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for products in PRODUCTS:
                p = ops.pack_linear(w, products, backend="cpp")
                for m in (1, 31, 32, 33, 97, 130):
                    for rows in (x[:m, :k].contiguous(), x[:m, :k]):
                        assert torch.equal(ops.linear(rows, p), ops.linear(rows.float(), p)), \
                            (products, m, rows.is_contiguous())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
def test_a_gated_bf16_output_is_the_fp32_one_rounded(isa, monkeypatch):
    """``out_dtype=torch.bfloat16`` (the down projection's input) gives the fp32 gated output
    rounded to nearest even, at 1 and 2 threads, alone and in a batch; it is refused without
    ``up``."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(97, 64, generator=gen)
    g, u = (ops.pack_linear(torch.randn(300, 64, generator=gen), "bf16", backend="cpp")
            for _ in range(2))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            want = ops.linear(x, g, up=u).to(torch.bfloat16)
            got = ops.linear(x, g, up=u, out_dtype=torch.bfloat16)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
            assert torch.equal(ops.linear(x[40:41], g, up=u, out_dtype=torch.bfloat16),
                               want[40:41])
    finally:
        torch.set_num_threads(before)
    wt = [ops.pack_linear(torch.randn(300, 64, generator=gen), "bf16", backend="torch")
          for _ in range(2)]
    ref = ops.linear(x, wt[0], up=wt[1], out_dtype=torch.bfloat16)
    assert torch.equal(ref, ops.linear(x, wt[0], up=wt[1]).to(torch.bfloat16))
    for bad in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match="out_dtype must be float32, or bfloat16 with up"):
            ops.linear(x, g, up=u, out_dtype=bad)
    with pytest.raises(ValueError, match="out_dtype must be float32, or bfloat16 with up"):
        ops.linear(x, g, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("products", PRODUCTS)
def test_a_rotary_epilogue_is_the_product_then_ops_rotary(isa, products, monkeypatch):
    """``linear(x, w, b, rotary=(cos, sin))`` (a query or key projection with its rotary
    embedding in the same pass) gives the bits of the product and then ``ops.rotary`` over its
    heads, with cos / sin per batch or broadcast, at 1 and 2 threads, a row alone or in a
    batch; within torch's error of the reference. Bad arguments are refused. Each forced
    level's epilogue, with head sizes in whole vectors (64) and in a scalar tail (8, for 8 and
    16 lanes), gives the bits of ``ops.rotary`` at the CPU's best level."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    gen = torch.Generator().manual_seed(31)
    b, t, k, n = 3, 37, 83, 576  # N over two tasks' columns
    x = torch.randn(b, t, k, generator=gen)
    w = ops.pack_linear(torch.randn(n, k, generator=gen), products, backend="cpp")
    bias = torch.randn(n, generator=gen)

    def then_rotary(out, c, s):
        d = c.shape[-1]
        heads = out.view(b, t, n // d, d).transpose(1, 2)
        with monkeypatch.context() as best:  # ops.rotary at the CPU's best level
            best.delenv(cpp_backend.ISA_ENV)
            return ops.rotary(heads, c, s).transpose(1, 2).reshape(b, t, n)

    before = torch.get_num_threads()
    try:
        for d in (8, 64):
            cos, sin = torch.randn(b, t, d, generator=gen), torch.randn(b, t, d, generator=gen)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                plain = ops.linear(x, w, bias)
                for c, s in ((cos[:1], sin[:1]), (cos, sin)):
                    got = ops.linear(x, w, bias, rotary=(c, s))
                    assert torch.equal(got, then_rotary(plain, c, s)), (d, threads, c.shape)
                one = ops.linear(x[1:2, 5:6], w, bias, rotary=(cos[1:2, 5:6], sin[1:2, 5:6]))
                assert torch.equal(one, got[1:2, 5:6])
    finally:
        torch.set_num_threads(before)
    wt = ops.pack_linear(ops.unpack_linear(w).float(), products, backend="torch")
    want = ops.linear(x, wt, bias, rotary=(cos, sin))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for bad in ((cos[:, :5], sin[:, :5]), (cos[..., :48], sin[..., :48]), (cos.double(), sin),
                (cos, sin[:1])):
        with pytest.raises(ValueError, match="rotary must be"):
            ops.linear(x, w, rotary=bad)
    with pytest.raises(ValueError, match="rotary must be"):
        ops.linear(x, w, residual=torch.zeros(b, t, n), rotary=(cos, sin))
