"""``icqs-fast demo``: ICQS on a small built-in set of financial-news sentiment answers.

The built-in files are :mod:`icqs_fast.data`'s (good and bad demonstrations, answers to score).
A good answer should score high (it is most likely after mostly-good demonstrations), a wrong
one low. Before scoring, the self-check (:mod:`icqs_fast.engine.selfcheck`) scores held-out
members of the demonstration pools, each without the demonstration sets that hold it: it gives
the expected AUC and accuracy on this task and the map from score to the calibrated probability
``p_good_calibrated`` printed beside each score (or says plainly that the pools are too small).
``--fpb`` draws the demonstrations from the Financial PhraseBank in
``../shared/data/fpb`` instead (real data, never copied into the package).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from icqs_fast.cli.options import add_declared, add_dtype_argument, add_model_arguments
from icqs_fast.data import TEMPLATE, data_file
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.io.datasets import fpb_examples
from icqs_fast.io.readers import RecordFields, read_examples, read_records
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    add_model_arguments(p)
    add_json_argument(p)
    add_declared(p, ScoringSettings, names=("num_ratios", "demos_per_set", "sets_per_ratio",
                                            "seed", "backend"))
    add_dtype_argument(p)
    add_threads_argument(p)
    p.add_argument("--fpb", action="store_true",
                   help="demonstrations from ../shared/data/fpb (Financial PhraseBank)")
    from icqs_fast.cli.options import add_calibration_arguments, add_self_check_arguments

    add_calibration_arguments(p)
    add_self_check_arguments(p)


def score_meaning(kind: str) -> str:
    """What a score is, in words a new user reads first (``kind``: the ``--score`` choice)."""
    how = {"argmax": "the share",
           "tied": "the share (the mean share of the near-tied best)",
           "mean": "the share (its posterior mean)"}.get(kind, "the share")
    return (f"A score is {how} of good demonstrations, in [0, 1], in the mixture of good and "
            "bad demonstrations under which the model finds the answer most likely: near 1 "
            "the answer looks like the good demonstrations, near 0 like the bad ones. It is "
            "not a probability; P(good) beside it is.")


def _trunc(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def run(args: argparse.Namespace) -> int:
    from icqs_fast.cli.options import self_check_kwargs
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.selfcheck import FIELD, SelfCheck, run_self_check
    from icqs_fast.jobs.score import score_records
    from icqs_fast.models import load_model

    if args.fpb:
        good, bad, _ = fpb_examples(n_good=32, n_bad=32, seed=args.seed, max_chars=160)
        demo_source = "Financial PhraseBank (../shared/data/fpb)"
    else:
        good = read_examples(data_file("demo_good.jsonl"))
        bad = read_examples(data_file("demo_bad.jsonl"))
        demo_source = "built-in"
    n = min(args.demos_per_set, len(good), len(bad))
    check_kw = self_check_kwargs(args)
    responses = data_file("demo_financial.jsonl")

    from icqs_fast.threads import apply_threads

    apply_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    t_load = time.perf_counter() - t0
    scorer = ICQSScorer(model, tok, good, bad, num_ratios=args.num_ratios, demos_per_set=n,
                        sets_per_ratio=args.sets_per_ratio, template=TEMPLATE, seed=args.seed,
                        backend=args.backend, calibration=args.calibrate, score=args.score,
                        tie_epsilon=args.tie_epsilon)
    t1 = time.perf_counter()
    # The self-check first, as a run does: its map gives each score's calibrated probability.
    check = (run_self_check(scorer, good, bad, **check_kw) if check_kw["max_heldout"]
             else SelfCheck.off())
    t_check = time.perf_counter() - t1
    scorer.self_check = check if check.ok else None  # each result's p_good_calibrated
    t1 = time.perf_counter()
    rows = []
    records = read_records(responses, RecordFields(label_field="quality"))
    for rec, res in score_records(scorer, records, path=responses):
        rows.append({"id": rec.id, "x": rec.x, "y": rec.y, "quality": rec.label,
                     "score": res.score, FIELD: res.p_good_calibrated,
                     "verdict": res.verdict,
                     "score_per_set": list(res.score_per_set),
                     "loglik": res.loglik.tolist(), "n_response_tokens": res.n_response_tokens,
                     **({"loglik_baseline": res.loglik_baseline.tolist()}
                        if res.loglik_baseline is not None else {})})
    t_score = time.perf_counter() - t1

    means = {}
    for q in ("good", "bad"):
        s = [r["score"] for r in rows if r["quality"] == q]
        means[q] = sum(s) / len(s) if s else float("nan")
    summary = {
        "n_responses": len(rows),
        "mean_score_good": means["good"],
        "mean_score_bad": means["bad"],
        "difference": means["good"] - means["bad"],
        "load_seconds": round(t_load, 3),
        "score_seconds": round(t_score, 3),
        "self_check_seconds": round(t_check, 3),
        "responses_per_second": round(len(rows) / t_score, 3) if t_score > 0 else None,
    }
    settings = {"model": args.model or "embedded SmolLM2-135M-Instruct",
                "demonstrations": demo_source, "n_good": len(good), "n_bad": len(bad),
                "num_ratios": args.num_ratios, "demos_per_set": n,
                "sets_per_ratio": args.sets_per_ratio, "seed": args.seed,
                "calibration": args.calibrate, "score": args.score,
                "ratios": list(scorer.ratios), "score_meaning": score_meaning(args.score)}
    if args.json:
        json.dump({"settings": settings, "results": rows, "summary": summary,
                   "self_check": check.to_dict()}, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0

    print(f"ICQS demo: {len(rows)} financial-news sentiment answers, "
          f"{settings['model']}, {demo_source} demonstrations")
    print(f"M+1={args.num_ratios} ratios x L={args.sets_per_ratio} sets of N={n} "
          f"demonstrations; score = ICQS-Epistemic, per-set = plain ICQS on each set"
          + ("" if args.calibrate == "none" else f"; calibration {args.calibrate}")
          + ("" if args.score == "argmax" else f"; {args.score} score"))
    print(settings["score_meaning"] + "\n")
    for line in check.lines():
        print(line)
    print()
    xw = 46
    pg = "  P(good)" if check.ok else ""
    print(f"{'#':>2}  {'headline':<{xw}}  {'answer':<8}  {'meant':<5}  {'score':>5}{pg}  per-set")
    for i, r in enumerate(rows, start=1):
        per = " ".join(f"{s:.2f}" for s in r["score_per_set"])
        p = f"  {r[FIELD]:>7.2f}" if check.ok else ""
        print(f"{i:>2}  {_trunc(r['x'], xw):<{xw}}  {r['y']:<8}  {r['quality']:<5}  "
              f"{r['score']:>5.2f}{p}  {per}")
    print(f"\nmean score: meant good {means['good']:.3f}, meant bad {means['bad']:.3f} "
          f"(difference {summary['difference']:+.3f}); scored {len(rows)} responses in "
          f"{t_score:.1f} s (model loaded in {t_load:.1f} s)")
    if check.ok:
        hits = sum((r["score"] >= check.threshold) == (r["quality"] == "good") for r in rows)
        print(f"P(good) is {FIELD}: the score through the self-check's {check.calibration.method}"
              f" map; expected accuracy {check.expected_accuracy:.2f} at score >= "
              f"{check.threshold:.4f}, here {hits}/{len(rows)} right; self-check took "
              f"{t_check:.1f} s")
    return 0
