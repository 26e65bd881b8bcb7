"""Reading responses and demonstrations from files, and writing results, lazily.

* :func:`read_records` streams :class:`Record` s from JSONL, CSV or TSV (optionally gzipped),
  Parquet files and Hugging Face ``datasets`` folders (``Dataset.save_to_disk``): one row (or
  one record batch of :data:`ARROW_BATCH_ROWS` rows) at a time, so a file of millions of rows
  is never held in memory. Field names are mapped (``x_field``, ``y_field``, ``id_field``,
  ``label_field``). :func:`count_records` counts records the same way; :func:`shard_range`
  and :func:`parse_shard` split an input into contiguous ranges for ``--shard i/n``.
* :func:`read_json_objects` / :func:`field_of` read JSONL files with their own schema (MT-Bench)
  with the same errors; :func:`read_rows` reads any supported format that way (``rank``).
* :func:`read_examples` reads a (small) good or bad demonstration file into ``(x, y)`` pairs.
* :func:`read_fpb` / :func:`fpb_examples` read the Financial PhraseBank ``sentence@label``
  format and build good (correct label) / bad (flipped label) demonstrations from it.
* :class:`JsonlWriter` writes one JSON object per line, each with a single ``write`` (so a crash
  leaves at most one incomplete last line, which :func:`read_resume_state` detects).
  :class:`ParquetResultWriter` writes ``.parquet`` results as committed part files merged into
  one file on close (see its docstring for what a crash keeps); :func:`open_results` picks the
  writer from the output's extension.
* :class:`OutputLock` is an advisory lock (``fcntl.flock`` on ``OUT.lock``) held by the process
  writing an output, so a second writer refuses at once.

Every problem with the input raises :class:`InputError` (a ``ValueError``) whose message names
the file, the line and the field, e.g. ``data.jsonl:17: field 'y': missing (keys: x, id)``
(for Parquet files and dataset folders, the 1-based row: ``data.parquet: row 17: ...``);
a problem with one record is a :class:`RecordError` (an ``InputError`` that also carries the
record's index), which per-record error handling uses instead of reading message text.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import gzip
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMATS = ("jsonl", "csv", "tsv", "parquet", "datasets")
TEXT_FORMATS = ("jsonl", "csv", "tsv")
# Rows per record batch read from Parquet / Arrow: what is held at once (as Python objects).
ARROW_BATCH_ROWS = 1024
# A JSONL line longer than this is a bad record (read in bounded pieces, never held whole): one
# record of a scoring file is a prompt and a response, and a multi-megabyte line is almost always
# a broken export (a whole file on one line) that would otherwise be tokenised for minutes.
MAX_LINE_BYTES = 1 << 20
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
               ".parquet": "parquet", ".pq": "parquet"}
_PARQUET_SUFFIXES = (".parquet", ".pq")

PathLike = str | os.PathLike


class InputError(ValueError):
    """A problem with one place of an input file.

    Attributes:
        path: the file (``"<stdin>"`` for standard input).
        line: 1-based line number where the record starts (None for a whole-file problem); for
            a Parquet file or a dataset folder, the 1-based row number (the message then says
            ``path: row N`` instead of ``path:N``).
        field: the field concerned (None when the problem is not about one field).
        reason: what is wrong, without the location.
    """

    def __init__(self, path: PathLike, line: int | None, field: str | None, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.field = field
        self.reason = reason
        if line is None:
            where = self.path
        elif _row_source(self.path):
            where = f"{self.path}: row {line}"
        else:
            where = f"{self.path}:{line}"
        what = f"field {field!r}: {reason}" if field is not None else reason
        super().__init__(f"{where}: {what}")


def _row_source(path: str) -> bool:
    """Whether ``path`` is read by rows rather than lines (Parquet, a dataset folder)."""
    return path.lower().endswith(_PARQUET_SUFFIXES) or os.path.isdir(path)


class RecordError(InputError):
    """A problem with one record (the rest of the file can still be read).

    Attributes:
        index: 0-based record index (counted as in :class:`Record`; bad records count too).
        path, line, field, reason: as in :class:`InputError`.
    """

    def __init__(self, path: PathLike, line: int | None, field: str | None, reason: str, *,
                 index: int) -> None:
        super().__init__(path, line, field, reason)
        self.index = index


@dataclass
class Record:
    """One response read from a file.

    Attributes:
        index: 0-based position among the file's records (data rows; bad rows count too, so an
            index always means the same row whatever rows were skipped).
        line: 1-based line number where the record starts (Parquet / datasets: the 1-based row
            number, ``index + 1``).
        x, y: the prompt and the response to score.
        id: the record's id field, if the file has one (any JSON scalar; str for CSV/TSV).
        label: the label field, if asked for (e.g. a gold label or "good"/"bad").
    """

    index: int
    line: int
    x: str
    y: str
    id: Any = None
    label: Any = None


def detect_format(path: PathLike, format: str | None = None) -> str:
    """``format`` if given, else from the extension (``.jsonl``/``.ndjson``/``.csv``/``.tsv``,
    optionally followed by ``.gz``; ``.parquet``/``.pq``), or ``"datasets"`` for a folder
    whose name has none of these extensions (a ``Dataset.save_to_disk`` folder)."""
    if format is not None:
        f = format.lower()
        if f in ("ndjson", "json-lines"):
            f = "jsonl"
        if f in ("hf", "arrow"):
            f = "datasets"
        if f not in FORMATS:
            raise ValueError(f"unknown input format {format!r}; use one of {', '.join(FORMATS)}")
        return f
    name = os.fspath(path)
    if name == "-":
        return "jsonl"
    p = Path(name.lower())
    suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
    if suffix not in _EXTENSIONS and os.path.isdir(name):
        return "datasets"
    if suffix not in _EXTENSIONS:
        raise ValueError(
            f"{name}: cannot tell the format from the extension {suffix or '(none)'!r}; "
            f"use .jsonl, .csv or .tsv (optionally .gz), .parquet, a datasets folder, or pass "
            "the format explicitly"
        )
    if p.suffix == ".gz" and _EXTENSIONS[suffix] == "parquet":
        raise ValueError(f"{name}: a Parquet file is compressed inside; it cannot be .gz")
    return _EXTENSIONS[suffix]


def _open_binary(path: PathLike) -> IO[bytes]:
    name = os.fspath(path)
    if name == "-":
        return sys.stdin.buffer
    if name.lower().endswith(".gz"):
        return gzip.open(name, "rb")
    return open(name, "rb")


def _display(path: PathLike) -> str:
    return "<stdin>" if os.fspath(path) == "-" else os.fspath(path)


def _get(obj: dict, field: str) -> tuple[bool, Any]:
    """``obj[field]``, or a dotted path (``"a.b.0"``) into nested objects/lists."""
    if field in obj:
        return True, obj[field]
    if "." not in field:
        return False, None
    cur: Any = obj
    for part in field.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(
                cur):
            cur = cur[int(part)]
        else:
            return False, None
    return True, cur


def _keys(row: dict) -> str:
    ks = [str(k) for k in row if k is not None]
    return ", ".join(ks[:12]) + (", ..." if len(ks) > 12 else "") if ks else "none"


def _raw_lines(f: IO[bytes], limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes, length) per physical line; bytes is None for a line longer than
    ``limit`` (read and dropped piece by piece, so it is never held in memory)."""
    lineno = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield lineno, raw, len(raw)
            continue
        n = len(raw)
        while not raw.endswith(b"\n"):
            raw = f.readline(1 << 16)
            if not raw:
                break
            n += len(raw)
        yield lineno, None, n


def _undecodable(exc: UnicodeDecodeError, encoding: str) -> str:
    bad = exc.object[exc.start:exc.start + 1]
    return (f"not valid {encoding} text (byte 0x{bad.hex()} at byte {exc.start + 1} of the "
            "line); pass the right encoding (--encoding)")


def _bad_field(obj: Any, prefix: str = "") -> str | None:
    """The first (dotted) field of a JSON value decoded with surrogateescape that holds an
    undecodable byte (a lone surrogate), or None."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            if _has_surrogate(str(k)):
                return name
            sub = _bad_field(v, name + ".")
            if sub is not None:
                return sub
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            sub = _bad_field(v, f"{prefix}{i}.")
            if sub is not None:
                return sub
    elif isinstance(obj, str) and _has_surrogate(obj):
        return prefix[:-1]
    return None


def _has_surrogate(s: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in s)


def _jsonl_rows(f: IO[bytes], name: str, skip: int, encoding: str, max_line_bytes: int
                ) -> Iterator[tuple[int, int, Any]]:
    """(index, line, object) per non-blank line; the object is None for the first ``skip``
    records (counted, not parsed) and a :class:`RecordError` for a bad line (reading goes on)."""
    index = 0
    for lineno, raw, n in _raw_lines(f, max_line_bytes):
        if raw is not None and not raw.strip():
            continue
        index += 1
        if index <= skip:
            yield index - 1, lineno, None
            continue
        if raw is None:
            yield index - 1, lineno, RecordError(
                name, lineno, None, f"line of {n} bytes is longer than the limit of "
                f"{max_line_bytes} bytes",
                index=index - 1)
            continue
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as exc:
            # Decode again, keeping the bad bytes, only to name the field that holds them.
            try:
                field = _bad_field(json.loads(raw.decode(encoding, "surrogateescape")))
            except (json.JSONDecodeError, UnicodeDecodeError):
                field = None
            yield index - 1, lineno, RecordError(name, lineno, field,
                                                 _undecodable(exc, encoding), index=index - 1)
            continue
        if lineno == 1 and text.startswith("\ufeff"):
            text = text[1:]
        try:
            # Without the line end, a line cut off inside a string reads "Unterminated string".
            obj = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as exc:
            at = exc.msg if exc.msg.endswith(" at") else exc.msg + " at"
            yield index - 1, lineno, RecordError(
                name, lineno, None, f"invalid JSON ({at} column {exc.colno})", index=index - 1)
            continue
        if not isinstance(obj, dict):
            obj = RecordError(name, lineno, None,
                              f"expected a JSON object, got {type(obj).__name__}",
                              index=index - 1)
        yield index - 1, lineno, obj


def _text_lines(f: IO[bytes], encoding: str) -> Iterator[str]:
    # Bad bytes become lone surrogates, found per cell afterwards (so the error names the row
    # and the column, and the rows around it are still read).
    for raw in f:
        yield raw.decode(encoding, "surrogateescape")


def _table_rows(f: IO[bytes], name: str, delimiter: str, fields: list[str], skip: int,
                encoding: str) -> Iterator[tuple[int, int, Any]]:
    """Like :func:`_jsonl_rows`, for CSV/TSV with a header row (a bad header raises)."""
    # TSV is read as plain tab-separated text (no quoting, as in GLUE); CSV with standard quoting.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(_text_lines(f, encoding), delimiter=delimiter, quoting=quoting)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise InputError(name, 1, None, f"malformed header ({exc})") from None
    if header and header[0].startswith("\ufeff"):
        header[0] = header[0][1:]
    header = [h.strip() for h in header]
    if any(_has_surrogate(h) for h in header):
        raise InputError(name, 1, None, f"header is not valid {encoding} text; pass the right "
                         "encoding (--encoding)")
    for field in fields:
        if field not in header:
            raise InputError(name, 1, field,
                             f"no such column in the header (columns: {', '.join(header)})")
    index = 0
    last = reader.line_num
    while True:
        start = last + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            last = reader.line_num
            index += 1
            if index > skip:
                yield index - 1, start, RecordError(name, start, None, f"malformed row ({exc})",
                                                    index=index - 1)
            continue
        last = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        index += 1
        if index <= skip:
            yield index - 1, start, None
        elif len(row) > len(header):
            yield index - 1, start, RecordError(
                name, start, None, f"{len(row)} columns but the header has {len(header)}",
                index=index - 1)
        else:
            bad = [h for h, v in zip(header, row, strict=False) if _has_surrogate(v)]
            if bad:
                yield index - 1, start, RecordError(
                    name, start, bad[0], f"not valid {encoding} text; pass the right encoding "
                    "(--encoding)", index=index - 1)
            else:
                yield index - 1, start, dict(zip(header, row, strict=False))


def read_records(
    path: PathLike,
    *,
    format: str | None = None,
    x_field: str = "x",
    y_field: str = "y",
    id_field: str | None = None,
    label_field: str | None = None,
    encoding: str = "utf-8",
    skip: int = 0,
    on_error: Callable[[RecordError], None] | str | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
    allow_empty: bool = True,
    stop: int | None = None,
) -> Iterator[Record]:
    """Stream the records of a JSONL, CSV, TSV or Parquet file or a Hugging Face dataset folder
    (``"-"``: JSONL on standard input).

    Nothing is read until the first record is asked for, and only one row (Parquet / datasets:
    one record batch of :data:`ARROW_BATCH_ROWS` rows, only the columns asked for) is held at a
    time.

    Args:
        path: the file; ``.gz`` files are decompressed on the fly. A folder is a dataset saved
            with ``datasets.Dataset.save_to_disk`` (one split; its Arrow files are read batch by
            batch, memory-mapped, without importing ``datasets``).
        format: ``"jsonl"``, ``"csv"``, ``"tsv"``, ``"parquet"`` or ``"datasets"``; from the
            extension (or a folder) if None.
        x_field, y_field: the fields holding the prompt and the response (JSONL, Parquet and
            datasets also take a dotted path into nested values such as ``"turns.0"``).
            CSV/TSV files need a header row.
        id_field: the field with the record's id; ``None`` uses ``"id"`` when a record has it.
        label_field: a field to carry along (e.g. a gold label); required in every record.
        encoding: text encoding (an ASCII-compatible one: lines are split on ``\\n`` bytes).
        skip: records before this index are counted but neither parsed nor checked (resume);
            Parquet skips whole row groups without reading them.
        stop: records from this index on are not read (``--shard``); None reads to the end.
        on_error: what to do with a bad record (a :class:`RecordError`): None raises it; a
            callable is called with it and reading goes on; ``"yield"`` yields it in place of
            the record (so the caller sees good and bad records in file order). Errors about
            the whole file (bad header, unreadable file, empty file) are always raised.
        max_line_bytes: a JSONL line longer than this is a bad record (see ``MAX_LINE_BYTES``).
            CSV/TSV cells are limited by Python's ``csv`` module (131072 characters).
        allow_empty: if False, a file without a single record (empty, blank lines only, a
            header only) raises :class:`InputError`.

    Yields:
        :class:`Record` s in file order (and :class:`RecordError` s with ``on_error="yield"``).

    Raises:
        RecordError: missing field, non-string x/y, invalid JSON, empty response, bytes that
            are not valid text, an over-long line, ...
        InputError: a bad header, a folder, an empty file (``allow_empty=False``).
        FileNotFoundError: no such file.
    """
    fmt = detect_format(path, format)
    name = _display(path)
    _check_source(path, fmt, name)
    if isinstance(on_error, str) and on_error != "yield":
        raise ValueError(f"on_error must be None, a callable or 'yield', got {on_error!r}")
    return _records(path, fmt, name, x_field, y_field, id_field, label_field, encoding, skip,
                    on_error, max_line_bytes, allow_empty, stop)


def _check_source(path: PathLike, fmt: str, name: str) -> None:
    """The input exists and is what ``fmt`` reads (a file, or a dataset folder)."""
    if name == "<stdin>":
        if fmt not in TEXT_FORMATS:
            raise ValueError(f"standard input is read as JSONL/CSV/TSV, not {fmt}")
        return
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"no such input file: {name}")
    if fmt == "datasets":
        _dataset_files(p, name)  # raises on a folder that is not a saved dataset
    elif os.path.isdir(p):
        raise InputError(name, None, None, "is a folder, not an input file")


def _records(path, fmt, name, x_field, y_field, id_field, label_field, encoding, skip, on_error,
             max_line_bytes, allow_empty, stop=None):
    required = [x_field, y_field] + ([label_field] if label_field else [])
    n_rows = 0
    f = None if fmt in ("parquet", "datasets") else _open_binary(path)
    try:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, skip, encoding, max_line_bytes)
        elif fmt in ("parquet", "datasets"):
            cols = required + ([id_field] if id_field else [])
            rows = _arrow_rows(path, fmt, name, cols, ("id",) if id_field is None else (), skip,
                               stop)
        else:
            cols = required + ([id_field] if id_field else [])
            rows = _table_rows(f, name, "," if fmt == "csv" else "\t", cols, skip, encoding)
        for index, line, row in rows:
            if stop is not None and index >= stop:
                n_rows += 1
                break
            n_rows += 1
            if row is None:
                continue
            try:
                if isinstance(row, RecordError):
                    raise row
                rec = _record(row, index, line, name, fmt, x_field, y_field, id_field,
                              label_field)
            except RecordError as exc:
                if on_error is None:
                    raise
                if on_error == "yield":
                    yield exc
                else:
                    on_error(exc)
                continue
            yield rec
    finally:
        if fmt in ("parquet", "datasets"):
            rows.close()  # releases the file / memory map at once, also after ``stop``
        if f is not None and f is not sys.stdin.buffer:
            f.close()
    if n_rows == 0 and not allow_empty:
        if fmt in ("parquet", "datasets"):
            raise InputError(name, None, None, "no records (no rows)")
        raise InputError(name, None, None, "no records (the file is empty or has only blank "
                         "lines" + (" and a header)" if fmt != "jsonl" else ")"))


# --------------------------------------------------------------------------- Arrow inputs


def _dataset_files(folder: str, name: str) -> list[str]:
    """The Arrow files of a ``Dataset.save_to_disk`` folder, in order (from its state.json)."""
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        try:
            with open(os.path.join(folder, "dataset_dict.json"), encoding="utf-8") as f:
                splits = ", ".join(json.load(f).get("splits", []))
        except (OSError, ValueError, AttributeError):
            splits = "?"
        raise InputError(name, None, None, f"is a DatasetDict folder (splits: {splits}); pass "
                         "one split's folder, e.g. FOLDER/train")
    state = os.path.join(folder, "state.json")
    if not os.path.isfile(state):
        raise InputError(name, None, None, "is a folder, not an input file (a dataset folder "
                         "saved with datasets' save_to_disk holds a state.json)")
    try:
        with open(state, encoding="utf-8") as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(os.path.join(name, "state.json"), None, "_data_files",
                         f"unreadable dataset state ({exc})") from None
    for fn in files:
        if not os.path.isfile(os.path.join(folder, fn)):
            raise InputError(name, None, None, f"data file {fn} listed in state.json is missing")
    return [os.path.join(folder, fn) for fn in files]


def _column_of(field: str, names: list[str]) -> str | None:
    """The top-level column a (dotted) field is read from, or None."""
    if field in names:
        return field
    head = field.split(".", 1)[0]
    return head if "." in field and head in names else None


def _project(schema_names: list[str], fields: list[str], optional: Sequence[str], name: str
             ) -> list[str]:
    """The columns to read for ``fields`` (a missing one is a whole-file error naming it) and
    for those of ``optional`` the file has."""
    cols: list[str] = []
    for field in fields:
        col = _column_of(field, schema_names)
        if col is None:
            raise InputError(name, None, field, "no such column (columns: "
                             f"{', '.join(schema_names)})")
        if col not in cols:
            cols.append(col)
    cols += [c for c in optional if c in schema_names and c not in cols]
    return cols


def _batch_rows(batch: Any, first: int, skip: int) -> Iterator[tuple[int, int, Any]]:
    """(index, row number, dict or None) per row of one record batch whose first row has index
    ``first``; rows before ``skip`` are counted, not converted."""
    n = batch.num_rows
    if first + n <= skip:
        for i in range(first, first + n):
            yield i, i + 1, None
        return
    for i in range(first, min(skip, first + n)):
        yield i, i + 1, None
    start = max(0, skip - first)
    # Converted in slices: at most ARROW_BATCH_ROWS rows are Python objects at once.
    for off in range(start, n, ARROW_BATCH_ROWS):
        part = batch.slice(off, ARROW_BATCH_ROWS).to_pylist()
        for j, row in enumerate(part):
            i = first + off + j
            yield i, i + 1, row


def _arrow_rows(path: PathLike, fmt: str, name: str, fields: list[str], optional: Sequence[str],
                skip: int, stop: int | None) -> Iterator[tuple[int, int, Any]]:
    """Like :func:`_jsonl_rows`, for a Parquet file (row groups skipped from the footer's row
    counts, buffered reads) or a dataset folder (its Arrow stream files, memory-mapped)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt == "parquet":
        try:
            # Buffered column reads: memory stays at about one page per column, not a whole
            # row group's column chunk (files written in one row group are common).
            pf = pq.ParquetFile(os.fspath(path), buffer_size=1 << 20, pre_buffer=False)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(name, None, None, f"not a readable Parquet file ({exc})") from None
        with pf:
            cols = _project(pf.schema_arrow.names, fields, optional, name)
            meta = pf.metadata
            first, group = 0, 0
            # Whole row groups before ``skip`` are counted from the footer, never read.
            while group < meta.num_row_groups and first + meta.row_group(group).num_rows <= skip:
                first += meta.row_group(group).num_rows
                group += 1
            if group < meta.num_row_groups:
                batches = pf.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=cols,
                                          row_groups=list(range(group, meta.num_row_groups)),
                                          use_threads=False)
                for batch in batches:
                    yield from _batch_rows(batch, first, skip)
                    first += batch.num_rows
                    if stop is not None and first >= stop:
                        break
        return
    import pyarrow.ipc as ipc

    first = 0
    for fn in _dataset_files(os.fspath(path), name):
        with pa.memory_map(fn, "r") as source:
            try:
                reader = ipc.open_stream(source)
            except pa.ArrowException as exc:
                raise InputError(fn, None, None, f"not a readable Arrow stream ({exc})") from None
            cols = _project(reader.schema.names, fields, optional, name)
            for batch in reader:
                if first + batch.num_rows <= skip:  # memory-mapped: skipping reads nothing
                    first += batch.num_rows
                    continue
                yield from _batch_rows(batch.select(cols), first, skip)
                first += batch.num_rows
                if stop is not None and first >= stop:
                    return


def _arrow_count(path: PathLike, fmt: str, name: str) -> int:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    if fmt == "parquet":
        try:
            return int(pq.read_metadata(os.fspath(path)).num_rows)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(name, None, None, f"not a readable Parquet file ({exc})") from None
    n = 0
    for fn in _dataset_files(os.fspath(path), name):
        with pa.memory_map(fn, "r") as source:
            for batch in ipc.open_stream(source):
                n += batch.num_rows
    return n


def count_records(path: PathLike, *, format: str | None = None, encoding: str = "utf-8",
                  max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """The number of records :func:`read_records` would index in ``path`` (bad records count,
    blank lines do not), without parsing them: non-blank lines of a JSONL file, CSV/TSV rows
    (parsed for quoting), the footer's row count of a Parquet file, the batch row counts of a
    dataset folder. Standard input cannot be counted (ValueError)."""
    fmt = detect_format(path, format)
    name = _display(path)
    if name == "<stdin>":
        raise ValueError("standard input cannot be counted (needed by --shard); pass a file")
    _check_source(path, fmt, name)
    if fmt in ("parquet", "datasets"):
        return _arrow_count(path, fmt, name)
    big = 1 << 62  # skip everything: records are counted, not parsed
    with _open_binary(path) as f:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, big, encoding, max_line_bytes)
        else:
            rows = _table_rows(f, name, "," if fmt == "csv" else "\t", [], big, encoding)
        n = 0
        for _ in rows:
            n += 1
        return n


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n`` (0-based shard index)."""
    i_s, sep, n_s = spec.partition("/")
    try:
        i, n = int(i_s), int(n_s)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard: expected i/n with 0 <= i < n (e.g. 0/4 ... 3/4), got {spec!r}")
    return i, n


def shard_range(total: int, i: int, n: int, align: int = 1) -> tuple[int, int]:
    """Record indices ``[start, stop)`` of shard ``i`` of ``n``: contiguous ranges in input order
    whose boundaries are multiples of ``align`` (blocks of ``align`` records are dealt out as
    evenly as possible), so the shards' outputs concatenated in shard order are the unsharded
    output. Shards may be empty when there are fewer blocks than shards."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if not 0 <= i < n:
        raise ValueError(f"shard {i} of {n}: need 0 <= i < n")
    blocks = -(-total // align)
    lo, hi = (i * blocks) // n, ((i + 1) * blocks) // n
    return min(lo * align, total), min(hi * align, total)


def _record(row: dict, index: int, line: int, name: str, fmt: str, x_field: str, y_field: str,
            id_field: str | None, label_field: str | None) -> Record:
    def err(field: str | None, reason: str) -> RecordError:
        return RecordError(name, line, field, reason, index=index)

    values = {}
    for field in (x_field, y_field):
        found, v = _get(row, field)
        if found and v is None and fmt in ("parquet", "datasets"):
            raise err(field, "missing (null)")
        if not found or (fmt != "jsonl" and v is None):
            what = "keys" if fmt == "jsonl" else "columns"
            raise err(field, f"missing (this record's {what}: {_keys(row)})")
        if not isinstance(v, str):
            raise err(field, f"must be a string, got {type(v).__name__} {_short(v)}")
        values[field] = v
    y = values[y_field]
    if not y.strip():
        raise err(y_field, "empty response (nothing to score)" if not y else
                  "whitespace-only response (nothing to score)")
    rid = None
    if id_field is not None:
        found, rid = _get(row, id_field)
        if not found or rid is None:
            raise err(id_field, f"missing (this record's keys: {_keys(row)})")
    elif "id" in row:
        rid = row["id"]
    if rid is not None and not isinstance(rid, (str, int, float, bool)):
        raise err(id_field or "id", f"must be a string or a number, got {type(rid).__name__}")
    label = None
    if label_field is not None:
        found, label = _get(row, label_field)
        if not found or (fmt != "jsonl" and label is None):
            raise err(label_field, f"missing (this record's keys: {_keys(row)})")
    return Record(index=index, line=line, x=values[x_field], y=y, id=rid, label=label)


def read_rows(path: PathLike, *, fields: Iterable[str] = (), optional: Iterable[str] = (),
              format: str | None = None, encoding: str = "utf-8",
              max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, int, dict]]:
    """Stream ``(index, line, row)`` for each record of a JSONL/CSV/TSV/Parquet file or dataset
    folder with its own schema (e.g. a results file for ``icqs-fast rank``); the caller checks
    the fields (:func:`field_of`). ``fields``: the columns a CSV/TSV header, a Parquet file or a
    dataset must have (only those are read from Parquet / datasets; dotted paths read their
    top-level column); ``optional``: columns also read from Parquet / datasets when present.
    JSONL rows are whole objects. CSV/TSV values are strings, ``line`` is the row number for
    Parquet / datasets.

    Raises:
        RecordError: a bad line (invalid JSON, not an object, undecodable, too long, ragged).
        InputError: a missing column, a folder that is not a dataset, an unreadable file.
        FileNotFoundError: no such file.
    """
    fmt = detect_format(path, format)
    name = _display(path)
    _check_source(path, fmt, name)
    return _plain_rows(path, fmt, name, list(fields), tuple(optional), encoding, max_line_bytes)


def _plain_rows(path, fmt, name, fields, optional, encoding, max_line_bytes):
    if fmt in ("parquet", "datasets"):
        rows = _arrow_rows(path, fmt, name, fields, optional, 0, None)
        try:
            for index, line, row in rows:
                yield index, line, row
        finally:
            rows.close()
        return
    f = _open_binary(path)
    try:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, 0, encoding, max_line_bytes)
        else:
            rows = _table_rows(f, name, "," if fmt == "csv" else "\t", fields, 0, encoding)
        for index, line, row in rows:
            if isinstance(row, RecordError):
                raise row
            yield index, line, row
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def read_json_objects(path: PathLike, *, encoding: str = "utf-8",
                      max_line_bytes: int = MAX_LINE_BYTES, allow_empty: bool = False
                      ) -> Iterator[tuple[int, dict]]:
    """Stream ``(line, object)`` for each non-blank line of a JSONL file (``.gz`` allowed), for
    files with their own schema (MT-Bench, ALLURE's memory and audit files); the caller checks
    the fields, raising :class:`RecordError` (see :func:`field_of`).

    Raises:
        RecordError: invalid JSON, not an object, bytes that are not valid text, a line longer
            than ``max_line_bytes``.
        InputError: a folder, or a file without a single record (unless ``allow_empty``: files
            a program appends to may hold none yet).
        FileNotFoundError: no such file.
    """
    name = _display(path)
    if not os.path.exists(os.fspath(path)):
        raise FileNotFoundError(f"no such input file: {name}")
    if os.path.isdir(os.fspath(path)):
        raise InputError(name, None, None, "is a folder, not an input file")
    return _json_objects(path, name, encoding, max_line_bytes, allow_empty)


def _json_objects(path, name, encoding, max_line_bytes, allow_empty):
    n = 0
    with _open_binary(path) as f:
        for _, line, obj in _jsonl_rows(f, name, 0, encoding, max_line_bytes):
            n += 1
            if isinstance(obj, RecordError):
                raise obj
            yield line, obj
    if n == 0 and not allow_empty:
        raise InputError(name, None, None, "no records (the file is empty or has only blank "
                         "lines)")


def field_of(obj: dict, field: str, kind: type | tuple[type, ...], *, path: PathLike, line: int,
             index: int) -> Any:
    """``obj[field]`` (a dotted path allowed, e.g. ``"choices.0.turns"``), checked to be a
    ``kind``; a :class:`RecordError` naming the file, line and field otherwise (bool is not
    accepted as a number)."""
    found, v = _get(obj, field)
    if not found:
        raise RecordError(path, line, field, f"missing (this record's keys: {_keys(obj)})",
                          index=index)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise RecordError(path, line, field,
                          f"must be {want}, got {type(v).__name__} {_short(v)}", index=index)
    return v


def _short(v: Any, n: int = 40) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def read_examples(
    path: PathLike,
    *,
    format: str | None = None,
    x_field: str = "x",
    y_field: str = "y",
    encoding: str = "utf-8",
) -> list[tuple[str, str]]:
    """All ``(x, y)`` pairs of a good or bad demonstration file (JSONL/CSV/TSV).

    Raises:
        InputError: a bad record, or a file with no examples.
    """
    out = [(r.x, r.y) for r in read_records(path, format=format, x_field=x_field,
                                            y_field=y_field, encoding=encoding)]
    if not out:
        raise InputError(_display(path), None, None, "no examples in the file")
    return out


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

    Test hook: ``ICQS_FAST_TEST_CRASH=MODE:N`` (read at construction) makes the process kill
    itself with SIGKILL at the N-th record this writer writes (0-based): ``before`` writing it,
    ``mid`` (after writing the first half of its line) or ``hold`` (after writing it, sleep until
    killed from outside). The crash-resume tests use it to stop runs at chosen points.
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
        self._crash = _crash_hook()

    def write(self, record: dict) -> None:
        """Append ``record`` as one JSON line (NaN/inf written as JSON5-style literals)."""
        if self._fd is None:
            raise ValueError(f"{self.path}: writer is closed")
        data = (json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n").encode("utf-8")
        if self._crash is not None and self._crash[0] != "hold" and self._crash[1] == self.count:
            _crash(self._crash[0], self._fd, data)
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop only for a short write
            view = view[os.write(self._fd, view):]
        self.count += 1
        if self._crash is not None and self._crash == ("hold", self.count - 1):
            _crash("hold", self._fd, b"")
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


def _crash_hook() -> tuple[str, int] | None:
    spec = os.environ.get("ICQS_FAST_TEST_CRASH")
    if not spec:
        return None
    mode, _, n = spec.partition(":")
    if mode not in ("before", "mid", "hold") or not n.isdigit():
        raise ValueError(f"ICQS_FAST_TEST_CRASH must be before|mid|hold:N, got {spec!r}")
    return mode, int(n)


def _crash(mode: str, fd: int, data: bytes) -> None:
    if mode == "mid":
        os.write(fd, data[: len(data) // 2])
        os.fsync(fd)
    if mode == "hold":
        os.fsync(fd)
        deadline = time.monotonic() + 600  # never outlive a test that forgot to kill us
        while time.monotonic() < deadline:
            time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


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


@dataclass
class ResumeState:
    """What an existing results file holds: ``last`` is the last complete record (None if none),
    ``count`` the number of complete records, ``end`` the byte offset just after it (JSONL;
    0 for Parquet), ``format`` the output's format (``"jsonl"`` or ``"parquet"``)."""

    last: dict | None
    count: int
    end: int
    format: str = "jsonl"


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
    return "parquet" if os.fspath(out).lower().endswith(_PARQUET_SUFFIXES) else "jsonl"


def parts_dir(out: PathLike) -> Path:
    """The folder of a Parquet output's committed parts (``OUT.parts``)."""
    return Path(f"{os.fspath(out)}.parts")


def _fsync_path(path: PathLike) -> None:
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


def _parquet_output(out: PathLike) -> _ParquetOutput:
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
    st = _parquet_output(path)
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
    ``pyarrow.parquet.ParquetWriter``. Column types are inferred from the records; a column that
    changes type (an ``id`` that is a number in one record and a string in another) is a
    ValueError at the commit that meets it. Records must carry an integer ``index`` that
    increases (the results of ``score`` / ``features`` do).

    Args:
        path: the output (``.parquet``); parent folders are created.
        append: continue an existing output (its file and committed parts are kept).
        part_rows, commit_every: when a part is committed (records, seconds).
        row_group_rows: rows per row group of the merged ``OUT``.

    Test hook: ``ICQS_FAST_TEST_CRASH=MODE:N`` as for :class:`JsonlWriter`: ``before`` kills the
    process before record N is buffered, ``mid`` while the part holding record N is being
    committed (its temporary file half written), ``hold`` after that part is committed.
    """

    def __init__(self, path: PathLike, *, append: bool = False,
                 part_rows: int = PARQUET_PART_ROWS, commit_every: float = PARQUET_COMMIT_SECONDS,
                 row_group_rows: int = PARQUET_ROW_GROUP_ROWS) -> None:
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.parts = parts_dir(path)
        if self.path.parent:
            os.makedirs(self.path.parent, exist_ok=True)
        if not append:
            _remove_parquet_output(self.path)
        os.makedirs(self.parts, exist_ok=True)
        st = _parquet_output(self.path)
        self._last_index = st.last["index"] if st.last else None
        srcs = ([st.main] if st.main else []) + st.parts
        self._schema = _unify([pq.read_schema(p) for p in srcs], os.fspath(self.path)) \
            if srcs else None
        self._buf: list[dict] = []
        self._part_rows = max(1, part_rows)
        self._commit_every = commit_every
        self._row_group_rows = max(1, row_group_rows)
        self._last_commit = time.monotonic()
        self._closed = False
        self.count = 0
        self._crash = _crash_hook()

    def write(self, record: dict) -> None:
        """Buffer ``record``; commit a part when it is due."""
        if self._closed:
            raise ValueError(f"{self.path}: writer is closed")
        idx = record.get("index")
        if not isinstance(idx, int) or (self._last_index is not None and idx <= self._last_index):
            raise ValueError(f"{self.path}: results need increasing integer indices, got {idx!r} "
                             f"after {self._last_index!r}")
        if self._crash is not None and self._crash == ("before", self.count):
            _crash("before", -1, b"")
        self._buf.append(record)
        self._last_index = idx
        self.count += 1
        if (len(self._buf) >= self._part_rows
                or time.monotonic() - self._last_commit >= self._commit_every):
            self.commit()

    def commit(self) -> None:
        """Write the buffered records as one part (temporary name, fsync, rename, fsync the
        folder): once this returns they survive a crash."""
        import pyarrow.parquet as pq

        self._last_commit = time.monotonic()
        if not self._buf:
            return
        table = records_table(self._buf)
        schema = table.schema if self._schema is None else \
            _unify([self._schema, table.schema], os.fspath(self.path))
        name = f"{_PART_PREFIX}{self._buf[0]['index']:012d}.parquet"
        tmp = self.parts / f".{name}.tmp"
        crash = self._crash is not None and self._crash[0] in ("mid", "hold") and \
            self.count - len(self._buf) <= self._crash[1] < self.count
        with pq.ParquetWriter(tmp, table.schema) as w:
            w.write_table(table)
            if crash and self._crash[0] == "mid":
                _crash("before", -1, b"")  # the temporary part has no footer yet
        _fsync_path(tmp)
        os.replace(tmp, self.parts / name)
        _fsync_path(self.parts)
        self._schema = schema
        self._buf.clear()
        if crash and self._crash[0] == "hold":
            deadline = time.monotonic() + 600  # never outlive a test that forgot to kill us
            while time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        """Commit what is buffered, then merge ``OUT`` and the parts into ``OUT``."""
        if self._closed:
            return
        self.commit()
        self._closed = True
        merge_parquet_output(self.path, row_group_rows=self._row_group_rows)

    def __enter__(self) -> ParquetResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_parquet_output(out: Path) -> None:
    import shutil

    for p in (out, Path(f"{out}.tmp")):
        if p.exists():
            p.unlink()
    if parts_dir(out).exists():
        shutil.rmtree(parts_dir(out))


def merge_parquet_output(out: PathLike, *, row_group_rows: int = PARQUET_ROW_GROUP_ROWS) -> None:
    """Merge a Parquet output's committed parts into ``OUT`` (streamed row group by row group:
    memory holds about ``row_group_rows`` rows), atomically, and remove ``OUT.parts``; without
    any record at all, ``OUT`` is an empty table with ``index`` and ``line`` columns."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    st = _parquet_output(out)
    if st.parts or st.main is None:
        srcs = ([st.main] if st.main else []) + st.parts
        if srcs:
            schema = _unify([pq.read_schema(p) for p in srcs], os.fspath(out))
        else:
            schema = pa.schema([("index", pa.int64()), ("line", pa.int64())])
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
        _fsync_path(tmp)
        os.replace(tmp, out)
        _fsync_path(out.parent if str(out.parent) else Path("."))
    if parts_dir(out).exists():
        shutil.rmtree(parts_dir(out))


def open_results(plan: OutputPlan) -> JsonlWriter | ParquetResultWriter:
    """The writer of ``plan.out``: :class:`ParquetResultWriter` for ``.parquet``/``.pq``, else
    :class:`JsonlWriter` (appending when resuming)."""
    if output_format(plan.out) == "parquet":
        return ParquetResultWriter(plan.out, append=plan.append)
    return JsonlWriter(plan.out, append=plan.append)


# --------------------------------------------------------------------------- output runs
# What every command writing a results file shares (``score``, ``features``): the settings file
# ``OUT.meta.json`` (the resume fingerprint), the resume plan, skipped-record lines.


def meta_path(output: PathLike) -> Path:
    """The settings file written next to the results (``OUT.meta.json``)."""
    return Path(f"{os.fspath(output)}.meta.json")


def write_meta(output: PathLike, settings: dict) -> None:
    """Write ``OUT.meta.json`` whole, then rename it into place (a crash never leaves a
    half-written settings file)."""
    mp = meta_path(output)
    tmp = mp.with_name(mp.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(settings, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, mp)


def skipped_record(err: RecordError) -> dict:
    """The output line of a bad record skipped with ``--on-error skip``: ``index``, ``line``
    and ``error`` (``field``, ``reason``); it keeps the record's place in the output, so a
    resume neither redoes nor loses it."""
    return {"index": err.index, "line": err.line,
            "error": {"field": err.field, "reason": err.reason}}


def runtime_settings(model: Any, backend: str) -> dict:
    """The model-side part of the resume fingerprint: the weights' dtype, the device type and
    the resolved kernel backend (``"auto"`` resolved, so ``auto`` and ``cpp`` on a CPU agree),
    read from the loaded model's parameters."""
    from . import backends

    p = next(model.parameters())
    return {"dtype": str(p.dtype).removeprefix("torch."), "device": p.device.type,
            "backend": backends.resolve(backend, p.device)}


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
        _dataset_files(input, input)
    if resume and overwrite:
        raise ValueError("choose at most one of --resume and --overwrite")


@dataclass
class OutputPlan:
    """How a run treats its output (from :func:`plan_output`).

    Attributes:
        out: the results file.
        append: resuming an existing output (else it is emptied by :func:`start_output`).
        start: the first input record index to write (0 unless resuming).
        last: the last complete record already there (None if none).
        state: what the existing file holds (resuming only).
        old: the settings in its ``OUT.meta.json`` (None without one).
    """

    out: Path
    append: bool = False
    start: int = 0
    last: dict | None = None
    state: ResumeState | None = None
    old: dict | None = None


def _refusal(out: Path, old: dict, new: dict, keys: Iterable[str]) -> ValueError | None:
    diff = sorted(k for k in keys if old.get(k) != new[k])
    if not diff:
        return None
    what = ", ".join(f"{k}: {old[k]!r} there, {new[k]!r} now" if k in old else
                     f"{k}: not recorded there" for k in diff)
    return ValueError(f"cannot --resume {out}: it was written with other settings ({what}); "
                      "use another output or --overwrite")


def plan_output(out: PathLike, settings: dict, *, resume: bool, overwrite: bool) -> OutputPlan:
    """Decide, before the model is loaded (to fail fast), what to do with ``out``.

    With ``resume`` and an existing output: where to continue, after checking that every key of
    ``settings`` matches its ``OUT.meta.json``. Without: an existing non-empty output is only
    replaced with ``overwrite``.

    Raises:
        ValueError: other settings there, or an existing output without ``--resume`` /
            ``--overwrite``.
        InputError: an output that is not a results file.
    """
    out = Path(out)
    if resume and (out.exists() or output_exists(out)):
        state = read_output_state(out)
        old = None
        mp = meta_path(out)
        if mp.is_file():
            old = json.loads(mp.read_text(encoding="utf-8"))
            err = _refusal(out, old, settings, settings)
            if err is not None:
                raise err
        last = state.last
        return OutputPlan(out, append=True, start=last["index"] + 1 if last is not None else 0,
                          last=last, state=state, old=old)
    if output_exists(out) and not overwrite and not resume:
        raise ValueError(f"{out} exists; pass --resume to continue it or --overwrite to replace it")
    return OutputPlan(out)


def check_runtime(plan: OutputPlan, settings: dict) -> None:
    """After the model is loaded: a resumed output must have been written with the same
    :data:`RUNTIME_KEYS` (dtype, device, backend) as ``settings`` (ValueError otherwise)."""
    if plan.old is not None:
        err = _refusal(plan.out, plan.old, settings, RUNTIME_KEYS)
        if err is not None:
            raise err


def start_output(plan: OutputPlan, settings: dict, log: Callable[..., None]) -> None:
    """Make the output ready for writing: when resuming, truncate a record cut off mid-write;
    else empty it, then write ``OUT.meta.json`` (a crash in between leaves an empty output,
    never old records under new settings)."""
    out = plan.out
    if plan.append and plan.state is not None and plan.state.format == "parquet":
        st = _parquet_output(out)
        for p in st.stale:  # merged into OUT by a run that crashed before removing them
            p.unlink()
        tmps = [p for p in (parts_dir(out).iterdir() if parts_dir(out).is_dir() else [])
                if p.name.endswith(".tmp")] + [p for p in [Path(f"{out}.tmp")] if p.exists()]
        for p in tmps:
            p.unlink()
        if st.stale or tmps:
            log(f"icqs-fast: removed {len(st.stale)} already merged and {len(tmps)} unfinished "
                f"part file(s) of {out}")
        log(f"icqs-fast: resuming {out}: {plan.state.count} records there, continuing at input "
            f"record {plan.start}")
    elif plan.append:
        assert plan.state is not None
        if out.stat().st_size != plan.state.end:
            with open(out, "r+b") as f:  # drop a record cut off mid-write
                f.truncate(plan.state.end)
            log(f"icqs-fast: removed an incomplete last line from {out}")
        log(f"icqs-fast: resuming {out}: {plan.state.count} records there, continuing at input "
            f"record {plan.start}")
    elif output_format(out) == "parquet":
        _remove_parquet_output(out)
        write_meta(out, settings)
    else:
        with open(out, "wb"):
            pass
        write_meta(out, settings)


def resume_check_needed(plan: OutputPlan) -> bool:
    """Whether the resumed output's last record has an id to compare with the input's record
    at that index (a skipped record's line has none)."""
    last = plan.last
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


def input_range(args: Any, plan: OutputPlan, *, align: int = 1) -> tuple[int, int | None, int]:
    """For a command with ``--shard``: ``(start, stop, total)``, the input records this run
    reads - its shard's range (:func:`shard_range`, boundaries multiples of ``align``), started
    after what a resumed output holds - and the number of records it will write (for the
    progress bar; -1 when unknown). Without ``--shard``: ``(plan.start, None, n)``, ``n`` known
    only for Parquet / datasets inputs (counting a text file would read it twice)."""
    shard = getattr(args, "shard", None)
    fmt = detect_format(args.input, args.format) if args.input != "-" else "jsonl"
    if shard is None:
        total = -1
        if fmt in ("parquet", "datasets"):
            total = max(0, count_records(args.input, format=args.format) - plan.start)
        return plan.start, None, total
    i, n = parse_shard(shard)
    total = count_records(args.input, format=args.format,
                          encoding=getattr(args, "encoding", "utf-8"))
    if total == 0:
        raise InputError(_display(args.input), None, None, "no records (nothing to shard)")
    lo, hi = shard_range(total, i, n, align)
    start = max(lo, plan.start)
    if plan.last is not None and not lo <= plan.last["index"] < hi:
        raise ValueError(f"cannot --resume {plan.out}: its last record {plan.last['index']} is "
                         f"outside shard {shard} (records {lo}..{hi - 1})")
    return start, hi, max(0, hi - start)


# --------------------------------------------------------------------------- real data


def shared_data_dir() -> Path:
    """The read-only real-data folder: ``$ICQS_FAST_SHARED_DATA``, else ``../shared/data``
    next to the repository (or the current folder)."""
    env = os.environ.get("ICQS_FAST_SHARED_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[1]
    for root in (repo, Path.cwd()):
        cand = root.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return repo.parent / "shared" / "data"


def default_fpb_path() -> Path:
    return shared_data_dir() / "fpb" / "Sentences_AllAgree.txt"


FPB_LABELS = ("positive", "negative", "neutral")


def read_fpb(path: PathLike | None = None) -> Iterator[Record]:
    """Stream Financial PhraseBank ``sentence@label`` lines as :class:`Record` s (x = sentence,
    y = label). The file is decoded as UTF-8, or Latin-1 when it is not valid UTF-8 (the
    original release is Latin-1).

    Raises:
        FileNotFoundError: no file (by default ``../shared/data/fpb/Sentences_AllAgree.txt``).
        InputError: a line without ``@label`` or with an unknown label.
    """
    p = Path(path) if path is not None else default_fpb_path()
    if not p.is_file():
        raise FileNotFoundError(f"Financial PhraseBank file not found: {p}")
    return _fpb(p)


def _fpb(p: Path) -> Iterator[Record]:
    with open(p, "rb") as f:
        index = 0
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = text.strip().lstrip("\ufeff")
            if not text:
                continue
            sentence, sep, label = text.rpartition("@")
            if not sep:
                raise InputError(p, lineno, "label", "no '@label' at the end of the line")
            label = label.strip().lower()
            if label not in FPB_LABELS:
                raise InputError(p, lineno, "label",
                                 f"unknown label {label!r} (expected {', '.join(FPB_LABELS)})")
            sentence = sentence.strip()
            if not sentence:
                raise InputError(p, lineno, "sentence", "empty sentence")
            yield Record(index=index, line=lineno, x=sentence, y=label, label=label)
            index += 1


_FLIP = {"positive": "negative", "negative": "positive"}


def fpb_examples(
    path: PathLike | None = None,
    *,
    n_good: int = 32,
    n_bad: int = 32,
    seed: int = 0,
    max_chars: int | None = 200,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[Record]]:
    """Good and bad ICQS demonstrations from Financial PhraseBank, plus the unused sentences.

    Good demonstrations are positive/negative sentences with their own label; bad ones are other
    positive/negative sentences with the opposite label (the ICQS paper's setup). Neutral
    sentences are never demonstrations; they stay in the returned rest, for scoring.

    Args:
        n_good, n_bad: pool sizes (each drawn from distinct sentences, half positive and half
            negative where possible).
        seed: sampling seed.
        max_chars: only sentences up to this length are drawn as demonstrations (short prompts).

    Returns:
        ``(good, bad, rest)``: two lists of (sentence, label) pairs and the remaining records.
    """
    rows = list(read_fpb(path))
    rng = random.Random(seed)
    polar = [r for r in rows if r.y in _FLIP and (max_chars is None or len(r.x) <= max_chars)]
    by_label = {lab: [r for r in polar if r.y == lab] for lab in _FLIP}
    for lst in by_label.values():
        rng.shuffle(lst)
    need = n_good + n_bad
    if len(polar) < need:
        raise ValueError(f"only {len(polar)} usable positive/negative sentences, need {need}")
    # Alternate labels so both pools are balanced while the data allow.
    order: list[Record] = []
    pos, neg = by_label["positive"], by_label["negative"]
    while len(order) < need:
        for lst in (pos, neg):
            if lst and len(order) < need:
                order.append(lst.pop())
    good_recs, bad_recs = order[:n_good], order[n_good:need]
    used = {r.index for r in good_recs} | {r.index for r in bad_recs}
    good = [(r.x, r.y) for r in good_recs]
    bad = [(r.x, _FLIP[r.y]) for r in bad_recs]
    rest = [r for r in rows if r.index not in used]
    return good, bad, rest
