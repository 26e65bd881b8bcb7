"""``icqs-fast features``: glass-box self-evaluation features of the responses of a file.

    icqs-fast features responses.jsonl -o features.jsonl [--features sent_logprob,softmax_ent]

One output line per response, ``{"index", "line", "id"?, "n_tokens", <feature>: float, ...,
"n_prompt_tokens", "truncated", "join"}``, in input order (features from
:func:`icqs_fast.features.glassbox`; NaN is written as ``NaN``; the last three are the
per-record diagnostics, :data:`DIAGNOSTICS`).
It streams, resumes, locks and handles bad input as ``icqs-fast score`` does (the machinery is
shared, in :mod:`icqs_fast.io`): one ``write`` per line, ``--resume`` after the last complete
line, one writer per output (``OUT.lock``), ``--on-error stop|skip`` with file:line:field
errors, and a resume key in ``OUT.meta.json`` (:meth:`FeatureJobConfig.resume_key`:
model, features, mode, batch and chunk sizes, system prompt, fields, encoding, shard; then
dtype, device, backend and the ``softmax_combo`` constants). The run itself is
:func:`icqs_fast.jobs.run.run_job` with :class:`FeatureStrategy`.

Records are scored in chunks of ``--chunk-size`` consecutive input records (a chunk is the
records whose index ``i`` has the same ``i // chunk_size``; bad records only leave a gap), each
one :func:`glassbox` call that sorts its items by length into padded batches of
``--batch-size``. A resumed run recomputes the chunk it stops in from its first record and writes
only the records after the last one on disk, so every record is computed in the same batch as in
an uninterrupted run and the file ends byte-identical to one.

Inputs and outputs as for ``icqs-fast score``: JSONL/CSV/TSV/Parquet/datasets-folder input,
JSONL or (``-o OUT.parquet``) Parquet output, a progress bar unless ``--quiet``. ``--shard i/n``
computes the i-th (0-based) of n contiguous record ranges whose boundaries are multiples of
``--chunk-size``, so every record is computed in the same batch as in the unsharded run and the
n outputs concatenated in shard order are the unsharded output.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icqs_fast.engine.checks import model_max_length
from icqs_fast.features.names import ALL_FEATURES
from icqs_fast.io.records import InputError, Record, RecordError
from icqs_fast.io.runs import check_runtime, resumed_dtype
from icqs_fast.io.schema import arrow_schema, features_row
from icqs_fast.jobs.config import DEFAULT_FEATURES, ON_ERROR, FeatureJobConfig
from icqs_fast.jobs.score import checked_runtime, output_summary

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["DEFAULT_FEATURES", "ON_ERROR", "FeatureStrategy", "FeatureSummary", "RecordNames",
           "check_feature_record", "feature_line", "feature_records", "load_combo_scale",
           "parse_features"]


# --------------------------------------------------------------------------- library part


@dataclass(frozen=True)
class RecordNames:
    """How a record error names its place: the input (``path``) and its x / y fields."""

    path: str = "<input>"
    x_field: str = "x"
    y_field: str = "y"


def check_feature_record(tokenizer: PreTrainedTokenizerBase, rec: Record, *, max_length: int | None,
                         system_prompt: str | None = None,
                         names: RecordNames = RecordNames()) -> RecordError | None:
    """What :func:`~icqs_fast.features.glassbox` would reject or compute wrongly for ``rec``, or
    None: a prompt the template can build, at least one response token, and prompt + response
    within ``max_length`` tokens (a longer row would run past the model's position table).
    ``rec`` is a record of the reader (:func:`~icqs_fast.io.readers.read_records`), which has
    checked its fields already (x and y strings, y not blank). Checked before the record
    reaches ``glassbox``, so the error names this record's index, line and field by
    construction."""
    from icqs_fast.features.extract import GlassboxItem, encode

    def err(field: str | None, reason: str) -> RecordError:
        return RecordError(names.path, rec.line, field, reason, index=rec.index)

    try:
        enc = encode(tokenizer, GlassboxItem(rec.x, rec.y), system_prompt)
    except ValueError as exc:
        return err(names.x_field, str(exc))
    if len(enc.ids) == enc.prompt_len:
        return err(names.y_field, "gives no response tokens")
    if max_length is not None and len(enc.ids) > max_length:
        return err(None, f"prompt and response of {len(enc.ids)} tokens (prompt "
                   f"{enc.prompt_len}) exceed the model's max length {max_length}")
    return None


def feature_records(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Iterable[Record | RecordError],
    *,
    chunk_size: int = 128,
    write_from: int = 0,
    names: RecordNames = RecordNames(),
    on_error: Callable[[RecordError], None] | None = None,
    **glassbox_kw: Any,
) -> Iterator[tuple[Record, dict[str, float]]]:
    """Glass-box features of :class:`~icqs_fast.io.records.Record` s, yielding ``(record, row)`` in
    input order, one chunk at a time (``row`` as one :func:`~icqs_fast.features.glassbox` row:
    ``n_tokens`` and the features, floats; then the diagnostics :data:`DIAGNOSTICS`).

    Chunks are the records with the same ``index // chunk_size``, each one ``glassbox`` call
    (``glassbox_kw``: features, mode, batch_size, backend, combo_scale, system_prompt, ...), so a
    record's batch depends only on the input, not on where a run started. Records and errors
    with ``index < write_from`` are computed with their chunk but neither yielded nor passed on
    (a resumed run's records already on disk).

    ``records`` may hold :class:`RecordError` s in place of bad records; a record
    :func:`check_feature_record` rejects becomes one too (named as ``names`` says). With
    ``on_error`` each is passed there in input order, interleaved with the yielded rows, and
    the run goes on. Without, the records before the first bad one (or before an
    :class:`InputError` the iterator raises) are computed and yielded, then the error is
    raised.
    """
    from icqs_fast.features.extract import GlassboxItem, encode, glassbox

    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    max_len = model_max_length(model, None)
    sp = glassbox_kw.get("system_prompt")
    chunk: list[Record | RecordError] = []
    chunk_id: int | None = None

    def flush() -> Iterator[tuple[Record, dict[str, float]]]:
        good = [r for r in chunk if isinstance(r, Record)]
        rows = iter(glassbox(model, tokenizer, [(r.x, r.y) for r in good], **glassbox_kw)
                    if good else [])
        for item in chunk:
            if isinstance(item, Record):
                row = next(rows)
                if item.index >= write_from:
                    enc = encode(tokenizer, GlassboxItem(item.x, item.y), sp,
                                 glassbox_kw.get("use_chat_template"))
                    # Per-record diagnostics: prompts are never cut here (a record too long
                    # for the model is refused), so ``truncated`` is always False.
                    yield item, {**row, "n_prompt_tokens": enc.prompt_len, "truncated": False,
                                 "join": enc.join}
            elif item.index >= write_from:
                assert on_error is not None
                on_error(item)
        chunk.clear()

    fatal: InputError | None = None
    source = iter(records)
    while True:
        try:
            item = next(source)
        except StopIteration:
            break
        except InputError as exc:
            fatal = exc  # what came before is still computed and written
            break
        if isinstance(item, Record):
            bad = check_feature_record(tokenizer, item, max_length=max_len, system_prompt=sp,
                                       names=names)
            item = item if bad is None else bad
        if isinstance(item, RecordError) and item.index < write_from:
            continue  # already on disk as a skipped line; not part of any batch
        if isinstance(item, RecordError) and on_error is None:
            fatal = item
            break
        cid = item.index // chunk_size
        if chunk_id is not None and cid != chunk_id:
            yield from flush()
        chunk_id = cid
        chunk.append(item)
    yield from flush()
    if fatal is not None:
        raise fatal


# Per-record diagnostics after the features: prompt tokens before the response, the
# prompt cut (never, in ``features``), the first response token merged with the prompt.
DIAGNOSTICS = ("n_prompt_tokens", "truncated", "join")


def feature_line(rec: Record, row: dict[str, Any]) -> dict[str, Any]:
    """The output JSON object of one record (:func:`icqs_fast.io.schema.features_row`):
    ``index``, ``line``, ``id`` (when the input has one), ``n_tokens``, the features in the
    order of ``row``, then the :data:`DIAGNOSTICS` (``n_prompt_tokens`` int, ``truncated`` and
    ``join`` bool)."""
    names = [k for k in row if k != "n_tokens" and k not in DIAGNOSTICS]
    return features_row(rec, row, names)


def parse_features(spec: str) -> list[str]:
    feats = [f.strip() for f in spec.split(",") if f.strip()]
    bad = [f for f in feats if f not in ALL_FEATURES]
    if not feats or bad:
        raise ValueError(f"--features: unknown or no feature(s) {bad}; choose from "
                         f"{', '.join(ALL_FEATURES)}")
    if len(set(feats)) != len(feats):
        raise ValueError(f"--features: a feature is named twice in {spec!r}")
    return feats


def load_combo_scale(path: str | None):
    from icqs_fast.features.extract import ComboScale

    if path is None:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such --combo-scale file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except json.JSONDecodeError as exc:
        raise InputError(path, exc.lineno, None, f"invalid JSON ({exc.msg})") from None
    keys = ("ent_lo", "ent_hi", "var_lo", "var_hi")
    if not isinstance(spec, dict):
        raise InputError(path, None, None, f"a --combo-scale file holds a JSON object with "
                         f"{', '.join(keys)}")
    for k in keys:
        v = spec.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(path, None, k, "missing or not a number")
    return ComboScale.from_dict(spec)


class FeatureSummary:
    """Running count and throughput of a features job."""

    def __init__(self) -> None:
        self.n = 0
        self.skipped = 0
        self.t0 = time.perf_counter()

    def add(self, rec: Record, res: Any) -> None:
        self.n += 1

    def text(self, prefix: str = "") -> str:
        dt = time.perf_counter() - self.t0
        rate = self.n / dt if dt > 0 else 0.0
        s = f"{prefix}{self.n} responses in {dt:.1f} s ({rate:.2f} responses/s)"
        return s + (f", {self.skipped} bad records skipped" if self.skipped else "")


class FeatureStrategy:
    """``features``' part of the job runner (:mod:`icqs_fast.jobs.runner`): glassbox over
    chunks of ``chunk_size`` records (a resumed run restarts at its chunk's first record), one
    :func:`feature_line` each."""

    desc = "features"
    done_prefix = "icqs-fast: features of "
    done_what = "features of"
    read_labels = False

    def __init__(self, config: FeatureJobConfig) -> None:
        self.config = config
        self.align = config.chunk_size
        self.model: Any = None
        self.tokenizer: Any = None
        self.scale: Any = None

    def prepare(self, log: Callable[..., None]) -> None:
        """Nothing to read before the model (the job runner's first step)."""

    def self_check(self, policy: Any, log: Callable[..., None],
                   run: Callable[[], dict] | None = None) -> None:
        """No self-check for features."""
        return None

    def use_self_check(self, check: dict) -> None:
        """No self-check for features."""

    def load(self, policy: Any, meta: dict, log: Callable[..., None]) -> None:
        from icqs_fast.features.extract import ComboScale, vocab_size

        c = self.config
        t_load = time.perf_counter()
        self.model, self.tokenizer = c.load_model(resumed_dtype(policy, c.dtype))
        t_load = time.perf_counter() - t_load
        self.scale = (ComboScale.from_dict(c.combo_scale) if c.combo_scale is not None
                      else ComboScale.intrinsic(vocab_size(self.model)))
        meta["combo_scale"] = self.scale.as_dict()
        meta.update(checked_runtime(self.model, c.backend))
        if policy is not None:  # the runner checks dtype/device/backend; these are known now
            check_runtime(policy, meta, keys=("combo_scale",))
        log(f"icqs-fast: model loaded in {t_load:.1f} s; features {', '.join(c.features)} "
            f"({c.mode} mode)")

    def results(self, records: Iterable[Record | RecordError], *, write_from: int,
                on_error: Callable[[RecordError], None] | None
                ) -> Iterator[tuple[Record, dict[str, float]]]:
        c = self.config
        return feature_records(
            self.model, self.tokenizer, records, chunk_size=c.chunk_size, write_from=write_from,
            names=RecordNames(c.input_name, c.x_field, c.y_field), on_error=on_error,
            features=list(c.features), mode=c.mode, batch_size=c.batch_size, backend=c.backend,
            system_prompt=c.system_prompt, combo_scale=self.scale,
            deterministic=c.deterministic)

    def line(self, rec: Record, res: dict[str, float]) -> dict:
        return feature_line(rec, res)

    def table_schema(self) -> Any:
        return arrow_schema("features", self.config.features)

    def summary(self) -> FeatureSummary:
        return FeatureSummary()

    def output_summary(self, out: Path) -> str:
        """One line on the whole output after a resumed run: its records and bad records."""
        return output_summary(out)
