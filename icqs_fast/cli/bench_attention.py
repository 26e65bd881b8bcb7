"""``icqs-fast bench attention``: options, then :func:`icqs_fast.benchmarks.attention.run`
(torch is imported only when it runs).
"""

from __future__ import annotations

import argparse

from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_json_argument(p, "print the record as JSON")
    p.add_argument("--seq-len", type=int, default=1024,
                   help="input tokens (instruction = first half, response = second half)")
    p.add_argument("--repeat", type=int, default=3, help="timed repeats per side (median)")
    p.add_argument("--quick", action="store_true", help="128 tokens, one repeat (for tests)")
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--random-weights", action="store_true",
                   help="a random-weight Llama of --config instead of the embedded model")
    p.add_argument("--config", default="tiny", choices=("tiny", "llama-1b"),
                   help="model shape with --random-weights (tiny: 2 layers, for tests)")
    p.add_argument("--lse", action="store_true",
                   help="also time attention_lse's cpp kernel against the torch path of cascade "
                        "attention (CPU; fp32 and bf16) on its prefix-part shape")
    p.add_argument("--lse-keys", default="512,2048,4096,5120",
                   help="key counts of --lse (comma-separated; --quick: 128)")
    p.add_argument("--lse-threads", default="1,2",
                   help="thread counts of --lse and --entropy-op (comma-separated)")
    p.add_argument("--entropy-op", action="store_true",
                   help="also time ops.attention_entropy alone, its cpp backend against its "
                        "torch backend (CPU, fp32), on one layer of the capture's shape")
    p.add_argument("--entropy-op-tokens", default="256,1024,2048",
                   help="token counts of --entropy-op (comma-separated; --quick: 128)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest max_abs_err that passes (default 1e-3 for fp32 models, 5e-2 "
                        "for half precision); the command exits 1, naming the field, on a "
                        "failure")


def run(args: argparse.Namespace) -> int:
    from icqs_fast.benchmarks import attention

    return attention.run(args)
