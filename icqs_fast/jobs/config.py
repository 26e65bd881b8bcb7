"""What a ``score`` or ``features`` job needs, as dataclasses (no argparse here: the thin
``icqs_fast.cli`` modules build these from their arguments; a library caller or a benchmark
builds them directly).

:meth:`JobConfig.fingerprint` is the resume fingerprint written to ``OUT.meta.json``: the
JSON-able dict of every option that changes what a result record contains (fields, encoding,
model, demonstrations, scoring or feature options, shard). A ``--resume`` with any of them
different is refused. What is known only once the model is loaded (resolved dtype, device,
backend; the ``softmax_combo`` constants) is added by the job.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from icqs_fast.engine.settings import RESULT_FIELDS, ScoringSettings

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
ON_ERROR = ("stop", "skip")
EXECUTORS = ("local", "ray")
DEFAULT_FEATURES = ("sent_logprob", "softmax_ent", "softmax_var", "token_prob_var",
                    "softmax_combo", "attn_ent_avg", "attn_ent_min")
DEFAULT_BLOCK_SIZE = 1024
OUTPUT_FORMATS = ("parquet", "jsonl")
# The ICQS options of a score job (ICQSScorer keyword arguments; ``stratify`` is the
# --stratify-field spec, resolved against the demonstration files by the job, ``template`` a
# dict of Template fields or None); the job turns them into one ``ScoringSettings``
# (:func:`icqs_fast.jobs.score.scoring_settings`), which validates them before a model loads.
# The defaults are ScoringSettings' own (one place), the template None (= the default one).
DEFAULT_SCORING: dict[str, Any] = {
    k: (None if k == "template" else getattr(ScoringSettings(), k)) for k in RESULT_FIELDS}
# Fingerprint names of scoring options that differ from the keyword (kept so that outputs
# written before the configs existed still resume).
_FINGERPRINT_NAMES = {"stratify": "stratify_field"}


# The command-line flag of each option a message may name (``num_ratios`` -> ``--num-ratios``).
OPTION_FLAGS = {**{k: "--" + k.replace("_", "-") for k in (*DEFAULT_SCORING, "token_budget")},
                "stratify": "--stratify-field", "calibration": "--calibrate"}


def flag_names(message: str) -> str:
    """``message`` with the Python names of the score options as their flags:
    ``demos_per_set=8`` -> ``--demos-per-set 8``, ``replacement=True`` -> ``--replacement``."""
    import re

    def sub(m: re.Match) -> str:
        value = m.group(3)
        return OPTION_FLAGS[m.group(1)] + ("" if value in (None, "True") else f" {value}")

    names = "|".join(sorted(OPTION_FLAGS, key=len, reverse=True))
    return re.sub(rf"(?<![-\w])({names})\b(=([\w.'-]+))?", sub, message)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_name(model: str | None) -> str:
    """The model as the fingerprint records it: an absolute folder, or the embedded model."""
    return EMBEDDED_MODEL if model in (None, "embedded") else os.path.abspath(model)


@dataclass
class RayOptions:
    """The ``--ray`` options (see :mod:`icqs_fast.jobs.ray_executor`)."""

    address: str | None = None
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE
    output_format: str = "parquet"

    def check(self) -> None:
        for name in ("workers", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.gpus_per_worker < 0 or self.cpus_per_worker < 0:
            raise ValueError("--gpus-per-worker / --cpus-per-worker must be >= 0")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format must be one of {OUTPUT_FORMATS}")


@dataclass(kw_only=True)
class JobConfig:
    """What ``score`` and ``features`` share: input, output, fields, errors, resume, model.

    ``ray`` is None for a single-process run; set, the job runs on Ray Data
    (:attr:`executor` is then ``"ray"``).
    """

    input: str
    output: str
    format: str | None = None
    x_field: str = "x"
    y_field: str = "y"
    id_field: str | None = None
    label_field: str | None = None
    encoding: str = "utf-8"
    shard: str | None = None
    on_error: str = "stop"
    resume: bool = False
    overwrite: bool = False
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    backend: str = "auto"
    load_in_8bit: bool = False
    load_in_4bit: bool = False
    threads: int | None = None
    quiet: bool = False
    ray: RayOptions | None = None

    kind = "job"

    @property
    def executor(self) -> str:
        return "local" if self.ray is None else "ray"

    @property
    def input_name(self) -> str:
        return "<stdin>" if self.input == "-" else self.input

    def check(self) -> None:
        """Checks that need no file and no model."""
        if self.on_error not in ON_ERROR:
            raise ValueError(f"--on-error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if self.shard is not None:
            from icqs_fast.io.records import parse_shard

            parse_shard(self.shard)  # a bad spec fails before anything is loaded
        if self.ray is not None:
            self.ray.check()

    def _record_fingerprint(self) -> dict[str, Any]:
        """What decides which records are read and what they carry into a result line."""
        return {"x_field": self.x_field, "y_field": self.y_field, "id_field": self.id_field,
                "label_field": self.label_field, "encoding": self.encoding}

    def fingerprint(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(kw_only=True)
class ScoreJobConfig(JobConfig):
    """An ``icqs-fast score`` job.

    ``scoring``: the ICQS options, :data:`DEFAULT_SCORING`'s keys (the result fields of
    :class:`~icqs_fast.engine.settings.ScoringSettings`, with ``stratify`` as the
    ``--stratify-field`` spec). ``token_budget`` and ``backend`` are engine-only (they do not
    change a score), and so is ``deterministic`` (batch-invariant mode, ``--deterministic``:
    the same scores, computed per response so that their bits do not depend on the batch).
    """

    good: str
    bad: str
    scoring: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SCORING))
    token_budget: int | None = None
    deterministic: bool = False
    # The fields of the demonstration files (None: x_field / y_field).
    demo_x_field: str | None = None
    demo_y_field: str | None = None
    # The self-check from the pools (engine.selfcheck.run_self_check keywords: max_heldout,
    # seed, method, leak, target_precision; {"max_heldout": 0}: off). Not in the fingerprint:
    # a resumed run reuses the self-check its meta file holds.
    self_check: dict[str, Any] = field(default_factory=dict)

    kind = "score"

    def __post_init__(self) -> None:
        self.demo_x_field = self.demo_x_field or self.x_field
        self.demo_y_field = self.demo_y_field or self.y_field
        unknown = sorted(set(self.scoring) - set(DEFAULT_SCORING))
        if unknown:
            raise TypeError(f"ScoreJobConfig.scoring: unknown option(s) {unknown}")
        self.scoring = {**DEFAULT_SCORING, **self.scoring}
        # Every option checked by the engine's own settings object, before any model loads
        # (stratify is the field spec here; the job resolves it against the demonstrations).
        opts = {k: v for k, v in self.scoring.items() if k not in ("stratify", "template")}
        ScoringSettings.build(**opts)

    def check(self) -> None:
        super().check()
        for name in ("good", "bad"):
            if not os.path.isfile(getattr(self, name)):
                raise FileNotFoundError(f"no such --{name} file: {getattr(self, name)}")

    def fingerprint(self) -> dict[str, Any]:
        """The resume fingerprint (see the module docstring)."""
        fp: dict[str, Any] = {
            "model": model_name(self.model),
            "good_sha256": file_sha256(self.good),
            "bad_sha256": file_sha256(self.bad),
        }
        # As JSON holds them (tuples become lists), so a fingerprint read back from the run
        # metadata compares equal.
        fp.update((_FINGERPRINT_NAMES.get(k, k), json.loads(json.dumps(v)))
                  for k, v in self.scoring.items())
        fp.update(self._record_fingerprint())
        if (self.demo_x_field, self.demo_y_field) != (self.x_field, self.y_field):
            # Only when they differ, so that outputs written before the option still resume.
            fp.update(demo_x_field=self.demo_x_field, demo_y_field=self.demo_y_field)
        return fp | ({"shard": self.shard} if self.shard else {})


@dataclass(kw_only=True)
class FeatureJobConfig(JobConfig):
    """An ``icqs-fast features`` job: the glass-box features, their mode, the batch and chunk
    sizes (they decide which records share a padded forward, so they change the last bits),
    the system prompt and, optionally, the ``softmax_combo`` constants (a dict of
    ``ComboScale.as_dict``; None: from the vocabulary size). ``deterministic``
    (``--deterministic``): every record in a forward of its own, whatever the batch and chunk
    sizes (batch-invariant features; in the fingerprint only when set, so older outputs still
    resume)."""

    features: tuple[str, ...] = DEFAULT_FEATURES
    mode: str = "standard"
    batch_size: int = 8
    chunk_size: int = 128
    system_prompt: str | None = None
    combo_scale: dict | None = None
    deterministic: bool = False

    kind = "features"

    def __post_init__(self) -> None:
        self.features = tuple(self.features)

    def check(self) -> None:
        super().check()
        for name in ("batch_size", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.label_field is not None:
            raise ValueError("features has no --label-field")
        if self.ray is not None and self.ray.block_size % self.chunk_size:
            # A block of whole chunks computes every record in the same glassbox call as the
            # single-process run, so the features are the same to the last bit.
            raise ValueError(f"--block-size ({self.ray.block_size}) must be a multiple of "
                             f"--chunk-size ({self.chunk_size})")

    def fingerprint(self) -> dict[str, Any]:
        """The resume fingerprint (see the module docstring)."""
        fp: dict[str, Any] = {
            "command": "features",
            "model": model_name(self.model),
            "features": list(self.features),
            "mode": self.mode,
            "batch_size": self.batch_size,
            "chunk_size": self.chunk_size,
            "system_prompt": self.system_prompt,
        }
        fp.update(self._record_fingerprint())
        del fp["label_field"]  # features writes no label
        if self.combo_scale is not None:
            fp["combo_scale"] = self.combo_scale
        if self.deterministic:
            fp["deterministic"] = True
        return fp | ({"shard": self.shard} if self.shard else {})
