"""``icqs-fast score``: arguments -> :class:`~icqs_fast.jobs.config.ScoreJobConfig` ->
:func:`icqs_fast.jobs.runner.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import (
    add_job_arguments,
    add_run_arguments,
    add_scoring_arguments,
    add_self_check_arguments,
    job_values,
    score_config,
)
from icqs_fast.jobs.config import ScoreJobConfig

# What --help says the command does (plain text; the module docstring is for developers).
DESCRIPTION = ("ICQS scores for the responses of a file (JSONL, CSV, TSV, Parquet or a datasets "
               "folder), streamed to JSONL or Parquet, resumable with --resume.")

# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag is derived from a declaration (:mod:`icqs_fast.cli.options`)."""
    p.description = DESCRIPTION
    add_job_arguments(p, ScoreJobConfig, what="results")
    add_scoring_arguments(p, record_fields=True)
    add_self_check_arguments(p)
    add_run_arguments(p, ScoreJobConfig)


def build_config(args: argparse.Namespace) -> ScoreJobConfig:
    """The job of parsed ``score`` arguments (the template file is read here; ValueError
    naming the flag)."""
    return score_config(args, **job_values(args, ScoreJobConfig))


def run(args: argparse.Namespace) -> int:
    from icqs_fast.jobs.runner import run_job

    return run_job(build_config(args))
