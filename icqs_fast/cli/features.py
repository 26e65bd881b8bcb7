"""``icqs-fast features``: arguments, then :func:`icqs_fast.jobs.features.run_features_locked`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from icqs_fast.io.records import FORMATS
from icqs_fast.io.runs import (
    OutputLock,
    check_run_paths,
)
from icqs_fast.jobs.features import (
    DEFAULT_FEATURES,
    ON_ERROR,
    load_combo_scale,
    parse_features,
    run_features_locked,
)

# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("input", help="responses: .jsonl/.csv/.tsv (optionally .gz), .parquet, a "
                   "datasets folder (save_to_disk); '-' = JSONL stdin")
    p.add_argument("-o", "--output", required=True,
                   help="features: JSONL (one line per response), or Parquet for "
                   ".parquet; with --ray a folder of per-block files")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="input format (default: from the extension; a folder is 'datasets')")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="compute only shard I (0-based) of N contiguous record ranges (aligned "
                   "to --chunk-size); the N outputs concatenated in shard order are the "
                   "unsharded output")
    p.add_argument("--x-field", default="x", help="field with the instruction (default: x)")
    p.add_argument("--y-field", default="y", help="field with the response (default: y)")
    p.add_argument("--id-field", default=None,
                   help="field with the record id (default: 'id' when present)")
    p.add_argument("--encoding", default="utf-8", help="input text encoding (default: utf-8)")
    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder, or 'embedded' (default: the embedded "
                   "SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--features", default=",".join(DEFAULT_FEATURES),
                   help="comma-separated feature names (default: all)")
    p.add_argument("--mode", choices=["standard", "selfeval-compat"], default="standard")
    p.add_argument("--batch-size", type=int, default=8, help="items per padded forward")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="records per glassbox call, sorted by length into batches")
    p.add_argument("--system-prompt", default=None, help="system prompt for every record")
    p.add_argument("--combo-scale", default=None,
                   help="JSON file with softmax_combo's constants (ent_lo, ent_hi, var_lo, "
                   "var_hi; ComboScale.as_dict); default: from the vocabulary size")
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
        from icqs_fast.jobs.ray_executor import run_ray

        return run_ray("features", args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    out = Path(args.output)
    feats = parse_features(args.features)
    for name in ("batch_size", "chunk_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    scale = load_combo_scale(args.combo_scale)
    if getattr(args, "shard", None) is not None:
        from icqs_fast.io.records import parse_shard

        parse_shard(args.shard)  # a bad spec fails before anything is loaded
    check_run_paths(args.input, args.resume, args.overwrite, args.format)
    # Held until this process ends (or crashes: the OS drops it), before the output is touched.
    with OutputLock(out):
        return run_features_locked(args, out, feats, scale, log)
