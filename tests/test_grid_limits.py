"""Every launch within CUDA's grid, block and shared-memory limits (issue 49, item 3): the
attention grid folds rows x heads into axis x, and the fake-CUDA recorder refuses a launch past
a limit, naming the kernel. Triton's own launcher checks none of it, so on a GPU such a launch
fails mid-job with "invalid argument"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from icqs_fast.kernels import attention_entropy as ak

from bench.gpu_model.launches import MAX_GRID, limit_problems
from bench.gpu_model.launches import attention_entropy as akl
from icqs_fast.engine.settings import DEFAULT_TOKEN_BUDGET, MAX_TOKEN_BUDGET

ROOT = Path(__file__).resolve().parents[1]


def test_limit_problems_name_the_kernel_and_the_limit():
    assert limit_problems("k", (2 ** 31 - 1, 65535, 65535), 32) == []
    (p,) = limit_problems("_attn_entropy_fwd", (1, 65536, 1), 4)
    assert "_attn_entropy_fwd" in p and "axis y" in p and "65535" in p
    (p,) = limit_problems("k", (2 ** 31, 1, 1), 4)
    assert "axis x" in p
    (p,) = limit_problems("k", (1, 1, 1), 64)
    assert "2048 threads" in p
    (p,) = limit_problems("k", (1, 1, 1), 4, shared_bytes=300_000, shared_limit=232_448)
    assert "300000 bytes" in p and "232448" in p


@pytest.mark.parametrize("budget", [DEFAULT_TOKEN_BUDGET, MAX_TOKEN_BUDGET])
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("suffix", [1, 2, 8, 16, 64])
def test_cascade_suffix_grid_within_limits(budget, heads, suffix):
    """The cascade's suffix part runs the kernel on ``[rows, Hq, S, D]`` with rows x S up to
    the token budget: at 16,384 one-token rows and 32 heads, rows x heads was 524,288 programs
    on grid y (limit 65,535). Its prefix part runs ``[entries, Hk, n group S, D]``."""
    rows = budget // suffix
    for dtype in (torch.bfloat16, torch.float32):
        (ln,) = akl.gpu_launches(rows, heads, 8, suffix, suffix, 128, dtype, True, lse=True)
        assert limit_problems(ln.kernel, ln.grid, ln.num_warps) == [], ln.grid
        cfg = ak.attention_settings(rows, heads, suffix, suffix, 128, dtype)
        m_blocks = -(-suffix // cfg.block_m)
        assert cfg.grid == (m_blocks * rows * heads, 1, 1) == ln.grid
        assert cfg.grid[0] <= MAX_GRID[0]


_FAKE = r'''
import dataclasses, json, sys, torch
from icqs_fast import ops
from bench.gpu_model.fake_cuda import CUDA0, DeviceLimitError, FakeCuda, Recorder
from icqs_fast.kernels import attention_entropy as ak

rows, heads, s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] == "unfolded":  # the launch before the fold: rows x heads on grid y
    orig = ak.attention_settings
    def unfolded(b, hq, tq, *a, **k):
        cfg = orig(b, hq, tq, *a, **k)
        return dataclasses.replace(cfg, grid=(-(-tq // cfg.block_m), b * hq, 1))
    ak.attention_settings = unfolded
rec = Recorder(compile=False)
out = {}
try:
    with FakeCuda(rec):
        q = torch.empty(rows, heads, s, 128, dtype=torch.bfloat16, device=CUDA0)
        kv = torch.empty(rows, 8, s, 128, dtype=torch.bfloat16, device=CUDA0)
        ops.attention_lse(q, kv, kv, scale=0.1, causal=True, backend="triton")
    out["ok"] = True
except DeviceLimitError as exc:
    out["error"] = str(exc)
out["grids"] = [e["grid"] for e in rec.launches]
sys.stdout.write("@@" + json.dumps(out))
'''


@pytest.mark.subprocess
@pytest.mark.parametrize("layout", ["folded", "unfolded"])
def test_recorder_checks_the_engine_launch(layout):
    """On the fake CUDA device (compiled launches need Triton's interpreter off: a child), the
    suffix part's launch at the default budget, one-token suffixes and 32 heads passes; the
    unfolded grid of before is refused with the kernel's name."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _FAKE, str(DEFAULT_TOKEN_BUDGET), "32", "1",
                        layout], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert "@@" in p.stdout, p.stderr[-3000:]
    out = json.loads(p.stdout.rsplit("@@", 1)[1])
    if layout == "folded":
        assert out.get("ok"), out
        assert out["grids"] == [[DEFAULT_TOKEN_BUDGET * 32, 1, 1]]
    else:
        assert "_attn_entropy_fwd" in out["error"] and "axis y" in out["error"], out
        assert out["grids"] == [[1, DEFAULT_TOKEN_BUDGET * 32, 1]]
