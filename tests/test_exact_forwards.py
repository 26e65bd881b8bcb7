"""The faster RMSNorm / gated-MLP forwards and rotary embedding
(:mod:`icqs_fast.exact_forwards`): the same bits as the modules' own forwards and transformers'
function, switched on only where a probe finds them equal, and left alone where
the input is not what the probe covered (another dtype, autograd). Every family of the model
matrix keeps its logits bit for bit (matrix tier), and so do its fused decoder layers (the
bf16-products form's residual adds folded into the passes after them)."""

from __future__ import annotations

import types

import pytest
import torch
from _helpers import ISAS, isa_param
from model_matrix import EXCLUDED, causal_lm_types, tiny_model

from icqs_fast import ops
from icqs_fast.backends import cpp_backend
from icqs_fast.exact_forwards import use_exact_forwards, uses_exact_forwards

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 320


def _ids(n: int = 2, t: int = 37) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(1))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_llama_switched_and_bit_identical():
    model = tiny_model("llama", VOCAB)
    ids = _ids()
    want = _logits(model, ids)
    counts = use_exact_forwards(model)
    layers = model.config.num_hidden_layers
    assert counts == {"rms_norm": 2 * layers + 1, "gated_mlp": layers, "kept": 0,
                      "rotary": layers, "decoder_layer": 0, "attention": 0}
    assert uses_exact_forwards(model.model.norm) and uses_exact_forwards(model.model.layers[0].mlp)
    assert torch.equal(_logits(model, ids), want)
    # Rows of very different scales, one token, a batch of one: still the same bits.
    for x in (_ids(1, 1), _ids(3, 5) % 7):
        fresh = tiny_model("llama", VOCAB)
        assert torch.equal(_logits(model, x), _logits(fresh, x))
    assert use_exact_forwards(model) == {"rms_norm": 0, "gated_mlp": 0, "kept": 0,
                                         "rotary": layers, "decoder_layer": 0, "attention": 0}


def test_a_norm_that_computes_otherwise_keeps_its_forward():
    model = tiny_model("llama", VOCAB)
    norm = model.model.norm

    def plus_one(self, x):  # Gemma's kind of norm: weight applied as 1 + w
        v = x.pow(2).mean(-1, keepdim=True)
        return (1.0 + self.weight) * (x * torch.rsqrt(v + self.variance_epsilon))

    cls = type("OffsetRMSNorm", (type(norm),), {"forward": plus_one})
    norm.__class__ = cls
    counts = use_exact_forwards(model)
    assert counts["kept"] == 1 and not uses_exact_forwards(norm)
    assert counts["rms_norm"] == 2 * model.config.num_hidden_layers


def test_a_call_with_more_arguments_takes_the_modules_own_forward():
    model = tiny_model("llama", VOCAB)
    norm = model.model.norm
    base = type(norm)

    def gated(self, x, gate=None):  # a gated norm (Mamba-2's kind): the gate is an argument
        out = base.forward(self, x)
        return out if gate is None else out * torch.sigmoid(gate)

    norm.__class__ = type("GatedRMSNorm", (base,), {"forward": gated})
    use_exact_forwards(model)
    assert uses_exact_forwards(norm)  # equal on the probe: the gate-free call
    x, g = torch.randn(2, 3, model.config.hidden_size), torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(norm(x, g), gated(norm, x, g))
        assert torch.equal(norm(x, gate=g), gated(norm, x, g))
        assert torch.equal(norm(x), gated(norm, x))


def test_hooks_on_the_gate_or_the_activation_see_what_they_saw():
    model = tiny_model("llama", VOCAB)
    use_exact_forwards(model)
    mlp = model.model.layers[0].mlp
    kept, acts = [], []
    h1 = mlp.gate_proj.register_forward_hook(lambda m, a, out: kept.append(out))
    h2 = mlp.act_fn.register_forward_hook(lambda m, a, out: acts.append(out))
    x = torch.randn(2, 3, model.config.hidden_size)
    with torch.no_grad():
        y = mlp(x)
        want = torch.nn.functional.linear(x, mlp.gate_proj.weight)
    h1.remove()
    h2.remove()
    assert len(kept) == 1 and torch.equal(kept[0], want)  # not overwritten by an in-place SiLU
    assert len(acts) == 1
    with torch.no_grad():
        assert torch.equal(y, type(mlp).forward(mlp, x))


def test_gemma_keeps_its_own_norm_and_mlp():
    model = tiny_model("gemma", VOCAB)
    ids = _ids()
    want = _logits(model, ids)
    counts = use_exact_forwards(model)
    assert counts["rms_norm"] == 0 and counts["gated_mlp"] == 0  # 1 + w, GELU
    assert torch.equal(_logits(model, ids), want)


def test_autograd_and_other_dtypes_take_the_modules_own_forward():
    model = tiny_model("llama", VOCAB)
    use_exact_forwards(model)
    mlp, norm = model.model.layers[0].mlp, model.model.norm
    x = torch.randn(3, model.config.hidden_size, requires_grad=True)
    y = mlp(x)  # grad on: no in-place SiLU on a tensor autograd needs
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    ref = type(mlp).forward(mlp, x.detach())
    assert torch.equal(y.detach(), ref)
    xb = torch.randn(3, model.config.hidden_size).bfloat16()
    with torch.no_grad():
        assert torch.equal(norm(xb), type(norm).forward(norm, xb))


def test_bf16_mixed_models_use_them(tiny_llama_dir):
    from icqs_fast import models

    mixed, _ = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-mixed", device="cpu")
    assert uses_exact_forwards(mixed.model.norm)
    assert all(uses_exact_forwards(layer.mlp) for layer in mixed.model.layers)
    fp32, _ = models.load_model(tiny_llama_dir(layers=2), dtype="float32", device="cpu")
    assert not uses_exact_forwards(fp32.model.norm)


@pytest.mark.skipif(not cpp_backend.available()[0], reason="needs icqs_fast._C")
def test_fused_forwards_are_one_pass_and_row_invariant(tiny_llama_dir):
    """``fused``: the probed modules take ops.rms_norm / ops.silu_mul (within fp32 rounding of
    the exact forwards, row by row), what a bf16-products model loads with (its packed gate and
    up projections as one gated product); other calls (another dtype, autograd) still take
    the module's own forward."""
    from icqs_fast import models

    model = tiny_model("llama", VOCAB)
    ids = _ids(3, 29)
    want = _logits(model, ids)
    layers = model.config.num_hidden_layers
    assert use_exact_forwards(model, fused=True) == {"rms_norm": 2 * layers + 1,
                                                     "gated_mlp": layers, "kept": 0,
                                                     "rotary": layers,
                                                     "decoder_layer": layers,
                                                     "attention": layers}
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    assert norm.forward.__func__ is not mlp.forward.__func__
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(norm(x), ops.rms_norm(x, norm.weight, norm.variance_epsilon))
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
        assert torch.equal(mlp(x), mlp.down_proj(ops.silu_mul(g, u)))
        xb = x.bfloat16()
        assert torch.equal(norm(xb), type(norm).forward(norm, xb))
    got = _logits(model, ids)  # not the exact forwards' bits, but their values
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A row alone, and beside others, is the same bits.
    assert torch.equal(_logits(model, ids[1:2]), got[1:2])
    fast, _ = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-products", device="cpu")
    assert fast.model.norm.forward.__func__ is norm.forward.__func__
    # Its packed gate and up projections: one gated product, the bits of the two and silu_mul;
    # once a weight changes, the module's own products.
    fmlp = fast.model.layers[0].mlp
    xf = torch.randn(7, fast.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert fmlp.gate_proj.packed_now() is not None and fmlp.up_proj.packed_now() is not None
        assert torch.equal(fmlp(xf), fmlp.down_proj(ops.silu_mul(fmlp.gate_proj(xf),
                                                                 fmlp.up_proj(xf))))
        fmlp.up_proj.weight.mul_(2.0)
        assert fmlp.up_proj.packed_now() is None
        assert torch.equal(fmlp(xf), fmlp.down_proj(ops.silu_mul(fmlp.gate_proj(xf),
                                                                 fmlp.up_proj(xf))))
    mixed, _ = models.load_model(tiny_llama_dir(layers=2), dtype="bf16-mixed", device="cpu")
    assert mixed.model.norm.forward.__func__ is not norm.forward.__func__


@pytest.mark.skipif(not cpp_backend.available()[0], reason="needs icqs_fast._C")
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma2"])
def test_fused_decoder_layers_keep_the_bits_of_their_parts(model_type, monkeypatch):
    """A bf16-products model's pre-norm decoder layers fold their residual adds into the
    passes after them (``ops.add_rms_norm``, ``ops.linear``'s ``residual``): its logits are the
    bits of the layers' own forwards over the same fused parts, a row alone or beside others.
    A layer that computes otherwise (Gemma 2's extra norms) keeps its own forward. The MLP's
    products read their inputs in bf16, as they would round them."""
    import warnings

    from icqs_fast import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = models.to_bf16_mixed(tiny_model(model_type, VOCAB), bf16_products=True)
    layers = list(model.model.layers)
    fused = [layer for layer in layers if "forward" in vars(layer)]
    assert len(fused) == (0 if model_type == "gemma2" else len(layers)), model_type
    ids = _ids(3, 29)
    # Their MLPs' two products read bf16 inputs (the norm and the gated product write them so);
    # Llama's query and key projections take their rotary embedding in the product, and its
    # three projections read the input norm's rows in bf16.
    seen, linear = [], cpp_backend.linear
    monkeypatch.setattr(cpp_backend, "linear",
                        lambda x, *a: seen.append((x.dtype, a[-1] is not None)) or linear(x, *a))
    got = _logits(model, ids)
    llama = model_type == "llama"  # its q / k / v read the input norm in bf16 too
    assert [d for d, _ in seen].count(torch.bfloat16) == (5 if llama else 2) * len(fused), seen
    rotated = sum(r for _, r in seen)
    assert rotated == (2 * len(fused) if llama else 0), (model_type, rotated)
    monkeypatch.undo()
    if fused:  # a hook on the attention: its own call, which the hook sees, and the same bits
        calls = []
        handle = fused[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        assert torch.equal(_logits(model, ids), got) and calls == [1]
        handle.remove()
    assert torch.equal(_logits(model, ids[1:2]), got[1:2])
    for layer in fused:
        del layer.forward
    assert torch.equal(_logits(model, ids), got)


def test_instance_not_class_is_changed():
    a, b = tiny_model("llama", VOCAB), tiny_model("llama", VOCAB)
    use_exact_forwards(a)
    assert isinstance(a.model.norm.forward, types.MethodType)
    assert not uses_exact_forwards(b.model.norm) and "forward" not in vars(b.model.norm)


@pytest.mark.matrix
@pytest.mark.parametrize("model_type", [t for t in causal_lm_types() if t not in EXCLUDED])
def test_every_family_keeps_its_logits(model_type):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, VOCAB)
        ids = _ids(2, 19)
        want = _logits(model, ids)
        use_exact_forwards(model)
        got = _logits(model, ids)
    assert torch.equal(got, want), model_type


@pytest.mark.matrix
@pytest.mark.skipif(not cpp_backend.available()[0], reason="needs icqs_fast._C")
def test_every_family_fused_layer_keeps_its_parts_bits():
    """bf16-products: in every family whose decoder layers fold their residual adds (those
    that pass the probe; the Llama kind at least), the logits are the bits of the layers' own
    forwards over the same parts."""
    import warnings

    from icqs_fast import models

    fused, differ = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in (t for t in causal_lm_types() if t not in EXCLUDED):
            model = models.to_bf16_mixed(tiny_model(model_type, VOCAB), bf16_products=True)
            layers = [m for m in model.modules()
                      if "forward" in vars(m) and hasattr(m, "post_attention_layernorm")]
            if not layers:
                continue
            fused.append(model_type)
            ids = _ids(2, 19)
            got = _logits(model, ids)
            for m in layers:
                del m.forward
            if not torch.equal(_logits(model, ids), got):
                differ.append(model_type)
    assert {"llama", "mistral", "qwen2", "qwen3", "granite"} <= set(fused), fused
    assert not differ, differ


@pytest.mark.parametrize("backend, isa", [
    pytest.param("torch", None, id="torch"),
    *(pytest.param("cpp", *p.values, id=f"cpp-{p.id}", marks=p.marks)
      for p in map(isa_param, ISAS))])
def test_rotary_is_transformers_arithmetic_bit_for_bit(backend, isa, monkeypatch):
    """``ops.rotary`` against transformers' ``apply_rotary_pos_emb`` (the original, not the one
    :func:`use_exact_forwards` may have put in its place): a transposed query (the attention's
    view), a key of one head, cos / sin broadcast from a batch of one, head sizes 2, 40 (whole
    vectors and a scalar tail) and 256, magnitudes from subnormal to 1e30, infinities, on cpp
    at each ISA level; the output keeps the query's layout."""
    from transformers.models.llama import modeling_llama

    from icqs_fast import backends, ops

    if not backends.available(backend)[0]:
        pytest.skip(f"{backend} backend unavailable")
    if isa is not None:
        monkeypatch.setenv(cpp_backend.ISA_ENV, isa)
    f = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__",
                modeling_llama.apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(4)
    for b, h, t, d, cb in ((2, 9, 37, 64, 2), (3, 2, 5, 2, 1), (2, 3, 7, 40, 1),
                           (1, 4, 3, 256, 1)):
        q = torch.randn(b, t, h, d, generator=g).transpose(1, 2) * 1e3
        k = torch.randn(b, 1, t, d, generator=g)
        q[0, 0, 0, :2] = torch.tensor([1e-42, float("inf")])
        k[-1, 0, -1, -1] = 1e30
        cos, sin = (torch.randn(cb, t, d, generator=g) for _ in range(2))
        want_q, want_k = f(q, k, cos, sin)
        got_q, got_k = ops.rotary(q, cos, sin, backend=backend), ops.rotary(k, cos, sin,
                                                                              backend=backend)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), (b, h, t, d)
        assert got_q.stride() == want_q.stride()
    with pytest.raises(ValueError, match="D even"):
        ops.rotary(torch.zeros(1, 1, 2, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="cos must be"):
        ops.rotary(torch.zeros(2, 1, 2, 4), torch.zeros(3, 2, 4), torch.zeros(2, 2, 4))


def test_rotary_replacement_falls_back_outside_the_probed_call():
    """The replaced function runs transformers' own for what the one pass does not cover (bf16,
    autograd, extra arguments) and gives the same results either way."""
    from transformers.models.llama import modeling_llama

    use_exact_forwards(tiny_model("llama", VOCAB))
    fast = modeling_llama.apply_rotary_pos_emb
    assert hasattr(fast, "__wrapped__")
    orig = fast.__wrapped__
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 1, 4, 8, generator=g)
    cos, sin = torch.randn(1, 4, 8, generator=g), torch.randn(1, 4, 8, generator=g)
    for args in ((q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16()),
                 (q.requires_grad_(), k, cos, sin)):
        for w, got in zip(orig(*args), fast(*args), strict=True):
            assert torch.equal(w, got) and got.requires_grad == w.requires_grad
    assert all(torch.equal(a, b) for a, b in zip(orig(q, k, cos, sin, 1),
                                                  fast(q, k, cos, sin, 1), strict=True))
