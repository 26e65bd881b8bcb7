"""``icqs-fast bench gpu``: measured GPU times of the Triton kernels and their ops.

Run on a machine with an NVIDIA GPU (``make bench-gpu``). For each headline case
(``token_stats`` bf16 ``[8192, 151936]`` and smaller N, ``linear_token_stats`` bf16 N x
4096 x 151936, attention entropy bf16 at head dims 64/128 with and without the entropy state) it

* times the public op end to end with ``triton.testing.do_bench`` (L2 flushed between runs),
* times each CUDA kernel the op launches alone, from the CUDA profiler (``kernel_ms``, by
  kernel name), and
* measures this device's copy bandwidth and bf16 matmul rate once (``device_measured``).

It writes ``gpu_ops_<arch>.json`` (one record per op and variant, with ``measured_ms`` and
``kernel_ms``) to ``--out-dir``, rewritten after every case, and then runs ``bench kernels``
(its CUDA records), ``bench icqs`` and ``bench attention`` in child processes, each writing its
own ``*_cuda.json`` there, so one that fails (e.g. out of memory) loses nothing else. The static
model's predictions beside these times are a laboratory step that reads the record
(``python -m bench.gpu_model.predict``, not part of the installed package).

The device window of a lent GPU machine is short (about 8 minutes for ``make bench-gpu``, the
install included), so the run has a time budget (``--budget-s``, :data:`DEFAULT_BUDGET_S`): a
section whose expected duration (:data:`SECTION_ESTIMATE_S`, reasoned from the code for a fresh
H100, see :func:`expected_duration`) no longer fits is skipped, a child is stopped when the
budget ends, and ``gpu_day_one.json`` (each section's status, seconds and file) is rewritten after
every section: a run cut anywhere still leaves every finished section's data.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from icqs_fast.benchmarks import environment
from icqs_fast.io.files import write_whole

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

# Seconds `bench gpu` may take: the GPU machine's device window is about 8 minutes for the whole
# `make bench-gpu` (a fresh machine: imports, the in-place install without the C++ extension,
# about 30 s, then this command), so 7 minutes here with room to spare. Tuned for that window
# only; --budget-s overrides it.
DEFAULT_BUDGET_S = 420.0
# Expected seconds of each section on a fresh H100 machine (empty Triton and CUDA caches, 16 CPU
# cores), reasoned from the code, not measured (no GPU has been lent to measure them):
# - startup: importing torch, triton and transformers, the CUDA context (~10-15 s);
# - ops: measure_device (1 GiB copy and a bf16 8192^3 matmul under do_bench, ~3 s), then 13
#   cases: about 20 distinct kernel configurations, each JIT-compiled by Triton when first run
#   (~2 s), ~20 do_bench timings of ~0.3 s and 10 profiled calls per op (~1 s each), inputs of
#   up to 5 GB built on the device;
# - kernels: a child (startup ~15 s) timing 7 CUDA records x 5 repeats against the torch
#   baseline and a float64 reference of [8192, 151936] logits (~2 s each), CPU records off;
# - icqs: a child (startup ~15 s, a 1.1B random Llama initialised on the CPU ~15 s) scoring
#   64 responses x 20 contexts: the naive side 1280 forwards of ~400 tokens (~10 ms each, launch
#   bound), the engine a few seconds, its FLOP-counting pass and matmul probes (~10 s);
# - attention: a child (startup and model ~30 s), eager attention with output_attentions at 4096
#   tokens x 22 layers (3 repeats each side) and the Triton-vs-sdpa comparison (~20 s).
SECTION_ESTIMATE_S = {"startup": 15.0, "ops": 70.0, "kernels": 50.0, "icqs": 90.0,
                      "attention": 55.0}

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
    """``"sm_90"`` / ``"sm_80"`` for this GPU; other archs map to the nearest one the static
    model knows (the record's name and the predictions read it)."""
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


def kernel_times(fn: Callable[[], Any], repeat: int = 10) -> dict[str, float]:
    """Mean CUDA time (ms) per call of each kernel ``fn`` launches, by kernel name, over
    ``repeat`` calls (the CUDA profiler's device-side durations, so launch gaps and host work
    don't count). Triton kernels appear under their function's name."""
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
        total[ev.name] = total.get(ev.name, 0.0) + ev.device_time / 1e3  # us -> ms
    return {k: v / repeat for k, v in total.items()}


def _case_fns(op: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device):
    """``{variant: callable}`` for one case (``""``: the op's only variant); inputs built on
    the device."""
    from icqs_fast import ops
    from icqs_fast.kernels import attention_entropy as ak

    gen = torch.Generator(device=device).manual_seed(0)
    if op == "token_stats":
        n, v = shape
        z = (torch.randn(n, v, generator=gen, device=device) * 4).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen, device=device)
        return {"": lambda: ops.token_stats(z, t, backend="triton")}
    if op == "linear_token_stats":
        n, h, v = shape
        hid = torch.randn(n, h, generator=gen, device=device).to(dtype)
        w = (torch.randn(v, h, generator=gen, device=device) * (3 / h**0.5)).to(dtype)
        t = torch.randint(0, v, (n,), generator=gen, device=device)
        return {"": lambda: ops.linear_token_stats(hid, w, t, backend="triton")}
    b, hq, hk, tt, d = shape
    q = torch.randn(b, hq, tt, d, generator=gen, device=device).to(dtype)
    k = torch.randn(b, hk, tt, d, generator=gen, device=device).to(dtype)
    vv = torch.randn(b, hk, tt, d, generator=gen, device=device).to(dtype)
    kr = torch.tensor([[0, tt]] * b, device=device)
    qm = torch.ones(b, tt, dtype=torch.bool, device=device)
    scale = d ** -0.5
    return {
        "entropy": lambda: ak.launch_attention(q, k, vv, causal=True, scale=scale,
                                               key_range=kr, query_mask=qm),
        "no_entropy": lambda: ak.launch_attention(q, k, vv, causal=True, scale=scale),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(hq // hk, 1), vv.repeat_interleave(hq // hk, 1),
            is_causal=True),
    }


def measure_case(op: str, dtype_name: str, shape: tuple[int, ...], device: torch.device,
                 arch: str) -> list[dict]:
    """One record per variant of a case: the op's time end to end (``measured_ms``), each CUDA
    kernel's it launched (``kernel_ms``, by name) and their sum (``kernels_ms``)."""
    from triton.testing import do_bench

    dtype = _DTYPES[dtype_name]
    out: list[dict] = []
    for variant, fn in _case_fns(op, dtype, shape, device).items():
        op_ms = do_bench(fn, warmup=10, rep=100)
        kern = kernel_times(fn)
        out.append({"op": op, "variant": variant or None, "dtype": dtype_name,
                    "shape": list(shape), "arch": arch, "kind": "op", "measured_ms": op_ms,
                    "kernel_ms": kern, "kernels_ms": sum(kern.values())})
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


def expected_duration(quick: bool = False, end_to_end: bool = True) -> dict[str, Any]:
    """What ``bench gpu`` is expected to take on a fresh H100 (:data:`SECTION_ESTIMATE_S`;
    ``--quick`` runs small shapes: a quarter of the case time, the children's fixed costs),
    against the default budget; the dry run (``python -m bench.gpu_model.dry_run``) states it."""
    est = dict(SECTION_ESTIMATE_S)
    if quick:
        est.update(ops=est["ops"] / 4, kernels=30.0, icqs=35.0, attention=30.0)
    if not end_to_end:
        est = {k: v for k, v in est.items() if k in ("startup", "ops")}
    total = sum(est.values())
    return {"sections_s": est, "expected_s": total, "budget_s": DEFAULT_BUDGET_S,
            "fits": total <= DEFAULT_BUDGET_S,
            "basis": "reasoned from the code for a fresh H100 (empty Triton cache), not "
                     "measured; the budget stops the run before the machine's ~8-minute window"}


class _Progress:
    """``gpu_day_one.json``: each section's status, seconds and file, rewritten after every
    section (a cut run keeps what finished)."""

    def __init__(self, out_dir: Path, budget_s: float, t0: float):
        self.path = out_dir / "gpu_day_one.json"
        self.t0, self.budget_s = t0, budget_s
        self.doc: dict[str, Any] = {"budget_s": budget_s, "expected": expected_duration(),
                                    "sections": []}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def fits(self, name: str) -> bool:
        return self.left() >= SECTION_ESTIMATE_S.get(name, 0.0)

    def add(self, name: str, status: str, seconds: float, file: Path | None = None,
            **extra: Any) -> None:
        self.doc["sections"].append({"name": name, "status": status,
                                     "seconds": round(seconds, 1),
                                     "estimate_s": SECTION_ESTIMATE_S.get(name),
                                     "file": None if file is None else file.name, **extra})
        self.doc["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        # Whole, each time: the file holds every section so far (a crash keeps them).
        write_whole(self.path, json.dumps(self.doc, indent=1) + "\n")


def _run_child(argv: list[str], log: Path, timeout: float) -> int | None:
    """Run ``icqs-fast ARGV`` with its output in ``log``; None when ``timeout`` stopped it."""
    cmd = [sys.executable, "-m", "icqs_fast.cli", *argv]
    print("bench gpu: running", " ".join(argv), flush=True)
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False,
                                  timeout=max(timeout, 1.0)).returncode
        except subprocess.TimeoutExpired:
            return None


def _write_ops(path: Path, head: dict, records: list[dict]) -> None:
    write_whole(path, json.dumps({**head, "records": records}, indent=1) + "\n")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        print("icqs-fast bench gpu: no CUDA device here; this command measures GPU times "
              "(`python -m bench.gpu_model.static` in a checkout predicts them without one)",
              file=sys.stderr)
        return 2
    budget = DEFAULT_BUDGET_S if getattr(args, "budget_s", None) is None else args.budget_s
    if budget <= 0:
        raise ValueError(f"--budget-s must be > 0, got {budget}")
    device = torch.device("cuda")
    out_dir = Path(args.out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = _Progress(out_dir, budget, t0)
    progress.add("startup", "ok", time.perf_counter() - t0)
    arch = arch_of(device)
    path = out_dir / f"gpu_ops_{arch.replace('_', '')}.json"
    t1 = time.perf_counter()
    props = torch.cuda.get_device_properties(device)
    dev_figs = measure_device(device)
    import triton

    head = {**environment(device), "triton": triton.__version__, "arch": arch,
            "device_measured": dev_figs, "sms": props.multi_processor_count}
    records: list[dict] = []
    failed = 0
    cases = QUICK_CASES if args.quick else CASES
    for i, (op, dt, shape) in enumerate(cases):
        if progress.left() <= 0:
            records.append({"op": op, "dtype": dt, "shape": list(shape), "kind": "op",
                            "error": "skipped: the time budget ran out"})
            continue
        try:
            records += measure_case(op, dt, shape, device, arch)
        except (RuntimeError, ValueError, MemoryError) as exc:
            failed += 1
            print(f"bench gpu: {op} {dt} {list(shape)} failed: {exc}", file=sys.stderr)
            records.append({"op": op, "dtype": dt, "shape": list(shape), "kind": "op",
                            "error": str(exc)[:500]})
        torch.cuda.empty_cache()
        _attention_ratios(records)
        # After every case: a run cut here keeps the cases done.
        _write_ops(path, {**head, "cases_done": i + 1, "cases": len(cases)}, records)
    progress.add("ops", "ok" if not failed else "failed", time.perf_counter() - t1, path)
    print(f"bench gpu: wrote {path}")
    for r in records:
        if r.get("kind") == "op" and "measured_ms" in r:
            print(f"  {r['op']:19s} {r.get('variant') or '':10s} {r['dtype']} "
                  f"{str(r['shape']):28s} measured {r['measured_ms']:.3f} ms "
                  f"(kernels {r['kernels_ms']:.3f})")
    if not args.no_end_to_end:
        q = ["--quick"] if args.quick else []
        # GPU-only runs: no CPU records or memory subprocesses (measured on the CPU machines);
        # llama-1b shapes with random weights (no hub). Most valuable first.
        children = [
            (["bench", "kernels", "--json", "--no-cpu", *q, "--out",
              str(out_dir / "kernels_cuda.json")], "kernels"),
            (["bench", "icqs", "--device", "cuda", "--random-weights", "--config",
              "tiny" if args.quick else "llama-1b", "--json", "--no-memory",
              *(["--responses", "8"] if args.quick else []),
              "--out", str(out_dir / "icqs_cuda.json")], "icqs"),
            (["bench", "attention", "--device", "cuda", "--random-weights", "--config",
              "tiny" if args.quick else "llama-1b", "--json", "--no-memory",
              *(["--quick"] if args.quick else ["--seq-len", "4096"]),
              "--out", str(out_dir / "attention_cuda.json")], "attention"),
        ]
        for argv, name in children:
            out = out_dir / f"{name}_cuda.json"
            if not progress.fits(name):
                print(f"bench gpu: skipping bench {name}: {progress.left():.0f} s of the "
                      f"{budget:.0f} s budget left, it is expected to take "
                      f"{SECTION_ESTIMATE_S[name]:.0f} s", file=sys.stderr)
                progress.add(name, "skipped", 0.0, None, left_s=round(progress.left(), 1))
                continue
            t1, wall1 = time.perf_counter(), time.time()
            rc = _run_child(argv, out_dir / f"{name}_cuda.log", progress.left())
            status = {None: "timeout", 0: "ok"}.get(rc, "failed")
            if rc != 0:
                failed += 1
                why = "ran out of time" if rc is None else f"exited {rc}"
                print(f"bench gpu: bench {name} {why} (see {name}_cuda.log)", file=sys.stderr)
            fresh = out.exists() and out.stat().st_mtime >= wall1  # not an older run's file
            progress.add(name, status, time.perf_counter() - t1, out if fresh else None,
                         log=f"{name}_cuda.log")
    print(f"bench gpu: {time.perf_counter() - t0:.0f} s of the {budget:.0f} s budget; "
          f"sections in {progress.path}")
    return 1 if failed else 0
