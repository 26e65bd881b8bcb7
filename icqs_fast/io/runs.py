"""One output's run: the advisory lock, the output policy (new, resume or overwrite), the run
metadata and its settings check, and the input range a resumed or sharded run reads.

The same policy serves both kinds of output (:class:`RunTarget`): a results file
(:class:`FileTarget`: ``OUT`` + ``OUT.meta.json``, written by the local run) and a folder of
block files (:class:`icqs_fast.io.blocks.BlockOutput`: ``OUT/part-*`` + ``OUT/run.meta.json``,
written by ``--ray`` workers). What differs - where the metadata lives, what "already holds
results" means, what a resume cleans up - is the target's; the rules (refuse other settings,
refuse to replace without ``--overwrite``, write the metadata before the first result, check
dtype / device / backend once known) are here, once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from icqs_fast.io.arrow import dataset_files
from icqs_fast.io.files import write_whole
from icqs_fast.io.readers import count_records
from icqs_fast.io.records import (
    InputError,
    PathLike,
    Record,
    RecordError,
    detect_format,
    display_name,
    parse_shard,
    shard_range,
)
from icqs_fast.io.results import (
    JsonlWriter,
    ParquetResultWriter,
    ResumeState,
    output_exists,
    output_format,
    parquet_output,
    parts_dir,
    read_output_state,
    remove_parquet_output,
)


class OutputLockedError(ValueError):
    """Another process holds the output's lock (a usage error: exit code 2 in the CLI)."""


class OutputLock:
    """Advisory exclusive lock on an output file, held for the life of the writing process.

    ``fcntl.flock`` on ``OUT.lock`` (created next to the output, holding the holder's pid). The
    OS releases it when the process exits or crashes, so a stale lock never blocks anyone; the
    file itself stays (removing it would race with a process that just opened it) and means
    nothing when no process holds the lock. Only cooperating writers (icqs-fast commands)
    check it.

    Raises:
        OutputLockedError: from :meth:`acquire` when another process holds the lock (its pid
            is in the message).
    """

    def __init__(self, output: PathLike) -> None:
        self.output = os.fspath(output)
        self.path = self.output + ".lock"
        self._fd: int | None = None

    def acquire(self) -> OutputLock:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = os.read(fd, 64).decode("ascii", "replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "a process whose pid is not known yet"
            raise OutputLockedError(
                f"{self.output} is being written by another icqs-fast process ({who}; lock "
                f"{self.path}); wait for it to finish or stop it, or use another output"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def open_results(policy: OutputPolicy, *, schema: Any = None) -> JsonlWriter | ParquetResultWriter:
    """The writer of ``policy.out``: :class:`ParquetResultWriter` for ``.parquet``/``.pq`` (rows
    in ``schema``, the job's declared table schema, when given), else :class:`JsonlWriter`
    (appending when resuming)."""
    if output_format(policy.out) == "parquet":
        return ParquetResultWriter(policy.out, append=policy.append, schema=schema)
    return JsonlWriter(policy.out, append=policy.append)


# --------------------------------------------------------------------------- output runs
# What every command writing a results file shares (``score``, ``features``): the settings file
# ``OUT.meta.json`` (the resume fingerprint), the resume policy, skipped-record lines.


def meta_path(output: PathLike) -> Path:
    """The settings file written next to the results (``OUT.meta.json``)."""
    return Path(f"{os.fspath(output)}.meta.json")


def write_meta(output: PathLike, meta: dict) -> None:
    """Write ``OUT.meta.json`` whole, then rename it into place (a crash never leaves a
    half-written settings file)."""
    write_whole(meta_path(output), json.dumps(meta, indent=1) + "\n", fsync=True)


RUNTIME_KEYS = ("dtype", "device", "backend")


def check_run_paths(input: str, resume: bool, overwrite: bool, format: str | None = None
                    ) -> None:
    """The checks before an output is locked: the input exists and is a file (``"-"`` is
    standard input) or a dataset folder, and at most one of ``resume`` / ``overwrite``."""
    if input != "-" and not os.path.exists(input):
        raise FileNotFoundError(f"no such input file: {input}")
    if input != "-" and os.path.isdir(input):
        try:
            fmt = detect_format(input, format)
        except ValueError:
            fmt = None
        if fmt != "datasets":
            raise InputError(input, None, None, "is a folder, not an input file")
        dataset_files(input, input)
    if resume and overwrite:
        raise ValueError("choose at most one of --resume and --overwrite")


@runtime_checkable
class RunTarget(Protocol):
    """An output a run writes (see the module docstring).

    Attributes:
        name: the output as messages name it.
        held: what a new run without ``--overwrite`` is refused for (``"exists"``).
        runtime_later: the metadata is written before the runtime (dtype, device, backend) is
            known, so a resumed output may lack it (checked only where recorded).
    """

    name: str
    held: str
    runtime_later: bool

    def holds_results(self) -> bool:
        """Whether a new run would replace results there."""

    def present(self) -> bool:
        """Whether there is anything to resume."""

    def resume_state(self) -> ResumeState:
        """What is there (resuming)."""

    def read_meta(self) -> dict | None:
        """The metadata written by the run that started the output (None without one)."""

    def write_meta(self, meta: dict) -> None:
        """Write the metadata whole."""

    def clear(self) -> None:
        """Empty the output for a new run (before its metadata is written)."""

    def reopen(self, policy: OutputPolicy, log: Callable[..., None]) -> None:
        """Make a resumed output ready to be continued (drop what a crash left unfinished)."""

    def lock(self) -> Any:
        """A context manager holding the output for this process."""


class FileTarget:
    """A results file (JSONL or Parquet, :func:`open_results`) and its ``OUT.meta.json``."""

    held = "exists"
    runtime_later = False

    def __init__(self, out: PathLike) -> None:
        self.out = Path(out)
        self.name = os.fspath(out)

    def holds_results(self) -> bool:
        return output_exists(self.out)

    def present(self) -> bool:
        return self.out.exists() or output_exists(self.out)

    def resume_state(self) -> ResumeState:
        return read_output_state(self.out)

    def read_meta(self) -> dict | None:
        mp = meta_path(self.out)
        return json.loads(mp.read_text(encoding="utf-8")) if mp.is_file() else None

    def write_meta(self, meta: dict) -> None:
        write_meta(self.out, meta)

    def clear(self) -> None:
        if output_format(self.out) == "parquet":
            remove_parquet_output(self.out)
        else:
            with open(self.out, "wb"):
                pass

    def reopen(self, policy: OutputPolicy, log: Callable[..., None]) -> None:
        out, state = self.out, policy.state
        assert state is not None
        if state.format == "parquet":
            st = parquet_output(out)
            for p in st.stale:  # merged into OUT by a run that crashed before removing them
                p.unlink()
            tmps = [p for p in (parts_dir(out).iterdir() if parts_dir(out).is_dir() else [])
                    if p.name.endswith(".tmp")] + [p for p in [Path(f"{out}.tmp")] if p.exists()]
            for p in tmps:
                p.unlink()
            if st.stale or tmps:
                log(f"icqs-fast: removed {len(st.stale)} already merged and {len(tmps)} "
                    f"unfinished part file(s) of {out}")
        elif out.stat().st_size != state.end:
            with open(out, "r+b") as f:  # drop a record cut off mid-write
                f.truncate(state.end)
            log(f"icqs-fast: removed an incomplete last line from {out}")
        log(f"icqs-fast: resuming {out}: {state.count} records there, continuing at input "
            f"record {policy.start}")

    def lock(self) -> OutputLock:
        return OutputLock(self.out)


def as_target(out: PathLike | RunTarget) -> RunTarget:
    """``out`` as a :class:`RunTarget` (a path: its :class:`FileTarget`)."""
    return out if isinstance(out, RunTarget) else FileTarget(out)


@dataclass
class OutputPolicy:
    """How a run treats its output (from :func:`output_policy`).

    Attributes:
        out: the output, as messages name it (the results file, or the block folder).
        append: resuming an existing output (else it is emptied by :func:`start_output`).
        start: the first input record index to write (0 unless resuming).
        last: the last complete record already there (None if none).
        state: what the existing output holds (resuming only).
        old: the settings in its metadata (None without one), as ``upgrade`` of
            :func:`output_policy` reads them (an earlier version's in today's terms).
        target: the output (:class:`RunTarget`; default: the file ``out``).
        labels: how a refusal names each key of the resume key (its flag; default: the key).
            The runtime keys (:func:`check_runtime`) keep their names: their values are
            resolved (dtype "bfloat16" for ``--dtype auto``), not an option's.
    """

    out: Path | str
    append: bool = False
    start: int = 0
    last: dict | None = None
    state: ResumeState | None = None
    old: dict | None = None
    target: Any = None
    labels: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = FileTarget(self.out)


def resume_refusal(out: PathLike, old: dict, new: dict, keys: Iterable[str],
                   labels: Mapping[str, str] | None = None) -> ValueError | None:
    """The refusal of a resume whose ``keys`` differ between the output's settings ``old``
    and this run's ``new`` (None when they match); ``labels`` names a key in the message (the
    option's flag, given by the job's declarations; default: the key; ``resume`` and
    ``overwrite``: the job's own options, default ``--resume`` / ``--overwrite``)."""
    diff = sorted(k for k in keys if old.get(k) != new[k])
    if not diff:
        return None
    name = (labels or {}).get
    what = ", ".join(f"{name(k, k)}: {old[k]!r} there, {new[k]!r} now" if k in old else
                     f"{name(k, k)}: not recorded there" for k in diff)
    return ValueError(f"cannot {name('resume', '--resume')} {os.fspath(out)}: it was written "
                      f"with other settings ({what}); use another output or "
                      f"{name('overwrite', '--overwrite')}")


def output_policy(out: PathLike | RunTarget, meta: dict, *, resume: bool, overwrite: bool,
                upgrade: Callable[[dict], dict] | None = None,
                labels: Mapping[str, str] | None = None) -> OutputPolicy:
    """Decide, before the model is loaded (to fail fast), what to do with ``out`` (a results
    file's path, or a :class:`RunTarget`).

    With ``resume`` and an existing output: where to continue, after checking that every key of
    ``meta`` matches its metadata (read through ``upgrade``, which puts the metadata of an
    output written by an earlier version in today's terms). Without: an existing non-empty
    output is only replaced with ``overwrite``. ``labels``: how a refusal names each key.

    Raises:
        ValueError: other settings there, or an existing output without ``--resume`` /
            ``--overwrite``.
        InputError: an output that is not a results file.
    """
    target = as_target(out)
    name = target.out if isinstance(target, FileTarget) else target.name
    if resume and target.present():
        state = target.resume_state()
        old = target.read_meta()
        if old is not None:
            old = upgrade(old) if upgrade is not None else old
            err = resume_refusal(target.name, old, meta, meta, labels)
            if err is not None:
                raise err
        last = state.last
        return OutputPolicy(name, append=True, start=last["index"] + 1 if last is not None else 0,
                          last=last, state=state, old=old, target=target, labels=labels)
    if target.holds_results() and not overwrite and not resume:
        name = (labels or {}).get
        raise ValueError(f"{target.name} {target.held}; pass {name('resume', '--resume')} to "
                         f"continue it or {name('overwrite', '--overwrite')} to replace it")
    return OutputPolicy(name, target=target, labels=labels)


def resumed_meta(policy: OutputPolicy | None) -> dict | None:
    """The metadata of the output a run resumes (its ``OUT.meta.json``); None for a new run
    (``policy`` None: no output, as ``icqs-fast check`` runs)."""
    return policy.old if policy is not None and policy.append else None


def resumed_dtype(policy: OutputPolicy | None, dtype: str) -> str:
    """The dtype a run loads its model in: ``dtype``, except that ``"auto"`` resuming an output
    takes the dtype that output was written with (an output started before ``auto`` chose
    bf16 on this CPU, or on a CPU of another kind, resumes in its own dtype instead of being
    refused)."""
    old = resumed_meta(policy)
    if dtype == "auto" and old and isinstance(old.get("dtype"), str):
        return old["dtype"]
    return dtype


def check_runtime(policy: OutputPolicy, meta: dict, *, keys: Iterable[str] = RUNTIME_KEYS
                  ) -> None:
    """After the model is loaded: a resumed output must have been written with the same
    ``keys`` (default :data:`RUNTIME_KEYS`: dtype, device, backend) as ``meta``
    (ValueError otherwise). An output whose metadata is written before the runtime is known
    (a block folder) is checked on the keys it records."""
    if policy.old is not None:
        keys = [k for k in keys if k in policy.old or not policy.target.runtime_later]
        err = resume_refusal(policy.out, policy.old, meta, keys)
        if err is not None:
            raise err


def start_output(policy: OutputPolicy, meta: dict, log: Callable[..., None]) -> None:
    """Make the output ready for writing: when resuming, drop what a crash left unfinished
    (a JSONL record cut off mid-write, unfinished Parquet parts or blocks); else empty it,
    then write its metadata (a crash in between leaves an empty output, never old records
    under new settings)."""
    if policy.append:
        policy.target.reopen(policy, log)
    else:
        policy.target.clear()
        policy.target.write_meta(meta)


def resume_check_needed(policy: OutputPolicy) -> bool:
    """Whether the resumed output's last record has an id to compare with the input's record
    at that index (a skipped record's line has none)."""
    last = policy.last
    return last is not None and "id" in last and "error" not in last


def checked_resume(records: Iterator[Record | RecordError], last: dict, path: str, *,
                   keep: bool = False) -> Iterator[Record | RecordError]:
    """Pass ``records`` through, checking that the record at ``last["index"]`` (the output's
    last record) still has ``last["id"]``; that record is dropped unless ``keep``.

    Raises:
        ValueError: it has another id, or is now a bad record (the input changed).
    """
    pending = True
    for rec in records:
        if pending and rec.index >= last["index"]:
            pending = False
            if rec.index == last["index"]:
                if isinstance(rec, RecordError) or rec.id != last["id"]:
                    got = "is now a bad record" if isinstance(rec, RecordError) else \
                        f"has id {rec.id!r}"
                    raise ValueError(
                        f"cannot --resume: {path}:{rec.line} (record {rec.index}) {got} but the "
                        f"output's last record has id {last['id']!r}; the input changed since "
                        "the output was written")
                if not keep:
                    continue
        yield rec


def input_range(input: str, format: str | None, encoding: str, shard: str | None,
                policy: OutputPolicy, *, align: int = 1) -> tuple[int, int | None, int]:
    """For a command with ``--shard`` (``shard`` = "I/N"): ``(start, stop, total)``, the input
    records this run reads - its shard's range (:func:`shard_range`, boundaries multiples of
    ``align``), started after what a resumed output holds - and the number of records it will
    write (for the progress bar; -1 when unknown). Without ``--shard``: ``(policy.start, None,
    n)``, ``n`` known only for Parquet / datasets inputs (counting a text file would read it
    twice)."""
    fmt = detect_format(input, format) if input != "-" else "jsonl"
    if shard is None:
        total = -1
        if fmt in ("parquet", "datasets"):
            total = max(0, count_records(input, format=format) - policy.start)
        return policy.start, None, total
    i, n = parse_shard(shard)
    total = count_records(input, format=format, encoding=encoding)
    if total == 0:
        raise InputError(display_name(input), None, None, "no records (nothing to shard)")
    lo, hi = shard_range(total, i, n, align)
    start = max(lo, policy.start)
    if policy.last is not None and not lo <= policy.last["index"] < hi:
        raise ValueError(f"cannot --resume {policy.out}: its last record {policy.last['index']} is "
                         f"outside shard {shard} (records {lo}..{hi - 1})")
    return start, hi, max(0, hi - start)
