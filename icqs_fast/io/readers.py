"""Reading responses and demonstrations from files, and writing results, lazily.

* :func:`read_records` streams :class:`Record` s from JSONL, CSV or TSV (optionally gzipped),
  Parquet files and Hugging Face ``datasets`` folders (``Dataset.save_to_disk``): one row (or
  one record batch of :data:`ARROW_BATCH_ROWS` rows) at a time, so a file of millions of rows
  is never held in memory. Field names are mapped (:class:`RecordFields`: ``x_field``,
  ``y_field``, ``id_field``, ``label_field``), and every record is checked here, once, by
  :func:`row_record` (x and y strings, y not blank, ...): the jobs, the Ray actors and the
  engine's callers take its records as they are. :func:`count_records` counts records the
  same way; :func:`shard_range` and :func:`parse_shard` split an input into contiguous
  ranges for ``--shard i/n``.
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
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from icqs_fast.io.arrow import arrow_count, arrow_rows, dataset_files
from icqs_fast.io.records import (
    MAX_LINE_BYTES,
    TEXT_FORMATS,
    InputError,
    PairRecord,
    PathLike,
    Record,
    RecordError,
    detect_format,
    display_name,
    field_keys,
    get_field,
    open_binary,
    short_repr,
)


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


@dataclass(frozen=True)
class RecordFields:
    """Which fields of a row make a :class:`Record`: the prompt (``x_field``), the response
    (``y_field``; both may be dotted paths into nested values of JSONL, Parquet and datasets,
    such as ``"turns.0"``), the id (``id_field``; None uses ``"id"`` when a row has it) and a
    field carried along (``label_field``, e.g. a gold label; required in every row when
    set)."""

    x_field: str = "x"
    y_field: str = "y"
    id_field: str | None = None
    label_field: str | None = None


def read_records(
    path: PathLike,
    fields: RecordFields | None = None,
    *,
    format: str | None = None,
    encoding: str = "utf-8",
    skip: int = 0,
    stop: int | None = None,
    on_error: Callable[[RecordError], None] | str | None = None,
    allow_empty: bool = True,
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
        fields: the record's fields (:class:`RecordFields`; default ``x`` / ``y``). CSV/TSV
            files need a header row.
        format: ``"jsonl"``, ``"csv"``, ``"tsv"``, ``"parquet"`` or ``"datasets"``; from the
            extension (or a folder) if None.
        encoding: text encoding (an ASCII-compatible one: lines are split on ``\\n`` bytes).
        skip: records before this index are counted but neither parsed nor checked (resume);
            Parquet skips whole row groups without reading them.
        stop: records from this index on are not read (``--shard``); None reads to the end.
        on_error: what to do with a bad record (a :class:`RecordError`): None raises it; a
            callable is called with it and reading goes on; ``"yield"`` yields it in place of
            the record (so the caller sees good and bad records in file order). Errors about
            the whole file (bad header, unreadable file, empty file) are always raised.
        allow_empty: if False, a file without a single record (empty, blank lines only, a
            header only) raises :class:`InputError`.

    A JSONL line longer than :data:`MAX_LINE_BYTES` is a bad record; CSV/TSV cells are
    limited by Python's ``csv`` module (131072 characters).

    Yields:
        :class:`Record` s in file order (and :class:`RecordError` s with ``on_error="yield"``).

    Raises:
        RecordError: missing field, non-string x/y, invalid JSON, empty response, bytes that
            are not valid text, an over-long line, ...
        InputError: a bad header, a folder, an empty file (``allow_empty=False``).
        FileNotFoundError: no such file.
    """
    fmt = detect_format(path, format)
    name = display_name(path)
    _check_source(path, fmt, name)
    if isinstance(on_error, str) and on_error != "yield":
        raise ValueError(f"on_error must be None, a callable or 'yield', got {on_error!r}")
    return _records(_Source(path, fmt, name, encoding), fields or RecordFields(),
                    (skip, stop), on_error, allow_empty)


@dataclass(frozen=True)
class _Source:
    path: PathLike
    fmt: str
    name: str
    encoding: str


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
        dataset_files(p, name)  # raises on a folder that is not a saved dataset
    elif os.path.isdir(p):
        raise InputError(name, None, None, "is a folder, not an input file")


def _records(src: _Source, fields: Any, span: tuple[int, int | None], on_error,
             allow_empty: bool, make: Callable[..., Any] | None = None):
    path, fmt, name, encoding = src.path, src.fmt, src.name, src.encoding
    skip, stop = span
    id_field = fields.id_field
    if make is None:  # plain records; a pair reader brings its own row check and columns
        make = row_record
        required = [fields.x_field, fields.y_field] + ([fields.label_field]
                                                      if fields.label_field else [])
    else:
        required = fields.columns()
    n_rows = 0
    f = None if fmt in ("parquet", "datasets") else open_binary(path)
    try:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, skip, encoding, MAX_LINE_BYTES)
        elif fmt in ("parquet", "datasets"):
            cols = required + ([id_field] if id_field else [])
            rows = arrow_rows(path, fmt, name, cols, ("id",) if id_field is None else (), skip,
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
                rec = make(row, index, line, name, fields, fmt)
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


def count_records(path: PathLike, *, format: str | None = None, encoding: str = "utf-8",
                  max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """The number of records :func:`read_records` would index in ``path`` (bad records count,
    blank lines do not), without parsing them: non-blank lines of a JSONL file, CSV/TSV rows
    (parsed for quoting), the footer's row count of a Parquet file, the batch row counts of a
    dataset folder. Standard input cannot be counted (ValueError)."""
    fmt = detect_format(path, format)
    name = display_name(path)
    if name == "<stdin>":
        raise ValueError("standard input cannot be counted (needed by --shard); pass a file")
    _check_source(path, fmt, name)
    if fmt in ("parquet", "datasets"):
        return arrow_count(path, fmt, name)
    big = 1 << 62  # skip everything: records are counted, not parsed
    with open_binary(path) as f:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, big, encoding, max_line_bytes)
        else:
            rows = _table_rows(f, name, "," if fmt == "csv" else "\t", [], big, encoding)
        n = 0
        for _ in rows:
            n += 1
        return n


def row_record(row: dict, index: int, line: int, name: str,
               fields: RecordFields = RecordFields(), fmt: str = "jsonl") -> Record:
    """The :class:`Record` of one row (a dict) read from ``name`` in format ``fmt``: THE record
    check (x and y strings, y not blank, an id that is a string or a number, the label there),
    used by every reader of records and by the Ray batch scorers for their batches' rows.

    Raises:
        RecordError: what is wrong, naming the field.
    """
    x_field, y_field = fields.x_field, fields.y_field
    id_field, label_field = fields.id_field, fields.label_field

    def err(field: str | None, reason: str) -> RecordError:
        return RecordError(name, line, field, reason, index=index)

    values = {}
    for field in (x_field, y_field):
        found, v = get_field(row, field)
        if found and v is None and fmt in ("parquet", "datasets"):
            raise err(field, "missing (null)")
        if not found or (fmt != "jsonl" and v is None):
            what = "keys" if fmt == "jsonl" else "columns"
            raise err(field, f"missing (this record's {what}: {field_keys(row)})")
        if not isinstance(v, str):
            raise err(field, f"must be a string, got {type(v).__name__} {short_repr(v)}")
        values[field] = v
    y = values[y_field]
    if not y.strip():
        raise err(y_field, "empty response (nothing to score)" if not y else
                  "whitespace-only response (nothing to score)")
    rid = None
    if id_field is not None:
        found, rid = get_field(row, id_field)
        if not found or rid is None:
            raise err(id_field, f"missing (this record's keys: {field_keys(row)})")
    elif "id" in row:
        rid = row["id"]
    if rid is not None and not isinstance(rid, (str, int, float, bool)):
        raise err(id_field or "id", f"must be a string or a number, got {type(rid).__name__}")
    label = None
    if label_field is not None:
        found, label = get_field(row, label_field)
        if not found or (fmt != "jsonl" and label is None):
            raise err(label_field, f"missing (this record's keys: {field_keys(row)})")
    return Record(index=index, line=line, x=values[x_field], y=y, id=rid, label=label)


@dataclass(frozen=True)
class PairFields:
    """Which fields of a row make a :class:`~icqs_fast.io.records.PairRecord`: the instruction
    (``x_field``), the two outputs (``y_a_field``, ``y_b_field``), the id and the label of the
    better output (``label_field``: ``a`` / ``b``, or ``1`` / ``2`` as LLMBar's
    ``output_1`` / ``output_2``). With ``pair_field`` set, a pair is instead two consecutive
    plain records (``x_field``, ``y_field``) sharing that field's value, a then b, each
    labelled good or bad by ``label_field`` (``good`` / ``bad``, ``1`` / ``0``, ``true`` /
    ``false``, ``chosen`` / ``rejected``, ``better`` / ``worse``)."""

    x_field: str = "x"
    y_a_field: str = "y_a"
    y_b_field: str = "y_b"
    id_field: str | None = None
    label_field: str | None = None
    pair_field: str | None = None
    y_field: str = "y"

    def columns(self) -> list[str]:
        """The columns a CSV/TSV header or a Parquet file must have (a/b records)."""
        return [self.x_field, self.y_a_field, self.y_b_field] + (
            [self.label_field] if self.label_field else [])


# The label values that name the better output of an a/b record, and that mark a grouped
# record good or bad (text, as CSV gives them, is compared lower-cased).
BETTER_A = ("a", 1, "1", "output_1")
BETTER_B = ("b", 2, "2", "output_2")
GOOD_LABELS = (True, 1, "1", "good", "better", "chosen", "true", "yes")
BAD_LABELS = (False, 0, "0", "bad", "worse", "rejected", "false", "no")


def _norm(v: Any) -> Any:
    if isinstance(v, str):
        return v.strip().lower()
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _label_in(v: Any, values: tuple) -> bool:
    v = _norm(v)
    # True == 1 in Python: a bool matches only a bool
    return any(v == w and isinstance(v, bool) == isinstance(w, bool) for w in values)


def row_pair(row: dict, index: int, line: int, name: str, fields: PairFields,
             fmt: str = "jsonl") -> PairRecord:
    """The :class:`~icqs_fast.io.records.PairRecord` of one a/b row: x, y_a and y_b checked as
    :func:`row_record` checks x and y, the label read as the better output.

    Raises:
        RecordError: what is wrong, naming the field.
    """
    a = row_record(row, index, line, name, RecordFields(
        fields.x_field, fields.y_a_field, fields.id_field, fields.label_field), fmt)
    b = row_record(row, index, line, name, RecordFields(fields.x_field, fields.y_b_field), fmt)
    better = None
    if fields.label_field is not None:
        if _label_in(a.label, BETTER_A):
            better = "a"
        elif _label_in(a.label, BETTER_B):
            better = "b"
        else:
            raise RecordError(name, line, fields.label_field, "the better output is a or b "
                              f"(or 1 / 2), got {short_repr(a.label)}", index=index)
    return PairRecord(index, line, a.x, a.y, b.y, a.id, better)


def read_pairs(
    path: PathLike,
    fields: PairFields | None = None,
    *,
    format: str | None = None,
    encoding: str = "utf-8",
    skip: int = 0,
    stop: int | None = None,
    on_error: Callable[[RecordError], None] | str | None = None,
    allow_empty: bool = True,
) -> Iterator[PairRecord]:
    """Stream the pairs of a file (the formats of :func:`read_records`, whose arguments these
    are): one a/b record per pair, or (``fields.pair_field``) two consecutive records sharing
    the pair field's value. A group of another size, or whose two records differ in x, is a
    :class:`RecordError` naming the pair field (or x) at the line of the record that breaks
    it. ``skip`` / ``stop`` count records: the pairs whose first record lies in ``[skip,
    stop)``, whole; grouped ones grouped from the file's start (as the whole file groups them).

    Yields:
        :class:`~icqs_fast.io.records.PairRecord` s in file order (and
        :class:`RecordError` s with ``on_error="yield"``).
    """
    fields = fields or PairFields()
    fmt = detect_format(path, format)
    name = display_name(path)
    _check_source(path, fmt, name)
    if isinstance(on_error, str) and on_error != "yield":
        raise ValueError(f"on_error must be None, a callable or 'yield', got {on_error!r}")
    src = _Source(path, fmt, name, encoding)
    if fields.pair_field is None:
        return _records(src, fields, (skip, stop), on_error, allow_empty, make=row_pair)
    plain = _records(src, RecordFields(fields.x_field, fields.y_field, fields.pair_field,
                                       fields.label_field), (0, None), "yield", allow_empty)
    return _grouped(plain, name, fields, on_error, (skip, stop))


def _grouped(plain: Iterator[Any], name: str, fields: PairFields, on_error: Any,
             span: tuple[int, int | None]) -> Iterator[Any]:
    key = fields.pair_field

    def bad(rec: Record, field: str | None, reason: str) -> RecordError:
        return RecordError(name, rec.line, field, reason, index=rec.index)

    def group_of_one(rec: Record) -> RecordError:
        return bad(rec, key, f"pair {short_repr(rec.id)} has 1 record (a pair is 2 consecutive "
                   f"records with the same {key})")

    def pair_of(a: Record, b: Record) -> PairRecord | RecordError:
        if a.x != b.x:
            return bad(b, fields.x_field, f"pair {short_repr(a.id)}: not the x of its first "
                       f"record (line {a.line})")
        better = None
        if fields.label_field is not None:
            la, lb = (_label_in(r.label, GOOD_LABELS) - _label_in(r.label, BAD_LABELS)
                      for r in (a, b))
            if {la, lb} != {1, -1}:
                return bad(b, fields.label_field, f"pair {short_repr(a.id)}: the labels "
                           f"{short_repr(a.label)} and {short_repr(b.label)} do not mark one "
                           "output good and the other bad")
            better = "a" if la == 1 else "b"
        return PairRecord(a.index, a.line, a.x, a.y, b.y, a.id, better)

    def items() -> Iterator[Any]:
        pending: Record | None = None
        closed: Any = object()  # the key of the last complete pair: a third record is bad
        for rec in plain:
            if isinstance(rec, RecordError):
                if pending is not None:
                    yield group_of_one(pending)
                    pending = None
                yield rec
                continue
            if pending is not None:
                if rec.id == pending.id:
                    yield pair_of(pending, rec)
                    closed, pending = rec.id, None
                    continue
                yield group_of_one(pending)
                pending = None
            if rec.id == closed:
                yield bad(rec, key, f"pair {short_repr(rec.id)} has a third record (a pair is "
                          f"2 consecutive records with the same {key})")
                continue
            pending = rec
        if pending is not None:
            yield group_of_one(pending)

    skip, stop = span
    for item in items():  # in index order: the first one past the range ends it
        if stop is not None and item.index >= stop:
            return
        if item.index < skip:
            continue
        if isinstance(item, RecordError):
            if on_error is None:
                raise item
            if on_error != "yield":
                on_error(item)
                continue
        yield item


def read_pool_pairs(path: PathLike, fields: PairFields | None = None, *,
                    format: str | None = None, encoding: str = "utf-8"
                    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(good, bad)`` demonstration pools given as pairs (``--good-bad-pairs``): per pair
    ``(x, better)`` into good and ``(x, worse)`` into bad; the better output is the label's
    (``fields.label_field``), else a.

    Raises:
        InputError: a bad pair (file, line, field), or a file without pairs.
    """
    good, bad = [], []
    for p in read_pairs(path, fields, format=format, encoding=encoding, allow_empty=False):
        better, worse = (p.y_a, p.y_b) if p.label in (None, "a") else (p.y_b, p.y_a)
        good.append((p.x, better))
        bad.append((p.x, worse))
    return good, bad


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
    name = display_name(path)
    _check_source(path, fmt, name)
    return _plain_rows(path, fmt, name, list(fields), tuple(optional), encoding, max_line_bytes)


def _plain_rows(path, fmt, name, fields, optional, encoding, max_line_bytes):
    if fmt in ("parquet", "datasets"):
        rows = arrow_rows(path, fmt, name, fields, optional, 0, None)
        try:
            for index, line, row in rows:
                yield index, line, row
        finally:
            rows.close()
        return
    f = open_binary(path)
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
    name = display_name(path)
    if not os.path.exists(os.fspath(path)):
        raise FileNotFoundError(f"no such input file: {name}")
    if os.path.isdir(os.fspath(path)):
        raise InputError(name, None, None, "is a folder, not an input file")
    return _json_objects(path, name, encoding, max_line_bytes, allow_empty)


def _json_objects(path, name, encoding, max_line_bytes, allow_empty):
    n = 0
    with open_binary(path) as f:
        for _, line, obj in _jsonl_rows(f, name, 0, encoding, max_line_bytes):
            n += 1
            if isinstance(obj, RecordError):
                raise obj
            yield line, obj
    if n == 0 and not allow_empty:
        raise InputError(name, None, None, "no records (the file is empty or has only blank "
                         "lines)")


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
    out = [(r.x, r.y) for r in read_records(path, RecordFields(x_field, y_field), format=format,
                                            encoding=encoding)]
    if not out:
        raise InputError(display_name(path), None, None, "no examples in the file")
    return out
