"""``icqs-fast --help``, every ``<command> --help`` and argument errors import no
torch / transformers (not timed: ``python -m bench.studies.startup`` measures the wall time)."""

import subprocess
import sys

import pytest

from icqs_fast.cli import COMMANDS

HEAVY = ("torch", "transformers", "numpy", "fastapi", "scipy", "sklearn", "pyarrow", "pandas")

_PROBE = """
import sys
from icqs_fast.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("HEAVY:" + ",".join(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _heavy_after(argv):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), *argv],
                         capture_output=True, text=True, check=True).stdout
    return out.rsplit("HEAVY:", 1)[1].strip()


@pytest.mark.subprocess
def test_import_icqs_fast_is_light_and_facade_still_works():
    code = ("import sys, icqs_fast; assert 'torch' not in sys.modules, 'torch'; "
            "from icqs_fast import ICQSScorer, TokenStats, linear_token_stats, token_stats; "
            "assert callable(token_stats) and callable(linear_token_stats); "
            "print(TokenStats.__name__, ICQSScorer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["TokenStats", "ICQSScorer"]


@pytest.mark.parametrize("path", [()] + [tuple(n.split()) for n in COMMANDS],
                         ids=lambda p: " ".join(p) or "top")
@pytest.mark.subprocess
def test_help_imports_no_heavy_module(path):
    assert _heavy_after([*path, "--help"]) == ""


@pytest.mark.parametrize("argv", [["score", "in.jsonl"], ["features", "--bogus"],
                                  ["eval", "sst2", "--ns", "x"], ["nope"]])
@pytest.mark.subprocess
def test_argument_errors_import_no_heavy_module(argv):
    assert _heavy_after(argv) == ""


def test_every_option_has_help():
    """Every option of every command says what it does in --help."""
    import argparse

    missing = []
    for name in COMMANDS:
        p = argparse.ArgumentParser()
        COMMANDS.get(name).add_arguments(p)
        missing += [f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
                    for a in p._actions if not a.help and a.dest != "help"]
    assert not missing, missing
