"""Startup time: wall time of ``icqs-fast --help`` and of every ``icqs-fast <command> --help``,
each in a fresh Python process.

    python -m bench.studies.startup [--runs 5] [--limit 1.0] [--json] [--pythonpath DIR]

The commands are read from the help itself (argparse's ``{a,b,...}`` choices of the top level
and of each command group), so a new command is measured without being listed here. Each is run
``--runs`` times as ``python -m icqs_fast.cli ... --help``; the record gives the median and the
max per command. The exit code is 1 when any median is above ``--limit`` seconds (default 1 s:
help and argument errors must not wait for torch / transformers). ``--pythonpath`` runs another
checkout's package (e.g. the one before a change) for a side-by-side figure. On a busy machine
the numbers move with its load, which is recorded (``loadavg_1min``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from icqs_fast.options import add_json_argument


def _env(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.path.abspath(pythonpath)
    return env


def _cwd(env: dict[str, str]) -> str:
    # `python -m` puts the working folder first on sys.path, ahead of PYTHONPATH: run in the
    # measured checkout (or, without one, a folder that holds no package) so that the package
    # measured is the one asked for.
    return env.get("PYTHONPATH") or os.path.expanduser("~")


def package_file(env: dict[str, str]) -> str:
    """The ``icqs_fast/__init__.py`` the measured processes import (recorded with the figures)."""
    return subprocess.run([sys.executable, "-c", "import icqs_fast; print(icqs_fast.__file__)"],
                          env=env, cwd=_cwd(env), capture_output=True, text=True,
                          check=True).stdout.strip()


def _help(words: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Wall seconds of ``python -m icqs_fast.cli WORDS --help`` and its output."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "icqs_fast.cli", *words, "--help"], env=env,
                          cwd=_cwd(env), capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"icqs-fast {' '.join(words)} --help exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-500:]}")
    return dt, proc.stdout


def _choices(help_text: str) -> list[str]:
    """The subcommands argparse lists as ``{a,b,c} ...`` in a usage text (not an option's
    choices, which have no ``...`` after them)."""
    m = re.search(r"\{([\w,-]+)\}\s+\.\.\.", help_text)
    return m.group(1).split(",") if m else []


def commands(env: dict[str, str]) -> list[list[str]]:
    """Every command path: ``[]`` (the top level), ``[cmd]``, and ``[group, cmd]``."""
    _, top = _help([], env)
    paths: list[list[str]] = [[]]
    for cmd in _choices(top):
        paths.append([cmd])
        _, text = _help([cmd], env)
        paths += [[cmd, sub] for sub in _choices(text)]
    return paths


def bench(runs: int = 5, limit: float = 1.0, pythonpath: str | None = None) -> dict:
    env = _env(pythonpath)
    rows = []
    for words in commands(env):
        times = [_help(words, env)[0] for _ in range(runs)]
        rows.append({"command": " ".join(["icqs-fast", *words, "--help"]),
                     "median_s": round(statistics.median(times), 3),
                     "max_s": round(max(times), 3)})
    slow = [r["command"] for r in rows if r["median_s"] > limit]
    return {"bench": "startup", "runs": runs, "limit_s": limit,
            "python": sys.executable, "pythonpath": env.get("PYTHONPATH"),
            "package": package_file(env),
            "loadavg_1min": os.getloadavg()[0], "commands": rows,
            "max_median_s": max(r["median_s"] for r in rows), "over_limit": slow}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("wall time of `icqs-fast --help` and each `icqs-fast <command> --help` in "
                     "fresh processes: median and max; exit 1 if a median is above --limit")
    p.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    p.add_argument("--limit", type=float, default=1.0,
                   help="seconds a median may take (default 1.0)")
    p.add_argument("--pythonpath", default=None,
                   help="PYTHONPATH of the measured processes (another checkout; default: "
                        "this one's environment)")
    add_json_argument(p, "print the record as one JSON line")


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError("--runs must be >= 1")
    rec = bench(args.runs, args.limit, args.pythonpath)
    if args.json:
        print(json.dumps(rec))
    else:
        print(f"{'command':44s} {'median s':>9s} {'max s':>7s}   (load {rec['loadavg_1min']:.1f})")
        for r in rec["commands"]:
            print(f"{r['command']:44s} {r['median_s']:9.3f} {r['max_s']:7.3f}")
        if rec["over_limit"]:
            print(f"over {args.limit} s: {', '.join(rec['over_limit'])}", file=sys.stderr)
    return 1 if rec["over_limit"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.startup")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
