"""``icqs-fast rank``: rank models by mean score, with bootstrap intervals and, given the true
qualities, the rank correlations.

    icqs-fast rank --scores scores.jsonl --group-field model [--truth truth.json] [--plot DIR]

The scores file (JSONL/CSV/TSV/Parquet or a dataset folder) has one record per (model, item):
``--group-field`` names the model, ``--score-field`` holds the score (``score`` by default, as
written by ``icqs-fast score``; its skipped-record lines are left out). Each model gets its mean
score, a percentile bootstrap interval over its items (``--n-boot`` resamples, ``--seed``) and a
rank (1 = highest mean). ``--truth`` (a JSON object ``{model: quality}``, or JSONL/CSV rows with
the group field and ``--truth-field``) adds Spearman / Kendall tau-b of the ranking and Pearson
of the means against the true qualities. ``--plot DIR`` writes ``DIR/ranking.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from icqs_fast.cli.options import add_quiet_argument
from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from icqs_fast.io.records import FORMATS

    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("--scores", required=True,
                   help="scores: .jsonl/.csv/.tsv (optionally .gz), .parquet or a datasets folder")
    p.add_argument("--group-field", default="model",
                   help="field naming the model of each record (default: model)")
    p.add_argument("--score-field", default="score", help="field with the score (default: score)")
    p.add_argument("--format", choices=list(FORMATS), default=None,
                   help="scores file format (default: from the extension)")
    p.add_argument("--truth", default=None,
                   help="true quality per model: JSON object {model: value}, or JSONL/CSV/TSV/"
                   "Parquet rows with the group field and --truth-field")
    p.add_argument("--truth-field", default="truth",
                   help="field with the true quality in a --truth table (default: truth)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write DIR/ranking.png")
    add_json_argument(p)
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    p.add_argument("--encoding", default="utf-8", help="text encoding (default: utf-8)")
    add_quiet_argument(p, "no progress bar / status lines")


def _f(v: float | None, spec: str = ".4f") -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, spec)


def run(args: argparse.Namespace) -> int:
    from icqs_fast.evals.ranking import (
        plot_ranking,
        rank_models,
        ranking_correlations,
        read_group_scores,
        read_truth,
    )
    from icqs_fast.progress import track

    if args.n_boot < 1:
        raise ValueError("--n-boot must be >= 1")
    if not 0 < args.level < 1:
        raise ValueError("--level must be in (0, 1)")
    t0 = time.perf_counter()
    truth = None
    if args.truth is not None:  # read first: a bad truth file fails before the long read
        truth = read_truth(args.truth, group_field=args.group_field,
                           truth_field=args.truth_field, encoding=args.encoding)
    groups, counts = read_group_scores(
        args.scores, group_field=args.group_field, score_field=args.score_field,
        format=args.format, encoding=args.encoding,
        progress=lambda rows: track(rows, desc="rank: reading", unit="record", quiet=args.quiet))
    rows = rank_models(groups, n_boot=args.n_boot, level=args.level, seed=args.seed,
                       truth=truth)
    corr = ranking_correlations(rows, truth) if truth is not None else None
    plot = None
    if args.plot is not None:
        plot = plot_ranking(rows, Path(args.plot) / "ranking.png",
                            score_label=f"mean {args.score_field}", level=args.level)
    seconds = round(time.perf_counter() - t0, 3)
    if args.json:
        doc = {"scores": args.scores, "group_field": args.group_field,
               "score_field": args.score_field, "n_boot": args.n_boot, "level": args.level,
               "seed": args.seed, "records": counts["records"],
               "error_records": counts["error_records"], "models": rows,
               "correlations": corr, "plot": str(plot) if plot else None, "seconds": seconds}
        print(json.dumps(doc, indent=1, allow_nan=True))
        return 0
    width = max([len("model")] + [len(r["model"]) for r in rows])
    pct = f"{args.level:.0%}"
    head = f"{'rank':>4}  {'model':<{width}}  {'n':>7}  {'mean':>8}  {pct + ' interval':>20}"
    if truth is not None:
        head += f"  {'truth':>8}"
    print(f"{counts['records']} scored records of {len(rows)} models in {args.scores}"
          + (f" ({counts['error_records']} skipped-record lines left out)"
             if counts["error_records"] else ""))
    print(head)
    for r in rows:
        line = (f"{r['rank'] if r['rank'] is not None else '-':>4}  {r['model']:<{width}}  "
                f"{r['n']:>7}  {_f(r['mean']):>8}  "
                f"{'[' + _f(r['ci_low']) + ', ' + _f(r['ci_high']) + ']':>20}")
        if truth is not None:
            line += f"  {_f(r['truth'], 'g'):>8}"
        print(line)
    if corr is not None:
        print(f"agreement with the truth over {corr['n_models']} models: spearman "
              f"{_f(corr['spearman'], '+.3f')}, kendall {_f(corr['kendall'], '+.3f')}, pearson "
              f"{_f(corr['pearson'], '+.3f')}")
        if corr["missing"]:
            print(f"no truth value for: {', '.join(corr['missing'])}", file=sys.stderr)
    if plot is not None:
        print(f"plot: {plot}")
    return 0
