"""``icqs-fast bench icqs``: options, then :func:`icqs_fast.benchmarks.icqs.run`
(torch is imported only when it runs).
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import DTYPE_NAMES, add_model_arguments
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("icqs-fast bench icqs: the ICQS engine (ICQSScorer) against the naive method "
                     "(one full forward per response and demonstration set), side by side")
    add_json_argument(p, "print the record as one JSON object")
    p.add_argument("--responses", type=int, default=None,
                   help="responses to score (default 64; 2 with --inputs long)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    add_model_arguments(p)
    p.add_argument("--random-weights", action="store_true",
                   help="a random-weight model of --config instead of the embedded model")
    p.add_argument("--config", default="llama-1b",
                   choices=("llama-1b", "tiny", "mistral-1b", "mistral-tiny", "mistral-smol"),
                   help="model shape with --random-weights (llama-1b: ~1.1B params; mistral-*: "
                        "the same with a sliding window shorter than the prompts; mistral-smol: "
                        "the embedded weights as a Mistral with a 64-token window)")
    p.add_argument("--inputs", default="short", choices=("short", "long"),
                   help="short: financial-news headlines against the naive method (default); "
                        "long: SummEval articles from ../shared/data/summeval (prompts of "
                        "2-5k tokens), the engine with torch's attention (torch_attention_s) "
                        "against the fused kernel (fast_s), scores compared")
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    add_threads_argument(p)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--cold-repeats", type=int, default=None,
                   help="runs of each side of the cold single-response comparison (median; "
                        "default 3); with --inputs long, runs of each attention path "
                        "(default 1)")
    p.add_argument("--mem-responses", type=int, default=16,
                   help="responses scored in the engine's memory subprocess (default 16)")
    p.add_argument("--calibrate", default=None, choices=["none", "content_free", "pmi"],
                   help="also time the engine with this calibration against without it "
                        "(calibration_overhead)")
    p.add_argument("--answers", default="labels", choices=("labels", "free-text"),
                   help="the responses' answers: labels (positive / negative; default) or "
                        "free-text (a distinct one-sentence answer per headline: no shared "
                        "calibration baselines)")
    p.add_argument("--dtype", default=None,
                   choices=DTYPE_NAMES,
                   help="the model's dtype (default: float32 on the CPU, where the engine's "
                        "exactness is checked, bf16 on CUDA; auto: what --dtype auto picks "
                        "here). A 16-bit model is checked against the naive method at its own "
                        "precision (scores within 0.01, log-likelihoods within 0.1 per token)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="the engine's tokens per forward (default: its own); a row's numbers "
                        "are the same bits at any budget")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest |loglik engine - naive| per response token that passes "
                        "(default 1e-4, 0.1 for a 16-bit model); "
                        "the command exits 1, naming the field, when a check fails")


def run(args: argparse.Namespace) -> int:
    if args.inputs == "long":
        from icqs_fast.benchmarks import icqs_long

        return icqs_long.run(args)
    from icqs_fast.benchmarks import icqs

    return icqs.run(args)
