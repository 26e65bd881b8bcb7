"""The ``--ray`` job of a command line, for the Ray tests (test-only: the library's CLI runs
``--ray`` through ``icqs-fast score|features --ray``).

:func:`build_config` parses ``score`` / ``features`` arguments with ``--ray`` implied into the
job config; :func:`main` runs it on the Ray executor (what ``icqs-fast score --ray`` runs), for
drivers in a process of their own (``tests/_faults.py ray-hold``). Errors are not caught: a
test driver shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

KINDS = ("score", "features")


def build_parser(kind: str) -> argparse.ArgumentParser:
    """The ``kind`` command's parser (its ``--ray`` options included), ``--ray`` implied."""
    p = argparse.ArgumentParser(prog=f"python tests/_ray_cli.py {kind}")
    importlib.import_module(f"icqs_fast.cli.{kind}").add_arguments(p)
    p.set_defaults(ray=True)
    return p


def build_config(kind: str, args: argparse.Namespace) -> Any:
    """The job config of ``kind`` for parsed arguments (the command module's own builder)."""
    return importlib.import_module(f"icqs_fast.cli.{kind}").build_config(args)


def main(argv: list[str] | None = None) -> int:
    """``score|features ARGS``: run the ``--ray`` job of the command's arguments; its exit code
    (2 with a usage line when the kind is missing)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in KINDS:
        print(f"usage: python tests/_ray_cli.py {{{','.join(KINDS)}}} ARGS", file=sys.stderr)
        return 2
    from icqs_fast.jobs.run import run_job

    return run_job(build_config(argv[0], build_parser(argv[0]).parse_args(argv[1:])),
                   executor="ray")


if __name__ == "__main__":
    sys.exit(main())
