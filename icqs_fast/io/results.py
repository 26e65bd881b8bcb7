"""Result writers: JSONL (one ``write`` per line), Parquet (committed part files merged on
close) and a block (:class:`BlockWriter`: one ``--ray`` block file, the same lines or the same
table written whole), and reading back what an output already holds (for ``--resume``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icqs_fast.io.records import PARQUET_SUFFIXES, InputError, PathLike, RecordError
from icqs_fast.io.schema import rows_table

# --------------------------------------------------------------------------- results


class JsonlWriter:
    """Append-or-create JSONL writer; each record is one line written with a single ``write``.

    What a crash (even SIGKILL or power loss) can leave: every record whose ``write`` returned,
    then at most one incomplete last line (no newline), which :func:`read_resume_state` finds
    and a resume truncates away. Records go to the OS at once (no user-space buffer, so another
    process reads them immediately); ``os.fsync`` runs every ``fsync_every`` seconds and on
    close, so a machine crash loses at most that many seconds of records, and never leaves a
    half-written record before a complete one.

    Args:
        path: output file; parent folders are created.
        append: append to an existing file instead of truncating it.
        fsync_every: seconds between ``os.fsync`` calls (0: after every record).
    """

    def __init__(self, path: PathLike, *, append: bool = False, fsync_every: float = 5.0
                 ) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._fsync_every = fsync_every
        self._last_sync = time.monotonic()
        self.count = 0

    def write(self, record: dict) -> None:
        """Append ``record`` as one JSON line (:func:`json_line`)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: writer is closed")
        view = memoryview(json_line(record))
        while view:  # a regular file takes it in one call; loop only for a short write
            view = view[os.write(self._fd, view):]
        self.count += 1
        now = time.monotonic()
        if now - self._last_sync >= self._fsync_every:
            os.fsync(self._fd)
            self._last_sync = now

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def json_line(record: dict) -> bytes:
    """``record`` as one UTF-8 JSON line, newline included, as :class:`JsonlWriter` writes it
    (non-ASCII text kept as is; NaN / inf as JSON5-style literals)."""
    return (json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n").encode("utf-8")


@dataclass
class ResumeState:
    """What an existing output holds: ``last`` is the last complete record (None if none),
    ``count`` the number of complete records (blocks for a block folder), ``end`` the byte
    offset just after it (JSONL; 0 otherwise), ``format`` the output's format (``"jsonl"``,
    ``"parquet"`` or ``"blocks"``), ``blocks`` the names of a block folder's complete block
    files."""

    last: dict | None
    count: int
    end: int
    format: str = "jsonl"
    blocks: tuple[str, ...] = ()


def read_resume_state(path: PathLike) -> ResumeState:
    """Scan a results JSONL file written by :class:`JsonlWriter`.

    A trailing line that is incomplete (no newline, or not valid JSON: a write cut off by a
    crash) is not counted; ``end`` stops before it so the caller can truncate it away. A bad
    line followed by good ones is an error (the file is not ours, or was edited).
    """
    name = os.fspath(path)
    last, count, end, pos = None, 0, 0, 0
    bad_line = None
    with open(name, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            pos += len(raw)
            if not raw.strip():
                if bad_line is None:
                    end = pos
                continue
            obj = None
            if raw.endswith(b"\n"):
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    obj = None
            if not isinstance(obj, dict) or "index" not in obj:
                bad_line = bad_line or lineno
                continue
            if bad_line is not None:
                raise InputError(name, bad_line, None,
                                 "not a complete result record, but more records follow it; "
                                 "cannot resume this file")
            last, count, end = obj, count + 1, pos
    return ResumeState(last=last, count=count, end=end)


# --------------------------------------------------------------------------- Parquet results
# A Parquet file is only readable once its footer is written, so a results file written in one
# piece would be lost whole by a crash. Instead records are committed in part files, each a
# complete Parquet file written to a temporary name, fsynced and renamed into OUT.parts/ (named
# by the first record's index); on close, OUT (if any) and the parts are merged, row group by
# row group, into OUT.tmp, which is fsynced and renamed over OUT, and then OUT.parts/ is removed.
# What a crash (even SIGKILL or a power cut) leaves: OUT as last closed plus the committed parts;
# a part not yet renamed is ignored, a part already merged into OUT (a crash between the rename
# and the removal) is recognised by its index and dropped. A resume therefore loses at most the
# records not yet committed: fewer than PARQUET_PART_ROWS records or PARQUET_COMMIT_SECONDS
# seconds of work, which it computes again. Every close rewrites OUT whole (a resumed run pays
# one copy of what was there).

PARQUET_PART_ROWS = 1000
PARQUET_COMMIT_SECONDS = 30.0
PARQUET_ROW_GROUP_ROWS = 8192
_PART_PREFIX = "part-"


def output_format(out: PathLike) -> str:
    """``"parquet"`` for a ``.parquet`` / ``.pq`` output, else ``"jsonl"``."""
    return "parquet" if os.fspath(out).lower().endswith(PARQUET_SUFFIXES) else "jsonl"


def parts_dir(out: PathLike) -> Path:
    """The folder of a Parquet output's committed parts (``OUT.parts``)."""
    return Path(f"{os.fspath(out)}.parts")


def fsync_path(path: PathLike) -> None:
    """fsync a file or a folder (a folder: so a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _part_index(path: Path) -> int:
    return int(path.name[len(_PART_PREFIX):-len(".parquet")])


def _committed_parts(out: PathLike) -> list[Path]:
    d = parts_dir(out)
    if not d.is_dir():
        return []
    parts = [p for p in d.iterdir() if p.name.startswith(_PART_PREFIX)
             and p.name.endswith(".parquet") and p.name[len(_PART_PREFIX):-8].isdigit()]
    return sorted(parts, key=_part_index)


def _last_row(path: Path) -> dict | None:
    """The last row of a Parquet file as a dict without its null fields (None if no rows)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as pf:
        for g in range(pf.metadata.num_row_groups - 1, -1, -1):
            if pf.metadata.row_group(g).num_rows:
                t = pf.read_row_group(g)
                row = t.slice(t.num_rows - 1).to_pylist()[0]
                return {k: v for k, v in row.items() if v is not None}
    return None


@dataclass
class _ParquetOutput:
    main: Path | None  # OUT, when it exists
    parts: list[Path]  # committed parts not yet merged, in order
    stale: list[Path]  # parts already merged into OUT (left by a crash after the rename)
    last: dict | None
    count: int


def parquet_output(out: PathLike) -> _ParquetOutput:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    main = out if out.exists() else None
    last, count = None, 0
    live: list[Path] = []
    stale: list[Path] = []
    for p in ([main] if main else []) + _committed_parts(out):
        if p is not main and last is not None and _part_index(p) <= last.get("index", -1):
            stale.append(p)
            continue
        try:
            n = pq.read_metadata(p).num_rows
            row = _last_row(p)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(p, None, None, f"not a readable Parquet results file ({exc}); "
                             "cannot resume it") from None
        if row is not None and not isinstance(row.get("index"), int):
            raise InputError(p, None, "index", "not a results file (no integer index column)")
        if p is not main:
            live.append(p)
        count += n
        last = row if row is not None else last
    return _ParquetOutput(main, live, stale, last, count)


def read_parquet_state(path: PathLike) -> ResumeState:
    """What a Parquet results output holds (``OUT`` plus its committed parts, see
    :class:`ParquetResultWriter`): the last record (its null fields left out, as absent keys of
    a JSONL record) and the number of records."""
    st = parquet_output(path)
    return ResumeState(last=st.last, count=st.count, end=0, format="parquet")


def read_output_state(path: PathLike) -> ResumeState:
    """:func:`read_resume_state` (JSONL) or :func:`read_parquet_state`, by extension."""
    if output_format(path) == "parquet":
        return read_parquet_state(path)
    return read_resume_state(path)


def output_exists(out: PathLike) -> bool:
    """Whether ``out`` holds results a new run would replace (a non-empty JSONL file; a Parquet
    file or committed parts)."""
    out = Path(out)
    if output_format(out) == "parquet":
        return out.exists() or bool(_committed_parts(out))
    return out.exists() and out.stat().st_size > 0


def records_table(records: list[dict]) -> Any:
    """A ``pyarrow.Table`` of result records: one column per key (first-seen order, ``error``
    last), types inferred from all values, absent keys null."""
    import pyarrow as pa

    keys: dict[str, None] = {}
    for r in records:
        for k in r:
            keys.setdefault(k, None)
    order = [k for k in keys if k != "error"] + (["error"] if "error" in keys else [])
    # Fixed types for the fields every results file shares, so that a part where they happen
    # to be all null (no bad record's field named) still has the type of the others.
    known = {"index": pa.int64(), "line": pa.int64(),
             "error": pa.struct([("field", pa.string()), ("reason", pa.string())])}
    cols = {}
    for k in order:
        try:
            cols[k] = pa.array([r.get(k) for r in records], type=known.get(k))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise ValueError(f"result field {k!r} cannot be one Parquet column (records "
                             f"{records[0].get('index')}..{records[-1].get('index')}: {exc}); "
                             "write JSONL output instead") from None
    return pa.table(cols)


def results_table(records: list[dict], schema: Any = None) -> Any:
    """The ``pyarrow.Table`` of result records as every Parquet writer writes it: in the job's
    declared ``schema`` (:func:`icqs_fast.io.schema.rows_table`) when given, else with the
    types inferred from the records (:func:`records_table`)."""
    if schema is None:
        return records_table(records)

    return rows_table(records, schema)


def write_parquet_table(sink: Any, table: Any) -> None:
    """``table`` as one Parquet file at ``sink`` (a path or a ``pyarrow`` output stream): how a
    part of :class:`ParquetResultWriter` and a Parquet :class:`BlockWriter` block are written."""
    import pyarrow.parquet as pq

    with pq.ParquetWriter(sink, table.schema) as w:
        w.write_table(table)


def _conform(table: Any, schema: Any) -> Any:
    """``table`` with ``schema``'s columns, in its order (absent ones null), cast to its types."""
    import pyarrow as pa

    cols = [table.column(f.name).cast(f.type) if f.name in table.column_names
            else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def _unify(schemas: list[Any], where: str) -> Any:
    import pyarrow as pa

    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ValueError(f"{where}: results whose columns change type cannot be one Parquet file "
                         f"({exc}); write JSONL output instead") from None


class ParquetResultWriter:
    """Parquet results written as they stream, crash-safe and resumable (see the section comment
    above: committed part files in ``OUT.parts/``, merged into ``OUT`` on close).

    Records are buffered and committed as one part every ``part_rows`` records or
    ``commit_every`` seconds, whichever comes first; each part is one row group written with
    ``pyarrow.parquet.ParquetWriter``. With ``schema`` (what ``score`` and ``features`` pass:
    the job's declared table schema, :func:`icqs_fast.io.schema.arrow_schema`) every part and
    the merged file have exactly that schema (``id`` / ``label`` as text), the one the
    ``--ray`` blocks of the same job have; without, column types are inferred from the records
    and a column that changes type (an ``id`` that is a number in one record and a string in
    another) is a ValueError at the commit that meets it. Records must carry an integer
    ``index`` that increases (the results of ``score`` / ``features`` do).

    Args:
        path: the output (``.parquet``); parent folders are created.
        append: continue an existing output (its file and committed parts are kept).
        part_rows, commit_every: when a part is committed (records, seconds).
        row_group_rows: rows per row group of the merged ``OUT``.
        schema: the table schema (``pyarrow.Schema``); None: inferred.
    """

    def __init__(self, path: PathLike, *, append: bool = False,
                 part_rows: int = PARQUET_PART_ROWS, commit_every: float = PARQUET_COMMIT_SECONDS,
                 row_group_rows: int = PARQUET_ROW_GROUP_ROWS, schema: Any = None) -> None:
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.parts = parts_dir(path)
        if self.path.parent:
            os.makedirs(self.path.parent, exist_ok=True)
        if not append:
            remove_parquet_output(self.path)
        os.makedirs(self.parts, exist_ok=True)
        st = parquet_output(self.path)
        self._last_index = st.last["index"] if st.last else None
        srcs = ([st.main] if st.main else []) + st.parts
        self._declared = schema
        self._schema = schema if schema is not None else \
            _unify([pq.read_schema(p) for p in srcs], os.fspath(self.path)) if srcs else None
        self._buf: list[dict] = []
        self._part_rows = max(1, part_rows)
        self._commit_every = commit_every
        self._row_group_rows = max(1, row_group_rows)
        self._last_commit = time.monotonic()
        self._closed = False
        self.count = 0

    @property
    def pending(self) -> int:
        """Records written but not committed yet (the last ``pending`` of ``count``)."""
        return len(self._buf)

    def write(self, record: dict) -> None:
        """Buffer ``record``; commit a part when it is due."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        idx = record.get("index")
        if not isinstance(idx, int) or (self._last_index is not None and idx <= self._last_index):
            raise ValueError(f"{self.path}: results need increasing integer indices, got {idx!r} "
                             f"after {self._last_index!r}")
        self._buf.append(record)
        self._last_index = idx
        self.count += 1
        if (len(self._buf) >= self._part_rows
                or time.monotonic() - self._last_commit >= self._commit_every):
            self.commit()

    def commit(self) -> None:
        """Write the buffered records as one part (temporary name, fsync, rename, fsync the
        folder): once this returns they survive a crash."""
        self._last_commit = time.monotonic()
        if not self._buf:
            return
        table = results_table(self._buf, self._declared)
        schema = self._declared if self._declared is not None else \
            table.schema if self._schema is None else \
            _unify([self._schema, table.schema], os.fspath(self.path))
        name = f"{_PART_PREFIX}{self._buf[0]['index']:012d}.parquet"
        tmp = self.parts / f".{name}.tmp"
        self.write_part(tmp, table)
        fsync_path(tmp)
        os.replace(tmp, self.parts / name)
        fsync_path(self.parts)
        self._schema = schema
        self._buf.clear()

    def write_part(self, path: Path, table: Any) -> None:
        """Write ``table`` (a ``pyarrow.Table``) as one Parquet file at ``path``: a part under
        its temporary name, which :meth:`commit` then fsyncs and renames into place."""
        write_parquet_table(path, table)

    def close(self) -> None:
        """Commit what is buffered, then merge ``OUT`` and the parts into ``OUT``."""
        if self._closed:
            return
        self.commit()
        self._closed = True
        merge_parquet_output(self.path, row_group_rows=self._row_group_rows,
                             schema=self._declared)

    def __enter__(self) -> ParquetResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BlockWriter:
    """The writer of one ``--ray`` block (``OUT/part-KKKKKK.<fmt>``): the rows the local
    writers write, in the same form - JSONL lines of :func:`json_line` (so ``cat
    OUT/part-*.jsonl`` is the single-process file), or one Parquet table built by
    :func:`results_table` (the declared ``schema``: a block reads as a part of a local ``-o
    X.parquet``) - buffered and handed whole to ``sink`` on :meth:`close` (a block file exists
    only once complete: :meth:`icqs_fast.io.blocks.BlockOutput.write_bytes`).

    Args:
        sink: called once with the encoded block (bytes).
        fmt: ``"jsonl"`` or ``"parquet"``.
        schema: the Parquet table schema (``pyarrow.Schema``); None: inferred.
    """

    def __init__(self, sink: Callable[[bytes], None], fmt: str, *, schema: Any = None) -> None:
        if fmt not in ("jsonl", "parquet"):
            raise ValueError(f"a block is jsonl or parquet, got {fmt!r}")
        self._sink, self.format, self._schema = sink, fmt, schema
        self._rows: list[dict] = []
        self._closed = False
        self.count = 0

    def write(self, record: dict) -> None:
        """Add ``record`` to the block."""
        if self._closed:
            raise ValueError("block writer is closed")
        self._rows.append(record)
        self.count += 1

    def close(self) -> None:
        """Encode the block and hand it to the sink (once)."""
        if self._closed:
            return
        self._closed = True
        if self.format == "jsonl":
            self._sink(b"".join(json_line(r) for r in self._rows))
            return
        import pyarrow as pa

        buf = pa.BufferOutputStream()
        write_parquet_table(buf, results_table(self._rows, self._schema))
        self._sink(buf.getvalue().to_pybytes())

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:  # a block that failed is not written at all
            self.close()
        self._closed = True


def remove_parquet_output(out: Path) -> None:
    for p in (out, Path(f"{out}.tmp")):
        if p.exists():
            p.unlink()
    if parts_dir(out).exists():
        shutil.rmtree(parts_dir(out))


def merge_parquet_output(out: PathLike, *, row_group_rows: int = PARQUET_ROW_GROUP_ROWS,
                         schema: Any = None) -> None:
    """Merge a Parquet output's committed parts into ``OUT`` (streamed row group by row group:
    memory holds about ``row_group_rows`` rows), atomically, and remove ``OUT.parts``. The
    result has ``schema`` when given (an output resumed from an older layout is cast to it),
    else the parts' unified schema; without any record at all and no schema, ``OUT`` is an
    empty table with ``index`` and ``line`` columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    st = parquet_output(out)
    if st.parts or st.main is None:
        srcs = ([st.main] if st.main else []) + st.parts
        if schema is None:
            schema = _unify([pq.read_schema(p) for p in srcs], os.fspath(out)) if srcs else \
                pa.schema([("index", pa.int64()), ("line", pa.int64())])
        tmp = Path(f"{out}.tmp")
        with pq.ParquetWriter(tmp, schema) as w:
            pending: list[Any] = []
            n = 0
            for src in srcs:
                with pq.ParquetFile(src) as pf:
                    for g in range(pf.metadata.num_row_groups):
                        t = _conform(pf.read_row_group(g), schema)
                        pending.append(t)
                        n += t.num_rows
                        if n >= row_group_rows:  # whole row groups out, the rest carried
                            full = (n // row_group_rows) * row_group_rows
                            big = pa.concat_tables(pending)
                            w.write_table(big.slice(0, full), row_group_size=row_group_rows)
                            pending, n = [big.slice(full)], n - full
            if n or not srcs:
                w.write_table(pa.concat_tables(pending) if n else schema.empty_table())
        fsync_path(tmp)
        os.replace(tmp, out)
        fsync_path(out.parent if str(out.parent) else Path("."))
    if parts_dir(out).exists():
        shutil.rmtree(parts_dir(out))


def skipped_record(err: RecordError) -> dict:
    """The output line of a bad record skipped with ``--on-error skip``: ``index``, ``line``
    and ``error`` (``field``, ``reason``); it keeps the record's place in the output, so a
    resume neither redoes nor loses it."""
    return {"index": err.index, "line": err.line,
            "error": {"field": err.field, "reason": err.reason}}
