"""What a ``score`` or ``features`` job needs, as dataclasses whose options are declared once
(:func:`icqs_fast.options.option`: flag, default, help, bounds), so the command-line flags
(:func:`icqs_fast.cli.options.add_declared`), the docs' option tables and the flag an error
message names come from here. No argparse here: the thin ``icqs_fast.cli`` modules build these
from their arguments; a library caller or a benchmark builds them directly.

:meth:`JobConfig.resume_key` is the resume key written to ``OUT.meta.json``: the JSON-able
dict of every option that changes what a result record contains (fields, encoding, model,
demonstrations, scoring or feature options, shard). A ``--resume`` with any of them different
is refused. For ``score`` it is the one scoring fingerprint,
:meth:`~icqs_fast.engine.settings.ScoringSettings.fingerprint`, plus the record fields; an
output written by an earlier version is read through :meth:`ScoreJobConfig.upgrade_meta`. What
is known only once the model is loaded (resolved dtype, device, backend; the
``softmax_combo`` constants) is added by the job.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

from icqs_fast.engine.settings import DEFAULT_MAX_HELDOUT, ScoringSettings
from icqs_fast.engine.settings import SELF_CHECK_LEAKS as LEAKS
from icqs_fast.engine.settings import SELF_CHECK_MAPS as METHODS
from icqs_fast.io.readers import PairFields, RecordFields, read_records
from icqs_fast.io.records import FORMATS
from icqs_fast.model_files import EMBEDDED_NAMES, PACKAGED_MODELS
from icqs_fast.options import DEVICE_MAPS, QUANTIZATIONS, check_declared, declared, option
from icqs_fast.threads import threads_option

EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
ON_ERROR = ("stop", "skip")
EXECUTORS = ("local", "ray")
DEFAULT_FEATURES = ("sent_logprob", "softmax_ent", "softmax_var", "token_prob_var",
                    "softmax_combo", "attn_ent_avg", "attn_ent_min")
FEATURE_MODES = ("standard", "selfeval-compat")
DEFAULT_BLOCK_SIZE = 1024
OUTPUT_FORMATS = ("parquet", "jsonl")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_name(model: str | None) -> str:
    """The model as the resume key records it: an absolute path (folder or GGUF file), the
    embedded model, or ``packaged:NAME`` for a packaged model named as such
    (:data:`icqs_fast.models.PACKAGED_MODELS`; a local path of that name wins)."""
    if model is None or model in EMBEDDED_NAMES:
        return EMBEDDED_MODEL
    if model in PACKAGED_MODELS and not os.path.exists(model):
        return f"packaged:{model}"
    return os.path.abspath(model)


class ModelLoadError(ValueError):
    """A job's model cannot be loaded: ``cannot load model NAME: reason`` (a usage error, exit
    code 2), the reason without the hub client's network advice (no network is used)."""

    def __init__(self, model: str | None, exc: BaseException) -> None:
        self.model = "embedded" if model is None else model
        self.reason = load_reason(self.model, exc)
        super().__init__(f"cannot load model {self.model}: {self.reason}")


# The prefixes models.load_model puts before its reason (the message here names the model
# once, first), and the hub client's lines on connecting to the hub, which do not apply: no
# network is ever used.
_LOAD_PREFIX = re.compile(r"^(?:could not load model '[^']*'(?: from local files \(no network "
                          r"access is used\))?: )")
_HUB_TEXT = ("huggingface.co", "internet connection", "offline mode", "Repo id must be",
             "repo_type")


def load_reason(model: str, exc: BaseException) -> str:
    """Why ``model`` failed to load, in one line: no such folder or cached id; else the
    loader's own reason, less its prefix and any hub-client text."""
    if isinstance(exc, OSError) and model != "embedded" \
            and not os.path.exists(os.path.expanduser(model)):
        return ("no such model folder or file, and no cached hub id of that name (no network "
                "is used: pass a local model folder)")
    text = _LOAD_PREFIX.sub("", str(exc).strip())
    lines = [ln for ln in text.splitlines() if not any(h in ln for h in _HUB_TEXT)]
    text = " ".join(ln.strip() for ln in lines if ln.strip())
    return text or f"{type(exc).__name__} while loading it"


@dataclass(frozen=True)
class RayOptions:
    """The ``--ray`` options (see :mod:`icqs_fast.jobs.ray_executor`)."""

    address: str | None = option(None, kind="str", help="Ray cluster: 'auto', "
                                 "ray://host:10001, host:6379 (none: start a local one)")
    workers: int = option(1, ge=1, help="actors, each with its own model (one per GPU)")
    gpus_per_worker: float | None = option(None, kind="float", ge=0, help="GPUs per actor "
                                           "(1 = one actor per GPU; none: 1 when the cluster "
                                           "reports GPUs and --device is not cpu, else 0)")
    cpus_per_worker: float = option(1.0, ge=0, help="CPU cores per actor (Ray sets its "
                                    "OMP_NUM_THREADS to this)")
    block_size: int = option(DEFAULT_BLOCK_SIZE, ge=1, help="records per input block and "
                             "output file (features: a multiple of --chunk-size)")
    output_format: str = option("parquet", choices=OUTPUT_FORMATS, help="block files: parquet "
                                "or jsonl (the single-process lines)")

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass(frozen=True)
class SelfCheckOptions:
    """The self-check from the demonstration pools (the keywords of
    :func:`icqs_fast.engine.selfcheck.run_self_check`, see :meth:`kwargs`). Not in the resume
    key: a resumed run reuses the self-check its meta file holds."""

    max_heldout: int = option(DEFAULT_MAX_HELDOUT, ge=0, flag="--self-check-max", metavar="N",
                              help="score at most N held-out demonstrations in the self-check, "
                              "half from each pool (each costs what one record costs: 2.4% of "
                              "a 10,000-record job, measured); the default also no more than "
                              "the job has records; 0 = off")
    seed: int = option(0, flag="--self-check-seed", metavar="SEED",
                       help="seed of the held-out draw, the bootstrap and the folds")
    method: str = option("auto", choices=METHODS, flag="--calibration-map",
                         help="score -> P(good) map: platt (logistic), isotonic, or auto (Platt "
                         "below 100 held-out items per class)")
    leak: str = option("input", choices=LEAKS, flag="--self-check-leak",
                       help="a held-out demonstration is judged without every set holding a "
                       "demonstration with its input (input) or the same input and answer "
                       "(pair: for pools that share inputs by design)")
    target_precision: float | None = option(None, kind="float", gt=0, le=1, metavar="P",
                                            help="also suggest the threshold whose held-out "
                                            "precision reaches P (at an even mix of good and "
                                            "bad answers)")
    target_accuracy: float | None = option(None, kind="float", gt=0, le=1, metavar="A",
                                           help="find the band of scores to send to a person "
                                           "(verdict abstain) so that the verdicts on the rest "
                                           "reach accuracy A on the held-out items, with the "
                                           "largest coverage; without it, every verdict is good "
                                           "or bad at the equal-error threshold")

    def __post_init__(self) -> None:
        check_declared(self)

    def kwargs(self) -> dict[str, Any]:
        """The :func:`~icqs_fast.engine.selfcheck.run_self_check` keywords."""
        return {d.name: getattr(self, d.name) for d in declared(self)}


@dataclass(frozen=True)
class PairOptions:
    """``score --pairs``: how the input's records make pairs (an instruction and two outputs;
    :class:`~icqs_fast.io.readers.PairFields`) and when two scores tie. The output fields also
    read a ``--good-bad-pairs`` file."""

    y_a_field: str = option("y_a", help="field with output a of a pair")
    y_b_field: str = option("y_b", help="field with output b of a pair")
    pair_field: str | None = option(None, kind="str", help="instead of a/b records: two "
                                    "consecutive records (--x-field, --y-field) with the same "
                                    "value of this field are a pair, a then b; their "
                                    "--label-field marks one good and one bad")
    tie_margin: float = option(0.0, ge=0, help="scores of a pair this close or closer are a "
                               "tie (preferred 'tie')")

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass(kw_only=True)
class JobConfig:
    """What ``score`` and ``features`` share: input, output, fields, errors, resume, model.

    ``ray`` is None for a single-process run; set, the job runs on Ray Data
    (:attr:`executor` is then ``"ray"``). The declared options are checked on construction
    (ValueError naming the flag).
    """

    input: str = option(kind="str", flag=False, help="responses: .jsonl/.csv/.tsv (optionally "
                        ".gz), .parquet, a datasets folder (save_to_disk); '-' = JSONL stdin")
    output: str = option(kind="str", flag=False, help="results: JSONL (one line per response), "
                         "or Parquet for .parquet; with --ray a folder of per-block files")
    format: str | None = option(None, kind="str", choices=FORMATS, result=False,
                                help="input format (none: "
                                "from the extension; a folder is 'datasets')")
    x_field: str = option("x", help="field with the query (the prompt / instruction)")
    y_field: str = option("y", help="field with the response")
    id_field: str | None = option(None, kind="str", help="field with the record id (none: "
                                  "'id' when present)")
    label_field: str | None = option(None, kind="str", help="field copied to the output as "
                                     "'label'; the summary gives means per label")
    encoding: str = option("utf-8", help="text encoding of the input (and demonstration) files")
    shard: str | None = option(None, kind="str", metavar="I/N", help="compute only shard I "
                               "(0-based) of N contiguous record ranges; the N outputs "
                               "concatenated in shard order are the unsharded output")
    on_error: str = option("stop", choices=ON_ERROR, result=False, help="a bad input record: "
                           "stop (earlier results are kept) or skip it")
    resume: bool = option(False, result=False, help="continue an existing OUTPUT after its "
                          "last record")
    overwrite: bool = option(False, result=False, help="replace an existing non-empty OUTPUT")
    model: str | None = option(None, kind="str", help="local Hugging Face model folder, a "
                               "GGUF file (or a folder holding one), a packaged model's name "
                               "(icqs-fast models), or 'embedded' (none: the embedded "
                               "SmolLM2-135M)")
    # The command line's --dtype has its own help (cli/options.add_dtype_argument).
    dtype: str = option("auto", flag=False, help="model weights' dtype")
    device: str = option("auto", help="auto, cpu, cuda, ...")
    quantization: str = option("none", choices=QUANTIZATIONS, help="bitsandbytes weights: "
                               "int8 (LLM.int8, computes in float16: the paper's setting) or "
                               "nf4 (4-bit NormalFloat); needs a CUDA device")
    device_map: str = option("none", choices=DEVICE_MAPS, help="auto: the model's layers "
                             "spread over every visible GPU (for a model larger than one; "
                             "needs CUDA); none: the whole model on --device")
    threads: int | None = threads_option()
    quiet: bool = option(False, result=False, help="no progress bar / status lines / summary "
                         "on stderr")
    ray: RayOptions | None = option(None, kind="any", flag=False, result=False,
                                    help="the --ray options (none: a single-process run)")

    kind = "job"

    def __post_init__(self) -> None:
        check_declared(self)

    @property
    def executor(self) -> str:
        return "local" if self.ray is None else "ray"

    @property
    def input_name(self) -> str:
        return "<stdin>" if self.input == "-" else self.input

    def check(self) -> None:
        """Checks that need a file but no model: the shard spec, and ``--model`` as far as
        reading no weights tells (:func:`icqs_fast.models.check_model_source`: a missing
        path, a truncated GGUF file or one of an unknown architecture, a packaged model not
        installed), so a bad model fails before any output is touched."""
        if self.shard is not None:
            from icqs_fast.io.records import parse_shard

            parse_shard(self.shard)  # a bad spec fails before anything is loaded
        from icqs_fast.models import check_model_source

        check_model_source(self.model)
        if self.ray is None:  # with --ray the actors' devices decide (ModelSpec.load)
            from icqs_fast.models import device_map_kwargs, quantization_kwargs

            quantization_kwargs(self.quantization, self.device)  # int8 / nf4 need CUDA
            device_map_kwargs(self.device_map, self.device)  # so does a split model

    def load_model(self, dtype: str) -> tuple[Any, Any]:
        """``(model, tokenizer)`` of :attr:`model` in ``dtype`` (a resumed output's, or
        :attr:`dtype`) on :attr:`device`.

        Raises:
            ModelLoadError: the model cannot be loaded (``cannot load model NAME: reason``).
        """
        from icqs_fast.models import device_map_kwargs, load_model, quantization_kwargs

        try:
            return load_model(None if self.model == "embedded" else self.model, dtype=dtype,
                              device=self.device,
                              **quantization_kwargs(self.quantization, self.device),
                              **device_map_kwargs(self.device_map, self.device))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(self.model, exc) from None

    def record_key(self) -> dict[str, Any]:
        """What decides which records are read and what they carry into a result line."""
        return {"x_field": self.x_field, "y_field": self.y_field, "id_field": self.id_field,
                "label_field": self.label_field, "encoding": self.encoding}

    def resume_key(self) -> dict[str, Any]:
        """The resume key of the job (see the module docstring)."""
        raise NotImplementedError

    def quantization_key(self) -> dict[str, Any]:
        """``--quantization`` for the resume key: quantised weights give other scores. Only
        when set, so that outputs written before the option still resume."""
        return {} if self.quantization == "none" else {"quantization": self.quantization}

    def device_map_key(self) -> dict[str, Any]:
        """``--device-map`` for the resume key (a split model runs each layer on its own GPU:
        other kernels, other last bits). Only when set, so that older outputs still resume."""
        return {} if self.device_map == "none" else {"device_map": self.device_map}

    def upgrade_meta(self, old: dict) -> dict:
        """The metadata of an output written by an earlier version, in today's terms (the
        default: as it is)."""
        return old

    def key_labels(self) -> dict[str, str]:
        """How a refused resume names each key: the option's flag (``x_field`` ->
        ``--x-field``), for the declared options of this job and of its settings."""
        labels = {d.name: d.flag for d in declared(self) if d.flag is not None}
        for name in ("good", "bad"):
            labels[f"{name}_sha256"] = f"--{name} file (sha256)"
        return labels


@dataclass(kw_only=True)
class ScoreJobConfig(JobConfig):
    """An ``icqs-fast score`` job.

    ``scoring``: the one :class:`~icqs_fast.engine.settings.ScoringSettings` of the run, built
    once by the command (``stratify`` already resolved against the demonstration files) and
    passed unchanged to the scorer, the Ray actors and the self-check. ``self_check``: the
    self-check's options (``max_heldout=0``: off).
    """

    # None only with good_bad_pairs (which then names both); __post_init__ checks it.
    good: str = option(None, kind="str", nullable=False, metavar="FILE",
                       help="good demonstrations: JSONL/CSV/TSV "
                       "(optionally .gz), Parquet or a datasets folder, with the --demo-x-field "
                       "/ --demo-y-field fields")
    bad: str = option(None, kind="str", nullable=False, metavar="FILE",
                      help="bad demonstrations (the same formats "
                      "and fields as --good)")
    good_bad_pairs: str | None = option(None, kind="str", metavar="FILE", help="the pools as "
                                        "pairs instead of --good / --bad: records with "
                                        "--demo-x-field, --y-a-field and --y-b-field; the "
                                        "better output (by --demo-label-field) goes to the "
                                        "good pool, the other to the bad pool")
    demo_label_field: str | None = option(None, kind="str", help="field of the "
                                          "--good-bad-pairs file naming the better output, a "
                                          "or b (or 1 / 2; none: --label-field; without "
                                          "either, a is the better)")
    demo_x_field: str | None = option(None, kind="str", help="field with the input in the "
                                      "--good / --bad files (none: --x-field)")
    demo_y_field: str | None = option(None, kind="str", help="field with the answer in the "
                                      "--good / --bad files (none: --y-field)")
    scoring: ScoringSettings = field(default_factory=ScoringSettings)
    self_check: SelfCheckOptions = field(default_factory=SelfCheckOptions)
    # None: one response per record; set: ``score --pairs`` (jobs.pairs.PairStrategy).
    pairs: PairOptions | None = None

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The job's strategy (jobs.kinds.STRATEGIES): ``pairs`` with :attr:`pairs`."""
        return "score" if self.pairs is None else "pairs"

    def __post_init__(self) -> None:
        if self.good_bad_pairs is not None:
            # (dataclasses.replace passes the good = bad = good_bad_pairs set here again)
            if {self.good, self.bad} - {None, self.good_bad_pairs}:
                raise ValueError("--good-bad-pairs gives both pools: leave out --good and "
                                 "--bad")
            self.good = self.bad = self.good_bad_pairs  # what the resume key hashes
        elif self.good is None or self.bad is None:
            raise ValueError("score needs --good and --bad (or --good-bad-pairs FILE)")
        super().__post_init__()
        self.demo_x_field = self.demo_x_field or self.x_field
        self.demo_y_field = self.demo_y_field or self.y_field
        if not isinstance(self.scoring, ScoringSettings):
            raise TypeError(f"ScoreJobConfig.scoring must be a ScoringSettings, got "
                            f"{type(self.scoring).__name__}")
        if not isinstance(self.self_check, SelfCheckOptions):
            raise TypeError(f"ScoreJobConfig.self_check must be a SelfCheckOptions, got "
                            f"{type(self.self_check).__name__}")
        if self.pairs is not None and not isinstance(self.pairs, PairOptions):
            raise TypeError(f"ScoreJobConfig.pairs must be a PairOptions, got "
                            f"{type(self.pairs).__name__}")

    @property
    def pair_options(self) -> PairOptions:
        """The pair fields of the input (``--pairs``) and of a ``--good-bad-pairs`` file."""
        return self.pairs or PairOptions()

    def pair_fields(self, *, demos: bool = False) -> Any:
        """The :class:`~icqs_fast.io.readers.PairFields` of the input (``demos``: of the
        ``--good-bad-pairs`` file, whose x is ``--demo-x-field`` and which has no ids)."""
        p = self.pair_options
        return PairFields(self.demo_x_field if demos else self.x_field, p.y_a_field,
                          p.y_b_field, None if demos else self.id_field,
                          (self.demo_label_field or self.label_field) if demos
                          else self.label_field,
                          p.pair_field, self.demo_y_field if demos else self.y_field)

    @property
    def backend(self) -> str:
        """The engine's backend (the settings' own)."""
        return self.scoring.backend

    def check(self) -> None:
        super().check()
        for name in ("good", "bad"):
            if not os.path.isfile(getattr(self, name)):
                flag = "good-bad-pairs" if self.good_bad_pairs is not None else name
                raise FileNotFoundError(f"no such --{flag} file: {getattr(self, name)}")
        if self.pairs is not None and self.pairs.pair_field is not None \
                and self.id_field is not None:
            raise ValueError("--pair-field is the pair's id: leave out --id-field")

    def resume_key(self) -> dict[str, Any]:
        """The model, the demonstration files' hashes, the scoring fingerprint
        (:meth:`ScoringSettings.fingerprint`), the record fields, the demonstration fields
        when they differ from the record fields, the shard."""
        key: dict[str, Any] = {
            "model": model_name(self.model),
            "good_sha256": file_sha256(self.good),
            "bad_sha256": file_sha256(self.bad),
            **self.scoring.fingerprint(),
            **self.record_key(),
        }
        if (self.demo_x_field, self.demo_y_field) != (self.x_field, self.y_field):
            # Only when they differ, so that outputs written before the option still resume.
            key.update(demo_x_field=self.demo_x_field, demo_y_field=self.demo_y_field)
        if self.good_bad_pairs is not None:
            key["good_bad_pairs"] = self.pair_fields_key() | {
                "label_field": self.demo_label_field or self.label_field}
        if self.pairs is not None:
            key["pairs"] = self.pair_fields_key() | {"tie_margin": self.pairs.tie_margin}
        return (key | self.quantization_key() | self.device_map_key()
                | ({"shard": self.shard} if self.shard else {}))

    def pair_fields_key(self) -> dict[str, Any]:
        """The pair fields, as the resume key holds them."""
        p = self.pair_options
        return {"y_a_field": p.y_a_field, "y_b_field": p.y_b_field, "pair_field": p.pair_field}

    def upgrade_meta(self, old: dict) -> dict:
        """The metadata of a ``score`` output written by an earlier version, in today's terms,
        so that it resumes exactly when its results are what this run computes:

        - before the declared options (c649e97 and earlier) the key held the
          ``--stratify-field`` spec as ``stratify_field`` (now the resolved ``stratify``), the
          template only when one was given, as the file's fields (``null``: the default), and
          ``tie_epsilon`` whatever the score (now only for ``score="tied"``, the only score it
          changes);
        - a result option added since takes its default (what the older version computed).
        """
        cls = type(self.scoring)
        new = dict(old)
        if "stratify_field" in new and "stratify" not in new:
            new["stratify"] = cls.json_value("stratify",
                                             resolve_stratify(new.pop("stratify_field"), self))
        defaults = {d.name: cls.json_value(d.name, d.default) for d in declared(cls)
                    if d.option.result}
        if "template" in new and (new["template"] is None or isinstance(new["template"], dict)):
            new["template"] = {**defaults["template"], **(new["template"] or {})}
        if new.get("score", defaults["score"]) != "tied":
            new.pop("tie_epsilon", None)
            defaults.pop("tie_epsilon")
        for name, value in defaults.items():
            new.setdefault(name, value)
        return new

    def key_labels(self) -> dict[str, str]:
        labels = super().key_labels()
        labels.update((d.name, d.flag) for d in declared(self.scoring) if d.flag is not None)
        labels["stratify"] = "--stratify-field"
        labels["template"] = "--template"
        return labels


def resolve_stratify(spec: str | None, config: ScoreJobConfig) -> Any:
    """The :class:`ScoringSettings` ``stratify`` of a ``--stratify-field`` spec: None
    ('none'), 'y' (the answer itself, or the demonstrations' y field named), 'auto', or, for
    another field of the demonstration files (``config.good`` / ``config.bad``, read with its
    demonstration fields and encoding), the per-file lists of its values."""
    if spec == "none":
        return None
    if spec == config.demo_y_field:
        return "y"
    if spec in (None, "y", "auto"):
        return spec

    fields = RecordFields(config.demo_x_field, config.demo_y_field, label_field=spec)
    return tuple([str(r.label) for r in read_records(path, fields, encoding=config.encoding)]
                 for path in (config.good, config.bad))


@dataclass(kw_only=True)
class FeatureJobConfig(JobConfig):
    """An ``icqs-fast features`` job: the glass-box features, their mode, the batch and chunk
    sizes (they decide which records share a padded forward, so they change the last bits),
    the system prompt and, optionally, the ``softmax_combo`` constants (a dict of
    ``ComboScale.as_dict``; None: from the vocabulary size)."""

    features: tuple[str, ...] = option(DEFAULT_FEATURES, flag=False, help="feature names")
    mode: str = option("standard", choices=FEATURE_MODES, help="standard, or the formulas of "
                       "the selfeval reference code (selfeval-compat; docs/scoring_files.md)")
    backend: str = option("auto", result=False, help="auto, torch, cpp, triton")
    batch_size: int = option(8, ge=1, help="items per padded forward")
    chunk_size: int = option(128, ge=1, help="records per glassbox call, sorted by length into "
                             "batches")
    system_prompt: str | None = option(None, kind="str", help="system prompt for every record")
    combo_scale: dict | None = option(None, kind="any", flag=False, help="softmax_combo's "
                                      "constants (none: from the vocabulary size)")
    # In the resume key only when set, so that older outputs still resume.
    deterministic: bool = option(False, help="batch-invariant mode: each record in a forward "
                                 "of its own, so its features are bit-identical whatever the "
                                 "batch (slower)")

    kind = "features"

    def check(self) -> None:
        super().check()
        if self.label_field is not None:
            raise ValueError("features has no --label-field")
        if self.ray is not None and self.ray.block_size % self.chunk_size:
            # A block of whole chunks computes every record in the same glassbox call as the
            # single-process run, so the features are the same to the last bit.
            raise ValueError(f"--block-size ({self.ray.block_size}) must be a multiple of "
                             f"--chunk-size ({self.chunk_size})")

    def resume_key(self) -> dict[str, Any]:
        """The resume key (see the module docstring)."""
        key: dict[str, Any] = {
            "command": "features",
            "model": model_name(self.model),
            "features": list(self.features),
            "mode": self.mode,
            "batch_size": self.batch_size,
            "chunk_size": self.chunk_size,
            "system_prompt": self.system_prompt,
        }
        key.update(self.record_key())
        del key["label_field"]  # features writes no label
        if self.combo_scale is not None:
            key["combo_scale"] = self.combo_scale
        if self.deterministic:
            key["deterministic"] = True
        return (key | self.quantization_key() | self.device_map_key()
                | ({"shard": self.shard} if self.shard else {}))
