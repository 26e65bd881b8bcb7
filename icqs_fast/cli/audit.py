"""``icqs-fast audit``: the ALLURE audit loop and its studies on SummEval, LLMBar or a custom file.

    icqs-fast audit --task summeval --limit 40 --balance --rounds 2 --json --plot plots/

The records (with ``--limit N``: an even, seeded spread of N over the file) are split into a
training and a held-out part (``--heldout``, stratified by truth, seeded). Each round evaluates
both with the current memory, turns the training mistakes into in-context examples, audits
them (``--audit auto``: accept when the evaluator's probability of its wrong label is at least
``--audit-threshold``; ``file``: the candidates are written to ``--audit-file`` and the run
stops until you set ``"accept"`` on every line and rerun with ``--resume``; ``none``: accept all)
and appends the accepted ones to the memory (``--memory FILE``, append-only JSONL; its round log
is ``FILE.rounds.jsonl``). Every number reported is on the held-out part, which never enters the
memory. After the loop: the sweep over the number of examples, the failure-mode clusters, the
cluster ablation and the attention-entropy change per round.

Judge bias (held-out, every round; the report's ``judge_bias`` is the last round's): agreement
with the human labels (Cohen's kappa, accuracy, confusion matrix), length bias (verdict against
the length difference of the two outputs, or the response length) and, for pairwise tasks
(``llmbar``), position-swap consistency: each held-out pair is also judged with its outputs
swapped (``--no-swap``: not) and the flip rate is reported. ``--debias`` makes the evaluator's
verdict the order-averaged one everywhere (twice the scoring). Intervals: seeded percentile
bootstrap (``--bootstrap`` resamples, ``--seed``). See :mod:`icqs_fast.allure.bias`.

Resume and bad input as in ``icqs-fast score``: ``--resume`` continues a memory written with the
same settings (checked against ``FILE.meta.json``), an existing memory is only replaced with
``--overwrite``, one process writes a memory at a time (``FILE.lock``), and a bad record stops the
run with an error naming the file, line and field (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from icqs_fast.cli.options import (
    add_backend_argument,
    add_dtype_argument,
    add_model_arguments,
    add_quiet_argument,
)
from icqs_fast.io.runs import OutputLock, check_run_paths, output_policy, start_output
from icqs_fast.io.strict_json import finite_or_none
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads

TASKS = ("summeval", "llmbar", "custom")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("ALLURE: audit an LLM evaluator round by round - in-context examples from "
                     "its training mistakes, accuracy on a held-out part (see docs)")
    p.add_argument("--task", choices=TASKS, required=True,
                   help="summeval, llmbar, or custom (a file with the custom-task fields)")
    p.add_argument("--data", default=None, help="input file (default for summeval / llmbar: "
                   "../shared/data)")
    p.add_argument("--rounds", type=int, default=3, help="most memory updates (default 3)")
    p.add_argument("--memory", default=None, help="memory JSONL (append-only); needed for "
                   "--resume and --audit file (default: kept in the process only)")
    p.add_argument("--audit", choices=("auto", "file", "none"), default="auto",
                   help="how candidates are accepted: auto (--audit-threshold), file (you "
                   "mark them in --audit-file, then --resume), none (all; default auto)")
    p.add_argument("--audit-threshold", type=float, default=0.6,
                   help="auto audit: accept when P(wrong label) >= this (default 0.6)")
    p.add_argument("--audit-file", default=None,
                   help="file audit: candidates file (default MEMORY.candidates.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="an even, seeded spread of N records")
    p.add_argument("--balance", action="store_true",
                   help="with --limit: the same number of records of each truth class")
    p.add_argument("--heldout", type=float, default=0.5, help="held-out fraction (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the spread and split (default 0)")
    p.add_argument("--max-new", type=int, default=6, help="most examples accepted per round")
    p.add_argument("--no-patience", action="store_true",
                   help="do not stop when the training accuracy stops improving")
    p.add_argument("--evaluator", choices=("likelihood", "icqs"), default="likelihood",
                   help="the evaluator audited: label likelihood or ICQS (default likelihood)")
    p.add_argument("--icqs-threshold", type=float, default=0.5,
                   help="ICQS evaluator: score above which the verdict is positive (default 0.5)")
    p.add_argument("--icqs-seed-examples", type=int, default=2,
                   help="ICQS evaluator: training records per class as seed demonstrations")
    from icqs_fast.engine.settings import CALIBRATIONS, SCORE_KINDS

    p.add_argument("--icqs-calibrate", default="none", choices=list(CALIBRATIONS),
                   help="ICQS evaluator: calibration of its log-likelihoods (as score "
                        "--calibrate; default none)")
    p.add_argument("--icqs-score", default="argmax", choices=list(SCORE_KINDS),
                   help="ICQS evaluator: argmax ratio (default) or posterior-mean score")
    add_model_arguments(p)
    add_dtype_argument(p)
    add_model_arguments(p, ("device",))
    add_backend_argument(p)
    add_threads_argument(p)
    p.add_argument("--bank-mib", type=int, default=1024,
                   help="KV memory of one scoring call (default 1024)")
    p.add_argument("--sweep-seeds", type=int, default=3, help="seeds of the sweep (0: no sweep)")
    p.add_argument("--proportions", default="0,0.25,0.5,0.75,1",
                   help="sweep: fractions of the memory used (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--clusters", type=int, default=3, help="failure-mode clusters (0: none)")
    p.add_argument("--no-ablation", action="store_true", help="skip the memory ablation study")
    p.add_argument("--attn-items", type=int, default=4,
                   help="held-out records whose attention entropy is measured per round")
    p.add_argument("--debias", action="store_true",
                   help="pairwise tasks: judge every pair in both orders and use the "
                   "order-averaged verdict (twice the scoring)")
    p.add_argument("--no-swap", action="store_true",
                   help="pairwise tasks: do not judge the held-out pairs swapped (no flip rate)")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap resamples of the judge-bias intervals (default 1000)")
    add_json_argument(p, "print the report as JSON on stdout")
    p.add_argument("--plot", default=None, help="folder for PNG plots")
    p.add_argument("--resume", action="store_true", help="continue the rounds of --memory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --memory")
    add_quiet_argument(p, "no progress bar / status lines on stderr")
    g = p.add_argument_group("custom task")
    g.add_argument("--task-field", default="x", help="field with the task (default x)")
    g.add_argument("--response-field", default="y", help="field with the response (default y)")
    g.add_argument("--label-field", default=None, help="field with the truth label")
    g.add_argument("--answer-field", default=None,
                   help="correct-answer field: truth by regex match of the response")
    g.add_argument("--id-field", default=None, help="field with the record id")
    g.add_argument("--pattern", default=r"(?<!\w){answer}(?!\w)",
                   help="regex truth pattern with {answer}")
    g.add_argument("--normalise", default="lower,space,strip",
                   help="comma list of: lower, strip, space, punct, nfkc")
    g.add_argument("--options", default="0,1", help="comma list of labels (default 0,1)")
    g.add_argument("--positive", default=None, help="positive label (default: the last option)")
    g.add_argument("--label-map", default=None, help="e.g. 'yes=1,no=0'")
    g.add_argument("--instructions", default=None, help="evaluation instructions")
    g.add_argument("--query-template", default=None,
                   help="user turn, with {task} {response} [{reference}]")


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of numbers, got {text!r}") from None


def _custom_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    kw: dict[str, Any] = dict(task=args.task_field, response=args.response_field,
                              label=args.label_field, answer=args.answer_field, id=args.id_field,
                              pattern=args.pattern,
                              normalisers=tuple(s.strip() for s in args.normalise.split(",")
                                                if s.strip()),
                              options=options, positive=args.positive or options[-1])
    if args.label_map:
        pairs = [kv.split("=", 1) for kv in args.label_map.split(",") if kv.strip()]
        if any(len(kv) != 2 for kv in pairs):
            raise ValueError(f"--label-map must look like 'yes=1,no=0', got {args.label_map!r}")
        kw["label_map"] = {a.strip(): b.strip() for a, b in pairs}
    if args.instructions:
        kw["instructions"] = args.instructions
    if args.query_template:
        kw["query_template"] = args.query_template
    return kw


def _settings(args: argparse.Namespace, data: str) -> dict[str, Any]:
    s = {k: getattr(args, k) for k in ("task", "limit", "balance", "heldout", "seed", "max_new",
                                       "evaluator", "audit", "audit_threshold")}
    s["data"] = os.path.abspath(data)
    s["model"] = os.path.abspath(args.model) if args.model else "embedded:SmolLM2-135M-Instruct"
    if args.debias:  # only when set: memories written before the flag existed still resume
        s["debias"] = True
    if args.evaluator == "icqs":  # what changes the ICQS evaluator's verdicts
        s["icqs"] = {"threshold": args.icqs_threshold,
                     "seed_examples": args.icqs_seed_examples,
                     "calibration": args.icqs_calibrate, "score": args.icqs_score}
    if args.task == "custom":
        s["custom"] = {k: v for k, v in _custom_kwargs(args).items() if k != "normalisers"}
        s["custom"]["normalisers"] = list(_custom_kwargs(args)["normalisers"])
    return s


def _progress(quiet: bool):
    from icqs_fast.progress import track

    def make(desc: str, total: int):
        it = iter(track(range(total), total=total, desc=desc, unit="record", quiet=quiet))

        def tick(n: int) -> None:
            for _ in range(n):
                next(it, None)
            if n and getattr(tick, "done", 0) + n >= total:
                next(it, None)  # exhaust: closes the bar
            tick.done = getattr(tick, "done", 0) + n

        return tick

    return make


def run(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):  # quiet means only errors, transformers' output too
        from icqs_fast.progress import quiet_transformers

        quiet_transformers()
    from icqs_fast.allure.data import default_path

    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    data = args.data or str(default_path(args.task))
    check_run_paths(data, args.resume, args.overwrite)
    if (args.resume or args.audit == "file") and not args.memory:
        raise ValueError("--resume and --audit file need --memory FILE")
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap must be >= 1, got {args.bootstrap}")
    for name in ("rounds", "max_new", "sweep_seeds", "clusters", "attn_items"):
        if getattr(args, name) < 0 or (name == "max_new" and args.max_new < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {int(name == 'max_new')}")
    if args.memory:
        with OutputLock(args.memory):
            return _run(args, data, log)
    return _run(args, data, log)


def _run(args: argparse.Namespace, data: str, log) -> int:
    from icqs_fast.allure import studies
    from icqs_fast.allure.data import load_task, split, spread
    from icqs_fast.allure.evaluators import (
        ICQSEvaluator,
        LikelihoodEvaluator,
        OrderAveragedEvaluator,
    )
    from icqs_fast.allure.loop import AcceptAll, AutoAudit, FileAudit
    from icqs_fast.allure.loop import audit as run_audit
    from icqs_fast.allure.memory import Memory
    from icqs_fast.models import load_model, runtime_settings

    t0 = time.perf_counter()
    apply_threads(args.threads)
    settings = _settings(args, data)
    policy = None
    if args.memory:
        policy = output_policy(args.memory, settings, resume=args.resume, overwrite=args.overwrite)
    custom = _custom_kwargs(args) if args.task == "custom" else {}
    spec, records = load_task(args.task, data, **custom)
    if args.debias and not spec.pairwise:
        raise ValueError(f"--debias needs a pairwise task (llmbar); {args.task} is not")
    picked = spread(records, args.limit, seed=args.seed, balance=args.balance)
    train, heldout = split(picked, args.heldout, seed=args.seed)
    log(f"icqs-fast audit: {args.task}: {len(records)} records, {len(picked)} used: "
        f"{len(train)} train / {len(heldout)} held-out")
    proportions = _floats(args.proportions, "--proportions")

    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    settings.update(runtime_settings(model, args.backend))
    if args.evaluator == "icqs":
        n = args.icqs_seed_examples
        good = [r for r in train if r.truth == spec.positive][:n]
        bad = [r for r in train if r.truth != spec.positive][:n]
        ev = ICQSEvaluator(model, tok, spec, seed_good=good, seed_bad=bad,
                           threshold=args.icqs_threshold, seed=args.seed, backend=args.backend,
                           calibration=args.icqs_calibrate, score=args.icqs_score)
    else:
        ev = LikelihoodEvaluator(model, tok, spec, backend=args.backend, bank_mib=args.bank_mib)
    if args.debias:
        ev = OrderAveragedEvaluator(ev)
    attn_items = args.attn_items if hasattr(ev, "attention_entropy") else 0

    memory = Memory(args.memory)
    if policy is not None:
        from icqs_fast.io.runs import check_runtime

        check_runtime(policy, settings)
        start_output(policy, settings, log)
        if policy.append:
            memory.load()
    audit_file = args.audit_file or (f"{args.memory}.candidates.jsonl" if args.memory else None)
    if args.audit == "file":
        if not args.resume and audit_file and os.path.exists(audit_file):
            os.remove(audit_file)  # decisions of an earlier run would match the new ids
        auditor: Any = FileAudit(audit_file, spec)
    elif args.audit == "none":
        auditor = AcceptAll()
    else:
        auditor = AutoAudit(args.audit_threshold)

    res = run_audit(ev, train, heldout, rounds=args.rounds, auditor=auditor, memory=memory,
                    max_new=args.max_new, patience=not args.no_patience, attn_items=attn_items,
                    swap=spec.pairwise and not args.no_swap,
                    resume=args.resume, progress=_progress(args.quiet),
                    log=lambda s: log(f"icqs-fast audit: {s}"))
    report: dict[str, Any] = {
        "task": args.task, "model": settings["model"], "evaluator": ev.describe(),
        "audit": res.audit, "stopped": res.stopped, "seed": args.seed, "limit": args.limit,
        "balance": args.balance, "n_train": len(train), "n_heldout": len(heldout),
        "positive": spec.positive, "options": list(spec.options),
        "rounds": [{"round": r.round, "memory_size": r.memory_size,
                    "heldout": {k: r.heldout[k] for k in ("accuracy", "f1", "auc", "kappa")},
                    "heldout_errors": r.heldout["errors"], "train_accuracy": r.train["accuracy"],
                    "mistakes": len(r.candidates), "accepted": len(r.accepted),
                    "heldout_features_mean": r.features_mean(),
                    "seconds": round(r.seconds, 2)} for r in res.rounds],
        "attention": studies.attention_change(res.rounds),
        "sweep": [], "clusters": [], "ablation": [],
    }
    bias = [studies.round_bias(spec, heldout, r, n_resamples=args.bootstrap, seed=args.seed)
            for r in res.rounds]
    for row, b in zip(report["rounds"], bias, strict=True):
        row["bias"] = _bias_row(b)
    report["debias"] = args.debias
    report["judge_bias"] = ({"round": res.rounds[-1].round, **bias[-1].to_json()} if bias
                            else None)
    mem = res.final_memory
    plots: dict[str, Any] = {}
    if res.stopped != "awaiting audit" and mem:
        if args.sweep_seeds > 0:
            log(f"icqs-fast audit: sweep over {len(proportions)} proportions of {len(mem)} "
                f"examples x {args.sweep_seeds} seeds")
            known = {tuple(e.id for e in memory.before(r.round)): r.heldout for r in res.rounds}
            report["sweep"] = studies.sweep(ev, heldout, mem, proportions=proportions,
                                            seeds=list(range(args.sweep_seeds)), known=known)
        if args.clusters > 0 and len(mem) >= 2:
            clusters, xy, assign = studies.failure_clusters(spec, mem, k=args.clusters,
                                                            seed=args.seed)
            report["clusters"] = [c.to_json() for c in clusters]
            if xy is not None:
                plots["tsne"] = (xy, assign, [c.name for c in clusters])
            if not args.no_ablation and len(clusters) > 1:
                log(f"icqs-fast audit: ablation of {len(clusters)} clusters")
                full = [res.rounds[-1].heldout_pred[r.id][0] for r in heldout]
                report["ablation"] = studies.ablation(ev, heldout, mem, clusters, full)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if args.plot:
        from icqs_fast.allure import plots as P

        d = Path(args.plot)
        P.plot_rounds(report["rounds"], d / "rounds.png")
        if report["judge_bias"] is not None:
            P.plot_bias(report["judge_bias"], report["rounds"], d / "bias.png")
        if report["sweep"]:
            P.plot_sweep(report["sweep"], d / "sweep.png")
        if "tsne" in plots:
            P.plot_tsne(*plots["tsne"], d / "tsne.png")
        if report["ablation"]:
            P.plot_ablation(report["ablation"], d / "ablation.png")
    if args.json:
        print(json.dumps(finite_or_none(report), indent=1))
    else:
        _print_text(report)
    if res.stopped == "awaiting audit":
        log(f"icqs-fast audit: decide the candidates in {audit_file} (\"accept\": true/false), "
            "then rerun with --resume")
    return 0


def _bias_row(b: Any) -> dict[str, Any]:
    """A round's headline bias statistics as ``[estimate, lo, hi]`` (None: absent)."""
    def iv(x: Any) -> list[float] | None:
        return None if x is None else [x.estimate, x.lo, x.hi]

    return {"flip_rate": iv(b.swap.flip_rate if b.swap else None),
            "first_position_rate": iv(b.swap.first_position_rate if b.swap else None),
            "kappa": iv(b.agreement.kappa),
            "length_point_biserial": iv(b.length.point_biserial if b.length else None)}


def _iv(x: dict[str, Any] | None) -> str:
    """``0.125 [0.050, 0.225]`` of a JSON interval (``undefined``: NaN/None)."""
    if x is None or x.get("estimate") is None or not math.isfinite(x["estimate"]):
        return "undefined"
    lo, hi = x.get("lo"), x.get("hi")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{x['estimate']:.3f} [interval undefined]"
    return f"{x['estimate']:.3f} [{lo:.3f}, {hi:.3f}]"


def _print_bias(b: dict[str, Any], debias: bool) -> None:
    a = b["agreement"]
    print(f"judge bias (held-out, round {b['round']}, {b['n']} records; "
          f"{100 * b['level']:g}% percentile bootstrap, {b['n_resamples']} resamples, "
          f"seed {b['seed']}):")
    s = b["swap"]
    if s is None:
        print("  position swap: absent (" + next(
            (n.split(": ", 1)[1] for n in b["notes"] if n.startswith("position swap")),
            "not judged") + ")")
    else:
        print(f"  position swap: flip rate {_iv(s['flip_rate'])} ({s['flips']} of "
              f"{s['n_pairs']} pairs); first position chosen {_iv(s['first_position_rate'])}")
        if s["debiased"] is not None:
            used = "used" if debias else "not used; --debias"
            print(f"  order-averaged verdict ({used}): kappa {_iv(s['debiased']['kappa'])}, "
                  f"accuracy {_iv(s['debiased']['accuracy'])}")
    ln = b["length"]
    if ln is not None:
        extra = "" if ln["longer_preferred_rate"] is None else \
            f"; longer output chosen {_iv(ln['longer_preferred_rate'])}"
        sp = "" if ln["spearman"] is None else \
            f"; Spearman(P({a['labels'][0]}), length) {_iv(ln['spearman'])}"
        print(f"  length bias ({ln['what']}): point-biserial r {_iv(ln['point_biserial'])}{sp}"
              f"; human labels r {_iv(ln['human_point_biserial'])}{extra}")
    conf = "; ".join(f"human {lab}: " + " ".join(str(c) for c in row)
                     for lab, row in zip(a["labels"], a["confusion"], strict=True))
    print(f"  agreement with human labels: kappa {_iv(a['kappa'])}, accuracy "
          f"{_iv(a['accuracy'])}; confusion (judge {' '.join(a['labels'])}): {conf}")
    for n in b["notes"]:
        if not n.startswith("position swap"):
            print(f"  note: {n}")


def _print_text(rep: dict[str, Any]) -> None:
    print(f"ALLURE audit: {rep['task']} ({rep['n_train']} train / {rep['n_heldout']} held-out), "
          f"{rep['evaluator']}; audit {rep['audit']}; stopped: {rep['stopped']}")
    print("round  examples  accuracy  f1      auc     kappa   FP  FN  swap flips")
    for r in rep["rounds"]:
        h, e = r["heldout"], r["heldout_errors"]
        fr = (r.get("bias") or {}).get("flip_rate")
        print(f"{r['round']:5d}  {r['memory_size']:8d}  {h['accuracy']:.3f}     {h['f1']:.3f}   "
              f"{h['auc']:.3f}   {h['kappa']:+.3f}  {e.get('false_positive', 0):3d} "
              f"{e.get('false_negative', 0):3d}  {'-' if fr is None else f'{fr[0]:.3f}'}")
    for s in rep["sweep"]:
        print(f"sweep n={s['n_examples']}: accuracy {s['accuracy']:.3f} +- "
              f"{s['accuracy_std']:.3f}, f1 {s['f1']:.3f}, auc {s['auc']:.3f}")
    for c in rep["clusters"]:
        print(f"cluster ({c['size']}): {c['name']}")
    for a in rep["ablation"]:
        print(f"without {a['cluster']}: accuracy {a['accuracy']:.3f}, kappa vs full "
              f"{a['kappa_vs_full']:.3f}, errors {a['errors']}")
    if rep.get("judge_bias") is not None:
        _print_bias(rep["judge_bias"], rep.get("debias", False))
    print(f"{rep['seconds']:.1f} s")
