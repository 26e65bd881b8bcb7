"""``icqs-fast score`` end to end on a tiny random Llama saved to disk, and ``icqs-fast demo``
on the embedded model."""

import json

import pytest
import torch
from _helpers import assert_same_lines, read_jsonl, write_jsonl

from icqs_fast import ICQSScorer, models
from icqs_fast.cli import main
from icqs_fast.io.runs import meta_path

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
RESPONSES = [{"id": f"r{i}", "x": f"sales up {i}%", "y": ["positive", "negative"][i % 2],
              "gold": i % 2} for i in range(8)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1"]




@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return models.load_model(tiny_dir, dtype="float32", device="cpu")


@pytest.fixture
def files(tmp_path, tiny_dir, loaded, monkeypatch):
    """Input/demo files, and load_model answering from the already loaded tiny model (the
    first test below loads it for real through the CLI)."""
    real = models.load_model

    def cached(name_or_path=None, **kw):
        if name_or_path is not None and str(name_or_path) == str(tiny_dir):
            return loaded
        return real(name_or_path, **kw)

    monkeypatch.setattr(models, "load_model", cached)
    g = write_jsonl(tmp_path / "good.jsonl", GOOD)
    b = write_jsonl(tmp_path / "bad.jsonl", BAD)
    return tmp_path, g, b


def _score(inp, out, g, b, model, *extra):
    return main(["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b),
                 "--model", str(model), *KW, *extra])


@pytest.mark.slow
def test_score_writes_valid_lines(tmp_path, tiny_dir, capsys):
    g = write_jsonl(tmp_path / "good.jsonl", GOOD)
    b = write_jsonl(tmp_path / "bad.jsonl", BAD)
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES)
    out = tmp_path / "out.jsonl"
    assert _score(inp, out, g, b, tiny_dir, "--label-field", "gold", "--backend", "torch") == 0
    err = capsys.readouterr().err
    assert "scored 8 responses" in err and "responses/s" in err and "mean score" in err
    assert "mean score by label: 0:" in err
    rows = read_jsonl(out)
    assert [r["index"] for r in rows] == list(range(8))
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(8)]
    assert [r["line"] for r in rows] == list(range(1, 9))
    assert [r["label"] for r in rows] == [i % 2 for i in range(8)]
    # Same numbers as the library with the same settings.
    model, tok = models.load_model(tiny_dir, dtype="float32", device="cpu")
    scorer = ICQSScorer(model, tok, [(d["x"], d["y"]) for d in GOOD],
                        [(d["x"], d["y"]) for d in BAD], num_ratios=3, demos_per_set=2,
                        sets_per_ratio=2, seed=1, backend="torch")
    ref = list(scorer.score([(r["x"], r["y"]) for r in RESPONSES]))
    for r, e in zip(rows, ref, strict=True):
        assert r["ratios"] == [0.0, 0.5, 1.0]
        # The posterior mean (the default) within fp32 rounding, as in assert_same_scores.
        assert r["score"] == pytest.approx(e.score, abs=1e-5)
        assert r["score_per_set"] == pytest.approx(e.score_per_set, abs=1e-5)
        assert torch.allclose(torch.tensor(r["loglik"]), e.loglik, atol=1e-5)
        assert len(r["loglik"]) == 3 and len(r["loglik"][0]) == 2
        assert r["n_response_tokens"] == e.n_response_tokens
        assert r["n_prompt_tokens"] == e.n_prompt_tokens.tolist()
        assert "n_dropped_demos" not in r
    assert json.loads(meta_path(out).read_text())["seed"] == 1


def test_bad_line_stops_then_resume(files, tiny_dir, capsys):
    d, g, b = files
    rows = [json.dumps(r) for r in RESPONSES]
    rows[4] = json.dumps({"id": "r4", "x": "sales up"})  # line 5: no y
    inp = write_jsonl(d / "in.jsonl", rows)
    out = d / "out.jsonl"
    # A budget that pulls several responses into the first forward: those before the bad line
    # must still be scored and written.
    assert _score(inp, out, g, b, tiny_dir, "--token-budget", "4000") == 2
    err = capsys.readouterr().err
    assert f"icqs-fast: error: {inp}:5: field 'y': missing" in err
    assert "--resume" in err
    assert [r["index"] for r in read_jsonl(out)] == [0, 1, 2, 3]

    # Without --resume an existing output is not overwritten.
    assert _score(inp, out, g, b, tiny_dir) == 2
    assert "pass --resume" in capsys.readouterr().err
    # Other settings than the output was written with: refused.
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--seed", "2") == 2
    assert "other settings (--seed: 1 there, 2 now)" in capsys.readouterr().err

    write_jsonl(inp, RESPONSES)  # fixed
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--token-budget", "4000") == 0
    assert "4 records there, continuing at input record 4" in capsys.readouterr().err
    got = read_jsonl(out)
    assert [r["index"] for r in got] == list(range(8))
    assert [r["id"] for r in got] == [f"r{i}" for i in range(8)]

    # Resuming a complete output adds nothing; a record cut off mid-write is replaced.
    assert _score(inp, out, g, b, tiny_dir, "--resume") == 0
    assert read_jsonl(out) == got
    text = out.read_text(encoding="utf-8").splitlines(keepends=True)
    out.write_text("".join(text[:6]) + text[6][:25], encoding="utf-8")
    assert _score(inp, out, g, b, tiny_dir, "--resume") == 0
    assert "removed an incomplete last line" in capsys.readouterr().err
    again = read_jsonl(out)
    assert [r["index"] for r in again] == list(range(8))
    # The replaced record is scored in another batch than before: floats within rounding.
    assert_same_lines(again, got)

    # An input that changed under the output (other id at the last written index): refused.
    changed = [dict(r, id=f"new{i}") for i, r in enumerate(RESPONSES)] + [RESPONSES[0]]
    write_jsonl(inp, changed)
    assert _score(inp, out, g, b, tiny_dir, "--resume") == 2
    assert "the input changed" in capsys.readouterr().err


def test_on_error_skip(files, tiny_dir, capsys):
    d, g, b = files
    rows = [json.dumps(r) for r in RESPONSES]
    rows[1] = "{not json"
    rows[3] = json.dumps({"id": "r3", "x": "a", "y": 5})
    rows[5] = json.dumps({"id": "r5", "x": "long text " * 80, "y": "positive"})  # too long
    inp = write_jsonl(d / "in.jsonl", rows)
    out = d / "out.jsonl"
    assert _score(inp, out, g, b, tiny_dir, "--on-error", "skip", "--max-length", "120",
                  "--token-budget", "4000") == 0
    err = capsys.readouterr().err
    assert f"skipping bad record: {inp}:2: invalid JSON" in err
    assert f"skipping bad record: {inp}:4: field 'y': must be a string, got int 5" in err
    # The query and response alone are over the limit: said so (not "drop demonstrations").
    assert f"skipping bad record: {inp}:6: the query and response alone are" in err
    assert "3 bad records skipped" in err
    rows = read_jsonl(out)
    # Skipped records keep their place in the output (a resume neither redoes nor loses them).
    assert [r["index"] for r in rows] == list(range(8))
    assert [r["index"] for r in rows if "score" in r] == [0, 2, 4, 6, 7]
    assert rows[1] == {"index": 1, "line": 2, "error": {
        "field": None, "reason": "invalid JSON (Expecting property name enclosed in double "
                                 "quotes at column 2)"}}
    assert rows[3]["error"] == {"field": "y", "reason": "must be a string, got int 5"}
    assert rows[5]["error"]["field"] is None
    assert rows[5]["error"]["reason"].startswith("the query and response alone are")


def test_too_long_record_stops_after_earlier_ones(files, tiny_dir, capsys):
    """A record only the scorer can reject (prompt too long) stops the run too, with the
    records pulled before it still scored and written."""
    d, g, b = files
    rows = list(RESPONSES)
    rows[5] = {"id": "r5", "x": "long text " * 80, "y": "positive"}
    inp = write_jsonl(d / "in.jsonl", rows)
    out = d / "out.jsonl"
    assert _score(inp, out, g, b, tiny_dir, "--max-length", "120", "--token-budget",
                  "4000") == 2
    assert f"icqs-fast: error: {inp}:6: the query and response alone are" in \
        capsys.readouterr().err
    assert [r["index"] for r in read_jsonl(out)] == [0, 1, 2, 3, 4]


def test_csv_input_and_missing_files(files, tiny_dir, capsys):
    d, g, b = files
    inp = d / "in.csv"
    inp.write_text("uid,question,answer\n1,revenue fell,negative\n2,\"profit, up\",positive\n",
                   encoding="utf-8")
    out = d / "out.jsonl"
    assert _score(inp, out, g, b, tiny_dir, "--x-field", "question", "--y-field", "answer",
                  "--id-field", "uid") == 2  # the demo files have no question/answer fields
    assert f"{g}:1: field 'question': missing" in capsys.readouterr().err
    g2 = write_jsonl(d / "g2.jsonl", [{"question": r["x"], "answer": r["y"]} for r in GOOD])
    b2 = write_jsonl(d / "b2.jsonl", [{"question": r["x"], "answer": r["y"]} for r in BAD])
    assert _score(inp, out, g2, b2, tiny_dir, "--x-field", "question", "--y-field", "answer",
                  "--id-field", "uid", "--overwrite") == 0
    assert [(r["id"], r["line"]) for r in read_jsonl(out)] == [("1", 2), ("2", 3)]
    assert _score(d / "nope.jsonl", out, g, b, tiny_dir, "--overwrite") == 2
    assert "no such input file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.embedded
def test_demo_json_on_embedded_model(capsys):
    # Smaller than the default demo (M+1=5, L=4, N=8 takes ~50 s on 2 busy CPU cores).
    # The paper's argmax score by name (the default is the posterior mean, checked below).
    assert main(["demo", "--json", "--num-ratios", "3", "--sets-per-ratio", "1",
                 "--demos-per-set", "2", "--score", "argmax"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["ratios"] == [0.0, 0.5, 1.0]
    res = doc["results"]
    assert len(res) == 16
    assert {r["quality"] for r in res} == {"good", "bad"}
    for r in res:
        assert r["score"] in (0.0, 0.5, 1.0) and len(r["score_per_set"]) == 1
        assert all(v < 0 for row in r["loglik"] for v in row)
    s = doc["summary"]
    assert s["n_responses"] == 16 and s["score_seconds"] > 0
    assert -1 <= s["difference"] <= 1
    # The self-check on the built-in pools (24 + 24: enough for an estimate) calibrates each.
    assert doc["self_check"]["status"] == "ok" and 0 <= doc["self_check"]["auc"] <= 1
    assert all(0.0 <= r["p_good_calibrated"] <= 1.0 for r in res)
    # Calibrated, continuous scores: the same raw loglik, a baseline beside it (the self-check
    # is checked above: not run again).
    assert main(["demo", "--json", "--num-ratios", "3", "--sets-per-ratio", "1",
                 "--demos-per-set", "2", "--calibrate", "content_free", "--score", "mean",
                 "--no-self-check"]) == 0
    cal = json.loads(capsys.readouterr().out)
    assert (cal["settings"]["calibration"], cal["settings"]["score"]) == ("content_free", "mean")
    for r, c in zip(res, cal["results"], strict=True):
        assert sum(c["loglik"], []) == pytest.approx(sum(r["loglik"], []), abs=1e-4)
        assert len(c["loglik_baseline"]) == 3 and 0.0 <= c["score"] <= 1.0
    assert any(c["score"] not in (0.0, 0.5, 1.0) for c in cal["results"])
    # The default score is the posterior mean (stable across dtypes): continuous, in [0, 1].
    assert main(["demo", "--json", "--num-ratios", "3", "--sets-per-ratio", "1",
                 "--demos-per-set", "2", "--no-self-check"]) == 0
    dflt = json.loads(capsys.readouterr().out)
    assert dflt["settings"]["score"] == "mean"
    for r, d in zip(res, dflt["results"], strict=True):
        assert 0.0 <= d["score"] <= 1.0 and d["loglik"] == r["loglik"]


@pytest.mark.slow
def test_score_records_streams(loaded):
    """Results come out while the input is still being read (one forward's worth at a time)."""
    from icqs_fast.io.records import Record
    from icqs_fast.jobs.score import score_records

    model, tok = loaded
    scorer = ICQSScorer(model, tok, [(d["x"], d["y"]) for d in GOOD],
                        [(d["x"], d["y"]) for d in BAD], num_ratios=3, demos_per_set=2,
                        sets_per_ratio=2, token_budget=300)
    pulled = []

    def records():
        for i in range(40):
            pulled.append(i)
            yield Record(index=i, line=i + 1, x=f"sales up {i}%", y="positive")

    seen = []
    for rec, res in score_records(scorer, records()):
        seen.append((rec.index, len(pulled)))
        assert res.index == rec.index  # the scorer saw exactly the records in order
    assert [i for i, _ in seen] == list(range(40))
    assert seen[0][1] < 10  # the first result came long before the 40th record was read


@pytest.mark.slow
def test_resume_fingerprint_has_dtype_device_backend(files, tiny_dir, loaded, capsys,
                                                     monkeypatch):
    """A resume in another dtype or with another kernel backend is refused (it would mix, e.g.,
    fp32 and bf16 scores in one file); the meta file records what was used."""
    d, g, b = files
    inp = write_jsonl(d / "in.jsonl", RESPONSES[:3])
    out = d / "out.jsonl"
    assert _score(inp, out, g, b, tiny_dir, "--dtype", "float32", "--backend", "torch") == 0
    meta = json.loads(meta_path(out).read_text())
    assert (meta["dtype"], meta["device"], meta["backend"]) == ("float32", "cpu", "torch")
    before = out.read_bytes()
    write_jsonl(inp, RESPONSES[:5])  # more input: a resume would add records

    import copy

    model, tok = loaded
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    # The fixture's cached loader ignores the dtype; answer bfloat16 with a bf16 copy.
    cached = models.load_model
    monkeypatch.setattr(models, "load_model", lambda p=None, **kw: (
        (bf16, tok) if kw.get("dtype") == "bfloat16" else cached(p, **kw)))
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--dtype", "bfloat16",
                  "--backend", "torch") == 2
    err = capsys.readouterr().err
    assert "other settings (dtype: 'float32' there, 'bfloat16' now)" in err
    assert out.read_bytes() == before
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--backend", "cpp") == 2
    assert "(backend: 'torch' there, 'cpp' now)" in capsys.readouterr().err
    assert out.read_bytes() == before
    # An output written before these were recorded: refused too, saying so.
    meta.pop("dtype")
    meta_path(out).write_text(json.dumps(meta))
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--backend", "torch") == 2
    assert "(dtype: not recorded there)" in capsys.readouterr().err
    meta["dtype"] = "float32"
    meta_path(out).write_text(json.dumps(meta))
    assert _score(inp, out, g, b, tiny_dir, "--resume", "--backend", "torch") == 0
    assert [r["index"] for r in read_jsonl(out)] == list(range(5))


def test_score_records_errors_are_typed_not_parsed(loaded):
    """Bad records reach ``on_error`` as RecordErrors built for that record (index, line,
    field), in input order; an error the scorer raises is never reinterpreted from its text."""
    from icqs_fast.io.readers import RecordFields, row_record
    from icqs_fast.io.records import InputError, Record, RecordError
    from icqs_fast.jobs.score import score_records

    model, tok = loaded
    scorer = ICQSScorer(model, tok, [(d["x"], d["y"]) for d in GOOD],
                        [(d["x"], d["y"]) for d in BAD], num_ratios=3, demos_per_set=2,
                        sets_per_ratio=2, max_length=60)
    with pytest.raises(RecordError) as blank:  # the reader's one record check: no Record
        row_record({"x": "sales down", "answer": " "}, 3, 4, "in.jsonl",
                   RecordFields(y_field="answer"))
    items = [Record(index=0, line=1, x="sales up", y="positive"),
             RecordError("in.jsonl", 2, "y", "missing", index=1),  # from the reader
             Record(index=2, line=3, x="long text " * 40, y="positive"),  # too long
             blank.value,
             Record(index=4, line=5, x="sales flat", y="negative")]
    events = []
    for rec, _res in score_records(scorer, items, path="in.jsonl", y_field="answer",
                                   on_error=lambda e: events.append(("err", e))):
        events.append(("ok", rec.index))
    assert [(k, v if k == "ok" else (v.index, v.line, v.field)) for k, v in events] == [
        ("ok", 0), ("err", (1, 2, "y")), ("err", (2, 3, None)), ("err", (3, 4, "answer")),
        ("ok", 4)]
    assert str(events[2][1]).startswith("in.jsonl:3: the query and response alone are ")
    # Without on_error: the records before the first bad one come out, then it is raised.
    got = []
    with pytest.raises(RecordError) as ei:
        for rec, _res in score_records(scorer, items, path="in.jsonl"):
            got.append(rec.index)
    assert got == [0] and ei.value.index == 1

    class Failing:  # a scorer failing with a message shaped like a per-record one
        def __getattr__(self, name):
            return getattr(scorer, name)

        def score(self, responses):
            next(iter(responses))
            raise ValueError("response 0: field 'y' gives no response tokens")

    with pytest.raises(ValueError, match="response 0") as ei:
        list(score_records(Failing(), items[:1], on_error=lambda e: None))
    assert not isinstance(ei.value, InputError)
