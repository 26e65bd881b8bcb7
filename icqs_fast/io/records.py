"""Records, the errors that name a file, line and field, and the small helpers every reader and
writer shares (format detection, field lookup, shards).
"""

from __future__ import annotations

import gzip
import json
import os
import sys
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
PARQUET_SUFFIXES = (".parquet", ".pq")

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
    return path.lower().endswith(PARQUET_SUFFIXES) or os.path.isdir(path)


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


@dataclass
class PairRecord:
    """One pair read from a file (``score --pairs``): an instruction and two outputs.

    Attributes:
        index, line: those of the pair's record (grouped by ``--pair-field``: of its first
            record, output a).
        x, y_a, y_b: the instruction and its two outputs.
        id: the record's id (grouped: the pair field's value).
        label: the better output by the label field, ``"a"`` or ``"b"`` (None without one).
    """

    index: int
    line: int
    x: str
    y_a: str
    y_b: str
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


def open_binary(path: PathLike) -> IO[bytes]:
    name = os.fspath(path)
    if name == "-":
        return sys.stdin.buffer
    if name.lower().endswith(".gz"):
        return gzip.open(name, "rb")
    return open(name, "rb")


def display_name(path: PathLike) -> str:
    return "<stdin>" if os.fspath(path) == "-" else os.fspath(path)


def get_field(obj: dict, field: str) -> tuple[bool, Any]:
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


def field_keys(row: dict) -> str:
    ks = [str(k) for k in row if k is not None]
    return ", ".join(ks[:12]) + (", ..." if len(ks) > 12 else "") if ks else "none"


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


def field_of(obj: dict, field: str, kind: type | tuple[type, ...], *, path: PathLike, line: int,
             index: int) -> Any:
    """``obj[field]`` (a dotted path allowed, e.g. ``"choices.0.turns"``), checked to be a
    ``kind``; a :class:`RecordError` naming the file, line and field otherwise (bool is not
    accepted as a number)."""
    found, v = get_field(obj, field)
    if not found:
        raise RecordError(path, line, field, f"missing (this record's keys: {field_keys(obj)})",
                          index=index)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise RecordError(path, line, field,
                          f"must be {want}, got {type(v).__name__} {short_repr(v)}", index=index)
    return v


def short_repr(v: Any, n: int = 40) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."
