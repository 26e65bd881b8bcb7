"""``icqs-fast bench gpu``: measured GPU times beside the static model's predictions
(:mod:`icqs_fast.benchmarks.gpu`), or with ``--dry-run`` every CUDA code path on fake CUDA
tensors with each Triton launch compiled for sm_90 instead of run
(:mod:`icqs_fast.benchmarks.dry_run`; no GPU needed)."""

from __future__ import annotations

import argparse

from icqs_fast.benchmarks import dry_run, gpu


def add_arguments(p: argparse.ArgumentParser) -> None:
    gpu.add_arguments(p)
    dry_run.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return dry_run.main(args)
    return gpu.run(args)
