"""Attention entropy without the attention matrix: every backend against a float64 reference on
random q/k/v, and the Hugging Face hook against eager ``output_attentions=True`` on the embedded
model."""

import math

import pytest
import torch
from _helpers import DEVICE, attention_lse64, attention_within_torch_error, skip_unless_in_ci
from tolerance import assert_within_torch_error

from icqs_fast import backends, ops
from icqs_fast.backends.torch_ref import attention_entropy_torch
from icqs_fast.features.attention import capture_attention_entropy, eager_range_entropy

BACKENDS = ["torch", "triton", "cpp"]


def _need(backend: str) -> None:
    if backend == "triton" and DEVICE == "cpu" and not backends.triton_interpreting():
        pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    if backend == "cpp":
        if DEVICE != "cpu":
            pytest.skip("the cpp backend runs on CPU tensors")
        ok, why = backends.available("cpp")
        if not ok:
            skip_unless_in_ci(f"cpp backend unavailable: {why}")


def reference64(q, k, v, key_range, query_mask, attention_mask, causal, scale,
                dtype=torch.float64, pv_dtype=None):
    """Float64 (or ``dtype``), fully materialised: out [B,Hq,Tq,D] and entropy [B,Hq,Tq] (0 for
    unflagged rows and rows with no allowed key in the range; output 0 for rows with no allowed
    key). ``pv_dtype``: the probabilities and values rounded to it for the PV product."""
    q, k, v = q.cpu().to(dtype), k.cpu().to(dtype), v.cpu().to(dtype)
    b, hq, tq, _ = q.shape
    hk, tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, 1)
    v = v.repeat_interleave(hq // hk, 1)
    s = q @ k.transpose(-1, -2) * scale
    allow = torch.ones(b, tq, tk, dtype=torch.bool)
    if attention_mask is not None:
        allow &= attention_mask.cpu()[:, None, :]
    if causal:
        allow &= (torch.arange(tk)[None, :] <= (tk - tq + torch.arange(tq))[:, None])[None]
    s = s.masked_fill(~allow[:, None], -math.inf)
    if pv_dtype is not None:
        v = v.to(pv_dtype).to(dtype)
    out = torch.zeros(b, hq, tq, v.shape[-1], dtype=dtype)
    ent = torch.zeros(b, hq, tq, dtype=dtype)
    for bi in range(b):
        k0, k1 = (int(x) for x in key_range[bi])
        for h in range(hq):
            for i in range(tq):
                row = s[bi, h, i]
                ok = torch.isfinite(row)
                if ok.any():
                    p = torch.softmax(row, -1)
                    if pv_dtype is not None:
                        p = p.to(pv_dtype).to(dtype)
                    out[bi, h, i] = p @ v[bi, h]
                sel = ok.clone()
                sel[: max(k0, 0)] = False
                sel[max(k1, 0):] = False
                if query_mask[bi, i] and sel.any():
                    pr = torch.softmax(row[sel], -1)
                    ent[bi, h, i] = -(pr * torch.log(pr)).sum()
    return out, ent


def _within_torch_error(out, ent, q, k, v, key_range, query_mask, attention_mask, causal,
                        scale):
    """``ops.attention_entropy``'s ``(out, ent)`` by the rule of tests/tolerance.py: the same
    code with fp32 scores, softmax and entropy (the kernels' dtype), the probabilities rounded
    to 16-bit inputs' dtype for the PV product and the output cast to it (as the kernels do);
    the out floor is half an eps of its dtype (the output's own rounding)."""
    args = (q, k, v, key_range, query_mask.cpu(), attention_mask, causal, scale)
    ro, re = reference64(*args)
    pv = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else None
    po, pe = reference64(*args, dtype=torch.float32, pv_dtype=pv)
    assert_within_torch_error(out, ro, po.to(out.dtype), ulps=0.5, name="out")
    assert_within_torch_error(ent, re, pe, name="entropy")
    return ro, re


def _inputs(b, hq, hk, tq, tk, d, dtype=torch.float32):
    q = torch.randn(b, hq, tq, d, device=DEVICE).to(dtype)
    k = (torch.randn(b, hk, tk, d, device=DEVICE) * 1.5).to(dtype)
    v = torch.randn(b, hk, tk, d, device=DEVICE).to(dtype)
    return q, k, v


# (B, Hq, Hk, Tq, Tk, D, causal, padding, key ranges)
CASES = {
    "gqa_leftpad_ranges": (2, 4, 2, 37, 37, 16, True, "left", [[0, 20], [11, 30]]),
    "mha_rightpad_mid": (2, 3, 3, 37, 37, 16, True, "right", [[5, 37], [17, 26]]),
    "odd_head_dim_no_pad": (2, 4, 1, 23, 23, 12, True, None, [[0, 23], [9, 10]]),
    "suffix_queries": (2, 4, 2, 7, 37, 16, True, "left", [[3, 30], [0, 37]]),
    "non_causal": (2, 2, 1, 19, 33, 16, False, "right", [[0, 33], [20, 40]]),
    # No padding, not causal: the kernel's unmasked key loop runs, then the ragged tail.
    "non_causal_no_pad": (2, 2, 2, 9, 40, 16, False, None, [[3, 35], [-4, 17]]),
    # ... and Tk a multiple of the key block: no masked loop compiled at all (EVEN_N).
    "non_causal_even": (1, 2, 1, 5, 32, 16, False, None, [[0, 20]]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_against_float64(backend, case):
    _need(backend)
    b, hq, hk, tq, tk, d, causal, pad, ranges = CASES[case]
    q, k, v = _inputs(b, hq, hk, tq, tk, d)
    am = None
    if pad is not None:
        am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
        if pad == "left":
            am[1, :6] = False
        else:
            am[1, tk - 6:] = False
    qm = torch.rand(b, tq, device=DEVICE) > 0.3
    qm[:, -1] = True
    kr = torch.tensor(ranges, dtype=torch.int64)
    scale = 0.3
    out, ent = ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, attention_mask=am,
                                     causal=causal, scale=scale, backend=backend)
    assert out.shape == (b, hq, tq, d) and out.dtype == q.dtype
    assert ent.shape == (b, hq, tq) and ent.dtype == torch.float32
    _, re = _within_torch_error(out, ent, q, k, v, kr, qm, am, causal, scale)
    # Unflagged rows are exactly 0 and flagged rows with > 1 key in range are informative.
    assert bool((ent[~qm[:, None, :].expand_as(ent)] == 0).all())
    assert float(re.max()) > 0.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_in_range(backend):
    """Causal row i < k0 sees no key of [k0, k1) -> entropy 0; a fully padded sequence -> output
    0 and entropy 0; an empty range -> 0; a single key -> 0."""
    _need(backend)
    b, hq, hk, t, d = 3, 2, 2, 21, 16
    q, k, v = _inputs(b, hq, hk, t, t, d)
    am = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    am[2] = False
    qm = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    kr = torch.tensor([[10, 15], [4, 4], [0, t]])
    out, ent = ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, attention_mask=am,
                                     backend=backend)
    assert torch.isfinite(out).all() and torch.isfinite(ent).all()
    assert bool((ent[0, :, :10] == 0).all())  # rows before the range start
    assert bool((ent[0, :, 10] == 0).all())  # exactly one key in range
    assert bool((ent[0, :, 11:] > 0).all())
    assert bool((ent[1] == 0).all()) and bool((ent[2] == 0).all()) and bool((out[2] == 0).all())
    _within_torch_error(out, ent, q, k, v, kr, qm, am, True, 1 / math.sqrt(d))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_and_strided(backend):
    """bf16 inputs with HF's [B, T, H, D] -> [B, H, T, D] transposed (non-contiguous) layout."""
    _need(backend)
    b, hq, hk, t, d = 2, 4, 2, 29, 16
    q = torch.randn(b, t, hq, d, device=DEVICE).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, t, hk, d, device=DEVICE).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, t, hk, d, device=DEVICE).to(torch.bfloat16).transpose(1, 2)
    qm = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    kr = torch.tensor([[0, 12], [3, 29]])
    out, ent = ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, backend=backend)
    assert out.dtype == torch.bfloat16
    # Scores are accumulated in fp32 from the exact bf16 values: entropy is judged in fp32.
    _within_torch_error(out, ent, q, k, v, kr, qm, None, True, 1 / math.sqrt(d))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_sink_far_above_the_range(backend):
    """A key outside the range (an attention sink) scoring far above every in-range key: the
    Triton kernel's in-range terms share the row max's reference, exact while the range's max is
    within ~70 nats of it (60 here); past 87.3 nats every in-range term underflows and the row
    reports entropy 0 (the documented limit, 120 nats here). The torch backend is exact in
    both."""
    _need(backend)
    b, h, t, d = 2, 2, 24, 16
    g = torch.Generator().manual_seed(7)
    # q = e_0 (plus a little noise in the other dims), scale 1: score of key j ~ k[j, 0].
    q = torch.zeros(b, h, t, d)
    q[..., 0] = 1.0
    q[..., 1:] = 0.05 * torch.randn(b, h, t, d - 1, generator=g)
    k = torch.randn(b, h, t, d, generator=g)
    k[..., 0] *= 2.0
    k[0, :, 0, 0] = 60.0  # sink 60 nats above the rest (batch 0), 120 (batch 1)
    k[1, :, 0, 0] = 120.0
    v = torch.randn(b, h, t, d, generator=g)
    q, k, v = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    qm = torch.ones(b, t, dtype=torch.bool, device=DEVICE)
    kr = torch.tensor([[1, t], [1, t]])
    out, ent = ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, scale=1.0,
                                     backend=backend)
    ro, re = reference64(q, k, v, kr, qm.cpu(), None, True, 1.0)
    po, pe = reference64(q, k, v, kr, qm.cpu(), None, True, 1.0, dtype=torch.float32)
    assert float(re[:, :, 8:].min()) > 0.1  # informative in-range distributions
    assert_within_torch_error(out, ro, po, ulps=0.5, name="out")
    # Triton's in-range sums are relative to the sink's score, 60 nats up: the entropy then
    # cancels terms of that size, and may carry 2 fp32 eps of it (measured: 1.35).
    gap_slack = 2 * torch.finfo(torch.float32).eps * 60 if backend == "triton" else 0.0
    assert_within_torch_error(ent[0], re[0], pe[0], slack=gap_slack,
                              name="entropy, sink 60 nats above")
    if backend in ("torch", "cpp"):  # cpp: the range's own softmax, without the sink
        assert_within_torch_error(ent[1], re[1], pe[1], name="entropy, sink 120 nats above")
    else:
        assert bool((ent[1] == 0).all())


@pytest.mark.parametrize("causal", [True, False])
def test_triton_lse_output(causal):
    """The kernel's log-sum-exp output (``RETURN_LSE``, used by cascade attention on CUDA)
    against float64 (tests/tolerance.py's rule): GQA, padding (one sequence fully padded: lse
    -inf, output 0), fewer queries than keys."""
    _need("triton")
    from icqs_fast.kernels.attention_entropy import attention_lse

    b, hq, hk, tq, tk, d = 3, 4, 2, 11, 30, 16
    q, k, v = _inputs(b, hq, hk, tq, tk, d)
    am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
    am[1, :9] = False
    am[2] = False
    out, lse = attention_lse(q, k, v, scale=0.3, causal=causal, attention_mask=am)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, tq)
    assert bool(torch.isneginf(lse[2]).all()) and bool((out[2] == 0).all())
    attention_within_torch_error(out, lse, q, k, v, scale=0.3, causal=causal, attention_mask=am)


# (B, Hq, Hk, Tq, Tk, D, causal, padding): one query and one key; GQA with 3 query heads per
# key head, an odd head size and a fully padded sequence; fewer queries than keys without
# causality; a key count that is a multiple of the kernel's key block.
LSE_CASES = {
    "one_query_one_key": (1, 2, 1, 1, 1, 8, True, None),
    "gqa3_odd_dim_leftpad_empty_row": (3, 6, 2, 7, 19, 12, True, "left"),
    "non_causal_fewer_queries": (2, 4, 4, 3, 33, 16, False, "right"),
    "keys_multiple_of_block": (1, 2, 1, 5, 64, 16, False, None),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LSE_CASES))
def test_attention_lse_against_float64(backend, case):
    """``ops.attention_lse`` (cascade attention's op) on every backend against float64 on
    awkward shapes; a sequence with no real key has lse -inf and output 0 (it drops out of a
    log-sum-exp merge)."""
    _need(backend)
    b, hq, hk, tq, tk, d, causal, pad = LSE_CASES[case]
    q, k, v = _inputs(b, hq, hk, tq, tk, d)
    am = None
    if pad is not None:
        am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
        if pad == "left":
            am[0, :tk // 3] = False
        else:
            am[-1, tk - 5:] = False
        if b > 2:
            am[2] = False  # a sequence with no real key
    out, lse = ops.attention_lse(q, k, v, scale=0.35, causal=causal, attention_mask=am,
                                 backend=backend)
    _, rl = attention_lse64(q, k, v, attention_mask=am, causal=causal, scale=0.35)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (b, hq, tq)
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(rl))
    attention_within_torch_error(out, lse, q, k, v, attention_mask=am, causal=causal,
                                 scale=0.35)
    assert bool((out.cpu()[~torch.isfinite(rl)] == 0).all())


def test_attention_lse_variants_on_the_torch_backend():
    """Softcap and a value head size other than D: the torch backend against float64 (the
    triton backend's variants: tests/test_triton_attention_variants.py); an unknown option is
    refused, naming it."""
    q, k, _ = _inputs(2, 4, 2, 6, 17, 16)
    v = torch.randn(2, 2, 17, 24, device=DEVICE)
    am = torch.ones(2, 17, dtype=torch.bool, device=DEVICE)
    am[1, 12:] = False
    out, lse = ops.attention_lse(q, k * 4, v, scale=0.25, causal=True, attention_mask=am,
                                 softcap=3.0, backend="torch")
    assert out.shape == (2, 4, 6, 24)
    attention_within_torch_error(out, lse, q, k * 4, v, attention_mask=am, causal=True,
                                 scale=0.25, softcap=3.0)
    with pytest.raises(ValueError, match=r"unknown option 'sinks'"):
        backends.choose("attention_lse", "triton", DEVICE, torch.float32, {"sinks"})


@pytest.mark.parametrize("causal", [True, False])
def test_gpu_launches_describe_the_launch(causal):
    """``gpu_launches``: one launch from the launcher's settings function, the exact count of
    allowed (query, key) pairs in its FLOPs, the entropy state as a constexpr switch."""
    from icqs_fast.kernels import attention_entropy as ak

    from bench.gpu_model.launches import attention_entropy as akl

    b, hq, hk, tq, tk, d = 2, 8, 2, 300, 700, 128
    pairs = sum(min(tk, tk - tq + i + 1) if causal else tk for i in range(tq))
    for ent in (True, False):
        (ln,) = akl.gpu_launches(b, hq, hk, tq, tk, d, torch.bfloat16, causal, entropy=ent)
        cfg = ak.attention_settings(b, hq, tq, tk, d, torch.bfloat16, causal=causal)
        assert ln.grid == cfg.grid == (math.ceil(tq / cfg.block_m) * b * hq, 1, 1)
        assert (ln.num_warps, ln.num_stages, ln.label) == (cfg.num_warps, cfg.num_stages,
                                                           cfg.label)
        assert ln.tensor_flops == 4 * d * b * hq * pairs and ln.elements == b * hq * pairs
        assert ln.constexprs["WITH_ENTROPY"] is ent and ln.constexprs["CAUSAL"] is causal
        assert ln.constexprs["EVEN_N"] is (not causal and tk % cfg.block_n == 0)
        assert ln.constexprs["BLOCK_M"] >= 64  # a wgmma tile per warpgroup on sm_90
        assert list(ln.signature)[:3] == ["q_ptr", "k_ptr", "v_ptr"]
        assert set(ln.signature) == set(ak._attn_entropy_fwd.arg_names)
        io = (2 * b * hq * tq * d + 2 * b * hk * tk * d) * 2
        assert ln.hbm_bytes == io + (b * hq * tq * 4 + b * tq + b * 16 if ent else 0)


def test_torch_chunking_matches_unchunked():
    """Small query chunks (several per sequence, padding + causal offset) give the same result."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 30, 41, 16
    q, k, v = _inputs(b, hq, hk, tq, tk, d)
    am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
    am[0, :7] = False
    qm = torch.rand(b, tq, device=DEVICE) > 0.5
    kr = torch.tensor([[2, 25], [15, 41]])
    out, ent = attention_entropy_torch(q, k, v, kr, qm, am, True, 0.25, chunk=7)
    _within_torch_error(out, ent, q, k, v, kr, qm, am, True, 0.25)


def test_bad_inputs_are_named():
    q, k, v = _inputs(2, 4, 2, 8, 8, 16)
    qm = torch.ones(2, 8, dtype=torch.bool)
    kr = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ops.attention_entropy(q, k[:, :1].expand(2, 3, 8, 16), v[:, :1].expand(2, 3, 8, 16),
                              key_range=kr, query_mask=qm)
    with pytest.raises(ValueError, match="key_range"):
        ops.attention_entropy(q, k, v, key_range=kr[:1], query_mask=qm)
    with pytest.raises(ValueError, match="query_mask"):
        ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm.long())
    with pytest.raises(ValueError, match="attention_mask"):
        ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm,
                              attention_mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="Tq <= Tk"):
        ops.attention_entropy(q, k[:, :, :4], v[:, :, :4], key_range=kr, query_mask=qm)
    with pytest.raises(ValueError, match="backend"):
        ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, backend="cpp", softcap=5.0)


# --------------------------------------------------------------------------- embedded model


@pytest.fixture(scope="module")
def model_tok():
    from icqs_fast.models import load_model

    try:
        model, tok = load_model(attn_implementation="eager", dtype="fp32", device=DEVICE)
    except FileNotFoundError as exc:
        skip_unless_in_ci(f"embedded model unavailable: {exc}")
    return model, tok


def _padded_batch(tok, side):
    """Two chat-like inputs of different lengths: instruction tokens then response tokens.
    Returns ids, attention_mask, query_mask (response rows) and key_range (instruction keys)."""
    pairs = [
        ("Explain why the sky is blue in one short paragraph.",
         " Sunlight scatters off air molecules, and blue light scatters most."),
        ("Name a fruit.", " An apple."),
    ]
    seqs, spans = [], []
    for ins, resp in pairs:
        a = tok(ins, add_special_tokens=False).input_ids
        r = tok(resp, add_special_tokens=False).input_ids
        seqs.append(a + r)
        spans.append((len(a), len(r)))
    t = max(len(s) for s in seqs)
    pad = tok.pad_token_id
    ids = torch.full((2, t), pad, dtype=torch.long)
    am = torch.zeros(2, t, dtype=torch.long)
    qm = torch.zeros(2, t, dtype=torch.bool)
    kr = torch.zeros(2, 2, dtype=torch.long)
    for i, (s, (na, nr)) in enumerate(zip(seqs, spans, strict=True)):
        o = t - len(s) if side == "left" else 0
        ids[i, o:o + len(s)] = torch.tensor(s)
        am[i, o:o + len(s)] = 1
        qm[i, o + na:o + na + nr] = True
        kr[i] = torch.tensor([o, o + na])
    assert spans[0] != spans[1] and bool((am == 0).any())
    return ids.to(DEVICE), am.to(DEVICE), qm.to(DEVICE), kr


@pytest.mark.slow
@pytest.mark.parametrize("side,backend", [("left", "torch"), ("right", "torch"),
                                          ("left", "triton"), ("right", "cpp")])
def test_hf_hook_matches_eager(model_tok, side, backend):
    _need(backend)
    model, tok = model_tok
    _assert_hook_matches_eager(model, *_padded_batch(tok, side), backend, atol=1e-4)


def _assert_hook_matches_eager(model, ids, am, qm, kr, backend, atol):
    """Entropies captured through the registered implementation equal those of eager
    ``output_attentions=True`` (0 on unflagged rows), the logits too, and the model's eager
    implementation is restored afterwards."""
    with torch.no_grad():
        ref = model(ids, attention_mask=am, output_attentions=True, use_cache=False)
        with capture_attention_entropy(model, qm, kr, backend=backend) as cap:
            assert model.config._attn_implementation != "eager"
            out = model(ids, attention_mask=am, use_cache=False)
    assert model.config._attn_implementation == "eager"  # restored
    cfg = model.config
    b, t = ids.shape
    assert cap.entropy.shape == (b, cfg.num_hidden_layers, cfg.num_attention_heads, t)
    want = torch.stack([eager_range_entropy(a, kr, qm) for a in ref.attentions], dim=1)
    assert torch.allclose(cap.entropy, want, atol=atol), (cap.entropy - want).abs().max()
    assert bool((cap.entropy[~qm[:, None, None, :].expand_as(cap.entropy)] == 0).all())
    assert float(want.max()) > 0.5
    real = am.bool()
    assert torch.allclose(out.logits[real], ref.logits[real], atol=atol), (
        (out.logits - ref.logits)[real].abs().max())


@pytest.mark.slow
def test_hf_hook_restores_on_error(model_tok):
    model, tok = model_tok
    ids, am, qm, kr = _padded_batch(tok, "left")
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention_entropy(model, qm, kr):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"
    # A forward with the wrong number of positions is refused with a clear message.
    with pytest.raises(ValueError, match="query_mask has"):
        with torch.no_grad(), capture_attention_entropy(model, qm[:, :-1], kr):
            model(ids, attention_mask=am, use_cache=False)
    assert model.config._attn_implementation == "eager"


# --------------------------------------------------------------------------- tiny GPT-2


def _random_padded_batch(vocab, side, gen):
    """Two random-id rows of different lengths, padded on ``side``: instruction keys then response
    queries. Returns ids, attention_mask, query_mask and key_range."""
    lens = [(9, 7), (4, 3)]  # (instruction, response) tokens per row
    t = max(a + r for a, r in lens)
    ids = torch.zeros(2, t, dtype=torch.long)
    am = torch.zeros(2, t, dtype=torch.long)
    qm = torch.zeros(2, t, dtype=torch.bool)
    kr = torch.zeros(2, 2, dtype=torch.long)
    for i, (na, nr) in enumerate(lens):
        n = na + nr
        o = t - n if side == "left" else 0
        ids[i, o:o + n] = torch.randint(0, vocab, (n,), generator=gen)
        am[i, o:o + n] = 1
        qm[i, o + na:o + n] = True
        kr[i] = torch.tensor([o, o + na])
    return ids.to(DEVICE), am.to(DEVICE), qm.to(DEVICE), kr


@pytest.mark.parametrize("side,inverse_layer_scale", [("right", False), ("left", True)])
def test_hf_hook_matches_eager_tiny_gpt2(side, inverse_layer_scale):
    """GPT-2 (absolute positions, its own per-layer ``scaling``) goes through the registered
    implementation: entropies and logits equal eager ``output_attentions=True``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     scale_attn_by_inverse_layer_idx=inverse_layer_scale,
                     attn_implementation="eager")
    model = GPT2LMHeadModel(cfg).to(DEVICE).eval()
    batch = _random_padded_batch(cfg.vocab_size, side, torch.Generator().manual_seed(1))
    assert batch[0].shape[0] == 2
    _assert_hook_matches_eager(model, *batch, "torch", atol=1e-5)


def test_gpu_launch_description_specialises_as_the_runtime_does():
    """The launch `bench static` compiles is the one a GPU runs: Triton specialises an int
    argument equal to 1 into a constexpr (GROUP when Hq == Hk) and marks ints divisible by 16
    (found by the dry run, `bench.gpu_model.dry_run`, which derives the signature as the runtime
    does)."""

    from bench.gpu_model.launches import attention_entropy as akl

    (same,) = akl.gpu_launches(1, 8, 8, 128, 128, 64, torch.bfloat16, causal=True)
    assert same.signature["GROUP"] == "constexpr" and same.constexprs["GROUP"] == 1
    assert {"Tq", "Tk"} <= set(same.extra["divisible_by_16"])
    (grouped,) = akl.gpu_launches(1, 8, 2, 100, 100, 64, torch.bfloat16, causal=False)
    assert grouped.signature["GROUP"] == "i32" and "GROUP" not in grouped.constexprs
    assert not {"Tq", "Tk"} & set(grouped.extra["divisible_by_16"])


# --------------------------------------------------------------------------- each layer's own mask


def _tiny_variant(kind):
    """Tiny eager models whose layers differ from plain causal attention: a 4-token sliding
    window on every layer (Mistral), a window on one of two layers plus score softcapping
    (Gemma 2), a window plus attention sinks (gpt-oss), 4-token chunks on one layer (Llama 4)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                 attn_implementation="eager")
    extra = {
        "mistral": dict(sliding_window=4),
        "gemma2": dict(sliding_window=4, head_dim=16, attn_logit_softcapping=2.0,
                       final_logit_softcapping=None),
        "gpt_oss": dict(sliding_window=4, head_dim=16, num_local_experts=2,
                        num_experts_per_tok=1, layer_types=["sliding_attention",
                                                            "full_attention"]),
        "llama4_text": dict(attention_chunk_size=4, head_dim=16, num_local_experts=2,
                            intermediate_size_mlp=64,
                            layer_types=["chunked_attention", "full_attention"]),
    }[kind]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **small, **extra))
    if kind == "gpt_oss":  # random sinks big enough to matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return model.to(DEVICE).eval()


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("kind", ["mistral", "gemma2", "gpt_oss", "llama4_text"])
def test_hf_hook_follows_each_layers_own_mask(kind, backend):
    """Windows, chunks, score softcapping and sinks: the captured entropies equal eager
    ``output_attentions=True`` (which applies each layer's own mask; sinks drop out of the
    range-renormalised entropy) and the logits are unchanged, so the outputs are right too.
    On cpp, gemma2's soft-capped layers fall back to "auto" (torch)."""
    _need(backend)
    model = _tiny_variant(kind)
    batch = _random_padded_batch(97, "right", torch.Generator().manual_seed(2))
    _assert_hook_matches_eager(model, *batch, backend, atol=1e-5)
