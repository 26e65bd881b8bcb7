"""``icqs-fast bench gpu`` on a machine without a GPU: it refuses clearly, its case table maps to
real launches, and its ratio arithmetic is right. (The GPU run itself is ``make bench-gpu``.)"""

import subprocess
import sys

import pytest
import torch

from icqs_fast.benchmarks import gpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def test_refuses_without_cuda():
    r = subprocess.run([sys.executable, "-m", "icqs_fast.cli", "bench", "gpu", "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA device" in r.stderr


@pytest.mark.parametrize("case", gpu.CASES + gpu.QUICK_CASES, ids=str)
def test_cases_describe_launches(case):
    """Every case builds the launches a GPU run would compile and time (names the profiler
    matches, positive work)."""
    from icqs_fast.kernels import attention_entropy, linear_token_stats, token_stats

    op, dt, shape = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    if op == "token_stats":
        launches = token_stats.gpu_launches(*shape, dtype)
    elif op == "linear_token_stats":
        launches = linear_token_stats.gpu_launches(*shape, dtype)
    else:
        b, hq, hk, t, d = shape
        launches = attention_entropy.gpu_launches(b, hq, hk, t, t, d, dtype, True)
    assert launches
    for ln in launches:
        assert ln.fn.__name__.startswith("_")
        assert ln.programs >= 1 and ln.hbm_bytes > 0


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
