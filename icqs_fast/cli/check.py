"""``icqs-fast check``: how well the scorer tells the good demonstrations from the bad ones, before
a run, and the calibrated P(good) map (:mod:`icqs_fast.engine.selfcheck`).

    icqs-fast check --good G --bad B [the scoring options of score] [--plot DIR] [--json]
    icqs-fast check --from-output OUT [--plot DIR] [--json]

Held-out members of the pools are scored as responses with the same settings, demonstration
sets and model as ``score`` would use, each one only from the demonstration sets that do not
hold it; prints the expected AUC with its bootstrap interval, the Brier score and ECE of the
calibrated probability, the equal-error threshold and the expected accuracy there, a plain
warning when the scorer does not separate the task, and with ``--target-accuracy A`` the
abstain band. ``--plot DIR`` writes ``DIR/reliability.png``. The held-out scores of the same
pools, settings and model are reused from the cache (a ``check`` after a ``score`` scores
nothing); ``--from-output OUT`` reads the self-check a ``score`` run stored in its meta file,
without loading a model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from icqs_fast.options import add_json_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    from icqs_fast.cli.options import (
        add_declared,
        add_scoring_arguments,
        add_self_check_arguments,
    )
    from icqs_fast.jobs.config import PairOptions, ScoreJobConfig

    p.description = __doc__.split("\n\n")[0].replace("``", "")
    add_scoring_arguments(p, demos_required=False)  # not with --from-output
    # The pools as pairs, as score takes them: the self-check then holds out whole
    # instructions and is said over pairs too (engine/selfcheck_pairs).
    add_declared(p, ScoreJobConfig, names=("good_bad_pairs", "demo_label_field"))
    add_declared(p, PairOptions, names=("y_a_field", "y_b_field", "tie_margin"))
    add_self_check_arguments(p, switch=False)
    p.add_argument("--plot", default=None, metavar="DIR", help="write DIR/reliability.png")
    add_json_argument(p)
    p.add_argument("--from-output", default=None, metavar="OUT",
                   help="show the self-check a score run stored in the meta file of its output "
                   "OUT (a results file or a --ray folder) instead of running one; no model "
                   "is loaded and --good / --bad are not needed")
    add_declared(p, ScoreJobConfig, names=("quiet", "threads"))


def stored_check(output: str) -> Any:
    """The SelfCheck a run stored in ``output``'s meta file (ValueError when it holds none)."""
    from icqs_fast.report.drift import read_self_check
    from icqs_fast.report.run_output import open_run

    check = read_self_check(open_run(output).meta)
    if check is None:
        raise ValueError(f"{output}: its meta file holds no self-check")
    return check


def _f(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, spec)


def run(args: argparse.Namespace) -> int:
    from icqs_fast.cli.options import score_config
    from icqs_fast.jobs.config import PairOptions
    from icqs_fast.jobs.score import ScoreStrategy
    from icqs_fast.threads import apply_threads

    if args.from_output is not None:
        return show(stored_check(args.from_output), args)
    if (args.good is None or args.bad is None) and args.good_bad_pairs is None:
        raise ValueError("check needs --good and --bad, or --good-bad-pairs FILE (or "
                         "--from-output OUT)")
    if args.self_check_max == 0:
        raise ValueError("--self-check-max must be >= 1 for check")
    # The score job's own configuration and strategy read the pools and build the scorer,
    # so the check runs under exactly the settings a score run would.
    pools: dict = {"good_bad_pairs": args.good_bad_pairs,
                   "demo_label_field": args.demo_label_field}
    if args.good_bad_pairs is not None:
        pools["pairs"] = PairOptions(y_a_field=args.y_a_field, y_b_field=args.y_b_field,
                                     tie_margin=args.tie_margin)
    config = score_config(args, input="-", output=os.devnull, dtype=args.dtype,
                          threads=args.threads, quiet=args.quiet or args.json, **pools)
    config.check()
    quiet = args.quiet or args.json
    apply_threads(args.threads)

    def log(*a: object) -> None:
        if not quiet:
            print(*a, file=sys.stderr)

    strategy = ScoreStrategy(config)
    strategy.prepare(log)
    strategy.load(None, {}, log)  # the model and the scorer, as score runs them
    strategy.self_check(None, log)  # and its self-check step
    return show(strategy.check, args)


def show(check: Any, args: argparse.Namespace) -> int:
    """Print ``check`` (a SelfCheck) as a table or JSON, with the reliability plot when asked."""
    from icqs_fast.engine.selfcheck import FIELD

    plot = None
    if args.plot and check.ok:
        from icqs_fast.evals.reliability import plot_reliability

        plot = str(plot_reliability(check, Path(args.plot) / "reliability.png"))
    if args.json:
        json.dump({**check.to_dict(), "plot": plot}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    if not check.ok:
        print(check.message)
        if args.plot:
            print("no reliability diagram without an estimate")
        return 0
    cal = check.calibration
    how = (f"sigmoid({cal.a:.4g} * score + {cal.b:.4g})" if cal.method == "platt"
           else f"isotonic, {len(cal.x)} knots")
    skipped = (f", {check.n_skipped} skipped (some ratio had no set without them)"
               if check.n_skipped else "")
    if check.config.get("cache") == "hit":
        skipped += "; their scores reused from the cache"
    elif check.config.get("reused"):
        skipped += (f"; {check.config['reused']} of their scores reused from the cache, "
                    f"{check.config.get('scored', 0)} scored")
    rows = [
        ("held out", f"{check.n_good} good + {check.n_bad} bad demonstrations{skipped}"),
        ("AUC", f"{_f(check.auc)} [{_f(check.auc_lo)}, {_f(check.auc_hi)}] "
                f"({check.level:.0%} bootstrap interval)"),
        ("Brier", f"{_f(check.brier)} (a constant 0.5: 0.250; out of fold)"),
        ("ECE", f"{_f(check.ece)} ({check.ece_bins} equal-width bins; out of fold)"),
        ("threshold", f"score >= {_f(check.threshold, '.4f')} (equal error rate; "
                      f"{FIELD} {_f(check.p_at_threshold, '.2f')} there)"),
        ("expected accuracy", f"{_f(check.expected_accuracy, '.2f')} at that threshold"),
        ("calibration map", how),
    ]
    for b in check.baselines:  # the trivial scorers on the same items (selfcheck_baselines)
        rows.append((f"baseline {b['name']}",
                     f"AUC {_f(b['auc'])} [{_f(b['auc_lo'])}, {_f(b['auc_hi'])}] ({b['text']}; "
                     f"{b['direction']} is good on the pools, fitted out of fold)"))
    lm = check.length_matched
    if check.baselines:
        rows.append(("AUC within length strata",
                     f"{_f(lm['auc'])} [{_f(lm['auc_lo'])}, {_f(lm['auc_hi'])}] (ICQS over good "
                     f"/ bad pairs of like length, {lm['strata']} "
                     f"{'stratum' if lm['strata'] == 1 else 'strata'})" if lm is not None
                     else "n/a (no length stratum holds both good and bad items)"))
    if check.beaten:
        rows.append(("WARNING", check.beaten))
    if check.target_precision is not None:
        rows.append(("precision target", check.precision_text()))
    if check.band is not None:
        rows.append(("abstain band", check.band.text().split(": ", 1)[1]))
    if check.warning:
        rows.append(("WARNING", check.warning))
    from icqs_fast.engine.selfcheck_pairs import pairwise_lines

    rows += [("pairwise", line) for line in pairwise_lines(check.pairwise)]  # a --pairs run's
    if plot:
        rows.append(("reliability diagram", plot))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
