"""The one declared schema of a scored record: every field of an ICQS result and of a glass-box
features result, declared once, and every writer derived from it.

A :class:`ResultField` says a field's name, element type, shape (dimensions named ``M+1``
mixture ratios, ``L`` sets per ratio), when it is present and what it means. From the two
declarations (:data:`ICQS_FIELDS`, :data:`FEATURE_FIELDS`) come:

* the JSON object of one record (:func:`icqs_row`, :func:`features_row`): the ``score`` /
  ``features`` JSONL lines, the ``--ray`` JSONL blocks and the local Parquet rows;
* the one Arrow schema of a results table (:func:`arrow_schema`), the same for ``-o X.parquet``
  and for the ``--ray`` Parquet blocks of the same job, so both read as one
  ``pyarrow.dataset``; :func:`rows_table` builds a table in it;
* the numpy columns of ``ICQSBatchScorer`` (:func:`column_arrays`);
* the ``/v1/score`` response model (``serve/schemas.py`` builds it from :data:`ICQS_FIELDS`);
* the field table of docs/scoring_files.md (:func:`markdown_table`, checked by a test).

Adding a field is one :class:`ResultField` here (plus, for an ICQS field, the attribute of
``ICQSResult`` it reads); ``tests/test_schema.py`` walks the declaration and checks that every
writer carries it.

No torch here (the io layer): a tensor value is read through its ``tolist()``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ResultField", "ICQS_FIELDS", "FEATURE_FIELDS", "PAIR_FIELDS", "ERROR_FIELD",
           "icqs_row", "result_row", "features_row", "pair_row", "arrow_schema", "table_row",
           "rows_table", "column_arrays", "fill_columns", "markdown_table", "text_value"]

# Element types: the Python type of a JSON value and its Arrow / numpy counterparts.
_TYPES = ("int", "float", "bool", "text")


@dataclass(frozen=True)
class ResultField:
    """One field of a scored record.

    Attributes:
        name: the key of the JSON line, the Parquet column, the batch column.
        type: element type: ``"int"``, ``"float"``, ``"bool"`` or ``"text"`` (``id`` and
            ``label`` are text in Parquet: strings as they are, other values as JSON text; in
            JSON lines they keep the input's value).
        shape: dimension names, ``()`` for a scalar; ``("L",)``, ``("M+1",)``,
            ``("M+1", "L")``.
        meaning: one line, for the docs and the server's schema.
        when: ``""`` (always present) or when it is present, e.g. ``"calibrated"``; an
            absent field is left out of a JSON line and null in a table.
        source: where the value comes from: ``"record"`` (the input record's attribute of
            that name: index, line, id, label), ``"result"`` (the result's attribute of that
            name), or ``"features"`` (the placeholder for the glass-box features, one float
            column each, in the order asked for).
        omit: when the field is left out of a JSON line: ``"none"`` (its value is None),
            ``"zero"`` (every element is 0) or ``""`` (never).
    """

    name: str
    type: str
    shape: tuple[str, ...] = ()
    meaning: str = ""
    when: str = ""
    source: str = "result"
    omit: str = ""

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"{self.name}: type must be one of {_TYPES}, got {self.type!r}")


_R = ResultField
# What every record line starts with: where it is in the input, and its id.
_RECORD = (
    _R("index", "int", meaning="0-based record number in the input (bad records count too)",
       source="record"),
    _R("line", "int", meaning="1-based line of the record in its file (Parquet / datasets "
       "inputs: the row number, index + 1)", source="record"),
    _R("id", "text", meaning="the input's id field (`--id-field`; default `id` when present)",
       when="the input has ids", source="record", omit="none"),
)

ICQS_FIELDS: tuple[ResultField, ...] = (
    *_RECORD,
    _R("label", "text", meaning="the input's `--label-field` value, copied",
       when="`--label-field` given", source="record"),
    _R("score", "float", meaning="ICQS-Epistemic: the argmax ratio (`argmax`), the mean ratio "
       "of the near-tied best (`tied`) or the posterior mean of the ratio (`mean`, the default)"),
    _R("score_per_set", "float", ("L",), "plain ICQS of each demonstration set"),
    _R("loglik", "float", ("M+1", "L"), "raw log P(y | demonstrations, x) summed over the "
       "response tokens, per context (whatever the calibration)"),
    _R("loglik_baseline", "float", ("M+1", "L"), "what `--calibrate` subtracts from `loglik` "
       "before scoring (content-free or premise-only log-likelihoods)", when="calibrated",
       omit="none"),
    _R("ratios", "float", ("M+1",), "the mixture ratios j / M of the contexts (share of good "
       "demonstrations)"),
    _R("n_response_tokens", "int", meaning="tokens of the response that are scored"),
    _R("n_prompt_tokens", "int", ("M+1", "L"), "tokens before the response in each context's "
       "prompt (BOS + demonstrations + query), as the model saw them"),
    _R("n_dropped_demos", "int", ("M+1", "L"), "oldest demonstrations dropped from each context "
       "to fit `--max-length` (`--drop-oldest-demos`)", when="some were dropped", omit="zero"),
    _R("truncated", "bool", meaning="demonstrations were dropped to fit the max length "
       "(nothing else is ever cut: a prompt that does not fit is an error)"),
    _R("join", "bool", meaning="the response's first token merges with the text before it "
       "under whole-text tokenization (that token, scored with the response, holds characters "
       "of the query too)"),
    _R("margin", "float", meaning="nats between the best and the second mixture ratio of the "
       "log-likelihoods averaged over sets: how far the argmax is from a tie"),
    _R("margins", "float", ("L",), "the same per set"),
    _R("near_ties", "int", meaning="sets whose margin is below `--tie-epsilon` (their plain "
       "ICQS argmax may flip under a change of dtype, backend or batch)"),
    _R("slope", "float", meaning="the posterior-mean score as the implied log-likelihood "
       "slope: nats from all-bad to all-good demonstrations (same ranking)"),
    _R("p_good", "float", meaning="sigmoid(slope): a readable scale, same ranking; not "
       "calibrated"),
    _R("p_good_calibrated", "float", meaning="P(good) of `score` through the monotone map the "
       "self-check fitted on held-out demonstrations of the pools (an even mix of good and "
       "bad answers); same ranking as `score`", when="the self-check gave an estimate",
       omit="none"),
    _R("verdict", "text", meaning="`good`, `bad` or `abstain`: with `--target-accuracy A`, "
       "`abstain` inside the self-check's abstain band (scores sent to a person so that the "
       "rest reaches accuracy A), `good` above it, `bad` below it; without, `good` at or above "
       "the self-check's equal-error threshold, else `bad`",
       when="the self-check gave an estimate", omit="none"),
)

FEATURE_FIELDS: tuple[ResultField, ...] = (
    *_RECORD,
    _R("n_tokens", "int", meaning="response tokens"),
    _R("<feature>", "float", meaning="each glass-box feature asked for (`--features`), in that "
       "order", source="features"),
    _R("n_prompt_tokens", "int", meaning="tokens of the chat-templated prompt before the "
       "response", omit="none"),
    _R("truncated", "bool", meaning="always false (`features` never cuts a prompt); there so "
       "that `score` and `features` lines filter alike", omit="none"),
    _R("join", "bool", meaning="the response's first token begins inside the prompt text under "
       "whole-text tokenization", omit="none"),
)

# One judged pair (icqs_fast.engine.pairs.PairResult): an instruction and its two outputs.
PAIR_FIELDS: tuple[ResultField, ...] = (
    *_RECORD,
    _R("label", "text", meaning="the better output by `--label-field`, `a` or `b`",
       when="`--label-field` given", source="record"),
    _R("score_a", "float", meaning="ICQS score of output a"),
    _R("score_b", "float", meaning="ICQS score of output b"),
    _R("preferred", "text", meaning="`a`, `b`, or `tie` when the margin is within the tie "
       "margin"),
    _R("margin", "float", meaning="`score_a - score_b`"),
    _R("p_a_better", "float", meaning="P(a better) from the self-check's calibrated P(good) of "
       "each output: pa (1 - pb) / (pa (1 - pb) + pb (1 - pa))",
       when="the self-check gave an estimate", omit="none"),
)

# A bad record skipped with --on-error skip keeps its place: index, line and this.
ERROR_FIELD = _R("error", "text", meaning="why a bad record was skipped (`--on-error skip`): "
                 "`field` and `reason`; every other field is then absent", when="skipped",
                 source="record", omit="none")


# --------------------------------------------------------------------------- values


def text_value(v: Any) -> str | None:
    """An ``id`` / ``label`` as Parquet text: a string as it is, None as null, anything else as
    its JSON text (so ids of any type make one column)."""
    return None if v is None else v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


_CAST = {"int": int, "float": float, "bool": bool}


def _value(f: ResultField, v: Any) -> Any:
    """``v`` as plain Python of the field's type and shape (a tensor or array through its
    ``tolist()``)."""
    if v is None or f.type == "text":
        return v
    if hasattr(v, "tolist"):
        v = v.tolist()
    cast = _CAST[f.type]

    def conv(x: Any, depth: int) -> Any:
        return [conv(y, depth - 1) for y in x] if depth else cast(x)

    return conv(v, len(f.shape))


def _flat(v: Any) -> list:
    return [y for x in v for y in _flat(x)] if isinstance(v, list) else [v]


def _omitted(f: ResultField, v: Any) -> bool:
    if f.omit == "none":
        return v is None
    if f.omit == "zero":
        return v is None or not any(_flat(v))
    return False


def _row(fields: Sequence[ResultField], rec: Any, res: Any, *, with_label: bool,
         features: Sequence[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields:
        if f.source == "features":
            out.update((k, float(res[k])) for k in features)
            continue
        if f.name == "label" and not with_label:
            continue
        if f.source == "record":
            v = getattr(rec, f.name)
        else:
            v = res.get(f.name) if isinstance(res, dict) else getattr(res, f.name, None)
        v = _value(f, v)
        if not _omitted(f, v):
            out[f.name] = v
    return out


def icqs_row(rec: Any, res: Any, *, with_label: bool = False) -> dict[str, Any]:
    """The JSON object of one scored record: the :data:`ICQS_FIELDS` of ``rec`` (a
    :class:`~icqs_fast.io.records.Record`: index, line, id, label) and ``res`` (an
    ``ICQSResult``), in declaration order, absent ones left out."""
    return _row(ICQS_FIELDS, rec, res, with_label=with_label)


def result_row(res: Any) -> dict[str, Any]:
    """The result's own :data:`ICQS_FIELDS` (not the record's index / line / id / label), in
    declaration order, absent ones left out: the ICQS part of a ``/v1/score`` item."""
    return _row([f for f in ICQS_FIELDS if f.source == "result"], None, res, with_label=False)


def features_row(rec: Any, row: dict[str, Any], features: Sequence[str]) -> dict[str, Any]:
    """The JSON object of one record's glass-box features: :data:`FEATURE_FIELDS` of ``rec``
    and of ``row`` (one ``glassbox`` row: ``n_tokens``, the features, the diagnostics), the
    features in the order of ``features``."""
    return _row(FEATURE_FIELDS, rec, row, with_label=False, features=features)


def pair_row(res: Any, rec: Any = None, *, with_label: bool = False) -> dict[str, Any]:
    """The JSON object of one judged pair: the :data:`PAIR_FIELDS` of ``rec`` (a
    :class:`~icqs_fast.io.records.PairRecord`: index, line, id, label; None: only the
    result's) and ``res`` (a ``PairResult``), in declaration order, absent ones left out."""
    fields = PAIR_FIELDS if rec is not None else [f for f in PAIR_FIELDS
                                                  if f.source == "result"]
    return _row(fields, rec, res, with_label=with_label)


# --------------------------------------------------------------------------- tables


def _arrow_type(f: ResultField) -> Any:
    import pyarrow as pa

    if f.name == "error":
        return pa.struct([("field", pa.string()), ("reason", pa.string())])
    t = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "text": pa.string()}[f.type]
    for _ in f.shape:
        t = pa.list_(t)
    return t


def _expand(fields: Sequence[ResultField], features: Sequence[str]) -> list[ResultField]:
    out = []
    for f in fields:
        if f.source == "features":
            out.extend(ResultField(k, "float", meaning=f.meaning) for k in features)
        else:
            out.append(f)
    return out


def arrow_schema(kind: str = "icqs", features: Sequence[str] = ()) -> Any:
    """The one ``pyarrow.Schema`` of a results table of ``kind`` (``"icqs"``, ``"pairs"`` or
    ``"features"``, with the feature names in order): every declared field (absent values
    null), 2-D fields as nested lists, ``id`` / ``label`` as text, and ``error`` last (a
    skipped bad record's row). Local ``-o X.parquet`` and ``--ray`` Parquet blocks of one job
    have exactly this schema."""
    import pyarrow as pa

    fields = _expand({"icqs": ICQS_FIELDS, "pairs": PAIR_FIELDS}.get(kind, FEATURE_FIELDS),
                     features)
    return pa.schema([pa.field(f.name, _arrow_type(f)) for f in [*fields, ERROR_FIELD]])


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """A JSON record as a row of :func:`arrow_schema`: ``id`` and ``label`` as text."""
    out = dict(row)
    for k in ("id", "label"):
        if k in out:
            out[k] = text_value(out[k])
    return out


def rows_table(rows: Iterable[dict[str, Any]], schema: Any) -> Any:
    """A ``pyarrow.Table`` of JSON records (:func:`icqs_row`, :func:`features_row`, skipped
    records) in ``schema`` (absent fields null)."""
    import pyarrow as pa

    return pa.Table.from_pylist([table_row(r) for r in rows], schema=schema)


def column_arrays(n: int, dims: dict[str, int], kind: str = "icqs",
                  features: Sequence[str] = ()) -> dict[str, Any]:
    """Empty numpy columns for ``n`` records of every declared result field (not the record's
    own ``index`` / ``line`` / ``id`` / ``label``): floats NaN, ints 0, bools False, shapes
    ``(n, *dims[d] for d in shape)`` (``dims``: ``{"M+1": ..., "L": ...}``). Fill them with
    :func:`fill_columns`."""
    import numpy as np

    dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_, "text": object}
    fill = {"int": 0, "float": np.nan, "bool": False, "text": None}
    out = {}
    for f in _expand(ICQS_FIELDS if kind == "icqs" else FEATURE_FIELDS, features):
        if f.source == "record":
            continue
        shape = (n, *(dims[d] for d in f.shape))
        out[f.name] = np.full(shape, fill[f.type], dtype=dtype[f.type])
    return out


def fill_columns(cols: dict[str, Any], i: int, row: dict[str, Any]) -> None:
    """Put one record's JSON object (:func:`icqs_row`) into row ``i`` of :func:`column_arrays`
    (fields absent from it keep their fill value)."""
    for k, a in cols.items():
        if k in row and row[k] is not None:
            a[i] = row[k]


# --------------------------------------------------------------------------- docs


def markdown_table(kind: str = "icqs") -> str:
    """The field table of docs/scoring_files.md: ``| field | type | present | meaning |``
    (``kind``: ``"icqs"``, ``"features"`` or ``"pairs"``)."""
    fields = ([*PAIR_FIELDS, ERROR_FIELD] if kind == "pairs" else
              [*(ICQS_FIELDS if kind == "icqs" else FEATURE_FIELDS), ERROR_FIELD])
    lines = ["| field | type | present | meaning |", "|---|---|---|---|"]
    for f in fields:
        typ = "".join(f"[{d}]" for d in f.shape) + " " + f.type if f.shape else f.type
        if f.name == "error":
            typ = "{field, reason}"
        lines.append(f"| `{f.name}` | {typ} | {f.when or 'always'} | {f.meaning} |")
    return "\n".join(lines)
