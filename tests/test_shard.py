"""``--shard i/n``, Parquet/datasets input and Parquet output of ``icqs-fast score`` and
``icqs-fast features``, end to end on a tiny random Llama: the shards' outputs concatenated in
shard order are the unsharded output (``features``: byte for byte, its chunks fall as unsharded;
``score``: floats within rounding, as a shard packs other records into its forwards); a Parquet
output holds the same records as the JSONL one; the progress status lines appear on a
non-terminal stderr and not with --quiet."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _helpers import assert_same_lines

from icqs_fast import models
from icqs_fast.cli import main

pytestmark = pytest.mark.slow  # end-to-end CLI runs, several per test

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
# Ten responses of varied lengths; record 4's response is blank (skipped with --on-error skip,
# with the same error from JSONL and Parquet).
RESPONSES = [{"id": f"r{i}", "x": f"Summarise report {i}" + " briefly" * (i % 3),
              "y": "Sales rose." + " Costs fell." * (i % 4)} for i in range(10)]
RESPONSES[4]["y"] = "   "
SCORE_KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
            "--dtype", "float32", "--device", "cpu", "--on-error", "skip", "--quiet"]
FEAT_KW = ["--dtype", "float32", "--device", "cpu", "--batch-size", "2", "--chunk-size", "3",
           "--features", "sent_logprob,softmax_ent", "--on-error", "skip",
           "--quiet"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("shard")
    model_dir = tiny_llama_dir()
    loaded = models.load_model(model_dir, dtype="float32", device="cpu")
    inp = _jsonl(d / "resp.jsonl", RESPONSES)
    pq.write_table(pa.Table.from_pylist(RESPONSES), d / "resp.parquet", row_group_size=4)
    return {"dir": d, "model": model_dir, "loaded": loaded, "jsonl": inp,
            "parquet": d / "resp.parquet", "good": _jsonl(d / "good.jsonl", GOOD),
            "bad": _jsonl(d / "bad.jsonl", BAD)}


@pytest.fixture
def cli(setup, monkeypatch):
    """Run a command with the module's tiny model (loaded once)."""
    def load(name_or_path=None, **kw):
        assert str(name_or_path) == str(setup["model"])
        return setup["loaded"]
    monkeypatch.setattr(models, "load_model", load)

    def run(command, inp, out, *extra):
        argv = [command, str(inp), "-o", str(out), "--model", str(setup["model"])]
        if command == "score":
            argv += ["--good", str(setup["good"]), "--bad", str(setup["bad"]), *SCORE_KW]
        else:
            argv += FEAT_KW
        return main(argv + list(extra))
    return run


@pytest.fixture(scope="module")
def reference(setup):
    """The unsharded JSONL output of each command on the JSONL input (computed once)."""
    done = {}

    def get(command, cli):
        if command not in done:
            out = setup["dir"] / f"ref-{command}.jsonl"
            assert cli(command, setup["jsonl"], out) == 0
            done[command] = out
        return done[command]
    return get


def _parquet_rows(path):
    """Rows of a Parquet output as JSON text, null fields dropped (absent keys in JSONL)."""
    return [json.dumps({k: v for k, v in r.items() if v is not None})
            for r in pq.read_table(path).to_pylist()]


def _jsonl_rows(path):
    return [json.dumps(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("command", ["score", "features"])
@pytest.mark.slow
def test_shards_concatenate_to_the_unsharded_output(setup, cli, reference, tmp_path, command):
    n = 2
    full = reference(command, cli)
    rows = _jsonl_rows(full)
    assert len(rows) == 10 and "error" in json.loads(rows[4])  # the bad record's place kept
    parts = [tmp_path / f"s{i}.jsonl" for i in range(n)]
    for i, p in enumerate(parts):
        # Shards read Parquet and JSONL alike (rows = lines here): the outputs do not differ.
        src = setup["parquet"] if i else setup["jsonl"]
        assert cli(command, src, p, "--shard", f"{i}/{n}") == 0
    if command == "features":
        assert b"".join(p.read_bytes() for p in parts) == full.read_bytes()
    else:
        assert_same_lines([json.loads(ln) for p in parts for ln in p.read_text().splitlines()],
                          map(json.loads, rows))
    sizes = [len(p.read_text().splitlines()) for p in parts]
    # score: records 0-4, 5-9; features: boundaries on --chunk-size (3) multiples, 4 chunks
    # dealt 2 + 2 -> records 0-5, 6-9 (each record in the same batch as unsharded).
    assert sizes == ([5, 5] if command == "score" else [6, 4])
    # A resume must use the same shard (the fingerprint holds it).
    assert cli(command, setup["jsonl"], parts[0], "--shard", f"1/{n}", "--resume") == 2
    assert cli(command, setup["jsonl"], tmp_path / "x.jsonl", "--shard", f"{n}/{n}") == 2


def test_resume_with_parquet_input(setup, cli, reference, tmp_path):
    """A JSONL output cut after 3 records (and a half-written 4th) is resumed from the Parquet
    copy of the input (rows, not lines, located by index) into the uninterrupted output."""
    ref = reference("score", cli)
    out = tmp_path / "out.jsonl"
    lines = ref.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:3]) + lines[3][:20])
    (tmp_path / "out.jsonl.meta.json").write_bytes(
        (setup["dir"] / "ref-score.jsonl.meta.json").read_bytes())
    assert cli("score", setup["parquet"], out, "--resume") == 0
    assert_same_lines(map(json.loads, out.read_text().splitlines()),
                      map(json.loads, ref.read_text().splitlines()))


def test_parquet_output(setup, cli, reference, tmp_path):
    ref = reference("features", cli)
    full = tmp_path / "full.parquet"
    assert cli("features", setup["parquet"], full) == 0
    assert _parquet_rows(full) == _jsonl_rows(ref)
    assert not (tmp_path / "full.parquet.parts").exists()
    # An existing Parquet output is not replaced without --overwrite (refused before loading).
    assert cli("features", setup["parquet"], full) == 2


def test_parquet_shards_and_progress(setup, cli, reference, tmp_path, capsys, monkeypatch):
    ref = reference("score", cli)
    capsys.readouterr()
    parts = [tmp_path / f"s{i}.parquet" for i in range(2)]
    # Shard 0 without --quiet, a status line per record: stderr is not a terminal here.
    monkeypatch.setenv("ICQS_FAST_PROGRESS_INTERVAL", "0")
    argv = [a for a in SCORE_KW if a != "--quiet"]
    assert main(["score", str(setup["parquet"]), "-o", str(parts[0]), "--model",
                 str(setup["model"]), "--good", str(setup["good"]), "--bad", str(setup["bad"]),
                 *argv, "--shard", "0/2"]) == 0
    err = capsys.readouterr().err
    # The shard's total is known (5 records, the last one skipped as bad).
    assert "score: 1/5 records (" in err and "ETA" in err and "done in" in err, err
    assert "skipping bad record" in err
    assert cli("score", setup["parquet"], parts[1], "--shard", "1/2") == 0  # --quiet
    assert capsys.readouterr().err == ""
    joined = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="permissive")
    assert_same_lines([{k: v for k, v in r.items() if v is not None} for r in joined.to_pylist()],
                      map(json.loads, _jsonl_rows(ref)))


@pytest.mark.slow
def test_eval_mtbench_progress_and_slices(setup, cli, tmp_path, capsys, monkeypatch):
    """``eval mtbench`` reports progress per slice of 8 answers; the sliced run gives the
    values of one glassbox call over all answers; --quiet prints nothing on stderr."""
    from icqs_fast.features.extract import glassbox
    from icqs_fast.io.datasets import load_mtbench

    def write(name, rows):
        _jsonl(tmp_path / name, rows)
    write("question.jsonl", [{"question_id": q, "turns": [f"Question {q}?", f"More on {q}?"]}
                             for q in range(5)])
    write("model_answer_m.jsonl", [
        {"question_id": q, "choices": [{"turns": [f"Answer {q}." * (1 + q % 3), "More."]}]}
        for q in range(5)])
    write("judgment_gpt-4_single.jsonl", [
        {"question_id": q, "model": "m", "turn": t, "score": 1 + (q + t) % 9}
        for q in range(5) for t in (1, 2)])
    monkeypatch.setenv("ICQS_FAST_PROGRESS_INTERVAL", "0")
    argv = ["eval", "mtbench", "--data", str(tmp_path), "--json", "--features", "sent_logprob",
            "softmax_ent", "--batch-size", "1", "--model", str(setup["model"])]
    capsys.readouterr()
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "mtbench features: 8/10 answers (" in cap.err
    assert "mtbench features: 10/10 answers (" in cap.err and "done in" in cap.err
    got = json.loads(cap.out)["records"]
    model, tok = setup["loaded"]
    items = [r["item"] for r in load_mtbench(tmp_path)]
    want = glassbox(model, tok, items, features=["sent_logprob", "softmax_ent"], batch_size=1)
    for g, w in zip(got, want, strict=True):
        for k in ("sent_logprob", "softmax_ent"):
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-9)
    assert main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == ""
