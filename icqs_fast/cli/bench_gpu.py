"""``icqs-fast bench gpu``: measured GPU times beside the static model's predictions
(:mod:`icqs_fast.benchmarks.gpu`), or with ``--dry-run`` every CUDA code path on fake CUDA
tensors with each Triton launch compiled for sm_90 instead of run
(:mod:`icqs_fast.benchmarks.dry_run`; no GPU needed)."""

from __future__ import annotations

import argparse

from icqs_fast.options import add_json_argument


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default=None,
                   help="where the JSON files go (default bench/results)")
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    p.add_argument("--no-end-to-end", action="store_true",
                   help="only the model check, not bench kernels/attention/icqs")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds the whole run may take (default 420: make bench-gpu must fit "
                        "a GPU machine's ~8-minute window); a section that no longer fits is "
                        "skipped, a child is stopped at the end, and every finished section's "
                        "file stays (gpu_day_one.json lists them)")


def _dry_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: run the CUDA code paths (bench gpu's cases, the ICQS "
                        "engine with cascade attention, features, audit, lm-eval) on fake CUDA "
                        "tensors (FakeTensorMode), compile every Triton launch for sm_90 "
                        "instead of running it, and report device/dtype errors and host syncs. "
                        "It cannot catch numerics, kernel correctness on hardware, timing, "
                        "memory limits or races (docs/GPU_MODEL.md)")
    p.add_argument("--paths", default=None,
                   help="with --dry-run: comma-separated subset of bench_gpu,engine,features,"
                        "audit,lm_eval (default: all)")
    add_json_argument(p, "with --dry-run: print the JSON report")
    p.add_argument("--out", default=None, help="with --dry-run: also write the JSON report here")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _gpu_arguments(p)
    _dry_run_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Imported here: both pull in torch, and `--help` must not.
    from icqs_fast.benchmarks import dry_run, gpu

    if args.dry_run:
        return dry_run.main(args)
    return gpu.run(args)
