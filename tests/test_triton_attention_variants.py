"""The Triton attention kernel's layer variants (sliding window, chunks, score softcap, attention
sinks, a value head size other than D, given token positions with padded slots, GQA) against a
float64 reference written here, on awkward shapes: windows smaller than the keys and than a key
block, windows over a padded prefix, rows with no allowed key, one key, odd head sizes, query
blocks that straddle chunk boundaries. Runs in Triton's CPU interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) or on CUDA; shapes are small, the heavier ones are marked ``slow``."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import (
    DEVICE,
    attention_lse64,
    attention_within_torch_error,
    cascade_paths_agree,
    variant_model,
)
from icqs_fast.kernels import attention_entropy as ak

from bench.gpu_model.launches import attention_entropy as akl
from icqs_fast import backends, ops

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not backends.triton_interpreting(),
                                reason="triton needs CUDA or TRITON_INTERPRET=1")


def _check(out, lse, q, k, v, **kw):
    """``(out, lse)`` of ``q, k, v`` and options ``kw`` (``pv_dtype`` among them, see
    :func:`_helpers.attention_within_torch_error`) within the rule of tests/tolerance.py;
    rows without an allowed key: lse -inf and output 0 exactly."""
    rl = attention_lse64(q, k, v, **{n: x for n, x in kw.items() if n != "pv_dtype"})[1]
    assert out.shape[:3] == rl.shape == lse.shape and lse.dtype == torch.float32
    dead = torch.isneginf(rl)
    assert torch.equal(torch.isneginf(lse).cpu(), dead), "rows without keys: lse -inf"
    attention_within_torch_error(out, lse, q, k, v, **kw)
    assert bool((out.cpu()[dead] == 0).all())


def _qkv(b, hq, hk, tq, tk, d, dv=None, dtype=torch.float32, k_scale=1.5):
    q = torch.randn(b, hq, tq, d, device=DEVICE).to(dtype)
    k = (torch.randn(b, hk, tk, d, device=DEVICE) * k_scale).to(dtype)
    v = torch.randn(b, hk, tk, d if dv is None else dv, device=DEVICE).to(dtype)
    return q, k, v


# (B, Hq, Hk, Tq, Tk, D, Dv, causal, options). Windows / chunks smaller than a key block (16 in
# the interpreter) and larger; fewer queries than keys (query blocks that start mid-window);
# odd head sizes; GQA groups of 2 and 3.
CASES = {
    "window_smaller_than_keys": (2, 4, 2, 37, 37, 16, None, True, {"window": 5}),
    "window_of_one": (1, 2, 1, 20, 20, 8, None, True, {"window": 1}),
    "window_wider_than_keys": (1, 2, 2, 9, 23, 16, None, True, {"window": 64}),
    "window_left_padded_prefix": (3, 6, 2, 9, 41, 12, None, True, {"window": 13, "pad": True}),
    "window_not_causal": (1, 2, 1, 7, 30, 16, None, False, {"window": 20}),
    "softcap": (2, 4, 2, 10, 29, 12, None, True, {"softcap": 2.0}),
    "softcap_window_gqa3": (1, 6, 2, 17, 33, 16, None, True, {"softcap": 5.0, "window": 9}),
    "value_dim_odd": (2, 4, 2, 11, 26, 12, 20, True, {"pad": True}),
    "value_dim_smaller_window": (1, 4, 1, 18, 18, 24, 8, True, {"window": 7}),
    "chunk_causal": (1, 4, 2, 21, 45, 16, None, True, {"chunk": 12}),
    "chunk_not_causal": (2, 2, 1, 19, 19, 8, None, False, {"chunk": 6}),
    "one_key": (1, 2, 1, 1, 1, 8, None, True, {"window": 3, "softcap": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_variants_against_float64(case):
    """``ops.attention_lse(backend="triton")`` against float64: output, lse, dead rows."""
    b, hq, hk, tq, tk, d, dv, causal, opt = CASES[case]
    opt = dict(opt)
    q, k, v = _qkv(b, hq, hk, tq, tk, d, dv, k_scale=4.0 if "softcap" in opt else 1.5)
    am = None
    if opt.pop("pad", False):
        am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
        am[0, : tk // 2] = False  # a left-padded prefix longer than the window
        if b > 2:
            am[2] = False  # no real key at all
    out, lse = ops.attention_lse(q, k, v, scale=0.3, causal=causal, attention_mask=am,
                                 backend="triton", **opt)
    _check(out, lse, q, k, v, scale=0.3, causal=causal, attention_mask=am, **opt)


def _cascade_positions(lengths, s, rows, p_max):
    """The cascade's prefix-part positions: query row r is suffix token r % s at
    ``lengths[g] + r % s``; prefix slot j at j, padded slots (j >= lengths[g]) at -1."""
    lens = torch.tensor(lengths)
    q_pos = lens[:, None] + torch.arange(rows)[None, :] % s
    j = torch.arange(p_max)
    k_pos = torch.where(j[None, :] < lens[:, None], j[None, :], -1)
    return q_pos.to(DEVICE), k_pos.to(DEVICE)


@pytest.mark.parametrize("opt", [{"window": 6}, {"chunk": 8}, {"window": 40, "softcap": 3.0},
                                 {}])
def test_cascade_prefix_part_positions(opt):
    """The cascade's prefix part of a local layer: stacked suffix queries (several suffix
    tokens per query block) against each entry's padded prefix slots, the window / chunk on
    the token positions; entry 1 is empty (every row dead)."""
    lengths, s, n, hq, hk, d = [19, 0, 7], 3, 2, 4, 2, 16
    rows = n * (hq // hk) * s
    q, k, v = _qkv(3, hk, hk, rows, 19, d)
    pos = _cascade_positions(lengths, s, rows, 19)
    out, lse = ops.attention_lse(q, k, v, scale=0.25, causal=True, positions=pos,
                                 backend="triton", **opt)
    _check(out, lse, q, k, v, scale=0.25, causal=True, positions=pos, **opt)
    assert bool(torch.isneginf(lse[1]).all())


def test_positions_with_padding_inside_and_unordered_slots():
    """Given positions need not grow with the slot: padding inside the sequence (-1), keys in
    shuffled slots, queries at negative positions (no allowed key: lse -inf, output 0)."""
    b, hq, hk, tq, tk, d = 2, 2, 1, 6, 24, 8
    q, k, v = _qkv(b, hq, hk, tq, tk, d)
    k_pos = torch.stack([torch.randperm(tk), torch.arange(tk)]) - 3  # 3 padded slots each
    q_pos = torch.tensor([[20, 21, 22, 23, 5, 1], [-1, -5, 2, 9, 10, 11]])
    pos = (q_pos.to(DEVICE), k_pos.to(DEVICE))
    for opt in ({"window": 4}, {"chunk": 5}):
        out, lse = ops.attention_lse(q, k, v, scale=0.5, causal=True, positions=pos,
                                     backend="triton", **opt)
        _check(out, lse, q, k, v, scale=0.5, causal=True, positions=pos, **opt)
        assert bool(torch.isneginf(lse[1, :, :2]).all())  # before every key


def test_sinks():
    """Sink logits per query head: the output shrinks by the sink's share of the denominator,
    the log-sum-exp stays that of the keys; a sink far above the scores (+60 nats: its weight
    2^86 overflows nothing) and far below; a dead row stays 0 and -inf."""
    b, hq, hk, tq, tk, d = 2, 4, 2, 13, 27, 16
    q, k, v = _qkv(b, hq, hk, tq, tk, d)
    am = torch.ones(b, tk, dtype=torch.bool, device=DEVICE)
    am[1] = False
    sinks = torch.tensor([0.5, 60.0, -40.0, 2.0], device=DEVICE)
    for opt in ({}, {"window": 4}):
        out, lse = ak.attention_lse(q, k, v, scale=0.3, causal=True, attention_mask=am,
                                    sinks=sinks, **opt)
        _check(out, lse, q, k, v, scale=0.3, causal=True, attention_mask=am, sinks=sinks,
               **opt)
        assert float(out[0, 1].abs().max()) < 1e-20  # all the mass on the +60 sink


def test_sinks_and_variants_with_the_entropy_state():
    """The entropy build shares the variant code: its output and lse equal the lse build's."""
    b, hq, hk, tq, tk, d = 1, 2, 1, 9, 21, 8
    q, k, v = _qkv(b, hq, hk, tq, tk, d, dv=12)
    kr = torch.tensor([[3, 15]], device=DEVICE)
    qm = torch.ones(b, tq, dtype=torch.bool, device=DEVICE)
    sinks = torch.tensor([1.0, -1.0], device=DEVICE)
    o1, ent, l1 = ak.launch_attention(q, k, v, causal=True, scale=0.4, key_range=kr,
                                      query_mask=qm, return_lse=True, window=6, softcap=2.5,
                                      sinks=sinks)
    o2, l2 = ak.attention_lse(q, k, v, scale=0.4, causal=True, window=6, softcap=2.5,
                              sinks=sinks)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert bool(torch.isfinite(ent).all()) and bool((ent >= 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_inputs(dtype):
    """16-bit q/k/v with a window, softcap and Dv != D: judged by the same code with the
    probabilities and the output rounded to 16 bits (on a GPU the kernel rounds both)."""
    q, k, v = _qkv(1, 4, 2, 12, 30, 16, dv=24, dtype=dtype)
    out, lse = ops.attention_lse(q, k, v, scale=0.25, causal=True, window=9, softcap=4.0,
                                 backend="triton")
    assert out.dtype == dtype
    _check(out, lse, q, k, v, scale=0.25, causal=True, window=9, softcap=4.0)


@pytest.mark.slow
@pytest.mark.parametrize("opt", [{"window": 37}, {"chunk": 32, "softcap": 8.0},
                                 {"window": 50, "pad": True}])
def test_longer_keys(opt):
    """Several key blocks before, inside and after the window / chunk for every query block."""
    opt = dict(opt)
    b, hq, hk, tq, tk, d = 2, 4, 1, 70, 150, 32
    q, k, v = _qkv(b, hq, hk, tq, tk, d, dv=20, k_scale=3.0)
    am = None
    if opt.pop("pad", False):
        am = torch.rand(b, tk, device=DEVICE) > 0.3
    out, lse = ops.attention_lse(q, k, v, scale=0.2, causal=True, attention_mask=am,
                                 backend="triton", **opt)
    _check(out, lse, q, k, v, scale=0.2, causal=True, attention_mask=am, **opt)


def test_gpu_launches_of_the_variants():
    """``gpu_launches`` describes each variant as the launcher builds it: the constexpr
    switches, the value head size, the exact allowed-pair count of windows and chunks, the
    key blocks the loop bounds visit, every kernel parameter in the signature."""
    b, hq, hk, tq, tk, d = 1, 8, 2, 300, 700, 128
    (ln,) = akl.gpu_launches(b, hq, hk, tq, tk, d, torch.bfloat16, True, entropy=False,
                            lse=True, window=128, softcap=50.0, sinks=True, dv=64)
    c = ln.constexprs
    assert (c["HAS_WINDOW"], c["HAS_SOFTCAP"], c["HAS_SINKS"], c["RETURN_LSE"]) == (True,) * 4
    assert (c["HAS_POS"], c["HAS_CHUNK"], c["EVEN_N"]) == (False, False, False)
    assert (c["HEAD_DIM"], c["HEAD_DV"], c["BLOCK_DV"]) == (128, 64, 64)
    pairs = sum(min(p + 1, 128) for p in range(tk - tq, tk))
    assert ln.tensor_flops == 2 * (128 + 64) * b * hq * pairs
    assert set(ln.signature) == set(ak._attn_entropy_fwd.arg_names)
    cfg = ak.attention_settings(b, hq, tq, tk, d, torch.bfloat16, dv=64, local=True)
    first = tk - tq  # the first query block's rows see keys first - 127 .. first + bm - 1
    lo = (first - 127) // cfg.block_n
    assert akl._key_blocks(cfg, tq, tk, True, 128)[0] == math.ceil((first + cfg.block_m)
                                                                  / cfg.block_n) - lo
    (ch,) = akl.gpu_launches(b, hq, hk, tq, tk, d, torch.bfloat16, False, entropy=False,
                            lse=True, chunk=100)
    assert ch.elements == b * hq * sum(100 for _ in range(tq))
    (pos,) = akl.gpu_launches(b, hq, hk, tq, tk, d, torch.bfloat16, True, entropy=False,
                             lse=True, positions=True, window=128)
    every = ak.attention_settings(b, hq, tq, tk, d, torch.bfloat16, has_keyok=True, local=True)
    assert pos.constexprs["HAS_POS"] and pos.loop_iters == math.ceil(tk / every.block_n)


def test_bf16_products_of_fp32_inputs():
    """``dot_dtype=torch.bfloat16`` (fp32 activations against a bf16 bank): the products of the
    bf16-rounded inputs, accumulated in fp32: the float64 result of the rounded inputs (on a GPU
    the probabilities also enter the PV product as bf16)."""
    q, k, v = _qkv(2, 4, 2, 9, 35, 16, dv=12)
    out, lse = ops.attention_lse(q, k, v, scale=0.3, causal=True, window=11,
                                 dot_dtype=torch.bfloat16, backend="triton")
    r = [x.to(torch.bfloat16).float() for x in (q, k, v)]
    # On a GPU the probabilities enter the PV product as bf16; the interpreter's dots are fp32.
    _check(out, lse, *r, scale=0.3, causal=True, window=11,
           pv_dtype=None if backends.triton_interpreting() else torch.bfloat16)
    exact, _ = attention_lse64(q, k, v, scale=0.3, causal=True, window=11)
    assert float((out.double().cpu() - exact).abs().max()) > 1e-4  # the rounding is real


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window", "softcap", "sinks"])
def test_cascade_takes_the_triton_kernel(kind, monkeypatch):
    """Cascade attention with the Triton kernel forced (``ICQS_FAST_CASCADE_ATTENTION=triton``:
    the bank forwards and both cascade parts, local layers through token positions) equals the
    torch path: sliding windows, a strong soft cap, sinks (added at the merge), GQA, prefixes of
    different lengths; on CUDA ``"auto"`` picks the same kernel (the support table)."""
    model, cfg = variant_model(kind)
    calls = []
    real = ops.attention_lse
    monkeypatch.setattr(ops, "attention_lse", lambda *a, **k: calls.append(k) or real(*a, **k))
    cascade_paths_agree(model, cfg, monkeypatch, "triton")
    assert calls and all(c.get("backend") == "triton" for c in calls)
    if kind != "softcap":
        assert any(c.get("window") for c in calls)
