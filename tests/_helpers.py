"""Shared test helpers (tests/ is on sys.path; it is deliberately not a package, so the repository
root - whose kernels/ folder must never be importable as top-level `kernels` - stays off it)."""

import json
import math
import os

import torch

from icqs_fast.types import TokenStats

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# `--dtype auto` / `load_model()` on the CPU pick bf16 where the CPU has native bf16 dot products
# (icqs_fast.models.choose_dtype): the suite pins float32 for that choice (conftest imports this
# module first; CLI subprocesses inherit it), so a test's numbers are the same on an AVX2-only
# and an avx512_bf16 CPU. tests/test_dtype_choice.py unsets it to test the choice itself.
os.environ.setdefault("ICQS_FAST_CPU_DTYPE", "float32")


def ref_token_stats(z: torch.Tensor, t: torch.Tensor, ignore_index: int, temp: float) -> dict:
    """float64 statistics of softmax(z / temp) at targets t; z [N, V] any float dtype."""
    z = z.double()
    n, v = z.shape
    valid = t != ignore_index
    tt = torch.where(valid, t, torch.zeros_like(t))
    x = z / temp
    fin = torch.isfinite(x)
    has = fin.any(-1)
    xf = x.masked_fill(~fin, -math.inf)
    m = torch.where(has, xf.amax(-1), torch.zeros(n, dtype=torch.float64))
    e = torch.exp(xf - m[:, None])  # 0 where masked
    s0 = e.sum(-1)
    lse = m + torch.log(s0)  # -inf when no entry is finite
    p = e / torch.where(has, s0, torch.ones_like(s0))[:, None]
    logp = (x - lse[:, None]).masked_fill(~fin, 0.0)
    ent = -(p * logp).sum(-1)
    varent = (p * (logp + ent[:, None]) ** 2).sum(-1)  # Var_p[-log p], two-pass
    nf = fin.sum(-1)
    mean = x.masked_fill(~fin, 0.0).sum(-1) / nf.clamp_min(1)
    lpv = ((x - mean[:, None]).masked_fill(~fin, 0.0) ** 2).sum(-1) / (nf - 1).clamp_min(1)
    z_t = z.gather(1, tt[:, None])[:, 0]
    x_t = z_t / temp
    idx = torch.arange(v)[None, :]
    larger = (z > z_t[:, None]).sum(-1)
    tie_before = ((z == z_t[:, None]) & (idx < tt[:, None])).sum(-1)
    zero = torch.zeros(n, dtype=torch.float64)
    out = {
        "logprob": x_t - lse,
        "entropy": torch.where(has, ent, zero),
        "varentropy": torch.where(has, varent, zero),
        "logprob_var": lpv,
        "max_logprob": torch.where(has, m - lse, zero),
        "is_greedy": torch.isfinite(x_t) & (larger == 0) & (tie_before == 0),
        "target_rank": larger,
    }
    out = {k: torch.where(valid, val, torch.zeros_like(val)) for k, val in out.items()}
    out["valid"] = valid
    return out


def ref_token_stats64(z: torch.Tensor, t: torch.Tensor, ignore_index: int = -100,
                      temp: float = 1.0) -> TokenStats:
    """:func:`ref_token_stats` as a :class:`TokenStats` (float64 fields, on the CPU): the
    independent reference the kernel tests compare every backend, the torch one included, with."""
    r = ref_token_stats(z.cpu(), t.cpu(), ignore_index, temp)
    return TokenStats(**{k: r[k] for k in ("logprob", "entropy", "varentropy", "logprob_var",
                                            "max_logprob", "is_greedy", "target_rank",
                                            "valid")})


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
