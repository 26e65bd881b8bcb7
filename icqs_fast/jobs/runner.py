"""ONE job runner for ``score`` and ``features``: read -> batch -> score -> write, with resume,
skip/stop on bad records, progress and a summary.

    from icqs_fast.jobs.config import ScoreJobConfig
    from icqs_fast.jobs.runner import run_job

    run_job(ScoreJobConfig(input="in.jsonl", output="out.jsonl", good="g.jsonl", bad="b.jsonl"))

What differs between the two commands is a small strategy object (:class:`JobStrategy`;
``jobs.score.ScoreStrategy``, ``jobs.features.FeatureStrategy``): load the engine, compute the
results of a record stream, turn one result into an output line, count it in the summary. The
executor is chosen by a string, ``"local"`` (this process) or ``"ray"`` (Ray Data,
:mod:`icqs_fast.jobs.ray_executor`; Ray is imported only there), by default from the config
(``config.ray`` set: ``"ray"``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from icqs_fast.io.readers import read_records, read_rows
from icqs_fast.io.records import InputError, Record, RecordError
from icqs_fast.io.results import output_format, remove_parquet_output, skipped_record
from icqs_fast.io.runs import (
    OutputLock,
    check_run_paths,
    check_runtime,
    checked_resume,
    input_range,
    meta_path,
    open_results,
    plan_output,
    resume_check_needed,
    start_output,
)
from icqs_fast.jobs.config import EXECUTORS, FeatureJobConfig, JobConfig, ScoreJobConfig
from icqs_fast.progress import quiet_transformers

Log = Callable[..., None]


class JobSummary(Protocol):
    n: int
    skipped: int

    def add(self, rec: Record, res: Any) -> None: ...

    def text(self, prefix: str = "") -> str: ...


class JobStrategy(Protocol):
    """What a job kind adds to the runner."""

    desc: str  # progress bar label
    done_prefix: str  # the final summary line's prefix
    align: int  # shard boundaries and resume restarts are multiples of this (chunked jobs)
    read_labels: bool  # read the label field into the records

    def load(self, plan: Any, settings: dict, log: Log) -> None:
        """Load the model and build the engine; add what is known only now (dtype, device,
        backend, ...) to ``settings`` and check it against a resumed output (``plan``)."""

    def results(self, records: Iterable[Record | RecordError], *, write_from: int,
                on_error: Callable[[RecordError], None] | None
                ) -> Iterator[tuple[Record, Any]]:
        """``(record, result)`` in input order (records before ``write_from`` are computed
        only as context, not yielded); bad records go to ``on_error`` or are raised."""

    def line(self, rec: Record, res: Any) -> dict:
        """The output line of one result."""

    def table_schema(self) -> Any:
        """The ``pyarrow.Schema`` of a Parquet output (:func:`icqs_fast.io.schema.arrow_schema`)."""

    def summary(self) -> JobSummary: ...


def strategy_for(config: JobConfig) -> JobStrategy:
    if isinstance(config, ScoreJobConfig):
        from icqs_fast.jobs.score import ScoreStrategy

        return ScoreStrategy(config)
    if isinstance(config, FeatureJobConfig):
        from icqs_fast.jobs.features import FeatureStrategy

        return FeatureStrategy(config)
    raise TypeError(f"no job for {type(config).__name__}")


def stderr_log(quiet: bool) -> Log:
    return (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))


def run_job(config: JobConfig, *, executor: str | None = None, log: Log | None = None,
            stats: dict | None = None) -> int:
    """Run a ``score`` or ``features`` job; the exit code (0; 130 on Ctrl-C).

    ``executor``: ``"local"`` or ``"ray"`` (default: ``config.executor``). ``stats``: the Ray
    executor's run figures (see :func:`icqs_fast.jobs.ray_executor.run_ray`).

    Raises:
        InputError: a bad record with ``on_error="stop"`` (file, line, field), a bad input.
        ValueError / FileNotFoundError: bad options, other settings in a resumed output.
    """
    executor = executor or config.executor
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "ray":
        from icqs_fast.jobs.ray_executor import run_ray

        return run_ray(config, stats=stats)  # checks the config itself
    config.check()
    log = log or stderr_log(config.quiet)
    check_run_paths(config.input, config.resume, config.overwrite, config.format)
    peek_input(config)  # whole-file errors before anything is written or loaded
    strategy = strategy_for(config)
    prepare = getattr(strategy, "prepare", None)
    if prepare is not None:
        prepare(log)  # what needs no model (score: the demonstration sets)
    try:
        make_output_folder(config.output, log)
        # Held until this process ends (or crashes: the OS drops it), before the output is
        # touched.
        with OutputLock(Path(config.output)):
            return run_local_locked(config, strategy, log)
    except OSError as exc:
        if not is_output_error(exc, config.output):
            raise
        raise OutputError(f"cannot write the output {config.output}: "
                          f"{exc.strerror or exc}"
                          + (f" ({exc.filename})" if exc.filename else "")) from None


class OutputError(ValueError):
    """The output cannot be written (an OS error on it: a usage error, exit code 2)."""


def is_output_error(exc: OSError, output: str) -> bool:
    """An OS error on the output, its lock, settings or part files, or its folder (one with
    no file name is a write error: reads name their file)."""
    if exc.filename is None:
        return True
    name, out = os.path.abspath(os.fspath(exc.filename)), os.path.abspath(output)
    return name.startswith(out) or out.startswith(name + os.sep)


def make_output_folder(output: str, log: Log) -> None:
    """Create a missing output folder (like ``mkdir -p``), saying so."""
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        log(f"icqs-fast: created the output folder {os.path.dirname(output) or parent}")


def peek_input(config: JobConfig) -> None:
    """Read the input's first record (files only; standard input cannot be read twice), so
    that what is wrong with the whole file - empty, a header without the fields (a wrong
    delimiter), unreadable - fails before the model loads and before the output is created.
    An error in the record itself is left to the run (its earlier records are kept)."""
    if config.input == "-" or config.resume or config.shard is not None:
        return  # resuming / sharded: the input range is checked by the run
    it = read_records(config.input, format=config.format, x_field=config.x_field,
                      y_field=config.y_field, id_field=config.id_field,
                      label_field=config.label_field, encoding=config.encoding,
                      on_error="yield", allow_empty=False)
    try:
        next(iter(it), None)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads`` (before the model loads); None leaves torch's default."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def run_local_locked(config: JobConfig, strategy: JobStrategy, log: Log) -> int:
    """The job in this process, its output lock held."""

    out = Path(config.output)
    settings = config.fingerprint()
    # Fail fast on other settings, before the model is loaded; the rest is checked after.
    plan = plan_output(out, settings, resume=config.resume, overwrite=config.overwrite)
    start, stop, total = input_range(config.input, config.format, config.encoding,
                                     config.shard, plan, align=strategy.align)
    set_threads(config.threads)
    if config.quiet:
        quiet_transformers()
    strategy.load(plan, settings, log)
    check_runtime(plan, settings)
    start_output(plan, settings, log)

    # Resuming: read again from the first record of the chunk the run stopped in (a chunked
    # job recomputes its records in the same batches, writing only those after the last one on
    # disk), and check that the output's last record still has its id.
    first = (start // strategy.align) * strategy.align
    check = resume_check_needed(plan)
    records: Iterable[Record | RecordError] = read_records(
        config.input, format=config.format, x_field=config.x_field, y_field=config.y_field,
        id_field=config.id_field,
        label_field=config.label_field if strategy.read_labels else None,
        encoding=config.encoding, skip=min(first, start - 1) if check else first,
        on_error="yield",  # strategy.results stops on an error if asked
        allow_empty=start > 0 or stop is not None, stop=stop,
    )
    if check:
        records = checked_resume(records, plan.last, config.input_name, keep=True)
        records = (r for r in records if r.index >= first)  # the last record may precede it

    summary = strategy.summary()
    try:
        return _write_results(config, strategy, plan, records, summary, start, total, log)
    except InputError as exc:
        if not isinstance(exc, RecordError) and not plan.append and summary.n == 0 \
                and summary.skipped == 0:
            remove_output(out)  # nothing was written: leave nothing behind
        raise


def remove_output(out: Path) -> None:
    """Remove a new output that holds nothing, its settings file and its lock file."""
    for p in (out, meta_path(out), Path(f"{out}.lock")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if output_format(out) == "parquet":
        remove_parquet_output(out)


def _write_results(config: JobConfig, strategy: JobStrategy, plan: Any,
                   records: Iterable[Record | RecordError], summary: JobSummary, start: int,
                   total: int, log: Log) -> int:
    from icqs_fast.progress import track

    out = plan.out
    with open_results(plan, schema=strategy.table_schema()) as writer:
        def skip(err: RecordError) -> None:
            writer.write(skipped_record(err))
            summary.skipped += 1
            log(f"icqs-fast: skipping bad record: {err}")

        results = strategy.results(records, write_from=start,
                                   on_error=skip if config.on_error == "skip" else None)
        try:
            for rec, res in track(results, total=total if total >= 0 else None,
                                  desc=strategy.desc, unit="record", quiet=config.quiet):
                writer.write(strategy.line(rec, res))
                summary.add(rec, res)
        except InputError as exc:
            if not isinstance(exc, RecordError):  # the whole input (e.g. empty standard input)
                raise
            log(summary.text("icqs-fast: stopped: "))
            log(f"icqs-fast: the results before the bad record are in {out}; fix it and rerun "
                "with --resume" + (", or pass --on-error skip" if config.on_error == "stop"
                                   else ""))
            raise
        except KeyboardInterrupt:
            log(summary.text("icqs-fast: interrupted: "))
            log(f"icqs-fast: results so far are in {out}; rerun with --resume to continue")
            return 130
    log(summary.text(strategy.done_prefix))
    if plan.append:  # the lines above cover this run only: say what the whole output holds
        log(output_summary(out, label=config.label_field is not None
                           and isinstance(config, ScoreJobConfig)))
    return 0


def output_summary(out: Path, *, label: bool = False) -> str:
    """One line on a whole results file (after a resumed run): its records, the bad records
    skipped in it and, for ``score`` output, the mean score (per label with ``label``)."""
    n = skipped = 0
    total = 0.0
    scored = 0
    by_label: dict[str, list[float]] = {}
    for _, _, row in read_rows(out, optional=("score", "label", "error", "n_tokens")):
        if "error" in row and "score" not in row and "n_tokens" not in row:
            skipped += 1
            continue
        n += 1
        score = row.get("score")
        if isinstance(score, (int, float)):
            scored += 1
            total += score
            if label:
                key = row.get("label")
                key = key if isinstance(key, str) else json.dumps(key)
                s = by_label.setdefault(key, [0, 0.0])
                s[0] += 1
                s[1] += score
    line = f"icqs-fast: the whole output {out} holds {n} records"
    if scored:
        line += f", mean score {total / scored:.4f}"
    if skipped:
        line += f", {skipped} bad records skipped"
    if by_label:
        line += "\n  mean score by label: " + ", ".join(
            f"{k}: {v[1] / v[0]:.4f} (n={v[0]})" for k, v in sorted(by_label.items()))
    return line

