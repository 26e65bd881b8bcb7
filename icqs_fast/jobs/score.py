"""``icqs-fast score``: ICQS scores for the responses of a file, streamed to JSONL or Parquet.

    icqs-fast score responses.jsonl -o scores.jsonl --good good.jsonl --bad bad.jsonl

Input: JSONL, CSV, TSV (optionally .gz), Parquet, or a Hugging Face ``datasets`` folder
(``save_to_disk``), read in a stream (see :func:`icqs_fast.io.readers.read_records`). Output:
JSONL, or
Parquet for ``-o OUT.parquet`` (committed in part files, merged into one file on close; see
:class:`icqs_fast.io.results.ParquetResultWriter` for what a crash keeps: at most the last
uncommitted part is computed again on ``--resume``). ``--shard i/n`` scores only the i-th
(0-based) of n contiguous ranges of input records: the n outputs concatenated in shard order
are the unsharded output (docs/scoring_files.md). A progress bar (or, when stderr is not a
terminal, a status line every 10 s) shows records/s and the ETA; ``--quiet`` turns it off.

Each response gets one output line as soon as it is scored (one ``write`` per line), so a run
that stops - a bad input line, Ctrl-C, SIGKILL, a power cut - keeps everything computed so far,
and ``--resume`` continues after the last written record without redoing or duplicating any (a
line cut off mid-write is truncated away and redone). One process at a time writes an output:
it holds an advisory lock on ``OUT.lock`` and a second one refuses at once, naming the holder's
pid. A bad input line stops the run with an error naming the file, line and field
(``--on-error stop``, the default) or is reported on stderr and recorded in the output as a
``{"index", "line", "error": {"field", "reason"}}`` line (``--on-error skip``).

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
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from icqs_fast.io.readers import read_examples, read_records
from icqs_fast.io.records import InputError, Record, RecordError
from icqs_fast.io.results import skipped_record
from icqs_fast.io.runs import (
    check_runtime,
    checked_resume,
    input_range,
    open_results,
    plan_output,
    resume_check_needed,
    start_output,
)
from icqs_fast.models import runtime_settings

ON_ERROR = ("stop", "skip")


# --------------------------------------------------------------------------- library part


def check_record(scorer: Any, rec: Record, *, path: str = "<input>", x_field: str = "x",
                 y_field: str = "y") -> RecordError | None:
    """What the scorer would reject in ``rec`` (before it is sent to the scorer), or None.

    The same checks as the scorer's own (through its public ``tokens``, ``template``,
    ``max_length``, ``drop_oldest_demos`` and ``n_contexts``): x and y strings, y non-empty,
    query and response giving tokens, every context's prompt within the max length. Checking
    here means the error is built for this record by construction, with its index, line and
    field, instead of being recovered from the scorer's message text.
    """
    def err(field: str | None, reason: str) -> RecordError:
        return RecordError(path, rec.line, field, reason, index=rec.index)

    for field, v in ((x_field, rec.x), (y_field, rec.y)):
        if not isinstance(v, str):
            return err(field, f"must be a string, got {type(v).__name__}")
    if not rec.y.strip():
        return err(y_field, "empty response (nothing to score)")
    tokens = scorer.tokens
    q = tokens.encode(scorer.template.format_query(rec.x))
    r = tokens.encode(scorer.template.format_response(rec.y))
    if not q:
        return err(x_field, f"the query part {scorer.template.format_query(rec.x)!r} has no "
                   "tokens; the template's query must produce at least one")
    if not r:
        return err(y_field, "gives no response tokens")
    from icqs_fast.engine.prompt_tokens import PromptTooLong

    try:  # the exact whole-text lengths; cached, so the engine does not tokenize them again
        tokens.layouts(rec.index, rec.x, rec.y, scorer.max_length, scorer.drop_oldest_demos)
    except PromptTooLong as exc:
        return err(None, exc.reason.replace("drop_oldest_demos=True",
                                            "drop_oldest_demos=True (--drop-oldest-demos)"))
    except ValueError as exc:
        return err(None, str(exc))
    return None


def score_records(
    scorer: Any,
    records: Iterable[Record | RecordError],
    *,
    path: str = "<input>",
    x_field: str = "x",
    y_field: str = "y",
    on_error: Callable[[RecordError], None] | None = None,
) -> Iterator[tuple[Record, Any]]:
    """Score :class:`~icqs_fast.io.records.Record` s with an
    :class:`~icqs_fast.engine.scorer.ICQSScorer`,
    yielding ``(record, result)`` in input order, lazily.

    ``records`` may also hold :class:`RecordError` s in place of bad records (``read_records(...,
    on_error="yield")``); a record the scorer would reject (see :func:`check_record`) becomes
    one too. With ``on_error`` each is passed there - in input order, interleaved with the
    yielded results, so a caller writing both keeps the file order - and scoring goes on.
    Without, every record before the first bad one (or before an :class:`InputError` the
    ``records`` iterator raises) is still scored and yielded, then the error is raised.
    """
    source = iter(records)
    queue: deque[Record | RecordError] = deque()  # fed records and errors, in input order
    fatal: list[InputError] = []

    def feed() -> Iterator[tuple[str, str]]:
        while not fatal:
            try:
                item = next(source)
            except StopIteration:
                return
            except InputError as exc:
                fatal.append(exc)  # end the stream; what came before is still scored
                return
            if not isinstance(item, RecordError):
                bad = check_record(scorer, item, path=path, x_field=x_field, y_field=y_field)
                if bad is None:
                    queue.append(item)
                    yield (item.x, item.y)
                    continue
                item = bad
            if on_error is None:
                fatal.append(item)
                return
            queue.append(item)

    for res in scorer.score(feed()):
        while isinstance(queue[0], RecordError):
            on_error(queue.popleft())
        yield queue.popleft(), res
    while queue:  # only errors are left
        on_error(queue.popleft())
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
        **({"loglik_baseline": res.loglik_baseline.tolist()}
           if getattr(res, "loglik_baseline", None) is not None else {}),
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


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_template(path: str | None):
    from icqs_fast.engine.prompts import Template

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


def score_settings(args: argparse.Namespace, template_spec: dict | None) -> dict:
    """What makes scores comparable: checked when resuming."""
    return {
        "model": os.path.abspath(args.model) if args.model else "embedded:SmolLM2-135M-Instruct",
        "good_sha256": file_sha256(args.good),
        "bad_sha256": file_sha256(args.bad),
        "num_ratios": args.num_ratios,
        "demos_per_set": args.demos_per_set,
        "sets_per_ratio": args.sets_per_ratio,
        "seed": args.seed,
        "mixing": args.mixing,
        "replacement": args.replacement,
        "stratify_field": args.stratify_field,
        "strata_order": args.strata_order,
        "max_length": args.max_length,
        "drop_oldest_demos": args.drop_oldest_demos,
        "template": template_spec,
        "x_field": args.x_field,
        "y_field": args.y_field,
    } | _calibration_settings(args) | (
        {"shard": args.shard} if getattr(args, "shard", None) else {})


def _calibration_settings(args: argparse.Namespace) -> dict:
    """The calibration options, in the settings only when not the defaults (so outputs written
    before they existed still resume)."""
    out = {}
    if getattr(args, "calibrate", "none") != "none":
        out["calibration"] = args.calibrate
    if getattr(args, "score", "argmax") != "argmax":
        out["score"] = args.score
    return out


def run_score_locked(args: argparse.Namespace, out: Path, log: Callable[..., None]) -> int:
    from icqs_fast.engine.scorer import DEFAULT_TOKEN_BUDGET, ICQSScorer
    from icqs_fast.models import load_model
    from icqs_fast.progress import track

    template, template_spec = load_template(args.template)
    settings = score_settings(args, template_spec)

    plan = plan_output(out, settings, resume=args.resume, overwrite=args.overwrite)
    start, stop, total = input_range(args, plan)

    ex_kw = dict(x_field=args.x_field, y_field=args.y_field, encoding=args.encoding)
    good = read_examples(args.good, **ex_kw)
    bad = read_examples(args.bad, **ex_kw)
    stratify = args.stratify_field
    if stratify == "none":
        stratify = None
    elif stratify == args.y_field:
        stratify = "y"
    elif stratify not in (None, "y", "auto"):  # a field of the demonstration files
        stratify = tuple([str(r.label) for r in read_records(
            path, label_field=args.stratify_field, **ex_kw)] for path in (args.good, args.bad))

    t_load = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    t_load = time.perf_counter() - t_load
    settings.update(runtime_settings(model, args.backend))
    check_runtime(plan, settings)
    scorer = ICQSScorer(
        model, tok, good, bad, num_ratios=args.num_ratios, demos_per_set=args.demos_per_set,
        sets_per_ratio=args.sets_per_ratio, template=template, seed=args.seed,
        mixing=args.mixing, replacement=args.replacement, stratify=stratify,
        strata_order=args.strata_order, backend=args.backend,
        token_budget=args.token_budget or DEFAULT_TOKEN_BUDGET, max_length=args.max_length,
        drop_oldest_demos=args.drop_oldest_demos,
        calibration=getattr(args, "calibrate", "none"), score=getattr(args, "score", "argmax"),
    )
    log(f"icqs-fast: model loaded in {t_load:.1f} s; {len(good)} good / {len(bad)} bad "
        f"demonstrations, {args.num_ratios} ratios x {args.sets_per_ratio} sets of "
        f"{args.demos_per_set}")
    start_output(plan, settings, log)

    summary = Summary()
    path_name = "<stdin>" if args.input == "-" else args.input
    with_label = args.label_field is not None
    # Resuming after a scored record with an id: read that record again and check it is the
    # same one (a skipped record's line has no id to compare).
    check = resume_check_needed(plan)
    records = read_records(
        args.input, format=args.format, x_field=args.x_field, y_field=args.y_field,
        id_field=args.id_field, label_field=args.label_field, encoding=args.encoding,
        skip=start - 1 if check else start, on_error="yield" if args.on_error == "skip" else None,
        allow_empty=start > 0 or stop is not None, stop=stop,
    )
    if check:
        records = checked_resume(records, plan.last, path_name)

    with open_results(plan) as writer:
        def skip(err: RecordError) -> None:
            writer.write(skipped_record(err))
            summary.skipped += 1
            log(f"icqs-fast: skipping bad record: {err}")

        scored = score_records(scorer, records, path=path_name, x_field=args.x_field,
                               y_field=args.y_field,
                               on_error=skip if args.on_error == "skip" else None)
        try:
            for rec, res in track(scored, total=total if total >= 0 else None, desc="score",
                                  unit="record", quiet=args.quiet):
                writer.write(result_record(rec, res, with_label=with_label))
                summary.add(res.score, rec.label, with_label)
        except InputError:
            log(summary.text("icqs-fast: stopped: "))
            log(f"icqs-fast: the results before the bad record are in {out}; fix it and rerun "
                "with --resume, or pass --on-error skip")
            raise
        except KeyboardInterrupt:
            log(summary.text("icqs-fast: interrupted: "))
            log(f"icqs-fast: results so far are in {out}; rerun with --resume to continue")
            return 130
    log(summary.text("icqs-fast: "))
    return 0
