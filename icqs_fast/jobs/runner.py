"""ONE job runner for ``score`` and ``features``, whatever runs the forward: read -> batch ->
score -> write, with the output policy, lock, resume, metadata, self-check, bad-record rules,
progress and a summary.

    from icqs_fast.jobs.config import ScoreJobConfig
    from icqs_fast.jobs.run import run_job

    run_job(ScoreJobConfig(input="in.jsonl", output="out.jsonl", good="g.jsonl", bad="b.jsonl"))

A job kind is a strategy object (:class:`~icqs_fast.jobs.kinds.JobStrategy`, found by the
config's ``kind`` in :data:`~icqs_fast.jobs.kinds.STRATEGIES`: ``jobs.score.ScoreStrategy``,
``jobs.features.FeatureStrategy``): load the engine, the self-check step, compute the results
of a record stream, turn one result into an output line, count it in the summary. Where the
forward runs decides only what the output is: :func:`run_local` (this process, a results file:
:class:`LocalOutput`) or an :class:`Executor` through :func:`run_with`
(``jobs.ray_executor.RayExecutor``: Ray Data actors, a folder of block files; Ray is imported
only there). Both start with :func:`start_job` and :func:`locked_output` - the same checks,
policy (:func:`icqs_fast.io.runs.output_policy`), lock, metadata and resume rules - and both
write results with :func:`stream_results` into the writers of :mod:`icqs_fast.io.results`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from icqs_fast.io.readers import RecordFields, read_records
from icqs_fast.io.records import InputError, Record, RecordError
from icqs_fast.io.results import output_format, remove_parquet_output, skipped_record
from icqs_fast.io.runs import (
    FileTarget,
    OutputPolicy,
    RunTarget,
    check_run_paths,
    check_runtime,
    checked_resume,
    input_range,
    meta_path,
    open_results,
    output_policy,
    resume_check_needed,
    start_output,
)
from icqs_fast.jobs.config import JobConfig
from icqs_fast.jobs.kinds import JobStrategy, JobSummary, Log, strategy_for
from icqs_fast.progress import quiet_transformers
from icqs_fast.threads import apply_threads


@dataclass
class JobRun:
    """One job as the runner hands it to its executor: decided, its output locked."""

    config: JobConfig
    strategy: JobStrategy
    policy: OutputPolicy
    meta: dict  # the metadata (OUT.meta.json): the resume key, then what the run adds
    log: Log
    stats: dict  # the executor's run figures (filled by the Ray executor)


class OutputPlace(Protocol):
    """Where a job's results go: this process's results file (:class:`LocalOutput`) or an
    executor's (see the module docstring)."""

    def check(self, config: JobConfig) -> None:
        """Refuse options this place cannot run, before anything is read."""

    def target(self, config: JobConfig, log: Log) -> RunTarget:
        """The output (an :class:`~icqs_fast.io.runs.RunTarget`)."""

    def layout_key(self, config: JobConfig) -> dict:
        """Keys this place adds to the job's resume key (its output layout)."""


class Executor(OutputPlace, Protocol):
    """Where a job's forward runs when not in this process (see the module docstring)."""

    def run(self, job: JobRun) -> int:
        """Compute and write the results; the exit code."""


@dataclass
class ResultSink:
    """Where :func:`stream_results` puts a result stream: a writer of :mod:`icqs_fast.io.results`
    (a results file, or one block), the summary it counts into, and whether bad records are
    written as skipped lines (``--on-error skip``) rather than raised."""

    writer: Any
    summary: JobSummary
    skip: bool
    log: Log


def stream_results(strategy: JobStrategy, records: Iterable[Record | RecordError],
                   sink: ResultSink, *, write_from: int = 0,
                   progress: Callable[[Iterable], Iterable] = iter) -> None:
    """Compute ``records`` with ``strategy`` and write each result line (and, skipping, each
    bad record's line in its place) to ``sink`` in input order - the one loop of the local run
    and of every ``--ray`` block.

    Raises:
        InputError: a bad record (not skipping) or a bad input, after the lines before it.
    """
    def skip(err: RecordError) -> None:
        sink.writer.write(skipped_record(err))
        sink.summary.skipped += 1
        sink.log(f"icqs-fast: skipping bad record: {err}")

    results = strategy.results(records, write_from=write_from,
                               on_error=skip if sink.skip else None)
    for rec, res in progress(results):
        sink.writer.write(strategy.line(rec, res))
        sink.summary.add(rec, res)


def stderr_log(quiet: bool) -> Log:
    return (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr))


def run_with(config: JobConfig, executor: Executor, *, log: Log | None = None,
             stats: dict | None = None) -> int:
    """Run ``config``'s job with ``executor``: the checks and the strategy's preparation
    (:func:`start_job`), the output's lock and policy (:func:`locked_output`), then
    :meth:`Executor.run`. An OS error on the output is an :class:`OutputError`."""
    strategy = strategy_for(config)
    log = start_job(config, strategy, executor, log)
    with locked_output(config, executor, log) as (policy, meta):
        return executor.run(JobRun(config, strategy, policy, meta, log,
                                   stats if stats is not None else {}))


def start_job(config: JobConfig, strategy: JobStrategy, executor: OutputPlace,
              log: Log | None) -> Log:
    """What every run of ``config`` with the ``strategy`` of its job kind
    (:func:`~icqs_fast.jobs.kinds.strategy_for`) does first, before the output is touched: the
    executor's and the paths' checks, the input's first record and the strategy's preparation
    (what needs no model: score's demonstration sets). Returns the log (``log`` or
    stderr's)."""
    executor.check(config)
    log = log or stderr_log(config.quiet)
    check_run_paths(config.input, config.resume, config.overwrite, config.format)
    # Whole-file errors before anything is written or loaded (a strategy whose records are
    # not plain ones, such as pairs, reads its own).
    getattr(strategy, "peek_input", peek_input)(config)
    strategy.prepare(log)
    return log


@contextlib.contextmanager
def locked_output(config: JobConfig, executor: OutputPlace, log: Log
                  ) -> Iterator[tuple[OutputPolicy, dict]]:
    """The output's lock held, and its policy (new, resumed or replaced:
    :func:`~icqs_fast.io.runs.output_policy`) with the metadata it was decided on; an OS
    error on the output, here or in the body, is an :class:`OutputError`."""
    try:
        target = executor.target(config, log)
        # Held until this process ends (or crashes: the OS drops it), before the output is
        # touched.
        with target.lock():
            meta = {**config.resume_key(), **executor.layout_key(config)}
            # Fail fast on other settings, before the model is loaded; the rest is checked
            # once it is.
            policy = output_policy(target, meta, resume=config.resume,
                                   overwrite=config.overwrite, upgrade=config.upgrade_meta,
                                   labels=config.key_labels())
            yield policy, meta
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
    delimiter), unreadable - and a bad first record (``--on-error stop``: no result could
    come before it) fail before the model loads and before the output is created. An error
    in a later record is left to the run (its earlier records are kept)."""
    if config.input == "-" or config.resume or config.shard is not None:
        return  # resuming / sharded: the input range is checked by the run
    it = read_records(config.input, record_fields(config), format=config.format,
                      encoding=config.encoding, on_error="yield", allow_empty=False)
    try:
        first = next(iter(it), None)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    if isinstance(first, RecordError) and config.on_error == "stop":
        raise first


def input_records(config: JobConfig, strategy: JobStrategy, **kw: Any
                  ) -> Iterator[Record | RecordError]:
    """The input's records as ``strategy`` computes them: its own reader when it has one
    (``read_input``: pairs), else :func:`~icqs_fast.io.readers.read_records` of the config's
    fields (``kw``: its skip, stop, on_error, allow_empty)."""
    read = getattr(strategy, "read_input", None)
    if read is not None:
        return read(**kw)
    return read_records(config.input, record_fields(config, labels=strategy.read_labels),
                        format=config.format, encoding=config.encoding, **kw)


def record_fields(config: JobConfig, *, labels: bool = True) -> RecordFields:
    """The record fields of ``config`` (its label field only with ``labels``)."""
    return RecordFields(config.x_field, config.y_field, config.id_field,
                        config.label_field if labels else None)


def run_local(config: JobConfig, *, log: Log | None = None, stats: dict | None = None) -> int:
    """Run ``config``'s job in this process (the output a results file: :class:`LocalOutput`);
    the exit code (``stats``: an executor's figures, none here). The steps of :func:`run_with`
    (the job kind's strategy, :func:`start_job`, :func:`locked_output`), then the model, the
    self-check and the results here, in one function a reader (or a static walk) follows from
    the job's options into the engine."""
    place = LocalOutput()
    strategy = strategy_for(config)
    log = start_job(config, strategy, place, log)
    with locked_output(config, place, log) as (policy, meta):
        start, stop, total = input_range(config.input, config.format, config.encoding,
                                         config.shard, policy, align=strategy.align)
        apply_threads(config.threads)  # before the model loads; None: the cores actually free
        if config.quiet:
            quiet_transformers()
        try:
            strategy.load(policy, meta, log)
            check_runtime(policy, meta)
            check = strategy.self_check(policy, log)
        except BaseException:
            # The output is not touched before start_output: only the lock file is new here
            # (an unloadable model, other settings, Ctrl-C during the self-check).
            remove_lock(Path(config.output))
            raise
        if check is not None:
            meta["self_check"] = check
        start_output(policy, meta, log)

        # Resuming: read again from the first record of the chunk the run stopped in (a
        # chunked job recomputes its records in the same batches, writing only those after
        # the last one on disk), and check that the output's last record still has its id.
        first = (start // strategy.align) * strategy.align
        resume_check = resume_check_needed(policy)
        records: Iterable[Record | RecordError] = input_records(
            config, strategy, skip=min(first, start - 1) if resume_check else first, stop=stop,
            on_error="yield",  # strategy.results stops on an error if asked
            allow_empty=start > 0 or stop is not None,
        )
        if resume_check:
            records = checked_resume(records, policy.last, config.input_name, keep=True)
            records = (r for r in records if r.index >= first)  # the last may precede it

        summary = strategy.summary()
        try:
            return _write_results(config, strategy, policy, log, records, summary, start, total)
        except InputError:
            if nothing_written(policy, summary):
                remove_output(Path(config.output))  # nothing was written: leave nothing
            raise


class LocalOutput:
    """The output of a job run in this process (:func:`run_local`): a results file (JSONL or
    Parquet)."""

    def check(self, config: JobConfig) -> None:
        config.check()

    def target(self, config: JobConfig, log: Log) -> RunTarget:
        make_output_folder(config.output, log)
        return FileTarget(config.output)

    def layout_key(self, config: JobConfig) -> dict:
        return {}


def nothing_written(policy: OutputPolicy, summary: JobSummary) -> bool:
    """Whether a run's output holds nothing: new (not appended to) and no line written."""
    return not policy.append and summary.n == 0 and summary.skipped == 0


def remove_output(out: Path) -> None:
    """Remove a new output that holds nothing, its settings file and its lock file."""
    for p in (out, meta_path(out)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if output_format(out) == "parquet":
        remove_parquet_output(out)
    remove_lock(out)


def remove_lock(out: Path) -> None:
    """Remove ``out``'s lock file (held by this process: no other writer can be between
    taking it and now), so that a run that wrote nothing leaves no file behind."""
    with contextlib.suppress(FileNotFoundError):
        Path(f"{out}.lock").unlink()


def _write_results(config: JobConfig, strategy: JobStrategy, policy: OutputPolicy, log: Log,
                   records: Iterable[Record | RecordError], summary: JobSummary, start: int,
                   total: int) -> int:
    from icqs_fast.progress import track

    out = policy.out

    total //= getattr(strategy, "records_per_result", 1)  # e.g. two records make a pair

    def bar(results: Iterable) -> Iterable:
        return track(results, total=total if total >= 0 else None, desc=strategy.desc,
                     unit=getattr(strategy, "unit", "record"), quiet=config.quiet)

    with open_results(policy, schema=strategy.table_schema()) as writer:
        sink = ResultSink(writer, summary, skip=config.on_error == "skip", log=log)
        try:
            stream_results(strategy, records, sink, write_from=start, progress=bar)
        except InputError as exc:
            if not isinstance(exc, RecordError):  # the whole input (e.g. empty standard input)
                raise
            if nothing_written(policy, summary):
                raise  # the first record scored is the bad one: nothing to resume from
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
    if policy.append:  # the lines above cover this run only: say what the whole output holds
        log(strategy.output_summary(out))
    return 0
