"""Reading responses and demonstrations from files, and writing results, lazily.

* :func:`read_records` streams :class:`Record` s from JSONL, CSV or TSV (optionally gzipped):
  one row at a time, so a file of millions of rows is never held in memory. Field names are
  mapped (``x_field``, ``y_field``, ``id_field``, ``label_field``).
* :func:`read_examples` reads a (small) good or bad demonstration file into ``(x, y)`` pairs.
* :func:`read_fpb` / :func:`fpb_examples` read the Financial PhraseBank ``sentence@label``
  format and build good (correct label) / bad (flipped label) demonstrations from it.
* :class:`JsonlWriter` writes one JSON object per line and flushes after each one.

Every problem with the input raises :class:`InputError` (a ``ValueError``) whose message names
the file, the line and the field, e.g. ``data.jsonl:17: field 'y': missing (keys: x, id)``.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

FORMATS = ("jsonl", "csv", "tsv")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}

PathLike = str | os.PathLike


class InputError(ValueError):
    """A problem with one place of an input file.

    Attributes:
        path: the file (``"<stdin>"`` for standard input).
        line: 1-based line number where the record starts (None for a whole-file problem).
        field: the field concerned (None when the problem is not about one field).
        reason: what is wrong, without the location.
    """

    def __init__(self, path: PathLike, line: int | None, field: str | None, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.field = field
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        what = f"field {field!r}: {reason}" if field is not None else reason
        super().__init__(f"{where}: {what}")


@dataclass
class Record:
    """One response read from a file.

    Attributes:
        index: 0-based position among the file's records (data rows; bad rows count too, so an
            index always means the same row whatever rows were skipped).
        line: 1-based line number where the record starts.
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
    optionally followed by ``.gz``)."""
    if format is not None:
        f = format.lower()
        if f in ("ndjson", "json-lines"):
            f = "jsonl"
        if f not in FORMATS:
            raise ValueError(f"unknown input format {format!r}; use one of {', '.join(FORMATS)}")
        return f
    name = os.fspath(path)
    if name == "-":
        return "jsonl"
    p = Path(name.lower())
    suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
    if suffix not in _EXTENSIONS:
        raise ValueError(
            f"{name}: cannot tell the format from the extension {suffix or '(none)'!r}; "
            f"use .jsonl, .csv or .tsv (optionally .gz) or pass the format explicitly"
        )
    return _EXTENSIONS[suffix]


def _open_text(path: PathLike, encoding: str = "utf-8") -> IO[str]:
    name = os.fspath(path)
    if name == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding=encoding, newline="")
    if name.lower().endswith(".gz"):
        return gzip.open(name, "rt", encoding=encoding, newline="")
    return open(name, encoding=encoding, newline="")


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


def _jsonl_rows(f: IO[str], name: str, skip: int) -> Iterator[tuple[int, int, Any]]:
    """(index, line, object) per non-blank line; the object is None for the first ``skip``
    records (counted, not parsed) and an :class:`InputError` for a bad line (reading goes on)."""
    index = 0
    for lineno, text in enumerate(f, start=1):
        if lineno == 1 and text.startswith("\ufeff"):
            text = text[1:]
        if not text.strip():
            continue
        if index < skip:
            index += 1
            yield index - 1, lineno, None
            continue
        index += 1
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            yield index - 1, lineno, InputError(
                name, lineno, None, f"invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            obj = InputError(name, lineno, None,
                             f"expected a JSON object, got {type(obj).__name__}")
        yield index - 1, lineno, obj


def _table_rows(f: IO[str], name: str, delimiter: str, fields: list[str], skip: int
                ) -> Iterator[tuple[int, int, Any]]:
    """Like :func:`_jsonl_rows`, for CSV/TSV with a header row (a bad header raises)."""
    # TSV is read as plain tab-separated text (no quoting, as in GLUE); CSV with standard quoting.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise InputError(name, 1, None, f"malformed header ({exc})") from None
    if header and header[0].startswith("\ufeff"):
        header[0] = header[0][1:]
    header = [h.strip() for h in header]
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
                yield index - 1, start, InputError(name, start, None, f"malformed row ({exc})")
            continue
        last = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue  # blank line
        index += 1
        if index <= skip:
            yield index - 1, start, None
        elif len(row) > len(header):
            yield index - 1, start, InputError(
                name, start, None, f"{len(row)} columns but the header has {len(header)}")
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
    on_error: Callable[[InputError], None] | None = None,
) -> Iterator[Record]:
    """Stream the records of a JSONL, CSV or TSV file (``"-"``: JSONL on standard input).

    Nothing is read until the first record is asked for, and only one row is held at a time.

    Args:
        path: the file; ``.gz`` files are decompressed on the fly.
        format: ``"jsonl"``, ``"csv"`` or ``"tsv"``; from the extension if None.
        x_field, y_field: the fields holding the prompt and the response (JSONL also takes a
            dotted path such as ``"turns.0"``). CSV/TSV files need a header row.
        id_field: the field with the record's id; ``None`` uses ``"id"`` when a record has it.
        label_field: a field to carry along (e.g. a gold label); required in every record.
        encoding: text encoding.
        skip: records before this index are counted but neither parsed nor checked (resume).
        on_error: called with each :class:`InputError` of a single record, and reading goes on;
            if None the error is raised. Errors about the whole file (bad header, unreadable
            file) are always raised.

    Yields:
        :class:`Record` s in file order.

    Raises:
        InputError: missing field, non-string x/y, invalid JSON, empty response, ...
        FileNotFoundError: no such file.
    """
    fmt = detect_format(path, format)
    name = _display(path)
    if name != "<stdin>" and not os.path.exists(os.fspath(path)):
        raise FileNotFoundError(f"no such input file: {name}")
    if name != "<stdin>" and os.path.isdir(os.fspath(path)):
        raise InputError(name, None, None, "is a folder, not an input file")
    return _records(path, fmt, name, x_field, y_field, id_field, label_field, encoding, skip,
                    on_error)


def _records(path, fmt, name, x_field, y_field, id_field, label_field, encoding, skip, on_error):
    required = [x_field, y_field] + ([label_field] if label_field else [])
    with _open_text(path, encoding) as f:
        if fmt == "jsonl":
            rows = _jsonl_rows(f, name, skip)
        else:
            cols = required + ([id_field] if id_field else [])
            rows = _table_rows(f, name, "," if fmt == "csv" else "\t", cols, skip)
        while True:
            try:
                index, line, row = next(rows)
            except StopIteration:
                return
            except UnicodeDecodeError as exc:
                raise InputError(name, None, None,
                                 f"not valid {encoding} text ({exc.reason}); pass the right "
                                 "encoding") from None
            if row is None:
                continue
            try:
                if isinstance(row, InputError):
                    raise row
                rec = _record(row, index, line, name, fmt, x_field, y_field, id_field,
                              label_field)
            except InputError as exc:
                if on_error is None:
                    raise
                on_error(exc)
                continue
            yield rec


def _record(row: dict, index: int, line: int, name: str, fmt: str, x_field: str, y_field: str,
            id_field: str | None, label_field: str | None) -> Record:
    values = {}
    for field in (x_field, y_field):
        found, v = _get(row, field)
        if not found or (fmt != "jsonl" and v is None):
            what = "keys" if fmt == "jsonl" else "columns"
            raise InputError(name, line, field,
                             f"missing (this record's {what}: {_keys(row)})")
        if not isinstance(v, str):
            raise InputError(name, line, field,
                             f"must be a string, got {type(v).__name__} {_short(v)}")
        values[field] = v
    y = values[y_field]
    if not y.strip():
        raise InputError(name, line, y_field, "empty response (nothing to score)")
    rid = None
    if id_field is not None:
        found, rid = _get(row, id_field)
        if not found or rid is None:
            raise InputError(name, line, id_field, f"missing (this record's keys: {_keys(row)})")
    elif "id" in row:
        rid = row["id"]
    if rid is not None and not isinstance(rid, (str, int, float, bool)):
        raise InputError(name, line, id_field or "id",
                         f"must be a string or a number, got {type(rid).__name__}")
    label = None
    if label_field is not None:
        found, label = _get(row, label_field)
        if not found or (fmt != "jsonl" and label is None):
            raise InputError(name, line, label_field,
                             f"missing (this record's keys: {_keys(row)})")
    return Record(index=index, line=line, x=values[x_field], y=y, id=rid, label=label)


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
    """Append-or-create JSONL writer that flushes every record as soon as it is written.

    Args:
        path: output file; parent folders are created.
        append: append to an existing file instead of truncating it.
        fsync: also ``os.fsync`` after each record (survives a machine crash, slower).
    """

    def __init__(self, path: PathLike, *, append: bool = False, fsync: bool = False) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self._fsync = fsync
        self.count = 0

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n")
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())
        self.count += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class ResumeState:
    """What an existing results file holds: ``last`` is the last complete record (None if none),
    ``count`` the number of complete records, ``end`` the byte offset just after it."""

    last: dict | None
    count: int
    end: int


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
