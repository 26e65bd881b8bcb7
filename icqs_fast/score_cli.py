"""``icqs-fast score``: ICQS scores for the responses of a JSONL/CSV/TSV file, streamed to JSONL.

    icqs-fast score responses.jsonl -o scores.jsonl --good good.jsonl --bad bad.jsonl

Each response gets one output line as soon as it is scored (written and flushed), so a run that
stops - a bad input line, Ctrl-C, a crash - keeps everything computed so far, and ``--resume``
continues after the last written record without redoing or duplicating any. A bad input line
stops the run with an error naming the file, line and field (``--on-error stop``, the default)
or is reported on stderr and skipped (``--on-error skip``).

Output record fields: ``index`` (0-based record number in the input; bad records count too),
``line``, ``id`` (when the input has one), ``label`` (with ``--label-field``), ``score``
(ICQS-Epistemic), ``score_per_set`` (plain ICQS per set), ``loglik`` (``[M+1][L]``),
``ratios``, ``n_response_tokens``, ``n_prompt_tokens`` (``[M+1][L]``) and, when demonstrations
had to be dropped, ``n_dropped_demos``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from .io import InputError, JsonlWriter, Record, read_examples, read_records, read_resume_state

ON_ERROR = ("stop", "skip")


# --------------------------------------------------------------------------- library part


def score_records(
    scorer: Any,
    records: Iterable[Record],
    *,
    path: str = "<input>",
    y_field: str = "y",
    on_error: Callable[[InputError], None] | None = None,
) -> Iterator[tuple[Record, Any]]:
    """Score :class:`~icqs_fast.io.Record` s with an :class:`~icqs_fast.icqs.ICQSScorer`,
    yielding ``(record, result)`` in input order, lazily.

    A record the scorer rejects (its response gives no tokens, its prompt is too long, ...)
    becomes an :class:`InputError` naming ``path`` and the record's line. With ``on_error``
    it is passed there and scoring goes on; without, every record before it - and before any
    :class:`InputError` the ``records`` iterator raises - is still scored and yielded, then
    the error is raised.
    """
    source = iter(records)
    replay: deque[Record] = deque()  # pulled by a scorer that failed, not yet scored
    fatal: list[InputError] = []
    while True:
        pending: deque[Record] = deque()
        fed = [0]
        stop = bool(fatal)

        def feed(pending=pending, fed=fed, stop=stop):
            while True:
                if replay:
                    rec = replay.popleft()
                elif stop:
                    return
                else:
                    try:
                        rec = next(source)
                    except StopIteration:
                        return
                    except InputError as exc:
                        fatal.append(exc)  # end the stream; what came before is still scored
                        return
                pending.append(rec)
                fed[0] += 1
                yield (rec.x, rec.y)

        try:
            for res in scorer.score(feed()):
                yield pending.popleft(), res
            break
        except ValueError as exc:
            msg = str(exc)
            tag = f"response {fed[0] - 1}: "
            if not pending or not msg.startswith(tag):
                raise  # not about one record
            bad = pending.pop()
            reason = msg[len(tag):].replace("pass drop_oldest_demos=True",
                                            "pass drop_oldest_demos=True (--drop-oldest-demos)")
            field = y_field if "field 'y'" in reason else None
            err = InputError(path, bad.line, field, reason.replace("field 'y' ", "").strip())
            replay.extendleft(reversed(pending))
            if on_error is None:
                fatal[:] = [err]  # this record comes before any the reader failed on
            else:
                on_error(err)
    if fatal:
        raise fatal[0]


def result_record(rec: Record, res: Any, *, with_label: bool = False) -> dict:
    """The output JSON object of one scored record."""
    out: dict[str, Any] = {"index": rec.index, "line": rec.line}
    if rec.id is not None:
        out["id"] = rec.id
    if with_label:
        out["label"] = rec.label
    out.update(
        score=res.score,
        score_per_set=list(res.score_per_set),
        loglik=res.loglik.tolist(),
        ratios=list(res.ratios),
        n_response_tokens=int(res.n_response_tokens),
        n_prompt_tokens=res.n_prompt_tokens.tolist(),
    )
    if int(res.n_dropped_demos.sum()) > 0:
        out["n_dropped_demos"] = res.n_dropped_demos.tolist()
    return out


class Summary:
    """Running count, mean score (overall and per label) and throughput."""

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.by_label: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.skipped = 0
        self.t0 = time.perf_counter()

    def add(self, score: float, label: Any = None, with_label: bool = False) -> None:
        self.n += 1
        self.total += score
        if with_label:
            s = self.by_label[json.dumps(label) if not isinstance(label, str) else label]
            s[0] += 1
            s[1] += score

    def text(self, prefix: str = "") -> str:
        dt = time.perf_counter() - self.t0
        mean = f"{self.total / self.n:.4f}" if self.n else "n/a"
        rate = self.n / dt if dt > 0 else 0.0
        parts = [f"{prefix}scored {self.n} responses in {dt:.1f} s ({rate:.2f} responses/s)",
                 f"mean score {mean}"]
        if self.skipped:
            parts.append(f"{self.skipped} bad records skipped")
        line = ", ".join(parts)
        if self.by_label:
            line += "\n  mean score by label: " + ", ".join(
                f"{k}: {v[1] / v[0]:.4f} (n={v[0]})" for k, v in sorted(self.by_label.items()))
        return line


# --------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    p.add_argument("input", help="responses: .jsonl/.csv/.tsv (optionally .gz); '-' = JSONL stdin")
    p.add_argument("-o", "--output", required=True, help="results JSONL (one line per response)")
    p.add_argument("--good", required=True, help="good demonstrations (JSONL/CSV/TSV, x/y fields)")
    p.add_argument("--bad", required=True, help="bad demonstrations (JSONL/CSV/TSV, x/y fields)")
    p.add_argument("--format", choices=["jsonl", "csv", "tsv"], default=None,
                   help="input format (default: from the extension)")
    p.add_argument("--x-field", default="x", help="field with the prompt/input (default: x)")
    p.add_argument("--y-field", default="y", help="field with the response (default: y)")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mixing", choices=["exact", "bernoulli"], default="exact")
    p.add_argument("--replacement", action="store_true",
                   help="draw demonstrations with replacement (small pools)")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--token-budget", type=int, default=None,
                   help="max rows x tokens per forward (default: the engine's)")
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
    p.add_argument("--quiet", action="store_true", help="no progress/summary on stderr")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_template(path: str | None):
    from .prompts import Template

    if path is None:
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except json.JSONDecodeError as exc:
        raise InputError(path, exc.lineno, None, f"invalid JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise InputError(path, None, None, "a template file holds a JSON object")
    unknown = sorted(set(spec) - {"system", "demo", "query", "response", "separator"})
    if unknown:
        raise InputError(path, None, unknown[0], "unknown Template field")
    return Template(**spec), spec


def _settings(args: argparse.Namespace, template_spec: dict | None) -> dict:
    """What makes scores comparable: checked when resuming."""
    return {
        "model": os.path.abspath(args.model) if args.model else "embedded:SmolLM2-135M-Instruct",
        "good_sha256": _sha256(args.good),
        "bad_sha256": _sha256(args.bad),
        "num_ratios": args.num_ratios,
        "demos_per_set": args.demos_per_set,
        "sets_per_ratio": args.sets_per_ratio,
        "seed": args.seed,
        "mixing": args.mixing,
        "replacement": args.replacement,
        "max_length": args.max_length,
        "drop_oldest_demos": args.drop_oldest_demos,
        "template": template_spec,
        "x_field": args.x_field,
        "y_field": args.y_field,
    }


def meta_path(output: str | os.PathLike) -> Path:
    """The settings file written next to the results (``OUT.meta.json``)."""
    return Path(f"{os.fspath(output)}.meta.json")


def run(args: argparse.Namespace) -> int:
    from .icqs import DEFAULT_TOKEN_BUDGET, ICQSScorer
    from .models import load_model

    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    out = Path(args.output)
    for name in ("good", "bad"):
        if not os.path.isfile(getattr(args, name)):
            raise FileNotFoundError(f"no such --{name} file: {getattr(args, name)}")
    if args.input != "-" and not os.path.isfile(args.input):
        raise FileNotFoundError(f"no such input file: {args.input}")
    if args.resume and args.overwrite:
        raise ValueError("choose at most one of --resume and --overwrite")
    template, template_spec = _load_template(args.template)
    settings = _settings(args, template_spec)

    start, last, append = 0, None, False
    if args.resume and out.exists():
        state = read_resume_state(out)
        mp = meta_path(out)
        if mp.is_file():
            old = json.loads(mp.read_text(encoding="utf-8"))
            diff = sorted(k for k in settings if old.get(k) != settings[k])
            if diff:
                raise ValueError(f"cannot --resume {out}: it was written with other settings "
                                 f"({', '.join(diff)} differ); use another output or --overwrite")
        if out.stat().st_size != state.end:
            with open(out, "r+b") as f:  # drop a record cut off mid-write
                f.truncate(state.end)
            log(f"icqs-fast: removed an incomplete last line from {out}")
        last = state.last
        start = last["index"] + 1 if last is not None else 0
        append = True
        log(f"icqs-fast: resuming {out}: {state.count} records there, continuing at input "
            f"record {start}")
    elif out.exists() and out.stat().st_size > 0 and not args.overwrite and not args.resume:
        raise ValueError(f"{out} exists; pass --resume to continue it or --overwrite to replace it")

    ex_kw = dict(x_field=args.x_field, y_field=args.y_field, encoding=args.encoding)
    good = read_examples(args.good, **ex_kw)
    bad = read_examples(args.bad, **ex_kw)

    t_load = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    t_load = time.perf_counter() - t_load
    scorer = ICQSScorer(
        model, tok, good, bad, num_ratios=args.num_ratios, demos_per_set=args.demos_per_set,
        sets_per_ratio=args.sets_per_ratio, template=template, seed=args.seed,
        mixing=args.mixing, replacement=args.replacement, backend=args.backend,
        token_budget=args.token_budget or DEFAULT_TOKEN_BUDGET, max_length=args.max_length,
        drop_oldest_demos=args.drop_oldest_demos,
    )
    log(f"icqs-fast: model loaded in {t_load:.1f} s; {len(good)} good / {len(bad)} bad "
        f"demonstrations, {args.num_ratios} ratios x {args.sets_per_ratio} sets of "
        f"{args.demos_per_set}")

    summary = Summary()
    path_name = "<stdin>" if args.input == "-" else args.input

    def skip(err: InputError) -> None:
        summary.skipped += 1
        log(f"icqs-fast: skipping bad record: {err}")

    with_label = args.label_field is not None
    # Resuming after a record with an id: read that record again and check it is the same one.
    check = last is not None and "id" in last
    records = read_records(
        args.input, format=args.format, x_field=args.x_field, y_field=args.y_field,
        id_field=args.id_field, label_field=args.label_field, encoding=args.encoding,
        skip=start - 1 if check else start, on_error=skip if args.on_error == "skip" else None,
    )
    if check:
        records = _checked(records, last, path_name)

    if not append:
        meta_path(out).write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")
    with JsonlWriter(out, append=append) as writer:
        try:
            for rec, res in score_records(scorer, records, path=path_name, y_field=args.y_field,
                                          on_error=skip if args.on_error == "skip" else None):
                writer.write(result_record(rec, res, with_label=with_label))
                summary.add(res.score, rec.label, with_label)
        except InputError:
            log(summary.text("icqs-fast: stopped: "))
            log(f"icqs-fast: the {summary.n} results before the bad record are in {out}; fix "
                "it and rerun with --resume, or pass --on-error skip")
            raise
        except KeyboardInterrupt:
            log(summary.text("icqs-fast: interrupted: "))
            log(f"icqs-fast: results so far are in {out}; rerun with --resume to continue")
            return 130
    log(summary.text("icqs-fast: "))
    return 0


def _checked(records: Iterator[Record], last: dict, path: str) -> Iterator[Record]:
    """Drop the already-written record ``last["index"]``, checking its id still matches."""
    first = True
    for rec in records:
        if first:
            first = False
            if rec.index == last["index"]:
                if rec.id != last["id"]:
                    raise ValueError(
                        f"cannot --resume: {path}:{rec.line} (record {rec.index}) has id "
                        f"{rec.id!r} but the output's last record has id {last['id']!r}; "
                        "the input changed since the output was written")
                continue
        yield rec
