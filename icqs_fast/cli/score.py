"""``icqs-fast score``: arguments -> :class:`~icqs_fast.jobs.config.ScoreJobConfig` ->
:func:`icqs_fast.jobs.runner.run_job`.
"""

from __future__ import annotations

import argparse

from icqs_fast.cli.options import add_calibration_arguments
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
    p.add_argument("--good", required=True,
                   help="good demonstrations: JSONL/CSV/TSV (optionally .gz), Parquet or a "
                   "datasets folder, with the --demo-x-field / --demo-y-field fields")
    p.add_argument("--bad", required=True,
                   help="bad demonstrations (the same formats and fields as --good)")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="input format (default: from the extension; a folder is 'datasets')")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="score only shard I (0-based) of N contiguous record ranges; the N "
                   "outputs concatenated in shard order are the unsharded output")
    p.add_argument("--x-field", default="x", help="field with the prompt/input (default: x)")
    p.add_argument("--y-field", default="y", help="field with the response (default: y)")
    p.add_argument("--demo-x-field", default=None,
                   help="field with the input in the --good / --bad files (default: --x-field)")
    p.add_argument("--demo-y-field", default=None,
                   help="field with the answer in the --good / --bad files (default: "
                   "--y-field)")
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
    p.add_argument("--seed", type=int, default=0, help="seed of the demonstration sets (default 0)")
    p.add_argument("--mixing", choices=["exact", "bernoulli"], default="exact",
                   help="good demonstrations per set: exact (round(r N)) or bernoulli "
                   "(each one good with probability r)")
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
    add_calibration_arguments(p)
    p.add_argument("--content-free", action="append", default=None, metavar="TEXT",
                   help="a content-free input of --calibrate content_free, put in the "
                        "template's query in place of x; repeat for several (averaged). "
                        "Default: 'N/A', '' and '[MASK]'. For free-text answers each input adds "
                        "one row per context and response, so one input costs a third")
    p.add_argument("--pmi-premise", default=None, metavar="TEXT",
                   help="the domain premise of --calibrate pmi, replacing the whole query "
                        "(default: the template's query text after {x}, e.g. 'Answer:')")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--token-budget", type=int, default=None,
                   help="max rows x tokens per forward (default: the engine's)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: each response's numbers are bit-identical "
                   "whatever else is in the input, its order and --token-budget (one response "
                   "per forward; slower)")
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
    # --threads; --ray and its options (Ray itself is imported only when --ray is given).
    from icqs_fast.cli.ray_options import add_job_arguments, add_ray_arguments

    add_job_arguments(p)
    add_ray_arguments(p)


def build_config(args: argparse.Namespace) -> ScoreJobConfig:
    """The job of parsed ``score`` arguments (the template file is read here)."""
    from icqs_fast.cli.ray_options import job_kwargs
    from icqs_fast.jobs.score import load_template

    _, template_spec = load_template(args.template)
    scoring = dict(num_ratios=args.num_ratios, demos_per_set=args.demos_per_set,
                   sets_per_ratio=args.sets_per_ratio, seed=args.seed, mixing=args.mixing,
                   replacement=args.replacement, stratify=args.stratify_field,
                   strata_order=args.strata_order, max_length=args.max_length,
                   drop_oldest_demos=args.drop_oldest_demos, template=template_spec,
                   calibration=args.calibrate, score=args.score,
                   tie_epsilon=args.tie_epsilon,
                   pmi_premise=args.pmi_premise,
                   **({"content_free": tuple(args.content_free)} if args.content_free else {}))
    try:
        return ScoreJobConfig(good=args.good, bad=args.bad, scoring=scoring,
                              token_budget=args.token_budget, deterministic=args.deterministic,
                              demo_x_field=args.demo_x_field, demo_y_field=args.demo_y_field,
                              **job_kwargs(args))
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
