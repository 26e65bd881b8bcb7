"""Shared test helpers (tests/ is on sys.path; it is deliberately not a package, so the repository
root - whose kernels/ folder must never be importable as top-level `kernels` - stays off it)."""

import json
import math
import os

import pytest
import torch

from icqs_fast.types import TokenStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# `--dtype auto` / `load_model()` on the CPU pick bf16 where the CPU has native bf16 dot products
# (icqs_fast.models.choose_dtype): the suite pins float32 for that choice (conftest imports this
# module first; CLI subprocesses inherit it), so a test's numbers are the same on an AVX2-only
# and an avx512_bf16 CPU. tests/test_dtype_choice.py unsets it to test the choice itself.
os.environ.setdefault("ICQS_FAST_CPU_DTYPE", "float32")


def ref_token_stats(z: torch.Tensor, t: torch.Tensor, ignore_index: int, temp: float,
                    dtype: torch.dtype = torch.float64) -> dict:
    """Statistics of softmax(z / temp) at targets t, computed in ``dtype`` (float64: the
    reference; float32: the same code in the kernels' output dtype, for tests/tolerance.py);
    z [N, V] any float dtype."""
    z = z.to(dtype)
    n, v = z.shape
    valid = t != ignore_index
    tt = torch.where(valid, t, torch.zeros_like(t))
    fin = torch.isfinite(z / temp)
    has = fin.any(-1)
    zf = z.masked_fill(~fin, -math.inf)
    zm = torch.where(has, zf.amax(-1), torch.zeros(n, dtype=dtype))
    # Logits relative to the row max before the temperature and log s0 come in: z - zm is
    # exact near it, so a common offset costs the float32 run nothing (z / T, or
    # x - (m + log s0), would round at the offset's ulp).
    d = (zf - zm[:, None]) / temp  # x - max x; -inf where masked
    e = torch.exp(d)  # 0 where masked
    s0 = e.sum(-1)
    log_s0 = torch.log(s0)  # -inf when no entry is finite
    p = e / torch.where(has, s0, torch.ones_like(s0))[:, None]
    logp = (d - log_s0[:, None]).masked_fill(~fin, 0.0)
    ent = -(p * logp).sum(-1)
    varent = (p * (logp + ent[:, None]) ** 2).sum(-1)  # Var_p[-log p], two-pass
    z_t = z.gather(1, tt[:, None])[:, 0]
    x_t = z_t / temp
    # Var of the finite x in one pass over u = x - K, K the target's x where finite: the sums
    # every backend's state keeps (icqs_fast/backends/state.py), so the float32 run errs as a
    # kernel keeping them in fp32 does (the cancellation, not the summation order); in float64
    # the shift keeps u small and the cancellation harmless.
    nf = fin.sum(-1)
    shift = torch.where(torch.isfinite(z_t), z_t, 0.0)[:, None]
    u = ((z - shift) / temp).masked_fill(~fin, 0.0)
    u1, u2 = u.sum(-1), (u * u).sum(-1)
    lpv = ((u2 - u1 * u1 / nf.clamp_min(1)) / (nf - 1).clamp_min(1)).clamp_min(0)
    idx = torch.arange(v)[None, :]
    larger = (z > z_t[:, None]).sum(-1)
    tie_before = ((z == z_t[:, None]) & (idx < tt[:, None])).sum(-1)
    zero = torch.zeros(n, dtype=dtype)
    out = {
        "logprob": (z_t - zm) / temp - log_s0,
        "entropy": torch.where(has, ent, zero),
        "varentropy": torch.where(has, varent, zero),
        "logprob_var": lpv,
        "max_logprob": torch.where(has, -log_s0, zero),
        "is_greedy": torch.isfinite(x_t) & (larger == 0) & (tie_before == 0),
        "target_rank": larger,
    }
    out = {k: torch.where(valid, val, torch.zeros_like(val)) for k, val in out.items()}
    out["valid"] = valid
    return out


def ref_token_stats64(z: torch.Tensor, t: torch.Tensor, ignore_index: int = -100,
                      temp: float = 1.0, dtype: torch.dtype = torch.float64) -> TokenStats:
    """:func:`ref_token_stats` as a :class:`TokenStats` (``dtype`` fields, float64 unless told,
    on the CPU): the independent reference the kernel tests compare every backend, the torch one
    included, with; in float32 the yardstick of tests/tolerance.py."""
    r = ref_token_stats(z.cpu(), t.cpu(), ignore_index, temp, dtype)
    return TokenStats(**{k: r[k] for k in ("logprob", "entropy", "varentropy", "logprob_var",
                                            "max_logprob", "is_greedy", "target_rank",
                                            "valid")})


# Every ICQS_FAST_CPP_ISA level a kernel test runs at; "auto": the CPU's best, the only level
# that reaches AMX tiles (an explicit avx512 keeps to the AVX512_BF16 dot products).
ISAS = ("sse4", "avx2", "avx512", "auto")


def isa_runs(name: str) -> bool:
    """Whether this CPU (and build) runs the C++ kernels' ISA level ``name`` (an
    ``ICQS_FAST_CPP_ISA`` value: ``auto`` or a key of ``cpp_backend.ISA_LEVELS``)."""
    from icqs_fast.backends import cpp_backend

    if not cpp_backend.available()[0]:
        return False
    from icqs_fast import _C

    return name == "auto" or cpp_backend.ISA_LEVELS[name] <= _C.best_isa()


def isa_param(name: str):
    """A ``pytest.param`` of the ISA level ``name``, skipped where :func:`isa_runs` is False."""
    return pytest.param(name, id=name, marks=pytest.mark.skipif(not isa_runs(name),
                                                                reason=f"CPU lacks {name}"))


def skip_unless_in_ci(reason: str) -> None:
    """Skip a test whose inputs live outside the repository (../shared/data, the embedded model's
    wheel) when they are missing on a developer's machine; in CI (``CI`` set) they must be
    there, so their absence fails the test instead of silently skipping it."""
    import os

    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must have it: ../shared beside the clone, `make setup`)")
    pytest.skip(reason)


def save_tiny_llama(d, *, layers: int = 1, max_positions: int = 512):
    """Save a tiny random Llama with the embedded model's tokenizer to folder ``d`` (seeded, so
    every test file that uses it scores with the same weights); returns ``d``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from icqs_fast import models

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, vocab_size=len(tok),
                      max_position_embeddings=max_positions)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def tiny_llama(*, device: str = DEVICE):
    """``(model, tokenizer)``: a seeded tiny random Llama (2 layers, hidden 64, GQA 4/2, sdpa)
    in eval mode on ``device``, with the embedded model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from icqs_fast import models

    tok = AutoTokenizer.from_pretrained(models.embedded_model_dir())
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=len(tok),
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(device).eval(), tok


def write_jsonl(path, rows):
    """Write ``rows`` to ``path`` one per line (dicts as JSON, strings verbatim: a test's bad
    line); returns ``path``."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def read_jsonl(path):
    """The JSON objects of a JSONL file, in order."""
    return [json.loads(line) for line in open(path, encoding="utf-8").read().splitlines()]


def assert_same_scores(a, b, tol: float = 1e-5) -> None:
    """Two ICQS results (e.g. engine and reference) have the same scores: identical for the
    discrete kinds (argmax, tied: the same log-likelihood order gives the same ratios), within
    ``tol`` for the posterior mean (fp32 rounding of the log-likelihoods moves it by ~1e-7)."""
    import pytest

    assert a.score_kind == b.score_kind
    if a.score_kind == "mean":
        assert a.score == pytest.approx(b.score, abs=tol)
        assert a.score_per_set == pytest.approx(b.score_per_set, abs=tol)
    else:
        assert a.score == b.score and a.score_per_set == b.score_per_set


def assert_same_lines(got, want, *, kind: str = "mean", tol: float = 1e-5,
                      rtol: float = 1e-6) -> None:
    """Output lines (dicts, in order) of the same records from separate runs hold the same
    records: the same keys; ints, strings, bools and nulls identical; every float
    (log-likelihoods, features, margins, slopes) within ``rtol`` relative or ``tol`` absolute,
    since another batch composition, process, resume point or CPU kind (AVX2 and AVX-512
    kernels round differently) moves fp32 sums by a few ulps. ``score`` / ``score_per_set``
    follow :func:`assert_same_scores`: identical for the discrete kinds (``kind`` "argmax" or
    "tied"), within ``tol`` for the posterior mean (the default)."""
    got, want = list(got), list(want)
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), (i, sorted(g), sorted(w))
        for k in g:
            exact = kind != "mean" and k in ("score", "score_per_set")
            _assert_close_values(g[k], w[k], tol, rtol, exact, f"line {i} field {k!r}")


def _assert_close_values(g, w, tol: float, rtol: float, exact: bool, where: str) -> None:
    import pytest

    if isinstance(w, float) and not exact and isinstance(g, (int, float)):
        assert g == pytest.approx(w, rel=rtol, abs=tol, nan_ok=True), where
    elif isinstance(w, list) and isinstance(g, list):
        assert len(g) == len(w), where
        for a, b in zip(g, w, strict=True):
            _assert_close_values(a, b, tol, rtol, exact, where)
    elif isinstance(w, dict) and isinstance(g, dict):
        assert g.keys() == w.keys(), where
        for k in w:
            _assert_close_values(g[k], w[k], tol, rtol, exact, f"{where}.{k}")
    else:
        assert type(g) is type(w) and g == w, (where, g, w)


def restore_environ(saved: dict) -> None:
    """Put environment variables back as ``saved`` recorded them (None: it was unset)."""
    import os

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def wait_for_file(path, timeout: float, proc=None) -> None:
    """Wait until ``path`` exists (a test hook's signal file), failing after ``timeout``
    seconds, or at once, with its stderr tail, if the subprocess ``proc`` has exited."""
    import os
    import time

    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"driver exited with {proc.returncode}: "
                                 f"{proc.stderr.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


def attention_lse64(q, k, v, *, scale, causal=False, attention_mask=None, softcap=None,
                    window=None, chunk=None, sinks=None, positions=None, with_scores=False,
                    dtype=torch.float64, pv_dtype=None):
    """Float64 ``(out, lse)`` of ``ops.attention_lse``'s contract, every score materialised (on
    the CPU, whatever the inputs' device): scores ``q.k scale`` (capped ``c tanh(s / c)``),
    allowed when the key is real (``attention_mask [B, Tk]``, key position >= 0), ``kpos <=
    qpos`` (causal), ``qpos - kpos < window``, ``kpos // chunk == qpos // chunk``; positions
    ``(q_pos [B, Tq], k_pos [B, Tk])`` default to ``Tk - Tq + i`` and ``j``; sinks ``[Hq]`` add
    ``exp(sink_h)`` to the output's denominator only. A row with no allowed key: output 0, lse
    -inf. (torch_ref.attention_lse computes in fp32: this is the independent float64 one.)
    ``with_scores``: also the masked scores ``[B, Hq, Tq, Tk]`` (-inf where not allowed), as
    ``(out, lse, scores)``. ``dtype``: the one the code computes in (float64 unless told);
    ``pv_dtype``: if given, the probabilities and values are rounded to it for the PV product
    (as the kernels do with 16-bit inputs), which still accumulates in ``dtype``."""
    q, k, v = q.cpu().to(dtype), k.cpu().to(dtype), v.cpu().to(dtype)
    b, hq, tq, _ = q.shape
    hk, tk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if positions is None:
        qp = (tk - tq + torch.arange(tq)).expand(b, tq)
        kp = torch.arange(tk).expand(b, tk)
    else:
        qp, kp = positions[0].cpu().long(), positions[1].cpu().long()
    qp, kp = qp[:, :, None], kp[:, None, :]
    allow = (kp >= 0).expand(b, tq, tk)
    if attention_mask is not None:
        allow = allow & attention_mask.cpu()[:, None, :]
    if causal:
        allow = allow & (kp <= qp)
    if window is not None:
        allow = allow & (qp - kp < window)
    if chunk is not None:
        allow = allow & (torch.div(kp, chunk, rounding_mode="floor")
                         == torch.div(qp, chunk, rounding_mode="floor"))
    s = s.masked_fill(~allow[:, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    total = lse
    if sinks is not None:
        total = torch.logaddexp(lse, sinks.cpu().to(dtype).view(1, hq, 1))
    p = torch.exp(s - torch.where(torch.isfinite(total), total, 0.0)[..., None])
    if pv_dtype is not None:
        p, v = p.to(pv_dtype).to(dtype), v.to(pv_dtype).to(dtype)
    return (p @ v, lse, s) if with_scores else (p @ v, lse)


def attention_within_torch_error(out, lse, q, k, v, *, pv_dtype="out", **kw) -> None:
    """``ops.attention_lse``'s ``(out, lse)`` judged by tests/tolerance.py's rule against
    :func:`attention_lse64` of the same ``q, k, v`` and options ``kw``, the same code run in
    the kernels' dtypes: scores, softmax and lse in float32, the probabilities rounded to
    ``pv_dtype`` for the PV product ("out": ``out.dtype`` when it is 16-bit, where the kernels
    round them; None: kept fp32), the output cast to ``out.dtype``. The floor of ``out`` is
    half an eps of its dtype at the largest |out|: the output's own rounding, for where the
    torch code is exact (one key); the default 8 ulps would be 6% in bf16."""
    from tolerance import assert_within_torch_error

    if pv_dtype == "out":
        pv_dtype = out.dtype if out.dtype in (torch.bfloat16, torch.float16) else None
    ro, rl = attention_lse64(q, k, v, **kw)
    po, pl = attention_lse64(q, k, v, dtype=torch.float32, pv_dtype=pv_dtype, **kw)
    assert_within_torch_error(out, ro, po.to(out.dtype), ulps=0.5, name="out")
    assert_within_torch_error(lse, rl, pl, name="lse")


def variant_model(kind: str):
    """``(model, config)``: a tiny model whose layers need attention's variants, with scores of
    a few units (random init gives ~1e-3: no cap or window would bite): Gemma 2 with a 1.0 soft
    cap ("softcap") or a 6-token window ("window"), gpt-oss with a 4-token window on one of two
    layers and sinks ("sinks"). GQA (4 query heads, 2 key heads), head size 16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, head_dim=16)
    extra = {
        "softcap": ("gemma2", dict(sliding_window=4096, attn_logit_softcapping=1.0,
                                   final_logit_softcapping=None)),
        "window": ("gemma2", dict(sliding_window=6, final_logit_softcapping=None)),
        "sinks": ("gpt_oss", dict(sliding_window=4, num_local_experts=2, num_experts_per_tok=1,
                                  layer_types=["sliding_attention", "full_attention"])),
    }[kind]
    cfg = AutoConfig.for_model(extra[0], **small, **extra[1])
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
            if kind == "sinks":
                torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
    return model, cfg


def cascade_paths_agree(model, cfg, monkeypatch, path: str) -> None:
    """Suffix hidden states of cascade attention (bank forwards and both cascade parts) with
    ``ICQS_FAST_CASCADE_ATTENTION=path`` equal those of the torch path (``=torch``): three
    prefixes of different lengths, six suffixes of 1-11 tokens over them, fp32, 1e-5."""
    from icqs_fast.engine import cascade
    from icqs_fast.engine.batching import PrefixBank, suffix_hidden
    from icqs_fast.engine.layout import layer_attention

    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (17, 9, 30)]
    entries = [2, 0, 1, 0, 1, 2]
    suffixes = [torch.randint(1, 300, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 12, (len(entries),), generator=g)]
    out = {}
    for mode in ("torch", path):
        monkeypatch.setenv(cascade.ATTENTION_ENV, mode)
        bank = PrefixBank(model, 0, 10_000, layers=layer_attention(cfg))
        ids = bank.add(prefixes)
        with torch.no_grad():
            out[mode] = suffix_hidden(model, bank, [ids[e] for e in entries], suffixes, 0,
                                      cascade=True)
    (h_t, m_t), (h_k, m_k) = out["torch"], out[path]
    assert torch.equal(m_t, m_k)
    torch.testing.assert_close(h_k[m_k], h_t[m_t], atol=1e-5, rtol=1e-5)


SENTIMENT_WORDS = ["profit", "sales", "costs", "margin", "revenue", "debt", "orders", "output"]


def sentiment_pools(n: int, start: int = 0) -> tuple[list, list]:
    """``n`` good and ``n`` bad (x, y) pairs with distinct inputs (good: the right sentiment),
    numbered from ``start`` (a later start gives records outside an earlier pool)."""
    good, bad = [], []
    for i in range(start, start + n):
        up = i % 2 == 0
        good.append((f"{SENTIMENT_WORDS[i % 8]} {'rose' if up else 'fell'} {i + 1}%",
                     "positive" if up else "negative"))
        bad.append((f"{SENTIMENT_WORDS[(i + 3) % 8]} {'grew' if up else 'shrank'} by {i + 2} "
                    "million", "negative" if up else "positive"))
    return good, bad


def shorter_is_good_pools(n: int = 24):
    """A made-up task whose good answers are exactly the shorter ones (1-3 words against
    6-12), on inputs of their own (nothing leaks between the classes)."""
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud paper light green".split()
    good = [(f"question {i}", " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))))
            for i in range(n)]
    bad = [(f"request {i}", " ".join(rng.choice(words) for _ in range(rng.randint(6, 12))))
           for i in range(n)]
    return good, bad
