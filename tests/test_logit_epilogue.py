"""linear_token_stats' logit epilogue (``logit_scale``, ``softcap``) on every backend, against an
independent float64 reference built from hidden, weight and bias.

The contract (ops.linear_token_stats): statistics of softmax(z / T) with
``z = (h W^T + b) * logit_scale``, then ``z = softcap * tanh(z / softcap)``; ``target_rank`` and
``is_greedy`` order the logits before the cap (tanh is increasing), ``is_greedy`` also needs a
finite capped target logit. The triton backend runs in Triton's interpreter on the CPU (small
shapes: it does ~1M logits/s).
"""

import math

import pytest
import torch
from _helpers import DEVICE, ref_token_stats64
from hypothesis import given, settings
from hypothesis import strategies as st
from test_token_stats import compare

from icqs_fast import ops, torch_ops
from icqs_fast.backends import cpp_backend

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              # The interpreter's numpy warns on -inf / NaN logits (masked entries by design).
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

NEEDS_CPP = pytest.mark.skipif(not cpp_backend.available()[0], reason="icqs_fast._C not built")
BACKENDS = ["torch", pytest.param("cpp", marks=NEEDS_CPP), "triton"]
# (logit_scale, softcap, temperature): scale < 1 and > 1, negative, cap alone, cap + temperature,
# a cap small enough to saturate most logits.
COMBOS = [(0.25, None, 1.0), (3.0, None, 0.7), (-1.5, None, 1.0), (1.0, 30.0, 1.0),
          (0.5, 5.0, 0.8), (2.5, 3.0, 1.3), (-0.7, 10.0, 1.0), (1.0, 0.5, 1.0)]


def dev_for(backend):
    return "cpu" if backend == "cpp" else DEVICE


def ref64(h, w, t, b=None, *, scale=1.0, softcap=None, temperature=1.0, ignore_index=-100,
          dtype=torch.float64):
    """Statistics of the post-processed logits (the ranks: of the uncapped ones), computed in
    ``dtype``: float64 the reference, float32 the same code in the kernels' dtype."""
    z = h.to(dtype) @ w.to(dtype).t()
    if b is not None:
        z = z + b.to(dtype)
    z = z * scale
    if softcap is None:
        return ref_token_stats64(z, t, ignore_index, temperature, dtype)
    zc = softcap * torch.tanh(z / softcap)
    out = ref_token_stats64(zc, t, ignore_index, temperature, dtype)
    valid = t != ignore_index
    tt = torch.where(valid, t, torch.zeros_like(t))
    z_t = z.gather(1, tt[:, None])[:, 0]
    idx = torch.arange(z.shape[1])[None, :]
    larger = (z > z_t[:, None]).sum(-1)
    tie_before = ((z == z_t[:, None]) & (idx < tt[:, None])).sum(-1)
    finite = torch.isfinite(zc.gather(1, tt[:, None])[:, 0])
    out.target_rank = torch.where(valid, larger, torch.zeros_like(larger))
    out.is_greedy = valid & finite & (larger == 0) & (tie_before == 0)
    return out


def refs(h, w, t, b=None, **kw):
    """What :func:`test_token_stats.compare` takes: :func:`ref64` in float64 and in float32."""
    return ref64(h, w, t, b, **kw), ref64(h, w, t, b, **kw, dtype=torch.float32)


def run(backend, h, w, t, b=None, **kw):
    dev = dev_for(backend)
    out = ops.linear_token_stats(h.to(dev), w.to(dev), t.to(dev),
                                 bias=None if b is None else b.to(dev), backend=backend,
                                 chunk_tokens=3, chunk_vocab=97, **kw)
    return out.map(lambda x: x.cpu())


def inputs(n=7, h=16, v=300, dtype=torch.float32, spread=3.0):
    """V = 300: not a multiple of any block (128 in the interpreter, 97 on the chunked path);
    row 2 ignored; a -inf bias column (never a target here) and a +5 column."""
    hid = torch.randn(n, h)
    w = torch.randn(v, h) * (spread / h**0.5)
    b = torch.randn(v)
    b[17] = float("-inf")
    b[min(250, v - 1)] = 5.0
    t = torch.randint(0, v, (n,))
    t[t == 17] = 18
    if n > 2:
        t[2] = -100
    return hid.to(dtype), w.to(dtype), b.to(dtype), t


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_softcap_temperature_fp32(backend):
    hid, w, b, t = inputs()
    for scale, cap, temp in COMBOS:
        kw = dict(logit_scale=scale, softcap=cap, temperature=temp)
        out = run(backend, hid, w, t, b, **kw)
        compare(out, *refs(hid, w, t, b, scale=scale, softcap=cap, temperature=temp))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_and_no_bias(backend):
    hid, w, _, t = inputs(n=1, v=131)
    for scale, cap, temp in COMBOS[3:6]:
        out = run(backend, hid, w, t, logit_scale=scale, softcap=cap, temperature=temp)
        compare(out, *refs(hid, w, t, scale=scale, softcap=cap, temperature=temp))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_turns_minus_inf_into_minus_cap(backend):
    """A -inf bias entry is the finite -softcap after the cap (tanh(-inf) = -1): it enters the
    softmax, also as a target (finite log-prob, last rank); a NaN entry stays masked."""
    hid, w, b, t = inputs(n=5)
    b[40] = float("nan")
    t[0] = 17  # the -inf column as a target
    for scale, cap in ((1.0, 4.0), (-2.0, 4.0), (0.3, 1.0)):
        out = run(backend, hid, w, t, b, logit_scale=scale, softcap=cap)
        compare(out, *refs(hid, w, t, b, scale=scale, softcap=cap))
        assert math.isfinite(float(out.logprob[0]))
    out = run(backend, hid, w, t, b, softcap=4.0)
    assert int(out.target_rank[0]) == 300 - 2  # every other column but the NaN one is larger


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_logits(backend):
    """Logits of +-100 under a cap of 5 (|z| / c = 20: tanh is exactly +-1 in fp32 and in
    float64 alike): the capped distribution is flat over the saturated entries, while the ranks
    still order the uncapped logits (no ties made by the saturation)."""
    n, h, v = 4, 8, 150
    hid = torch.randn(n, h)
    w = torch.randn(v, h) / 10
    b = torch.zeros(v)
    b[:60] = 100.0 + torch.arange(60.0)     # saturated at +cap, all distinct
    b[60:90] = -100.0 - torch.arange(30.0)  # saturated at -cap
    t = torch.tensor([0, 59, 75, 120])
    for temp in (1.0, 0.5):
        out = run(backend, hid, w, t, b, softcap=5.0, temperature=temp)
        compare(out, *refs(hid, w, t, b, softcap=5.0, temperature=temp))
    assert out.target_rank[1] == 0 and bool(out.is_greedy[1])  # the largest uncapped logit
    assert out.target_rank[0] == 59 and not bool(out.is_greedy[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_common_offset(backend):
    """A common offset of 300 on every logit: softmax-invariant without the cap (the fp32
    logits keep ~3e-5 of absolute rounding there, which the same code in fp32 pays too),
    saturating with it."""
    hid, w, b, t = inputs()
    b = torch.randn(300) + 300.0
    for scale, cap in ((0.5, None), (2.0, None), (1.0, 30.0), (0.05, 30.0)):
        out = run(backend, hid, w, t, b, logit_scale=scale, softcap=cap)
        compare(out, *refs(hid, w, t, b, scale=scale, softcap=cap))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(backend, dtype):
    """16-bit hidden/weight/bias (the reference uses the same rounded values in float64; the
    kernels accumulate in fp32)."""
    hid, w, b, t = inputs(dtype=dtype)
    for scale, cap, temp in ((0.5, 5.0, 0.8), (3.0, None, 1.0)):
        out = run(backend, hid, w, t, b, logit_scale=scale, softcap=cap, temperature=temp)
        compare(out, *refs(hid.float(), w.float(), t, b.float(), scale=scale, softcap=cap,
                           temperature=temp))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_folds_into_the_temperature_bit_for_bit(backend):
    """Without a cap the scale is the temperature's divisor: (scale 2, T 2) is (1, 1) bit for
    bit, and the defaults passed explicitly change nothing; a negative scale is the negated
    hidden state (exact)."""
    hid, w, b, t = inputs(n=4, v=200)
    base = run(backend, hid, w, t, b)
    for kw in (dict(logit_scale=2.0, temperature=2.0), dict(logit_scale=1.0, softcap=None)):
        got = run(backend, hid, w, t, b, **kw)
        for name in ("logprob", "entropy", "varentropy", "logprob_var", "max_logprob",
                     "is_greedy", "target_rank"):
            assert torch.equal(getattr(got, name), getattr(base, name)), (kw, name)
    neg = run(backend, hid, w, t, b, logit_scale=-1.0)
    pos = run(backend, -hid, w, t, -b)
    assert torch.equal(neg.logprob, pos.logprob) and torch.equal(neg.target_rank, pos.target_rank)


@NEEDS_CPP
@settings(max_examples=25)
@given(scale=st.floats(0.05, 20.0) | st.floats(-20.0, -0.05), temp=st.floats(0.2, 3.0),
       cap=st.none() | st.floats(0.3, 60.0), seed=st.integers(0, 2**16))
def test_property_cpp_and_torch_match_float64(scale, temp, cap, seed):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 5, 12, 257
    hid = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.8
    b = torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    ref = refs(hid, w, t, b, scale=scale, softcap=cap, temperature=temp)
    for backend in ("cpp", "torch"):
        out = run(backend, hid, w, t, b, logit_scale=scale, softcap=cap, temperature=temp)
        compare(out, *ref)


BAD = [
    (dict(logit_scale=0.0), "logit_scale must be a finite number != 0, got 0.0"),
    (dict(logit_scale=float("nan")), "logit_scale must be a finite number != 0, got nan"),
    (dict(logit_scale=float("inf")), "logit_scale must be a finite number != 0, got inf"),
    (dict(logit_scale=True), "logit_scale must be a finite number != 0, got True"),
    (dict(logit_scale="2"), "logit_scale must be a finite number != 0, got '2'"),
    (dict(softcap=0.0), "softcap must be None or a finite number > 0, got 0.0"),
    (dict(softcap=-30.0), "softcap must be None or a finite number > 0, got -30.0"),
    (dict(softcap=float("inf")), "softcap must be None or a finite number > 0, got inf"),
    (dict(softcap=float("nan")), "softcap must be None or a finite number > 0, got nan"),
    (dict(softcap=1e-300), "outside float32's range"),
    (dict(logit_scale=1e-300), "outside float32's range"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_validation(backend):
    """The same ValueError on every backend (checked in ops before dispatch), and through the
    torch.library wrapper."""
    hid, w, b, t = inputs(n=3, v=50)
    for kw, msg in BAD:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            run(backend, hid, w, t, b, **kw)
    for kw, msg in BAD[:9]:
        with pytest.raises(ValueError, match=msg):
            torch_ops.linear_token_stats(hid, w, t, bias=b, backend="torch", **kw)


def test_torch_op_schema_and_opcheck():
    """The registered op takes the two arguments (defaults 1.0 and None) and passes opcheck
    (fake implementation, schema, no mutation) with the epilogue on."""
    schema = str(torch.ops.icqs_fast.linear_token_stats.default._schema)
    assert "float logit_scale=1." in schema and "float? softcap=None" in schema
    hid, w, b, t = inputs(n=4, v=60)
    args = (hid, w, t, b, -100, 0.9, "auto", 3, 16, 0.5, 7.0)
    torch.library.opcheck(torch.ops.icqs_fast.linear_token_stats.default, args)
    got = torch_ops.linear_token_stats(hid, w, t, bias=b, temperature=0.9, chunk_tokens=3,
                                       chunk_vocab=16, logit_scale=0.5, softcap=7.0)
    compare(got, *refs(hid, w, t, b, scale=0.5, softcap=7.0, temperature=0.9))
