"""The command-line flags of the declared options (:mod:`icqs_fast.options`), and the option
groups several commands share, so their names, choices, defaults and help agree: each flag is
derived from the field that declares it (``ScoringSettings``, ``ScoreJobConfig``,
``SelfCheckOptions``, ``RayOptions``, ...), and the settings objects are built from the parsed
values in one place each (:func:`scoring_settings`, :func:`score_config`)."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any

from icqs_fast.engine.settings import DEFAULT_SCORE

# The flags of the declarations are derived in icqs_fast/options.py (bench scripts and the
# benchmarks use them too, which may not import the CLI); the commands import them from here.
from icqs_fast.options import add_declared, declared_values  # noqa: F401


def add_calibration_arguments(p: argparse.ArgumentParser, default_score: str = DEFAULT_SCORE
                              ) -> None:
    """``--calibrate``, ``--score`` and ``--tie-epsilon``, as ``score``, ``eval``, ``demo`` and
    ``serve`` take them (``eval`` keeps the paper's argmax as its default)."""
    from icqs_fast.engine import settings

    add_declared(p, settings.ScoringSettings, names=CALIBRATION_OPTIONS,
                 defaults={"score": default_score})


# The ScoringSettings fields of add_calibration_arguments.
CALIBRATION_OPTIONS = ("calibration", "score", "tie_epsilon")


def add_self_check_arguments(p: argparse.ArgumentParser, *, switch: bool = True) -> None:
    """The self-check's options (:class:`~icqs_fast.jobs.config.SelfCheckOptions`), as
    ``score``, ``check``, ``demo`` and ``serve`` take them; ``switch`` adds ``--no-self-check``
    (``score``: the self-check runs by default)."""
    from icqs_fast.jobs.config import SelfCheckOptions

    if switch:
        p.add_argument("--no-self-check", action="store_true",
                       help="skip the self-check from the demonstration pools (no "
                            "p_good_calibrated, no expected accuracy)")
    add_declared(p, SelfCheckOptions)


def self_check_options(args: argparse.Namespace) -> Any:
    """The :class:`~icqs_fast.jobs.config.SelfCheckOptions` of parsed
    :func:`add_self_check_arguments` options (ValueError naming the flag)."""
    from icqs_fast.jobs.config import SelfCheckOptions

    values = declared_values(args, SelfCheckOptions)
    if getattr(args, "no_self_check", False):
        values["max_heldout"] = 0
    return SelfCheckOptions(**values)


def self_check_kwargs(args: argparse.Namespace) -> dict:
    """The :func:`icqs_fast.engine.selfcheck.run_self_check` keywords of parsed
    :func:`add_self_check_arguments` options (ValueError naming the flag)."""
    return self_check_options(args).kwargs()


def add_scoring_arguments(p: argparse.ArgumentParser, *, record_fields: bool = False,
                          demos_required: bool = True) -> None:
    """The demonstration files, the model and the ICQS options, as ``score`` and ``check`` take
    them (everything but the input/output, record-field, resume and Ray options): the declared
    options of :class:`~icqs_fast.jobs.config.ScoreJobConfig`'s demonstrations and model and
    every :class:`~icqs_fast.engine.settings.ScoringSettings` option with a flag, plus
    ``--stratify-field`` and ``--template`` (files the command turns into settings).
    ``record_fields``: the command also reads records (``score``), whose ``--x-field`` /
    ``--y-field`` are then the demonstration fields' defaults. ``demos_required`` False:
    ``--good`` / ``--bad`` may be left out (``check --from-output``)."""
    from icqs_fast.engine import settings
    from icqs_fast.jobs.config import ScoreJobConfig

    add_declared(p, ScoreJobConfig, names=DEMO_OPTIONS, required=demos_required,
                 defaults=None if record_fields else {"demo_x_field": "x", "demo_y_field": "y"})
    add_declared(p, ScoreJobConfig, names=MODEL_OPTIONS)
    add_dtype_argument(p)
    add_declared(p, settings.ScoringSettings)
    p.add_argument("--stratify-field", default="auto", metavar="FIELD",
                   help="label-balanced demonstration sets: every set at every ratio holds the "
                        "same count per value of FIELD of the good/bad files ('y': the answer "
                        "itself, i.e. the label it states; 'auto': 'y' when the answers are "
                        "labels (default); 'none': unstratified)")
    p.add_argument("--template", default=None, metavar="FILE",
                   help="JSON file with Template fields (system, demo, query, response, separator)")


# The ScoreJobConfig fields add_scoring_arguments adds (the input's are add_job_arguments').
DEMO_OPTIONS = ("good", "bad", "demo_x_field", "demo_y_field", "encoding")
MODEL_OPTIONS = ("model", "device", "quantization", "device_map")


def scoring_settings(args: argparse.Namespace, config: Any) -> Any:
    """The one :class:`~icqs_fast.engine.settings.ScoringSettings` of a ``score`` / ``check``
    run, from parsed :func:`add_scoring_arguments` options: the template file read, the
    ``--stratify-field`` spec resolved against ``config``'s demonstration files (ValueError /
    InputError naming the flag or file)."""
    from icqs_fast.engine import settings
    from icqs_fast.jobs.config import resolve_stratify
    from icqs_fast.jobs.score import load_template

    template, _ = load_template(args.template)
    return settings.ScoringSettings(**declared_values(args, settings.ScoringSettings),
                                    template=template,
                                    stratify=resolve_stratify(args.stratify_field, config))


def add_job_arguments(p: argparse.ArgumentParser, cls: Any, *, what: str,
                      exclude: Collection[str] = ()) -> None:
    """The input, output and record options of a job of class ``cls`` (``ScoreJobConfig`` or
    ``FeatureJobConfig``). ``what``: what the output holds ("results", "features");
    ``exclude``: fields the command does not take (``features``: no label)."""
    from icqs_fast.jobs.config import JobConfig

    p.add_argument("input", help=_help(JobConfig, "input"))
    p.add_argument("-o", "--output", required=True,
                   help=_help(JobConfig, "output").replace("results", what, 1))
    add_declared(p, cls, names=INPUT_OPTIONS, exclude=exclude)


def add_run_arguments(p: argparse.ArgumentParser, cls: Any) -> None:
    """After the command's own options: ``--resume`` and the like, ``--threads`` and the
    ``--ray`` group (:class:`~icqs_fast.jobs.config.RayOptions`)."""
    from icqs_fast.jobs.config import RayOptions

    add_declared(p, cls, names=RUN_OPTIONS)
    g = p.add_argument_group("Ray (scale-out; OUTPUT is then a folder of block files)")
    g.add_argument("--ray", action="store_true",
                   help="run on a Ray cluster with Ray Data (icqs-fast[ray])")
    add_declared(g, RayOptions)


# The JobConfig fields of add_job_arguments and add_run_arguments.
INPUT_OPTIONS = ("format", "shard", "x_field", "y_field", "id_field", "label_field")
RUN_OPTIONS = ("resume", "overwrite", "on_error", "quiet", "threads")


def _help(cls: Any, name: str) -> str:
    from icqs_fast.options import declaration

    return declaration(cls, name).option.help.replace("%", "%%")


def job_values(args: argparse.Namespace, cls: Any) -> dict[str, Any]:
    """The :class:`~icqs_fast.jobs.config.JobConfig` fields of parsed
    :func:`add_job_arguments` / :func:`add_run_arguments` options and the model options
    (``ray``: a :class:`RayOptions` with ``--ray``, else None), by field name."""
    from icqs_fast.jobs.config import RayOptions

    values = declared_values(args, cls, names=(*INPUT_OPTIONS, *RUN_OPTIONS, *MODEL_OPTIONS,
                                               "encoding"))
    values.update(input=args.input, output=args.output, dtype=args.dtype,
                  ray=RayOptions(**declared_values(args, RayOptions)) if args.ray else None)
    return values


def score_config(args: argparse.Namespace, **job: Any) -> Any:
    """The :class:`~icqs_fast.jobs.config.ScoreJobConfig` of parsed ``score`` / ``check``
    options: the job fields (``job``: :func:`job_values`, or what ``check`` sets), the
    demonstrations, the self-check options and the one ScoringSettings
    (:func:`scoring_settings`), built here and nowhere else."""
    import dataclasses

    from icqs_fast.jobs.config import ScoreJobConfig

    job = {**declared_values(args, ScoreJobConfig, names=(*DEMO_OPTIONS, *MODEL_OPTIONS)),
           **job}
    config = ScoreJobConfig(**job, self_check=self_check_options(args))
    # The --stratify-field spec is resolved against the demonstration files the config names.
    return dataclasses.replace(config, scoring=scoring_settings(args, config))


def add_model_arguments(p: argparse.ArgumentParser, names: Collection[str] = ("model",), *,
                        what: str = "") -> None:
    """The model options of a command that loads a model outside a job (``demo``, ``eval``,
    ``audit``, ``serve``, ``bench icqs``), declared once with the jobs' (``--model``,
    ``--device``: :class:`~icqs_fast.jobs.config.JobConfig`); ``what``: what the model is here
    ("evaluator: "), said before ``--model``'s help."""
    from icqs_fast.jobs.config import JobConfig
    from icqs_fast.options import declaration

    helps = {"model": what + declaration(JobConfig, "model").option.help} if what else None
    add_declared(p, JobConfig, names=names, helps=helps)


def add_quiet_argument(p: argparse.ArgumentParser, help: str) -> None:  # noqa: A002
    """``--quiet``, declared once (:class:`~icqs_fast.jobs.config.JobConfig`), with ``help``:
    what this command then leaves unsaid."""
    from icqs_fast.jobs.config import JobConfig

    add_declared(p, JobConfig, names=("quiet",), helps={"quiet": help})


def add_backend_argument(p: argparse.ArgumentParser) -> None:
    """``--backend``, the engine's (:class:`~icqs_fast.engine.settings.ScoringSettings`), for
    the commands that build a scorer outside a job (``demo``, ``eval``, ``audit``)."""
    from icqs_fast.engine import settings

    add_declared(p, settings.ScoringSettings, names=("backend",))


# The names icqs_fast.models.choose_dtype accepts (written out: the models module imports torch,
# which `--help` must not; tests/test_dtype_choice.py checks that the two agree).
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "bf16-mixed", "mixed",
               "bf16-products", "float16", "fp16")


def add_quantization_argument(p: argparse.ArgumentParser) -> None:
    """``--quantization``, declared once (:class:`~icqs_fast.jobs.config.JobConfig`), for the
    commands that load a model outside a job (``serve``, ``eval``)."""
    from icqs_fast.jobs.config import JobConfig

    add_declared(p, JobConfig, names=("quantization",))


def add_device_map_argument(p: argparse.ArgumentParser) -> None:
    """``--device-map``, declared once (:class:`~icqs_fast.jobs.config.JobConfig`), for the
    commands that load a model outside a job (``serve``, ``eval``)."""
    from icqs_fast.jobs.config import JobConfig

    add_declared(p, JobConfig, names=("device_map",))


def add_dtype_argument(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--dtype``, as every command that loads a model takes it."""
    p.add_argument("--dtype", default=default, choices=DTYPE_NAMES,
                   help="how the model computes. auto (default): bf16 on CUDA; on a CPU with "
                        "native bf16 dot products (avx512_bf16 / AMX) bf16-products (bf16 "
                        "weights and products, fp32 accumulation, activations, norms and "
                        "softmax: within ~0.11 nats/token of float32 on the embedded model), "
                        "else float32; bf16-mixed: bf16 weights, products at fp32 precision "
                        "(within ~0.06); bfloat16: the pure bf16 forward. On the CPU every dtype "
                        "is batch-invariant (a row's numbers the same bits whatever shares its "
                        "forward); "
                        "$ICQS_FAST_CPU_DTYPE overrides that choice; `icqs-fast info` shows it "
                        "and why. An explicit 16-bit dtype the CPU has no native dot product "
                        "for warns (about 5x slower than float32)")


# --------------------------------------------------------------------------- docs

def doc_tables() -> tuple[tuple[str, Any, tuple[str, ...] | None], ...]:
    """The option tables of docs/CLI.md, each generated from its declarations: (title, the
    declaring class, the fields; None: every declared option with a flag). A function, so that
    the classes are imported only when the docs are written."""
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.jobs.config import (
        FeatureJobConfig,
        JobConfig,
        PairOptions,
        RayOptions,
        ScoreJobConfig,
        SelfCheckOptions,
    )
    from icqs_fast.serve.config import ServeConfig

    return (
        ("Input, output and run (`score`, `features`; `--label-field`: `score` only)",
         JobConfig, (*INPUT_OPTIONS, "encoding", *MODEL_OPTIONS, *RUN_OPTIONS)),
        ("Demonstrations (`score`, `check`)", ScoreJobConfig,
         ("good", "bad", "good_bad_pairs", "demo_label_field", "demo_x_field", "demo_y_field")),
        ("Pairs (`score --pairs`; the pair fields and `--tie-margin` also for "
         "`--good-bad-pairs` of `score` and `check`)",
         PairOptions, None),
        ("ICQS options (`score`, `check`; `--calibrate`, `--score`, `--tie-epsilon` also "
         "`eval`, `demo`, `serve`; `/v1/score`'s `icqs_options` takes those marked request)",
         ScoringSettings, None),
        ("Self-check (`score`, `check`, `demo`, `serve`)", SelfCheckOptions, None),
        ("`features`", FeatureJobConfig, (
            "mode", "backend", "batch_size", "chunk_size", "deterministic", "system_prompt")),
        ("`--ray` (`score`, `features`)", RayOptions, None),
        ("The server (`serve`; its ICQS options are the request ones above, its self-check "
         "options the self-check's; docs/SERVER.md)", ServeConfig, None),
    )


DOCS_BEGIN = "<!-- option tables: generated by icqs_fast.cli.options.options_docs -->"
DOCS_END = "<!-- end of the generated option tables -->"


def options_docs() -> str:
    """The option tables of docs/CLI.md (between :data:`DOCS_BEGIN` and :data:`DOCS_END`),
    generated from the declarations (:func:`doc_tables`)."""
    from icqs_fast.options import declared, options_table

    parts = [DOCS_BEGIN, ""]
    for title, cls, names in doc_tables():
        table = options_table(cls, names=names)
        requested = [d.flag for d in declared(cls) if d.option.request]
        parts += [f"**{title}**", "", table.rstrip("\n")]
        if requested:
            parts.append("")
            parts.append("request options (`icqs_options`): " + ", ".join(
                f"`{f}`" for f in requested))
        parts.append("")
    return "\n".join(parts + [DOCS_END])


def write_options_docs(path: str = "docs/CLI.md") -> bool:
    """Replace the generated option tables in ``path`` with :func:`options_docs` (appended
    when the file has none); whether the file changed. ``python -m icqs_fast.cli.options``
    runs it on docs/CLI.md."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = options_docs()
    if DOCS_BEGIN in text and DOCS_END in text:
        head, rest = text.split(DOCS_BEGIN, 1)
        tail = rest.split(DOCS_END, 1)[1]
        updated = head + new + tail
    else:
        updated = text.rstrip("\n") + "\n\n" + new + "\n"
    if updated != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(updated)
    return updated != text


if __name__ == "__main__":
    print("docs/CLI.md " + ("updated" if write_options_docs() else "already up to date"))
