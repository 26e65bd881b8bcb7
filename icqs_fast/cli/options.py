"""Option groups several commands share, written once so their names, choices and help agree."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any

from icqs_fast.engine.settings import CALIBRATIONS, DEFAULT_SCORE, SCORE_KINDS, TIE_EPSILON


def add_declared(p: argparse.ArgumentParser | Any, cls: Any, *,
                 names: Collection[str] | None = None, exclude: Collection[str] = (),
                 defaults: dict[str, Any] | None = None) -> None:
    """Add the declared options of the dataclass ``cls`` (:mod:`icqs_fast.options`) that have
    a flag to ``p`` (a parser or an argument group): ``dest`` is the field name, the type,
    choices, default and help come from the declaration. ``names``: only these fields;
    ``exclude``: not these; ``defaults``: other defaults for this command. A bool option is a
    switch that turns it on; a ``strs`` option is repeated (unset: the declared default)."""
    from icqs_fast.options import declared, default_text, metavar

    for d in declared(cls):
        if d.flag is None or d.name in exclude or (names is not None and d.name not in names):
            continue
        default = (defaults or {}).get(d.name, d.default)
        opt = d.option
        shown = default_text(d) if default == d.default else str(default)
        text = opt.help.replace("%", "%%") + (f" (default {shown})" if shown else "")
        kw: dict[str, Any] = dict(dest=d.name, help=text)
        if opt.kind == "bool":
            kw.update(action="store_true", default=bool(default))
        elif opt.kind == "strs":
            kw.update(action="append", default=None, metavar=metavar(d))
        else:
            kw.update(type={"int": int, "float": float}.get(opt.kind, str), default=default)
            if opt.choices is not None:
                kw["choices"] = list(opt.choices)
            else:
                kw["metavar"] = metavar(d)
        p.add_argument(d.flag, **kw)


def declared_values(args: argparse.Namespace, cls: Any, *,
                    names: Collection[str] | None = None) -> dict[str, Any]:
    """The parsed values of the options :func:`add_declared` added for ``cls`` (by field
    name; a repeated option given no time is left out, so the declared default holds)."""
    from icqs_fast.options import declared

    out = {}
    for d in declared(cls):
        if d.flag is None or (names is not None and d.name not in names) \
                or not hasattr(args, d.name):
            continue
        v = getattr(args, d.name)
        if d.option.kind == "strs" and v is None:
            continue
        out[d.name] = v
    return out


def add_calibration_arguments(p: argparse.ArgumentParser, default_score: str = DEFAULT_SCORE
                              ) -> None:
    """``--calibrate``, ``--score`` and ``--tie-epsilon`` (issues 17, 29), as ``score``, ``eval``,
    ``demo`` and ``serve`` take them (``eval`` keeps the paper's argmax as its default)."""
    p.add_argument("--calibrate", default="none", choices=list(CALIBRATIONS),
                   help="calibrate the ICQS log-likelihoods: content_free = minus log P(y | "
                        "demos, content-free input) (Zhao et al. 2021), pmi = minus log P(y | "
                        "demos, domain premise) (Holtzman et al. 2021); default none")
    p.add_argument("--score", default=default_score, choices=list(SCORE_KINDS),
                   help="ICQS score: the posterior mean of the ratio (mean: stable across "
                        "dtypes and backends), the ratio of the most likely context (argmax, "
                        "the paper's), or the mean ratio of the contexts within --tie-epsilon "
                        f"nats of it (tied); default {default_score}")
    p.add_argument("--tie-epsilon", type=float, default=TIE_EPSILON, metavar="NATS",
                   help="--score tied: contexts within this many nats of the most likely one "
                        f"count as tied (default {TIE_EPSILON}, from the measured fp32/bf16 "
                        "noise); also the noise level of the near_ties diagnostic")


def add_self_check_arguments(p: argparse.ArgumentParser, *, switch: bool = True) -> None:
    """The self-check's options (:mod:`icqs_fast.engine.selfcheck`), as ``score`` and ``check``
    take them; ``switch`` adds ``--no-self-check`` (``score``: the self-check runs by default)."""
    from icqs_fast.engine.selfcheck import DEFAULT_MAX_HELDOUT, LEAKS, METHODS

    if switch:
        p.add_argument("--no-self-check", action="store_true",
                       help="skip the self-check from the demonstration pools (no "
                            "p_good_calibrated, no expected accuracy)")
    p.add_argument("--self-check-max", type=int, default=DEFAULT_MAX_HELDOUT, metavar="N",
                   help="score at most N held-out demonstrations in the self-check, half from "
                        f"each pool (default {DEFAULT_MAX_HELDOUT}: each costs what one record "
                        "costs: 2.4%% of a 10,000-record job, measured); 0 = off")
    p.add_argument("--self-check-seed", type=int, default=0, metavar="SEED",
                   help="seed of the held-out draw, the bootstrap and the folds (default 0)")
    p.add_argument("--calibration-map", default="auto", choices=list(METHODS),
                   help="score -> P(good) map: platt (logistic), isotonic, or auto (Platt "
                        "below 100 held-out items per class; default)")
    p.add_argument("--target-precision", type=float, default=None, metavar="P",
                   help="also suggest the threshold whose held-out precision reaches P (at an "
                        "even mix of good and bad answers)")
    p.add_argument("--self-check-leak", default="input", choices=list(LEAKS),
                   help="a held-out demonstration is judged without every set holding a "
                        "demonstration with its input (input; default) or the same input and "
                        "answer (pair: for pools that share inputs by design)")


def self_check_kwargs(args: argparse.Namespace) -> dict:
    """The :func:`icqs_fast.engine.selfcheck.run_self_check` keywords of parsed
    :func:`add_self_check_arguments` options (ValueError naming the flag)."""
    if args.self_check_max < 0:
        raise ValueError(f"--self-check-max must be >= 0, got {args.self_check_max}")
    tp = args.target_precision
    if tp is not None and not 0.0 < tp <= 1.0:
        raise ValueError(f"--target-precision must be in (0, 1], got {tp}")
    return {"max_heldout": 0 if getattr(args, "no_self_check", False) else args.self_check_max,
            "seed": args.self_check_seed, "method": args.calibration_map,
            "leak": args.self_check_leak, "target_precision": tp}


def add_scoring_arguments(p: argparse.ArgumentParser, *, record_fields: bool = False) -> None:
    """The demonstration files, the model and the ICQS options, as ``score`` and ``check`` take
    them (everything but the input/output, record-field, resume and Ray options).
    ``record_fields``: the command also reads records (``score``), whose ``--x-field`` /
    ``--y-field`` are then the demonstration fields' defaults."""
    p.add_argument("--good", required=True,
                   help="good demonstrations: JSONL/CSV/TSV (optionally .gz), Parquet or a "
                   "datasets folder, with the --demo-x-field / --demo-y-field fields")
    p.add_argument("--bad", required=True,
                   help="bad demonstrations (the same formats and fields as --good)")
    p.add_argument("--demo-x-field", default=None if record_fields else "x",
                   help="field with the input in the --good / --bad files (default: "
                   f"{'--x-field' if record_fields else 'x'})")
    p.add_argument("--demo-y-field", default=None if record_fields else "y",
                   help="field with the answer in the --good / --bad files (default: "
                   f"{'--y-field' if record_fields else 'y'})")
    p.add_argument("--encoding", default="utf-8", help="text encoding (default: utf-8)")
    p.add_argument("--model", default=None,
                   help="local Hugging Face model folder (default: the embedded SmolLM2-135M)")
    add_dtype_argument(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--num-ratios", type=int, default=5, help="M+1 ratios j/M (default 5)")
    p.add_argument("--demos-per-set", type=int, default=8, help="N (default 8)")
    p.add_argument("--sets-per-ratio", type=int, default=4, help="L (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the demonstration sets (default 0)")
    p.add_argument("--mixing", choices=["exact", "bernoulli"], default="exact",
                   help="good demonstrations per set: exact (round(r N)) or bernoulli "
                   "(each one good with probability r)")
    p.add_argument("--replacement", action="store_true",
                   help="draw demonstrations with replacement (small pools)")
    p.add_argument("--stratify-field", default="auto", metavar="FIELD",
                   help="label-balanced demonstration sets: every set at every ratio holds the "
                        "same count per value of FIELD of the good/bad files ('y': the answer "
                        "itself, i.e. the label it states; 'auto': 'y' when the answers are "
                        "labels (default); 'none': unstratified)")
    p.add_argument("--strata-order", choices=["shuffled", "fixed"], default="fixed",
                   help="with --stratify-field: 'fixed' (default) puts the same stratum at each "
                        "position of every set (the last demonstration's label included)")
    add_calibration_arguments(p)
    p.add_argument("--content-free", action="append", default=None, metavar="TEXT",
                   help="a content-free input of --calibrate content_free, put in the "
                        "template's query in place of x; repeat for several (averaged). "
                        "Default: 'N/A', '' and '[MASK]'. For free-text answers each input adds "
                        "one row per context and response, so one input costs a third")
    p.add_argument("--pmi-premise", default=None, metavar="TEXT",
                   help="the domain premise of --calibrate pmi, replacing the whole query "
                        "(default: the template's query text after {x}, e.g. 'Answer:')")
    p.add_argument("--backend", default="auto", help="auto, torch, cpp, triton")
    p.add_argument("--token-budget", type=int, default=None,
                   help="max rows x tokens per forward (default: the engine's)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode (one response per forward; slower)")
    p.add_argument("--max-length", type=int, default=None, help="prompt length limit")
    p.add_argument("--drop-oldest-demos", action="store_true",
                   help="drop a set's oldest demonstrations when a prompt is too long")
    p.add_argument("--template", default=None,
                   help="JSON file with Template fields (system, demo, query, response, separator)")


def scoring_options(args: argparse.Namespace, template_spec: dict | None) -> dict:
    """The ``scoring`` dict of a :class:`~icqs_fast.jobs.config.ScoreJobConfig` from parsed
    :func:`add_scoring_arguments` options (``template_spec``: the template file's fields)."""
    return dict(num_ratios=args.num_ratios, demos_per_set=args.demos_per_set,
                sets_per_ratio=args.sets_per_ratio, seed=args.seed, mixing=args.mixing,
                replacement=args.replacement, stratify=args.stratify_field,
                strata_order=args.strata_order, max_length=args.max_length,
                drop_oldest_demos=args.drop_oldest_demos, template=template_spec,
                calibration=args.calibrate, score=args.score, tie_epsilon=args.tie_epsilon,
                pmi_premise=args.pmi_premise,
                **({"content_free": tuple(args.content_free)} if args.content_free else {}))


# The names icqs_fast.models.choose_dtype accepts (written out: the models module imports torch,
# which `--help` must not; tests/test_dtype_choice.py checks that the two agree).
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def add_dtype_argument(p: argparse.ArgumentParser, default: str = "auto") -> None:
    """``--dtype``, as every command that loads a model takes it."""
    p.add_argument("--dtype", default=default, choices=DTYPE_NAMES,
                   help="model weights' dtype. auto (default): bf16 on CUDA; on the CPU bf16 "
                        "where it has native bf16 dot products (avx512_bf16 / AMX: faster "
                        "than fp32, the default score within 0.01), else float32; "
                        "$ICQS_FAST_CPU_DTYPE overrides that choice; `icqs-fast info` shows it "
                        "and why. An explicit 16-bit dtype the CPU has no native dot product "
                        "for warns (about 5x slower than float32)")
