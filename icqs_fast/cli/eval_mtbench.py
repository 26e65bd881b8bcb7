"""``icqs-fast eval mtbench``: glass-box features vs GPT-4 judgments on MT-Bench.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from icqs_fast.cli.options import (
    add_declared,
    add_dtype_argument,
    add_model_arguments,
    add_quiet_argument,
)
from icqs_fast.evals.mtbench import ENSEMBLE_FEATURES
from icqs_fast.io.datasets import eval_dataset
from icqs_fast.jobs.config import FeatureJobConfig
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads


def add_arguments(p: argparse.ArgumentParser) -> None:
    from icqs_fast.features.names import ALL_FEATURES, MODES

    ds = eval_dataset("mtbench")
    p.add_argument("--data", default=None,
                   help=f"MT-Bench folder (default ../shared/data/{ds.default})")
    add_json_argument(p)
    p.add_argument("--limit", type=int, default=None,
                   help="score N judged answers spread evenly over the set (default: all)")
    add_model_arguments(p, what="evaluator: ")
    p.add_argument("--features", nargs="+", default=list(ALL_FEATURES),
                   choices=list(ALL_FEATURES) + list(ENSEMBLE_FEATURES), metavar="FEATURE",
                   help=f"features (default all of {' '.join(ALL_FEATURES)}; "
                        "unt_exp / unt_var run the 7-prompt ensemble)")
    p.add_argument("--mode", default="standard", choices=list(MODES),
                   help="standard, or the selfeval reference code's formulas (selfeval-compat)")
    p.add_argument("--reference", default="none", choices=["none", "illustrate", "calibrate"],
                   help="reference augmentation for questions with a GPT-4 reference answer")
    p.add_argument("--calibration-factor", type=float, default=1.0,
                   help="calibrate: feature(answer) - factor x feature(reference answer), for "
                        "every feature including unt_exp / unt_var")
    p.add_argument("--batch-size", type=int, default=4,
                   help="answers per padded forward for the glass-box features (default 4); "
                        "the prompt ensemble puts one answer's members in each forward")
    add_declared(p, FeatureJobConfig, names=("backend",))
    add_dtype_argument(p)
    add_quiet_argument(p, "no progress bar / status lines on stderr")
    add_threads_argument(p)


def _fmt(v: float) -> str:
    return "   nan" if not math.isfinite(v) else f"{v:+.3f}"


def run(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):  # quiet means only errors, transformers' output too
        from icqs_fast.progress import quiet_transformers

        quiet_transformers()
    import torch

    from icqs_fast.features.ensembles import prompt_ensemble
    from icqs_fast.features.extract import FEATURE_DIRECTION, glassbox
    from icqs_fast.metrics import correlations
    from icqs_fast.models import load_model
    from icqs_fast.progress import Progress

    apply_threads(args.threads)
    ds = eval_dataset("mtbench")
    data = Path(args.data) if args.data is not None else ds.default_path()
    if not data.is_dir():
        what = "is not a folder" if data.exists() else "not found"
        print(f"icqs-fast eval mtbench: data folder {data} {what}; nothing to do",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    recs = ds.read(data, args.limit)
    model, tok = load_model(args.model, dtype=args.dtype)
    t_load = time.perf_counter() - t0
    items = [r["item"] for r in recs]
    ref = None if args.reference == "none" else args.reference
    base = [f for f in args.features if f not in ENSEMBLE_FEATURES]
    ens = [f for f in args.features if f in ENSEMBLE_FEATURES]
    t1 = time.perf_counter()
    values: dict[str, list[float]] = {f: [] for f in args.features}
    # Items go in slices, the progress report updated after each (glassbox's results do not
    # depend on how items are batched; the ensemble runs one answer per forward anyway).
    step = max(8, 4 * args.batch_size)
    quiet = getattr(args, "quiet", False)
    with torch.no_grad():
        if base:
            rows = []
            with Progress(total=len(items), desc="mtbench features", unit="answer",
                          quiet=quiet) as prog:
                for i in range(0, len(items), step):
                    rows += glassbox(model, tok, items[i:i + step], features=base,
                                     mode=args.mode, batch_size=args.batch_size,
                                     backend=args.backend, reference=ref,
                                     calibration_factor=args.calibration_factor)
                    prog.update(len(items[i:i + step]))
            for f in base:
                values[f] = [r[f] for r in rows]
        if ens:
            # One forward per answer: its members (one per system prompt) share the response.
            erows = []
            with Progress(total=len(items), desc="mtbench ensemble", unit="answer",
                          quiet=quiet) as prog:
                for i in range(0, len(items), step):
                    erows += prompt_ensemble(model, tok, items[i:i + step],
                                             backend=args.backend, mode=args.mode,
                                             reference=ref,
                                             calibration_factor=args.calibration_factor)
                    prog.update(len(items[i:i + step]))
            for f in ens:
                values[f] = [r[f] for r in erows]
    t_score = time.perf_counter() - t1
    scores = [r["score"] for r in recs]
    table = {f: {"direction": FEATURE_DIRECTION[f], **correlations(values[f], scores)}
             for f in args.features}
    meta = {"n": len(recs), "evaluator": args.model or "embedded SmolLM2-135M-Instruct",
            "mode": args.mode, "reference": args.reference, "load_s": round(t_load, 2),
            "score_s": round(t_score, 2), "answers_per_s": round(len(recs) / t_score, 3)}
    if args.json:
        out = {"meta": meta, "correlations": table,
               "records": [{k: r[k] for k in ("question_id", "model", "turn", "score")}
                           | {f: values[f][i] for f in args.features}
                           for i, r in enumerate(recs)]}
        print(json.dumps(out, indent=1))
        return 0
    print(f"MT-Bench: {len(recs)} judged answers, evaluator {meta['evaluator']}, mode "
          f"{args.mode}, reference {args.reference}")
    print(f"{'feature':<15} {'dir':>3} {'pearson':>8} {'spearman':>8} {'kendall':>8}")
    for f, row in table.items():
        print(f"{f:<15} {row['direction']:>+3d} {_fmt(row['pearson']):>8} "
              f"{_fmt(row['spearman']):>8} {_fmt(row['kendall']):>8}")
    print("raw correlations with the GPT-4 score; dir = +1 if higher feature = better, so a "
          "feature agrees with GPT-4 when dir x correlation > 0")
    print(f"time: load {t_load:.1f} s, scoring {t_score:.1f} s "
          f"({meta['answers_per_s']} answers/s)")
    return 0
