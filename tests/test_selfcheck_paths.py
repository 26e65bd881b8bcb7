"""The self-check reaches every path that scores: ``score`` (JSONL and Parquet), its meta file
and summary, ``--resume`` (the stored self-check reused), pools too small (one line, no field),
and the server's kept scorer. The ``--ray`` path is in tests/test_distributed.py."""

import json

import pyarrow.parquet as pq
import pytest
from _helpers import read_jsonl, write_jsonl

from icqs_fast.cli import main
from icqs_fast.engine.selfcheck import SelfCheck

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 24 + 24 demonstrations: enough for an estimate (20 per class at least).
GOOD = [{"x": f"sales rose {i}% this quarter", "y": "positive"} for i in range(12)] + [
    {"x": f"losses grew by {i} million", "y": "negative"} for i in range(12)]
BAD = [{"x": f"sales rose {i}% this quarter", "y": "negative"} for i in range(12)] + [
    {"x": f"losses grew by {i} million", "y": "positive"} for i in range(12)]
RESPONSES = [{"x": f"revenue up {i}% on the year", "y": ["positive", "negative"][i % 2]}
             for i in range(6)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "0",
      "--dtype", "float32", "--device", "cpu", "--backend", "torch", "--quiet"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("selfcheck-paths")
    return {"good": write_jsonl(d / "good.jsonl", GOOD), "bad": write_jsonl(d / "bad.jsonl", BAD),
            "small_good": write_jsonl(d / "sg.jsonl", GOOD[:5]),
            "small_bad": write_jsonl(d / "sb.jsonl", BAD[:5]),
            "input": write_jsonl(d / "in.jsonl", RESPONSES), "model": str(tiny_llama_dir())}


def _score(files, out, *extra, good="good", bad="bad"):
    return main(["score", str(files["input"]), "-o", str(out), "--good", str(files[good]),
                 "--bad", str(files[bad]), "--model", files["model"], *KW, *extra])


def test_score_lines_meta_and_summary_carry_the_self_check(files, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    assert _score(files, out, "--self-check-max", "48") == 0
    meta = json.loads((tmp_path / "o.jsonl.meta.json").read_text())
    check = SelfCheck.from_dict(meta["self_check"])
    assert check.ok and check.n_good + check.n_bad + check.n_skipped == 48
    assert 0.0 <= check.auc_lo <= check.auc <= check.auc_hi <= 1.0
    rows = read_jsonl(out)
    assert len(rows) == len(RESPONSES)
    for r in rows:  # the fitted map of the meta file applied to the record's own score
        assert r["p_good_calibrated"] == pytest.approx(check.record_value(r["score"]), abs=1e-12)
        assert 0.0 <= r["p_good_calibrated"] <= 1.0
    # Quiet prints no summary; without --quiet the summary says the expected accuracy.
    capsys.readouterr()
    out2 = tmp_path / "o2.jsonl"
    argv = ["score", str(files["input"]), "-o", str(out2), "--good", str(files["good"]),
            "--bad", str(files["bad"]), "--model", files["model"],
            *[k for k in KW if k != "--quiet"], "--self-check-max", "48"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "expected accuracy" in err and "threshold score >=" in err


def test_resume_reuses_the_stored_self_check(files, tmp_path):
    out = tmp_path / "o.jsonl"
    assert _score(files, out, "--self-check-max", "48") == 0
    first = read_jsonl(out)
    meta = (tmp_path / "o.jsonl.meta.json").read_text()
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]))  # a run stopped after 3 records
    # Other self-check options on --resume: the stored self-check is used, not a new one.
    assert _score(files, out, "--resume", "--self-check-max", "40", "--self-check-seed", "9") == 0
    assert (tmp_path / "o.jsonl.meta.json").read_text() == meta
    again = read_jsonl(out)
    assert [r["p_good_calibrated"] for r in again] == pytest.approx(
        [r["p_good_calibrated"] for r in first], abs=1e-6)


def test_parquet_column_and_turning_it_off(files, tmp_path):
    out = tmp_path / "o.parquet"
    assert _score(files, out, "--self-check-max", "48") == 0
    col = pq.read_table(out).column("p_good_calibrated").to_pylist()
    assert len(col) == len(RESPONSES) and all(v is not None for v in col)
    off = tmp_path / "off.parquet"
    assert _score(files, off, "--no-self-check") == 0
    assert pq.read_table(off).column("p_good_calibrated").null_count == len(RESPONSES)
    meta = json.loads((tmp_path / "off.parquet.meta.json").read_text())
    assert meta["self_check"]["status"] == "off"


def test_small_pools_skip_it_with_one_line(files, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    argv = ["score", str(files["input"]), "-o", str(out), "--good", str(files["small_good"]),
            "--bad", str(files["small_bad"]), "--model", files["model"],
            *[k for k in KW if k != "--quiet"]]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert sum("self-check skipped" in line for line in err.splitlines()) == 1
    assert "at least 20" in err
    assert all("p_good_calibrated" not in r for r in read_jsonl(out))


def test_server_kept_scorer_gets_the_map(files):
    from icqs_fast.io.readers import read_examples
    from icqs_fast.models import load_model
    from icqs_fast.serve.app import Server
    from icqs_fast.serve.scoring import icqs_item

    model, tok = load_model(files["model"], dtype="float32", device="cpu")
    good, bad = read_examples(files["good"]), read_examples(files["bad"])
    opts = {"num_ratios": 3, "demos_per_set": 2, "sets_per_ratio": 2, "seed": 0}
    server = Server(model, tok, good=good, bad=bad, icqs_options=opts)
    check = server.scoring.run_self_check(max_heldout=48)
    assert check.ok
    item = icqs_item(next(server.scoring.new_scorer(None, None, {}).score([("q", "positive")])))
    assert item.p_good_calibrated == pytest.approx(check.record_value(item.score), abs=1e-12)
    # A request's own options: another scorer, no map (null).
    other = server.scoring.new_scorer(None, None, {"seed": 3})
    assert icqs_item(next(other.score([("q", "positive")]))).p_good_calibrated is None
    # /v1/score carries the server's self-check, the baselines beside ICQS, for records
    # scored with its own pools and settings; null for a request's own options.
    import httpx

    from icqs_fast.serve.runner import ServerThread

    with ServerThread(server) as st:
        recs = [{"x": "q", "y": "positive"}]
        r = httpx.post(st.base_url + "/v1/score", json={"records": recs}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["self_check"]
        assert got["auc"] == pytest.approx(check.auc) and got["beaten"] == check.beaten
        assert [b["name"] for b in got["baselines"]] == [b["name"] for b in check.baselines]
        assert {"auc", "auc_lo", "auc_hi", "direction"} <= set(got["baselines"][0])
        r = httpx.post(st.base_url + "/v1/score", timeout=120,
                       json={"records": recs, "icqs_options": {"seed": 3}})
        assert r.status_code == 200 and r.json()["self_check"] is None
