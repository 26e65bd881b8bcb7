"""Job configs and the edges of the resume fingerprint and --threads, through the
``icqs-fast`` entry point: every option that changes what a result record contains is checked
on ``--resume`` (exit 2, naming it), and ``score`` / ``features`` take ``--threads``."""

import json

import pytest
import torch
from _helpers import write_jsonl

from icqs_fast import models
from icqs_fast.cli import main
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.jobs.config import FeatureJobConfig, RayOptions, ScoreJobConfig

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
RESPONSES = [{"id": f"r{i}", "x": f"sales up {i}%", "y": ["positive", "negative"][i % 2],
              "gold": i % 2, "model": f"m{i % 3}"} for i in range(4)]
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
      "--dtype", "float32", "--device", "cpu", "--backend", "torch", "--quiet"]
FKW = ["--dtype", "float32", "--device", "cpu", "--backend", "torch", "--quiet",
       "--chunk-size", "2", "--batch-size", "2", "--features", "sent_logprob,softmax_ent"]



@pytest.fixture(scope="module")
def tiny_dir(tiny_llama_dir):
    return tiny_llama_dir()


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return models.load_model(tiny_dir, dtype="float32", device="cpu")


@pytest.fixture
def files(tmp_path, tiny_dir, loaded, monkeypatch):
    """Files, and load_model answering from the already loaded tiny model (recording calls)."""
    calls = []

    def cached(name_or_path=None, **kw):
        calls.append(("load_model", str(name_or_path)))
        assert str(name_or_path) == str(tiny_dir)
        return loaded

    monkeypatch.setattr(models, "load_model", cached)
    return {"dir": tmp_path, "good": write_jsonl(tmp_path / "good.jsonl", GOOD),
            "bad": write_jsonl(tmp_path / "bad.jsonl", BAD),
            "input": write_jsonl(tmp_path / "in.jsonl", RESPONSES), "model": tiny_dir,
            "calls": calls}


def _score(f, out, *extra):
    return main(["score", str(f["input"]), "-o", str(out), "--good", str(f["good"]),
                 "--bad", str(f["bad"]), "--model", str(f["model"]), *KW, *extra])


def _features(f, out, *extra):
    return main(["features", str(f["input"]), "-o", str(out), "--model", str(f["model"]),
                 *FKW, *extra])


@pytest.mark.parametrize("first, then, key", [
    (["--label-field", "gold"], ["--label-field", "model"], "--label-field"),
    ([], ["--label-field", "gold"], "--label-field"),
    ([], ["--id-field", "model"], "--id-field"),
    ([], ["--encoding", "latin-1"], "--encoding"),
])
@pytest.mark.slow
def test_score_resume_with_another_record_option_is_refused(files, capsys, first, then, key):
    out = files["dir"] / "out.jsonl"
    assert _score(files, out, *first) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert _score(files, out, *then, "--resume") == 2
    err = capsys.readouterr().err
    assert "cannot --resume" in err and key in err and "other settings" in err
    assert out.read_bytes() == before  # nothing written
    assert _score(files, out, *first, "--resume") == 0  # the same options still resume


@pytest.mark.parametrize("then, key", [(["--id-field", "model"], "--id-field"),
                                      (["--encoding", "latin-1"], "--encoding"),
                                      (["--x-field", "model"], "--x-field")])
@pytest.mark.slow
def test_features_resume_with_another_record_option_is_refused(files, capsys, then, key):
    out = files["dir"] / "f.jsonl"
    assert _features(files, out) == 0
    capsys.readouterr()
    assert _features(files, out, *then, "--resume") == 2
    err = capsys.readouterr().err
    assert "cannot --resume" in err and key in err


@pytest.mark.parametrize("command", ["score", "features"])
@pytest.mark.slow
def test_threads_is_set_before_the_model_loads(files, monkeypatch, command):
    calls = files["calls"]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    run = _score if command == "score" else _features
    assert run(files, files["dir"] / "o.jsonl", "--threads", "1") == 0
    assert calls[:2] == [("threads", 1), ("load_model", str(files["model"]))]


@pytest.mark.parametrize("command", ["score", "features"])
def test_threads_must_be_positive(files, capsys, command):
    run = _score if command == "score" else _features
    assert run(files, files["dir"] / "o.jsonl", "--threads", "0") == 2
    assert "--threads must be an int >= 1, got 0" in capsys.readouterr().err


def test_resume_key_is_json_and_holds_every_record_option(files):
    settings = ScoringSettings(num_ratios=3)
    c = ScoreJobConfig(input="in.jsonl", output="o.jsonl", good=str(files["good"]),
                       bad=str(files["bad"]), label_field="gold", id_field="model",
                       scoring=settings)
    assert c.scoring is settings  # held, not copied
    key = c.resume_key()
    assert json.loads(json.dumps(key)) == key
    assert (key["label_field"], key["id_field"], key["encoding"]) == ("gold", "model", "utf-8")
    # The scoring part is the one scoring fingerprint.
    assert {k: key[k] for k in settings.fingerprint()} == settings.fingerprint()
    assert key["num_ratios"] == 3 and key["stratify"] == "auto"
    assert c.executor == "local"
    with pytest.raises(TypeError, match="must be a ScoringSettings"):
        ScoreJobConfig(input="i", output="o", good="g", bad="b", scoring={"num_ratios": 3})
    f = FeatureJobConfig(input="in.jsonl", output="o.jsonl", ray=RayOptions(block_size=4),
                         chunk_size=3)
    assert f.executor == "ray" and "label_field" not in f.resume_key()
    with pytest.raises(ValueError, match="multiple of --chunk-size"):
        f.check()


def test_executor_is_chosen_by_name(files, monkeypatch):
    """run_job: "local" | "ray" (default from the config); an unknown name is refused."""
    import icqs_fast.jobs.ray_executor as rex
    from icqs_fast.jobs.run import run_job

    c = ScoreJobConfig(input=str(files["input"]), output=str(files["dir"] / "o.jsonl"),
                       good=str(files["good"]), bad=str(files["bad"]))
    with pytest.raises(ValueError, match="executor must be one of"):
        run_job(c, executor="threads")
    seen = []
    monkeypatch.setattr(rex, "run_ray", lambda cfg, **kw: seen.append(cfg) or 0)
    assert run_job(c, executor="ray") == 0 and seen == [c]
