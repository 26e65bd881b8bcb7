"""``icqs-fast bench kernels``: options, then :func:`icqs_fast.benchmarks.kernels.run`
(torch is imported only when it runs).
"""

from __future__ import annotations

import argparse

from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_argument(p, "print the records as a JSON list")
    p.add_argument("--repeat", type=int, default=5, help="timed repeats per side (median)")
    p.add_argument("--quick", action="store_true", help="small shapes (for tests)")
    p.add_argument("--out", default=None, help="also write the JSON records to this file")
    add_threads_argument(p)  # the cpp backend follows torch's count
    p.add_argument("--no-cuda", action="store_true", help="CPU records only")
    p.add_argument("--no-cpu", action="store_true",
                   help="CUDA records only (bench gpu: the CPU ones are measured elsewhere)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest max_abs_err that passes, every op (default: per op, "
                        "token_stats 1e-3, linear_token_stats 5e-3); the command exits 1, "
                        "naming the field, on a failure")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.benchmarks import kernels

    return kernels.run(args)
