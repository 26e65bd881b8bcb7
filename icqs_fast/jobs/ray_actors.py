"""Scale-out on Ray Data: callable classes for ``ray.data.Dataset.map_batches``.

    import ray
    from ray.data import ActorPoolStrategy
    from icqs_fast.jobs.ray_actors import ICQSBatchScorer, ModelSpec

    ds = ray.data.read_parquet("responses.parquet")          # columns x, y (, id)
    scored = ds.map_batches(
        ICQSBatchScorer, fn_constructor_kwargs={"good": "good.jsonl", "bad": "bad.jsonl",
                                                "model": ModelSpec(dtype="bf16")},
        batch_size=256,                                      # responses per call
        compute=ActorPoolStrategy(size=4), num_gpus=1,       # one actor = one model = one GPU
    )

Each actor loads the model once (a local folder or the embedded SmolLM2-135M; dtype, device,
8/4-bit), reads the demonstration files and builds the ICQS prefix bank once; every call then
scores a batch (a dict of numpy columns or a pandas DataFrame). A response's M+1 x L contexts
are always scored inside one call, so the prefix sharing stays intact whatever ``batch_size``.

* :class:`ICQSBatchScorer`: ``x``, ``y`` (``id``, ``index`` passed through) -> ``score``,
  ``score_per_set`` ``[n, L]``, ``loglik`` ``[n, M+1, L]`` float64 (Ray stores it as a tensor
  column, its shape ``(M+1, L)`` in the schema), ``loglik_baseline`` (calibrated runs only,
  the same shape), ``n_response_tokens``, ``n_prompt_tokens`` ``[n, M+1, L]``, ``error``
  (None, or ``"field: reason"`` for a record the scorer rejects; its numbers are NaN / 0).
* :class:`GlassboxBatchScorer`: ``x``, ``y`` -> ``n_tokens`` and one float64 column per
  glass-box feature, ``error``.

Choosing the pool (see docs/SCALEOUT.md): on GPUs one actor per GPU (``num_gpus=1``,
``concurrency`` = number of GPUs); on CPUs one actor per ``num_cpus`` cores (Ray sets the
actor's ``OMP_NUM_THREADS`` to its ``num_cpus``). ``batch_size`` only needs to be large enough to
fill the engine's token budget (a few hundred responses); larger batches only add latency.

A batch's rows become records by the reader's own rule (:func:`icqs_fast.io.readers.
row_record`: x and y strings, y not blank), so a bad row gets the message the file reader gives.

The ``--ray`` run of ``icqs-fast score`` / ``features`` (:mod:`icqs_fast.jobs.ray_executor`)
runs the job's own strategy on each actor instead, over deterministic input blocks
(:class:`BlockSpec`) that the actor reads itself (:func:`block_items`): records never travel
as columns.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from icqs_fast.io.readers import (
    PairFields,
    RecordFields,
    read_examples,
    read_pairs,
    read_records,
    row_record,
)
from icqs_fast.io.records import PairRecord, PathLike, Record, RecordError
from icqs_fast.io.schema import column_arrays, features_row, fill_columns, icqs_row
from icqs_fast.jobs.config import DEFAULT_FEATURES
from icqs_fast.jobs.features import RecordNames, feature_records
from icqs_fast.models import runtime_settings

__all__ = ["ICQSBatchScorer", "GlassboxBatchScorer", "ModelSpec", "BlockSpec", "block_items"]


@dataclass(frozen=True)
class ModelSpec:
    """Which model an actor loads, and how (:func:`icqs_fast.models.load_model`'s arguments):
    ``model`` a local Hugging Face folder, None (or ``"embedded"``) for the embedded
    SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "none"  # --quantization: none, int8, nf4
    device_map: str = "none"  # --device-map: none, auto (the actor's GPUs)

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``."""
        from icqs_fast.models import device_map_kwargs, load_model, quantization_kwargs

        return load_model(None if self.model in (None, "embedded") else self.model,
                          dtype=self.dtype, device=self.device,
                          **quantization_kwargs(self.quantization, self.device),
                          **device_map_kwargs(self.device_map, self.device))


def _model_spec(model: ModelSpec | str | None) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec(model)


# --------------------------------------------------------------------------- batches


def batch_columns(batch: Any) -> dict[str, np.ndarray]:
    """A map_batches batch (dict of numpy arrays, pandas DataFrame or pyarrow Table) as a dict
    of numpy arrays."""
    if isinstance(batch, dict):
        return {k: np.asarray(v) for k, v in batch.items()}
    if hasattr(batch, "to_pydict") and hasattr(batch, "schema"):  # pyarrow.Table
        return {k: np.asarray(v, dtype=object) for k, v in batch.to_pydict().items()}
    if hasattr(batch, "columns") and hasattr(batch, "to_numpy"):  # pandas.DataFrame
        return {str(k): batch[k].to_numpy() for k in batch.columns}
    raise TypeError(f"a batch must be a dict of numpy arrays, a pandas DataFrame or a pyarrow "
                    f"Table, got {type(batch).__name__}")


def _batch_records(cols: dict[str, np.ndarray], x_field: str, y_field: str
                   ) -> list[Record | RecordError]:
    """Records of a plain batch (``x``/``y`` columns; ``index`` defaults to the row number),
    checked by the reader's rule (:func:`~icqs_fast.io.readers.row_record`)."""
    for f in (x_field, y_field):
        if f not in cols:
            raise ValueError(f"batch has no column {f!r} (columns: {', '.join(cols)})")
    n = len(cols[x_field])
    index = cols.get("index")
    fields = RecordFields(x_field, y_field)
    out: list[Record | RecordError] = []
    for i in range(n):
        idx = int(index[i]) if index is not None else i
        row = {x_field: cols[x_field][i], y_field: cols[y_field][i]}
        try:
            out.append(row_record(row, idx, idx + 1, "<batch>", fields))
        except RecordError as exc:
            out.append(exc)
    return out


def _passthrough(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: cols[k] for k in ("id", "index") if k in cols}


def _load_demos(demos: PathLike | Sequence, x_field: str, y_field: str,
                encoding: str = "utf-8") -> list[tuple[str, str]]:
    if isinstance(demos, (str, os.PathLike)):
        return read_examples(demos, x_field=x_field, y_field=y_field, encoding=encoding)
    return [(str(x), str(y)) for x, y in demos]


class ICQSBatchScorer:
    """ICQS scorer for ``Dataset.map_batches`` (a callable class: one instance per actor).

    Args:
        good, bad: demonstration files (JSONL/CSV/TSV with the ``columns`` fields) or
            sequences of ``(x, y)`` pairs.
        settings: the :class:`~icqs_fast.engine.settings.ScoringSettings` of the run (or its
            :meth:`~icqs_fast.engine.settings.ScoringSettings.asdict`); None: the defaults.
        model: a :class:`ModelSpec` (model, dtype, device, 8/4-bit), or only the model (a
            local Hugging Face folder; None or ``"embedded"``: the embedded
            SmolLM2-135M-Instruct).
        columns: the batch columns with the prompt and the response (and the fields of the
            demonstration files, read with ``encoding``).
        self_check: a fitted :class:`~icqs_fast.engine.selfcheck.SelfCheck` or its
            ``to_dict()``: its map gives each record ``p_good_calibrated``.
        **options: ScoringSettings fields replacing those of ``settings`` (``num_ratios``,
            ``demos_per_set``, ``stratify`` as ``jobs.config.resolve_stratify`` gives it,
            ``calibration``, ``score``, ``backend``, ...; ``template`` may be a dict of its
            fields, ``token_budget`` None keeps the default): the keyword form of the same
            settings, as :class:`~icqs_fast.engine.scorer.ICQSScorer` takes them.

    Output columns (``__call__``): every result field of the declared schema
    (:data:`icqs_fast.io.schema.ICQS_FIELDS`: ``score``, ``score_per_set`` ``[n, L]``,
    ``loglik`` ``[n, M+1, L]`` float64, ``loglik_baseline`` (NaN unless calibrated), ...,
    ``p_good``; floats NaN and ints 0 for a rejected record), ``error``, and ``id`` /
    ``index`` passed through.

    Attributes:
        model, tokenizer, scorer: the loaded model and the :class:`ICQSScorer` (its prefix bank
            is built in the constructor, once per actor).
        settings: the run's ScoringSettings.
        runtime: :func:`~icqs_fast.models.runtime_settings` of the loaded model.
    """

    def __init__(self, good: PathLike | Sequence, bad: PathLike | Sequence,
                 settings: Any = None, *, model: ModelSpec | str | None = None,
                 columns: tuple[str, str] = ("x", "y"), encoding: str = "utf-8",
                 self_check: Any = None, **options: Any) -> None:
        from icqs_fast.engine.scorer import ICQSScorer
        from icqs_fast.engine.settings import ScoringSettings

        if options.get("token_budget", 0) is None:
            del options["token_budget"]  # None: the engine's default
        # Built (a Mapping decoded) in one call, validated before the model loads (TypeError
        # naming an unknown option, ValueError naming a flag).
        self.settings = ScoringSettings.build(settings, **options)
        self.x_field, self.y_field = columns
        g, b = self.pools(dict(good=good, bad=bad, x_field=columns[0], y_field=columns[1],
                               encoding=encoding))
        self.model, self.tokenizer = _model_spec(model).load()
        self.good, self.bad = g, b
        self.scorer = ICQSScorer(self.model, self.tokenizer, g, b, self.settings)
        if self_check is not None:  # the run's self-check: p_good_calibrated on every record
            from icqs_fast.engine.selfcheck import SelfCheck

            check = self_check if isinstance(self_check, SelfCheck) else \
                SelfCheck.from_dict(dict(self_check))
            self.scorer.self_check = check if check.ok else None
        _ = self.scorer.prefix_bank  # once per actor, before the first batch
        self.runtime = runtime_settings(self.model, self.settings.backend)

    @staticmethod
    def pools(kw: Mapping) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The good and bad demonstrations the constructor's keywords ``kw`` name (files read,
        sequences as pairs)."""
        fields = (kw.get("x_field", "x"), kw.get("y_field", "y"), kw.get("encoding", "utf-8"))
        return _load_demos(kw["good"], *fields), _load_demos(kw["bad"], *fields)

    def results(self, items: Sequence[Record | RecordError], *, path: str = "<batch>",
                on_error: Any = None):
        """``(record, ICQSResult)`` for the good items, in order (``jobs.score.score_records``
        rules: ``on_error`` gets each bad item; without it the first bad one is raised)."""
        from icqs_fast.jobs.score import score_records

        return score_records(self.scorer, items, path=path, x_field=self.x_field,
                             y_field=self.y_field, on_error=on_error)

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        cols = batch_columns(batch)
        items = _batch_records(cols, self.x_field, self.y_field)
        n = len(items)
        dims = {"M+1": self.scorer.num_ratios, "L": self.scorer.sets_per_ratio}
        out = column_arrays(n, dims, "icqs")
        row = {it.index: i for i, it in enumerate(items)}
        errors: list[RecordError] = []
        for rec, res in self.results(items, on_error=errors.append):
            fill_columns(out, row[rec.index], icqs_row(rec, res))
        return {**_passthrough(cols), **out, "error": _error_column(n, row, errors)}


class GlassboxBatchScorer:
    """Glass-box feature scorer for ``Dataset.map_batches`` (one instance per actor).

    Args:
        model: as :class:`ICQSBatchScorer`.
        features: feature names (default: ``jobs.config.DEFAULT_FEATURES``).
        chunk_size: records per ``glassbox`` call (records with the same ``index //
            chunk_size``; as ``icqs-fast features --chunk-size``).
        combo_scale: ``softmax_combo`` constants (a dict); default from the vocabulary size.
        columns: the batch columns with the instruction and the response.
        **glassbox_kw: :func:`icqs_fast.features.glassbox`'s options (``mode``,
            ``batch_size``, ``backend``, ``system_prompt``, ``deterministic``).
    """

    def __init__(self, *, model: ModelSpec | str | None = None,
                 features: Sequence[str] | None = None, chunk_size: int = 128,
                 combo_scale: dict | None = None, columns: tuple[str, str] = ("x", "y"),
                 **glassbox_kw: Any) -> None:
        from icqs_fast.features.extract import ComboScale, vocab_size

        self.x_field, self.y_field = columns
        self.model, self.tokenizer = _model_spec(model).load()
        self.features = list(features or DEFAULT_FEATURES)
        self.scale = (ComboScale.from_dict(combo_scale) if combo_scale is not None
                      else ComboScale.intrinsic(vocab_size(self.model)))
        self.chunk_size = chunk_size
        self.kw = dict(glassbox_kw, features=self.features, combo_scale=self.scale)
        self.runtime = runtime_settings(self.model, glassbox_kw.get("backend", "auto"))

    def results(self, items: Sequence[Record | RecordError], *, path: str = "<batch>",
                on_error: Any = None):
        """``(record, row)`` for the good items, in order (``jobs.features.feature_records``
        rules)."""
        return feature_records(self.model, self.tokenizer, items, chunk_size=self.chunk_size,
                               names=RecordNames(path, self.x_field, self.y_field),
                               on_error=on_error, **self.kw)

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        cols = batch_columns(batch)
        items = _batch_records(cols, self.x_field, self.y_field)
        n = len(items)
        out = column_arrays(n, {}, "features", self.features)
        row = {it.index: i for i, it in enumerate(items)}
        errors: list[RecordError] = []
        for rec, res in self.results(items, on_error=errors.append):
            fill_columns(out, row[rec.index], features_row(rec, res, self.features))
        return {**_passthrough(cols), **out, "error": _error_column(n, row, errors)}


def _error_column(n: int, row: dict[int, int], errors: list[RecordError]) -> np.ndarray:
    """The ``error`` batch column: None, or ``"field: reason"`` for a record rejected."""
    out = np.full(n, None, dtype=object)
    for err in errors:
        out[row[err.index]] = f"{err.field}: {err.reason}" if err.field else err.reason
    return out


# --------------------------------------------------------------------------- input blocks

@dataclass(frozen=True)
class BlockSpec:
    """Where block ``block`` of an input is: records ``[start, end)`` of ``path`` (``fmt`` as
    :func:`~icqs_fast.io.records.detect_format` names it), read with ``fields`` and
    ``encoding``, or (``score --pairs``) with the ``pairs`` :class:`~icqs_fast.io.readers.
    PairFields`; ``name`` is the input as its errors name it (default: ``path``)."""

    path: str
    fmt: str
    block: int
    start: int
    end: int
    fields: RecordFields = RecordFields()
    encoding: str = "utf-8"
    name: str | None = None
    pairs: PairFields | None = None

    def at(self, block: int, start: int, end: int) -> BlockSpec:
        """The same input's block ``block``: records ``[start, end)``."""
        return replace(self, block=block, start=start, end=end)


def block_items(spec: BlockSpec) -> list[Record | PairRecord | RecordError]:
    """The records of one block as the single-process reader gives them
    (:func:`~icqs_fast.io.readers.read_records`, any input format it reads; bad records as
    :class:`RecordError` s in their place, named by ``spec.name``), skipping to the block's
    start without parsing (Parquet: whole row groups skipped from the footer); with
    ``spec.pairs`` the pairs whose first record lies there (:func:`~icqs_fast.io.readers.
    read_pairs`, as ``--shard`` reads: a pair is never split between blocks)."""
    out: list[Record | PairRecord | RecordError] = []
    kw: dict[str, Any] = dict(format=spec.fmt, encoding=spec.encoding, skip=spec.start,
                              on_error="yield")
    items = (read_records(spec.path, spec.fields, **kw) if spec.pairs is None else
             read_pairs(spec.path, spec.pairs, stop=spec.end, **kw))
    for rec in items:
        if rec.index >= spec.end:
            break
        if isinstance(rec, RecordError) and spec.name is not None:
            rec = RecordError(spec.name, rec.line, rec.field, rec.reason, index=rec.index)
        out.append(rec)
    return out
