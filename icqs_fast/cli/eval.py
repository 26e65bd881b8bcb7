"""``icqs-fast eval fpb|sst2|chaosnli``: the ICQS study on Financial PhraseBank, SST-2 and ChaosNLI.

The groups, judgment rules and distribution rule are documented in :mod:`icqs_fast.evals.study`. The
printed table (or ``--json`` document) reports the run for the largest ``--demos-per-set`` value;
the others make the curve against the number of in-context examples. ``--plot DIR`` writes
``<dataset>_loglik.png`` (log-likelihood vs mixture ratio, band over the L sets, one curve per
group), ``<dataset>_hist.png`` (ICQS-Epistemic score histograms per group) and
``<dataset>_curve_<group or metric>.png`` (metric vs N with bootstrap 95 % intervals).

Examples::

    icqs-fast eval fpb --limit 20 --demos-per-set 2,4 --num-ratios 5 --sets-per-ratio 2 --plot figs
    icqs-fast eval sst2 --limit 30 --labels synonyms --json
    icqs-fast eval chaosnli --limit 10 --json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from icqs_fast.cli.options import add_calibration_arguments

DEFAULT_FILES = {"fpb": ("fpb", "Sentences_AllAgree.txt"), "sst2": ("sst2", "dev.tsv"),
                 "chaosnli": ("chaosnli", "chaosNLI_snli.jsonl")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the three ``eval`` study commands (which one: ``args.subcommand``)."""
    p.add_argument("--data", default=None,
                   help="the dataset file, or a folder holding it (directly or in a "
                        "fpb/ sst2/ chaosnli/ subfolder); default ../shared/data/...")
    p.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write the PNG figures to DIR (with --pool-json: the pooled "
                        "comparison's figure)")
    p.add_argument("--seed", type=int, default=0, help="seed of pools, groups, sets (default 0)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="test sentences per group (seeded; ChaosNLI: per majority label); "
                        "default all (slow on a CPU)")
    p.add_argument("--demos-per-set", default="8", metavar="N[,N...]",
                   help="demonstrations per set; a list (e.g. 2,4,8) gives the curve against "
                        "the number of in-context examples; the largest is reported (default 8)")
    p.add_argument("--num-ratios", type=int, default=5, help="M+1 mixture ratios (default 5)")
    p.add_argument("--sets-per-ratio", type=int, default=4, dest="sets",
                   help="L sets per ratio (default 4; as in score)")
    p.add_argument("--sets", type=int, dest="sets", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name of --sets-per-ratio
    p.add_argument("--pool", type=int, default=32,
                   help="good and bad demonstration pool sizes, each (default 32)")
    p.add_argument("--labels", default="original", choices=["original", "synonyms"],
                   help="fpb/sst2: test responses say positive/negative, or good/bad and "
                        "happy/sad (demonstrations keep the original words)")
    p.add_argument("--ask-threshold", type=float, default=None,
                   help="Ask LLM judges a response correct when its expected 1-5 rating >= this "
                        "(default 3)")
    p.add_argument("--stratify", action="store_true",
                   help="label-stratified demonstration sets (build_demo_sets(stratify='y')): "
                        "every set holds the same label counts, only correctness changes with r "
                        "(fpb, sst2)")
    add_calibration_arguments(p, default_score="argmax")  # the paper's method, replicated
    p.add_argument("--compare", action="store_true",
                   help="also compute every calibration x score variant from the same run "
                        "(raw and content-free log-likelihoods shared) and print their "
                        "comparison (fpb/sst2: AUCs with intervals, accuracy per group; chaosnli: "
                        "MAE / CE / Spearman with intervals)")
    p.add_argument("--pool-json", default=None, metavar="FILE[,FILE...]",
                   help="run nothing; read these '--compare --json' documents (e.g. "
                        "one per seed), pool their items and print the comparison table")
    p.add_argument("--no-baselines", action="store_true", help="ICQS only (no ICL, Ask LLM)")
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap resamples for the 95%% intervals (default 1000)")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress report on stderr")
    p.add_argument("--stability", default=None, metavar="CONFIG",
                   help="score the test responses (largest --demos-per-set) under this run's "
                        "--dtype/--backend and again under CONFIG, and print how every score "
                        "kind moves (issue 29); CONFIG: float32|bfloat16|float16, "
                        "torch|cpp|triton, deterministic or budget=N")


def parse_ns(text: str) -> list[int]:
    """``"2,4,8"`` -> ``[2, 4, 8]`` (sorted, unique, each >= 1)."""
    try:
        ns = sorted({int(t) for t in str(text).split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"--demos-per-set: expected integers like 2,4,8, got {text!r}") from None
    if not ns or ns[0] < 1:
        raise ValueError(f"--demos-per-set: expected integers >= 1, got {text!r}")
    return ns


def data_path(dataset: str, data: str | None) -> Path:
    """The dataset file from ``--data`` (a file, or a folder holding the default file name
    directly or in its dataset subfolder); default under
    :func:`icqs_fast.io.datasets.shared_data_dir`."""
    from icqs_fast.io.datasets import shared_data_dir

    sub, name = DEFAULT_FILES[dataset]
    if data is None:
        return shared_data_dir() / sub / name
    p = Path(data)
    if p.is_dir():
        for cand in (p / name, p / sub / name):
            if cand.is_file():
                return cand
        raise FileNotFoundError(f"--data {p}: no {name} in it nor in {p / sub}")
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: not found")
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("num_ratios", "sets", "pool", "n_boot"):
        v = getattr(args, name)
        lo = 2 if name == "num_ratios" else 1
        if v < lo:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")


def run(args: argparse.Namespace) -> int:
    """Run one study command; 0 on success (bad input raises, which the CLI turns into 2)."""
    if getattr(args, "quiet", False):  # quiet means only errors, transformers' output too
        from icqs_fast.progress import quiet_transformers

        quiet_transformers()
    import torch

    from icqs_fast.evals import study, study_data
    from icqs_fast.models import load_model

    dataset = args.subcommand
    if args.pool_json:
        return _pool(args)
    _check(args)
    ns = parse_ns(args.demos_per_set)
    if max(ns) > args.pool:
        raise ValueError(f"--demos-per-set {max(ns)} exceeds --pool {args.pool}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = data_path(dataset, args.data)
    st = study.StudySettings(
        demos_per_set=ns, num_ratios=args.num_ratios, sets_per_ratio=args.sets, seed=args.seed,
        ask_threshold=study.ASK_THRESHOLD if args.ask_threshold is None else args.ask_threshold,
        n_boot=args.n_boot, backend=args.backend, quiet=args.quiet,
        baselines=not args.no_baselines, stratify=args.stratify,
        calibration=args.calibrate, score=args.score, compare=args.compare,
        tie_epsilon=args.tie_epsilon)
    t0 = time.perf_counter()
    if dataset == "chaosnli":
        if args.labels != "original" or args.stratify:
            raise ValueError("--labels synonyms and --stratify apply to fpb and sst2 only "
                             "(ChaosNLI's pools hold one label each)")
        data: Any = study_data.chaosnli_data(path, pool=args.pool, limit=args.limit, seed=args.seed)
    else:
        load = study_data.fpb_data if dataset == "fpb" else study_data.sst2_data
        data = load(path, pool=args.pool, limit=args.limit, seed=args.seed, labels=args.labels)
    t_load = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    t_load = time.perf_counter() - t_load
    model_name = args.model or "embedded SmolLM2-135M-Instruct"
    if args.stability:
        return _stability(args, dataset, data, model, tok, st, max(ns), model_name)
    with torch.no_grad():
        if dataset == "chaosnli":
            out = study.run_chaosnli(model, tok, data, st)
        else:
            out = study.run_sentiment(model, tok, data, st)
    seconds = time.perf_counter() - t0
    if dataset == "chaosnli":
        doc = study.chaosnli_json(out, model=model_name, seconds=seconds, st=st)
    else:
        doc = study.sentiment_json(out, dataset=dataset, model=model_name, seconds=seconds,
                                   st=st, labels=args.labels)
    # Load = data + model; the rest of the wall time not in a phase is bootstrap and bookkeeping.
    doc["timing"] = {"load": round(t_load, 2), **doc["timing"]}
    if args.plot:
        from icqs_fast.evals.plots import write_plots

        doc["plots"] = [str(p) for p in write_plots(dataset, out, ns, args.plot)]
    if args.json:
        print(study.dumps(doc))
    elif dataset == "chaosnli":
        _print_chaosnli(doc, path)
    else:
        _print_sentiment(doc, path)
    return 0


def _stability(args: argparse.Namespace, dataset: str, data: Any, model: Any, tok: Any,
               st: Any, n: int, model_name: str) -> int:
    """``--stability CONFIG``: both sides over the study's test responses and the table."""
    from icqs_fast.evals import stability, study
    from icqs_fast.evals.calibration_study import auc_ci

    other = stability.parse_config(args.stability)
    if dataset == "chaosnli":
        from icqs_fast.engine.prompts import Template

        template = Template(**study.NLI_ICQS_TEMPLATE)
        good = [(it.premise, it.hypothesis) for it in data.good]
        bad = [(it.premise, it.hypothesis) for it in data.bad]
        responses = [(it.premise, it.hypothesis) for it in data.test]
        groups: dict[str, list] = {}
    else:
        template, good, bad = None, data.good, data.bad
        groups = {g: [(r.x, r.y) for r in rs] for g, rs in data.groups.items()}
        responses = list(dict.fromkeys(xy for rs in groups.values() for xy in rs))
    settings = study.scoring_settings(n, st, template)
    a, ta, la = stability.score_side(model, tok, good, bad, responses, settings, quiet=args.quiet,
                                     desc="ICQS side A")
    b, tb, lb = stability.score_side(model, tok, good, bad, responses, settings, other,
                                     quiet=args.quiet, desc="ICQS side B")
    doc = stability.agreement(a, b, settings.tie_epsilon)
    doc.update(dataset=dataset, model=model_name, side_a=la, side_b=lb,
               seconds={"a": round(ta, 2), "b": round(tb, 2)},
               settings={"demos_per_set": n, "num_ratios": st.num_ratios,
                         "sets_per_ratio": st.sets_per_ratio, "seed": st.seed,
                         "stratify": st.stratify, "calibration": st.calibration,
                         "limit": args.limit})
    if "correct" in groups and "incorrect" in groups:
        # Correct vs incorrect answers: the AUC of each score kind on each side.
        from icqs_fast.engine.calibration import icqs_scores

        idx = {xy: i for i, xy in enumerate(responses)}
        doc["auc"] = {}
        for side, res in (("a", a), ("b", b)):
            for kind in doc["kinds"]:
                sc = [icqs_scores(r.loglik_calibrated, r.ratios, kind, settings.tie_epsilon)[0]
                      for r in res]
                doc["auc"][f"{side}/{kind}"] = auc_ci(
                    [sc[idx[xy]] for xy in groups["correct"]],
                    [sc[idx[xy]] for xy in groups["incorrect"]], n_boot=args.n_boot,
                    seed=args.seed)
    if args.json:
        print(study.dumps(study.finite(doc)))
        return 0
    print(f"{dataset}: {len(responses)} responses, N={n}, M+1={st.num_ratios}, "
          f"L={st.sets_per_ratio}, seed {st.seed}; side A {la} ({ta:.0f} s), side B {lb} "
          f"({tb:.0f} s)")
    print(stability.table(doc))
    if "auc" in doc:
        print("AUC correct vs incorrect (A / B): " + "; ".join(
            f"{k} {doc['auc']['a/' + k]['value']:.3f} / {doc['auc']['b/' + k]['value']:.3f}"
            for k in doc["kinds"]))
    return 0


def _pool(args: argparse.Namespace) -> int:
    """``--pool-json``: the comparison table of several ``--compare --json`` documents' items
    (runs of the same settings but the seed); ``--plot DIR``: its figure."""
    import json

    from icqs_fast.evals import calibration_study as cs
    from icqs_fast.evals import study
    from icqs_fast.evals.plots import DATASET_NAMES

    docs, files = [], [f.strip() for f in str(args.pool_json).split(",") if f.strip()]
    for f in files:
        with open(f, encoding="utf-8") as fh:
            try:
                doc = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--pool-json {f}: line {exc.lineno}: invalid JSON "
                                 f"({exc.msg})") from None
        if not isinstance(doc, dict) or "compare" not in doc \
                or doc.get("dataset") != args.subcommand:
            raise ValueError(f"--pool-json {f}: not an 'eval {args.subcommand} --compare --json' "
                             "document")
        if args.subcommand == "chaosnli" and "items" not in doc["compare"]:
            raise ValueError(f"--pool-json {f}: no per-item predictions (written before 'eval "
                             "chaosnli --compare' kept them); rerun it")
        docs.append(doc)
    if not docs:
        raise ValueError("--pool-json: no file given")
    # Pooling is over seeds: every other setting must agree, or the items are not one sample.
    same = {k: v for k, v in docs[0]["settings"].items() if k != "seed"}
    for f, d in zip(files, docs, strict=True):
        diff = sorted(k for k in same if d["settings"].get(k) != same[k])
        if diff:
            raise ValueError(f"--pool-json {f}: settings differ from {files[0]}'s ({diff[0]}: "
                             f"{d['settings'].get(diff[0])!r} vs {same[diff[0]]!r}); pool runs "
                             "that differ only in --seed")
    nli = args.subcommand == "chaosnli"
    cmp = (cs.pool_nli if nli else cs.pool)(docs, n_boot=args.n_boot, seed=args.seed)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        kind = "" if nli else "_stratified" if same.get("stratify") else "_unstratified"
        path = os.path.join(args.plot, f"calibration_{args.subcommand}{kind}.png")
        title = (f"{DATASET_NAMES[args.subcommand]}{kind.replace('_', ', ')}, "
                 f"N={same['demos_per_set']}, M+1={same['num_ratios']}, "
                 f"L={same['sets_per_ratio']}, {len(docs)} runs")
        cmp["plot"] = (cs.plot_pooled_nli if nli else cs.plot_pooled)({title: cmp}, path)
    if args.json:
        print(study.dumps(study.finite(cmp)))
        return 0
    s = docs[0]["settings"]
    print(f"{DATASET_NAMES[args.subcommand]}: {len(docs)} runs pooled (seeds {cmp['seeds']}), "
          + (f"{cmp['n']} items" if nli else f"stratify {s.get('stratify')}")
          + f", N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}")
    print(cs.nli_compare_table(cmp) if nli else cs.compare_table(cmp))
    print(f"Epistemic {'Spearman' if nli else 'AUC'} per run: " + "; ".join(
        f"{n} " + "/".join(_f(v) for v in vals) for n, vals in cmp["per_doc"].items()))
    if args.plot:
        print(f"wrote {cmp['plot']}")
    return 0


def _pct(v: float | None) -> str:
    return "    -" if v is None else f"{100 * v:5.1f}"


def _print_sentiment(doc: dict[str, Any], path: Path) -> None:
    from icqs_fast.evals.plots import DATASET_NAMES

    s = doc["settings"]
    print(f"{DATASET_NAMES[doc['dataset']]} ({path}), model {doc['model']}, "
          f"N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}, "
          f"seed {s['seed']}, labels {doc['labels']}")
    methods = [m for m in ("icqs", "icqs_epistemic", "icl", "ask_llm")
               if m in doc["groups"]["correct"]]
    print(f"{'group':<17} {'n':>4} {'expect':>9} " + " ".join(f"{m:>22}" for m in methods))
    for g, row in doc["groups"].items():
        cells = []
        for m in methods:
            lo, hi = doc["intervals"][g][m]
            cells.append(f"{_pct(row[m])} [{_pct(lo)},{_pct(hi)}]".rjust(22))
        print(f"{g:<17} {doc['n'][g]:>4} {doc['expected'][g]:>9} " + " ".join(cells))
    r = doc["ranking"]
    means = ", ".join(f"{100 * m['accuracy']:.0f}%: {m['mean_score']:.3f}" for m in r["models"])
    rho = "nan" if r["spearman"] is None else f"{r['spearman']:+.3f}"
    ci = r["interval"]
    ci = "n/a" if not ci or any(v is None for v in ci) else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
    print(f"synthetic-LLM ranking: Spearman {rho} (95% CI {ci}); mean scores {means}")
    sep = doc["separation"]
    print("mean score per group: " + "; ".join(
        f"{g}: " + ", ".join(f"{m} {v:.3f}" for m, v in row.items())
        for g, row in sep["mean"].items()))
    if "auc_correct_vs_incorrect" in sep:
        print("AUC correct vs incorrect: " + ", ".join(
            f"{m} {_f(v)}" for m, v in sep["auc_correct_vs_incorrect"].items()))
    if len(doc["curve"]) > 1:
        print("curve (accuracy % per N):")
        for pt in doc["curve"]:
            row = "; ".join(f"{g}: " + ", ".join(f"{m} {_pct(pt['groups'][g][m]).strip()}"
                                                  for m in methods)
                            for g in pt["groups"])
            print(f"  N={pt['demos_per_set']}: {row}")
    print("accuracy % [bootstrap 95% CI] = fraction judged as the expected verdict; rules: "
          "ICQS per set score >= 0.5, Epistemic score >= 0.5, ICL predicted label == response, "
          f"Ask LLM expected rating >= {s['ask_threshold']:g}")
    if "compare" in doc:
        from icqs_fast.evals.calibration_study import compare_table

        print("calibration x score comparison (one run; the raw and content-free "
              "log-likelihoods shared):")
        print(compare_table(doc["compare"]))
    print(f"time: {doc['seconds']:.1f} s ({_timing(doc)})")
    for p in doc.get("plots", []):
        print(f"wrote {p}")


def _timing(doc: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in doc.get("timing", {}).items()
                     if isinstance(v, (int, float)))


def _print_chaosnli(doc: dict[str, Any], path: Path) -> None:
    from icqs_fast.evals.plots import DATASET_NAMES

    s = doc["settings"]
    print(f"{DATASET_NAMES['chaosnli']} ({path}), model {doc['model']}, {doc['n']} test pairs, "
          f"N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}, seed "
          f"{s['seed']}")
    print(f"{'method':<15} " + " ".join(f"{k:>24}" for k in ("mae", "ce", "spearman")))
    for m in ("icqs", "icqs_epistemic", "icl"):
        if m not in doc:
            continue
        cells = []
        for k in ("mae", "ce", "spearman"):
            v, (lo, hi) = doc[m][k], doc["intervals"][m][k]
            cells.append(("nan" if v is None else f"{v:.3f} [{_f(lo)}, {_f(hi)}]").rjust(24))
        print(f"{m:<15} " + " ".join(cells))
    if len(doc["curve"]) > 1:
        print("curve (mae / ce / spearman per N):")
        for pt in doc["curve"]:
            row = "; ".join(f"{m}: " + "/".join(_f(pt[m][k]) for k in ("mae", "ce", "spearman"))
                            for m in ("icqs", "icqs_epistemic", "icl") if m in pt)
            print(f"  N={pt['demos_per_set']}: {row}")
    if "compare" in doc:
        from icqs_fast.evals.calibration_study import nli_compare_table

        print("calibration x score comparison (one run):")
        print(nli_compare_table(doc["compare"]))
    print("distribution rules: " + "; ".join(f"{k}: {v}" for k, v in doc["rules"].items()))
    print(f"time: {doc['seconds']:.1f} s ({_timing(doc)})")
    for p in doc.get("plots", []):
        print(f"wrote {p}")


def _f(v: float | None) -> str:
    return "nan" if v is None else f"{v:.3f}"
