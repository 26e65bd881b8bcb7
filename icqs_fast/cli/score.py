"""``icqs-fast score``: arguments, then :func:`icqs_fast.jobs.score.run_score_locked`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from icqs_fast.io.records import FORMATS
from icqs_fast.io.runs import (
    OutputLock,
    check_run_paths,
)
from icqs_fast.jobs.score import ON_ERROR, run_score_locked

# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("input", help="responses: .jsonl/.csv/.tsv (optionally .gz), .parquet, a "
                   "datasets folder (save_to_disk); '-' = JSONL stdin")
    p.add_argument("-o", "--output", required=True,
                   help="results: JSONL (one line per response), or Parquet for "
                   ".parquet; with --ray a folder of per-block files")
    p.add_argument("--good", required=True, help="good demonstrations (JSONL/CSV/TSV, x/y fields)")
    p.add_argument("--bad", required=True, help="bad demonstrations (JSONL/CSV/TSV, x/y fields)")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="input format (default: from the extension; a folder is 'datasets')")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="score only shard I (0-based) of N contiguous record ranges; the N "
                   "outputs concatenated in shard order are the unsharded output")
    p.add_argument("--x-field", default="x", help="field with the prompt/input (default: x)")
    p.add_argument("--y-field", default="y", help="field with the response (default: y)")
    p.add_argument("--id-field", default=None,
                   help="field with the record id (default: 'id' when present)")
    p.add_argument("--label-field", default=None,
                   help="field copied to the output as 'label'; the summary gives means per label")
    p.add_argument("--encoding", default="utf-8", help="input text encoding (default: utf-8)")
    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--num-ratios", type=int, default=5, help="M+1 ratios j/M (default 5)")
    p.add_argument("--demos-per-set", type=int, default=8, help="N (default 8)")
    p.add_argument("--sets-per-ratio", type=int, default=4, help="L (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixing", choices=["exact", "bernoulli"], default="exact")
    p.add_argument("--replacement", action="store_true",
                   help="draw demonstrations with replacement (small pools)")
    p.add_argument("--stratify-field", default="auto", metavar="FIELD",
                   help="label-balanced demonstration sets: every set at every ratio holds the "
                        "same count per value of FIELD of the good/bad files ('y': the answer "
                        "itself, i.e. the label it states; 'auto': 'y' when the answers are "
                        "labels (default); 'none': unstratified)")
    p.add_argument("--strata-order", choices=["shuffled", "fixed"], default="fixed",
                   help="with --stratify-field: 'fixed' (default) puts the same stratum at each "
                        "position of every set (the last demonstration's label included)")
    p.add_argument("--calibrate", default="none", choices=["none", "content_free", "pmi"],
                   help="calibrate the log-likelihoods: content_free = minus log P(y | demos, "
                        "content-free input) (Zhao et al. 2021), pmi = minus log P(y | demos, "
                        "domain premise) (Holtzman et al. 2021); default none")
    p.add_argument("--score", default="argmax", choices=["argmax", "mean"],
                   help="the ratio of the most likely context (argmax, default) or the "
                        "posterior mean of the ratio (mean)")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--token-budget", type=int, default=None,
                   help="max rows x tokens per forward (default: the engine's)")
    p.add_argument("--max-length", type=int, default=None, help="prompt length limit")
    p.add_argument("--drop-oldest-demos", action="store_true",
                   help="drop a set's oldest demonstrations when a prompt is too long")
    p.add_argument("--template", default=None,
                   help="JSON file with Template fields (system, demo, query, response, separator)")
    p.add_argument("--resume", action="store_true",
                   help="continue an existing OUTPUT after its last record")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty OUTPUT")
    p.add_argument("--on-error", choices=ON_ERROR, default="stop",
                   help="a bad input record: stop (default; earlier results are kept) or skip it")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar / status lines / summary on stderr")
    # --ray and its options (Ray itself is imported only when --ray is given).
    from icqs_fast.cli.ray_options import add_ray_arguments

    add_ray_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.ray:
        if args.calibrate != "none" or args.score != "argmax":
            raise ValueError("--calibrate / --score are not passed to --ray workers yet; run "
                             "without --ray")
        from icqs_fast.jobs.ray_executor import run_ray

        return run_ray("score", args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    out = Path(args.output)
    for name in ("good", "bad"):
        if not os.path.isfile(getattr(args, name)):
            raise FileNotFoundError(f"no such --{name} file: {getattr(args, name)}")
    if getattr(args, "shard", None) is not None:
        from icqs_fast.io.records import parse_shard

        parse_shard(args.shard)  # a bad spec fails before anything is loaded
    check_run_paths(args.input, args.resume, args.overwrite, args.format)
    # Held until this process ends (or crashes: the OS drops it), before the output is touched.
    with OutputLock(out):
        return run_score_locked(args, out, log)
