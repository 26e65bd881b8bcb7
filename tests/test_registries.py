"""The registries code reads instead of branching on names.

* The evaluation data sets (``icqs_fast.io.datasets.EVAL_DATASETS``): exactly what ``icqs-fast
  eval`` offers, every default path where the callers used to look, every kind with its study.
* The backends' support table (``icqs_fast.backends.support``), walked: each declared capability
  (backend x operation x dtype, and each option) is run on a tiny input against a float64
  reference; each undeclared one is refused by ``ops`` with an error naming it, and ``"auto"``
  routes it to a backend that has it.
* Kernels are reached only through ``ops`` / the backends, and Triton's interpreter is detected
  in one place.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import DEVICE, attention_lse64, ref_token_stats

from icqs_fast import backends, ops
from icqs_fast.backends import support
from icqs_fast.io import datasets

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- data sets


def test_registry_is_what_eval_offers():
    """Every registry entry is an ``eval`` subcommand and every ``eval`` subcommand an entry
    (same order), each wired to the module of its kind, with the entry's help line."""
    from icqs_fast.cli import COMMANDS, build_parser
    from icqs_fast.evals.study_kinds import STUDY_KINDS

    evals = [(name.split()[1], COMMANDS.get(name).__name__, COMMANDS.about[name])
             for name in COMMANDS if name.startswith("eval ")]
    assert [name for name, _, _ in evals] == list(datasets.EVAL_DATASETS)
    for name, mod, help_ in evals:
        ds = datasets.eval_dataset(name)
        assert ds.kind in datasets.KINDS and help_ == ds.help
        want = "icqs_fast.cli.eval" if ds.kind in STUDY_KINDS else "icqs_fast.cli.eval_mtbench"
        assert mod == want, name
        args = build_parser(["eval", name]).parse_args(["eval", name])
        assert args.subcommand == name
    # Every kind but the judge-score one is an ICQS study; every study kind has a data set.
    assert set(STUDY_KINDS) == set(datasets.KINDS) - {"judgments"}
    assert {d.kind for d in datasets.eval_datasets()} == set(datasets.KINDS)
    with pytest.raises(ValueError, match="unknown evaluation data set 'nope'"):
        datasets.eval_dataset("nope")


# Where each caller used to look, before the registry (shared-data folder relative parts).
OLD_DEFAULTS = {"fpb": ("fpb", "Sentences_AllAgree.txt"), "sst2": ("sst2", "dev.tsv"),
                "chaosnli": ("chaosnli", "chaosNLI_snli.jsonl"), "mtbench": ("mtbench",)}


def test_default_paths_resolve_as_before(tmp_path, monkeypatch):
    """Each entry's default is the file the callers used to name: under the shared-data folder
    (``$ICQS_FAST_SHARED_DATA`` honoured); ``eval --data FOLDER`` finds it directly in the
    folder or in its data set's subfolder; the loaders' ``path=None`` reads it."""
    from icqs_fast.cli.eval import data_path
    from icqs_fast.evals import study_data

    assert set(OLD_DEFAULTS) == set(datasets.EVAL_DATASETS)
    monkeypatch.setenv("ICQS_FAST_SHARED_DATA", str(tmp_path))
    for name, parts in OLD_DEFAULTS.items():
        ds = datasets.eval_dataset(name)
        assert ds.default_path() == tmp_path.joinpath(*parts)
        if len(parts) == 2:
            assert data_path(name, None) == tmp_path.joinpath(*parts)
            (tmp_path / "flat").mkdir(exist_ok=True)
            (tmp_path / "flat" / parts[1]).write_text("x")
            assert data_path(name, str(tmp_path / "flat")) == tmp_path / "flat" / parts[1]
            (tmp_path / "nested" / parts[0]).mkdir(parents=True, exist_ok=True)
            (tmp_path / "nested" / parts[0] / parts[1]).write_text("x")
            assert data_path(name, str(tmp_path / "nested")) == \
                tmp_path / "nested" / parts[0] / parts[1]
    assert datasets.default_fpb_path() == tmp_path / "fpb" / "Sentences_AllAgree.txt"
    # The loaders' defaults: a small file at each default place is what they read.
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"s{i} .\t{i % 2}\n" for i in range(12)))
    d = study_data.sst2_data(pool=2, limit=2)
    assert d.dataset == "sst2" and len(d.good) == 2 and set(d.groups) == {"correct", "incorrect"}
    (tmp_path / "fpb").mkdir()
    (tmp_path / "fpb" / "Sentences_AllAgree.txt").write_text("".join(
        f"s{i} .@{('positive', 'negative', 'neutral')[i % 3]}\n" for i in range(18)))
    assert study_data.fpb_data(pool=2, limit=2).dataset == "fpb"
    with pytest.raises(FileNotFoundError, match="chaosNLI_snli.jsonl"):
        study_data.chaosnli_data()
    # Without the variable, from the repository root: the old cwd-relative MT-Bench default.
    monkeypatch.delenv("ICQS_FAST_SHARED_DATA")
    monkeypatch.chdir(ROOT)
    assert datasets.eval_dataset("mtbench").default_path().resolve() == \
        Path("../shared/data/mtbench").resolve()


def test_fpb_study_data_is_the_fpb_examples_rule(tmp_path):
    """FPB's study data through the registry (rows -> polar_pools) equals the former route
    (``fpb_examples`` -> groups): same pools, groups and polar sentences."""
    from icqs_fast.evals import study_data

    rows = [(f"Sentence number {i} .", ("positive", "negative", "neutral")[(i * 7) % 3])
            for i in range(40)]
    p = tmp_path / "fpb.txt"
    p.write_text("".join(f"{x}@{y}\n" for x, y in rows))
    for seed in (0, 3):
        good, bad, rest = datasets.fpb_examples(p, n_good=4, n_bad=4, seed=seed)
        groups, polar = study_data.sentiment_groups([(r.x, r.y) for r in rest], limit=3,
                                                    seed=seed, neutral=True, labels="synonyms")
        d = study_data.fpb_data(p, pool=4, limit=3, seed=seed, labels="synonyms")
        assert (d.good, d.bad, d.groups, d.polar) == (good, bad, groups, polar)


def test_real_data_reads_through_the_registry():
    """Each entry's reader reads its real default file (when the shared data are here)."""
    for ds in datasets.eval_datasets():
        p = ds.default_path()
        if not p.exists():
            pytest.skip(f"no shared data at {p}")
        recs = ds.read(p, 5) if ds.kind == "judgments" else ds.read(p)
        assert len(recs) >= 5, ds.name


def test_plots_and_study_read_the_registry(monkeypatch):
    """A data set added to the registry needs no other edit: the study's Ask LLM question and
    the plots' titles come from its entry; an unknown kind is refused by name."""
    from icqs_fast.evals import plots, study

    extra = datasets.EvalDataset("toy", "Toy reviews", "a toy", "toy/toy.tsv", "labels",
                                 ("accuracy",), datasets.sst2_rows, subject="toy review")
    monkeypatch.setitem(datasets.EVAL_DATASETS, "toy", extra)
    assert "this toy review?" in study._ask_question("toy", ("positive", "negative"), "x")
    assert "financial news sentence" in study._ask_question("fpb", ("a", "b"), "x")
    with pytest.raises(ValueError, match="no study figures for mtbench"):
        plots.write_plots("mtbench", {}, [1], "unused")


# --------------------------------------------------------------------------- backends


def _runs_here(op: str, backend: str) -> bool:
    """Whether ``backend`` can run ``op`` on this test machine's device at all."""
    s = support.entry(op, backend)
    return (s is not None and backends.available(backend)[0]
            and support.refusal(op, backend, DEVICE) is None)


TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    same_inf = torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() if bool(fin.any()) else 0.0
    assert same_inf and err <= tol * (1 + want[fin].abs().max().item() if bool(fin.any())
                                      else 1), f"{what}: max error {err:.3g} (tol {tol:g})"


# Each option of each op, as the call's keyword values (applied to the tiny inputs below).
def _token_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(6, 37, generator=g) * 3).to(dtype)
    t = torch.tensor([0, 5, -100, 36, 11, 2])
    got = ops.token_stats(z.to(DEVICE), t.to(DEVICE), temperature=0.7, backend=backend)
    return got, ref_token_stats(z, t, -100, 0.7)


def _linear_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 12, generator=g).to(dtype)
    w = (torch.randn(41, 12, generator=g) * 0.5).to(dtype)
    b = (torch.randn(41, generator=g) * 0.1).to(dtype) if "bias" in opts else None
    scale = -1.7 if "logit_scale" in opts else 1.0
    cap = 3.0 if "softcap" in opts else None
    t = torch.tensor([3, 40, -100, 0, 17])
    got = ops.linear_token_stats(h.to(DEVICE), w.to(DEVICE), t.to(DEVICE),
                                 bias=None if b is None else b.to(DEVICE), temperature=0.9,
                                 logit_scale=scale, softcap=cap, backend=backend,
                                 chunk_tokens=2, chunk_vocab=16)
    z = h.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    z = z * scale
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return got, ref_token_stats(z, t, -100, 0.9)


def _check_stats(got, want, dtype, what):
    tol = TOL[dtype] if dtype != torch.float64 else 1e-5  # fp32 outputs
    for f in ("logprob", "entropy", "varentropy", "max_logprob"):
        _close(getattr(got, f), want[f], tol, f"{what} {f}")
    assert torch.equal(got.target_rank.cpu(), want["target_rank"]), what
    assert torch.equal(got.valid.cpu(), want["valid"]), what


def _range_entropy64(s, key_range, query_mask):
    """Entropy of each flagged row's softmax renormalised over its key range (float64)."""
    b, _, _, tk = s.shape
    kpos = torch.arange(tk)
    inr = (kpos[None, :] >= key_range[:, :1]) & (kpos[None, :] < key_range[:, 1:])
    s2 = s.masked_fill(~inr[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s2, -1, keepdim=True)
    ok = torch.isfinite(lse)
    logp = torch.where(torch.isfinite(s2) & ok, s2 - torch.where(ok, lse, 0.0), 0.0)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(ok[..., 0] & query_mask[:, None, :], ent, 0.0)


def _attn_inputs(dtype, opts, seed):
    g = torch.Generator().manual_seed(seed)
    b, hq, hk, tq, tk, d = 2, 4, 2, 5, 11, 8
    dv = 6 if "value_dim" in opts else d
    q = torch.randn(b, hq, tq, d, generator=g).to(dtype)
    k = (torch.randn(b, hk, tk, d, generator=g) * 1.5).to(dtype)
    v = torch.randn(b, hk, tk, dv, generator=g).to(dtype)
    am = torch.ones(b, tk, dtype=torch.bool)
    am[1, 8:] = False  # right padding (the variants' rule)
    variant = {"window": 4 if "window" in opts else None, "chunk": 4 if "chunk" in opts else None,
               "softcap": 2.5 if "softcap" in opts else None,
               "sinks": torch.randn(hq, generator=g) if "sinks" in opts else None}
    return q, k, v, am, variant


def _entropy_call(backend, dtype, opts):
    q, k, v, am, var = _attn_inputs(dtype, opts, 3)
    kr = torch.tensor([[1, 9], [0, 6]])
    qm = torch.tensor([[True, False, True, True, True], [True, True, False, True, True]])
    dev = {n: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for n, x in var.items()}
    out, ent = ops.attention_entropy(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), key_range=kr,
                                     query_mask=qm, attention_mask=am.to(DEVICE), causal=True,
                                     scale=0.3, backend=backend, **dev)
    ro, _, s = attention_lse64(q, k, v, causal=True, attention_mask=am, scale=0.3,
                              with_scores=True, **var)
    return (out, ent), (ro, _range_entropy64(s, kr, qm))


def _lse_call(backend, dtype, opts):
    q, k, v, am, var = _attn_inputs(dtype, opts, 4)
    local = {"window": var["window"], "chunk": var["chunk"]}
    positions, ref_am = None, am
    if "positions" in opts:  # the default slots shifted per row (same masks), one key masked
        b, tq, tk = q.shape[0], q.shape[2], k.shape[2]
        off = torch.arange(b)[:, None] * 3
        k_pos = torch.arange(tk).expand(b, tk) + off
        k_pos[0, 2] = -1
        positions = ((tk - tq + torch.arange(tq)).expand(b, tq) + off, k_pos)
        ref_am = am.clone()
        ref_am[0, 2] = False
    dot = torch.bfloat16 if "dot_dtype" in opts else None
    kw = dict(scale=0.3, causal=True, softcap=var["softcap"], backend=backend, dot_dtype=dot,
              **local)
    if "state" in opts:  # one pass in two calls: the first 64 keys, then the rest
        tq, tk = q.shape[2], k.shape[2]
        cut = min(64, tk)
        q_pos = (tk - tq + torch.arange(tq)).expand(q.shape[0], tq)
        k_pos = torch.where(am, torch.arange(tk), -1)
        st, _ = ops.attention_lse(q.to(DEVICE), k[:, :, :cut].to(DEVICE), v[:, :, :cut].to(DEVICE),
                                  positions=(q_pos, k_pos[:, :cut]), return_state=True, **kw)
        out, lse = ops.attention_lse(q.to(DEVICE), k[:, :, cut:].to(DEVICE),
                                     v[:, :, cut:].to(DEVICE), positions=(q_pos, k_pos[:, cut:]),
                                     state=st, **kw)
    elif "bf16_out" in opts:  # the output rounded to bf16 (a bf16 product's input)
        out, lse = ops.attention_lse(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                     attention_mask=am.to(DEVICE), out_dtype=torch.bfloat16,
                                     **kw)
        assert out.dtype == torch.bfloat16
    elif "key_batch" in opts:  # both rows read batch 1's keys: as if gathered
        kb = torch.tensor([1, 1])
        out, lse = ops.attention_lse(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                     attention_mask=am.to(DEVICE), key_batch=kb.to(DEVICE), **kw)
        k, v, ref_am = k[kb], v[kb], am[kb]
    else:
        out, lse = ops.attention_lse(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
                                     attention_mask=am.to(DEVICE), positions=positions, **kw)
    if dot is not None:  # the reference of bf16 products: the inputs rounded to bf16
        q, k, v = (x.to(dot).float() for x in (q, k, v))
    ro, rl = attention_lse64(q, k, v, causal=True, attention_mask=ref_am, scale=0.3,
                             softcap=var["softcap"], **local)
    return (out, lse), (ro, rl)


def _check_pair(got, want, dtype, what):
    for name, g, w in zip(("out", "second"), got, want, strict=True):
        _close(g, w, TOL[dtype], f"{what} {name}")


def _linear_op_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 70, generator=g).to(dtype)
    w = torch.randn(45, 70, generator=g).to(dtype)
    b = torch.randn(45, generator=g)
    if opts & {"gated", "bf16_out"}:  # silu(x W^T) * (x U^T), no bias (rounded to bf16)
        u = torch.randn(45, 70, generator=g).to(dtype)
        pw, pu = (ops.pack_linear(t, "fp32", backend=backend) for t in (w, u))
        bf16 = "bf16_out" in opts
        out = ops.linear(x, pw, up=pu, out_dtype=torch.bfloat16 if bf16 else torch.float32)
        want = F.silu(x.double() @ w.double().T) * (x.double() @ u.double().T)
        return out, want.to(torch.bfloat16) if bf16 else want
    if "rotary" in opts:  # each 8-wide head of the output rotated, x as [1, 37, K]
        c, s = (torch.randn(1, 37, 8, generator=g) for _ in range(2))
        out = ops.linear(x[None], ops.pack_linear(w[:40], "fp32", backend=backend), b[:40],
                         rotary=(c, s))[0]
        y = (x.double() @ w[:40].double().T + b[:40].double()).view(37, 5, 8)
        half = torch.cat((-y[..., 4:], y[..., :4]), -1)
        return out, (y * c[0, :, None].double() + half * s[0, :, None].double()).reshape(37, 40)
    if "residual" in opts:  # + a residual [M, N], added last
        r = torch.randn(37, 45, generator=g)
        out = ops.linear(x, ops.pack_linear(w, "fp32", backend=backend), b, residual=r)
        return out, x.double() @ w.double().T + b.double() + r.double()
    out = ops.linear(x, ops.pack_linear(w, "fp32", backend=backend), b)
    return out, x.double() @ w.double().T + b.double()


def _check_linear(got, want, dtype, what):
    # fp32 products of the (widened) inputs; a bf16 output (and its reference) rounded once.
    _close(got, want, TOL[got.dtype if got.dtype == torch.bfloat16 else torch.float32], what)


def _rotary_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 5, 8, generator=g).to(dtype)
    cos, sin = (torch.randn(1, 5, 8, generator=g).to(dtype) for _ in range(2))
    out = ops.rotary(x, cos, sin, backend=backend)
    x, cos, sin = (t.double() for t in (x, cos, sin))
    return out, x * cos[:, None] + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin[:, None]


def _check_in_dtype(got, want, dtype, what):
    _close(got, want, TOL[dtype], what)


def _concat_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(7)
    a = torch.randn(3, 2, 9, 5, generator=g).to(dtype)[:, :, 1:]  # strided slots
    b = torch.randn(2, 2, 4, 5, generator=g).to(dtype)
    ix = lambda *v: torch.tensor(v)  # noqa: E731
    parts = [(a, ix(2, 0), ix(1, 5), ix(3, 2)), (b, ix(1, 1), ix(0, 2), ix(4, 1))]
    out = ops.concat_slots(parts, 8, backend=backend)
    want = torch.zeros(2, 2, 8, 5, dtype=torch.float64)
    want[0, :, :3], want[0, :, 3:7] = a[2, :, 1:4].double(), b[1].double()
    want[1, :, :2], want[1, :, 2:3] = a[0, :, 5:7].double(), b[1, :, 2:3].double()
    return out, want


def _check_copy(got, want, dtype, what):
    assert torch.equal(got.double(), want), what  # a copy: exact in every dtype


def _rms_norm_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(6, 33, generator=g).to(dtype), torch.randn(33, generator=g).to(dtype)
    bf16 = torch.bfloat16 if "bf16_out" in opts else None  # a product's input
    out = ops.rms_norm(x, w, 1e-5, out_dtype=bf16, backend=backend)
    assert out.dtype == (bf16 or dtype)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    return out, want if bf16 is None else want.to(bf16)


def _add_rms_norm_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(10)
    x, r = (torch.randn(6, 33, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(33, generator=g).to(dtype)
    normed = torch.bfloat16 if "bf16_normed" in opts else None  # a product's input
    total, out = ops.add_rms_norm(x, r, w, 1e-5, normed_dtype=normed, backend=backend)
    assert torch.equal(total, r + x), "the sum is torch's add in the dtype"
    assert out.dtype == (normed or dtype)
    sd = total.double()
    want = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    return out, want if normed is None else want.to(normed)


def _silu_mul_call(backend, dtype, opts):
    g = torch.Generator().manual_seed(9)
    gate, up = (torch.randn(5, 19, generator=g).to(dtype) for _ in range(2))
    out = ops.silu_mul(gate, up, backend=backend)
    return out, F.silu(gate.double()) * up.double()


CALLS = {"linear": (_linear_op_call, _check_linear), "rotary": (_rotary_call, _check_in_dtype),
         "concat_slots": (_concat_call, _check_copy),
         "rms_norm": (_rms_norm_call, _check_in_dtype),
         "add_rms_norm": (_add_rms_norm_call, _check_in_dtype),
         "silu_mul": (_silu_mul_call, _check_in_dtype),
         "token_stats": (_token_call, _check_stats), "linear_token_stats": (_linear_call,
                                                                            _check_stats),
         "attention_entropy": (_entropy_call, _check_pair), "attention_lse": (_lse_call,
                                                                              _check_pair)}


@pytest.mark.parametrize("op", list(support.TABLE))
@pytest.mark.parametrize("backend", list(support.PREFERENCE))
def test_support_table_walk(op, backend):
    """Every declared dtype and option of (op, backend) runs and matches the float64 reference;
    every undeclared option and dtype is refused by ops, naming it, and "auto" routes the
    option to a backend that has it."""
    call, check = CALLS[op]
    s = support.entry(op, backend)
    if s is None:
        with pytest.raises(ValueError, match=f"{op}: backend '{backend}' does not implement"):
            call(backend, torch.float32, frozenset())
        return
    if not _runs_here(op, backend):
        pytest.skip(f"{backend} does not run on {DEVICE} here")
    for dtype in s.dtypes:
        check(*call(backend, dtype, frozenset()), dtype, f"{op}/{backend}/{dtype}")
    for opt in support.OPTIONS[op]:
        if opt in s.options:
            # bf16 products (dot_dtype) round the probabilities too, a bf16 output itself:
            # bf16's tolerance.
            tol_dtype = torch.bfloat16 if opt in ("dot_dtype", "bf16_out") else torch.float32
            check(*call(backend, torch.float32, frozenset({opt})), tol_dtype,
                  f"{op}/{backend}/{opt}")
            continue
        with pytest.raises(ValueError, match=rf"backend '{backend}' does not support .*\({opt}\)"):
            call(backend, torch.float32, frozenset({opt}))
        assert backends.choose(op, "auto", DEVICE, torch.float32, {opt}) in \
            support.implementing(op, opt)
        check(*call("auto", torch.float32, frozenset({opt})),
              torch.bfloat16 if opt in ("dot_dtype", "bf16_out") else torch.float32,
              f"{op}/auto/{opt}")
    for dtype in set(support.FLOATS) - set(s.dtypes):
        with pytest.raises(TypeError, match=r"float64|dtype|takes .* inputs"):
            call(backend, dtype, frozenset())


def test_auto_follows_the_table():
    """"auto" picks by the table: the fused kernels on CUDA, the C++ extension on the CPU for
    every operation (the attention entropy's soft cap on torch, which has it), never Triton's
    interpreter; a named backend on a device it lacks is an error saying so."""
    cpu_token = "cpp" if backends.available("cpp")[0] else "torch"
    for op in support.TABLE:
        assert backends.choose(op, "auto", "cpu", torch.float32) == cpu_token
    assert backends.choose("attention_entropy", "auto", "cpu", torch.float32,
                           {"softcap"}) == "torch"
    if DEVICE == "cuda" and backends.available("triton")[0]:
        for op in support.TABLE:
            assert backends.choose(op, "auto", "cuda", torch.float32) == "triton"
        with pytest.raises(ValueError, match="backend 'cpp' needs cpu tensors"):
            ops.token_stats(torch.randn(2, 5, device="cuda"), torch.zeros(2, dtype=torch.long,
                                                                         device="cuda"),
                            backend="cpp")
    assert backends.fallback("attention_entropy", "cpp") == "cpp"
    assert backends.fallback("attention_entropy", "cpp", {"softcap"}) == "auto"
    assert backends.fallback("attention_entropy", "triton", {"window"}) == "auto"
    assert backends.fallback("attention_entropy", "triton") == "triton"
    with pytest.raises(ValueError, match="unknown backend 'magic'"):
        backends.fallback("attention_entropy", "magic")
    with pytest.raises(ValueError, match="unknown option 'rope'"):
        support.refusal("attention_lse", "torch", options={"rope"})


def test_cascade_kernel_choice_follows_the_table():
    """Cascade attention takes the fused kernel exactly where the table's "auto" has one."""
    from icqs_fast.engine import cascade

    cpu = "cpp" if backends.available("cpp")[0] else None
    assert cascade._kernel_backend(torch.device("cpu"), torch.float32, None, False) == cpu
    assert cascade._kernel_backend(torch.device("cpu"), torch.bfloat16, 50.0, True) == cpu
    if DEVICE == "cuda" and backends.available("triton")[0]:
        dev = torch.device("cuda")
        assert cascade._kernel_backend(dev, torch.bfloat16, None, False) == "triton"
        assert cascade._kernel_backend(dev, torch.bfloat16, 50.0, False) is None
        assert cascade._kernel_backend(dev, torch.bfloat16, None, True) is None


# --------------------------------------------------------------------------- kernels


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


# Rooms that may call the kernels: the ops, the backends, and the benchmarks and `info` (which
# describe, compile and time the launches themselves).
KERNEL_ROOMS = ("icqs_fast/ops/", "icqs_fast/backends/", "icqs_fast/benchmarks/",
                "icqs_fast/info.py")


def test_model_code_reaches_kernels_only_through_ops():
    bad = []
    for p in sorted((ROOT / "icqs_fast").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(KERNEL_ROOMS):
            continue
        bad += [f"{rel}: imports {m}" for m in _imports(p)
                if m == "icqs_fast.kernels" or m.startswith("icqs_fast.kernels.")]
    assert not bad, "\n".join(bad)


# Own "is Triton interpreting" checks still to replace by kernels.launch.triton_interpreting,
# each with its reason; the set only shrinks.
# (The static compiler's own checks moved out of the package with it, to bench/gpu_model/.)
KNOWN_INTERPRET_CHECKS: set[str] = set()
_INTERPRET = re.compile(r"(environ\.get|getenv)\(\s*['\"]TRITON_INTERPRET|runtime\W+interpret")


def test_one_interpreter_check():
    found = set()
    for p in sorted([*(ROOT / "icqs_fast").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]):
        if _INTERPRET.search(p.read_text(encoding="utf-8")):
            found.add(p.relative_to(ROOT).as_posix())
    assert found - KNOWN_INTERPRET_CHECKS == {"kernels/launch.py"}
    assert backends.triton_interpreting is __import__(
        "icqs_fast.kernels.launch", fromlist=["x"]).triton_interpreting
