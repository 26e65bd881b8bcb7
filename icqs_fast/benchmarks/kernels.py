"""``icqs-fast bench kernels``: the token-statistics kernels against the usual torch sequence.

Each record times one backend of ``token_stats`` / ``linear_token_stats`` side by side with the
baseline a user would write (``log_softmax``, ``gather``, entropy ``-(p * logp).sum``, variance
``logp.var`` as separate ops; after a matmul for the linear op), alternating the two in every
repeat and taking the median after a warm-up. ``max_abs_err`` is the largest absolute error of
the backend over all float fields against a float64 reference; ``gbps`` counts the logits read
once, to be compared with ``copy_gbps``, the device's measured copy bandwidth (read + write of a
``clone``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch

from icqs_fast import backends, ops
from icqs_fast.backends import torch_ref
from icqs_fast.benchmarks import at_most, check_fields, environment, equals, report_failures
from icqs_fast.types import FLOAT_FIELDS, TokenStats

BASELINE = "torch log_softmax+gather+entropy+var"
BASELINE_LINEAR = "torch matmul+log_softmax+gather+entropy+var"
FIELDS = ("op", "backend", "baseline", "device", "dtype", "shape", "time_ms", "baseline_ms",
          "speedup", "gbps", "max_abs_err")

# Correctness: largest |error| against the float64 reference that passes, per op (the statistics
# are computed in fp32 from the given logits; the linear op adds the matmul's rounding, ~1e-4 on
# the CPU at H = 576). --tolerance overrides both. token_stats' integer fields (target rank,
# is_greedy) must be exact; the linear op's may differ at near-ties (see its record's note).
ERR_TOL = {"token_stats": 1e-3, "linear_token_stats": 5e-3}

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def baseline_token_stats(logits: torch.Tensor, targets: torch.Tensor):
    """The unfused torch sequence: ``[N, V]`` logits (upcast to fp32) -> logprob, entropy, var."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprob = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    var = logp.var(-1)
    return logprob, entropy, var


def baseline_linear(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Materialise ``hidden @ weight.T`` (fp32 on the CPU, native dtype on CUDA), then the
    sequence of :func:`baseline_token_stats`."""
    if hidden.device.type == "cpu":
        hidden, weight = hidden.float(), weight.float()
    return baseline_token_stats(hidden @ weight.t(), targets)


def reference64(logits_fn: Callable[[int, int], torch.Tensor], n: int, targets: torch.Tensor,
                rows: int = 256) -> TokenStats:
    """Float64 reference statistics, ``rows`` rows of logits at a time (bounded memory).

    ``logits_fn(r0, r1)`` returns the float64 logits of rows ``r0:r1``.
    """
    parts = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        parts.append(torch_ref.token_stats(logits_fn(r0, r1), targets[r0:r1],
                                           compute_dtype=torch.float64))
    return TokenStats.cat(parts)


def max_abs_err(out: TokenStats, ref: TokenStats) -> float:
    """Largest |out - ref| over every float field (NaN if any output is not finite)."""
    worst = 0.0
    for name in FLOAT_FIELDS:
        a = getattr(out, name).double().cpu()
        b = getattr(ref, name).double().cpu()
        if not torch.isfinite(a).all():
            return math.nan
        worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
    return worst


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def side_by_side(cand: Callable[[], object], base: Callable[[], object] | None, repeat: int,
                 device: torch.device) -> tuple[float, float | None]:
    """Median milliseconds of ``cand`` and ``base``, alternated in each repeat after a warm-up,
    so both see the same machine load."""
    med = alternated([cand] + ([base] if base is not None else []), repeat, device)
    return med[0], (med[1] if base is not None else None)


def alternated(fns: list[Callable[[], object]], repeat: int, device: torch.device) -> list[float]:
    """Median milliseconds of each of ``fns``, run in turn in each repeat after a warm-up, so
    all see the same machine load (:func:`side_by_side` for two)."""
    times: list[list[float]] = [[] for _ in fns]
    for f in fns:  # warm-up: lazy imports, allocator, autotuning
        f()
    _sync(device)
    for _ in range(max(1, repeat)):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            _sync(device)
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def copy_bandwidth(device: torch.device, nbytes: int, repeat: int = 5) -> float:
    """GB/s of ``clone`` on ``device`` (bytes read + bytes written), median of ``repeat``."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    ms, _ = side_by_side(lambda: x.clone(), None, repeat, device)
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def _record(op, backend, baseline, device, dtype, shape, t_ms, b_ms, nbytes, err, extra):
    rec = {
        "op": op, "backend": backend, "baseline": baseline, "device": device.type,
        "dtype": dtype, "shape": list(shape), "time_ms": round(t_ms, 3),
        "baseline_ms": None if b_ms is None else round(b_ms, 3),
        "speedup": None if b_ms is None else round(b_ms / t_ms, 3),
        "gbps": None if nbytes is None else round(nbytes / (t_ms * 1e-3) / 1e9, 3),
        "max_abs_err": err,
    }
    rec.update(extra)
    return rec


def bench_token_stats(backend: str, device: torch.device, dtype: str, n: int, v: int,
                      repeat: int, extra: dict) -> dict:
    """One ``token_stats`` record: ``backend`` vs the baseline on ``[n, v]`` logits ~ N(0, 4^2)."""
    # Generated on the device itself: [8192, 151936] would take seconds on the host.
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(n, v, generator=gen, device=device) * 4).to(_DTYPES[dtype])
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    run = lambda: ops.token_stats(logits, targets, backend=backend)
    t_ms, b_ms = side_by_side(run, lambda: baseline_token_stats(logits, targets), repeat, device)
    ref = reference64(lambda r0, r1: logits[r0:r1].double(), n, targets)
    out = run()
    err = max_abs_err(out, ref)
    ints_ok = (torch.equal(out.target_rank, ref.target_rank)
               and torch.equal(out.is_greedy, ref.is_greedy))
    lp, ent, var = baseline_token_stats(logits, targets)
    base_err = max(float((a.double() - b.double()).abs().max()) for a, b in
                   ((lp, ref.logprob), (ent, ref.entropy), (var, ref.logprob_var)))
    nbytes = logits.numel() * logits.element_size()
    return _record("token_stats", backend, BASELINE, device, dtype, (n, v), t_ms, b_ms, nbytes,
                   err, {**extra, "int_fields_exact": ints_ok, "baseline_max_abs_err": base_err})


def bench_linear(backend: str, device: torch.device, dtype: str, n: int, h: int, v: int,
                 repeat: int, extra: dict) -> dict:
    """One ``linear_token_stats`` record: hidden ``[n, h]``, weight ``[v, h]`` (an LM head)."""
    gen = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(n, h, generator=gen, device=device).to(_DTYPES[dtype])
    weight = (torch.randn(v, h, generator=gen, device=device) * (3 / h**0.5)).to(_DTYPES[dtype])
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    run = lambda: ops.linear_token_stats(hidden, weight, targets, backend=backend)
    t_ms, b_ms = side_by_side(run, lambda: baseline_linear(hidden, weight, targets), repeat,
                              device)
    w64 = weight.double()
    ref = reference64(lambda r0, r1: hidden[r0:r1].double() @ w64.t(), n, targets)
    out = run()
    err = max_abs_err(out, ref)
    ints_ok = (torch.equal(out.target_rank, ref.target_rank)
               and torch.equal(out.is_greedy, ref.is_greedy))
    gflops = 2 * n * h * v / (t_ms * 1e-3) / 1e9
    # The plain product alone (what the statistics are allowed to add at most 10% to), timed
    # side by side with the fused op.
    mm_ms, _ = side_by_side(lambda: hidden @ weight.t(), None, repeat, device)
    # gbps is not meaningful for a matmul-bound op: report its GFLOP/s instead.
    return _record("linear_token_stats", backend, BASELINE_LINEAR, device, dtype, (n, h, v),
                   t_ms, b_ms, None, err,
                   {**extra, "gflops": round(gflops, 1), "int_fields_exact": ints_ok,
                    "matmul_ms": round(mm_ms, 3),
                    "matmul_gflops": round(2 * n * h * v / (mm_ms * 1e-3) / 1e9, 1),
                    "fraction_of_matmul": round(mm_ms / t_ms, 3),
                    "note": "shape is [N, H, V]; target_rank may differ from the float64 "
                            "reference where fp32 matmul rounding reorders near-ties"})


def benchmark_cases(quick: bool, cuda: bool, cpu: bool = True) -> list[tuple]:
    """The list of (kind, backend, device, dtype, shape) records to run (``cpu=False``: the
    CUDA ones only)."""
    avail = backends.availability()
    cpu_backends = [b for b in ("cpp", "torch") if avail[b][0] and cpu]
    jobs: list[tuple] = []
    ts = (64, 4096) if quick else (2048, 49152)
    lin = (64, 64, 4096) if quick else (2048, 576, 49152)  # SmolLM2-135M's head
    for b in cpu_backends:
        jobs.append(("token_stats", b, "cpu", "fp32", ts))
    if "cpp" in cpu_backends:
        jobs.append(("token_stats", "cpp", "cpu", "bf16", ts))
        jobs.append(("linear_token_stats", "cpp", "cpu", "fp32", lin))
    if cuda:
        gpu_backends = [b for b in ("triton", "torch") if avail[b][0]]
        big = (256, 151936) if quick else (8192, 151936)
        for b in gpu_backends:
            jobs.append(("token_stats", b, "cuda", "fp32", ts))
            jobs.append(("token_stats", b, "cuda", "bf16", ts))
            jobs.append(("token_stats", b, "cuda", "bf16", big))
        if "triton" in gpu_backends:
            glin = (256, 64, 4096) if quick else (8192, 576, 49152)
            jobs.append(("linear_token_stats", "triton", "cuda", "bf16", glin))
    return jobs


def checks(op: str, tolerance: float | None = None) -> dict:
    """The correctness fields of an ``op`` record and what each must be."""
    out = {"max_abs_err": at_most(ERR_TOL[op] if tolerance is None else tolerance)}
    if op == "token_stats":
        out["int_fields_exact"] = equals(True)
    return out


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    from icqs_fast.threads import apply_threads

    apply_threads(args.threads)  # None: the cores other processes leave free (threads.py)
    cuda = torch.cuda.is_available() and not args.no_cuda
    copy_bytes = (64 << 20) if args.quick else (1 << 30)
    cpu = not getattr(args, "no_cpu", False)
    if not (cpu or cuda):
        raise ValueError("--no-cpu without a CUDA device (or with --no-cuda) leaves no record")
    copy = {}
    if cpu:
        copy["cpu"] = copy_bandwidth(torch.device("cpu"), copy_bytes // 4, args.repeat)
    if cuda:
        copy["cuda"] = copy_bandwidth(torch.device("cuda"), copy_bytes, args.repeat)
    records = []
    failed = 0
    envs = {dev: environment(dev) for dev in copy}
    for kind, backend, dev, dtype, shape in benchmark_cases(args.quick, cuda, cpu):
        device = torch.device(dev)
        extra = {"copy_gbps": round(copy[dev], 3), "repeat": args.repeat,
                 "threads": torch.get_num_threads() if dev == "cpu" else None}
        try:
            if kind == "token_stats":
                rec = bench_token_stats(backend, device, dtype, *shape, args.repeat, extra)
                rec["frac_of_copy_bw"] = round(rec["gbps"] / copy[dev], 3)
            else:
                rec = bench_linear(backend, device, dtype, *shape, args.repeat, extra)
        except (RuntimeError, ValueError, MemoryError) as exc:
            # One failing backend (e.g. out of memory) must not lose the other records; the
            # command still exits non-zero.
            failed += 1
            print(f"bench kernels: {kind} {backend} {dev} {dtype} {list(shape)} failed: {exc}",
                  file=sys.stderr)
            rec = {**dict.fromkeys(FIELDS), "op": kind, "backend": backend, "device": dev,
                   "dtype": dtype, "shape": list(shape), **extra, "error": str(exc)[:500]}
        else:
            if not args.json:
                _print_row(rec)
        records.append({**rec, **{k: v for k, v in envs[dev].items() if k not in rec}})
        # Valid JSON, one record per line; written after every record (a run stopped by a
        # time limit keeps the records done).
        text = "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]"
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if cuda:
            torch.cuda.empty_cache()
    text = "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]"
    if args.json:
        print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    bad = []
    for r in records:
        if "error" not in r:  # a failed record is already counted
            bad += check_fields(r, checks(r["op"], getattr(args, "tolerance", None)),
                                prefix=f"{r['op']} {r['backend']} {r['device']} {r['dtype']} "
                                       f"{r['shape']}: ")
    return max(report_failures("kernels", bad), 1 if failed else 0)


def _print_row(r: dict) -> None:
    speed = "" if r["speedup"] is None else f"{r['speedup']:6.2f}x"
    gbps = "" if r["gbps"] is None else f"{r['gbps']:7.2f} GB/s"
    print(f"{r['op']:19s} {r['backend']:7s} {r['device']:4s} {r['dtype']:4s} "
          f"{str(r['shape']):20s} {r['time_ms']:10.2f} ms  base {r['baseline_ms']:10.2f} ms "
          f"{speed} {gbps}  err {r['max_abs_err']:.2e}", flush=True)
