"""``icqs-fast`` command line.

Each subcommand lives in the module that owns it; that module exposes
``add_arguments(parser)`` and ``run(args) -> int``. This file only wires them up.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from types import ModuleType

from icqs_fast.registry import Registry

# Every command (its words joined by a space) -> its module, imported only when the command is
# asked for; each module has add_arguments(parser) and run(args) -> int.
COMMANDS: Registry[ModuleType] = Registry("command")


@COMMANDS.add("info", "versions, device and available backends")
def _info() -> ModuleType:
    from icqs_fast.cli import info
    return info


@COMMANDS.add("models",
              "models loadable by name (installed or not) and the model cache, with sizes")
def _models() -> ModuleType:
    from icqs_fast.cli import models
    return models


@COMMANDS.add("demo", "score a small built-in set with the embedded model")
def _demo() -> ModuleType:
    from icqs_fast.cli import demo
    return demo


@COMMANDS.add("score", "score responses from a JSONL/CSV/TSV file with ICQS")
def _score() -> ModuleType:
    from icqs_fast.cli import score
    return score


@COMMANDS.add("check",
              "self-check from the demonstration pools: expected AUC, calibration, threshold")
def _check() -> ModuleType:
    from icqs_fast.cli import check
    return check


@COMMANDS.add("features", "glass-box features of a file's responses")
def _features() -> ModuleType:
    from icqs_fast.cli import features
    return features


@COMMANDS.add("rank", "rank models by mean score, with bootstrap intervals")
def _rank() -> ModuleType:
    from icqs_fast.cli import rank
    return rank


@COMMANDS.add("report", "one HTML page of a run's output; --baseline: drift between two runs")
def _report() -> ModuleType:
    from icqs_fast.cli import report
    return report


@COMMANDS.add("audit", "ALLURE: audit an LLM evaluator, round by round")
def _audit() -> ModuleType:
    from icqs_fast.cli import audit
    return audit


@COMMANDS.add("serve",
              "OpenAI-compatible scoring server (/v1/completions echo+logprobs, /v1/score)")
def _serve() -> ModuleType:
    from icqs_fast.cli import serve
    return serve


@COMMANDS.add("bench kernels", "token-statistics kernels vs torch")
def _bench_kernels() -> ModuleType:
    from icqs_fast.cli import bench_kernels
    return bench_kernels


@COMMANDS.add("bench icqs", "ICQS engine vs the naive method")
def _bench_icqs() -> ModuleType:
    from icqs_fast.cli import bench_icqs
    return bench_icqs


@COMMANDS.add("bench attention", "attention entropy vs eager")
def _bench_attention() -> ModuleType:
    from icqs_fast.cli import bench_attention
    return bench_attention


@COMMANDS.add("bench gpu",
              "measured GPU times of the Triton kernels and ops, then bench "
              "kernels/icqs/attention on CUDA (needs CUDA)")
def _bench_gpu() -> ModuleType:
    from icqs_fast.cli import bench_gpu
    return bench_gpu


@COMMANDS.add("bench lm-eval", "lm-eval's HF model vs the icqs-fast lm-eval model on a local task")
def _bench_lm_eval() -> ModuleType:
    from icqs_fast.benchmarks import lm_eval
    return lm_eval


@COMMANDS.add("bench scaleout", "records/s on Ray Data with 1..n workers vs the single-process CLI")
def _bench_scaleout() -> ModuleType:
    from icqs_fast.benchmarks import scaleout
    return scaleout


@COMMANDS.add("bench serve",
              "load test of 'serve' on 127.0.0.1: throughput, latency percentiles, no lost "
              "answers")
def _bench_serve() -> ModuleType:
    from icqs_fast.benchmarks import serve
    return serve


@COMMANDS.add("eval mtbench", "glass-box features vs GPT-4 on MT-Bench")
def _eval_mtbench() -> ModuleType:
    from icqs_fast.cli import eval_mtbench
    return eval_mtbench


def _eval_study() -> ModuleType:
    from icqs_fast.cli import eval as study
    return study


# One module runs the ICQS study of every data set (read from the command's words).
COMMANDS.add("eval fpb", "ICQS study on Financial PhraseBank")(_eval_study)
COMMANDS.add("eval sst2", "ICQS study on SST-2")(_eval_study)
COMMANDS.add("eval chaosnli", "ICQS study on ChaosNLI distributions")(_eval_study)


# Sphinx markup in docstrings reused as help: ":class:`~a.b.C`" -> "C", ":func:`a.b`" -> "a.b",
# ":ref:`text <target>`" -> "text", "``x``" -> "x". Help is read by people, not Sphinx.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)(?:\s*<[^`>]*>)?`")


def plain_text(text: str | None) -> str | None:
    """``text`` without Sphinx roles and double backticks (None stays None)."""
    if text is None:
        return None

    def role(m: re.Match) -> str:
        return m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)

    return _ROLE.sub(role, text).replace("``", "")


def _plain_help(p: argparse.ArgumentParser) -> None:
    """Every text of a command's ``--help`` as plain text (:func:`plain_text`)."""
    p.description, p.epilog = plain_text(p.description), plain_text(p.epilog)
    for a in p._actions:
        if isinstance(a.help, str):
            a.help = plain_text(a.help)


def _selected(argv: list[str] | None) -> tuple[str, ...] | None:
    """The command path ``argv`` names (its leading non-option words); None: build them all."""
    if argv is None:
        return None
    words = []
    for a in argv:
        if a.startswith("-") or len(words) == 2:
            break
        words.append(a)
    return tuple(words)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the command it names imports its module and adds its
    arguments (so ``--help`` and argument errors answer without importing any other command's
    module). Command modules keep ``add_arguments`` free of torch / transformers / numpy."""
    selected = _selected(argv)
    parser = argparse.ArgumentParser(prog="icqs-fast",
                                     description=plain_text(__doc__.splitlines()[0]))
    # Each command's own parser by its path, for its usage on a misspelled flag (main).
    parser.set_defaults(_path=())
    commands: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    parser.commands = commands  # type: ignore[attr-defined]
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name in COMMANDS:
        path, help_ = tuple(name.split()), COMMANDS.about[name]
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = g.add_subparsers(dest="subcommand", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_)
        p.set_defaults(_command=name, _path=path)
        commands[path] = p
        if selected is not None and selected[:len(path)] != path:
            continue  # not the command asked for: its arguments are never parsed
        try:
            mod = COMMANDS.get(name)
        except ImportError as exc:
            # A missing optional piece should break only its own subcommand.
            p.set_defaults(_import_error=str(exc))
            continue
        mod.add_arguments(p)
        _plain_help(p)
    return parser


CUDA_ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def main(argv: list[str] | None = None) -> int:
    # OpenMP's wait policy is read once, when torch loads: set it before any command imports it.
    from icqs_fast import threads

    threads.prepare_openmp()
    # CUDA's caching allocator reads this at its first allocation: expandable segments keep
    # the varied shapes of banks and forwards (and the server's bank per request) from
    # fragmenting GPU memory. A value of one's own stands.
    os.environ.setdefault(CUDA_ALLOC_ENV, "expandable_segments:True")
    if argv is None:  # the process entry point (not a caller's or a test's in-process call)
        argv = sys.argv[1:]
        threads.enable_governor()
        threads.prepare_malloc()  # a process-wide policy: not for a caller's process
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would name them under the top-level usage: give the command's own
        parser.commands.get(args._path, parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    err = getattr(args, "_import_error", None)
    if err:
        print(f"icqs-fast: this command is unavailable: {err}", file=sys.stderr)
        return 2
    mod = COMMANDS.get(args._command)
    try:
        return int(mod.run(args) or 0)
    # Bad input (a file, a field, an option value) is a ValueError or a missing file: one line,
    # exit 2. Anything else (TypeError included) is a bug and keeps its traceback.
    except (ValueError, FileNotFoundError) as exc:
        print(f"icqs-fast: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written: one line, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"icqs-fast: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
