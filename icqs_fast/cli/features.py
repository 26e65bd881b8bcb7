"""``icqs-fast features``: arguments -> :class:`~icqs_fast.jobs.config.FeatureJobConfig` ->
:func:`icqs_fast.jobs.runner.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import add_dtype_argument
from icqs_fast.io.records import FORMATS
from icqs_fast.jobs.config import DEFAULT_FEATURES, ON_ERROR, FeatureJobConfig

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
    add_dtype_argument(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--features", nargs="+", default=[",".join(DEFAULT_FEATURES)],
                   metavar="FEATURE",
                   help="feature names, space- or comma-separated (as in eval mtbench; "
                   f"default: all of {' '.join(DEFAULT_FEATURES)})")
    p.add_argument("--mode", choices=["standard", "selfeval-compat"], default="standard",
                   help="standard, or the formulas of the selfeval reference code "
                   "(selfeval-compat; docs/scoring_files.md)")
    p.add_argument("--batch-size", type=int, default=8, help="items per padded forward")
    p.add_argument("--chunk-size", type=int, default=128,
                   help="records per glassbox call, sorted by length into batches")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: each record in a forward of its own, so its "
                   "features are bit-identical whatever the batch (slower)")
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
    # --threads; --ray and its options (Ray itself is imported only when --ray is given).
    from icqs_fast.cli.ray_options import add_job_arguments, add_ray_arguments

    add_job_arguments(p)
    add_ray_arguments(p)


def build_config(args: argparse.Namespace) -> FeatureJobConfig:
    """The job of parsed ``features`` arguments (the --combo-scale file is read here)."""
    from icqs_fast.cli.ray_options import job_kwargs
    from icqs_fast.jobs.features import load_combo_scale, parse_features

    feats = parse_features(",".join(args.features))
    scale = load_combo_scale(args.combo_scale)
    return FeatureJobConfig(features=tuple(feats), mode=args.mode, batch_size=args.batch_size,
                            chunk_size=args.chunk_size, system_prompt=args.system_prompt,
                            combo_scale=None if scale is None else scale.as_dict(),
                            deterministic=args.deterministic,
                            **job_kwargs(args))


def run(args: argparse.Namespace) -> int:
    from icqs_fast.jobs.runner import run_job

    return run_job(build_config(args))
