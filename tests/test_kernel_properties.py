"""Property-based tests (hypothesis) of the three kernel ops on every backend here, against
float64 references written in this file.

The references are deliberately small and share no code with the package (not even its torch
backend, whose state/merge code the fast paths reuse): the log-softmax, its moments and the
attention softmax are computed directly in float64 from the inputs (cast exactly from their
dtype).

Inputs are drawn as a few parameters plus a seed (the tensors come from a seeded
``torch.Generator``), so hypothesis shrinks shapes and features, and every failing case can be
pinned with ``@example(case=...)`` as plain data. Runs are derandomised (same examples every run,
no example database) with a fixed example budget per test; the Triton interpreter (~1M elements
per second) gets smaller shapes and fewer examples.

Semantics the references fix (from ``icqs_fast.types.TokenStats`` and
``icqs_fast.backends.state``):

* non-finite logits (``-inf``, ``+inf``, NaN) other than the target's are masked vocabulary
  entries: left out of the softmax, its moments and ``logprob_var``; they still count in
  ``target_rank`` when they compare larger (``+inf``);
* ``logprob = z_t / T - logsumexp(finite z / T)`` in IEEE arithmetic (NaN or infinite for a
  non-finite target); ``is_greedy`` needs a finite target, no larger entry and no equal entry
  at a lower index; ``target_rank`` counts strictly larger entries;
* rows whose target is ``ignore_index`` are all zero and not valid.
"""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import ref_token_stats
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from icqs_fast import backends, ops
from icqs_fast.types import FLOAT_FIELDS

# The Triton interpreter evaluates masked-out lanes too (inf - inf there): numpy's warnings.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.usefixtures("one_torch_thread")]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EPS32 = 2.0**-24  # fp32 unit roundoff
# Output rounding of the attention output, which is returned in the input dtype.
EPS_OUT = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}

TOKEN_BACKENDS = [b for b in ("torch", "cpp", "triton") if backends.availability()[b][0]]
ATTN_BACKENDS = ["torch"] + [b for b in ("triton", "cpp") if b in TOKEN_BACKENDS]
# Example budgets and shape limits per backend. The Triton interpreter costs ~0.05-0.1 s per
# program (one row of token_stats, one 16-row x 128-column tile of linear_token_stats, one
# 16-query block of attention) on the shared 2-core machine: few rows and examples there.
TOKEN_LIMITS = {"torch": dict(n=300, elems=200_000, examples=40),
                "cpp": dict(n=300, elems=400_000, examples=60),
                "triton": dict(n=6, elems=24_000, examples=10)}
LINEAR_LIMITS = {"torch": dict(n=200, v=3000, h=80, elems=60_000, examples=30),
                 "cpp": dict(n=200, v=3000, h=80, elems=60_000, examples=40),
                 "triton": dict(n=16, v=140, h=24, elems=2_500, examples=8)}
# Absolute error floor of the float outputs per backend: cpp and torch keep float64 states,
# the Triton kernels accumulate in fp32 (observed worst errors use < 40% of these with the
# per-row rounding terms below).
BASE_TOL = {"torch": 2e-6, "cpp": 2e-6, "triton": 5e-6}
ATTN_LIMITS = {"torch": dict(b=2, hk=2, tq=40, elems=600_000, examples=40),
               "cpp": dict(b=2, hk=2, tq=40, elems=600_000, examples=40),
               "triton": dict(b=1, hk=1, tq=16, elems=60_000, examples=8)}


def _settings(n: int):
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


# --------------------------------------------------------------------------- references


def ref_attention(q, k, v, key_range, query_mask, attention_mask, causal, scale):
    """float64 attention output [B, Hq, Tq, D] and range entropy [B, Hq, Tq] from the full
    score matrix (see :func:`icqs_fast.ops.attention_entropy` for the definition)."""
    b, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    k64 = k.double().repeat_interleave(hq // hk, dim=1)
    v64 = v.double().repeat_interleave(hq // hk, dim=1)
    s = q.double() @ k64.transpose(-1, -2) * scale
    allow = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    if attention_mask is not None:
        allow = allow & attention_mask[:, None, None, :]
    if causal:
        allow = allow & (torch.arange(tk)[None, :] <= (tk - tq) + torch.arange(tq)[:, None])
    allow = allow.expand(b, hq, tq, tk)

    def softmax(mask):
        sm = s.masked_fill(~mask, -math.inf)
        any_ = mask.any(-1, keepdim=True)
        mx = torch.where(any_, sm.amax(-1, keepdim=True), torch.zeros_like(sm[..., :1]))
        e = torch.exp(sm - mx)
        return e / torch.where(any_, e.sum(-1, keepdim=True), torch.ones_like(mx)), any_[..., 0]

    p, _ = softmax(allow)
    out = p @ v64
    k0 = key_range[:, 0].clamp(0, tk)
    k1 = key_range[:, 1].clamp(0, tk)
    kpos = torch.arange(tk)
    in_range = (kpos[None, :] >= k0[:, None]) & (kpos[None, :] < k1[:, None])
    pr, any_r = softmax(allow & in_range[:, None, None, :])
    ent = -torch.where(pr > 0, pr * torch.log(pr), torch.zeros_like(pr)).sum(-1)
    ent = torch.where(any_r & query_mask[:, None, :], ent, torch.zeros_like(ent))
    return out, ent


# --------------------------------------------------------------------------- comparison


def _assert_close(name, got, want, tol):
    """Elementwise |got - want| <= tol, NaN where want is NaN, equal infinities."""
    got, want = got.double(), want.double()
    tol = torch.as_tensor(tol, dtype=torch.float64).expand_as(want)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{name}: NaN at {torch.isnan(got).nonzero()}" \
        f" vs expected {nan.nonzero()}"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]) and not torch.isinf(got[~inf]).any(), \
        f"{name}: infinities differ\n{got}\n{want}"
    ok = ~nan & ~inf
    err = (got[ok] - want[ok]).abs()
    bad = err > tol[ok]
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        where = ok.nonzero()[i].tolist()
        pytest.fail(f"{name}: {int(bad.sum())} elements off, first at {where}: got "
                    f"{got[ok][i].item():.9g}, want {want[ok][i].item():.9g}, err "
                    f"{err[i].item():.3g} > tol {tol[ok][i].item():.3g}")


def _check_stats(out, ref, n, tol_row, base, rtol, z_slack=None, z=None, t=None):
    """Compare a TokenStats with a reference dict. ``tol_row`` [N]: per-row absolute error scale
    of the scaled logits (their fp32 rounding); ``z_slack`` (linear op): the bound on each
    computed logit's error, within which a rank or greedy decision may go either way."""
    for name in FLOAT_FIELDS:
        g = getattr(out, name)
        assert g.shape == (n,) and g.dtype == torch.float32, (name, g.shape, g.dtype)
    assert out.valid.dtype == torch.bool and out.is_greedy.dtype == torch.bool
    assert out.target_rank.dtype == torch.int64
    assert torch.equal(out.valid, ref["valid"])
    r = ref
    ent_scale = 1.0 + r["entropy"].abs() + r["varentropy"].sqrt()
    tols = {
        "logprob": base + rtol * r["logprob"].abs() + 4 * tol_row,
        "max_logprob": base + rtol * r["max_logprob"].abs() + 4 * tol_row,
        "entropy": base + rtol * r["entropy"].abs() + 4 * tol_row * ent_scale,
        "varentropy": base + rtol * r["varentropy"].abs() + 8 * tol_row * ent_scale ** 2,
        # Variance of up to V scaled logits: relative error of the accumulation, plus the
        # logits' own rounding times their spread.
        "logprob_var": base + 10 * rtol * r["logprob_var"].abs()
        + 4 * tol_row * (1 + r["logprob_var"].sqrt()),
    }
    for name, tol in tols.items():
        _assert_close(name, getattr(out, name), r[name], tol)
    if z_slack is None:
        assert torch.equal(out.target_rank, r["target_rank"]), \
            f"target_rank\n{out.target_rank}\n{r['target_rank']}"
        assert torch.equal(out.is_greedy, r["is_greedy"]), \
            f"is_greedy\n{out.is_greedy}\n{r['is_greedy']}"
        return
    # Computed logits: decisions within the logits' error bound may go either way.
    valid = r["valid"]
    tt = torch.where(valid, t, torch.zeros_like(t))
    z_t = z.gather(1, tt[:, None])
    sl = z_slack[:, None]
    lo = torch.where(valid, (z > z_t + sl).sum(-1), 0)
    hi = torch.where(valid, (z > z_t - sl).sum(-1), 0)
    assert ((lo <= out.target_rank) & (out.target_rank <= hi)).all(), \
        f"target_rank\n{out.target_rank}\n{lo}\n{hi}"
    idx = torch.arange(z.shape[1])[None, :]
    near = (((z - z_t).abs() <= sl) & (idx != tt[:, None])).any(-1)
    decided = ~near
    assert torch.equal(out.is_greedy[decided], r["is_greedy"][decided]), "is_greedy"


# --------------------------------------------------------------------------- token_stats


def token_cases(lim: dict, nonfinite: bool):
    """Parameters of one token_stats input (tensors are built from ``seed``)."""
    return st.fixed_dictionaries({
        "n": st.integers(0, lim["n"]),
        "v": st.integers(1, 4000),
        "dtype": st.sampled_from(list(DTYPES)),
        "temperature": st.sampled_from([1.0, 0.5, 2.0, 0.3, 3.7]),
        "scale": st.sampled_from([1.0, 0.01, 8.0, 40.0]),
        "offset": st.sampled_from([0.0, 1000.0, -1000.0, 1e4, -1e4]),
        "neginf": st.sampled_from([0.0, 0.0, 0.2, 0.95, 1.0]),
        "nan": st.sampled_from([0, 0, 1, 5]) if nonfinite else st.just(0),
        "posinf": st.sampled_from([0, 0, 1]) if nonfinite else st.just(0),
        "extremes": st.sampled_from([0, 0, 3]),
        "ties": st.booleans(),
        "ignore_index": st.sampled_from([-100, -1, 0]),
        "ignored": st.sampled_from([0.0, 0.3, 1.0]),
        "layout": st.sampled_from(["contiguous", "row_padded", "col_strided"]),
        "seed": st.integers(0, 2**31 - 1),
    }).map(lambda c: _bound(c, lim["elems"]))


def _bound(c: dict, max_elems: int) -> dict:
    if c["n"] * c["v"] > max_elems:  # keep V as drawn (blocks, tails), cut the rows
        c = dict(c, n=max(1, max_elems // c["v"]))
    return c


def build_logits(c: dict):
    """(logits [N, V] in the case's dtype and layout, targets [N] int64)."""
    g = torch.Generator().manual_seed(c["seed"])
    n, v = c["n"], c["v"]
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * c["scale"]
    if c["ties"]:
        z = z.round()
    z = z + c["offset"]
    if c["extremes"]:
        i = torch.randint(0, max(n * v, 1), (c["extremes"],), generator=g)
        vals = torch.tensor([1e4, -1e4, 1e4], dtype=torch.float64)[:c["extremes"]]
        z.view(-1)[i[i < n * v]] = vals[i < n * v]
    u = torch.rand(n, v, generator=g)
    z[u < c["neginf"]] = -math.inf
    for count, val in ((c["nan"], math.nan), (c["posinf"], math.inf)):
        if count and n:
            i = torch.randint(0, n * v, (count,), generator=g)
            z.view(-1)[i] = val
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < c["ignored"]] = c["ignore_index"]
    dt = DTYPES[c["dtype"]]
    if c["layout"] == "row_padded":
        big = torch.zeros(n, v + 5, dtype=dt)
        big[:, 2:v + 2] = z.to(dt)
        zz = big[:, 2:v + 2]
    elif c["layout"] == "col_strided":
        big = torch.zeros(n, 2 * v, dtype=dt)
        big[:, ::2] = z.to(dt)
        zz = big[:, ::2]
    else:
        zz = z.to(dt)
    return zz, t


def _row_rounding(zz: torch.Tensor, temp: float) -> torch.Tensor:
    """Per row, the fp32 rounding error scale of the scaled logits z / T: eps32 * max |z / T|
    over finite entries (a fp32 implementation cannot represent them more closely)."""
    x = zz.double() / temp
    x = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    return EPS32 * (x.amax(-1) if x.shape[1] else torch.zeros(x.shape[0], dtype=x.dtype))


def _run_token_stats(c: dict, backend: str):
    zz, t = build_logits(c)
    out = ops.token_stats(zz, t, ignore_index=c["ignore_index"], temperature=c["temperature"],
                          backend=backend)
    ref = ref_token_stats(zz, t, c["ignore_index"], c["temperature"])
    tol = _row_rounding(zz, c["temperature"])
    n = c["n"]
    _check_stats(out, ref, n, tol, base=BASE_TOL[backend], rtol=2e-6)


def _token_test(backend: str):
    lim = TOKEN_LIMITS[backend]

    @_settings(lim["examples"])
    @given(case=token_cases(lim, True))
    # Shapes around the Triton block sizes and the interpreter's, an all-masked row, V = 1.
    @example(case=dict(n=3, v=1, dtype="fp32", temperature=1.0, scale=1.0, offset=0.0,
                       neginf=0.0, nan=0, posinf=0, extremes=0, ties=False, ignore_index=-100,
                       ignored=0.0, layout="contiguous", seed=0))
    @example(case=dict(n=5, v=1025, dtype="bf16", temperature=0.3, scale=40.0, offset=1e4,
                       neginf=0.2, nan=0, posinf=0, extremes=3, ties=True, ignore_index=0,
                       ignored=0.3, layout="row_padded", seed=1))
    @example(case=dict(n=4, v=17, dtype="fp16", temperature=2.0, scale=8.0, offset=-1e4,
                       neginf=1.0, nan=0, posinf=0, extremes=0, ties=False, ignore_index=-1,
                       ignored=0.0, layout="col_strided", seed=2))
    def check(case):
        _run_token_stats(case, backend)

    return check


@pytest.mark.parametrize("backend", TOKEN_BACKENDS)
def test_token_stats_matches_float64(backend):
    _token_test(backend)()


@pytest.mark.parametrize("backend", TOKEN_BACKENDS)
def test_nonfinite_logits_are_masked_entries(backend):
    """NaN and +inf logits other than the target's are left out like -inf ones, on a fixed
    case (the property test above draws them too)."""
    c = dict(n=6, v=37, dtype="fp32", temperature=1.0, scale=1.0, offset=0.0, neginf=0.1, nan=3,
             posinf=2, extremes=0, ties=False, ignore_index=-100, ignored=0.0,
             layout="contiguous", seed=5)
    _run_token_stats(c, backend)


@pytest.mark.parametrize("row", [[0.0, math.nan, 1.0], [0.0, math.inf, 1.0],
                                 [-math.inf, -math.inf]])
def test_torch_backend_nonfinite_rows(row):
    """Minimal cases the property test found when the torch backend propagated NaN/+inf
    logits and gave NaN max_logprob on an all -inf row (cpp and triton mask them)."""
    z = torch.tensor([row])
    t = torch.tensor([0])
    out = ops.token_stats(z, t, backend="torch")
    ref = ref_token_stats(z, t, -100, 1.0)
    _check_stats(out, ref, 1, _row_rounding(z, 1.0), base=2e-5, rtol=2e-6)


@pytest.mark.skipif("triton" not in TOKEN_BACKENDS, reason="triton backend not available")
@pytest.mark.parametrize("op", ["token_stats", "linear_token_stats"])
def test_triton_logprob_var_masked_target(op):
    """Minimal case found by the property test: the target is a masked (-inf) entry and the
    other logits sit near 1000; the variance of the 7 finite ones is 0.0722, where the kernels'
    fp32 sums (origin 0 without a finite target) gave 0.0 (token_stats) and 0.189
    (linear_token_stats)."""
    row = [1000.0 + (0.37 * i) % 1.0 for i in range(8)]
    t = torch.tensor([0])
    bias = torch.zeros(8)
    bias[0] = -math.inf
    z = torch.tensor([row]) + bias
    if op == "token_stats":
        out = ops.token_stats(z, t, backend="triton")
    else:  # logits = 1 x row + bias, H = 1
        out = ops.linear_token_stats(torch.ones(1, 1), torch.tensor(row)[:, None], t, bias=bias,
                                     backend="triton")
    want = ref_token_stats(z, t, -100, 1.0)["logprob_var"]
    assert float(want[0]) == pytest.approx(0.0722, abs=1e-3)
    _assert_close("logprob_var", out.logprob_var, want, 1e-4)


# --------------------------------------------------------------------------- linear_token_stats


def linear_cases(lim: dict):
    return st.fixed_dictionaries({
        "n": st.integers(0, lim["n"]),
        "v": st.integers(1, lim["v"]),
        "h": st.integers(1, lim["h"]),
        "dtype": st.sampled_from(list(DTYPES)),
        "temperature": st.sampled_from([1.0, 0.5, 2.0, 0.3]),
        "scale": st.sampled_from([1.0, 0.05, 6.0]),
        "bias": st.sampled_from(["none", "plain", "offset", "masked", "masked_offset"]),
        "ignore_index": st.sampled_from([-100, -1, 0]),
        "ignored": st.sampled_from([0.0, 0.3, 1.0]),
        "layout": st.sampled_from(["contiguous", "padded"]),
        "seed": st.integers(0, 2**31 - 1),
    }).map(lambda c: _bound(c, lim["elems"]))


def build_linear(c: dict):
    g = torch.Generator().manual_seed(c["seed"])
    n, v, h = c["n"], c["v"], c["h"]
    dt = DTYPES[c["dtype"]]
    hid = torch.randn(n, h, generator=g) * c["scale"]
    w = torch.randn(v, h, generator=g) / math.sqrt(h)
    bias = None
    if c["bias"] != "none":
        bias = torch.randn(v, generator=g)
        if c["bias"] in ("offset", "masked_offset"):
            bias = bias + 1000.0  # a large common offset on every logit
        if c["bias"] in ("masked", "masked_offset"):
            bias[torch.rand(v, generator=g) < 0.3] = -math.inf  # masked vocabulary entries
        bias = bias.to(dt)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < c["ignored"]] = c["ignore_index"]
    if c["layout"] == "padded":  # rows with a stride larger than H
        hb = torch.zeros(n, h + 3, dtype=dt)
        hb[:, 1:h + 1] = hid.to(dt)
        wb = torch.zeros(v, h + 7, dtype=dt)
        wb[:, :h] = w.to(dt)
        return hb[:, 1:h + 1], wb[:, :h], bias, t
    return hid.to(dt), w.to(dt), bias, t


def _run_linear(c: dict, backend: str):
    hid, w, bias, t = build_linear(c)
    temp = c["temperature"]
    out = ops.linear_token_stats(hid, w, t, bias=bias, ignore_index=c["ignore_index"],
                                 temperature=temp, backend=backend)
    z = hid.double() @ w.double().t()
    if bias is not None:
        z = z + bias.double()
    ref = ref_token_stats(z, t, c["ignore_index"], temp)
    # Error bound of each fp32 logit: an H-term dot product (gamma_H * sum |h||w|) plus the
    # rounding of the bias sum.
    mag = hid.double().abs() @ w.double().abs().t()
    bmag = bias.double().abs().nan_to_num(posinf=0.0) if bias is not None else 0.0
    dz = (c["h"] + 2) * EPS32 * (mag + bmag)
    slack = dz.amax(-1) if c["v"] else torch.zeros(c["n"], dtype=torch.float64)
    _check_stats(out, ref, c["n"], slack / temp, base=BASE_TOL[backend], rtol=2e-6,
                 z_slack=2 * slack, z=z, t=t)


def _linear_test(backend: str):
    lim = LINEAR_LIMITS[backend]

    @_settings(lim["examples"])
    @given(case=linear_cases(lim))
    # Two vocabulary tiles of the Triton kernel (V = 129 > 128), H not a multiple of its K
    # block, masked vocabulary entries in the bias, strided rows.
    @example(case=dict(n=3, v=129, h=20, dtype="bf16", temperature=0.5, scale=6.0,
                       bias="masked", ignore_index=-100, ignored=0.3, layout="padded", seed=3))
    def check(case):
        _run_linear(case, backend)

    return check


@pytest.mark.parametrize("backend", TOKEN_BACKENDS)
def test_linear_token_stats_matches_float64(backend):
    _linear_test(backend)()


# --------------------------------------------------------------------------- attention entropy


@st.composite
def attention_cases(draw, lim: dict):
    causal = draw(st.booleans())
    tq = draw(st.integers(1, lim["tq"]))
    tk = draw(st.integers(tq if causal else 1, 48))
    hk = draw(st.integers(1, lim["hk"]))
    group = draw(st.integers(1, 3))
    b = draw(st.integers(1, lim["b"]))
    d = draw(st.sampled_from([1, 8, 16, 24, 33, 64]))
    while b * hk * group * tq * tk * max(d, 16) > lim["elems"] and tq > 1:
        tq = max(1, tq // 2)
        tk = max(tk // 2, tq if causal else 1)
    return {
        "b": b, "hk": hk, "group": group, "tq": tq, "tk": tk, "d": d, "causal": causal,
        "dtype": draw(st.sampled_from(list(DTYPES))),
        "scale": draw(st.sampled_from([None, 0.05, 1.0])),
        "magnitude": draw(st.sampled_from([1.0, 0.01, 30.0])),
        "padding": draw(st.sampled_from(["none", "left", "random"])),
        "layout": draw(st.sampled_from(["contiguous", "bthd"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def build_attention(c: dict):
    g = torch.Generator().manual_seed(c["seed"])
    b, hk, tq, tk, d = c["b"], c["hk"], c["tq"], c["tk"], c["d"]
    hq = hk * c["group"]
    dt = DTYPES[c["dtype"]]

    def rand(h, t):
        x = torch.randn(b, t, h, d, generator=g) * c["magnitude"] ** 0.5
        if c["layout"] == "bthd":  # Hugging Face's [B, T, H, D] storage, viewed as [B, H, T, D]
            return x.to(dt).transpose(1, 2)
        return x.transpose(1, 2).contiguous().to(dt)

    q, k, v = rand(hq, tq), rand(hk, tk), rand(hk, tk)
    # Key ranges anywhere, including empty, reversed and out of [0, Tk].
    kr = torch.randint(-2, tk + 3, (b, 2), generator=g)
    qm = torch.rand(b, tq, generator=g) < 0.7
    am = None
    if c["padding"] == "left":
        pads = torch.randint(0, tk, (b,), generator=g)
        am = torch.arange(tk)[None, :] >= pads[:, None]
    elif c["padding"] == "random":
        am = torch.rand(b, tk, generator=g) < 0.8
    return q, k, v, kr, qm, am


def _run_attention(c: dict, backend: str):
    q, k, v, kr, qm, am = build_attention(c)
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(c["d"])
    out, ent = ops.attention_entropy(q, k, v, key_range=kr, query_mask=qm, attention_mask=am,
                                     causal=c["causal"], scale=c["scale"], backend=backend)
    ref_out, ref_ent = ref_attention(q, k, v, kr, qm, am, c["causal"], scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ent.shape == q.shape[:3] and ent.dtype == torch.float32
    # Scores: fp32 dot products of D terms (products of fp16/bf16 inputs are exact in fp32).
    hq = q.shape[1]
    k64 = k.double().abs().repeat_interleave(hq // k.shape[1], dim=1)
    ds = (c["d"] + 2) * EPS32 * (q.double().abs() @ k64.transpose(-1, -2)) * scale
    ds_row = ds.amax(-1)
    vmax = v.double().abs().amax() if v.numel() else torch.tensor(0.0)
    # Output: the output dtype's rounding and the accumulation of up to Tk terms, plus the
    # score error's effect on the weights (relative 2 * ds) times |v|.
    out_tol = (4 * EPS_OUT[c["dtype"]] + 8 * EPS32 * c["tk"] + 4 * ds_row[..., None]) * vmax \
        + 1e-6
    _assert_close("out", out, ref_out, out_tol)
    ent_tol = 2e-5 + 1e-5 * ref_ent + 4 * ds_row * (1 + math.log(max(c["tk"], 2)))
    _assert_close("entropy", ent, ref_ent, ent_tol)


def _attention_test(backend: str):
    lim = ATTN_LIMITS[backend]

    @_settings(lim["examples"])
    @given(case=attention_cases(lim))
    @example(case=dict(b=2, hk=2, group=2, tq=5, tk=19, d=33, causal=True, dtype="bf16",
                       scale=None, magnitude=30.0, padding="left", layout="bthd", seed=4))
    def check(case):
        _run_attention(case, backend)

    return check


@pytest.mark.parametrize("backend", ATTN_BACKENDS)
def test_attention_entropy_matches_float64(backend):
    _attention_test(backend)()
