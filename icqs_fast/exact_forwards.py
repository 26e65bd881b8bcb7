"""Faster forwards, bit for bit equal, for a model's RMSNorm and gated-MLP modules and its
rotary embedding.

transformers' RMSNorm runs five passes over the activations (``pow``, ``mean``, ``rsqrt``
of the variance plus eps, two products) and its gated MLP allocates the SiLU output and the
product anew. With fp32 activations on the CPU (bf16-mixed) those passes are a tenth of the
engine's time (docs/DECISIONS.md, "Exact forwards"). Here the norm is torch's fused
``F.rms_norm`` (one kernel) and the MLP computes SiLU and the product in place on the gate
projection's output: the same operations in the same order, so the same bits, with fewer
passes and no new buffers.

transformers' ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``: two products, a
negation, a concatenation and a sum per tensor) becomes :func:`icqs_fast.ops.rotary`'s one pass,
the same arithmetic. It is a function of the modeling module, not a method: the module's global
is replaced (for every model of that family in the process, with the same bits), and every call
outside the probed form (fp32 on the CPU, ``[B, H, T, D]`` against ``[B, T, D]``, no autograd,
not under ``torch.compile``) takes the original.

Each replacement is switched on for a module only after a probe finds that it gives that
module's own output exactly (``torch.equal``) on a random input, so a family whose norm or MLP
computes differently (Gemma's ``1 + weight``, another activation, a bias, a cast) keeps its
own forward. Calls the probe did not cover (more arguments than the input, a dtype other than
fp32, a norm's input of another width than its weight, a tensor that autograd tracks) take
the module's own forward too.

``fused`` (the bf16-products form, whose linear products round their inputs to bf16 anyway)
trades the bits for fewer passes: a module that passes the probe takes the C++ one-pass
:func:`icqs_fast.ops.rms_norm` (its own fixed summation order per row) and
:func:`icqs_fast.ops.silu_mul` (its own e^x) instead, within a few fp32 ulps of torch's, and
still row by row, so batch-invariant (docs/DECISIONS.md, "Fused row-wise passes"). There, a
pre-norm decoder layer whose forward passes its probe (transformers' layer against the
expression of it) folds its residual adds into the passes after them, with the bits of the
add (:func:`_fused_layer`).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from icqs_fast import backends, ops

# The instance attribute that marks a module whose forward this module replaced.
_MARK = "_icqs_exact_forward"

ATTENTION_OUT_DTYPE = "icqs_out_dtype"
"""The keyword (and the attribute marking an attention function that takes it) by which
:func:`_llama_attention` asks for the attention output in bf16, the rounding its bf16-products
output projection gives it, so the projection reads it in place."""


def _norm_eps(module: Any) -> float | None:
    """The module's epsilon under transformers' names (None: not one we know)."""
    for name in ("variance_epsilon", "eps"):
        eps = getattr(module, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _is_rms_norm(module: Any) -> bool:
    w = getattr(module, "weight", None)
    return ("RMSNorm" in type(module).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1
            and _norm_eps(module) is not None)


def _is_gated_silu_mlp(module: Any) -> bool:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(isinstance(p, torch.nn.Linear) for p in parts)
            and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def _probed_norm_call(self: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    w = self.weight
    # Not the probed call: e.g. a gated norm's gate, another width than the weight's.
    return not (args or kwargs or x.dtype != torch.float32 or w.dtype != torch.float32
                or x.shape[-1:] != w.shape
                or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))


def _fast_norm(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if not _probed_norm_call(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    return F.rms_norm(x, self.weight.shape, self.weight, _norm_eps(self))


def _fused_norm(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if not _probed_norm_call(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    return ops.rms_norm(x, self.weight, _norm_eps(self))


def _hooked(module: Any) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _probed_mlp_call(self: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    # Other arguments: not the probed call; autograd: the in-place SiLU would break it; a hook
    # on the gate projection may keep its output (which SiLU would overwrite in place) and one
    # on the activation expects it to be called.
    return not (args or kwargs or x.dtype != torch.float32 or torch.is_grad_enabled()
                or _hooked(self.gate_proj) or _hooked(self.act_fn))


def _fast_mlp(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if not _probed_mlp_call(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    g = self.gate_proj(x)
    F.silu(g, inplace=True)
    g.mul_(self.up_proj(x))
    return self.down_proj(g)


def _packed_now(layer: Any) -> Any:
    """The pack a switched linear layer's products read now (icqs_fast.invariant_linears'
    ``packed_now``), or None (not switched, or its weight changed)."""
    return getattr(layer, "packed_now", lambda: None)()


def _gated(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The fused MLP's ``silu(gate(x)) * up(x)``. Both projections' weights packed and
    current, no bias, no hook on the up projection: one gated product, the same bits, without
    writing and reading back the two [T, I] products."""
    gate, up = self.gate_proj, self.up_proj
    g, u = _packed_now(gate), _packed_now(up)
    if (g is not None and u is not None and g.products == u.products and x.device.type == "cpu"
            and gate.bias is None and up.bias is None and not _hooked(up)):
        return ops.linear(x, g, up=u)
    return ops.silu_mul(gate(x), up(x))


def _fused_mlp(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if not _probed_mlp_call(self, x, args, kwargs):
        return type(self).forward(self, x, *args, **kwargs)
    return self.down_proj(_gated(self, x))


_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _is_pre_norm_layer(module: Any) -> bool:
    """A decoder layer of the Llama kind's parts (its forward is then probed)."""
    parts = [getattr(module, n, None) for n in _LAYER_PARTS]
    return (all(isinstance(p, torch.nn.Module) for p in parts) and _is_rms_norm(parts[0])
            and _is_rms_norm(parts[2]) and _is_gated_silu_mlp(parts[3]))


def _exact_layer(self: Any, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """transformers' pre-norm decoder layer as the probe's equal: attention of the normed
    input plus the input, then the MLP of the normed sum plus the sum."""
    h, _ = self.self_attn(hidden_states=self.input_layernorm(x), **kwargs)
    h = x + h
    return h + self.mlp(self.post_attention_layernorm(h))


def _fused_layer(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`_exact_layer` with the fused parts' bits, each residual add folded into the
    pass after it: the first into the post-attention norm (``ops.add_rms_norm``), the second
    into the down projection's product (``ops.linear``'s ``residual``); a probed Llama
    attention runs as :func:`_llama_attention`. The same bits as the layer's own forward over
    its fused norm and MLP, with fewer passes over the activations."""
    post, mlp = self.post_attention_layernorm, self.mlp
    if (args or getattr(post.forward, "__func__", None) is not _fused_norm
            or getattr(mlp.forward, "__func__", None) is not _fused_mlp
            or _hooked(post) or _hooked(mlp)):
        return type(self).forward(self, x, *args, **kwargs)
    attn, norm = self.self_attn, self.input_layernorm
    if getattr(attn, _MARK, False) and not _hooked(attn):  # a hook expects its call
        qkv = _bf16_qkv(attn, norm, x, kwargs.get("position_embeddings"))
        if qkv is not None:  # the projections round the norm to bf16: it writes it so
            h = _llama_attention(attn, ops.rms_norm(x, norm.weight, _norm_eps(norm),
                                                    out_dtype=torch.bfloat16), qkv, **kwargs)
        else:
            h = _llama_attention(attn, norm(x), None, **kwargs)
    else:
        h, _ = attn(hidden_states=self.input_layernorm(x), **kwargs)
    if not (_probed_norm_call(post, h, (), {}) and x.dtype == torch.float32
            and h.device.type == "cpu" and x.shape == h.shape):
        h = x + h
        return h + mlp(post(h))
    packs = _bf16_mlp_packs(mlp) if _probed_mlp_call(mlp, h, (), {}) else None
    if packs is not None:
        # The products round their inputs to bf16 anyway: the norm and the gated product
        # write them so (the same bits), and the next product reads them in place.
        h, normed = ops.add_rms_norm(h, x, post.weight, _norm_eps(post),
                                     normed_dtype=torch.bfloat16)
        g = ops.linear(normed, packs[0], up=packs[1], out_dtype=torch.bfloat16)
        return ops.linear(g, packs[2], mlp.down_proj.bias, residual=h)
    h, normed = ops.add_rms_norm(h, x, post.weight, _norm_eps(post))
    if not _probed_mlp_call(mlp, normed, (), {}):
        return h + mlp(normed)
    down = mlp.down_proj
    d = _packed_now(down)
    if d is None or _hooked(down):
        return h + down(_gated(mlp, normed))
    return ops.linear(_gated(mlp, normed), d, down.bias, residual=h)


def _llama_attention(attn: Any, x: torch.Tensor, qkv: tuple | None = None, *,
                     position_embeddings: Any = None, attention_mask: torch.Tensor | None = None,
                     cache: Any = None, past_key_values: Any = None, **kwargs: Any
                     ) -> torch.Tensor:
    """transformers' ``LlamaAttention.forward`` (its output, before nothing else): the same
    calls, except that with its query and key projections packed, current and unhooked, each
    takes its rotary embedding in its product's pass (``ops.linear``'s ``rotary``: the bits of
    the projection and then :func:`icqs_fast.ops.rotary`, the module's probed rotary) rather
    than in a pass of its own. ``qkv``: the three bf16-products packs (:func:`_bf16_qkv`) of a
    bf16 ``x``, which they read in place."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cache = cache if cache is not None else past_key_values
    shape = (*x.shape[:-1], -1, attn.head_dim)
    cos, sin = position_embeddings
    fused = qkv[:2] if qkv is not None else _rotary_packs(attn, x, cos)
    if fused is not None:
        q, k = (ops.linear(x, p, proj.bias, rotary=(cos, sin)).view(shape).transpose(1, 2)
                for p, proj in zip(fused, (attn.q_proj, attn.k_proj), strict=True))
    else:
        q, k = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj))
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    v = attn.v_proj(x) if qkv is None else ops.linear(x, qkv[2], attn.v_proj.bias)
    v = v.view(shape).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    eager = sys.modules[type(attn).__module__].eager_attention_forward
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    o = _cpp_packs((attn.o_proj,), bf16=True) if qkv is not None else None
    bf16 = (o is not None and getattr(interface, ATTENTION_OUT_DTYPE, False)
            and q.dtype == torch.float32)
    out, _ = interface(attn, q, k, v, attention_mask,
                       dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, **kwargs,
                       **({ATTENTION_OUT_DTYPE: torch.bfloat16} if bf16 else {}))
    out = out.reshape(*x.shape[:-1], -1).contiguous()
    if bf16 and out.dtype == torch.bfloat16:
        return ops.linear(out, o[0], attn.o_proj.bias)
    return attn.o_proj(out)


def _cpp_packs(parts: tuple, bf16: bool = False) -> tuple | None:
    """The packs of the linear layers ``parts`` when every one is current, of the cpp backend
    (of bf16 products with ``bf16``) and unhooked (None otherwise)."""
    packs = tuple(_packed_now(p) for p in parts)
    if (any(p is None or p.backend != "cpp" or bf16 and p.products != "bf16" for p in packs)
            or any(_hooked(p) for p in parts)):
        return None
    return packs


def _rotary_fits(attn: Any, x: torch.Tensor, cos: Any) -> bool:
    """Whether q / k may take the rotary embedding in their products: the module's probed
    rotary, a CPU ``[B, T, H]`` fp32 call, no autograd, a head size dividing 256."""
    rope = getattr(sys.modules[type(attn).__module__], _ROTARY, None)
    d = attn.head_dim
    return not (not getattr(rope, _MARK, False) or x.dim() != 3 or x.device.type != "cpu"
                or not isinstance(cos, torch.Tensor) or cos.dtype != torch.float32
                or d % 2 or 256 % d or torch.is_grad_enabled())


def _rotary_packs(attn: Any, x: torch.Tensor, cos: Any) -> tuple | None:
    """The query and key packs that take the rotary embedding in their pass (else None)."""
    return _cpp_packs((attn.q_proj, attn.k_proj)) if _rotary_fits(attn, x, cos) else None


def _bf16_qkv(attn: Any, norm: Any, x: torch.Tensor, pe: Any) -> tuple | None:
    """The q / k / v packs when all three are bf16-products ones (current, cpp, unhooked, q and
    k taking the rotary embedding) and the norm is the probed fused one (else None)."""
    if (getattr(norm.forward, "__func__", None) is not _fused_norm or _hooked(norm)
            or not _probed_norm_call(norm, x, (), {}) or not isinstance(pe, tuple)
            or len(pe) != 2 or not _rotary_fits(attn, x, pe[0])):
        return None
    return _cpp_packs((attn.q_proj, attn.k_proj, attn.v_proj), bf16=True)


def _use_llama_attention(layer: Any, model: torch.nn.Module) -> bool:
    """Mark ``layer.self_attn`` for :func:`_llama_attention` when it is transformers'
    ``LlamaAttention`` (its forward, unhooked) and the two give the same bits on the probe."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    attn = getattr(layer, "self_attn", None)
    if (attn is None or type(attn).forward is not LlamaAttention.forward or _hooked(attn)
            or not hasattr(sys.modules[type(attn).__module__], "eager_attention_forward")):
        return False
    x, kw = _layer_probe(layer, model) or (None, {})
    if x is None or not _same_bits(lambda m, t: type(m).forward(m, t, **kw)[0],
                                   lambda m, t: _llama_attention(m, t, None, **kw), attn, x):
        return False
    setattr(attn, _MARK, True)
    return True


def _bf16_mlp_packs(mlp: Any) -> tuple[Any, Any, Any] | None:
    """The gate, up and down packs of a gated MLP whose three products are bf16 ones of the
    cpp backend, current and unhooked, the gate and up without a bias (None otherwise)."""
    if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
        return None
    return _cpp_packs((mlp.gate_proj, mlp.up_proj, mlp.down_proj), bf16=True)


def _layer_equal_on_probe(layer: Any, model: torch.nn.Module) -> bool:
    """Whether :func:`_exact_layer` gives the layer's own output on a ``[2, 5, H]`` input with
    the model's rotary embedding (a layer that computes otherwise, e.g. Gemma's extra norms,
    or one whose attention needs more than the probe gives, keeps its forward)."""
    x, kw = _layer_probe(layer, model) or (None, {})
    return x is not None and _same_bits(lambda m, t: type(m).forward(m, t, **kw),
                                        lambda m, t: _exact_layer(m, t, **kw), layer, x)


def _layer_probe(layer: Any, model: torch.nn.Module) -> tuple[torch.Tensor, dict] | None:
    """A layer's probe input and what a model always passes (its rotary embedding, no mask)."""
    rope = getattr(getattr(model, "model", model), "rotary_emb", None)
    w = layer.input_layernorm.weight
    if rope is None or w.dtype != torch.float32:
        return None
    x = _probe_input(w.shape[-1], w.device)
    try:
        with torch.no_grad():
            pe = rope(x, torch.arange(5, device=w.device).expand(2, 5))
    except Exception:  # noqa: BLE001 - what cannot take the probe stays as it is
        return None
    return x, {"position_embeddings": pe, "attention_mask": None}


def _probe_input(width: int, device: torch.device) -> torch.Tensor:
    """``[2, 5, width]`` fp32: rows of different scales (1e-3 to 1e3) and signs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, width, generator=gen, dtype=torch.float64)
    scale = torch.logspace(-3, 3, 10, dtype=torch.float64).reshape(2, 5, 1)
    return (x * scale).float().to(device)


def _same_bits(original: Any, fast: Any, *args: Any) -> bool:
    """Whether ``fast(*args)`` gives ``original(*args)``'s tensor(s) bit for bit."""
    with torch.no_grad():
        try:
            want, got = original(*args), fast(*args)
        except Exception:  # noqa: BLE001 - what cannot take the probe stays as it is
            return False
    if isinstance(want, torch.Tensor):
        want, got = (want,), (got,)
    return (isinstance(want, tuple) and isinstance(got, tuple) and len(want) == len(got)
            and all(isinstance(w, torch.Tensor) and torch.equal(w, g)
                    for w, g in zip(want, got, strict=True)))


def _equal_on_probe(module: Any, fast: Any, width: int, device: torch.device) -> bool:
    return _same_bits(type(module).forward, fast, module, _probe_input(width, device))


_ROTARY = "apply_rotary_pos_emb"


def _fast_rotary(original: Any) -> Any:
    def apply_rotary_pos_emb(*args: Any, **kwargs: Any) -> Any:
        # The probed call is (q, k, cos, sin); any other (keywords, no key, another
        # unsqueeze_dim) is the original's.
        if (kwargs or len(args) != 4 or torch.compiler.is_compiling()
                or not all(isinstance(t, torch.Tensor) for t in args)):
            return original(*args, **kwargs)
        q, k, cos, sin = ts = args
        if (any(t.dtype != torch.float32 or t.device.type != "cpu" for t in ts)
                or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape
                or q.shape[-1] % 2 or not q.shape[-1] == k.shape[-1] == cos.shape[-1]
                or not q.shape[2] == k.shape[2] == cos.shape[1] or q.shape[0] != k.shape[0]
                or cos.shape[0] not in (1, q.shape[0])
                or torch.is_grad_enabled() and any(t.requires_grad for t in ts)):
            return original(*args)
        return ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(apply_rotary_pos_emb, _MARK, True)
    return apply_rotary_pos_emb


def _rotary_equal_on_probe(original: Any, fast: Any, head_dim: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, h, 5, head_dim, generator=gen) * 30 for h in (3, 1))
    cos, sin = (torch.randn(2, 5, head_dim, generator=gen) for _ in range(2))
    return _same_bits(original, fast, q, k, cos, sin)


def _use_exact_rotary(model: torch.nn.Module) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling module of each attention class of
    ``model`` (one with a ``head_dim``) by the one-pass equal that passes the probe; the
    number of attention modules whose modeling module now uses it."""
    n = 0
    for module in model.modules():
        ns = sys.modules.get(type(module).__module__)
        d = getattr(module, "head_dim", None)
        f = getattr(ns, _ROTARY, None)
        if not (callable(f) and isinstance(d, int) and d % 2 == 0 and d > 0):
            continue
        if getattr(f, _MARK, False):
            n += 1
            continue
        fast = _fast_rotary(f)
        if _rotary_equal_on_probe(f, fast, d):
            setattr(ns, _ROTARY, fast)
            n += 1
    return n


def use_exact_forwards(model: torch.nn.Module, fused: bool = False) -> dict[str, int]:
    """Replace the forward of each RMSNorm and gated-SiLU MLP module of ``model`` whose fp32
    parameters pass the probe (the same output bits on a random fp32 input) by its faster
    equal; in place, on the module instances only (the classes are untouched, so other models
    keep theirs). Calling it again changes nothing. With ``fused`` (and the cpp backend), those
    modules take the one-pass C++ forwards instead: within fp32 rounding, not the same bits.

    Returns:
        ``{"rms_norm": n, "gated_mlp": m, "kept": k, "rotary": r, "decoder_layer": d,
        "attention": a}``: the modules switched and those kept (their probe differed), the
        attention modules whose modeling module's rotary embedding is the one-pass equal
        (:func:`_use_exact_rotary`), and (``fused`` only) the decoder layers whose residual
        adds are folded in (:func:`_fused_layer`) and, of those, the ones whose Llama
        attention takes its rotary embedding in its products (:func:`_llama_attention`).
    """
    counts = {"rms_norm": 0, "gated_mlp": 0, "kept": 0}
    kind_op = {"rms_norm": "rms_norm", "gated_mlp": "silu_mul"}
    layers = []
    for module in model.modules():
        if getattr(module, _MARK, False):
            continue
        if fused and _is_pre_norm_layer(module):
            layers.append(module)
            continue
        if _is_rms_norm(module):
            kind, fast, w, one_pass = "rms_norm", _fast_norm, module.weight, _fused_norm
        elif _is_gated_silu_mlp(module):
            kind, fast, w, one_pass = "gated_mlp", _fast_mlp, module.gate_proj.weight, _fused_mlp
        else:
            continue
        # The weight, not the parameters: a norm may hold its weight as a buffer.
        if w.dtype != torch.float32 or not _equal_on_probe(module, fast, w.shape[-1], w.device):
            counts["kept"] += 1
            continue
        if fused and backends.choose(kind_op[kind], "auto", w.device, w.dtype) == "cpp":
            fast = one_pass  # the probe showed the module computes what the one pass does
        module.forward = types.MethodType(fast, module)
        setattr(module, _MARK, True)
        counts[kind] += 1
    counts["rotary"] = _use_exact_rotary(model)
    # Fused: the pre-norm decoder layers that pass their probe fold their residual adds into
    # the passes after them (probed last, on their own parts' forwards).
    counts["decoder_layer"] = counts["attention"] = 0
    for layer in layers:
        if (backends.choose("add_rms_norm", "auto", layer.input_layernorm.weight.device,
                            torch.float32) == "cpp" and _layer_equal_on_probe(layer, model)):
            layer.forward = types.MethodType(_fused_layer, layer)
            setattr(layer, _MARK, True)
            counts["decoder_layer"] += 1
            counts["attention"] += _use_llama_attention(layer, model)
    return counts


def uses_exact_forwards(module: Any) -> bool:
    """Whether :func:`use_exact_forwards` replaced ``module``'s forward."""
    return bool(getattr(module, _MARK, False))
