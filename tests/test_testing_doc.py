"""docs/TESTING.md's tier table against the suite: every heavy marker the Makefile's fast tier
leaves out is registered and listed in the doc, and each count the doc states holds within the
tolerance it states (one ``--collect-only`` in a fresh interpreter, reading each test's
markers)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "TESTING.md"

# Writes each collected test's marker names to $TIER_OUT (after conftest's own marking).
_PLUGIN = '''
import json, os

def pytest_collection_finish(session):
    with open(os.environ["TIER_OUT"], "w") as f:
        json.dump([sorted({m.name for m in item.iter_markers()}) for item in session.items], f)
'''


def _heavy_markers() -> list[str]:
    """The markers ``make test-fast`` deselects (its ``FAST_DESELECT`` expression)."""
    text = (ROOT / "Makefile").read_text()
    expr = re.search(r"^FAST_DESELECT := not \((.+)\)$", text, re.M)
    assert expr, "Makefile: no FAST_DESELECT := not (...) line"
    return [m.strip() for m in expr.group(1).split(" or ")]


def _doc_rows() -> dict[str, int]:
    """``{tier: count}`` from the doc's tier table: rows ``| `name` | ... | N | ...``."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([\w-]+)`\s*\|.*?\|\s*([\d,]+)\s*\|", line)
        if m:
            rows[m.group(1)] = int(m.group(2).replace(",", ""))
    return rows


def _tolerance() -> float:
    m = re.search(r"counts hold within (\d+) %", DOC.read_text())
    assert m, "docs/TESTING.md must say how close its counts are ('counts hold within N %')"
    return int(m.group(1)) / 100


def test_heavy_markers_are_registered_and_documented():
    # pyproject.toml's `markers = [...]` entries, "name: meaning" (no tomllib on Python 3.10).
    block = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    registered = set(re.findall(r'^\s*"([\w-]+):', block.group(1), re.M))
    heavy = set(_heavy_markers())
    assert heavy <= registered, f"not in pyproject.toml's markers: {heavy - registered}"
    assert heavy | {"all", "fast"} <= set(_doc_rows()), \
        f"no row in docs/TESTING.md's tier table: {heavy | {'all', 'fast'} - set(_doc_rows())}"


@pytest.mark.subprocess
def test_doc_counts_match_the_suite(tmp_path):
    (tmp_path / "tier_dump.py").write_text(_PLUGIN)
    out = tmp_path / "markers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tier_dump",
         "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TIER_OUT": str(out), "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    marks = [set(m) for m in json.loads(out.read_text())]
    heavy = _heavy_markers()
    actual = {"all": len(marks), "fast": sum(not (m & set(heavy)) for m in marks)}
    actual.update({h: sum(h in m for m in marks) for h in heavy})
    doc, tol = _doc_rows(), _tolerance()
    for tier, n in actual.items():
        assert tier in doc, f"docs/TESTING.md lists no count for `{tier}`"
        assert abs(n - doc[tier]) <= max(tol * doc[tier], 3), (
            f"docs/TESTING.md says {doc[tier]} tests for `{tier}`, the suite has {n}: "
            "update the table")
