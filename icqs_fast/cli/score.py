"""``icqs-fast score``: arguments -> :class:`~icqs_fast.jobs.config.ScoreJobConfig` ->
:func:`icqs_fast.jobs.run.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import (
    add_declared,
    add_job_arguments,
    add_run_arguments,
    add_scoring_arguments,
    add_self_check_arguments,
    declared_values,
    job_values,
    score_config,
)
from icqs_fast.jobs.config import PairOptions, ScoreJobConfig

# What --help says the command does (plain text; the module docstring is for developers).
DESCRIPTION = ("ICQS scores for the responses of a file (JSONL, CSV, TSV, Parquet or a datasets "
               "folder), streamed to JSONL or Parquet, resumable with --resume.")

# --------------------------------------------------------------------------- command line

# The ScoreJobConfig fields only `score` takes (the pools given as pairs).
POOL_PAIR_OPTIONS = ("good_bad_pairs", "demo_label_field")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag is derived from a declaration (:mod:`icqs_fast.cli.options`)."""
    p.description = DESCRIPTION
    add_job_arguments(p, ScoreJobConfig, what="results")
    add_scoring_arguments(p, record_fields=True, demos_required=False)
    add_declared(p, ScoreJobConfig, names=POOL_PAIR_OPTIONS)
    add_self_check_arguments(p)
    g = p.add_argument_group("Pairs (which of two outputs to one instruction is better)")
    g.add_argument("--pairs", action="store_true",
                   help="the input's records are pairs: x with two outputs (--y-a-field, "
                        "--y-b-field), or two records grouped by --pair-field; one line per "
                        "pair (score_a, score_b, preferred, margin, p_a_better)")
    add_declared(g, PairOptions)
    add_run_arguments(p, ScoreJobConfig)


def build_config(args: argparse.Namespace) -> ScoreJobConfig:
    """The job of parsed ``score`` arguments (the template file is read here; ValueError
    naming the flag)."""
    pairs = PairOptions(**declared_values(args, PairOptions))
    if not args.pairs and pairs.pair_field is not None and args.good_bad_pairs is None:
        raise ValueError("--pair-field groups the records of --pairs or --good-bad-pairs: "
                         "pass --pairs")
    return score_config(args, **job_values(args, ScoreJobConfig),
                        **declared_values(args, ScoreJobConfig, names=POOL_PAIR_OPTIONS),
                        pairs=pairs if args.pairs else None)


def run(args: argparse.Namespace) -> int:
    from icqs_fast.jobs.run import run_job

    return run_job(build_config(args))
