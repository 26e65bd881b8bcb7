"""The engine's chosen path is loud (issue 49, item 4): the plan (cascade / KV copy / plain, the
backend, why) in the meta file of every ``score`` run; a probe's exception reported with its
type and message and logged at WARNING when it costs the fastest path; ``--backend triton`` that
cannot run is an error; ``auto`` stepping past an unavailable Triton on CUDA says so."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from _helpers import tiny_llama, write_jsonl

from icqs_fast import backends
from icqs_fast.engine import capability


def test_a_failed_cascade_probe_is_reported_and_warned(monkeypatch, caplog):
    """A Triton compile / launch / out-of-memory error in the cascade probe steps down to the
    KV copies: the plan names the error (type and message) and says it at WARNING."""
    model, _ = tiny_llama(device="cpu")
    real = capability._probe

    def probe(model, body, layers, cascade):
        if cascade:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, body, layers, cascade)

    monkeypatch.setattr(capability, "_probe", probe)
    with caplog.at_level(logging.INFO, logger="icqs_fast"):
        plan = capability.model_plan(model)
    assert plan.path == "kv-copy" and not plan.fastest
    assert plan.probe_errors == ("cascade: OutOfMemoryError: CUDA out of memory. Tried to "
                                 "allocate 2.00 GiB",)
    meta = plan.as_meta("cpp")
    assert meta["path"] == "kv-copy" and meta["backend"] == "cpp" and not meta["fastest"]
    assert "OutOfMemoryError" in meta["why"] and meta["message"] == plan.message
    (rec,) = [r for r in caplog.records if r.name == "icqs_fast" and "per-row KV" in r.message]
    assert rec.levelno == logging.WARNING and "OutOfMemoryError" in rec.message


@pytest.mark.slow  # a second tiny model (~3 s here)
def test_the_cascade_plan_is_logged_quietly(caplog):
    model, _ = tiny_llama(device="cpu")
    with caplog.at_level(logging.INFO, logger="icqs_fast"):
        plan = capability.model_plan(model)
    assert plan.fastest and plan.as_meta("cpp")["why"] == "" and plan.probe_errors == ()
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "icqs_fast")


@pytest.mark.slow  # loads a tiny model and scores two records (~3 s here)
def test_meta_file_names_the_path_and_backend(tmp_path, tiny_llama_dir):
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.io.runs import meta_path
    from icqs_fast.jobs.config import ScoreJobConfig, SelfCheckOptions
    from icqs_fast.jobs.run import run_job

    good = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
        {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
    bad = [dict(r, y="negative" if r["y"] == "positive" else "positive") for r in good]
    g, b = write_jsonl(tmp_path / "g.jsonl", good), write_jsonl(tmp_path / "b.jsonl", bad)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "sales up", "y": "positive"}])
    out = tmp_path / "o.jsonl"
    cfg = ScoreJobConfig(input=str(inp), output=str(out), good=str(g), bad=str(b),
                         model=str(tiny_llama_dir()), dtype="float32", device="cpu",
                         scoring=ScoringSettings(num_ratios=2, demos_per_set=2,
                                                 sets_per_ratio=1, backend="auto"),
                         self_check=SelfCheckOptions(max_heldout=0), quiet=True)
    assert run_job(cfg) == 0
    meta = json.loads(meta_path(out).read_text())
    e = meta["engine"]
    assert e["path"] == "cascade" and e["fastest"] and e["why"] == ""
    assert e["backend"] == meta["backend"] == backends.resolve("auto", torch.device("cpu"))
    assert e["message"].startswith("llama: prefix bank, cascade attention")
    m = meta["memory_plan"]  # the CPU reads no free memory: reported, not split
    assert m["free_bytes"] is None and m["token_budget"] == m["asked_budget"]
    assert m["bank_bytes"] > 0 and m["per_token_bytes"] > 0


def test_backend_triton_that_cannot_run_is_an_error(monkeypatch):
    from icqs_fast.backends import triton_backend
    from icqs_fast.jobs.score import checked_runtime

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(triton_backend, "available", lambda: (False, "no CUDA device"))
    with pytest.raises(ValueError, match=r"--backend triton: backend 'triton' is not "
                                         r"available: no CUDA device"):
        checked_runtime(model, "triton")


def test_auto_past_an_unavailable_triton_on_cuda_warns(monkeypatch, caplog):
    from icqs_fast.backends import triton_backend

    monkeypatch.setattr(triton_backend, "available",
                        lambda: (False, "icqs_fast.kernels does not import: boom"))
    monkeypatch.setattr(backends, "_SAID", set())
    with caplog.at_level(logging.WARNING, logger="icqs_fast"):
        for _ in range(2):
            assert backends.choose("token_stats", "auto", torch.device("cuda")) == "torch"
    (rec,) = [r for r in caplog.records if r.name == "icqs_fast"]
    assert "'triton' would run this call" in rec.message and "boom" in rec.message


_NO_COMBINES = r'''
import builtins, warnings
real = builtins.__import__
def imp(name, globals=None, locals=None, fromlist=(), level=0):
    # Another Triton's layout: the private combines are not where kernels/token_stats.py looks.
    if (name == "triton.language.standard" and (globals or {}).get("__name__")
            == "icqs_fast.kernels.token_stats"):
        raise ImportError(f"cannot import name {fromlist[0]!r}")
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = imp
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import torch
    from icqs_fast import ops
    from icqs_fast.backends import triton_backend
    z, t = torch.randn(3, 50), torch.tensor([1, 2, 3])
    got = ops.token_stats(z, t, backend="triton").logprob
    ref = ops.token_stats(z, t, backend="torch").logprob
print("@@", (got - ref).abs().max().item() < 1e-5, triton_backend.available()[1])
print("@@W", len([x for x in w if "private combines" in str(x.message)]))
'''


@pytest.mark.subprocess
def test_missing_private_triton_combines_are_reported():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", _NO_COMBINES], capture_output=True, text=True,
                       timeout=300, env=env)
    assert "@@" in p.stdout, p.stderr[-3000:]
    out = p.stdout.split("@@", 1)[1]
    assert out.startswith(" True") and "lacks the private combines" in out
    assert "@@W 1" in p.stdout  # warned once, at the import


@pytest.mark.slow  # a tiny model and a server object (~4 s here)
def test_metrics_name_the_served_path():
    from icqs_fast.serve.app import Server

    model, tok = tiny_llama(device="cpu")
    server = Server(model, tok)
    text = server.metrics.render()[0].decode()
    want = backends.resolve("auto", torch.device("cpu"))
    assert (f'icqs_serve_engine_path{{backend="{want}",fastest="true",path="cascade"}} 1.0'
            in text), [ln for ln in text.splitlines() if "engine" in ln]
    assert server.plan["path"] == "cascade"
