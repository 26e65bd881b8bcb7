"""``icqs-fast score``: arguments -> :class:`~icqs_fast.jobs.config.ScoreJobConfig` ->
:func:`icqs_fast.jobs.runner.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import (
    add_scoring_arguments,
    add_self_check_arguments,
    scoring_options,
    self_check_kwargs,
)
from icqs_fast.io.records import FORMATS
from icqs_fast.jobs.config import ON_ERROR, ScoreJobConfig, flag_names

# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("input", help="responses: .jsonl/.csv/.tsv (optionally .gz), .parquet, a "
                   "datasets folder (save_to_disk); '-' = JSONL stdin")
    p.add_argument("-o", "--output", required=True,
                   help="results: JSONL (one line per response), or Parquet for "
                   ".parquet; with --ray a folder of per-block files")
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
    add_scoring_arguments(p, record_fields=True)
    add_self_check_arguments(p)
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


def build_config(args: argparse.Namespace) -> ScoreJobConfig:
    """The job of parsed ``score`` arguments (the template file is read here)."""
    from icqs_fast.cli.ray_options import job_kwargs
    from icqs_fast.jobs.score import load_template

    _, template_spec = load_template(args.template)
    try:
        return ScoreJobConfig(good=args.good, bad=args.bad,
                              scoring=scoring_options(args, template_spec),
                              token_budget=args.token_budget, deterministic=args.deterministic,
                              demo_x_field=args.demo_x_field, demo_y_field=args.demo_y_field,
                              self_check=self_check_kwargs(args), **job_kwargs(args))
    except ValueError as exc:
        raise ValueError(flag_names(str(exc))) from None


def run(args: argparse.Namespace) -> int:
    from icqs_fast.jobs.runner import run_job

    config = build_config(args)
    try:
        return run_job(config)
    except ValueError as exc:
        if type(exc) is not ValueError:  # InputError & co. name files and fields already
            raise
        raise ValueError(flag_names(str(exc))) from None
