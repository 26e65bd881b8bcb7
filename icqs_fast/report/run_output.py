"""A scoring run's output read back for the report and the drift check, streamed and summarised
in bounded memory.

:func:`open_run` finds what an output is - a JSONL file, a Parquet file (with the committed
parts of an unfinished run, :func:`icqs_fast.io.results.parquet_output`) or a ``--ray`` folder
(:class:`icqs_fast.io.blocks.BlockOutput`) - and its metadata (``OUT.meta.json`` or
``OUT/run.meta.json``, read by the targets of :mod:`icqs_fast.io.runs` and
:mod:`icqs_fast.io.blocks`).
:meth:`RunOutput.rows` streams its records (only the fields the report reads; Parquet reads only
those columns). :func:`summarise` walks them once into a :class:`RunSummary`: fixed-bin
histograms per label, reservoir samples, top-k heaps of the least certain records and of the
most confident mistakes, the confusion at the threshold, and (for the drift check, when asked)
compact per-record columns. A million-record output is summarised in a few tens of MB at most
(the columns: 41 bytes a record, only with ``columns=True``), the rest is bounded.

No torch (a report is read where no model is loaded).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icqs_fast.io.blocks import META_FILE, BlockOutput, is_uri
from icqs_fast.io.records import InputError
from icqs_fast.io.results import output_format, parquet_output
from icqs_fast.io.runs import FileTarget
from icqs_fast.io.schema import text_value

__all__ = ["RunOutput", "RunSummary", "Scored", "open_run", "summarise", "label_class",
           "HIST_BINS", "TOP_K"]

# The fields a summary reads (io/schema.py ICQS_FIELDS; ``verdict`` when a run has one).
READ_FIELDS = ("index", "id", "label", "score", "p_good_calibrated", "margin", "near_ties",
               "score_per_set", "verdict", "error")
# Equal-width bins over [0, 1] (score and p_good_calibrated both lie there), fine enough that
# the page can zoom into the occupied range (ICQS scores often sit within 0.4-0.6).
HIST_BINS = 400
TOP_K = 10  # records per "least certain" / "confident mistakes" table
RESERVOIR = 20000  # per distribution: the KS test and the PSI read these samples
MAX_LABELS = 20  # distinct labels kept apart; more are pooled as "(other)"

# Labels read as good / bad for the confusion and the mistakes (case-insensitive text).
GOOD_LABELS = {"good", "1", "true", "yes", "pos", "positive", "acceptable", "correct"}
BAD_LABELS = {"bad", "0", "false", "no", "neg", "negative", "unacceptable", "incorrect", "wrong"}


def label_class(label: Any) -> int | None:
    """1 for a label read as good, 0 for bad (:data:`GOOD_LABELS` / :data:`BAD_LABELS`, any
    case; JSON true / false / 1 / 0 too), None otherwise."""
    if label is None:
        return None
    t = (label if isinstance(label, str) else json.dumps(label)).strip().lower()
    return 1 if t in GOOD_LABELS else 0 if t in BAD_LABELS else None


@dataclass
class RunOutput:
    """One run's output (from :func:`open_run`).

    Attributes:
        path: the output as given.
        kind: ``"jsonl"``, ``"parquet"`` or ``"blocks"`` (a ``--ray`` folder).
        meta: its metadata (the run's settings and self-check; ``{}`` without a meta file).
        meta_file: where the metadata was read from (None without one).
        files: the files holding its records, in record order.
    """

    path: str
    kind: str
    meta: dict
    meta_file: str | None
    files: list[str]
    _blocks: BlockOutput | None = None

    def rows(self) -> Iterator[tuple[str, int, dict]]:
        """``(file, line or row number, record)`` for every record (skipped bad records
        included: they hold ``error``), in file order; only :data:`READ_FIELDS`.

        Raises:
            InputError: a line that is not a result record (file and line named); an incomplete
                last line of a JSONL file (a run still writing, or killed) is left out.
        """
        for f in self.files:
            fmt = "parquet" if f.lower().endswith((".parquet", ".pq")) else "jsonl"
            if fmt == "parquet":
                yield from _parquet_rows(f, self._blocks)
            else:
                yield from _jsonl_rows(f, self._blocks)


def _open_binary(path: str, blocks: BlockOutput | None) -> Any:
    if blocks is not None:
        return blocks.fs.open_input_stream(path)
    return open(path, "rb")


def _jsonl_rows(path: str, blocks: BlockOutput | None) -> Iterator[tuple[str, int, dict]]:
    with _open_binary(path, blocks) as f:
        data = f if blocks is None else iter(f.read().splitlines(keepends=True))
        pending: tuple[int, bytes] | None = None  # a bad line: an error only if more follow
        for lineno, raw in enumerate(data, start=1):
            if not raw.strip():
                continue
            if pending is not None:
                raise InputError(path, pending[0], None, "not a result record (a JSON object "
                                 "with an integer index) and more records follow it")
            try:
                obj = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("index"), int):
                pending = (lineno, raw)
                continue
            yield path, lineno, {k: obj[k] for k in READ_FIELDS if k in obj}


def _parquet_rows(path: str, blocks: BlockOutput | None) -> Iterator[tuple[str, int, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path if blocks is None else blocks.fs.open_input_file(path))
        names = set(pf.schema_arrow.names)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(path, None, None, f"not a readable Parquet results file ({exc})"
                         ) from None
    if "index" not in names:
        raise InputError(path, None, "index", "not a results file (no index column)")
    cols = [c for c in READ_FIELDS if c in names]
    row = 0
    with pf:
        for batch in pf.iter_batches(batch_size=8192, columns=cols):
            for rec in batch.to_pylist():
                row += 1
                yield path, row, {k: v for k, v in rec.items() if v is not None}


def open_run(path: str | os.PathLike) -> RunOutput:
    """The output at ``path`` (a JSONL or Parquet results file, or a ``--ray`` folder: a path or
    a pyarrow filesystem URI such as ``s3://bucket/out``) and its metadata.

    Raises:
        FileNotFoundError: nothing there.
        InputError: a folder that is not a ``--ray`` output, an unreadable meta file.
    """
    p = os.fspath(path)
    if os.path.isdir(p) or is_uri(p):  # a --ray folder, mounted or on a pyarrow filesystem
        bo = BlockOutput(p)
        blocks = sorted(n for n in bo.parts() if ".tmp." not in n
                        and n.endswith((".jsonl", ".parquet")))
        if not blocks and not bo.exists(META_FILE):
            raise InputError(p, None, None, "is a folder without block files (part-*.jsonl / "
                             f"part-*.parquet) or {META_FILE}: not a --ray output")
        meta = _meta(lambda: bo.read_meta(), bo.path(META_FILE))
        return RunOutput(p, "blocks", meta or {}, bo.path(META_FILE) if meta is not None
                         else None, [bo.path(n) for n in blocks], _blocks=bo)
    target = FileTarget(p)
    fmt = output_format(p)
    if fmt == "parquet":
        st = parquet_output(p)
        files = [os.fspath(f) for f in ([st.main] if st.main else []) + st.parts]
        if not files:
            raise FileNotFoundError(f"no such output: {p}")
    else:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such output: {p}")
        files = [p]
    meta_file = f"{p}.meta.json"
    meta = _meta(target.read_meta, meta_file)
    return RunOutput(p, fmt, meta or {}, meta_file if meta is not None else None, files)


def _meta(read: Any, where: str) -> dict | None:
    try:
        meta = read()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(where, getattr(exc, "lineno", None), None,
                         f"not a readable meta file ({exc})") from None
    if meta is not None and not isinstance(meta, dict):
        raise InputError(where, 1, None, "not a meta file (a JSON object)")
    return meta


# --------------------------------------------------------------------------- the summary


@dataclass
class Scored:
    """One record as the report's tables show it (no per-set arrays)."""

    index: int
    id: Any
    label: Any
    score: float
    p: float | None
    margin: float | None
    near_ties: int | None
    spread: float | None  # max - min of score_per_set
    verdict: str | None
    where: str  # file:line

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _TopK:
    """The ``k`` items with the highest priority seen so far (ties: the earliest kept)."""

    def __init__(self, k: int) -> None:
        self.k, self.heap, self.n = k, [], 0

    def push(self, priority: float, item: Any) -> None:
        self.n += 1
        entry = (priority, -self.n, item)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, entry)
        elif entry[:2] > self.heap[0][:2]:
            heapq.heapreplace(self.heap, entry)

    def items(self) -> list[Any]:
        return [e[2] for e in sorted(self.heap, key=lambda e: (e[0], e[1]), reverse=True)]


class _Reservoir:
    """A uniform sample of at most ``cap`` values (Algorithm R, seeded: the same output gives
    the same sample)."""

    def __init__(self, cap: int, seed: int) -> None:
        self.cap, self.n, self.values = cap, 0, array("d")
        self.rng = random.Random(seed)

    def add(self, v: float) -> None:
        self.n += 1
        if len(self.values) < self.cap:
            self.values.append(v)
        else:
            j = self.rng.randrange(self.n)
            if j < self.cap:
                self.values[j] = v


@dataclass
class _Moments:
    n: int = 0
    s: float = 0.0
    ss: float = 0.0

    def add(self, v: float) -> None:
        self.n, self.s, self.ss = self.n + 1, self.s + v, self.ss + v * v

    @property
    def mean(self) -> float:
        return self.s / self.n if self.n else math.nan

    @property
    def sd(self) -> float:
        if self.n < 2:
            return math.nan
        return math.sqrt(max(0.0, (self.ss - self.s * self.s / self.n) / (self.n - 1)))


@dataclass
class RunSummary:
    """What one pass over an output keeps (see the module docstring).

    Attributes:
        n: scored records; n_skipped: skipped bad records (``error``); n_nan: scored records
            whose score is NaN (left out of everything else).
        labels: records per label (as text; ``None`` key without a label).
        hist: ``{"score" | "p": {label: [HIST_BINS counts]}}`` over [0, 1].
        moments: ``{"score" | "p": {label: _Moments}}`` (label ``"*"``: all records).
        samples: ``{"score" | "p": _Reservoir}``, for KS and PSI.
        threshold: the score threshold used for the verdicts (the self-check's) or NaN.
        verdicts: records per verdict (the record's ``verdict`` field, else good / bad from
            ``threshold``).
        confusion: ``{(label 1/0, verdict): count}`` for records with a good / bad label.
        unrecognised_labels: labels that are neither good nor bad (:func:`label_class`).
        least_margin, most_ties, widest_spread, closest: top-k :class:`Scored` lists.
        mistakes: the most confident mistakes (verdict against a good / bad label), most
            confident first.
        columns: per-record ``key`` (64-bit hash of the id, or the index), ``score``, ``p``,
            ``verdict`` (1 good, 0 bad, 2 abstain, -1 none), ``label`` (64-bit hash, 0 none)
            when asked for (drift).
    """

    n: int = 0
    n_skipped: int = 0
    n_nan: int = 0
    labels: dict = field(default_factory=dict)
    hist: dict = field(default_factory=dict)
    moments: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    threshold: float = math.nan
    verdicts: dict = field(default_factory=dict)
    verdict_source: str = "none"
    confusion: dict = field(default_factory=dict)
    unrecognised_labels: set = field(default_factory=set)
    least_margin: list = field(default_factory=list)
    most_ties: list = field(default_factory=list)
    widest_spread: list = field(default_factory=list)
    closest: list = field(default_factory=list)
    mistakes: list = field(default_factory=list)
    columns: dict | None = None
    keyed_by: str = "id"

    @property
    def has_labels(self) -> bool:
        return any(k is not None for k in self.labels)


VERDICT_CODE = {"good": 1, "bad": 0, "abstain": 2}


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                          "little", signed=True)


def _bin(v: float) -> int:
    return min(HIST_BINS - 1, max(0, int(v * HIST_BINS)))


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) \
        and math.isfinite(v) else None


def summarise(run: RunOutput, *, threshold: float = math.nan, columns: bool = False,
              k: int = TOP_K, seed: int = 0) -> RunSummary:
    """One streamed pass over ``run``'s records (:meth:`RunOutput.rows`) into a
    :class:`RunSummary`.

    ``threshold``: the score threshold that makes a verdict (good when ``score >=
    threshold``) for records without a ``verdict`` field; NaN: no verdicts then. ``columns``:
    also keep the per-record columns the drift check matches (ids hashed to 64 bits; the index
    when the output has no ids). ``k``: rows per top-k table.
    """
    s = RunSummary(threshold=threshold)
    s.hist = {"score": {}, "p": {}}
    s.moments = {"score": {"*": _Moments()}, "p": {"*": _Moments()}}
    s.samples = {"score": _Reservoir(RESERVOIR, seed), "p": _Reservoir(RESERVOIR, seed + 1)}
    tops = {"least_margin": _TopK(k), "most_ties": _TopK(k), "widest_spread": _TopK(k),
            "closest": _TopK(k), "mistakes": _TopK(k)}
    cols = {"key": array("q"), "index": array("q"), "score": array("d"), "p": array("d"),
            "verdict": array("b"), "label": array("q")} if columns else None
    all_ids = True
    no_score, first = 0, ("", 0)
    sources = set()
    for where, line, r in run.rows():
        if "error" in r:
            s.n_skipped += 1
            continue
        if "score" not in r:
            no_score += 1
            if s.n == 0 and s.n_nan == 0 and no_score == 1:
                first = (where, line)
            continue
        score = _float(r.get("score"))
        if score is None:
            s.n_nan += 1
            continue
        s.n += 1
        raw_label = r.get("label")
        label = text_value(raw_label)
        if label not in s.labels and len(s.labels) >= MAX_LABELS:
            label = "(other)"
        s.labels[label] = s.labels.get(label, 0) + 1
        p = _float(r.get("p_good_calibrated"))
        for what, v in (("score", score), ("p", p)):
            if v is None:
                continue
            h = s.hist[what].setdefault(label, [0] * HIST_BINS)
            h[_bin(v)] += 1
            s.moments[what]["*"].add(v)
            s.moments[what].setdefault(label, _Moments()).add(v)
            s.samples[what].add(v)
        verdict = r.get("verdict")
        if verdict in VERDICT_CODE:
            sources.add("field")
        elif not math.isnan(threshold):
            verdict = "good" if score >= threshold else "bad"
            sources.add("threshold")
        else:
            verdict = None
        if verdict is not None:
            s.verdicts[verdict] = s.verdicts.get(verdict, 0) + 1
        cls = label_class(raw_label)
        if raw_label is not None and cls is None:
            if len(s.unrecognised_labels) < MAX_LABELS:
                s.unrecognised_labels.add(label)
        elif cls is not None and verdict is not None:
            s.confusion[(cls, verdict)] = s.confusion.get((cls, verdict), 0) + 1
        sps = [x for x in (r.get("score_per_set") or []) if _float(x) is not None]
        margin = _float(r.get("margin"))
        ties = r.get("near_ties") if isinstance(r.get("near_ties"), int) else None
        spread = (max(sps) - min(sps)) if len(sps) >= 2 else None
        # Each heap is offered the record only when it would enter (so Scored is built for few).
        offers = [(name, prio) for name, prio in (
            ("least_margin", None if margin is None else -margin),
            ("most_ties", (ties, -(margin or 0.0)) if ties else None),
            ("widest_spread", spread),
            ("closest", None if math.isnan(threshold) else -abs(score - threshold)))
            if prio is not None and (len(tops[name].heap) < k or prio > tops[name].heap[0][0])]
        if cls is not None and verdict in ("good", "bad") and (verdict == "good") != (cls == 1):
            conf = abs(p - 0.5) if p is not None else abs(score - threshold)
            t = tops["mistakes"]
            if len(t.heap) < k or conf > t.heap[0][0]:
                offers.append(("mistakes", conf))
        if offers:
            item = Scored(r["index"], r.get("id"), raw_label, score, p, margin, ties, spread,
                          verdict, f"{where}:{line}")
            for name, prio in offers:
                tops[name].push(prio, item)
        if cols is not None:
            rid = r.get("id")
            all_ids = all_ids and rid is not None
            cols["key"].append(_hash64(text_value(rid)) if rid is not None else 0)
            cols["index"].append(r["index"])
            cols["score"].append(score)
            cols["p"].append(math.nan if p is None else p)
            cols["verdict"].append(VERDICT_CODE.get(verdict, -1) if verdict else -1)
            cols["label"].append(0 if label is None else _hash64(label))
    if no_score and not (s.n or s.n_nan):
        raise InputError(first[0], first[1], "score", "no record has a score: not the output "
                         "of icqs-fast score (a features output?)")
    if no_score:
        raise InputError(first[0], first[1], "score", f"{no_score} records have no score "
                         "(and others do): not one score output")
    for name, t in tops.items():
        setattr(s, name, t.items())
    s.verdict_source = "+".join(sorted(sources)) or "none"
    if cols is not None:
        if not all_ids:  # some record has no id: match every record by its index
            cols["key"] = cols["index"]
        s.columns = cols
        s.keyed_by = "id" if all_ids else "index"
    return s


_BIDI = set("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def record_texts(input_path: str, meta: dict, ids: dict[int, Any], *, limit: int = 400
                 ) -> dict[int, tuple[str, str]]:
    """``{index: (x, y)}`` of the input records at the indices of ``ids`` (``{index: the
    output's id or None}``; one streamed pass of the scored input, read with the run's own
    fields and encoding from ``meta``), each text cut to ``limit`` characters (an ellipsis
    marks a cut).

    Raises:
        InputError: a record whose id is not the output's at that index (not the scored
            input), naming the input's file and line.
    """
    from icqs_fast.io.readers import RecordFields, read_records

    def cut(t: str) -> str:
        # Bidirectional controls are shown as their code points: an override in one record's
        # text must not reorder what the page shows after it (Trojan-source style).
        t = "".join(f"<U+{ord(c):04X}>" if c in _BIDI else c for c in " ".join(str(t).split()))
        return t if len(t) <= limit else t[:limit - 1] + "\u2026"

    if not ids:
        return {}
    fields = RecordFields(meta.get("x_field") or "x", meta.get("y_field") or "y",
                          meta.get("id_field"))
    out: dict[int, tuple[str, str]] = {}
    last = max(ids)
    for rec in read_records(Path(input_path), fields, encoding=meta.get("encoding") or "utf-8",
                            on_error="yield", stop=last + 1):
        if rec.index not in ids or not hasattr(rec, "x"):
            continue
        want = ids[rec.index]
        if want is not None and text_value(rec.id) != text_value(want):
            raise InputError(input_path, rec.line, meta.get("id_field") or "id",
                             f"record {rec.index} has id {rec.id!r} but the output's record "
                             f"{rec.index} has id {want!r}: not the scored input (--input)")
        out[rec.index] = (cut(rec.x), cut(rec.y))
    return out
