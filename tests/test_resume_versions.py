"""Outputs written by an earlier version (tests/data/resume_v0: c649e97, before the declared
options, with the old resume key: ``stratify_field``, ``template`` null, ``tie_epsilon`` for
every score) resume with today's code: the run continues after their last record (not a
restart, not a refusal), and what it appends is what today's code computes for those records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from icqs_fast.cli import main
from icqs_fast.io.readers import read_rows

pytestmark = pytest.mark.embedded  # the fixtures were written with the embedded model

DATA = Path(__file__).parent / "data" / "resume_v0"
PKG = Path(__file__).resolve().parents[1] / "icqs_fast" / "data"
SMALL = ["--num-ratios", "2", "--demos-per-set", "1", "--sets-per-ratio", "1",
         "--no-self-check", "--quiet"]
TIED = ["--score", "tied", "--template", "tpl.json", "--stratify-field", "none"]


def _score(d: Path, out: str, *extra: str) -> int:
    return main(["score", str(d / "in4.jsonl"), "-o", str(d / out), "--good",
                 str(PKG / "demo_good.jsonl"), "--bad", str(PKG / "demo_bad.jsonl"), *SMALL,
                 *extra])


@pytest.fixture()
def old(tmp_path):
    for p in DATA.iterdir():
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "tpl.json").chmod(0o644)
    return tmp_path


def _rows(path: Path) -> list[dict]:
    return [row for _, _, row in read_rows(path, optional=("id", "score", "loglik"))]


@pytest.mark.parametrize("out, extra", [("out.jsonl", []), ("out.parquet", []),
                                        ("tied.jsonl", TIED)])
def test_an_earlier_versions_output_resumes(old, out, extra, monkeypatch):
    monkeypatch.chdir(old)  # tpl.json
    before = _rows(old / out)
    meta_before = json.loads((old / f"{out}.meta.json").read_text())
    assert "stratify_field" in meta_before and "tie_epsilon" in meta_before  # the old key
    assert len(before) == 2
    assert _score(old, out, *extra, "--resume") == 0
    after = _rows(old / out)
    assert after[:2] == before  # continued, not restarted
    assert [r["id"] for r in after] == ["fin-01", "fin-02", "fin-03", "fin-04"]
    # What was appended is what today's code computes for those records (in the dtype the
    # old output was written with, which a resumed --dtype auto keeps).
    fresh = old / "fresh"
    fresh.mkdir()
    assert _score(old, f"fresh/{out}", *extra, "--dtype", meta_before["dtype"]) == 0
    now = _rows(fresh / out)
    for a, b in zip(after[2:], now[2:], strict=True):
        assert a["id"] == b["id"] and a["score"] == pytest.approx(b["score"], abs=1e-6)


def test_an_earlier_versions_output_still_refuses_other_settings(old, capsys):
    assert _score(old, "out.jsonl", "--resume", "--demos-per-set", "2") == 2
    err = capsys.readouterr().err
    assert "other settings (--demos-per-set: 1 there, 2 now)" in err
    assert _score(old, "out.jsonl", "--resume", "--score", "tied") == 2  # tie_epsilon counts
    assert "--score: 'mean' there, 'tied' now" in capsys.readouterr().err
    assert len(_rows(old / "out.jsonl")) == 2  # nothing written
