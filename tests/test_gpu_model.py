"""The overlap range of the static GPU model (``predicted_low`` / ``predicted_high``), the error
fields of the validation records and the on-paper end-to-end calculation (``bench static
--e2e``). One test compiles (a child process, a few configurations); the rest is arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_model import e2e
from bench.gpu_model import model as gpu_model
from bench.gpu_model.compiler import clean_env
from bench.gpu_model.peer_validation import range_errors
from bench.gpu_model.static import CHILD_ENV

ROOT = Path(__file__).resolve().parents[1]


def _summary(body, rest, *, loop_mufu=0, rest_mufu=0, outer=0, tensor="hgmma"):
    counts = dict.fromkeys(gpu_model.CLASSES, 0)
    return gpu_model.SassSummary(
        total=body + rest, body=body, loop_counts={**counts, "instructions": body,
                                                   "mufu": loop_mufu},
        rest_counts={**counts, "instructions": rest, "mufu": rest_mufu}, tensor=tensor,
        tf32=False, loops=2 if outer else 1,
        outer_counts={**counts, "instructions": outer})


HW = gpu_model.hardware("sm_90", clock_hz=1e9, launch_overhead_s=0.0)
KW = {"num_warps": 4, "programs": 132, "regs": 64, "smem_bytes": 0}


def test_no_tensor_work_means_low_equals_high():
    p = gpu_model.predict(HW, _summary(100, 20, tensor=None), loop_iters=10, hbm_bytes=1e6,
                          tensor_flops=0, **KW)
    assert p["predicted_low_s"] == p["predicted_high_s"] == p["predicted_s"]


def test_softmax_loop_serialises_tensor_and_cuda_core_work():
    # MUFU in the hot loop (flash attention): high = t_tensor + t_cuda.
    s = _summary(100, 20, loop_mufu=8)
    flops = 132 * 4e6
    p = gpu_model.predict(HW, s, loop_iters=10, hbm_bytes=0, tensor_flops=flops, **KW)
    t_cuda = max(p["t_issue_s"], p["t_mufu_s"], p["t_shuffle_s"])
    assert p["t_tensor_s"] > 0 and t_cuda > 0
    assert p["predicted_low_s"] == pytest.approx(max(t_cuda, p["t_tensor_s"]))
    assert p["predicted_high_s"] == pytest.approx(t_cuda + p["t_tensor_s"])


def test_gemm_loop_overlaps_and_only_the_epilogue_is_added():
    # No MUFU in the hot loop (a K loop): high = max(t_tensor, loop part) + rest part; the
    # enclosing tile loop's 30 instructions run outer_iters = 5 times.
    s = _summary(100, 40, outer=30)
    flops = 132 * 2e8
    p = gpu_model.predict(HW, s, loop_iters=50, outer_iters=5, hbm_bytes=0,
                          tensor_flops=flops, **KW)
    per_warp = 100 * 50 + 40 + 30 * 4
    assert p["warp_instructions"] == 4 * per_warp
    t_issue = p["t_issue_s"]
    rest = t_issue * (40 + 30 * 4) / per_warp
    want = max(p["t_tensor_s"], t_issue - rest) + rest
    assert p["predicted_high_s"] == pytest.approx(want)
    assert p["predicted_low_s"] < p["predicted_high_s"] < p["t_tensor_s"] + t_issue
    assert p["frac_tensor_high"] == pytest.approx(flops / p["predicted_high_s"]
                                                  / HW.tensor_bf16_spec)


def test_range_errors():
    inside = range_errors(10.0, 8.0, 12.0)
    assert inside["rel_error_range"] == 0.0 and inside["within_35pct"]
    assert inside["rel_error_low"] == pytest.approx(-0.2)
    assert inside["rel_error_high"] == pytest.approx(0.2)
    assert inside["overlap_position"] == pytest.approx(0.5)
    below = range_errors(10.0, 4.0, 6.0)   # both ends fast: the nearer (high) end counts
    assert below["rel_error_range"] == pytest.approx(-0.4) and not below["within_35pct"]
    assert not below["within_35pct_high"]
    flat = range_errors(10.0, 9.0, 9.0)
    assert flat["overlap_position"] is None and flat["rel_error_range"] == pytest.approx(-0.1)


def test_e2e_prefix_bank_vs_naive():
    res = e2e.icqs_throughput()
    s = res["settings"]
    assert res["contexts_per_response"] == 20 and res["context_tokens"] == 8 * 160
    for way in ("naive", "prefix_bank"):
        for end in ("low", "high"):
            r = res[way][end]
            assert r["responses_per_s"] == pytest.approx(1 / r["seconds_per_response"])
            assert r["scored_tokens_per_s"] == pytest.approx(
                s["response_tokens"] * r["responses_per_s"])
        # The pessimistic end is slower.
        assert res[way]["high"]["responses_per_s"] < res[way]["low"]["responses_per_s"]
    # Naive FLOPs: 20 causal forwards of 1536 tokens.
    p = e2e._params(e2e.LLAMA_7B)
    t = 1280 + 256
    want = 20 * (2 * p * t + 4 * 32 * 4096 * t * (t + 1) / 2)
    assert res["flops_per_response"]["naive"] == pytest.approx(want)
    assert 6.5e9 < p < 6.8e9  # Llama-2-7B less its input embedding
    # The bank forwards 256 of every 1536 tokens: a speed-up near, and below, 6x.
    assert 5.0 < res["speedup"]["high"] < 6.0
    # Twice the ratios, twice the work per response.
    res2 = e2e.icqs_throughput(ratios=10)
    assert res2["naive"]["low"]["seconds_per_response"] == pytest.approx(
        2 * res["naive"]["low"]["seconds_per_response"])


@pytest.mark.subprocess
def test_e2e_cli_json():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_model.static", "--e2e", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert res["prefix_bank"]["high"]["responses_per_s"] > res["naive"]["low"]["responses_per_s"]


VALIDATE = '''
import json
from bench.gpu_model.compiler import Compiler
from bench.gpu_model.peer_validation import compute_validation_records
print(json.dumps(compute_validation_records(Compiler(), "sm_90", tiles=((64, 64),))))
'''


@pytest.mark.subprocess
def test_compute_bound_validation_records(tmp_path):
    """The four H100 points of the tutorial's attention forward, one tile each: every record
    carries low / high and its errors, is compute-bound, and lies within 35% at the
    pessimistic end (a prediction change that breaks this fails here)."""
    (tmp_path / "v.py").write_text(VALIDATE)
    env = clean_env()
    env[CHILD_ENV] = "1"
    proc = subprocess.run([sys.executable, str(tmp_path / "v.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = json.loads(proc.stdout)
    assert len(recs) == 4
    for r in recs:
        assert "error" not in r, r
        assert r["compute_bound_point"] and r["bound_class"] == "compute"
        assert r["predicted_low_ms"] < r["predicted_high_ms"]
        assert r["rel_error_low"] == pytest.approx(
            (r["predicted_low_ms"] - r["published_ms"]) / r["published_ms"])
        assert r["rel_error_high"] == pytest.approx(
            (r["predicted_high_ms"] - r["published_ms"]) / r["published_ms"])
        assert r["within_35pct_high"], r
        assert "flash3_fp16_fwd.png" in r["source"]
    flops = 4 * 4 * 32 * 4096 ** 2 * 64
    d64 = next(r for r in recs if r["shape"]["d"] == 64 and not r["shape"]["causal"])
    assert d64["published_ms"] == pytest.approx(flops / 400e12 * 1e3)


def test_cold_path_outside_the_tile_loop_runs_outer2_iters_times():
    # A loop around the tile loop (the masked fold kept out of it) with 200 instructions of its
    # own: they run outer2_iters = 3 times per program, the tile loop's 30 outer_iters = 5 times.
    counts = dict.fromkeys(gpu_model.CLASSES, 0)
    s = gpu_model.SassSummary(
        total=100 + 40 + 30 + 200, body=100,
        loop_counts={**counts, "instructions": 100},
        rest_counts={**counts, "instructions": 40 + 30 + 200}, tensor="hgmma", tf32=False,
        loops=3, outer_counts={**counts, "instructions": 30},
        outer2_counts={**counts, "instructions": 200})
    assert s.per_execution(50, "instructions", 5, 3) == 100 * 50 + 270 + 30 * 4 + 200 * 2
    p = gpu_model.predict(HW, s, loop_iters=50, outer_iters=5, outer2_iters=3, hbm_bytes=0,
                          tensor_flops=132 * 2e8, **KW)
    assert p["warp_instructions"] == 4 * (100 * 50 + 270 + 30 * 4 + 200 * 2)


def test_summarize_finds_the_loop_around_the_tile_loop():
    lines = []

    def ins(addr, text):
        lines.append(f"        /*{addr:04x}*/                   {text} ;")

    lines.append(".L_x_0:")        # outer loop head (cold path)
    ins(0x00, "FADD R1, R1, R2")
    lines.append(".L_x_1:")        # tile loop head
    ins(0x10, "IADD3 R3, R3, 0x1, RZ")
    lines.append(".L_x_2:")        # K loop head
    ins(0x20, "HGMMA.64x64x16.F32.BF16 R4, gdesc[UR4], R4")
    ins(0x30, "@P0 BRA `(.L_x_2)")
    ins(0x40, "MUFU.EX2 R5, R5")
    ins(0x50, "@P1 BRA `(.L_x_1)")
    ins(0x60, "FMUL R6, R6, R6")
    ins(0x70, "FMUL R6, R6, R6")
    ins(0x80, "@P2 BRA `(.L_x_0)")
    ins(0x90, "EXIT")
    s = gpu_model.summarize("\n".join(lines) + "\n")
    assert s.body == 2 and s.outer_counts["instructions"] == 3
    assert s.outer_counts["mufu"] == 1
    assert s.outer2_counts["instructions"] == 4  # FADD, two FMUL, the branch
