"""Static sm_90 / sm_80 compilation of every Triton kernel (no GPU, no driver) and the
performance model of :mod:`bench.gpu_model.model`.

The test suite runs with ``TRITON_INTERPRET=1`` (conftest), under which ``@triton.jit``
functions cannot be compiled, so every compilation runs in a child process with a clean
environment (:func:`bench.gpu_model.compiler.clean_env`). The shape table's launches are
compiled once per distinct configuration (``bench static`` dedupes them) and shared by the tests
through a module-scoped fixture.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_model import model as gpu_model
from bench.gpu_model.compiler import clean_env
from bench.gpu_model.static import CHILD_ENV

pytestmark = pytest.mark.static

ROOT = Path(__file__).resolve().parents[1]
MATMUL_KERNELS = ("linear_token_stats", "attention_entropy")


def _child(args: list[str], cwd: Path = ROOT, timeout: int = 900) -> subprocess.CompletedProcess:
    env = clean_env()
    env[CHILD_ENV] = "1"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> list[dict]:
    """Records of ``bench static`` over the full shape table (no validation records), one child
    per arch, both running at once (each compiles its distinct configurations once)."""
    tmp = tmp_path_factory.mktemp("static")
    procs = {}
    for arch in ("sm_90", "sm_80"):
        env = clean_env()
        env[CHILD_ENV] = "1"
        procs[arch] = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu_model.static", "--arch", arch,
             "--no-validation", "--out", str(tmp / f"{arch}.json")],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    recs = []
    for arch, proc in procs.items():
        _, err = proc.communicate(timeout=1800)
        assert proc.returncode == 0, err[-4000:]
        recs += json.loads((tmp / f"{arch}.json").read_text())
    return recs


def _where(r: dict) -> str:
    return f"{r['arch']} {r['kernel']} {r.get('dtype')} {r.get('config', {}).get('label')} " \
           f"{r.get('shape')}"


def _distinct(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in records:
        key = (r["arch"], r["kernel"], r.get("dtype"), json.dumps(r.get("config"), sort_keys=True,
                                                                   default=str))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def test_every_launch_compiles_for_both_archs(table):
    assert {r["arch"] for r in table} == {"sm_90", "sm_80"}
    assert {r.get("op", r["kernel"]) for r in table} >= {
        "token_stats", "linear_token_stats", "attention_entropy"}
    bad = [f"{_where(r)}: {r['error']}" for r in table if "error" in r]
    assert not bad, "\n".join(bad)


def test_no_spills(table):
    bad = [f"{_where(r)}: {r['spill_bytes']} spill bytes (stack {r['stack_bytes']}, local "
           f"{r['local_bytes']}), {r['regs']} regs"
           for r in _distinct(table) if "error" not in r and r["spill_bytes"]]
    assert not bad, "\n".join(bad)


def test_shared_memory_within_the_arch_limit(table):
    limits = {a: gpu_model.hardware(a).smem_per_block for a in ("sm_90", "sm_80")}
    bad = [f"{_where(r)}: {r['smem_bytes']} B > {limits[r['arch']]} B"
           for r in _distinct(table) if "error" not in r and r["smem_bytes"] > limits[r["arch"]]]
    assert not bad, "\n".join(bad)
    assert all(r["occupancy"]["blocks_per_sm"] >= 1 for r in table if "error" not in r)


def _rows(r: dict) -> int:
    shape = r["shape"]
    return shape["n"] if "n" in shape else shape["tq"]


def test_matmul_kernels_use_wgmma_on_sm90_and_mma_on_sm80(table):
    bad = []
    for r in _distinct(table):
        if r["kernel"] not in MATMUL_KERNELS or "error" in r:
            continue
        want = "hmma" if r["arch"] == "sm_80" else ("hgmma" if _rows(r) >= 64 else None)
        if not r["tensor_cores"] or (want and r["tensor_instr"] != want):
            bad.append(f"{_where(r)}: tensor instructions {r['tensor_instr']}, want "
                       f"{want or 'any'}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# The SASS parser and hot-loop finder on known input

SASS = """\
        .text.k:
k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, 0x0 ;
.L_x_0:
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0030*/                   MOV R3, 0x0 ;
.L_x_1:
        /*0040*/                   MUFU.EX2 R5, R2 ;
        /*0050*/                   SHFL.BFLY PT, R6, R5, 0x10, 0x1f ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*00a0*/              @!P0 BRA `(.L_x_0) ;
        /*00b0*/                   STG.E desc[UR4][R6.64], R8 ;
        /*00c0*/                   EXIT ;
.L_x_2:
        /*00d0*/                   BRA `(.L_x_2);
"""


def test_parse_sass_instructions_labels_and_branch_targets():
    instrs, labels = gpu_model.parse_sass(SASS)
    assert len(instrs) == 14
    assert labels[".L_x_0"] == 0x20 and labels[".L_x_1"] == 0x40 and labels[".L_x_2"] == 0xD0
    bra = [i for i in instrs if i.base == "BRA"]
    assert [(b.pred, b.target) for b in bra] == [("@P1", ".L_x_1"), ("@!P0", ".L_x_0"),
                                                ("", ".L_x_2")]
    assert instrs[4].opcode == "MUFU.EX2" and instrs[4].base == "MUFU"


def test_hot_loop_is_the_innermost_and_the_trap_is_not_a_loop():
    instrs, labels = gpu_model.parse_sass(SASS)
    loops = gpu_model.find_loops(instrs, labels)
    assert [(lp.start, lp.end) for lp in loops] == [(2, 10), (4, 8)]
    hot = gpu_model.hot_loop(loops)
    assert (hot.start, hot.end) == (4, 8)
    s = gpu_model.summarize(SASS)
    assert (s.total, s.body, s.loops) == (14, 5, 2)
    assert s.loop_counts == {"barrier": 1, "shuffle": 1, "mufu": 1, "tensor": 0,
                             "global_load": 0, "global_store": 0, "shared": 0, "local": 0,
                             "instructions": 5}
    assert s.rest_counts["tensor"] == 1 and s.rest_counts["global_store"] == 1
    assert s.tensor == "hmma" and not s.tf32
    assert s.per_execution(10, "mufu") == 10 and s.per_execution(10, "instructions") == 59


def test_no_loop_means_an_empty_body():
    s = gpu_model.summarize("        /*0000*/                   EXIT ;\n")
    assert (s.total, s.body, s.loops) == (1, 0, 0)


def test_res_usage_parse():
    text = " Function k:\n  REG:94 STACK:32 SHARED:1024 LOCAL:8 CONSTANT[0]:608 TEXTURE:0\n"
    assert gpu_model.parse_res_usage(text) == {"regs": 94, "stack": 32, "static_smem": 1024,
                                               "local": 8}


# ----------------------------------------------------------------------------------------------
# A tiny hand-written kernel whose loop is known: 1024 fp32 per iteration over 4 warps = 8 per
# thread, so the loop body has 8 MUFU.EX2 and two 16-byte loads per thread, the store after it.

TINY = '''
import triton
import triton.language as tl


@triton.jit
def tiny_sum_exp(X, OUT, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * n + cols, mask=cols < n, other=0.0)
        acc += tl.exp(x)
    tl.store(OUT + row, tl.sum(acc, axis=0))
'''

TINY_RUN = '''
import json, sys
sys.path.insert(0, sys.argv[1])
from tiny_kernel import tiny_sum_exp
from bench.gpu_model.launches import Launch
from bench.gpu_model.compiler import Compiler, analyze

ln = Launch(kernel="tiny", fn=tiny_sum_exp,
            signature={"X": "*fp32", "OUT": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            constexprs={"BLOCK": 1024}, num_warps=4, num_stages=1, grid=(4096, 1, 1),
            hbm_bytes=4096 * 65536 * 4, elements=4096 * 65536, loop_iters=64.0,
            loop_elements=1024, extra={"divisible_by_16": ["X", "OUT", "n"]})
c = Compiler()
print(json.dumps([analyze(ln, a, c(ln, a)) for a in ("sm_90", "sm_80")]))
'''


def test_tiny_kernel_hot_loop_counts(tmp_path):
    (tmp_path / "tiny_kernel.py").write_text(TINY)
    (tmp_path / "run.py").write_text(TINY_RUN)
    proc = _child([str(tmp_path / "run.py"), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in json.loads(proc.stdout):
        assert "error" not in r, r
        hot = r["sass"]["hot_loop"]
        assert r["sass"]["loops"] == 1
        assert hot["mufu"] == 8 and hot["global_load"] == 2 and hot["global_store"] == 0
        assert hot["barrier"] == 0 and hot["shuffle"] == 0
        assert r["sass_per_element"]["mufu"] == pytest.approx(8 * 4 / 1024)
        assert r["spill_bytes"] == 0 and not r["tensor_cores"]
        # 1 GiB of fp32 at the achievable bandwidth; the issue term is far below it.
        hw = gpu_model.hardware(r["arch"])
        assert r["bound"] == "hbm"
        assert r["predicted_ms"] == pytest.approx(
            (2**30 / hw.hbm_achievable + hw.launch_overhead_s) * 1e3)


# ----------------------------------------------------------------------------------------------
# The model's arithmetic

def _summary(body: int, rest: int, mufu: int = 0, shfl: int = 0, tensor=None):
    counts = dict.fromkeys(gpu_model.CLASSES, 0)
    loop = {**counts, "instructions": body, "mufu": mufu, "shuffle": shfl}
    return gpu_model.SassSummary(total=body + rest, body=body, loop_counts=loop,
                                 rest_counts={**counts, "instructions": rest}, tensor=tensor,
                                 tf32=False, loops=1 if body else 0)


def test_occupancy_limits():
    hw = gpu_model.hardware("sm_90")
    # 255 regs -> 256 per thread -> 8192 per warp; 4 warps -> 2 blocks by registers.
    occ = gpu_model.occupancy(hw, regs=255, smem_bytes=0, num_warps=4)
    assert occ["by_regs"] == 2 and occ["blocks_per_sm"] == 2
    # 100 KB + 1 KB reserved per block -> 2 blocks in 228 KB.
    occ = gpu_model.occupancy(hw, regs=32, smem_bytes=100 * 1024, num_warps=4)
    assert occ["by_smem"] == 2 and occ["blocks_per_sm"] == 2
    occ = gpu_model.occupancy(hw, regs=32, smem_bytes=0, num_warps=32)
    assert occ["by_warps"] == 2 and occ["blocks_per_sm"] == 2


def test_predicted_time_terms_and_waves():
    hw = gpu_model.hardware("sm_90", clock_hz=1e9, launch_overhead_s=0.0)
    s = _summary(body=100, rest=20, mufu=10, shfl=5)
    # 264 programs on 132 SMs: 2 per SM, both resident (1 wave), 8 warps each -> 4 issue/clk.
    p = gpu_model.predict(hw, s, num_warps=8, programs=264, loop_iters=10, hbm_bytes=0,
                          tensor_flops=0, regs=32, smem_bytes=0)
    instr = 8 * (100 * 10 + 20)
    assert p["warp_instructions"] == instr
    assert p["t_issue_s"] == pytest.approx(2 * instr / 4e9)
    assert p["t_mufu_s"] == pytest.approx(2 * 8 * 32 * 100 / 16e9)
    assert p["t_shuffle_s"] == pytest.approx(2 * 8 * 32 * 50 / 32e9)
    assert p["bound"] == "issue" and p["predicted_s"] == pytest.approx(p["t_issue_s"])
    # One more program: the busiest SM runs 3, still one wave (blocks_per_sm = 8).
    p3 = gpu_model.predict(hw, s, num_warps=8, programs=265, loop_iters=10, hbm_bytes=0,
                           tensor_flops=0, regs=32, smem_bytes=0)
    assert p3["t_issue_s"] == pytest.approx(3 * instr / 4e9)
    # One warp per program, one program per SM: one scheduler busy, a quarter of the rate.
    p1 = gpu_model.predict(hw, s, num_warps=1, programs=132, loop_iters=10, hbm_bytes=0,
                           tensor_flops=0, regs=32, smem_bytes=0)
    assert p1["t_issue_s"] == pytest.approx((100 * 10 + 20) / 1e9)
    # Registers allow 1 block of 32 warps per SM: 3 programs per SM -> 3 waves.
    pw = gpu_model.predict(hw, s, num_warps=32, programs=3 * 132, loop_iters=10, hbm_bytes=0,
                           tensor_flops=0, regs=64, smem_bytes=0)
    assert pw["occupancy"]["blocks_per_sm"] == 1 and pw["waves"] == 3


def test_predicted_time_hbm_and_tensor_bounds():
    hw = gpu_model.hardware("sm_90", launch_overhead_s=2e-6)
    s = _summary(body=10, rest=10)
    p = gpu_model.predict(hw, s, num_warps=4, programs=1320, loop_iters=1, hbm_bytes=3e9,
                          tensor_flops=0, regs=32, smem_bytes=0)
    assert p["bound"] == "hbm"
    assert p["predicted_s"] == pytest.approx(3e9 / hw.hbm_achievable + 2e-6)
    assert p["frac_hbm"] == pytest.approx((3e9 / p["predicted_s"]) / hw.hbm_achievable)
    st = _summary(body=10, rest=10, tensor="hgmma")
    flops = 2 * 8192 * 4096 * 151936
    p = gpu_model.predict(hw, st, num_warps=8, programs=132 * 10, loop_iters=1, hbm_bytes=0,
                          tensor_flops=flops, regs=128, smem_bytes=0)
    assert p["bound"] == "tensor"
    assert p["t_tensor_s"] == pytest.approx(flops / hw.tensor_bf16_achievable)
    assert p["frac_tensor"] == pytest.approx(flops / p["predicted_s"] / hw.tensor_bf16_spec)
    # Without tensor-core instructions the FLOPs are FFMAs (already in the issue term).
    p = gpu_model.predict(hw, s, num_warps=8, programs=1320, loop_iters=1, hbm_bytes=0,
                          tensor_flops=flops, regs=128, smem_bytes=0)
    assert p["t_tensor_s"] == 0.0 and "frac_tensor" not in p


def test_hardware_overrides(monkeypatch):
    assert gpu_model.hardware(90).sms == 132 and gpu_model.hardware("sm_80").sms == 108
    monkeypatch.setenv("ICQS_GPU_MODEL", "clock_hz=1.755e9,sms=130")
    monkeypatch.setenv("ICQS_GPU_ISSUE_EFFICIENCY", "0.8")
    hw = gpu_model.hardware("sm_90", hbm_achievable=2.9e12)
    assert (hw.clock_hz, hw.sms, hw.issue_efficiency, hw.hbm_achievable) == (
        1.755e9, 130, 0.8, 2.9e12)
    with pytest.raises(ValueError):
        gpu_model.hardware("sm_70")
    with pytest.raises(ValueError):
        gpu_model.hardware("sm_90", not_a_field=1)
    assert all(hw.sources for hw in gpu_model.HARDWARE.values())
