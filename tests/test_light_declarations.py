"""The option, settings and schema modules import nothing heavy: a tool that reads the
declarations (the CLI's flags, the docs' tables, a job's config) never loads torch or
transformers; their heavy types come in under ``TYPE_CHECKING`` only. ``icqs-fast --help``
and every ``<command> --help`` are checked in tests/test_startup.py."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "triton", "scipy", "sklearn", "pyarrow", "pandas")

DECLARATIONS = (
    "icqs_fast.options",
    "icqs_fast.engine.settings",
    "icqs_fast.jobs.config",
    "icqs_fast.io.schema",
    "icqs_fast.serve.config",
    "icqs_fast.serve.schemas",
    "icqs_fast.cli.options",
)

_PROBE = """
import importlib, sys
importlib.import_module(sys.argv[1])
print("HEAVY:" + ",".join(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _heavy_after_import(module: str) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), module],
                         capture_output=True, text=True, check=True).stdout
    return out.rsplit("HEAVY:", 1)[1].strip()


@pytest.mark.parametrize("module", DECLARATIONS)
@pytest.mark.subprocess
def test_declaration_imports_nothing_heavy(module):
    assert _heavy_after_import(module) == "", f"importing {module} loads heavy modules"


@pytest.mark.subprocess
def test_the_probe_sees_a_heavy_import():
    """The check itself can fail: icqs_fast.types holds torch tensors, so it imports torch."""
    assert "torch" in _heavy_after_import("icqs_fast.types").split(",")
