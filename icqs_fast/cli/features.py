"""``icqs-fast features``: arguments -> :class:`~icqs_fast.jobs.config.FeatureJobConfig` ->
:func:`icqs_fast.jobs.run.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import (
    MODEL_OPTIONS,
    add_declared,
    add_dtype_argument,
    add_job_arguments,
    add_run_arguments,
    declared_values,
    job_values,
)
from icqs_fast.jobs.config import DEFAULT_FEATURES, FeatureJobConfig

# What --help says the command does (plain text; the module docstring is for developers).
DESCRIPTION = ("Glass-box features (sentence log-prob, softmax entropy and variance, attention "
               "entropy, ...) per response of a file, streamed to JSONL or Parquet, resumable.")

# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    add_job_arguments(p, FeatureJobConfig, what="features", exclude=("label_field",))
    add_declared(p, FeatureJobConfig, names=("encoding", *MODEL_OPTIONS))
    add_dtype_argument(p)
    p.add_argument("--features", nargs="+", default=[",".join(DEFAULT_FEATURES)],
                   metavar="FEATURE",
                   help="feature names, space- or comma-separated (as in eval mtbench; "
                   f"default: all of {' '.join(DEFAULT_FEATURES)})")
    add_declared(p, FeatureJobConfig, names=FEATURE_OPTIONS)
    p.add_argument("--combo-scale", default=None,
                   help="JSON file with softmax_combo's constants (ent_lo, ent_hi, var_lo, "
                   "var_hi; ComboScale.as_dict); default: from the vocabulary size")
    add_run_arguments(p, FeatureJobConfig)


# The declared FeatureJobConfig options with a flag of their own.
FEATURE_OPTIONS = ("mode", "backend", "batch_size", "chunk_size", "deterministic",
                   "system_prompt")


def build_config(args: argparse.Namespace) -> FeatureJobConfig:
    """The job of parsed ``features`` arguments (the --combo-scale file is read here)."""
    from icqs_fast.jobs.features import load_combo_scale, parse_features

    feats = parse_features(",".join(args.features))
    scale = load_combo_scale(args.combo_scale)
    return FeatureJobConfig(features=tuple(feats),
                            combo_scale=None if scale is None else scale.as_dict(),
                            **declared_values(args, FeatureJobConfig, names=FEATURE_OPTIONS),
                            **job_values(args, FeatureJobConfig))


def run(args: argparse.Namespace) -> int:
    from icqs_fast.jobs.run import run_job

    return run_job(build_config(args))
