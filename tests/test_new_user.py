"""What a new user meets around the score / features jobs, through the entry point
(``main([...])``): output errors, quiet, whole-file errors, demonstration fields, checks before
the model loads, flag names in messages, summaries."""

import json
import re

import pytest
from _helpers import write_jsonl

from icqs_fast import models
from icqs_fast.cli import main

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(2)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(2)]
BAD = [{"x": d["x"], "y": "negative" if d["y"] == "positive" else "positive"} for d in GOOD]
ROWS = [{"id": f"r{i}", "x": f"sales moved {i}", "y": "positive"} for i in range(3)]
KW = ["--num-ratios", "2", "--demos-per-set", "1", "--sets-per-ratio", "1", "--seed", "0",
      "--dtype", "float32", "--device", "cpu"]
FKW = ["--features", "sent_logprob", "--batch-size", "2", "--chunk-size", "2", "--dtype",
       "float32", "--device", "cpu"]



@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    d = tiny_llama_dir()
    return d, models.load_model(d, dtype="float32", device="cpu")


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    return {"good": write_jsonl(d / "good.jsonl", GOOD), "bad": write_jsonl(d / "bad.jsonl", BAD),
            "input": write_jsonl(d / "input.jsonl", ROWS)}


@pytest.fixture
def loads(tiny, monkeypatch):
    """load_model -> the tiny model, counting the calls."""
    calls = []

    def load(*a, **k):
        calls.append(a)
        return tiny[1]
    monkeypatch.setattr(models, "load_model", load)
    return calls


def score(files, out, *extra, tiny=None, inp=None):
    return main(["score", str(inp or files["input"]), "-o", str(out), "--good",
                 str(files["good"]), "--bad", str(files["bad"]), "--model", str(tiny[0]), *KW,
                 *extra])


def features(files, out, *extra, tiny=None, inp=None):
    return main(["features", str(inp or files["input"]), "-o", str(out), "--model", str(tiny[0]),
                 *FKW, *extra])


RUN = {"score": score, "features": features}


# --------------------------------------------------------------------------- 2: output errors

@pytest.mark.parametrize("cmd", ["score", "features"])
def test_unwritable_output_is_one_line_exit_2(cmd, files, tiny, loads, capsys):
    assert RUN[cmd](files, "/sys/out.jsonl", "--quiet", tiny=tiny) == 2
    err = capsys.readouterr().err
    assert err.startswith("icqs-fast: error: cannot write the output /sys/out.jsonl: "), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert loads == []  # refused before the model loads


@pytest.mark.parametrize("cmd", ["score", "features"])
@pytest.mark.slow
def test_missing_output_folder_is_created_and_said(cmd, files, tiny, loads, tmp_path, capsys):
    out = tmp_path / "new" / "sub" / "out.jsonl"
    assert RUN[cmd](files, out, tiny=tiny) == 0
    assert f"icqs-fast: created the output folder {out.parent}" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3
    out2 = tmp_path / "new2" / "out.jsonl"
    assert RUN[cmd](files, out2, "--quiet", tiny=tiny) == 0
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- 3: quiet

@pytest.mark.parametrize("cmd", ["score", "features"])
def test_quiet_prints_nothing_no_loading_bar_no_future_warning(cmd, files, tiny, tmp_path,
                                                               monkeypatch, capsys):
    import warnings

    from transformers.utils import logging as hf_logging

    bar = []
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (
        bar.append(hf_logging.is_progress_bar_enabled()), tiny[1])[1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            assert RUN[cmd](files, tmp_path / "out.jsonl", "--quiet", tiny=tiny) == 0
        finally:
            hf_logging.enable_progress_bar()
            hf_logging.set_verbosity_warning()
    assert bar == [False]
    assert not [w for w in seen if "past_key_values" in str(w.message)], \
        [str(w.message) for w in seen]
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- 4: whole-file errors

@pytest.mark.parametrize("cmd", ["score", "features"])
@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_empty_input_no_hint_nothing_left(cmd, on_error, files, tiny, loads, tmp_path, capsys):
    empty = files["input"].with_name("empty.jsonl")
    empty.write_text("")
    out = tmp_path / "o" / "out.jsonl"
    assert RUN[cmd](files, out, "--on-error", on_error, tiny=tiny, inp=empty) == 2
    err = capsys.readouterr().err
    assert f"icqs-fast: error: {empty}: no records" in err, err
    assert "--resume" not in err and "--on-error" not in err, err
    assert not (tmp_path / "o").exists()  # no output, no .meta.json, no .lock
    assert loads == []


def test_empty_stdin_leaves_nothing(files, tiny, loads, tmp_path, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    out = tmp_path / "out.jsonl"
    assert score(files, out, "--on-error", "skip", tiny=tiny, inp="-") == 2
    err = capsys.readouterr().err
    assert "no records" in err and "--resume" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_response_longer_than_the_context_alone(files, tiny, loads, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "long.jsonl", [{"x": "a", "y": "word " * 200}])
    out = tmp_path / "out.jsonl"
    assert score(files, out, "--max-length", "64", "--drop-oldest-demos", "--quiet", tiny=tiny,
                 inp=inp) == 2
    err = capsys.readouterr().err
    assert re.search(r"the query and response alone are \d+ tokens, not less than the "
                     r"model's max length 64", err), err
    assert "--max-length" in err and "single demonstration" not in err, err


# --------------------------------------------------------------------------- 5: demo fields

def test_demo_fields_default_to_the_input_fields_and_can_differ(files, tiny, loads, tmp_path,
                                                                capsys):
    inp = write_jsonl(tmp_path / "sst.jsonl", [{"sentence": r["x"], "label": r["y"]} for r in ROWS])
    out = tmp_path / "out.jsonl"
    # The demonstration files have x / y, the input sentence / label: refused without the option.
    assert score(files, out, "--x-field", "sentence", "--y-field", "label", "--quiet",
                 tiny=tiny, inp=inp) == 2
    assert "good.jsonl" in capsys.readouterr().err
    assert score(files, out, "--x-field", "sentence", "--y-field", "label", "--demo-x-field",
                 "x", "--demo-y-field", "y", "--quiet", "--overwrite", tiny=tiny, inp=inp) == 0
    assert len(out.read_text().splitlines()) == 3
    meta = json.loads((tmp_path / "out.jsonl.meta.json").read_text())
    assert (meta["demo_x_field"], meta["demo_y_field"]) == ("x", "y")
    # ... and in the resume check: other demonstration fields are refused.
    demos = {k: write_jsonl(tmp_path / f"{k}2.jsonl", [{"q": d["x"], "a": d["y"]} for d in rows])
             for k, rows in (("good", GOOD), ("bad", BAD))}
    assert main(["score", str(inp), "-o", str(out), "--good", str(demos["good"]), "--bad",
                 str(demos["bad"]), "--model", str(tiny[0]), *KW, "--x-field", "sentence",
                 "--y-field", "label", "--demo-x-field", "q", "--demo-y-field", "a", "--quiet",
                 "--resume"]) == 2
    assert "--demo-x-field" in capsys.readouterr().err


# --------------------------------------------------------------------------- 7: before the model

@pytest.mark.parametrize("extra, msg", [
    (["--num-ratios", "1"], r"--num-ratios must be an int >= 2, got 1"),
    (["--demos-per-set", "5"], r"too few examples for --demos-per-set 5: 4 good and 4 bad "
                               r"\(each pool needs at least 5; or pass --replacement\)"),
])
def test_counts_checked_before_the_model_with_flag_names(extra, msg, files, tiny, loads,
                                                         tmp_path, capsys):
    out = tmp_path / "o" / "out.jsonl"
    assert score(files, out, "--quiet", *extra, tiny=tiny) == 2
    err = capsys.readouterr().err
    assert re.search(msg, err) and "num_ratios" not in err and "demos_per_set" not in err, err
    assert loads == [] and not (tmp_path / "o").exists()


def test_bad_header_and_unknown_features_before_the_model(files, tiny, loads, tmp_path, capsys):
    csv = tmp_path / "semi.csv"
    csv.write_text("id;x;y\nr0;a;b\n")
    out = tmp_path / "o" / "out.jsonl"
    assert features(files, out, tiny=tiny, inp=csv) == 2
    assert f"{csv}:1: field 'x': no such column" in capsys.readouterr().err
    assert features(files, out, "--features", "sent_logprob,nope", tiny=tiny) == 2
    assert "--features: unknown" in capsys.readouterr().err
    assert loads == [] and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- 10: summaries

def test_summary_says_which_stratification_auto_chose(files, tiny, loads, tmp_path, capsys):
    assert score(files, tmp_path / "out.jsonl", "--demos-per-set", "4", tiny=tiny) == 0
    err = capsys.readouterr().err
    assert "demonstration sets stratified by the answer (2 strata: negative, positive) " \
           "(--stratify-field auto)" in err, err
    assert score(files, tmp_path / "out2.jsonl", "--stratify-field", "none", tiny=tiny) == 0
    assert "demonstration sets unstratified (--stratify-field none)" in capsys.readouterr().err


# --------------------------------------------------------------------------- 9: help and names

def _sub(path):
    import argparse

    from icqs_fast.cli import build_parser

    p = build_parser(list(path))
    for w in path:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[w]
    return p


def test_audit_help_has_a_description_and_every_option_help():
    p = _sub(("audit",))
    assert p.description
    assert [a.option_strings for a in p._actions if a.option_strings and a.help is None] == []


def test_top_level_help_has_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_one_name_for_sets_per_ratio_and_both_feature_forms():
    p = _sub(("eval", "sst2"))
    assert p.parse_args(["--sets-per-ratio", "2"]).sets == 2
    assert p.parse_args(["--sets", "3"]).sets == 3  # the old name, hidden
    assert p.parse_args([]).sets == 4
    assert "--sets-per-ratio" in p.format_help() and "--sets " not in p.format_help()
    f = _sub(("features",))
    from icqs_fast.cli.features import build_config

    for form in (["sent_logprob,softmax_ent"], ["sent_logprob", "softmax_ent"]):
        args = f.parse_args(["in.jsonl", "-o", "o.jsonl", "--features", *form])
        assert build_config(args).features == ("sent_logprob", "softmax_ent")


@pytest.mark.slow
def test_summary_after_resume_covers_the_whole_output(files, tmp_path, tiny, capsys):
    """A resumed run's summary also says what the whole output holds (before, a
    resume of a complete output printed "scored 0 responses ... mean score n/a" only)."""
    out = tmp_path / "o.jsonl"
    rows = [dict(r, label="a" if i % 2 else "b") for i, r in enumerate(ROWS)]
    inp = write_jsonl(tmp_path / "lab.jsonl", rows)
    assert score(files, out, "--label-field", "label", "--quiet", tiny=tiny, inp=inp) == 0
    got = [json.loads(x) for x in out.read_text().splitlines()]
    capsys.readouterr()
    assert score(files, out, "--label-field", "label", "--resume", tiny=tiny, inp=inp) == 0
    err = capsys.readouterr().err
    assert "scored 0 responses" in err  # this run's own part
    mean = sum(r["score"] for r in got) / len(got)
    assert f"the whole output {out} holds 3 records, mean score {mean:.4f}" in err, err
    by = {lab: [r["score"] for r in got if r["label"] == lab] for lab in ("a", "b")}
    want = ", ".join(f"{k}: {sum(v) / len(v):.4f} (n={len(v)})" for k, v in sorted(by.items()))
    assert f"mean score by label: {want}" in err.split("whole output")[1], err


@pytest.mark.slow
def test_eval_prints_short_intervals_and_named_curve_columns(tiny, capsys):
    """`eval` prints intervals with 3 decimals (not 16 digits) and curve columns
    with the method's name."""
    from icqs_fast.io.datasets import shared_data_dir

    data = shared_data_dir() / "sst2"
    if not (data / "dev.tsv").is_file():
        pytest.skip(f"no SST-2 data in {data} (../shared/data)")
    assert main(["eval", "sst2", "--data", str(data), "--model", str(tiny[0]), "--limit", "2",
                 "--demos-per-set", "1,2", "--num-ratios", "2", "--sets-per-ratio", "1",
                 "--pool", "4", "--no-baselines", "--n-boot", "20", "--quiet"]) == 0
    cap = capsys.readouterr()
    out = cap.out
    assert "Loading weights" not in cap.err and "past_key_values" not in cap.err  # --quiet
    assert not re.search(r"\d\.\d{5,}", out), out  # no long floats anywhere
    curve = [x for x in out.splitlines() if x.strip().startswith("N=")]
    assert len(curve) == 2 and all("correct: icqs " in x and "icqs_epistemic " in x
                                   for x in curve), curve
    assert re.search(r"Spearman \S+ \(95% CI (n/a|\[[+-]\d\.\d{3}, [+-]\d\.\d{3}\])\)", out), out
