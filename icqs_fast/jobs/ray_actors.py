"""Scale-out on Ray Data: callable classes for ``ray.data.Dataset.map_batches``.

    import ray
    from ray.data import ActorPoolStrategy
    from icqs_fast.jobs.ray_actors import ICQSBatchScorer

    ds = ray.data.read_parquet("responses.parquet")          # columns x, y (, id)
    scored = ds.map_batches(
        ICQSBatchScorer, fn_constructor_kwargs={"good": "good.jsonl", "bad": "bad.jsonl"},
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

The ``--ray`` run of ``icqs-fast score`` / ``features`` (:mod:`icqs_fast.jobs.ray_executor`)
uses the same classes on deterministic input blocks read by :class:`RecordBlocks`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from icqs_fast.io.readers import read_examples, read_records
from icqs_fast.io.records import PathLike, Record, RecordError
from icqs_fast.io.schema import column_arrays, features_row, fill_columns, icqs_row
from icqs_fast.models import runtime_settings

__all__ = ["ICQSBatchScorer", "GlassboxBatchScorer", "RecordBlocks", "BlockSpec",
           "block_items", "items_of_block"]


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
    """Records of a plain batch (``x``/``y`` columns; ``index`` defaults to the row number)."""
    for f in (x_field, y_field):
        if f not in cols:
            raise ValueError(f"batch has no column {f!r} (columns: {', '.join(cols)})")
    n = len(cols[x_field])
    index = cols.get("index")
    out: list[Record | RecordError] = []
    for i in range(n):
        idx = int(index[i]) if index is not None else i
        x, y = cols[x_field][i], cols[y_field][i]
        if not isinstance(x, str) or not isinstance(y, str):
            field, v = (x_field, x) if not isinstance(x, str) else (y_field, y)
            out.append(RecordError("<batch>", idx + 1, field,
                                   f"must be a string, got {type(v).__name__}", index=idx))
            continue
        out.append(Record(index=idx, line=idx + 1, x=x, y=y))
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
        good, bad: demonstration files (JSONL/CSV/TSV with ``x_field``/``y_field``) or
            sequences of ``(x, y)`` pairs.
        settings: the :class:`~icqs_fast.engine.settings.ScoringSettings` of the run, or its
            :meth:`~icqs_fast.engine.settings.ScoringSettings.asdict` (what a driver sends to
            its actors: JSON-able, so one object carries every option to every actor); None:
            the defaults.
        model: a local Hugging Face folder; None (or ``"embedded"``) for the embedded
            SmolLM2-135M-Instruct.
        dtype, device, load_in_8bit, load_in_4bit: as :func:`icqs_fast.models.load_model`.
        x_field, y_field: the batch columns with the prompt and the response (and the fields
            of the demonstration files, read with ``encoding``).
        self_check: a fitted :class:`~icqs_fast.engine.selfcheck.SelfCheck` as its ``to_dict()``
            (what a driver sends): its map gives each record ``p_good_calibrated``.
        **options: ScoringSettings fields replacing those of ``settings`` (``num_ratios``,
            ``demos_per_set``, ``stratify`` as ``jobs.score.resolve_stratify`` gives it,
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
                 settings: Any = None, *, model: str | None = None, dtype: str = "auto",
                 device: str = "auto", load_in_8bit: bool = False, load_in_4bit: bool = False,
                 x_field: str = "x", y_field: str = "y", encoding: str = "utf-8",
                 self_check: Mapping | None = None, **options: Any) -> None:
        from icqs_fast.engine.prompts import Template
        from icqs_fast.engine.scorer import ICQSScorer
        from icqs_fast.engine.settings import ScoringSettings
        from icqs_fast.models import load_model

        if isinstance(settings, Mapping):
            settings = ScoringSettings.from_dict(settings)
        if isinstance(options.get("template"), Mapping):
            options["template"] = Template(**options["template"])
        if options.get("token_budget", 0) is None:
            del options["token_budget"]  # None: the engine's default
        # Validated before the model loads (TypeError naming an unknown option).
        self.settings = ScoringSettings.build(settings, **options)
        self.x_field, self.y_field = x_field, y_field
        g, b = self.pools(dict(good=good, bad=bad, x_field=x_field, y_field=y_field,
                               encoding=encoding))
        self.model, self.tokenizer = load_model(
            None if model in (None, "embedded") else model, dtype=dtype, device=device,
            load_in_8bit=load_in_8bit, load_in_4bit=load_in_4bit)
        self.good, self.bad = g, b
        self.scorer = ICQSScorer(self.model, self.tokenizer, g, b, self.settings)
        if self_check is not None:  # the run's self-check: p_good_calibrated on every record
            from icqs_fast.engine.selfcheck import SelfCheck

            check = SelfCheck.from_dict(dict(self_check))
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
        model, dtype, device, load_in_8bit, load_in_4bit: as :class:`ICQSBatchScorer`.
        features: feature names (default: ``jobs.config.DEFAULT_FEATURES``).
        mode, batch_size, backend, system_prompt, deterministic: as
            :func:`icqs_fast.features.glassbox`.
        chunk_size: records per ``glassbox`` call (records with the same ``index //
            chunk_size``; as ``icqs-fast features --chunk-size``).
        combo_scale: ``softmax_combo`` constants (a dict); default from the vocabulary size.
        x_field, y_field: the batch columns with the instruction and the response.
    """

    def __init__(self, *, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 load_in_8bit: bool = False, load_in_4bit: bool = False,
                 features: Sequence[str] | None = None, mode: str = "standard",
                 batch_size: int = 8, chunk_size: int = 128, backend: str = "auto",
                 system_prompt: str | None = None, combo_scale: dict | None = None,
                 x_field: str = "x", y_field: str = "y", deterministic: bool = False) -> None:
        from icqs_fast.features.extract import ComboScale, vocab_size
        from icqs_fast.jobs.config import DEFAULT_FEATURES
        from icqs_fast.models import load_model

        self.x_field, self.y_field = x_field, y_field
        self.model, self.tokenizer = load_model(
            None if model in (None, "embedded") else model, dtype=dtype, device=device,
            load_in_8bit=load_in_8bit, load_in_4bit=load_in_4bit)
        self.features = list(features or DEFAULT_FEATURES)
        self.scale = (ComboScale.from_dict(combo_scale) if combo_scale is not None
                      else ComboScale.intrinsic(vocab_size(self.model)))
        self.chunk_size = chunk_size
        self.kw = dict(features=self.features, mode=mode, batch_size=batch_size,
                       backend=backend, system_prompt=system_prompt, combo_scale=self.scale,
                       deterministic=deterministic)
        self.runtime = runtime_settings(self.model, backend)

    def results(self, items: Sequence[Record | RecordError], *, path: str = "<batch>",
                on_error: Any = None):
        """``(record, row)`` for the good items, in order (``jobs.features.feature_records``
        rules)."""
        from icqs_fast.jobs.features import feature_records

        return feature_records(self.model, self.tokenizer, items, chunk_size=self.chunk_size,
                               path=path, x_field=self.x_field, y_field=self.y_field,
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
    :func:`~icqs_fast.io.records.detect_format` names it)."""

    path: str
    fmt: str
    block: int
    start: int
    end: int
    x_field: str = "x"
    y_field: str = "y"
    id_field: str | None = None
    label_field: str | None = None
    encoding: str = "utf-8"


def block_items(spec: BlockSpec) -> list[Record | RecordError]:
    """The records of one block as the single-process reader gives them
    (:func:`~icqs_fast.io.readers.read_records`, any input format it reads; bad records as
    :class:`RecordError` s in their place), skipping to the block's start without parsing
    (Parquet: whole row groups skipped from the footer)."""
    out = []
    for rec in read_records(spec.path, format=spec.fmt, x_field=spec.x_field,
                            y_field=spec.y_field, id_field=spec.id_field,
                            label_field=spec.label_field, encoding=spec.encoding,
                            skip=spec.start, on_error="yield"):
        if rec.index >= spec.end:
            break
        out.append(rec)
    return out


BLOCK_SCHEMA_FIELDS = ("block", "index", "line", "x", "y", "id_json", "label_json",
                       "error_field", "error_reason")


def _block_table(spec: BlockSpec):
    """One block's records as a pyarrow Table (ids and labels as JSON text, so any JSON value
    survives the trip; a bad record has its error and empty x/y)."""
    import pyarrow as pa

    items = block_items(spec)
    cols: dict[str, list] = {k: [] for k in BLOCK_SCHEMA_FIELDS}
    for it in items:
        bad = isinstance(it, RecordError)
        cols["block"].append(spec.block)
        cols["index"].append(it.index)
        cols["line"].append(it.line)
        cols["x"].append("" if bad else it.x)
        cols["y"].append("" if bad else it.y)
        cols["id_json"].append(None if bad or it.id is None else json.dumps(it.id))
        cols["label_json"].append(None if bad or spec.label_field is None
                                  else json.dumps(it.label, ensure_ascii=False))
        cols["error_field"].append(it.field if bad else None)
        cols["error_reason"].append(it.reason if bad else None)
    types = {"block": pa.int64(), "index": pa.int64(), "line": pa.int64()}
    return pa.table({k: pa.array(v, type=types.get(k, pa.string())) for k, v in cols.items()})


def items_of_block(cols: dict[str, np.ndarray], path: str) -> list[Record | RecordError]:
    """Rebuild the records (and :class:`RecordError` s) of a block table's columns."""
    out: list[Record | RecordError] = []
    for i in range(len(cols["index"])):
        idx, line = int(cols["index"][i]), int(cols["line"][i])
        reason = cols["error_reason"][i]
        if reason is not None and not (isinstance(reason, float) and np.isnan(reason)):
            field = cols["error_field"][i]
            field = None if field is None or (isinstance(field, float) and np.isnan(field)) \
                else str(field)
            out.append(RecordError(path, line, field, str(reason), index=idx))
            continue
        idj, labj = cols["id_json"][i], cols["label_json"][i]
        out.append(Record(index=idx, line=line, x=str(cols["x"][i]), y=str(cols["y"][i]),
                          id=json.loads(idj) if isinstance(idj, str) else None,
                          label=json.loads(labj) if isinstance(labj, str) else None))
    return out


def _read_block(spec: BlockSpec):
    t0 = time.perf_counter()
    table = _block_table(spec)
    # The read time travels with the block, so the worker summary can separate it out.
    import pyarrow as pa

    return [table.append_column("read_s", pa.array([time.perf_counter() - t0] * len(table),
                                                   type=pa.float64()))]


def _ray_datasource_base():
    from ray.data import Datasource

    return Datasource


class RecordBlocks:
    """A Ray Data datasource reading an input's records in deterministic blocks (build it with
    :meth:`datasource`, read it with ``ray.data.read_datasource(..., override_num_blocks=
    len(specs))``): one read task and one Ray block per :class:`BlockSpec`, with the columns
    ``BLOCK_SCHEMA_FIELDS`` + ``read_s``, so a block's records stay together and the block
    number names its output file."""

    @staticmethod
    def datasource(specs: Sequence[BlockSpec]):
        from ray.data import ReadTask
        from ray.data.block import BlockMetadata

        base = _ray_datasource_base()

        class _Source(base):  # type: ignore[misc, valid-type]
            def __init__(self, specs: Sequence[BlockSpec]) -> None:
                super().__init__()
                self.specs = list(specs)

            def estimate_inmemory_data_size(self) -> int | None:
                return None

            def get_name(self) -> str:
                return "ICQSRecordBlocks"

            def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                               data_context: Any = None) -> list:
                import functools

                return [ReadTask(functools.partial(_read_block, s),
                                 BlockMetadata(num_rows=s.end - s.start, size_bytes=None,
                                               exec_stats=None, input_files=[s.path]))
                        for s in self.specs]

        return _Source(specs)
