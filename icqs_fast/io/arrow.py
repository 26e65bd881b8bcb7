"""Parquet files and Hugging Face ``datasets`` folders read one record batch at a time (pyarrow),
with the same row numbers and errors as the text readers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from icqs_fast.io.records import ARROW_BATCH_ROWS, InputError, PathLike

# --------------------------------------------------------------------------- Arrow inputs


def dataset_files(folder: str, name: str) -> list[str]:
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


def arrow_rows(path: PathLike, fmt: str, name: str, fields: list[str], optional: Sequence[str],
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
    for fn in dataset_files(os.fspath(path), name):
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


def arrow_count(path: PathLike, fmt: str, name: str) -> int:
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    if fmt == "parquet":
        try:
            return int(pq.read_metadata(os.fspath(path)).num_rows)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(name, None, None, f"not a readable Parquet file ({exc})") from None
    n = 0
    for fn in dataset_files(os.fspath(path), name):
        with pa.memory_map(fn, "r") as source:
            for batch in ipc.open_stream(source):
                n += batch.num_rows
    return n
