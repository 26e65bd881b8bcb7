"""The cpp backend of ``ops.attention_lse`` (``csrc/attention.cpp``) against a float64 dense
reference: awkward shapes (one key, all-masked rows, odd head sizes, another value head size,
GQA), the variants the cascade passes it (soft cap, sliding window, chunks, token positions with
padded keys), every ISA level this CPU runs (forced through ``ICQS_FAST_CPP_ISA``; ``auto``
reaches the AMX tiles), fp32 and bf16 (AMX, AVX512_BF16 dot products and the widened fp32
path), thread-count invariance, and the cascade's forced-path switch."""

import math

import pytest
import torch
from _helpers import (
    ISAS,
    attention_lse64,
    attention_within_torch_error,
    cascade_paths_agree,
    isa_param,
    variant_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from icqs_fast import ops
from icqs_fast.backends import cpp_backend

pytestmark = pytest.mark.skipif(not cpp_backend.available()[0],
                                reason=f"cpp backend unavailable: {cpp_backend.available()[1]}")


def _level(name):
    from icqs_fast import _C

    return _C.best_isa() if name == "auto" else cpp_backend.ISA_LEVELS[name]


def _inputs(b, hq, hk, tq, tk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, tq, d, generator=g).to(dtype)
    k = (torch.randn(b, hk, tk, d, generator=g) * 1.5).to(dtype)
    v = torch.randn(b, hk, tk, dv, generator=g).to(dtype)
    return q, k, v


def _check(q, k, v, ref_kv=None, **kw):
    """The cpp backend's ``(out, lse)`` within the rule of tests/tolerance.py (16-bit inputs:
    judged by the same code with bf16 probabilities in the PV product and a 16-bit output)."""
    out, lse = ops.attention_lse(q, k, v, backend="cpp", **kw)
    ref_k, ref_v = ref_kv or (k, v)
    _, rl = attention_lse64(q, ref_k, ref_v, **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    dead = ~torch.isfinite(rl)
    assert torch.equal(dead, lse == -math.inf), "rows with no allowed key: lse -inf exactly"
    assert torch.all(out[dead] == 0), "rows with no allowed key: output 0"
    attention_within_torch_error(out, lse, q, ref_k, ref_v, **kw)
    return out, lse


# (b, hq, hk, tq, tk, d, dv), options
CASES = {
    "one_key": ((1, 2, 1, 1, 1, 16, 16), {"causal": True}),
    "one_key_many_queries": ((2, 2, 2, 5, 1, 8, 8), {}),
    "odd_d80_gqa": ((2, 6, 2, 9, 70, 80, 80), {"causal": True}),
    "d96_value_dim": ((1, 4, 1, 33, 129, 96, 40), {"causal": True}),
    "d100_softcap": ((2, 2, 1, 17, 65, 100, 100), {"softcap": 5.0}),
    "d3_dv5": ((1, 1, 1, 4, 7, 3, 5), {"causal": True}),
    "padded_keys": ((3, 4, 2, 6, 90, 64, 64), {"mask": True}),
    "window": ((2, 4, 2, 40, 150, 32, 32), {"causal": True, "window": 13}),
    "chunk": ((2, 2, 1, 50, 120, 24, 24), {"causal": True, "chunk": 16}),
    "positions_gqa_window": ((2, 4, 2, 20, 100, 64, 48),
                             {"causal": True, "window": 30, "positions": True}),
}


def _options(b, tq, tk, opts, seed=1):
    kw = {k: x for k, x in opts.items() if k not in ("mask", "positions")}
    g = torch.Generator().manual_seed(seed)
    if opts.get("mask"):
        am = torch.rand(b, tk, generator=g) > 0.4
        am[0] = False  # a row of all-masked keys: every query of it has none
        kw["attention_mask"] = am
    if opts.get("positions"):  # a bank's layout: prefixes of different lengths, padded slots
        lens = torch.tensor([tk - 7 * i for i in range(b)])
        j = torch.arange(tk)
        kp = torch.where(j[None] < lens[:, None], j[None] + 2, -1)
        qp = lens[:, None] + 2 + torch.arange(tq)[None] - tq
        kw["positions"] = (qp, kp)
    return kw


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, dtype, isa, monkeypatch):
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    (b, hq, hk, tq, tk, d, dv), opts = CASES[case]
    q, k, v = _inputs(b, hq, hk, tq, tk, d, dv, dtype)
    _check(q, k, v, scale=d ** -0.5, **_options(b, tq, tk, opts))


@pytest.mark.parametrize("bf16_dot", [True, False])
def test_bf16_paths_and_fp16(bf16_dot, monkeypatch):
    """bf16 on the AVX512_BF16 dot products and widened to fp32 (as on CPUs without them); fp16
    inputs are widened."""
    monkeypatch.setattr(cpp_backend, "BF16_DOT", bf16_dot)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _inputs(2, 4, 2, 37, 200, 72, 72, dtype, seed=5)
        _check(q, k, v, scale=0.1, causal=True, softcap=20.0)


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("d", [80, 64])  # 64: whole AMX tiles (auto on an AMX CPU)
def test_bf16_products_of_fp32_inputs(isa, bf16_dot, d, monkeypatch):
    """``dot_dtype=bfloat16`` (mixed precision): fp32 q/k/v enter both products rounded to
    bf16, on every ISA level and with or without the AVX512_BF16 dot products; the output stays
    fp32 and matches the float64 attention of the rounded inputs; a row's result does not
    depend on the other rows of the call (thread split, batch neighbours)."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    monkeypatch.setattr(cpp_backend, "BF16_DOT", bf16_dot)
    q, k, v = _inputs(2, 4, 2, 21, 150, d, 48, torch.float32, seed=9)
    am = torch.ones(2, 150, dtype=torch.bool)
    am[1, 120:] = False
    kw = {"scale": 0.1, "causal": True, "attention_mask": am}
    out, lse = ops.attention_lse(q, k, v, dot_dtype=torch.bfloat16, backend="cpp", **kw)
    assert out.dtype == torch.float32
    rq, rk, rv = (x.to(torch.bfloat16).float() for x in (q, k, v))
    # The bf16 dot-product path (AVX-512 with AVX512_BF16) rounds the probabilities to bf16
    # for the PV product, the widened path keeps them fp32 (on an AVX-512 CPU without
    # AVX512_BF16 the bf16 yardstick is merely looser).
    rounds_p = bf16_dot and _level(isa) == 2
    attention_within_torch_error(out, lse, rq, rk, rv,
                                 pv_dtype=torch.bfloat16 if rounds_p else None, **kw)
    plain, _ = ops.attention_lse(q, k, v, backend="cpp", **kw)
    assert not torch.equal(out, plain), "the products were not rounded"
    alone, lse1 = ops.attention_lse(q[1:], k[1:], v[1:], dot_dtype=torch.bfloat16,
                                    backend="cpp", scale=0.1, causal=True,
                                    attention_mask=am[1:])
    assert torch.equal(alone, out[1:]) and torch.equal(lse1, lse[1:])


def test_all_masked_rows_and_nan_in_padded_slots():
    """Queries whose keys are all masked get lse -inf and output 0 exactly; a NaN in a masked
    key or value slot (an unused bank slot) never reaches the output."""
    q, k, v = _inputs(2, 2, 1, 4, 10, 16, 16, torch.float32)
    am = torch.ones(2, 10, dtype=torch.bool)
    am[0] = False
    am[1, 6:] = False
    k[1, :, 6:] = float("nan")
    v[1, :, 7] = float("nan")
    clean = (k.nan_to_num(), v.nan_to_num())  # the reference's matmul would spread the NaN
    out, lse = _check(q, k, v, ref_kv=clean, scale=0.25, attention_mask=am)
    assert torch.all(lse[0] == -math.inf) and torch.isfinite(lse[1]).all()
    assert torch.isfinite(out).all()
    # causal with Tq > visible keys: the first queries of a causal row see only padded slots
    am2 = torch.zeros(1, 10, dtype=torch.bool)
    am2[0, 3:] = True
    q1, k1, v1 = _inputs(1, 1, 1, 10, 10, 8, 8, torch.float32)
    out, lse = _check(q1, k1, v1, scale=0.3, causal=True, attention_mask=am2)
    assert torch.all(lse[0, 0, :3] == -math.inf) and torch.all(out[0, 0, :3] == 0)


def test_strided_inputs_and_thread_invariance():
    """Non-contiguous q/k/v (a transposed layout, as transformers' projections give) read in
    place; 1 and 2 threads give bit-identical results (each row's arithmetic does not depend on
    how rows are split over threads)."""
    q, k, v = _inputs(2, 4, 2, 45, 130, 40, 40, torch.float32)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qs.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, l1 = ops.attention_lse(qs, ks, vs, scale=0.2, causal=True, backend="cpp")
        torch.set_num_threads(2)
        o2, l2 = ops.attention_lse(qs, ks, vs, scale=0.2, causal=True, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    _check(qs, ks, vs, scale=0.2, causal=True)


def test_output_is_token_major():
    """The output is written as ``[B, Tq, Hq, Dv]`` (returned transposed), so the model's next
    step, ``out.transpose(1, 2).contiguous()``, is a view: the same values as a contiguous
    output, without the copy a forward spent once per layer."""
    q, k, v = _inputs(3, 6, 2, 37, 50, 32, 24, torch.float32)
    out, lse = _check(q, k, v, scale=0.3, causal=True)
    moved = out.transpose(1, 2)
    assert moved.is_contiguous() and moved.contiguous().data_ptr() == moved.data_ptr()
    ref = torch.empty(out.shape).copy_(out)  # contiguous
    assert torch.equal(ref.transpose(1, 2).contiguous(), moved.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_keys(dtype):
    """Thousands of keys (a long demonstration prefix), padded, GQA, causal (0.1 s)."""
    q, k, v = _inputs(2, 4, 2, 70, 3000, 64, 64, dtype, seed=7)
    am = torch.ones(2, 3000, dtype=torch.bool)
    am[1, 2500:] = False
    _check(q, k, v, scale=0.125, causal=True, attention_mask=am)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_property_random_layouts(data):
    """Random shapes and variants (fp32, the CPU's best ISA) match the float64 reference."""
    hk = data.draw(st.integers(1, 2))
    hq = hk * data.draw(st.integers(1, 3))
    tk = data.draw(st.integers(1, 150))
    causal = data.draw(st.booleans())
    tq = data.draw(st.integers(1, tk if causal else 80))
    d = data.draw(st.integers(1, 70))
    dv = data.draw(st.sampled_from([d, data.draw(st.integers(1, 40))]))
    b = data.draw(st.integers(1, 2))
    q, k, v = _inputs(b, hq, hk, tq, tk, d, dv, torch.float32,
                      seed=data.draw(st.integers(0, 99)))
    kw = {"scale": data.draw(st.floats(0.05, 1.0)), "causal": causal}
    if data.draw(st.booleans()):
        kw["attention_mask"] = torch.rand(b, tk) > data.draw(st.floats(0.0, 0.9))
    variant = data.draw(st.sampled_from(["none", "softcap", "window", "chunk"]))
    if variant == "softcap":
        kw["softcap"] = data.draw(st.floats(0.5, 30.0))
    elif variant != "none":
        kw[variant] = data.draw(st.integers(1, 40))
    _check(q, k, v, **kw)


def test_argument_errors():
    q, k, v = _inputs(1, 2, 1, 3, 5, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        ops.attention_lse(q, k, v, window=0, backend="cpp")
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        ops.attention_lse(q, k, v, chunk=2.5, backend="cpp")
    with pytest.raises(ValueError, match=r"positions must be \(q_pos \[1, 3\], k_pos \[1, 5\]\)"):
        ops.attention_lse(q, k, v, positions=(torch.zeros(1, 3), torch.zeros(1, 5)),
                          backend="cpp")
    with pytest.raises(ValueError, match="dot_dtype must be torch.bfloat16 or None"):
        ops.attention_lse(q, k, v, dot_dtype=torch.float16, backend="cpp")
    with pytest.raises(ValueError, match="needs cpu tensors|does not"):
        ops.attention_lse(q.to("meta"), k.to("meta"), v.to("meta"), backend="cpp")


def test_cascade_attention_switch(monkeypatch):
    """ICQS_FAST_CASCADE_ATTENTION picks cascade attention's path: auto (cpp on the CPU), torch
    (the torch path, for side-by-side timings), a backend named; a bad value is an error that
    names the variable."""
    from icqs_fast.engine import cascade

    cpu = torch.device("cpu")
    for value, want in (("", "cpp"), ("auto", "cpp"), ("torch", None), ("cpp", "cpp")):
        monkeypatch.setenv(cascade.ATTENTION_ENV, value)
        assert cascade._kernel_backend(cpu, torch.bfloat16, None, False) == want
    monkeypatch.setenv(cascade.ATTENTION_ENV, "auto")
    # bf16 products of fp32 activations (a bf16 bank): the cpp kernel has them.
    assert cascade._kernel_backend(cpu, torch.float32, None, False, None, True) == "cpp"
    monkeypatch.setenv(cascade.ATTENTION_ENV, "magic")
    with pytest.raises(ValueError, match="ICQS_FAST_CASCADE_ATTENTION=magic: unknown backend"):
        cascade._kernel_backend(cpu, torch.float32, None, False)


def test_bank_forwards_take_the_kernel(monkeypatch):
    """Prefix-bank and KV-copy forwards of a model that can switch its attention run through the
    kernel (positions, no masks) unless the switch says torch; the model's implementation is
    left as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from icqs_fast.engine import cascade

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    model = LlamaForCausalLM(cfg)
    before = model.config._attn_implementation
    assert cascade.positional_kernel(model, "cpu")
    assert model.config._attn_implementation == before
    monkeypatch.setenv(cascade.ATTENTION_ENV, "torch")
    assert not cascade.positional_kernel(model, "cpu")


@pytest.mark.parametrize("kind", ["softcap", "window"])
def test_cascade_kernel_equals_torch_path(kind, monkeypatch):
    """Suffix hidden states through the kernel (bank forwards and cascade attention) equal those
    of the torch path (ICQS_FAST_CASCADE_ATTENTION=torch) on a Gemma 2-shaped model with a strong
    score soft cap (1.0, so a dropped cap would show) or a short sliding window, GQA, prefixes
    of different lengths."""
    model, cfg = variant_model(kind)
    cascade_paths_agree(model, cfg, monkeypatch, "auto")


def test_bf16_products_rule():
    """Cascade attention asks for bf16 products exactly in mixed precision: fp32 activations
    with the layer's weights, or the bank, in bf16."""
    from icqs_fast.engine.cascade import bf16_products

    bf, f32 = torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4)
    assert bf16_products(bf, torch.float32) == torch.bfloat16
    assert bf16_products(f32, torch.float32) is None
    assert bf16_products(f32, torch.float32, torch.bfloat16) == torch.bfloat16
    assert bf16_products(bf, torch.bfloat16) is None
    assert bf16_products(torch.nn.Identity(), torch.float32) is None


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("dot", [None, torch.bfloat16])
def test_rows_do_not_depend_on_the_rows_beside_them(isa, dot, monkeypatch):
    """A query block computes only the register tiles holding its rows (a short suffix leaves
    most of a 32-row block empty): each row's output and LSE are bit for bit those of the same
    row inside a longer call, for every row count around the tile and block sizes (1-4, 5, 31-33,
    63-65 rows of one key head; non-causal, so key visibility does not depend on Tq)."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    q, k, v = _inputs(2, 1, 1, 65, 70, 64, 64, torch.float32, seed=3)
    full_o, full_l = ops.attention_lse(q, k, v, backend="cpp", dot_dtype=dot)
    for n in (1, 2, 3, 4, 5, 31, 32, 33, 63, 64):
        o, lse = ops.attention_lse(q[:, :, :n], k, v, backend="cpp", dot_dtype=dot)
        assert torch.equal(o, full_o[:, :, :n]), n
        assert torch.equal(lse, full_l[:, :, :n]), n


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("window", [None, 9])
def test_causal_rows_do_not_depend_on_the_rows_beside_them(isa, window, monkeypatch):
    """Causal GQA on token positions, padded key slots at the end of a row (a short suffix): the
    kernel computes a key block only up to the last key some row of its query block may see,
    and a query block holds one query head's rows (or several heads' where a head has fewer
    rows than a block); none of it may change a row's arithmetic.
    Each row's output and LSE are bit for bit those of the same row (same position) inside a
    longer call, for row counts around the tile, block and head sizes; and they match the
    float64 reference."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    tq, tk = 70, 83
    q, k, v = _inputs(2, 3, 1, tq, tk, 64, 48, torch.float32, seed=11)
    j = torch.arange(tk)
    lens = torch.tensor([tk - 9, 61])
    kp = torch.where(j[None] < lens[:, None], j[None], -1)
    qp = (torch.arange(tq)[None] + torch.tensor([[tk - 9 - tq], [61 - tq]])).clamp(min=0)
    kw = {"scale": 0.125, "causal": True, "window": window}
    full_o, full_l = _check(q, k, v, positions=(qp, kp), **kw)
    for n in (1, 3, 4, 5, 17, 31, 32, 33, 47, 64, 69):
        o, lse = ops.attention_lse(q[:, :, :n], k, v, backend="cpp", positions=(qp[:, :n], kp),
                                   **kw)
        assert torch.equal(o, full_o[:, :, :n]), n
        assert torch.equal(lse, full_l[:, :, :n]), n


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("dot", [None, torch.bfloat16])
def test_shared_keys_read_in_place_are_the_gathered_keys(isa, dot, monkeypatch):
    """``key_batch`` (the one-pass cascade's prefix part: each row against its entry's keys):
    the bits of the same call on the gathered keys, values, mask and key positions, with a
    returned state, at 1 and 2 threads; runs of rows sharing keys long and short, and rows
    out of entry order. Bad key batches are refused."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    q, _, _ = _inputs(12, 6, 2, 21, 5, 64, 64, torch.float32, seed=5)
    _, k, v = _inputs(3, 6, 2, 21, 130, 64, 64, torch.float32, seed=6)
    kb = torch.tensor([0, 0, 0, 0, 0, 2, 2, 1, 0, 1, 1, 1])
    kpos = torch.arange(130).expand(3, 130).clone()
    kpos[1, 100:] = -1
    qpos = 130 + torch.arange(21).expand(12, 21)
    mask = torch.ones(3, 130, dtype=torch.bool)
    mask[2, 7] = False
    kw = {"scale": 0.125, "causal": True, "backend": "cpp", "dot_dtype": dot}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            o, lse = ops.attention_lse(q, k, v, positions=(qpos, kpos), attention_mask=mask,
                                       key_batch=kb, **kw)
            wo, wl = ops.attention_lse(q, k[kb], v[kb], positions=(qpos, kpos[kb]),
                                       attention_mask=mask[kb], **kw)
            assert torch.equal(o, wo) and torch.equal(lse, wl), threads
            st, _ = ops.attention_lse(q, k[:, :, :64], v[:, :, :64], return_state=True,
                                      positions=(qpos, kpos[:, :64]), key_batch=kb, **kw)
            ws, _ = ops.attention_lse(q, k[kb, :, :64], v[kb, :, :64], return_state=True,
                                      positions=(qpos, kpos[kb, :64]), **kw)
            assert torch.equal(st, ws), threads
    finally:
        torch.set_num_threads(before)
    ref_o, ref_l = ops.attention_lse(q, k, v, positions=(qpos, kpos), attention_mask=mask,
                                     key_batch=kb, scale=0.125, causal=True, backend="torch",
                                     dot_dtype=dot)
    tol = 3e-2 if dot is not None else 2e-4
    torch.testing.assert_close(o, ref_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_l, rtol=tol, atol=tol)
    for bad, why in ((torch.tensor([0, 3] * 6), r"key_batch values must be in \[0, 3\)"),
                     (torch.tensor([-1] * 12), r"key_batch values must be in \[0, 3\)"),
                     (kb[:5], r"key_batch must be a \[12\] integer tensor"),
                     (kb.float(), r"key_batch must be a \[12\] integer tensor")):
        with pytest.raises(ValueError, match=why):
            ops.attention_lse(q, k, v, key_batch=bad, backend="cpp")
    with pytest.raises(ValueError, match=r"k_pos \[3, 130\]\) integer tensors"):
        ops.attention_lse(q, k, v, key_batch=kb, positions=(qpos, kpos[kb]), backend="cpp")


@pytest.mark.parametrize("isa", [isa_param(n) for n in ISAS])
@pytest.mark.parametrize("dot", [None, torch.bfloat16])
def test_a_bf16_output_is_the_fp32_one_rounded(isa, dot, monkeypatch):
    """``out_dtype=torch.bfloat16`` (the input a bf16-products output projection reads in
    place): the fp32 output rounded to nearest even, token-major like it, the LSE unchanged,
    with positions, GQA, shared keys and rows with no allowed key (output 0). Refused with a
    returned state or another dtype."""
    monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    q, _, _ = _inputs(4, 6, 2, 21, 5, 64, 64, torch.float32, seed=7)
    _, k, v = _inputs(2, 6, 2, 21, 90, 64, 64, torch.float32, seed=8)
    kb = torch.tensor([0, 1, 1, 0])
    kpos = torch.arange(90).expand(2, 90).clone()
    kpos[1] = -1  # batch 1: no key allowed
    qpos = 90 + torch.arange(21).expand(4, 21)
    kw = {"scale": 0.125, "causal": True, "backend": "cpp", "dot_dtype": dot,
          "positions": (qpos, kpos), "key_batch": kb}
    o32, l32 = ops.attention_lse(q, k, v, **kw)
    o16, l16 = ops.attention_lse(q, k, v, out_dtype=torch.bfloat16, **kw)
    assert o16.dtype == torch.bfloat16 and torch.equal(o16, o32.to(torch.bfloat16))
    assert o16.stride() == o32.stride() and torch.equal(l16, l32)
    assert torch.equal(o16[1], torch.zeros_like(o16[1]))
    ref, _ = ops.attention_lse(q, k, v, out_dtype=torch.bfloat16, **{**kw, "backend": "torch"})
    torch.testing.assert_close(o16.float(), ref.float(), rtol=3e-2, atol=3e-2)
    for bad in ({"out_dtype": torch.float16}, {"out_dtype": torch.bfloat16, "return_state": True}):
        with pytest.raises(ValueError, match="out_dtype must be q's dtype"):
            ops.attention_lse(q, k, v, **kw, **bad)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("dot", [None, torch.bfloat16])
def test_without_the_lse_the_output_is_the_same(backend, dot):
    """``with_lse=False`` (the cascade's last part, whose LSE nobody reads): the same output
    bits, fp32 and bf16, with a resumed state and rows with no allowed key; the LSE is None."""
    q, _, _ = _inputs(3, 6, 2, 13, 5, 64, 64, torch.float32, seed=11)
    _, k, v = _inputs(3, 6, 2, 13, 70, 64, 64, torch.float32, seed=12)
    kpos = torch.arange(70).expand(3, 70).clone()
    kpos[2] = -1
    kw = {"scale": 0.125, "causal": True, "backend": backend, "dot_dtype": dot,
          "positions": (70 + torch.arange(13).expand(3, 13), kpos)}
    for extra in ({}, {"out_dtype": torch.bfloat16}):
        out, lse = ops.attention_lse(q, k, v, **kw, **extra)
        alone, none = ops.attention_lse(q, k, v, with_lse=False, **kw, **extra)
        assert none is None and lse is not None and torch.equal(alone, out)
    if backend == "cpp":
        state, _ = ops.attention_lse(q, k[:, :, :64], v[:, :, :64], return_state=True,
                                     **{**kw, "positions": (kw["positions"][0], kpos[:, :64])})
        rest = {**kw, "positions": (kw["positions"][0], kpos[:, 64:]), "state": state}
        out, lse = ops.attention_lse(q, k[:, :, 64:], v[:, :, 64:], **rest)
        alone, none = ops.attention_lse(q, k[:, :, 64:], v[:, :, 64:], with_lse=False, **rest)
        assert none is None and torch.equal(alone, out)
