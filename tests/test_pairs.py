"""Pairs as judges are evaluated (issue 50, part 2; the library subset): both outputs of a pair
in one scoring stream, ``preferred`` / margin / P(a better) declared once, pairwise accuracy with
its interval, and the length judge beside it - on LLMBar's natural set."""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from _helpers import skip_unless_in_ci, tiny_llama

from icqs_fast.engine.pairs import (
    length_preferences,
    p_a_better,
    pairwise_accuracy,
    score_pairs,
)
from icqs_fast.io.schema import PAIR_FIELDS, pair_row

LLMBAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "llmbar" / "natural.json"


@dataclass
class Res:
    score: float
    p_good_calibrated: float | None = None


class Fake:
    """A scorer whose score is the response's length: what it was asked, in order."""

    def __init__(self, p=None):
        self.seen, self.calls, self.p = [], 0, p

    def score(self, items, share_query=False):
        self.calls += 1
        for x, y in items:
            self.seen.append((x, y))
            yield Res(float(len(y)), None if self.p is None else self.p(y))


def test_both_outputs_in_one_stream_and_the_declared_fields():
    fake = Fake(p=lambda y: min(0.9, 0.1 * len(y)))
    pairs = [("q1", "aaaa", "bb"), ("q2", "c", "ddd"), ("q3", "ee", "ff")]
    got = list(score_pairs(fake, pairs, tie_margin=0.5))
    assert fake.calls == 1  # one stream: one prefix bank for every output of every pair
    assert fake.seen == [("q1", "aaaa"), ("q1", "bb"), ("q2", "c"), ("q2", "ddd"),
                         ("q3", "ee"), ("q3", "ff")]
    assert [r.preferred for r in got] == ["a", "b", "tie"]
    assert [r.margin for r in got] == [2.0, -2.0, 0.0]
    pa, pb = 0.4, 0.2
    assert got[0].p_a_better == pytest.approx(pa * (1 - pb) / (pa * (1 - pb) + pb * (1 - pa)))
    assert got[2].p_a_better == pytest.approx(0.5)
    row = pair_row(got[0])  # without a record: the result's fields only
    assert list(row) == [f.name for f in PAIR_FIELDS if f.source == "result"]
    assert row["preferred"] == "a" and row["score_a"] == 4.0
    # Without a self-check map: no P(a better), and the field is left out.
    plain = next(score_pairs(Fake(), pairs[:1]))
    assert plain.p_a_better is None and "p_a_better" not in pair_row(plain)
    with pytest.raises(ValueError, match="tie_margin"):
        list(score_pairs(Fake(), pairs, tie_margin=-1))


def test_p_a_better_and_accuracy_with_its_interval():
    assert p_a_better(0.5, 0.5) == 0.5 and p_a_better(1.0, 1.0) == 0.5
    assert p_a_better(0.9, 0.1) > 0.98 and p_a_better(None, 0.3) is None
    acc, lo, hi = pairwise_accuracy(["a", "b", "tie", "a"], ["a", "a", "b", "a"], n_boot=500)
    assert acc == pytest.approx((1 + 0 + 0.5 + 1) / 4) and lo <= acc <= hi
    assert pairwise_accuracy(["a"] * 30, ["a"] * 30)[1:] == (1.0, 1.0)
    with pytest.raises(ValueError, match="'a' or 'b'"):
        pairwise_accuracy(["a"], ["c"])
    assert length_preferences([("x", "ab", "abc"), ("x", "abcd", "a"), ("x", "a", "b")]) == [
        "a", "b", "tie"]
    assert length_preferences([("x", "ab", "abc")], shorter=False) == ["b"]


def _llmbar():
    if not LLMBAR.exists():
        skip_unless_in_ci("LLMBar data (../shared/data/llmbar) missing")
    rows = json.loads(LLMBAR.read_text(encoding="utf-8"))
    pairs = [(r["input"], r["output_1"], r["output_2"]) for r in rows]
    better = ["a" if int(r["label"]) == 1 else "b" for r in rows]
    return pairs, better


@pytest.mark.slow
def test_llmbar_natural_pairs_with_the_length_judge_beside():
    """Demonstrations from the first 60 pairs (good = the better output, bad = the worse),
    the other 40 judged: pairwise accuracy with its interval, the length judge's beside it,
    each pair's two outputs scored in the same stream."""
    from icqs_fast.engine.scorer import ICQSScorer

    pairs, better = _llmbar()
    assert len(pairs) == 100
    train, test = range(60), range(60, 100)
    good = [(pairs[i][0], pairs[i][1 if better[i] == "a" else 2]) for i in train]
    bad = [(pairs[i][0], pairs[i][2 if better[i] == "a" else 1]) for i in train]
    model, tok = tiny_llama(device="cpu")
    scorer = ICQSScorer(model, tok, good, bad, num_ratios=2, demos_per_set=1,
                        sets_per_ratio=1, seed=0, drop_oldest_demos=True)
    judged = list(score_pairs(scorer, [pairs[i] for i in test]))
    assert len(judged) == 40 and all(math.isfinite(r.margin) for r in judged)
    truth = [better[i] for i in test]
    acc, lo, hi = pairwise_accuracy([r.preferred for r in judged], truth, n_boot=500)
    assert 0.0 <= lo <= acc <= hi <= 1.0 and hi - lo < 0.5
    short = length_preferences([pairs[i] for i in test])
    s_acc, s_lo, s_hi = pairwise_accuracy(short, truth, n_boot=500)
    # The length judge's accuracy is exactly the share of pairs whose better output is the
    # shorter (no tie in these 40).
    assert s_acc == sum((len(pairs[i][1]) < len(pairs[i][2])) == (better[i] == "a")
                        for i in test) / 40
    assert s_lo <= s_acc <= s_hi


# --------------------------------------------------------------------------- score --pairs

KW = ["--num-ratios", "2", "--demos-per-set", "1", "--sets-per-ratio", "1", "--seed", "0",
      "--dtype", "float32", "--device", "cpu", "--quiet"]


def _pools(n=30):
    from _helpers import sentiment_pools

    good, bad = sentiment_pools(n)
    return [{"x": x, "y": y} for x, y in good], [{"x": x, "y": y} for x, y in bad]


def _test_pairs():
    """Five a/b pairs (a the right sentiment in the even ones), labelled with the better."""
    from _helpers import sentiment_pools

    good, bad = sentiment_pools(5, start=40)
    rows = []
    for i, ((x, right), (_, wrong)) in enumerate(zip(good, bad, strict=True)):
        a, b = (right, wrong) if i % 2 == 0 else (wrong, right + " indeed")
        rows.append({"id": f"p{i}", "x": x, "y_a": a, "y_b": b, "better": "a" if a == right
                     else "b"})
    return rows


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from icqs_fast import models

    d = tiny_llama_dir()
    return d, models.load_model(d, dtype="float32", device="cpu")


@pytest.fixture
def cli(tiny, tmp_path, monkeypatch, capsys):
    """``icqs-fast score ...`` with the tiny model (loaded once); ``(exit code, stderr)``."""
    from _helpers import write_jsonl

    from icqs_fast import models
    from icqs_fast.cli import main

    model_dir, loaded = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    good, bad = _pools()
    g = write_jsonl(tmp_path / "good.jsonl", good)
    b = write_jsonl(tmp_path / "bad.jsonl", bad)

    def run(*args, demos=True, quiet=True):
        capsys.readouterr()
        code = main(["score", *map(str, args), *(["--good", str(g), "--bad", str(b)]
                                                 if demos else []),
                     "--model", str(model_dir), *(KW if quiet else KW[:-1])])
        return code, capsys.readouterr().err
    return run


def test_score_pairs_both_outputs_scored_and_every_field(cli, tmp_path):
    from _helpers import read_jsonl, write_jsonl

    rows = _test_pairs()
    inp = write_jsonl(tmp_path / "pairs.jsonl", rows)
    code, err = cli("--pairs", inp, "-o", tmp_path / "judged.jsonl", "--label-field", "better",
                    "--self-check-max", "60", quiet=False)
    assert code == 0, err
    got = read_jsonl(tmp_path / "judged.jsonl")
    assert len(got) == 5
    for r, src in zip(got, rows, strict=True):
        assert set(f.name for f in PAIR_FIELDS) == set(r), r  # the self-check gave P(a better)
        assert r["id"] == src["id"] and r["label"] == src["better"]
        assert r["margin"] == pytest.approx(r["score_a"] - r["score_b"])
        assert r["preferred"] == ("a" if r["margin"] > 0 else "b")  # tie margin 0
        assert 0 <= r["p_a_better"] <= 1
        assert (r["p_a_better"] > 0.5) == (r["margin"] > 0)  # the map is monotone
    # The summary: pairwise accuracy with its interval, the length judge's beside it.
    assert re.search(r"judged 5 pairs in .*\n  pairwise accuracy \d\.\d{3} \[\d\.\d{3}, "
                     r"\d\.\d{3}\] \(95 % interval, 5 pairs\); the length judge \(the "
                     r"(shorter|longer) output, as the pools favour\) \d\.\d{3} \[", err), err
    acc = sum(r["preferred"] == r["label"] for r in got) / 5
    assert f"pairwise accuracy {acc:.3f} [" in err, err
    # Both outputs scored as `score` scores them: the same stream of (x, y_a), (x, y_b).
    plain = write_jsonl(tmp_path / "plain.jsonl", [
        {"x": r["x"], "y": y} for r in rows for y in (r["y_a"], r["y_b"])])
    assert cli(plain, "-o", tmp_path / "plain_out.jsonl", "--no-self-check")[0] == 0
    scores = [r["score"] for r in read_jsonl(tmp_path / "plain_out.jsonl")]
    assert [s for r in got for s in (r["score_a"], r["score_b"])] == pytest.approx(scores,
                                                                                abs=1e-6)


def test_pair_field_grouping_parquet_and_pools_as_pairs(cli, tmp_path):
    """Two records per pair by --pair-field give the a/b records' lines; Parquet holds the
    same rows; --good-bad-pairs gives the pools of the --good / --bad files."""
    import pyarrow.parquet as pq
    from _helpers import read_jsonl, write_jsonl

    rows = _test_pairs()
    ab = write_jsonl(tmp_path / "ab.jsonl", rows)
    grouped = write_jsonl(tmp_path / "grouped.jsonl", [
        {"pid": r["id"], "x": r["x"], "y": r[f"y_{s}"],
         "ok": "good" if r["better"] == s else "bad"} for r in rows for s in "ab"])
    common = ("--no-self-check",)
    assert cli("--pairs", ab, "-o", tmp_path / "ab_out.jsonl", "--label-field", "better",
               *common)[0] == 0
    code, err = cli("--pairs", grouped, "-o", tmp_path / "g_out.parquet", "--pair-field", "pid",
                    "--label-field", "ok", *common)
    assert code == 0, err
    want = read_jsonl(tmp_path / "ab_out.jsonl")
    table = pq.read_table(tmp_path / "g_out.parquet").to_pylist()
    assert [t["id"] for t in table] == [w["id"] for w in want]
    assert [t["line"] for t in table] == [1, 3, 5, 7, 9]
    for t, w in zip(table, want, strict=True):
        assert t["label"] == w["label"] and t["preferred"] == w["preferred"]
        assert t["score_a"] == pytest.approx(w["score_a"], abs=1e-6)
        assert t["score_b"] == pytest.approx(w["score_b"], abs=1e-6)
        assert t["p_a_better"] is None and t["error"] is None
    # The pools as pairs: (x, better) good, (x, worse) bad - the same pools as _pools().
    good, bad = _pools()
    pool_pairs = write_jsonl(tmp_path / "pool_pairs.jsonl", [
        {"x": g["x"], "y_a": b["y"], "y_b": g["y"], "better": "b"}
        for g, b in zip(good, bad, strict=True)])
    # Pools of distinct inputs per class are paired here by position: the good pool's x.
    pools_from_files = write_jsonl(tmp_path / "bad_same_x.jsonl", [
        {"x": g["x"], "y": b["y"]} for g, b in zip(good, bad, strict=True)])
    assert cli("--pairs", ab, "-o", tmp_path / "files.jsonl", "--label-field", "better",
               "--good", tmp_path / "good.jsonl", "--bad", pools_from_files, *common,
               demos=False)[0] == 0
    code, err = cli("--pairs", ab, "-o", tmp_path / "as_pairs.jsonl", "--label-field", "better",
                    "--good-bad-pairs", pool_pairs, *common, demos=False)
    assert code == 0, err
    assert read_jsonl(tmp_path / "as_pairs.jsonl") == read_jsonl(tmp_path / "files.jsonl")
    # ... and so does a plain (one response a record) score job.
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"x": r["x"], "y": r["y_a"]} for r in rows])
    for name, demos in (("p_files", ["--good", tmp_path / "good.jsonl", "--bad",
                                     pools_from_files]),
                        ("p_pairs", ["--good-bad-pairs", pool_pairs, "--demo-label-field",
                                     "better"])):
        assert cli(plain, "-o", tmp_path / f"{name}.jsonl", *demos, *common,
                   demos=False)[0] == 0
    assert read_jsonl(tmp_path / "p_pairs.jsonl") == read_jsonl(tmp_path / "p_files.jsonl")


BAD_PAIRS = [
    # (rows, extra flags, line, field, message)
    ([{"x": "q", "y_a": "a"}], (), 1, "y_b", r"field 'y_b': missing \(this record's keys: x, "
     r"y_a\)"),
    ([{"x": "q", "y_a": "a", "y_b": "b"}, {"x": "r", "y_a": "a", "y_b": 5}], (), 2, "y_b",
     r"must be a string, got int 5"),
    ([{"x": "q", "y_a": "a", "y_b": "b", "l": "c"}], ("--label-field", "l"), 1, "l",
     r"the better output is a or b"),
    ([{"k": 1, "x": "q", "y": "a"}, {"k": 2, "x": "q", "y": "b"}, {"k": 2, "x": "q", "y": "c"}],
     ("--pair-field", "k"), 1, "k", r"pair 1 has 1 record"),
    ([{"k": 1, "x": "q", "y": "a"}, {"k": 1, "x": "q", "y": "b"}, {"k": 1, "x": "q", "y": "c"}],
     ("--pair-field", "k"), 3, "k", r"pair 1 has a third record"),
    ([{"k": 1, "x": "q", "y": "a"}, {"k": 1, "x": "other", "y": "b"}], ("--pair-field", "k"),
     2, "x", r"not the x of its first record \(line 1\)"),
]


@pytest.mark.parametrize("rows, extra, line, field, msg", BAD_PAIRS)
def test_bad_pairs_exit_2_before_the_model_leaving_nothing(rows, extra, line, field, msg,
                                                           tmp_path, monkeypatch, capsys):
    import re

    from _helpers import write_jsonl

    from icqs_fast import models
    from icqs_fast.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    inp = write_jsonl(tmp_path / "in" / "pairs.jsonl", rows)
    good, bad = _pools()
    g = write_jsonl(tmp_path / "in" / "good.jsonl", good)
    b = write_jsonl(tmp_path / "in" / "bad.jsonl", bad)
    code = main(["score", "--pairs", str(inp), "-o", str(tmp_path / "out" / "o.jsonl"),
                 "--good", str(g), "--bad", str(b), *extra, *KW])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"icqs-fast: error: {inp}:{line}: field '{field}': "), err
    assert re.search(msg, err), err
    assert list((tmp_path / "out").iterdir()) == []  # no output, meta or lock file


def test_pairs_refusals_and_a_bad_pool_pair(tmp_path, capsys):
    from _helpers import write_jsonl

    from icqs_fast.cli import main

    inp = write_jsonl(tmp_path / "pairs.jsonl", [{"x": "q", "y_a": "a", "y_b": "b"}])
    good, bad = _pools()
    g = write_jsonl(tmp_path / "good.jsonl", good)
    b = write_jsonl(tmp_path / "bad.jsonl", bad)
    base = ["score", "--pairs", str(inp), "-o", str(tmp_path / "o.jsonl"), *KW]
    assert main([*base, "--good", str(g), "--bad", str(b), "--pair-field", "k",
                 "--id-field", "x"]) == 2
    assert "leave out --id-field" in capsys.readouterr().err
    assert main([*base]) == 2
    assert "score needs --good and --bad (or --good-bad-pairs FILE)" in capsys.readouterr().err
    assert main([*base, "--good-bad-pairs", str(inp), "--good", str(g)]) == 2
    assert "leave out --good and --bad" in capsys.readouterr().err
    pools = write_jsonl(tmp_path / "pools.jsonl", [{"x": "q", "y_a": "a", "y_b": "b"},
                                                   {"x": "r", "y_a": "a"}])
    assert main([*base, "--good-bad-pairs", str(pools)]) == 2
    assert f"{pools}:2: field 'y_b': missing" in capsys.readouterr().err
    assert main(["score", str(inp), "-o", str(tmp_path / "p.jsonl"), "--good", str(g),
                 "--bad", str(b), "--pair-field", "k", *KW]) == 2
    assert "pass --pairs" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_long(tiny_llama_dir):
    """The tiny model with room for LLMBar's long prompts (loaded before `cli` patches the
    loader)."""
    from icqs_fast import models

    return models.load_model(tiny_llama_dir(max_positions=4096), dtype="float32", device="cpu")


@pytest.mark.slow
def test_score_pairs_cli_on_llmbar_natural(tiny_long, cli, tmp_path, monkeypatch):
    """`score --pairs` on LLMBar's natural set as a user runs it: the first 60 pairs as the
    pools (--good-bad-pairs, label 1 / 2), the other 40 judged; every pair's line, the label
    read, and the summary's accuracies those of the lines and of the length judge."""
    from _helpers import read_jsonl, write_jsonl

    if not LLMBAR.exists():
        skip_unless_in_ci("LLMBar data (../shared/data/llmbar) missing")
    from icqs_fast import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: tiny_long)
    rows = json.loads(LLMBAR.read_text(encoding="utf-8"))
    train = write_jsonl(tmp_path / "train.jsonl", rows[:60])
    test = write_jsonl(tmp_path / "test.jsonl", rows[60:])
    out = tmp_path / "judged.jsonl"
    code, err = cli("--pairs", test, "-o", out, "--good-bad-pairs", train, "--x-field", "input",
                    "--y-a-field", "output_1", "--y-b-field", "output_2", "--label-field",
                    "label", "--drop-oldest-demos", "--no-self-check", demos=False, quiet=False)
    assert code == 0, err
    got = read_jsonl(out)
    assert [r["index"] for r in got] == list(range(40))
    truth = ["a" if int(r["label"]) == 1 else "b" for r in rows[60:]]
    assert [r["label"] for r in got] == truth
    for r in got:
        assert r["preferred"] == ("a" if r["margin"] > 0 else "b" if r["margin"] < 0 else "tie")
    acc, lo, hi = pairwise_accuracy([r["preferred"] for r in got], truth)
    pairs = [(r["input"], r["output_1"], r["output_2"]) for r in rows[60:]]
    good = [(r["output_1"] if int(r["label"]) == 1 else r["output_2"]) for r in rows[:60]]
    bad = [(r["output_2"] if int(r["label"]) == 1 else r["output_1"]) for r in rows[:60]]
    shorter = sum(map(len, good)) <= sum(map(len, bad))
    lacc, llo, lhi = pairwise_accuracy(length_preferences(pairs, shorter=shorter), truth)
    assert (f"pairwise accuracy {acc:.3f} [{lo:.3f}, {hi:.3f}] (95 % interval, 40 pairs); "
            f"the length judge (the {'shorter' if shorter else 'longer'} output, as the pools "
            f"favour) {lacc:.3f} [{llo:.3f}, {lhi:.3f}]") in err, err


def test_skip_bad_pairs_and_the_tie_margin(cli, tmp_path):
    """--on-error skip: a bad pair's error line in its place, the others judged; a tie
    margin wider than every margin makes every pair a tie."""
    from _helpers import read_jsonl, write_jsonl

    rows = _test_pairs()[:3]
    rows.insert(1, {"x": "q", "y_a": "a"})
    inp = write_jsonl(tmp_path / "pairs.jsonl", rows)
    code, err = cli("--pairs", inp, "-o", tmp_path / "o.jsonl", "--on-error", "skip",
                    "--no-self-check")
    assert code == 0, err
    got = read_jsonl(tmp_path / "o.jsonl")
    assert [r["index"] for r in got] == [0, 1, 2, 3]
    assert got[1] == {"index": 1, "line": 2, "error": {"field": "y_b", "reason": got[1][
        "error"]["reason"]}} and "missing" in got[1]["error"]["reason"]
    assert all("preferred" in r for r in got[:1] + got[2:])
    assert cli("--pairs", inp, "-o", tmp_path / "t.jsonl", "--on-error", "skip",
               "--no-self-check", "--tie-margin", "1e9")[0] == 0
    ties = read_jsonl(tmp_path / "t.jsonl")
    assert [r.get("preferred") for r in ties] == ["tie", None, "tie", "tie"]
    assert [r.get("score_a") for r in ties] == [r.get("score_a") for r in got]


# --------------------------------------------------------------------------- pairwise self-check


def test_pairwise_self_check_holds_out_whole_instructions():
    """The draw by instruction (each drawn x brings its good and bad answers, nested in its
    size), ICQS's pairwise accuracy over the held-out pairs, the length judge's with its
    direction fitted out of fold, the abstain band over margins, and the meta round trip."""
    import numpy as np

    from icqs_fast.engine.selfcheck import SelfCheck, fit_self_check
    from icqs_fast.engine.selfcheck_pairs import (
        instruction_heldout,
        item_pairs,
        pair_band_verdict,
        pairwise_self_check,
    )

    n = 40
    good = [(f"q{i}", "g" * (3 + i % 4)) for i in range(n)]  # the good answers the shorter
    bad = [(f"q{i}", "b" * (8 + i % 5)) for i in range(n)]
    small, labels_small = instruction_heldout(good, bad, 20, seed=3)
    items, labels = instruction_heldout(good, bad, 60, seed=3)
    assert len(items) == 60 and int(labels.sum()) == 30
    assert set(small) <= set(items)  # a larger draw holds every instruction of a smaller one
    xs_good = {x for (x, _), lab in zip(items, labels, strict=True) if lab == 1}
    xs_bad = {x for (x, _), lab in zip(items, labels, strict=True) if lab == 0}
    assert xs_good == xs_bad and len(xs_good) == 30  # whole instructions, both answers
    assert len(item_pairs(items, labels)) == 30
    assert instruction_heldout(good, [(f"r{i}", y) for i, (_, y) in enumerate(bad)], 60,
                               0) is None  # no instruction answered in both pools
    # Scores that pick the good answer in exactly 21 of the 30 pairs, the wrong picks by
    # small margins (so a band of small margins sent to a person leaves the right ones).
    pairs = item_pairs(items, labels)
    s = np.zeros(len(items))
    for k, (i, _) in enumerate(pairs):
        s[i] = 1.0 + 0.1 * k if k < 21 else -0.01 * (k - 20)
    values = [{"length_tokens": float(len(y)), "length_chars": float(len(y))} for _, y in items]
    p = pairwise_self_check(s, labels, items, values, target_accuracy=0.9, folds=5, seed=0,
                            n_boot=200, level=0.95)
    assert p["pairs"] == 30 and p["instructions"] == 30 and p["ties"] == 0
    assert p["accuracy"] == pytest.approx(21 / 30)
    assert p["accuracy_lo"] < 21 / 30 < p["accuracy_hi"]
    length = {b["name"]: b for b in p["baselines"]}["length_chars"]
    assert length["accuracy"] == 1.0 and length["direction"] == "lower"
    assert "beats ICQS on the held-out pairs" in p["beaten"]
    band = p["band"]
    assert band["target"] == 0.9 and band["reached"] and band["accuracy"] >= 0.9
    assert 0 < band["hi"] < 1.0 and -1.0 < band["lo"] < 0
    assert [pair_band_verdict(band, m) for m in (0.0, 3.0, -3.0)] == ["tie", "a", "b"]
    # A tie margin wider than every margin: every pair a tie, counted half.
    wide = pairwise_self_check(s, labels, items, None, tie_margin=10.0, folds=5, seed=0,
                               n_boot=200, level=0.95)
    assert wide["ties"] == 30 and wide["accuracy"] == 0.5 and wide["baselines"] == []
    # Through fit_self_check: said in the summary, kept in the meta file's dict.
    check = fit_self_check(s, labels, baseline_values=values, pair_items=items,
                           target_accuracy=0.9, n_boot=200)
    text = "\n".join(check.lines())
    assert f"expected pairwise accuracy {21 / 30:.3f} [" in text, text
    assert "pairwise baselines (direction fitted out of fold): length_tokens 1.000" in text
    assert "pairwise abstain band for accuracy 0.9" in text
    d = check.to_dict()
    json.dumps(d, allow_nan=False)
    assert SelfCheck.from_dict(d).pairwise == d["pairwise"]
    assert d["pairwise"]["pairs"] == 30 and "pairwise" in check.summary_dict()


def test_pairwise_band_is_symmetric_and_measured_out_of_fold():
    """The band over pairs: ties within |margin| <= t whichever output is a, t fitted on the
    other instruction folds for each fold's pairs; a target nothing reaches: all ties."""
    import numpy as np

    from icqs_fast.engine.selfcheck_pairs import margin_band

    rng = np.random.default_rng(1)
    d = rng.normal(0.5, 1.0, 60)
    band = margin_band(d, np.arange(60), 0.8, folds=5, seed=0, n_boot=200, level=0.95)
    assert band.reached and band.lo == -band.hi and band.hi > 0
    assert band.coverage < 1.0 and band.coverage_lo <= band.coverage <= band.coverage_hi
    # In sample, the fitted margin's outside reaches the aim it was fitted for.
    out = np.abs(d) > band.hi
    assert (d[out] > 0).mean() >= band.aim - 1e-9 and band.aim >= 0.8
    none = margin_band(-np.abs(d), np.arange(60), 0.8, folds=5, seed=0, n_boot=200,
                       level=0.95)  # every pick wrong
    assert not none.reached


def test_score_pairs_self_check_over_pairs_in_summary_meta_and_check(cli, tiny, tmp_path,
                                                                     capsys):
    """`score --pairs --good-bad-pairs`: the self-check draws whole instructions and says
    the expected pairwise accuracy, the pairwise baselines and the band over pairs; the meta
    file keeps them and `check --from-output` shows them."""
    from _helpers import write_jsonl

    from icqs_fast.cli import main
    from icqs_fast.io.runs import meta_path

    tiny_dir = tiny[0]
    good, bad = _pools()
    pool_pairs = write_jsonl(tmp_path / "pool_pairs.jsonl", [
        {"x": g["x"], "y_a": g["y"], "y_b": b["y"], "better": "a"}
        for g, b in zip(good, bad, strict=True)])
    inp = write_jsonl(tmp_path / "pairs.jsonl", _test_pairs())
    out = tmp_path / "judged.jsonl"
    code, err = cli("--pairs", inp, "-o", out, "--label-field", "better", "--good-bad-pairs",
                    pool_pairs, "--self-check-max", "60", "--target-accuracy", "0.8",
                    demos=False, quiet=False)
    assert code == 0, err
    # (30 instructions drawn; a pair with an output no clean set could score is left out)
    got = re.search(r"self-check: pairwise \((\d+) held-out pairs of \1 instructions, whole "
                    r"instructions held out\): expected pairwise accuracy \d\.\d{3} \[", err)
    assert got and 20 <= int(got[1]) <= 30, err
    assert "pairwise baselines (direction fitted out of fold): length_tokens" in err
    assert "pairwise abstain band" in err
    meta = json.loads(meta_path(out).read_text())
    pw = meta["self_check"]["pairwise"]
    assert pw["pairs"] == int(got[1]) and meta["self_check"]["config"]["draw"] == "instructions"
    assert {b["name"] for b in pw["baselines"]} >= {"length_tokens", "length_chars"}
    capsys.readouterr()
    assert main(["check", "--from-output", str(out)]) == 0
    shown = capsys.readouterr().out
    assert re.search(rf"^pairwise +pairwise \({got[1]} held-out pairs", shown, re.M), shown
    # check with the same pools as pairs: the same pairwise self-check, its scores from the
    # cache score filled (nothing scored again).
    assert main(["check", "--good-bad-pairs", str(pool_pairs), "--model", str(tiny_dir),
                 "--self-check-max", "60", "--target-accuracy", "0.8", "--json",
                 *KW[:-1]]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["cache"] == "hit" and d["config"]["draw"] == "instructions"
    assert d["pairwise"] == pw


# --------------------------------------------------------------------------- resume, shard


@pytest.mark.parametrize("grouped", [False, True])
def test_pairs_resume_and_shard(grouped, cli, tmp_path):
    """--shard i/n with pairs: the shards' outputs concatenated are the whole run's (a grouped
    pair cut by a record boundary goes to the shard of its first record); --resume after a
    run cut short continues after the last pair written, checking its id, and ends with the
    whole run's lines."""
    from _helpers import read_jsonl, write_jsonl

    from icqs_fast.io.runs import meta_path

    rows = _test_pairs()
    if grouped:  # 10 records: the 2-shard boundary (record 5) cuts pair p2 (records 4, 5)
        rows = [{"pid": r["id"], "x": r["x"], "y": r[f"y_{s}"]} for r in rows for s in "ab"]
        extra = ["--pair-field", "pid"]
    else:
        extra = []
    inp = write_jsonl(tmp_path / "pairs.jsonl", rows)
    common = [*extra, "--no-self-check"]
    code, err = cli("--pairs", inp, "-o", tmp_path / "all.jsonl", *common)
    assert code == 0, err
    whole = read_jsonl(tmp_path / "all.jsonl")
    assert len(whole) == 5
    parts = []
    for i in range(3):
        out = tmp_path / f"s{i}.jsonl"
        code, err = cli("--pairs", inp, "-o", out, "--shard", f"{i}/3", *common)
        assert code == 0, err
        parts += read_jsonl(out)
    assert [r["index"] for r in parts] == [r["index"] for r in whole]
    assert parts == whole
    # A run cut short after two pairs: --resume writes the other three, once each.
    cut = tmp_path / "cut.jsonl"
    code, err = cli("--pairs", inp, "-o", cut, *common)
    assert code == 0, err
    cut.write_text("".join(line + "\n" for line in cut.read_text().splitlines()[:2]))
    assert meta_path(cut).exists()
    code, err = cli("--pairs", inp, "-o", cut, "--resume", *common)
    assert code == 0, err
    assert read_jsonl(cut) == whole
    # The input changed under the last pair written: refused, naming it.
    rows2 = [dict(r) for r in rows]
    key = "pid" if grouped else "id"
    k = 2 if grouped else 1  # the record of the second pair's a
    rows2[k][key] = "other"
    if grouped:
        rows2[k + 1][key] = "other"
    write_jsonl(inp, rows2)
    cut.write_text("".join(line + "\n" for line in cut.read_text().splitlines()[:2]))
    code, err = cli("--pairs", inp, "-o", cut, "--resume", *common)
    assert code == 2 and "the input changed since the output was written" in err, err


# --------------------------------------------------------------------------- /v1/score pairs


@pytest.mark.server
def test_v1_score_pairs_equal_score_pairs(tiny):
    """/v1/score with 'pairs' (the FastAPI test client, the tiny model): per pair the fields
    `score --pairs` writes (the declared PAIR_FIELDS' result part), equal to the library's
    score_pairs; the tie margin; pairs with features, or pairs and records, are a 400."""
    from starlette.testclient import TestClient

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.serve.app import Server
    from icqs_fast.serve.config import ServeConfig

    _, (model, tok) = tiny
    good, bad = _pools(6)
    g = [[r["x"], r["y"]] for r in good]
    b = [[r["x"], r["y"]] for r in bad]
    opts = {"num_ratios": 2, "demos_per_set": 1, "sets_per_ratio": 2, "seed": 0}
    rows = _test_pairs()
    pairs = [{"x": r["x"], "y_a": r["y_a"], "y_b": r["y_b"]} for r in rows]
    srv = Server(model, tok, ServeConfig(model_name="tiny"))
    with TestClient(srv.app()) as client:
        r = client.post("/v1/score", json={"pairs": pairs, "good": g, "bad": b,
                                           "icqs_options": opts})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        scorer = ICQSScorer(model, tok, [tuple(x) for x in g], [tuple(x) for x in b], **opts)
        want = list(score_pairs(scorer, [(p["x"], p["y_a"], p["y_b"]) for p in pairs]))
        assert [d["index"] for d in data] == list(range(5))
        for d, w in zip(data, want, strict=True):
            assert set(d) == {"index", "pair"}
            # As a score --pairs line: p_a_better left out without a self-check (the
            # request's own pools get none).
            assert set(d["pair"]) == {f.name for f in PAIR_FIELDS if f.source == "result"
                                      and f.name != "p_a_better"}
            assert d["pair"]["score_a"] == pytest.approx(w.score_a, abs=1e-5)
            assert d["pair"]["score_b"] == pytest.approx(w.score_b, abs=1e-5)
            assert d["pair"]["preferred"] == w.preferred
        r = client.post("/v1/score", json={"pairs": pairs[:2], "good": g, "bad": b,
                                           "icqs_options": opts, "tie_margin": 1e9})
        assert [d["pair"]["preferred"] for d in r.json()["data"]] == ["tie", "tie"]
        for body, word in (({"features": True}, "leave out 'features'"),
                           ({"records": [{"x": "q", "y": "a"}]}, "'records' or 'pairs'")):
            r = client.post("/v1/score", json={"pairs": pairs, "good": g, "bad": b, **body})
            assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
        r = client.post("/v1/score", json={"pairs": [{"y_a": "a", "y_b": "b"}], "good": g,
                                           "bad": b})
        assert r.status_code == 400 and "pair 0" in r.json()["error"]["message"], r.text


def test_one_prefix_pass_for_every_pair(tiny, monkeypatch):
    """N pairs cost ONE prefix-bank pass, the same for 2 pairs as for 6: the demonstration
    prefixes are computed once and every output runs only its own suffix rows against them
    (2 outputs x M+1 x L contexts per pair). The query x runs once per pair and context, in a
    row of its own that both outputs continue (tests/test_query_once.py): counted here."""
    import icqs_fast.engine.scorer as scorer_mod
    from icqs_fast.engine.batching import PrefixBank
    from icqs_fast.engine.scorer import ICQSScorer

    _, (model, tok) = tiny
    good, bad = _pools(8)
    rows = _test_pairs()
    adds, suffix_rows, query_rows = [], [], []
    real_add, real_suffix = PrefixBank.add, scorer_mod.suffix_hidden

    def add(self, prefixes):
        adds.append((id(self), len(prefixes)))
        return real_add(self, prefixes)

    def suffix(model_, bank, entries, suffixes, *a, **k):
        (query_rows if k.get("capture") is not None else suffix_rows).extend(suffixes)
        return real_suffix(model_, bank, entries, suffixes, *a, **k)

    monkeypatch.setattr(PrefixBank, "add", add)
    monkeypatch.setattr(scorer_mod, "suffix_hidden", suffix)
    passes = {}
    for n in (2, 6):
        adds.clear()
        suffix_rows.clear()
        query_rows.clear()
        sc = ICQSScorer(model, tok, [(r["x"], r["y"]) for r in good],
                        [(r["x"], r["y"]) for r in bad], num_ratios=2, demos_per_set=1,
                        sets_per_ratio=2, seed=0)
        pairs = [(r["x"], r["y_a"], r["y_b"]) for r in (rows * 2)[:n]]
        assert len(list(score_pairs(sc, pairs))) == n
        if sc.plain:
            pytest.fail("the tiny llama should take the prefix-bank path")
        # (the model's capability probe, run once per model, builds a bank of its own)
        passes[n] = ([k for b, k in adds if b == id(sc.prefix_bank)],
                     sc.prefix_bank.forward_tokens, len(sc.prefix_bank))
        assert len(suffix_rows) == 2 * n * sc.n_contexts  # each output's own rows only
        # The query's tokens run once per pair and context, not in the outputs' rows.
        q = len(tok.encode(pairs[0][0], add_special_tokens=False))
        assert len(query_rows) == n * sc.n_contexts
        assert min(len(s) for s in query_rows) >= q
        assert max(len(s) for s in suffix_rows) < q
    # One add of the 4 demonstration prefixes, whatever the number of pairs.
    assert passes[2] == passes[6] and passes[2][0] == [4] and passes[2][2] == 4
