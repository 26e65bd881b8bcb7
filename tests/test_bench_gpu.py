"""``icqs-fast bench gpu`` on a machine without a GPU: it refuses clearly, its case table maps to
real launches, and its ratio arithmetic is right; the lab's dry run of the CUDA code paths and its
predictions beside a measured record. (The GPU run itself is ``make bench-gpu``.)"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_model.predict import case_launches
from icqs_fast.benchmarks import gpu

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


@pytest.mark.subprocess
def test_refuses_without_cuda():
    r = subprocess.run([sys.executable, "-m", "icqs_fast.cli", "bench", "gpu", "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr


@pytest.mark.parametrize("case", gpu.CASES + gpu.QUICK_CASES, ids=str)
def test_cases_describe_launches(case):
    """Every case's Triton variants have the launches the predictions compile (names the
    profiler's kernel times are matched by, positive work); the torch reference has none."""
    op, dt, shape = case
    variants = ("entropy", "no_entropy") if op == "attention" else (None,)
    for variant in variants:
        launches = case_launches(op, gpu._DTYPES[dt], shape, variant)
        assert launches
        for ln in launches:
            assert ln.fn.__name__.startswith("_")
            assert ln.programs >= 1 and ln.hbm_bytes > 0
    if op == "attention":
        assert case_launches(op, gpu._DTYPES[dt], shape, "sdpa") is None


def test_attention_ratios():
    recs = [
        {"op": "attention", "shape": [1, 2], "variant": "entropy", "kind": "op",
         "measured_ms": 1.3},
        {"op": "attention", "shape": [1, 2], "variant": "no_entropy", "kind": "op",
         "measured_ms": 1.0},
        {"op": "attention", "shape": [1, 2], "variant": "sdpa", "kind": "op",
         "measured_ms": 0.5},
        {"op": "token_stats", "shape": [1, 2], "variant": None, "kind": "op",
         "measured_ms": 9.0},
    ]
    gpu._attention_ratios(recs)
    assert recs[0]["ratio_vs_no_entropy"] == pytest.approx(1.3)
    assert recs[0]["ratio_vs_sdpa"] == pytest.approx(2.6)
    assert "ratio_vs_no_entropy" not in recs[1] and "ratio_vs_sdpa" not in recs[3]


# --- the dry run: the CUDA code paths on fake CUDA tensors (no GPU) ---------------------------

_DRY_PATHS = ("bench_gpu", "engine", "features", "audit", "lm_eval", "score", "serve", "ray")


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    """One ``python -m bench.gpu_model.dry_run`` (a child process without the Triton
    interpreter; Triton's on-disk cache keeps a rerun's compiles cheap)."""
    import json
    import os

    out = tmp_path_factory.mktemp("dry") / "dry.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_model.dry_run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.exists(), r.stderr[-3000:]
    return r, json.loads(out.read_text())


@pytest.mark.subprocess
def test_dry_run_covers_every_cuda_path(dry_report):
    r, rep = dry_report
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert rep["ok"] and rep["arch"] == "sm_90"
    for name in _DRY_PATHS:
        e = rep["paths"][name]
        assert e["status"] == "ok", (name, e.get("traceback"))
        assert e["launches"] >= 1 and e["compiles_ok"] >= 1, (name, e)
    assert rep["paths"]["engine"]["model_device"] == "cuda:0"
    assert rep["paths"]["engine"]["cascade"] is True
    assert rep["paths"]["lm_eval"]["device"] == "cuda:0"
    # The score job's meta file names the path and backend; the server's three routes; a
    # --ray actor on a GPU (one per GPU by default on a GPU cluster).
    assert (rep["paths"]["score"]["engine"], rep["paths"]["score"]["backend"]) == (
        "cascade", "triton") and rep["paths"]["score"]["records"] == 3
    assert rep["paths"]["score"]["memory_plan"]["free_bytes"] == 70 * 2**30
    s = rep["paths"]["serve"]
    assert (s["echo"], s["generated_steps"], s["scored"], s["engine"]) == (2, 3, 2, "cascade")
    assert rep["paths"]["ray"]["runtime"] == "cuda" and rep["paths"]["ray"]["gpus_per_actor"] == 1
    assert "_attn_entropy_fwd" in rep["paths"]["features"]["kernels"]
    assert "_linear_token_stats_kernel" in rep["paths"]["engine"]["kernels"]
    assert rep["compiles"] >= 3 and all(k["compiled"] for k in rep["kernels"])
    # Token stats reach the host in one copy per field and batch, not one per (response,
    # context) or request (96 and 48 copies per batch before).
    hot = [s for s in rep["host_syncs"] if s["op"] == "cuda -> cpu copy" and s["count"] > 16]
    assert not hot, hot


@pytest.mark.subprocess
def test_dry_run_sync_budgets(dry_report):
    """Every path within its host-sync budget (each sync drains the GPU queue; per batch
    forward, once-per-model setup apart), none in the ops or the per-layer code, the counts in
    the report."""
    from bench.gpu_model.dry_run import SETUP_SYNC_BUDGET, SYNC_BUDGETS

    _, rep = dry_report
    for name in _DRY_PATHS:
        e = rep["paths"][name]
        b = e["sync_budget"]
        assert b["ok"], (name, b["problems"])
        assert b["per_forward"] == SYNC_BUDGETS[name] and b["setup"] == SETUP_SYNC_BUDGET
        assert e["syncs_batch"] <= SYNC_BUDGETS[name] * max(e["forwards"], 1)
        if name != "bench_gpu":
            assert e["forwards"] >= 1 and e["launches_batch"]["per_layer"] > 0, (name, e)
    assert rep["paths"]["bench_gpu"]["syncs_batch"] == 0  # the ops themselves never sync
    # Greedy generation reads the host once per token (the token, its log-prob and the top-N
    # in one copy; four reads before).
    gen = [s for s in rep["host_syncs"] if s["path"] == "serve" and s["phase"] == "batch"
           and "serve/generation.py" in s["site"].split(" < ")[0]]
    assert sum(s["count"] for s in gen) == rep["paths"]["serve"]["generated_steps"], gen
    # The capture's mask checks: no sync per layer (its causality once per model, "setup").
    assert not [s for s in rep["host_syncs"] if "features/attention.py" in s["site"].split(
        " < ")[0] and s["phase"] != "setup"]


_PLANTED = r'''
import json, sys, torch
from icqs_fast.backends import triton_backend
from bench.gpu_model.dry_run import dry_run
orig = triton_backend._prepare
def planted(targets, ignore_index):  # the bug: target ids left on the CPU
    valid, safe_t = orig(targets, ignore_index)
    return valid, safe_t.to("cpu")
triton_backend._prepare = planted
r = dry_run(("bench_gpu",), compile=False)
sys.stdout.write("@@" + json.dumps(r["paths"]["bench_gpu"]))
'''

_PLANTED_KERNEL = r'''
import json, sys, torch
from icqs_fast.kernels import linear_token_stats as k
from bench.gpu_model.dry_run import dry_run
orig = k.target_logits
def planted(hidden, weight, bias, targets, out):  # the bug: a CPU tensor into a CUDA kernel
    return orig(hidden, weight, bias, targets.cpu(), out)
k.target_logits = planted
r = dry_run(("bench_gpu",), compile=False)
sys.stdout.write("@@" + json.dumps(r["paths"]["bench_gpu"]))
'''


@pytest.mark.parametrize("script,needle", [(_PLANTED, "cuda:0 and cpu"),
                                           (_PLANTED_KERNEL, "is a cpu tensor")],
                         ids=["cpu-index-in-cuda-op", "cpu-tensor-into-kernel"])
@pytest.mark.subprocess
def test_dry_run_catches_a_planted_device_mixup(script, needle):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert "@@" in p.stdout, p.stderr[-3000:]
    e = json.loads(p.stdout.rsplit("@@", 1)[1])
    assert e["status"] == "error", e
    assert needle in e["error"].lower(), e["error"]


# --- GPU day one: make bench-gpu fits the lent machine's window and keeps what finished --------


def test_expected_duration_fits_the_budget():
    e = gpu.expected_duration()
    assert e["expected_s"] == pytest.approx(sum(e["sections_s"].values()))
    assert set(e["sections_s"]) == {"startup", "ops", "kernels", "icqs", "attention"}
    # The whole make target must fit ~8 minutes: the budget leaves room for the install.
    assert e["fits"] and e["budget_s"] == gpu.DEFAULT_BUDGET_S < 8 * 60
    assert gpu.expected_duration(quick=True)["expected_s"] < e["expected_s"]
    assert set(gpu.expected_duration(end_to_end=False)["sections_s"]) == {"startup", "ops"}


def test_progress_file_after_every_section(tmp_path):
    import json
    import time

    p = gpu._Progress(tmp_path, budget_s=60.0, t0=time.perf_counter())
    p.add("startup", "ok", 1.0)
    doc = json.loads((tmp_path / "gpu_day_one.json").read_text())
    assert [s["name"] for s in doc["sections"]] == ["startup"] and doc["budget_s"] == 60.0
    assert p.fits("kernels") and not p.fits("ops")  # 50 and 70 s expected, 60 s budget
    p.add("kernels", "timeout", 50.0, tmp_path / "kernels_cuda.json")
    doc = json.loads((tmp_path / "gpu_day_one.json").read_text())
    assert doc["sections"][1] == {"name": "kernels", "status": "timeout", "seconds": 50.0,
                                  "estimate_s": gpu.SECTION_ESTIMATE_S["kernels"],
                                  "file": "kernels_cuda.json"}


@pytest.mark.subprocess
@pytest.mark.subprocess
def test_dry_run_states_the_expected_duration(dry_report):
    r, rep = dry_report
    assert rep["gpu_run_expected"]["expected_s"] == gpu.expected_duration()["expected_s"]
    assert "expected duration of the real run" in r.stdout


def test_kernels_no_cpu_without_cuda_is_a_clear_error(capsys):
    from icqs_fast.cli import main

    assert main(["bench", "kernels", "--no-cpu", "--quick"]) == 2
    assert "--no-cpu" in capsys.readouterr().err


# --- the predictions beside a measured record (lab step; compiles for sm_90, no GPU) -----------


@pytest.mark.static
@pytest.mark.subprocess
def test_predictions_beside_a_measured_record(tmp_path):
    """``python -m bench.gpu_model.predict`` on a ``gpu_ops`` record of the shape ``bench gpu``
    writes: each Triton launch gets its measured time by kernel name, a prediction from the
    table and from the measured device, and ``rel_error = predicted / measured - 1``; the torch
    reference keeps its time and gets no prediction; a file that is not a record exits 2."""
    import json
    import os

    shape = [256, 32000]
    ops = [{"op": "token_stats", "variant": None, "dtype": "bf16", "shape": shape,
            "arch": "sm_90", "kind": "op", "measured_ms": 0.05,
            "kernel_ms": {"_token_stats_kernel": 0.04, "elementwise": 0.003},
            "kernels_ms": 0.043},
           {"op": "attention", "variant": "sdpa", "dtype": "bf16", "shape": [1, 8, 8, 512, 128],
            "arch": "sm_90", "kind": "op", "measured_ms": 0.2, "kernel_ms": {"flash": 0.19},
            "kernels_ms": 0.19}]
    doc = {"arch": "sm_90", "sms": 132, "records": ops,
           "device_measured": {"hbm_achievable": 4.0e12, "tensor_bf16_achievable": 7.0e14}}
    src = tmp_path / "gpu_ops_sm90.json"
    src.write_text(json.dumps(doc))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_model.predict", str(src)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_model_check_sm90.json").read_text())
    assert out["model_table"] and out["sms"] == 132
    (kern,) = [x for x in out["records"] if x["kind"] == "kernel"]
    assert kern["fn"] == "_token_stats_kernel" and kern["measured_ms"] == 0.04
    assert kern["predicted_ms"] > 0 and kern["predicted_ms_measured_hw"] > 0
    assert kern["rel_error"] == pytest.approx(kern["predicted_ms"] / 0.04 - 1)
    op, sdpa = [x for x in out["records"] if x["kind"] == "op"]
    assert op["kernels_ms"] == 0.04 and op["predicted_ms"] == pytest.approx(kern["predicted_ms"])
    assert op["rel_error_op"] == pytest.approx(op["predicted_ms"] / 0.05 - 1)
    assert sdpa["variant"] == "sdpa" and "predicted_ms" not in sdpa and sdpa["measured_ms"] == 0.2
    src.write_text(json.dumps({"arch": "sm_90"}))
    bad = subprocess.run([sys.executable, "-m", "bench.gpu_model.predict", str(src)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no field 'sms'" in bad.stderr
