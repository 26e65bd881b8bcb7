"""``icqs-fast bench gpu``: measured GPU times beside the static model's predictions.

Run on a machine with an NVIDIA GPU (``make bench-gpu``). For each headline case of issue 9
(``token_stats`` bf16 ``[8192, 151936]`` and smaller N, ``linear_token_stats`` bf16 N x 4096 x
151936, attention entropy bf16 at head dims 64/128 with and without the entropy state) it

* times the public op end to end with ``triton.testing.do_bench`` (L2 flushed between runs),
* times each Triton kernel of the op alone from the CUDA profiler (kernel names of the op's
  :func:`gpu_launches`), and
* compiles the same launches for this GPU's arch and asks :mod:`icqs_fast.benchmarks.gpu_model` for
  a
  prediction, twice: with the model's table figures and with this device's measured copy
  bandwidth and bf16 matmul rate (so an H200, whose memory is faster than the table's H100,
  is still judged fairly).

It writes ``gpu_model_check_<arch>.json`` (one record per kernel launch and per op, with
``measured_ms``, ``predicted_ms`` and ``rel_error = predicted / measured - 1``) to ``--out-dir``
and then runs ``bench kernels``, ``bench attention`` and ``bench icqs`` in child processes, each
writing its own ``*_cuda.json`` there, so one that fails (e.g. out of memory) loses nothing else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from icqs_fast.benchmarks import environment

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

# (op, dtype, shape): shape is [N, V] for token_stats, [N, H, V] for linear_token_stats and
# [B, Hq, Hk, T, D] for attention (causal, every query row flagged, key range = all keys).
CASES: list[tuple[str, str, tuple[int, ...]]] = [
    ("token_stats", "bf16", (8192, 151936)),
    ("token_stats", "fp16", (8192, 151936)),
    ("token_stats", "fp32", (8192, 151936)),
    ("token_stats", "bf16", (1024, 151936)),
    ("token_stats", "bf16", (64, 151936)),
    ("token_stats", "bf16", (1, 151936)),
    ("linear_token_stats", "bf16", (8192, 4096, 151936)),
    ("linear_token_stats", "bf16", (512, 4096, 151936)),
    ("linear_token_stats", "bf16", (16, 4096, 151936)),
    ("linear_token_stats", "bf16", (8192, 2048, 128256)),
    ("attention", "bf16", (1, 32, 8, 4096, 128)),
    ("attention", "bf16", (1, 32, 32, 4096, 128)),
    ("attention", "bf16", (1, 32, 8, 4096, 64)),
]
QUICK_CASES: list[tuple[str, str, tuple[int, ...]]] = [
    ("token_stats", "bf16", (256, 32000)),
    ("linear_token_stats", "bf16", (256, 1024, 32000)),
    ("attention", "bf16", (1, 8, 8, 512, 128)),
]
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def arch_of(device: torch.device) -> str:
    """``"sm_90"`` / ``"sm_80"`` for this GPU; other archs map to the nearest modelled one."""
    major, minor = torch.cuda.get_device_capability(device)
    return "sm_90" if major >= 9 else "sm_80"


def measure_device(device: torch.device) -> dict[str, float]:
    """This GPU's copy bandwidth (read + write bytes / s) and bf16 8192^3 matmul FLOP/s."""
    from triton.testing import do_bench

    x = torch.empty(1 << 28, dtype=torch.float32, device=device).fill_(1.0)  # 1 GiB
    copy_ms = do_bench(lambda: x.clone(), warmup=25, rep=200)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=200)
    return {"hbm_achievable": 2 * (1 << 30) / (copy_ms * 1e-3),
            "tensor_bf16_achievable": 2 * 8192**3 / (mm_ms * 1e-3)}


def kernel_times(fn: Callable[[], Any], names: set[str], repeat: int = 10) -> dict[str, float]:
    """Mean CUDA time (ms) per call of each kernel in ``names`` over ``repeat`` calls of ``fn``
    (the CUDA profiler's device-side durations, so launch gaps and host work don't count)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        # Triton kernels appear under their function's name; exact match only, so that e.g.
        # "_token_stats_kernel" never counts "_linear_token_stats_kernel" too.
        if ev.name in names:
            total[ev.name] = total.get(ev.name, 0.0) + ev.device_time / 1e3  # us -> ms
    return {k: v / repeat for k, v in total.items()}


def _case_fns(op: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device):
    """(launches, {variant: callable}) for one case; inputs built on the device."""
    from icqs_fast import ops
    from icqs_fast.kernels import attention_entropy as ak
    from icqs_fast.kernels import linear_token_stats as lk
    from icqs_fast.kernels import token_stats as tk

    gen = torch.Generator(device=device).manual_seed(0)
    if op == "token_stats":
        n, v = shape
        z = (torch.randn(n, v, generator=gen, device=device) * 4).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen, device=device)
        return {"": (tk.gpu_launches(n, v, dtype),
                     lambda: ops.token_stats(z, t, backend="triton"))}
    if op == "linear_token_stats":
        n, h, v = shape
        hid = torch.randn(n, h, generator=gen, device=device).to(dtype)
        w = (torch.randn(v, h, generator=gen, device=device) * (3 / h**0.5)).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen, device=device)
        return {"": (lk.gpu_launches(n, h, v, dtype),
                     lambda: ops.linear_token_stats(hid, w, t, backend="triton"))}
    b, hq, hk, tt, d = shape
    q = torch.randn(b, hq, tt, d, generator=gen, device=device).to(dtype)
    k = torch.randn(b, hk, tt, d, generator=gen, device=device).to(dtype)
    vv = torch.randn(b, hk, tt, d, generator=gen, device=device).to(dtype)
    kr = torch.tensor([[0, tt]] * b, device=device)
    qm = torch.ones(b, tt, dtype=torch.bool, device=device)
    scale = d ** -0.5
    return {
        "entropy": (ak.gpu_launches(b, hq, hk, tt, tt, d, dtype, True, entropy=True),
                    lambda: ak.launch_attention(q, k, vv, causal=True, scale=scale,
                                                key_range=kr, query_mask=qm)),
        "no_entropy": (ak.gpu_launches(b, hq, hk, tt, tt, d, dtype, True, entropy=False),
                       lambda: ak.launch_attention(q, k, vv, causal=True, scale=scale)),
        "sdpa": (None, lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1),
            is_causal=True)),
    }


def check_case(op: str, dtype_name: str, shape: tuple[int, ...], device: torch.device,
               compiler, hw_table, hw_measured, arch: str) -> list[dict]:
    """Records for one case: one per Triton launch and one for the whole op (per variant)."""
    from triton.testing import do_bench

    from icqs_fast.benchmarks.static import analyze

    dtype = _DTYPES[dtype_name]
    out: list[dict] = []
    for variant, (launches, fn) in _case_fns(op, dtype, shape, device).items():
        op_ms = do_bench(fn, warmup=10, rep=100)
        base = {"op": op, "variant": variant or None, "dtype": dtype_name, "shape": list(shape),
                "arch": arch}
        if launches is None:  # a reference without a model (e.g. torch sdpa)
            out.append({**base, "kind": "op", "measured_ms": op_ms})
            continue
        names = {ln.fn.__name__ for ln in launches}
        measured = kernel_times(fn, names)
        pred_sum = pred_sum_meas = 0.0
        for ln in launches:
            compiled = compiler(ln, arch)
            rec_t = analyze(ln, arch, compiled, hw_table)
            rec_m = analyze(ln, arch, compiled, hw_measured)
            p_t, p_m = rec_t.get("predicted_ms"), rec_m.get("predicted_ms")
            m = measured.get(ln.fn.__name__)
            pred_sum += p_t or 0.0
            pred_sum_meas += p_m or 0.0
            out.append({**base, "kind": "kernel", "kernel": ln.kernel, "fn": ln.fn.__name__,
                        "config": ln.label, "measured_ms": m, "predicted_ms": p_t,
                        "predicted_ms_measured_hw": p_m, "bound": rec_t.get("bound"),
                        "rel_error": None if not (m and p_t) else p_t / m - 1,
                        "rel_error_measured_hw": None if not (m and p_m) else p_m / m - 1,
                        "regs": rec_t.get("regs"), "spill_bytes": rec_t.get("spill_bytes"),
                        "error": rec_t.get("error")})
        kern_ms = sum(v for v in measured.values())
        out.append({**base, "kind": "op", "measured_ms": op_ms, "kernels_ms": kern_ms,
                    "predicted_ms": pred_sum, "predicted_ms_measured_hw": pred_sum_meas,
                    "rel_error_kernels": pred_sum / kern_ms - 1 if kern_ms else None,
                    "rel_error_op": pred_sum / op_ms - 1 if op_ms else None})
    return out


def _attention_ratios(records: list[dict]) -> None:
    """Add ``ratio_vs_no_entropy`` / ``ratio_vs_sdpa`` to each attention ``entropy`` op record."""
    ops_ = {(r["op"], tuple(r["shape"]), r["variant"]): r for r in records if r["kind"] == "op"}
    for (op, shape, variant), r in ops_.items():
        if op != "attention" or variant != "entropy":
            continue
        ne = ops_.get((op, shape, "no_entropy"))
        sd = ops_.get((op, shape, "sdpa"))
        if ne:
            r["ratio_vs_no_entropy"] = r["measured_ms"] / ne["measured_ms"]
        if sd:
            r["ratio_vs_sdpa"] = r["measured_ms"] / sd["measured_ms"]


def _run_child(argv: list[str], log: Path) -> int:
    cmd = [sys.executable, "-m", "icqs_fast.cli", *argv]
    print("bench gpu: running", " ".join(argv), flush=True)
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("icqs-fast bench gpu: no CUDA device here; this command measures GPU times "
              "(use `icqs-fast bench static` for the predictions alone)", file=sys.stderr)
        return 2
    from icqs_fast.benchmarks import gpu_model
    from icqs_fast.benchmarks.static import Compiler

    device = torch.device("cuda")
    out_dir = Path(args.out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    arch = arch_of(device)
    props = torch.cuda.get_device_properties(device)
    dev_figs = measure_device(device)
    hw_table = gpu_model.hardware(arch)
    hw_measured = gpu_model.hardware(arch, sms=props.multi_processor_count, **dev_figs)
    compiler = Compiler()
    records: list[dict] = []
    failed = 0
    for op, dt, shape in (QUICK_CASES if args.quick else CASES):
        try:
            records += check_case(op, dt, shape, device, compiler, hw_table, hw_measured, arch)
        except (RuntimeError, ValueError, MemoryError) as exc:
            failed += 1
            print(f"bench gpu: {op} {dt} {list(shape)} failed: {exc}", file=sys.stderr)
            records.append({"op": op, "dtype": dt, "shape": list(shape), "kind": "op",
                            "error": str(exc)[:500]})
        torch.cuda.empty_cache()
    _attention_ratios(records)
    env = environment(device)
    import triton

    doc = {**env, "triton": triton.__version__, "arch": arch, "device_measured": dev_figs,
           "model_table": hw_table.name, "records": records}
    path = out_dir / f"gpu_model_check_{arch.replace('_', '')}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"bench gpu: wrote {path}")
    for r in records:
        if r.get("kind") == "op" and "predicted_ms" in r:
            print(f"  {r['op']:19s} {r.get('variant') or '':10s} {r['dtype']} "
                  f"{str(r['shape']):28s} measured {r['measured_ms']:.3f} ms "
                  f"(kernels {r['kernels_ms']:.3f}) predicted {r['predicted_ms']:.3f} ms")
    if not args.no_end_to_end:
        q = ["--quick"] if args.quick else []
        # GPU-only runs: no CPU memory subprocesses; llama-1b shapes with random weights (no hub).
        children = [
            (["bench", "kernels", "--json", *q, "--out", str(out_dir / "kernels_cuda.json")],
             "kernels"),
            (["bench", "attention", "--device", "cuda", "--random-weights", "--config",
              "tiny" if args.quick else "llama-1b", "--json", "--no-memory",
              *(["--quick"] if args.quick else ["--seq-len", "4096"]),
              "--out", str(out_dir / "attention_cuda.json")], "attention"),
            (["bench", "icqs", "--device", "cuda", "--random-weights", "--config",
              "tiny" if args.quick else "llama-1b", "--json", "--no-memory",
              *(["--responses", "8"] if args.quick else []),
              "--out", str(out_dir / "icqs_cuda.json")], "icqs"),
        ]
        for argv, name in children:
            rc = _run_child(argv, out_dir / f"{name}_cuda.log")
            if rc:
                failed += 1
                print(f"bench gpu: bench {name} exited {rc} (see {name}_cuda.log)",
                      file=sys.stderr)
    return 1 if failed else 0

