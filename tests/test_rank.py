"""``icqs-fast rank`` and icqs_fast.evals.ranking: means, ranks, intervals, truth correlations
(against
scipy on hand-known means), every input format, bad input naming file/line/field, the plot."""

import json
import math
import re

import numpy as np
import pytest
from _helpers import write_jsonl
from scipy import stats

from icqs_fast.cli import main
from icqs_fast.evals.ranking import rank_models, ranking_correlations, read_group_scores
from icqs_fast.io.results import ParquetResultWriter

# Four models with hand-known means: a 0.75, b 0.5, c 0.5 (tied with b), d 0.25 (+ one NaN).
SCORES = {"a": [1, 1, 1, 0], "b": [1, 0, 1, 0], "c": [0.5, 0.5, 0.5, 0.5],
          "d": [0, 0.5, 0, 0.5, float("nan")]}
TRUTH = {"a": 4.0, "b": 2.0, "c": 3.0, "d": 1.0}


def _records(scores=SCORES):
    # Interleaved as a scoring run would write them, with one skipped-record line.
    rows = []
    for i in range(5):
        for m, s in scores.items():
            if i < len(s):
                rows.append({"index": len(rows), "model": m, "score": s[i]})
    rows.insert(3, {"index": 99, "line": 4, "error": {"field": "y", "reason": "missing"}})
    return rows



def test_rank_models_known_means_ranks_and_intervals():
    rows = rank_models(SCORES, n_boot=300, seed=0, truth=TRUTH)
    assert [(r["model"], r["rank"]) for r in rows] == [("a", 1), ("b", 2), ("c", 2), ("d", 4)]
    got = {r["model"]: r for r in rows}
    assert [got[m]["mean"] for m in "abcd"] == [0.75, 0.5, 0.5, 0.25]
    assert got["d"]["n"] == 4 and got["d"]["n_nan"] == 1
    assert got["c"]["ci_low"] == got["c"]["ci_high"] == 0.5  # constant scores
    for r in rows:
        assert r["ci_low"] <= r["mean"] <= r["ci_high"]
        assert r["truth"] == TRUTH[r["model"]]
    # 4 items of 0/1 with mean 0.75: resampled means are multiples of 1/4 in [0, 1].
    assert got["a"]["ci_low"] in (0.25, 0.5) and got["a"]["ci_high"] == 1.0
    # Seeded: the same intervals again; a model without a finite score is unranked, last.
    assert rank_models(SCORES, n_boot=300, seed=0, truth=TRUTH) == rows
    more = rank_models({"x": [float("nan")], "y": [0.1]}, n_boot=10)
    assert [(r["model"], r["rank"]) for r in more] == [("y", 1), ("x", None)]


def test_ranking_correlations_against_scipy():
    rows = rank_models(SCORES, n_boot=10)
    corr = ranking_correlations(rows, TRUTH | {"zz": 7.0})
    means = [0.75, 0.5, 0.5, 0.25]
    true = [4.0, 2.0, 3.0, 1.0]
    assert corr["n_models"] == 4 and corr["missing"] == []
    assert corr["spearman"] == pytest.approx(stats.spearmanr(means, true).statistic)
    assert corr["kendall"] == pytest.approx(stats.kendalltau(means, true).statistic)
    assert corr["pearson"] == pytest.approx(stats.pearsonr(means, true).statistic)
    # Hand check: Kendall tau-b with the b/c tie: 5 concordant, 0 discordant, one tie in x:
    # 5 / sqrt(5 * 6).
    assert corr["kendall"] == pytest.approx(5 / math.sqrt(30))
    part = ranking_correlations(rows, {"a": 1.0, "d": 0.0})
    assert part["n_models"] == 2 and part["missing"] == ["b", "c"]


def test_every_input_format_gives_the_same_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _records()
    ref, counts = read_group_scores(write_jsonl(tmp_path / "s.jsonl", rows))
    assert counts == {"records": 17, "error_records": 1}
    assert list(ref) == ["a", "b", "c", "d"]
    scored = [r for r in rows if "score" in r]
    csv = tmp_path / "s.csv"
    csv.write_text("model,score\n" + "".join(f"{r['model']},{r['score']}\n" for r in scored))
    pq.write_table(pa.Table.from_pylist(scored), tmp_path / "s.parquet")
    with ParquetResultWriter(tmp_path / "r.parquet") as w:  # a results file, error line kept
        for i, r in enumerate(rows):
            w.write(r | {"index": i})
    for p in (csv, tmp_path / "s.parquet", tmp_path / "r.parquet"):
        got, _ = read_group_scores(p)
        assert list(got) == list(ref)
        for m in ref:
            np.testing.assert_array_equal(got[m], ref[m])


def test_rank_cli_table_json_truth_and_plot(tmp_path, capsys):
    import matplotlib.image as mpimg

    scores = write_jsonl(tmp_path / "s.jsonl", _records())
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps(TRUTH))
    plots = tmp_path / "plots"
    assert main(["rank", "--scores", str(scores), "--group-field", "model", "--truth",
                 str(truth), "--plot", str(plots), "--n-boot", "200", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "17 scored records of 4 models" in out and "1 skipped-record lines left out" in out
    lines = out.splitlines()
    assert lines[2].split()[:4] == ["1", "a", "4", "0.7500"]
    assert lines[5].split()[:4] == ["4", "d", "4", "0.2500"]
    assert f"spearman {stats.spearmanr([0.75, .5, .5, .25], [4, 2, 3, 1]).statistic:+.3f}" in out
    png = plots / "ranking.png"
    assert png.stat().st_size > 5000
    img = mpimg.imread(png)
    assert img.shape[0] > 200 and img.shape[1] > 400 and img[..., :3].std() > 0.05  # not blank

    # JSON, truth from a CSV table with another truth field.
    tcsv = tmp_path / "truth.csv"
    tcsv.write_text("model,quality\na,4\nb,2\nc,3\nd,1\n")
    assert main(["rank", "--scores", str(scores), "--truth", str(tcsv), "--truth-field",
                 "quality", "--json", "--n-boot", "50", "--seed", "3", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["model"] for m in doc["models"]] == ["a", "b", "c", "d"]
    assert doc["models"][0]["mean"] == 0.75 and doc["models"][2]["rank"] == 2
    assert doc["correlations"]["kendall"] == pytest.approx(5 / math.sqrt(30))
    assert doc["seed"] == 3 and doc["records"] == 17


@pytest.mark.parametrize("content, name, pattern", [
    ('{"model": "a", "score": 1}\n{"model": "b", "score": 0}\n{"model": "b", "score": "high"}\n',
     "s.jsonl", r"s\.jsonl:3: field 'score': must be a number, got 'high'"),
    ('{"model": "a", "score": 1}\n{"score": 0.5}\n', "s.jsonl",
     r"s\.jsonl:2: field 'model': missing \(this record's keys: score\)"),
    ('{"model": "a", "score": 1}\n{"model": "a", "score": true}\n', "s.jsonl",
     r"s\.jsonl:2: field 'score': must be a number, got bool true"),
    ('{"model": "a", "score": 1}\n{"model": "a", "score": 1\n', "s.jsonl",
     r"s\.jsonl:2: invalid JSON"),
    ("model,score\na,1\nb,\n", "s.csv", r"s\.csv:3: field 'score': missing \(empty\)"),
    ("name,score\na,1\n", "s.csv", r"s\.csv:1: field 'model': no such column"),
    ("", "s.jsonl", r"s\.jsonl: field 'score': no scored records"),
])
def test_rank_cli_bad_scores_exit_2_naming_file_line_field(tmp_path, capsys, content, name,
                                                            pattern):
    p = tmp_path / name
    p.write_text(content)
    assert main(["rank", "--scores", str(p), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icqs-fast: error: ")
    assert re.search(pattern, err), err


def test_rank_cli_bad_truth_and_options(tmp_path, capsys):
    scores = write_jsonl(tmp_path / "s.jsonl", _records())
    bad = tmp_path / "t.json"
    bad.write_text('{"a": 1, "b": "good"}')
    assert main(["rank", "--scores", str(scores), "--truth", str(bad), "--quiet"]) == 2
    assert "t.json: field 'b': must be a number" in capsys.readouterr().err
    tj = write_jsonl(tmp_path / "t.jsonl", [{"model": "a", "truth": 1}, {"model": "a", "truth": 2}])
    assert main(["rank", "--scores", str(scores), "--truth", str(tj), "--quiet"]) == 2
    assert "t.jsonl:2: field 'model': model 'a' appears twice" in capsys.readouterr().err
    assert main(["rank", "--scores", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such input file" in capsys.readouterr().err
    assert main(["rank", "--scores", str(scores), "--n-boot", "0"]) == 2
