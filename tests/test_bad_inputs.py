"""The bad-input corpus (``tests/data/bad/``) through every command that reads files.

``icqs-fast score`` (input and ``--good``/``--bad`` files), ``icqs-fast features`` (input) and
``icqs-fast eval mtbench --data`` (its JSONL files) must answer each bad file with exit code 2 and
an error naming the file, the line and the field (where there is one), and ``score`` and
``features`` must keep every record scored before the bad one; ``--resume`` after fixing the
input completes the file exactly as an uninterrupted run.
In each corpus file the bad record is the third (line 3; line 4 of a CSV, after its header).
The 10 MB line is generated here (not committed). Parquet input does not exist yet, so there is
no wrong-schema Parquet case.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
from _helpers import write_jsonl

from icqs_fast import models
from icqs_fast.cli import main
from icqs_fast.io.readers import read_records
from icqs_fast.io.records import InputError, RecordError

BAD = Path(__file__).parent / "data" / "bad"
GOOD_DEMOS = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(2)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(2)]
BAD_DEMOS = [{"x": d["x"], "y": "negative" if d["y"] == "positive" else "positive"}
             for d in GOOD_DEMOS]
KW = ["--num-ratios", "2", "--demos-per-set", "1", "--sets-per-ratio", "1", "--seed", "0",
      "--dtype", "float32", "--device", "cpu", "--quiet"]
BIG = 10 * 1024 * 1024

# file -> (line, field, the message after "FILE:LINE: ")
CASES = {
    "truncated.jsonl": (3, None, r"invalid JSON \(Unterminated string starting at column 39\)"),
    "wrong_type.jsonl": (3, "y", r"field 'y': must be a string, got int 5"),
    "missing_field.jsonl": (3, "y", r"field 'y': missing \(this record's keys: id, x\)"),
    "empty_response.jsonl": (3, "y", r"field 'y': empty response \(nothing to score\)"),
    "whitespace_response.jsonl": (3, "y",
                                  r"field 'y': whitespace-only response \(nothing to score\)"),
    "non_utf8.jsonl": (3, "y", r"field 'y': not valid utf-8 text \(byte 0xff at byte 45 of "
                               r"the line\); pass the right encoding \(--encoding\)"),
    "non_utf8.csv": (4, "y", r"field 'y': not valid utf-8 text; pass the right encoding"),
    "ragged.csv": (4, None, r"4 columns but the header has 3"),
    "big.jsonl": (3, None, rf"line of {BIG + 1} bytes is longer than the limit of 1048576 "
                           r"bytes$"),
}
WHOLE_FILE = {
    "empty.jsonl": r"no records \(the file is empty or has only blank lines\)",
    "folder.jsonl": r"is a folder, not an input file",
    # a CSV written with another delimiter: one column named 'id;x;y'
    "semicolon.csv": r"1: field 'x': no such column in the header \(columns: id;x;y\)",
}



def _corpus(name, tmp_path):
    """The corpus file (the 10 MB line written into tmp_path)."""
    if name != "big.jsonl":
        return BAD / name
    lines = (BAD / "wrong_type.jsonl").read_bytes().splitlines(keepends=True)
    lines[2] = b"x" * BIG + b"\n"
    p = tmp_path / "big.jsonl"
    p.write_bytes(b"".join(lines))
    return p


def test_corpus_is_complete():
    on_disk = {p.name for p in BAD.iterdir()}
    assert on_disk == (set(CASES) - {"big.jsonl"}) | set(WHOLE_FILE)
    assert (BAD / "empty.jsonl").stat().st_size == 0 and (BAD / "folder.jsonl").is_dir()


@pytest.mark.parametrize("name", sorted(CASES))
def test_reader_names_line_and_field_and_goes_on(name, tmp_path):
    path = _corpus(name, tmp_path)
    line, field, msg = CASES[name]
    with pytest.raises(RecordError, match=rf"^{path}:{line}: {msg}") as ei:
        list(read_records(path))
    assert (ei.value.path, ei.value.line, ei.value.field, ei.value.index) == (
        str(path), line, field, 2)
    # The records around it are read (skip mode sees them all, in order).
    got = list(read_records(path, on_error="yield"))
    assert [type(r).__name__ for r in got] == ["Record"] * 2 + ["RecordError"] + ["Record"] * 2
    assert [r.index for r in got] == list(range(5))
    assert [r.id for r in got if not isinstance(r, RecordError)] == ["r0", "r1", "r3", "r4"]


@pytest.mark.parametrize("name", sorted(WHOLE_FILE))
def test_reader_whole_file_errors(name):
    with pytest.raises(InputError, match=rf"^{BAD / name}:? ?{WHOLE_FILE[name]}") as ei:
        list(read_records(BAD / name, allow_empty=False))
    assert not isinstance(ei.value, RecordError) and ei.value.line in (None, 1)  # 1: header


# --------------------------------------------------------------------------- icqs-fast score


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    d = tiny_llama_dir()
    return d, models.load_model(d, dtype="float32", device="cpu")


@pytest.fixture
def score(tiny, tmp_path, monkeypatch):
    """``icqs-fast score INPUT -o OUT`` with the tiny model (loaded once for the module)."""
    model_dir, loaded = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    good = write_jsonl(tmp_path / "good.jsonl", GOOD_DEMOS)
    bad = write_jsonl(tmp_path / "bad.jsonl", BAD_DEMOS)

    def run(inp, out, *extra, good=good, bad=bad):
        return main(["score", str(inp), "-o", str(out), "--good", str(good), "--bad", str(bad),
                     "--model", str(model_dir), *KW, *extra])
    return run


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_score_stops_with_exit_2_and_keeps_earlier_records(name, score, tmp_path, capsys):
    path = _corpus(name, tmp_path)
    line, _, msg = CASES[name]
    out = tmp_path / "out.jsonl"
    assert score(path, out) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icqs-fast: error: {path}:{line}: ") and \
        re.search(msg, err), err
    assert [(r["index"], r["id"]) for r in _rows(out)] == [(0, "r0"), (1, "r1")]


@pytest.mark.parametrize("name", sorted(WHOLE_FILE))
def test_score_whole_file_errors(name, score, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert score(BAD / name, out) == 2
    err = capsys.readouterr().err
    assert re.search(rf"icqs-fast: error: {BAD / name}:? ?{WHOLE_FILE[name]}", err), err
    assert "--resume" not in err and "--on-error" not in err, err  # no per-record hint
    # nothing left behind: no output, settings or lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl"]


@pytest.mark.parametrize("name", ["truncated.jsonl", "non_utf8.jsonl", "ragged.csv"])
@pytest.mark.slow
def test_resume_after_fixing_the_input_completes_the_file(name, score, tmp_path, capsys):
    src = BAD / name
    inp = tmp_path / name
    shutil.copy(src, inp)
    out = tmp_path / "out.jsonl"
    assert score(inp, out) == 2
    assert [r["index"] for r in _rows(out)] == [0, 1]
    # Fix the bad record (the same record as the others, in the file's own format).
    text = inp.read_bytes().splitlines(keepends=True)
    bad_at = 2 if name.endswith(".jsonl") else 3
    text[bad_at] = (json.dumps({"id": "r2", "x": "sales up 2%", "y": "positive"}) + "\n"
                    if name.endswith(".jsonl") else "r2,sales up 2%,positive\n").encode()
    inp.write_bytes(b"".join(text))
    assert score(inp, out, "--resume") == 0
    ref = tmp_path / "ref.jsonl"
    assert score(inp, ref) == 0
    assert out.read_bytes() == ref.read_bytes()
    assert [r["id"] for r in _rows(out)] == [f"r{i}" for i in range(5)]


def test_skip_mode_runs_the_whole_corpus_file(score, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert score(BAD / "wrong_type.jsonl", out, "--on-error", "skip") == 0
    rows = _rows(out)
    assert [r["index"] for r in rows] == list(range(5))
    assert rows[2] == {"index": 2, "line": 3,
                       "error": {"field": "y", "reason": "must be a string, got int 5"}}


@pytest.mark.parametrize("name", ["wrong_type.jsonl", "non_utf8.jsonl", "empty.jsonl",
                                  "folder.jsonl"])
def test_bad_demonstration_file(name, score, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "sales up", "y": "positive"}])
    out = tmp_path / "out.jsonl"
    assert score(inp, out, good=BAD / name) == 2
    err = capsys.readouterr().err
    if name in CASES:
        line, _, msg = CASES[name]
        assert f"icqs-fast: error: {BAD / name}:{line}: " in err
        assert re.search(msg, err), err
    else:
        assert f"icqs-fast: error: {BAD / name}" in err or f"--good file: {BAD / name}" in err
    assert not out.exists()


# --------------------------------------------------------------------------- icqs-fast features

FKW = ["--features", "sent_logprob,softmax_combo,attn_ent_avg", "--dtype", "float32", "--device",
       "cpu", "--quiet"]


@pytest.fixture
def features(tiny, monkeypatch):
    """``icqs-fast features INPUT -o OUT`` with the tiny model (loaded once for the module)."""
    model_dir, loaded = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)

    def run(inp, out, *extra):
        return main(["features", str(inp), "-o", str(out), "--model", str(model_dir), *FKW,
                     *extra])
    return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_features_stops_with_exit_2_and_keeps_earlier_records(name, features, tmp_path, capsys):
    path = _corpus(name, tmp_path)
    line, _, msg = CASES[name]
    out = tmp_path / "out.jsonl"
    assert features(path, out) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icqs-fast: error: {path}:{line}: ") and re.search(msg, err), err
    rows = _rows(out)
    assert [(r["index"], r["id"]) for r in rows] == [(0, "r0"), (1, "r1")]
    assert all(isinstance(r["sent_logprob"], float) for r in rows)


@pytest.mark.parametrize("name", sorted(WHOLE_FILE))
def test_features_whole_file_errors(name, features, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert features(BAD / name, out) == 2
    err = capsys.readouterr().err
    assert re.search(rf"icqs-fast: error: {BAD / name}:? ?{WHOLE_FILE[name]}", err), err
    assert "--resume" not in err, err
    assert list(tmp_path.iterdir()) == []  # no output, settings or lock file


@pytest.mark.slow
def test_features_skip_mode_and_resume_after_fixing(features, tmp_path):
    out = tmp_path / "out.jsonl"
    assert features(BAD / "wrong_type.jsonl", out, "--on-error", "skip") == 0
    rows = _rows(out)
    assert [r["index"] for r in rows] == list(range(5))
    assert rows[2] == {"index": 2, "line": 3,
                       "error": {"field": "y", "reason": "must be a string, got int 5"}}
    # Stopped at the bad record, fixed, resumed: the same bytes as an uninterrupted run.
    inp = tmp_path / "in.jsonl"
    shutil.copy(BAD / "truncated.jsonl", inp)
    out = tmp_path / "out2.jsonl"
    assert features(inp, out) == 2
    text = inp.read_bytes().splitlines(keepends=True)
    text[2] = (json.dumps({"id": "r2", "x": "sales up 2%", "y": "positive"}) + "\n").encode()
    inp.write_bytes(b"".join(text))
    assert features(inp, out, "--resume") == 0
    ref = tmp_path / "ref.jsonl"
    assert features(inp, ref) == 0
    assert out.read_bytes() == ref.read_bytes()


# --------------------------------------------------------------------------- eval mtbench


def _mtbench(root: Path) -> Path:
    root.mkdir()
    write_jsonl(root / "question.jsonl", [
        {"question_id": q, "category": "writing", "turns": [f"Question {q}?", f"And {q}?"]}
        for q in (81, 82)])
    write_jsonl(root / "model_answer_m.jsonl", [
        {"question_id": q, "model_id": "m", "choices": [{"index": 0, "turns": [
            f"Answer {q}.", f"More {q}."]}]} for q in (81, 82)])
    write_jsonl(root / "judgment_gpt-4_single.jsonl", [
        {"question_id": q, "model": "m", "turn": t, "score": float(q - 78 + t)}
        for q in (81, 82) for t in (1, 2)])
    return root


def _break(path: Path, kind: str, line: int = 2) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    obj = json.loads(lines[line - 1])
    if kind == "truncated":
        cut = lines[line - 1].index(b'"model": "') + len(b'"model": "') + 1
        lines[line - 1] = lines[line - 1][:cut] + b"\n"  # cut inside the "model" string
    elif kind == "wrong_type":
        lines[line - 1] = (json.dumps(dict(obj, score="high")) + "\n").encode()
    elif kind == "missing_field":
        obj.pop("model")
        lines[line - 1] = (json.dumps(obj) + "\n").encode()
    elif kind == "non_utf8":
        lines[line - 1] = lines[line - 1].replace(b'"m"', b'"m\xff"')
    elif kind == "big":
        lines[line - 1] = b" " * BIG + lines[line - 1]
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize("kind, field, msg", [
    ("truncated", None, r"invalid JSON \(Unterminated string starting at column 30\)$"),
    ("wrong_type", "score", r"field 'score': must be int or float, got str 'high'"),
    ("missing_field", "model", r"field 'model': missing \(this record's keys: question_id, "
                               r"turn, score\)"),
    ("non_utf8", "model", r"field 'model': not valid utf-8 text \(byte 0xff at byte 32 of "
                          r"the line"),
    ("big", None, rf"line of {BIG + 59} bytes is longer than the limit of 1048576 bytes$"),
])
def test_eval_mtbench_bad_judgment_line(kind, field, msg, tmp_path, capsys):
    root = _mtbench(tmp_path / "mtbench")
    jfile = root / "judgment_gpt-4_single.jsonl"
    _break(jfile, kind)
    assert main(["eval", "mtbench", "--data", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icqs-fast: error: {jfile}:2: ") and re.search(
        msg, err), err


def test_eval_mtbench_other_bad_files(tmp_path, capsys):
    root = _mtbench(tmp_path / "mtbench")
    afile = root / "model_answer_m.jsonl"
    a = afile.read_text().splitlines()
    afile.write_text(a[0] + "\n" + a[1].replace('"turns": ["Answer 82.", "More 82."]',
                                                '"turns": ["Answer 82.", 7]') + "\n")
    assert main(["eval", "mtbench", "--data", str(root)]) == 2
    assert f"error: {afile}:2: field 'choices.0.turns.1': must be str, got int" in \
        capsys.readouterr().err
    afile.write_text(a[0] + "\n")  # question 82 has no answer
    assert main(["eval", "mtbench", "--data", str(root)]) == 2
    assert (f"{root / 'judgment_gpt-4_single.jsonl'}:3: field 'question_id': model 'm' has "
            "no answer to question 82") in capsys.readouterr().err
    (root / "question.jsonl").write_bytes(b"")
    assert main(["eval", "mtbench", "--data", str(root)]) == 2
    assert f"{root / 'question.jsonl'}: no records (the file is empty" in \
        capsys.readouterr().err
    (root / "question.jsonl").unlink()
    (root / "question.jsonl").mkdir()
    assert main(["eval", "mtbench", "--data", str(root)]) == 2
    assert f"{root / 'question.jsonl'}: is a folder" in capsys.readouterr().err
    assert main(["eval", "mtbench", "--data", str(afile)]) == 2
    assert f"data folder {afile} is not a folder" in capsys.readouterr().err


def test_eval_mtbench_empty_answer_is_a_record(tmp_path):
    """An empty answer is kept (the real MT-Bench data has one, judged by GPT-4); the
    glass-box features of an empty response are NaN, which the correlations leave out."""
    from icqs_fast.io.datasets import load_mtbench

    root = _mtbench(tmp_path / "mtbench")
    afile = root / "model_answer_m.jsonl"
    afile.write_text(afile.read_text().replace('"Answer 82."', '""'))
    recs = load_mtbench(root)
    assert [(r["question_id"], r["turn"], r["item"]["response"]) for r in recs] == [
        (81, 1, "Answer 81."), (81, 2, "More 81."), (82, 1, ""), (82, 2, "More 82.")]
    assert recs[3]["item"]["history"] == [("Question 82?", "")]


# --------------------------------------------------------------------------- before the model

# A bad first record, as a file of one format: (file name, content, line, field, message).
FIRST_RECORD = [
    ("no_y.jsonl", '{"x": "a"}\n{"x": "b", "y": "c"}\n', 1, "y",
     r"field 'y': missing \(this record's keys: x\)"),
    ("int_y.jsonl", '{"x": "a", "y": 5}\n', 1, "y", r"field 'y': must be a string, got int 5"),
    ("blank_y.jsonl", '{"x": "a", "y": ""}\n', 1, "y",
     r"field 'y': empty response \(nothing to score\)"),
    ("list.jsonl", '["a", "b"]\n', 1, None, r"expected a JSON object, got list"),
    ("empty_cell.csv", "x,y\na,\nb,c\n", 2, "y", r"field 'y': empty response"),
]


@pytest.fixture
def no_model(monkeypatch):
    """A model load that fails the test: these errors must come before any model."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("command", ["score", "features"])
@pytest.mark.parametrize("name, text, line, field, msg", FIRST_RECORD)
def test_bad_first_record_fails_before_the_model_and_leaves_nothing(
        command, name, text, line, field, msg, no_model, tmp_path, capsys):
    inp = tmp_path / "in" / name
    inp.parent.mkdir()
    inp.write_text(text, encoding="utf-8")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    good = write_jsonl(tmp_path / "in" / "good.jsonl", GOOD_DEMOS)
    bad = write_jsonl(tmp_path / "in" / "bad.jsonl", BAD_DEMOS)
    extra = (["--good", str(good), "--bad", str(bad), *KW] if command == "score" else FKW)
    assert main([command, str(inp), "-o", str(out_dir / "out.jsonl"), "--model", "nosuchmodel",
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icqs-fast: error: {inp}:{line}: ") and re.search(msg, err), err
    assert field is None or f"field '{field}'" in err
    assert "results before the bad record" not in err and "--resume" not in err, err
    assert list(out_dir.iterdir()) == []  # no output, meta or lock file


def test_bad_first_record_with_skip_is_skipped(score, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "a"}, {"x": "sales up", "y": "positive"}])
    out = tmp_path / "out.jsonl"
    assert score(inp, out, "--on-error", "skip") == 0
    assert [sorted(r) for r in _rows(out)][0] == ["error", "index", "line"]


def test_first_record_the_scorer_rejects_leaves_nothing(score, tmp_path, capsys):
    """A first record that passes the reader but not the scorer's check (it needs the
    tokenizer, so the model): exit 2 naming it, no 'results before' line, no file left."""
    (tmp_path / "in").mkdir()
    inp = write_jsonl(tmp_path / "in" / "in.jsonl", [{"x": "sales " * 2000, "y": "up"}])
    out = tmp_path / "out" / "out.jsonl"
    out.parent.mkdir()
    assert score(inp, out, "--max-length", "64") == 2
    err = capsys.readouterr().err
    assert f"icqs-fast: error: {inp}:1: " in err, err
    assert "results before the bad record" not in err, err
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("command", ["score", "features"])
@pytest.mark.parametrize("model, reason", [
    ("nosuchmodel", "no such model folder or file"),
    ("missing/folder", "no such model folder or file"),
    ("", "no config.json"),  # a folder that is no model
])
def test_unloadable_model_says_so_and_leaves_nothing(command, model, reason, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "sales up", "y": "positive"}])
    good = write_jsonl(tmp_path / "good.jsonl", GOOD_DEMOS)
    bad = write_jsonl(tmp_path / "bad.jsonl", BAD_DEMOS)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    name = str(tmp_path / model) if model != "nosuchmodel" else model
    extra = (["--good", str(good), "--bad", str(bad), *KW] if command == "score" else FKW)
    assert main([command, str(inp), "-o", str(out_dir / "o.jsonl"), "--model", name,
                 *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icqs-fast: error: cannot load model {name}: "), err
    assert reason in err and "huggingface.co" not in err and "cannot write" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert list(out_dir.iterdir()) == []  # no lock, output or meta file
