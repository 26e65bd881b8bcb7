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
from typing import TYPE_CHECKING, Any

from icqs_fast.cli.options import (
    add_backend_argument,
    add_calibration_arguments,
    add_device_map_argument,
    add_dtype_argument,
    add_model_arguments,
    add_quantization_argument,
    add_quiet_argument,
)
from icqs_fast.io.datasets import EvalDataset, eval_dataset, eval_datasets
from icqs_fast.io.strict_json import finite_or_none
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the ``eval`` study commands, one per ``labels`` / ``distributions`` data set
    of the registry (which one: ``args.subcommand``)."""
    folders = " ".join(f"{d.folder}/" for d in eval_datasets() if d.kind != "judgments")
    p.add_argument("--data", default=None,
                   help="the dataset file, or a folder holding it (directly or in a "
                        f"{folders} subfolder); default ../shared/data/...")
    add_model_arguments(p)
    add_json_argument(p, "print one JSON document")
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
    add_backend_argument(p)
    add_dtype_argument(p)
    add_quantization_argument(p)
    add_device_map_argument(p)
    add_threads_argument(p)
    add_quiet_argument(p, "no progress report on stderr")
    p.add_argument("--stability", default=None, metavar="CONFIG",
                   help="score the test responses (largest --demos-per-set) under this run's "
                        "--dtype/--backend and again under CONFIG, and print how every score "
                        "kind moves between the two (which kinds rounding noise can flip); "
                        "CONFIG: float32|bfloat16|float16, "
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


def data_path(dataset: str | EvalDataset, data: str | None) -> Path:
    """The dataset file from ``--data`` (a file, or a folder holding the default file name
    directly or in its dataset subfolder); default: the registry entry's
    (:meth:`icqs_fast.io.datasets.EvalDataset.default_path`)."""
    ds = dataset if isinstance(dataset, EvalDataset) else eval_dataset(dataset)
    sub, name = ds.folder, ds.file_name
    if data is None:
        return ds.default_path()
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

    from icqs_fast.evals import study
    from icqs_fast.evals.study_kinds import study_of
    from icqs_fast.models import device_map_kwargs, load_model, quantization_kwargs

    quant = quantization_kwargs(args.quantization)  # before any data or model is read
    quant.update(device_map_kwargs(args.device_map))

    ds, kind = study_of(args.subcommand)
    if args.pool_json:
        return _pool(args)
    _check(args)
    ns = parse_ns(args.demos_per_set)
    if max(ns) > args.pool:
        raise ValueError(f"--demos-per-set {max(ns)} exceeds --pool {args.pool}")
    apply_threads(args.threads)
    path = data_path(ds, args.data)
    st = study.StudySettings(
        demos_per_set=ns, num_ratios=args.num_ratios, sets_per_ratio=args.sets, seed=args.seed,
        ask_threshold=study.ASK_THRESHOLD if args.ask_threshold is None else args.ask_threshold,
        n_boot=args.n_boot, backend=args.backend, quiet=args.quiet,
        baselines=not args.no_baselines, stratify=args.stratify,
        calibration=args.calibrate, score=args.score, compare=args.compare,
        tie_epsilon=args.tie_epsilon)
    t0 = time.perf_counter()
    if not kind.label_options and (args.labels != "original" or args.stratify):
        label_sets = ", ".join(d.name for d in eval_datasets() if d.kind == "labels")
        raise ValueError(f"--labels synonyms and --stratify apply to {label_sets} only "
                         f"({ds.title}'s pools hold one label each)")
    data: Any = kind.load(ds, path, pool=args.pool, limit=args.limit, seed=args.seed,
                          labels=args.labels)
    t_load = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype, **quant)
    t_load = time.perf_counter() - t_load
    model_name = _model_name(args)
    if args.stability:
        return _stability(args, ds, kind, data, model, tok, st)
    with torch.no_grad():
        out = kind.run(model, tok, data, st)
    seconds = time.perf_counter() - t0
    doc = kind.document(out, ds=ds, model=model_name, seconds=seconds, st=st, labels=args.labels)
    # Load = data + model; the rest of the wall time not in a phase is bootstrap and bookkeeping.
    doc["timing"] = {"load": round(t_load, 2), **doc["timing"]}
    if args.plot:
        from icqs_fast.evals.plots import write_plots

        doc["plots"] = [str(p) for p in write_plots(ds.name, out, ns, args.plot)]
    print(study.dumps(doc) if args.json else kind.report(doc, path, ds))
    return 0


def _model_name(args: argparse.Namespace) -> str:
    """The model as the study's records name it."""
    return args.model or "embedded SmolLM2-135M-Instruct"


def _stability(args: argparse.Namespace, ds: EvalDataset, kind: Any, data: Any,
               model: PreTrainedModel, tok: PreTrainedTokenizerBase, st: Any) -> int:
    """``--stability CONFIG``: both sides over the study's test responses (at the largest
    ``--demos-per-set`` of ``st``) and the table."""
    from icqs_fast.evals import stability, study
    from icqs_fast.evals.calibration_study import auc_ci

    dataset, n, model_name = ds.name, max(st.demos_per_set), _model_name(args)
    other = stability.parse_config(args.stability)
    template, good, bad, responses, groups = kind.responses(data)
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
        print(study.dumps(finite_or_none(doc)))
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

    from icqs_fast.evals import study
    from icqs_fast.evals.study_kinds import study_of
    from icqs_fast.evals.study_report import fmt

    ds, kind = study_of(args.subcommand)
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
        if kind.needs_items and "items" not in doc["compare"]:
            raise ValueError(f"--pool-json {f}: no per-item predictions (written before 'eval "
                             f"{ds.name} --compare' kept them); rerun it")
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
    cmp = kind.pool(docs, n_boot=args.n_boot, seed=args.seed)
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        suffix = kind.pooled_suffix(same)
        path = os.path.join(args.plot, f"calibration_{ds.name}{suffix}.png")
        title = (f"{ds.title}{suffix.replace('_', ', ')}, "
                 f"N={same['demos_per_set']}, M+1={same['num_ratios']}, "
                 f"L={same['sets_per_ratio']}, {len(docs)} runs")
        cmp["plot"] = kind.plot_pooled({title: cmp}, path)
    if args.json:
        print(study.dumps(finite_or_none(cmp)))
        return 0
    s = docs[0]["settings"]
    print(f"{ds.title}: {len(docs)} runs pooled (seeds {cmp['seeds']}), "
          + kind.pooled_size(cmp, s)
          + f", N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}")
    print(kind.compare_table(cmp))
    print(f"Epistemic {kind.per_run_metric} per run: " + "; ".join(
        f"{n} " + "/".join(fmt(v) for v in vals) for n, vals in cmp["per_doc"].items()))
    if args.plot:
        print(f"wrote {cmp['plot']}")
    return 0
