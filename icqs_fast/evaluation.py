"""``icqs-fast eval mtbench``: correlation of glass-box features with GPT-4 scores on MT-Bench.

Data (read in place, never copied): ``question.jsonl``, ``model_answer_<model>.jsonl`` (answers
in ``choices[0].turns``), ``judgment_gpt-4_single.jsonl`` (``question_id``, ``model``, ``turn``,
``score``; judgments with a score below 1, i.e. GPT-4's ``-1`` = unparsable, are dropped) and,
for the reference augmentations, ``reference_answer_gpt-4.jsonl``.

Each judged (question, turn, model) answer is scored by the evaluator (default: the embedded
SmolLM2-135M-Instruct). Turn 1 is prompted with question 1; turn 2 with question 1 and the model's
own turn-1 answer as an earlier chat turn, then question 2 (the attention features use the
question-2 tokens as "instruction keys"). The answers come from other models (Llama-2-7B-chat and
Vicuna-7B), so with the embedded evaluator this is *cross*-evaluation, not self-evaluation.

The table reports the raw correlation of each feature's value with the GPT-4 score, together
with the feature's direction (``FEATURE_DIRECTION``: +1 if higher = better). A feature works as
intended when ``direction x correlation > 0``.

``--reference illustrate|calibrate`` applies to every feature of answers whose question has a
GPT-4 reference answer, the ensemble features included: with ``calibrate``, ``unt_exp`` and
``unt_var`` become ``value(answer) - factor x value(reference)``, the reference answer scored by
the same 7-prompt ensemble (:func:`icqs_fast.ensembles.prompt_ensemble`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_DATA = "../shared/data/mtbench"
ENSEMBLE_FEATURES = ("unt_exp", "unt_var")


def _read_jsonl(path: Path) -> list[tuple[int, int, dict[str, Any]]]:
    """``(index, line, object)`` per record; errors name the file, line and field."""
    from .io import read_json_objects

    return [(i, line, obj) for i, (line, obj) in enumerate(read_json_objects(path))]


def _turns(path: Path, i: int, line: int, obj: dict, field: str) -> list[str]:
    from .io import RecordError, field_of

    turns = field_of(obj, field, list, path=path, line=line, index=i)
    for t, text in enumerate(turns):
        if not isinstance(text, str):
            raise RecordError(path, line, f"{field}.{t}",
                              f"must be str, got {type(text).__name__}", index=i)
    return turns


def _by_question(path: Path, field: str) -> dict[int, tuple[list[str], int]]:
    """question_id -> (turns, line) of a question / answer / reference file."""
    from .io import field_of

    out = {}
    for i, line, obj in _read_jsonl(path):
        qid = field_of(obj, "question_id", int, path=path, line=line, index=i)
        out[qid] = (_turns(path, i, line, obj, field), line)
    return out


def load_mtbench(data: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Judged MT-Bench answers as records ``{question_id, model, turn, score, item}``, where
    ``item`` is a dict for :func:`icqs_fast.features.glassbox` (with ``history`` for turn 2 and
    ``reference`` when a GPT-4 reference answer exists).

    Records are sorted by (question_id, turn, model). ``limit`` keeps ``limit`` records spread
    evenly over that order (so every category is represented), not the first ``limit``.

    Every file is read whole before anything is scored, and any problem (invalid JSON, a missing
    or mistyped field, a judgment of a question or answer that is not there) raises
    :class:`icqs_fast.io.InputError` naming the file, line and field. An empty answer is a
    valid record (the real data has one, judged by GPT-4); its features are NaN.
    """
    from .io import RecordError, field_of

    root = Path(data)
    qfile = root / "question.jsonl"
    jfile = root / "judgment_gpt-4_single.jsonl"
    for f in (qfile, jfile):
        if not f.exists():
            raise FileNotFoundError(f"MT-Bench file {f} not found (pass --data FOLDER)")
    questions = _by_question(qfile, "turns")
    refs: dict[int, tuple[list[str], int]] = {}
    rfile = root / "reference_answer_gpt-4.jsonl"
    if rfile.exists():
        refs = _by_question(rfile, "choices.0.turns")
    answers: dict[str, dict[int, tuple[list[str], int]]] = {}
    recs = []
    for i, line, j in _read_jsonl(jfile):
        def need(field, kind, j=j, i=i, line=line):
            return field_of(j, field, kind, path=jfile, line=line, index=i)

        score = float(need("score", (int, float)))
        if score < 1:
            continue
        model = need("model", str)
        qid, turn = need("question_id", int), need("turn", int)
        if turn not in (1, 2):
            raise RecordError(jfile, line, "turn", f"must be 1 or 2, got {turn}", index=i)
        if model not in answers:
            afile = root / f"model_answer_{model}.jsonl"
            if not afile.exists():
                raise FileNotFoundError(f"answers of {model!r} not found: {afile} (needed by "
                                        f"{jfile}:{line})")
            answers[model] = _by_question(afile, "choices.0.turns")
        if qid not in questions:
            raise RecordError(jfile, line, "question_id", f"no question {qid} in {qfile}",
                              index=i)
        if qid not in answers[model]:
            raise RecordError(jfile, line, "question_id",
                              f"model {model!r} has no answer to question {qid}", index=i)
        (q, qline), (a, aline) = questions[qid], answers[model][qid]
        for f, turns, fline, field in ((qfile, q, qline, "turns"),
                                       (root / f"model_answer_{model}.jsonl", a, aline,
                                        "choices.0.turns")):
            if len(turns) < turn:
                raise RecordError(f, fline, field, f"{len(turns)} turn(s), but {jfile}:{line} "
                                  f"judges turn {turn}", index=i)
        ref = refs.get(qid, (None, 0))[0]
        item: dict[str, Any] = {"instruction": q[turn - 1], "response": a[turn - 1],
                                "reference": ref[turn - 1] if ref and len(ref) >= turn else None}
        if turn == 2:
            item["history"] = [(q[0], a[0])]
        recs.append({"question_id": qid, "model": model, "turn": turn, "score": score,
                     "item": item})
    recs.sort(key=lambda r: (r["question_id"], r["turn"], r["model"]))
    if limit is not None and 0 < limit < len(recs):
        n = len(recs)
        recs = [recs[(i * n) // limit] for i in range(limit)]
    return recs


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .features import ALL_FEATURES, MODES

    p.add_argument("--data", default=DEFAULT_DATA, help=f"MT-Bench folder (default {DEFAULT_DATA})")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--limit", type=int, default=None,
                   help="score N judged answers spread evenly over the set (default: all)")
    p.add_argument("--model", default=None, help="evaluator folder (default: embedded SmolLM2)")
    p.add_argument("--features", nargs="+", default=list(ALL_FEATURES),
                   choices=list(ALL_FEATURES) + list(ENSEMBLE_FEATURES), metavar="FEATURE",
                   help=f"features (default all of {' '.join(ALL_FEATURES)}; "
                        "unt_exp / unt_var run the 7-prompt ensemble)")
    p.add_argument("--mode", default="standard", choices=list(MODES))
    p.add_argument("--reference", default="none", choices=["none", "illustrate", "calibrate"],
                   help="reference augmentation for questions with a GPT-4 reference answer")
    p.add_argument("--calibration-factor", type=float, default=1.0,
                   help="calibrate: feature(answer) - factor x feature(reference answer), for "
                        "every feature including unt_exp / unt_var")
    p.add_argument("--batch-size", type=int, default=4,
                   help="answers per padded forward for the glass-box features (default 4); "
                        "the prompt ensemble puts one answer's members in each forward")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar / status lines on stderr")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is much faster on an "
                        "oversubscribed machine)")


def _fmt(v: float) -> str:
    return "   nan" if not math.isfinite(v) else f"{v:+.3f}"


def run(args: argparse.Namespace) -> int:
    import torch

    from .ensembles import prompt_ensemble
    from .features import FEATURE_DIRECTION, glassbox
    from .metrics import correlations
    from .models import load_model
    from .progress import Progress

    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.data).is_dir():
        what = "is not a folder" if Path(args.data).exists() else "not found"
        print(f"icqs-fast eval mtbench: data folder {args.data} {what}; nothing to do",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    recs = load_mtbench(args.data, args.limit)
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
