"""``icqs-fast features`` end to end on a tiny random Llama saved to disk: the file equals
:func:`glassbox` called directly, the resume fingerprint, records the model cannot take, the
combo constants, and a resume at every cut point being byte-identical to an uninterrupted run.
(SIGKILLed runs and the lock: ``tests/test_resume_crash.py``; the bad-input corpus:
``tests/test_bad_inputs.py``.)"""

import json
import math

import pytest
import torch
from _helpers import write_jsonl

from icqs_fast import backends, models
from icqs_fast.cli import main
from icqs_fast.features.extract import ALL_FEATURES, ComboScale, glassbox
from icqs_fast.io.runs import meta_path

# Lengths vary so the chunks' length sort and the padding matter.
RESPONSES = [{"id": f"r{i}", "x": f"Summarise report {i}" + " briefly" * (i % 3),
              "y": "Sales rose." + " Costs fell and margins grew." * (i % 4)} for i in range(10)]
KW = ["--dtype", "float32", "--device", "cpu", "--batch-size", "2", "--chunk-size", "4",
      "--quiet"]



def _rows(path):
    # NaN is written as the literal NaN, which json.loads reads back.
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    d = tiny_llama_dir(layers=2, max_positions=256)
    return d, models.load_model(d, dtype="float32", device="cpu")


@pytest.fixture
def features(tiny, tmp_path, monkeypatch):
    """``icqs-fast features INPUT -o OUT`` with the tiny model (loaded once for the module)."""
    model_dir, loaded = tiny
    calls = []

    def load(name_or_path=None, **kw):
        assert str(name_or_path) == str(model_dir) and kw["dtype"] == "float32"
        calls.append(kw)
        return loaded
    monkeypatch.setattr(models, "load_model", load)

    def run(inp, out, *extra):
        return main(["features", str(inp), "-o", str(out), "--model", str(model_dir), *KW,
                     *extra])
    run.calls = calls
    return run


def _close(got: dict, want: dict, keys):
    for k in keys:
        g, w = got[k], want[k]
        assert (math.isnan(g) and math.isnan(w)) or abs(g - w) <= 1e-6, (got["index"], k, g, w)


@pytest.mark.parametrize("mode, feats", [
    ("standard", list(ALL_FEATURES)),
    ("selfeval-compat", ["softmax_combo", "sent_logprob", "softmax_var", "attn_ent_min"]),
])
@pytest.mark.slow
def test_file_equals_glassbox_called_directly(features, tiny, tmp_path, mode, feats):
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES)
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--mode", mode, "--features", ",".join(feats)) == 0
    rows = _rows(out)
    _, (model, tok) = tiny
    want = glassbox(model, tok, [(r["x"], r["y"]) for r in RESPONSES], features=feats,
                    mode=mode, batch_size=3)
    assert [r["index"] for r in rows] == list(range(10))
    assert [r["id"] for r in rows] == [r["id"] for r in RESPONSES]
    assert [r["line"] for r in rows] == list(range(1, 11))
    for got, w in zip(rows, want, strict=True):
        # The features in the order asked for, after index/line/id/n_tokens; then the
        # per-record diagnostics.
        assert list(got) == ["index", "line", "id", "n_tokens", *feats, "n_prompt_tokens",
                             "truncated", "join"]
        assert got["truncated"] is False and isinstance(got["join"], bool)
        assert got["n_prompt_tokens"] > 0
        assert got["n_tokens"] == w["n_tokens"] > 0
        _close(got, w, feats)
        assert all(math.isfinite(got[k]) for k in feats)
    meta = json.loads(meta_path(out).read_text())
    vocab = model.get_output_embeddings().weight.shape[0]
    assert meta["features"] == feats and meta["mode"] == mode
    assert (meta["dtype"], meta["device"], meta["backend"]) == (
        "float32", "cpu", backends.resolve("auto", torch.device("cpu")))
    assert meta["combo_scale"] == ComboScale.intrinsic(vocab).as_dict()


def test_csv_input_with_fields_and_combo_scale_file(features, tiny, tmp_path):
    inp = tmp_path / "in.csv"
    inp.write_text("key,prompt,answer\n" + "".join(
        f"k{i},{r['x']},{r['y']}\n" for i, r in enumerate(RESPONSES[:3])), encoding="utf-8")
    scale = {"ent_lo": 1.0, "ent_hi": 9.0, "var_lo": 2.0, "var_hi": 4.0}
    sfile = tmp_path / "scale.json"
    sfile.write_text(json.dumps(scale))
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--x-field", "prompt", "--y-field", "answer", "--id-field", "key",
                    "--features", "softmax_ent,softmax_var,softmax_combo",
                    "--combo-scale", str(sfile)) == 0
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["k0", "k1", "k2"]
    for r in rows:  # the combo of each row from its own two features and the file's constants
        want = ((r["softmax_ent"] - 1) / 8 + (r["softmax_var"] - 2) / 2) / 2
        assert abs(r["softmax_combo"] - want) <= 1e-9
    assert json.loads(meta_path(out).read_text())["combo_scale"] == scale


def test_bad_options(features, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES[:2])
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--features", "sent_logprob,nope") == 2
    assert "--features: unknown or no feature(s) ['nope']" in capsys.readouterr().err
    sfile = tmp_path / "scale.json"
    sfile.write_text(json.dumps({"ent_lo": 0, "ent_hi": 1, "var_lo": 0}))
    assert features(inp, out, "--combo-scale", str(sfile)) == 2
    assert f"error: {sfile}: field 'var_hi': missing or not a number" in capsys.readouterr().err
    assert features(inp, out, "--chunk-size", "0") == 2
    assert "--chunk-size must be an int >= 1, got 0" in capsys.readouterr().err
    assert not out.exists() and features.calls == []  # refused before loading the model


@pytest.mark.slow
def test_resume_at_every_cut_is_byte_identical(features, tmp_path):
    """An output cut after any number of complete records (or inside a line) is completed by
    --resume into exactly the uninterrupted run's bytes, whichever chunk the cut falls in."""
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES)
    ref = tmp_path / "ref.jsonl"
    assert features(inp, ref, "--features", "sent_logprob,softmax_ent,attn_ent_avg") == 0
    ref_bytes = ref.read_bytes()
    lines = ref_bytes.splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    for k in (0, 3, 4, 7):
        for half in (False, True):
            out.write_bytes(b"".join(lines[:k]) + (lines[k][:20] if half else b""))
            meta_path(out).write_bytes(meta_path(ref).read_bytes())
            assert features(inp, out, "--resume",
                            "--features", "sent_logprob,softmax_ent,attn_ent_avg") == 0
            assert out.read_bytes() == ref_bytes, (k, half)


def test_resume_refused_on_other_settings(features, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES[:3])
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--features", "sent_logprob") == 0
    before = out.read_bytes()
    for extra, what in [(["--features", "softmax_ent"], "features: ['sent_logprob'] there"),
                        (["--features", "sent_logprob", "--mode", "selfeval-compat"],
                         "--mode: 'standard' there, 'selfeval-compat' now"),
                        (["--features", "sent_logprob", "--batch-size", "3"],
                         "--batch-size: 2")]:
        assert features(inp, out, "--resume", *extra) == 2
        assert f"cannot --resume {out}: it was written with other settings ({what}" in \
            capsys.readouterr().err
    assert features(inp, out, "--features", "sent_logprob") == 2  # neither --resume nor overwrite
    assert "exists; pass --resume" in capsys.readouterr().err
    # A score output is not a features output.
    meta = json.loads(meta_path(out).read_text())
    del meta["command"]
    meta_path(out).write_text(json.dumps(meta))
    assert features(inp, out, "--resume", "--features", "sent_logprob") == 2
    assert "command: not recorded there" in capsys.readouterr().err
    # A resumed run with another dtype in the meta file (checked once the model is loaded).
    meta.update(command="features", dtype="bfloat16")
    meta_path(out).write_text(json.dumps(meta))
    assert features(inp, out, "--resume", "--features", "sent_logprob") == 2
    assert "dtype: 'bfloat16' there, 'float32' now" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_resume_refused_when_the_input_changed(features, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", RESPONSES[:6])
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--features", "sent_logprob") == 0
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:5]))  # record 4 is the last; chunk 1 starts there
    changed = [dict(r, id="zz") if i == 4 else r for i, r in enumerate(RESPONSES[:6])]
    write_jsonl(inp, changed)
    assert features(inp, out, "--resume", "--features", "sent_logprob") == 2
    assert (f"cannot --resume: {inp}:5 (record 4) has id 'zz' but the output's last record "
            "has id 'r4'") in capsys.readouterr().err


def test_record_too_long_for_the_model(features, tmp_path, capsys):
    """A record longer than the model's position table (256) is a bad record naming its line,
    not a crash or a silently wrong value; --on-error skip records it in its place."""
    rows = [dict(r) for r in RESPONSES[:4]]
    rows[2]["y"] = "word " * 300
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert features(inp, out, "--features", "sent_logprob") == 2
    err = capsys.readouterr().err
    assert f"icqs-fast: error: {inp}:3: prompt and response of " in err
    assert "exceed the model's max length 256" in err
    assert [r["id"] for r in _rows(out)] == ["r0", "r1"]  # earlier records kept
    assert features(inp, out, "--features", "sent_logprob", "--on-error", "skip",
                    "--overwrite") == 0
    got = _rows(out)
    assert [r["index"] for r in got] == [0, 1, 2, 3] and "error" in got[2]
    assert got[2]["error"]["field"] is None and "max length 256" in got[2]["error"]["reason"]
