"""The self-check inside a ``score`` job and ``check`` (issue 40, items 2 and 4), end to end on
the tiny random Llama: every record's ``verdict``, the abstain band in the meta file and the
summary, the "do not trust" warning where the scorer does not separate, the size capped by the
job, the cache reused by a second run, and ``check --from-output`` reading the meta file."""

import json
import re

import pytest
from _helpers import read_jsonl, shorter_is_good_pools, write_jsonl
from _helpers import sentiment_pools as pools

from icqs_fast.cli import main
from icqs_fast.io.runs import meta_path

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "3", "--seed", "1",
      "--threads", "1"]


@pytest.fixture
def job(tmp_path, tiny_llama_dir):
    good, bad = pools(24)
    g = write_jsonl(tmp_path / "good.jsonl", [{"x": x, "y": y} for x, y in good])
    b = write_jsonl(tmp_path / "bad.jsonl", [{"x": x, "y": y} for x, y in bad])
    recs = [{"id": i, "x": f"orders rose {i}%", "y": ["positive", "negative"][i % 2],
             "gold": ["good", "bad"][i % 2]} for i in range(60)]
    inp = write_jsonl(tmp_path / "in.jsonl", recs)
    return tmp_path, g, b, inp, str(tiny_llama_dir())


def _score(job, out, *extra, n=None):
    d, g, b, inp, model = job
    if n is not None:
        rows = read_jsonl(inp)[:n]
        inp = write_jsonl(d / f"in{n}.jsonl", rows)
    return main(["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b),
                 "--model", model, "--label-field", "gold", *KW, *extra])


def test_verdicts_band_warning_and_cache(job, capsys):
    d = job[0]
    out = d / "a.jsonl"
    assert _score(job, out, "--target-accuracy", "0.7") == 0
    err = capsys.readouterr().err
    meta = json.loads(meta_path(out).read_text())
    chk = meta["self_check"]
    assert chk["status"] == "ok" and chk["target_accuracy"] == 0.7
    band = chk["band"]
    assert band["target"] == 0.7 and "coverage" in band and "curve" in band
    assert "abstain band for accuracy 0.7" in err  # the log and the summary
    rows = read_jsonl(out)
    assert len(rows) == 60 and all(r["verdict"] in ("good", "bad", "abstain") for r in rows)
    # The tiny random model does not separate the pools: said plainly, with the advice.
    if chk["auc_lo"] <= 0.5 or chk["brier"] >= 0.25:
        assert chk["warning"].startswith("do not trust these scores on this task")
        assert "self-check WARNING: do not trust" in err and "--model" in err
    assert chk["config"]["cache"] == "stored"
    # A second run with the same pools, settings and model: the cached held-out scores.
    out2 = d / "b.jsonl"
    assert _score(job, out2) == 0
    err = capsys.readouterr().err
    chk2 = json.loads(meta_path(out2).read_text())["self_check"]
    assert chk2["config"]["cache"] == "hit" and "reused from the cache" in err
    assert chk2["auc"] == chk["auc"] and chk2["band"] is None
    # Without a target: good / bad at the threshold.
    assert {r["verdict"] for r in read_jsonl(out2)} <= {"good", "bad"}
    # check with the same pools, settings and model (asking 256 items: the same 24 + 24 drawn)
    # reuses them too: check --plot after score does not score the pools again.
    _, g, b, _, model = job
    assert main(["check", "--good", str(g), "--bad", str(b), "--model", model, *KW,
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["cache"] == "hit" and doc["auc"] == chk["auc"]
    # check reads the stored self-check from the output's meta file: no model, no scoring.
    assert main(["check", "--from-output", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["auc"] == chk["auc"] and doc["band"] == band


def test_a_small_jobs_self_check_costs_no_more_than_the_job(job, capsys):
    out = job[0] / "small.jsonl"
    assert _score(job, out, n=30) == 0
    err = capsys.readouterr().err
    chk = json.loads(meta_path(out).read_text())["self_check"]
    assert chk["status"] == "too_small" and "the job has 30 records" in chk["message"]
    assert chk["config"]["sized_by_job"] == {"asked": 256, "job_records": 30}
    assert "the job has 30 records" in err
    assert all("verdict" not in r for r in read_jsonl(out))
    # A --self-check-max of one's own is taken as asked.
    out2 = job[0] / "asked.jsonl"
    assert _score(job, out2, "--self-check-max", "48", n=30) == 0
    chk = json.loads(meta_path(out2).read_text())["self_check"]
    assert chk["status"] == "ok" and "sized_by_job" not in chk["config"]


def test_check_and_score_say_length_beats_icqs(tmp_path, tiny_llama_dir, capsys):
    """The made-up task whose good answers are exactly the shorter ones, through ``check``
    (its table) and ``score`` (its summary and meta file)."""
    good, bad = shorter_is_good_pools()
    g = write_jsonl(tmp_path / "good.jsonl", [{"x": x, "y": y} for x, y in good])
    b = write_jsonl(tmp_path / "bad.jsonl", [{"x": x, "y": y} for x, y in bad])
    model = str(tiny_llama_dir())
    assert main(["check", "--good", str(g), "--bad", str(b), "--model", model, *KW]) == 0
    out = capsys.readouterr().out
    assert "baseline length_tokens" in out and "baseline logprob_mean" in out
    assert re.search(r"WARNING +response length in tokens beats ICQS on these pools", out), out
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": f"q {i}", "y": "alpha " * (i % 9 + 1)}
                                               for i in range(60)])
    res = tmp_path / "o.jsonl"
    assert main(["score", str(inp), "-o", str(res), "--good", str(g), "--bad", str(b),
                 "--model", model, *KW]) == 0
    err = capsys.readouterr().err
    assert "self-check WARNING: response length in tokens beats ICQS" in err
    assert "baselines on the same held-out items" in err
    chk = json.loads(meta_path(res).read_text())["self_check"]
    assert [x["name"] for x in chk["baselines"]][:2] == ["length_tokens", "length_chars"]
    assert chk["beaten"].startswith("response length in tokens beats ICQS")
