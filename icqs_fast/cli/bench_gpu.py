"""``icqs-fast bench gpu``: measured GPU times of the Triton kernels and their ops
(:mod:`icqs_fast.benchmarks.gpu`)."""

from __future__ import annotations

import argparse


def _gpu_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default=None,
                   help="where the JSON files go (default bench/results)")
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    p.add_argument("--no-end-to-end", action="store_true",
                   help="only the ops' times, not bench kernels/attention/icqs")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds the whole run may take (default 420: make bench-gpu must fit "
                        "a GPU machine's ~8-minute window); a section that no longer fits is "
                        "skipped, a child is stopped at the end, and every finished section's "
                        "file stays (gpu_day_one.json lists them)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _gpu_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Imported here: it pulls in torch, and `--help` must not.
    from icqs_fast.benchmarks import gpu

    return gpu.run(args)
