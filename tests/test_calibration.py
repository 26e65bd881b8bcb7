"""Calibrated ICQS: contextual calibration ("content_free"), domain-conditional PMI
("pmi") and the posterior-mean score. The engine's calibrated log-likelihood equals the difference
of two independent plain-forward log-likelihoods of whole texts; its (query, y) baseline cache
never mixes contexts; score="mean" lies in [0, 1] and equals the argmax score when the posterior
is one-hot; the settings fingerprint holds the new options."""

import numpy as np
import pytest
import torch
from _helpers import DEVICE, assert_same_scores

from icqs_fast.engine.calibration import calibration_queries, icqs_scores
from icqs_fast.engine.prompts import Template, build_demo_sets
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.engine.scorer import ICQSScorer
from icqs_fast.engine.settings import RESULT_FIELDS, ScoringSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = [("the movie was great", "positive"), ("I loved it", "positive"),
        ("superb acting and a moving story", "positive"), ("dull", "negative"),
        ("a tedious, overlong mess", "negative"), ("nothing happens for two hours", "negative")]
BAD = [("terrible film", "positive"), ("boring", "positive"),
       ("a slow and empty remake", "positive"), ("wonderful", "negative"),
       ("I would watch it again tomorrow", "negative"), ("a joyous celebration", "negative")]
# Label answers (shared baselines) and one free-text answer.
RESPONSES = [("a wonderful time", "positive"), ("awful", "negative"),
             ("a long, slow film", "positive"), ("so-so", "it was fine I guess")]
SMALL = dict(num_ratios=3, demos_per_set=4, sets_per_ratio=2, seed=3)
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_llama_model):
    return tiny_llama_model


@torch.no_grad()
def plain_loglik(model, tok, before: str, response: str) -> float:
    """log P(response | before) by one forward over the whole text tokenized as one string; the
    response = the tokens from the first one holding a response character."""
    enc = tok(before + response, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    k0 = next(k for k, (a, b) in enumerate(spans) if b > len(before) or a >= len(before))
    t = torch.tensor([ids], device=DEVICE)
    logp = torch.log_softmax(model(input_ids=t).logits[0].double(), dim=-1)
    return float(sum(logp[k - 1, ids[k]] for k in range(k0, len(ids))))


@pytest.mark.parametrize("calibration", ["content_free", "pmi"])
@pytest.mark.slow
def test_calibrated_loglik_is_a_difference_of_plain_forwards(tiny, calibration):
    model, tok = tiny
    st = ScoringSettings(**SMALL, calibration=calibration)
    got = list(ICQSScorer(model, tok, GOOD, BAD, st).score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, st)
    sets = [s for row in build_demo_sets(GOOD, BAD, **st.demo_set_options()) for s in row]
    tpl = st.template
    for (x, y), g, r in zip(RESPONSES, got, ref, strict=True):
        assert g.calibration == calibration and g.loglik_baseline is not None
        torch.testing.assert_close(g.loglik, r.loglik, atol=TOL, rtol=0)
        torch.testing.assert_close(g.loglik_baseline, r.loglik_baseline, atol=TOL, rtol=0)
        torch.testing.assert_close(g.loglik_calibrated, g.loglik - g.loglik_baseline,
                                   atol=1e-5, rtol=0)
        assert_same_scores(g, r)
        # Two independent plain forwards per context (written here, not the reference's code).
        for c in (0, len(sets) - 1):
            prefix = tpl.format_prefix(sets[c].examples)
            raw = plain_loglik(model, tok, prefix + tpl.format_query(x), tpl.format_response(y))
            if calibration == "content_free":
                base = sum(plain_loglik(model, tok, prefix + tpl.format_query(q),
                                        tpl.format_response(y)) for q in st.content_free)
                base /= len(st.content_free)
            else:
                base = plain_loglik(model, tok, prefix + "Answer:", tpl.format_response(y))
            j, l_ = divmod(c, st.sets_per_ratio)
            assert abs(float(g.loglik_calibrated[j, l_]) - (raw - base)) < TOL


@pytest.mark.slow
def test_baseline_cache_is_per_context_and_per_answer(tiny):
    """Responses sharing an answer share its baseline rows (scored once per context); the
    baseline differs between contexts and equals each context's own plain forward, also when a
    small token budget splits a baseline's rows over several forwards and responses."""
    model, tok = tiny
    st = ScoringSettings(**SMALL, calibration="content_free", token_budget=64)
    sc = ICQSScorer(model, tok, GOOD, BAD, st)
    got = list(sc.score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, st)
    n_ctx = st.num_ratios * st.sets_per_ratio
    answers = {y for _, y in RESPONSES}
    assert sc.calibration_rows == len(answers) * len(st.content_free) * n_ctx
    assert sorted(sc._cal_cache) == sorted((q, y) for q in range(len(st.content_free))
                                           for y in answers)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.loglik_baseline, r.loglik_baseline, atol=TOL, rtol=0)
        assert g.loglik_baseline.unique().numel() > 1  # one value per context, not shared
    # Same answer, different inputs: the same baseline; different answers: different ones.
    torch.testing.assert_close(got[0].loglik_baseline, got[2].loglik_baseline, atol=0, rtol=0)
    assert not torch.allclose(got[0].loglik_baseline, got[1].loglik_baseline)
    # A second pass hits the cache only and gives the same results.
    again = list(sc.score(RESPONSES[::-1]))[::-1]
    assert sc.calibration_rows == len(answers) * len(st.content_free) * n_ctx
    for a, b in zip(got, again, strict=True):
        assert_same_scores(a, b)
        torch.testing.assert_close(a.loglik_calibrated, b.loglik_calibrated, atol=TOL, rtol=0)


def test_uncalibrated_results_unchanged(tiny):
    model, tok = tiny
    a = list(ICQSScorer(model, tok, GOOD, BAD, **SMALL).score(RESPONSES))
    b = list(ICQSScorer(model, tok, GOOD, BAD, **SMALL, calibration="content_free")
             .score(RESPONSES))
    for x, y in zip(a, b, strict=True):
        assert x.loglik_baseline is None and x.calibration == "none"
        torch.testing.assert_close(x.loglik_calibrated, x.loglik, atol=0, rtol=0)
        torch.testing.assert_close(x.loglik, y.loglik, atol=TOL, rtol=0)


def test_mean_score_in_unit_interval_and_one_hot_equals_argmax():
    ratios = [0.0, 0.25, 0.5, 0.75, 1.0]
    g = torch.Generator().manual_seed(0)
    for scale in (0.01, 1.0, 30.0, 1e4):
        for _ in range(20):
            ll = torch.randn(5, 3, generator=g, dtype=torch.float64) * scale
            s, per = icqs_scores(ll, ratios, "mean")
            assert 0.0 <= s <= 1.0 and all(0.0 <= v <= 1.0 for v in per)
    for j in range(5):
        ll = torch.full((5, 3), -1e4, dtype=torch.float64)
        ll[j] = 0.0  # the posterior is one-hot on ratio j (every set too)
        assert icqs_scores(ll, ratios, "mean") == icqs_scores(ll, ratios, "argmax")
        assert icqs_scores(ll, ratios, "mean")[0] == ratios[j]
    with pytest.raises(ValueError):
        icqs_scores(torch.zeros(5, 3), ratios, "median")


def test_engine_mean_score_matches_reference(tiny):
    model, tok = tiny
    st = ScoringSettings(**SMALL, calibration="pmi", score="mean")
    got = list(ICQSScorer(model, tok, GOOD, BAD, st).score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, st)
    for g, r in zip(got, ref, strict=True):
        assert g.score_kind == "mean" and 0.0 <= g.score <= 1.0
        assert abs(g.score - r.score) < 1e-4
        assert g.score == pytest.approx(icqs_scores(g.loglik_calibrated, g.ratios, "mean")[0],
                                        abs=1e-6)


def test_settings_fingerprint_and_validation():
    s = ScoringSettings()
    assert (s.calibration, s.score, s.pmi_premise) == ("none", "mean", None)
    fp = s.fingerprint()
    for k in ("calibration", "content_free", "pmi_premise", "score"):
        assert k in RESULT_FIELDS and k in fp
    assert fp["content_free"] == ["N/A", "", "[MASK]"]
    for change in (dict(calibration="pmi"), dict(score="argmax"), dict(content_free=["N/A"]),
                   dict(pmi_premise="The answer is:")):
        assert s.replace(**change).fingerprint() != fp
    assert ScoringSettings.from_dict(s.replace(content_free=["x"]).fingerprint()).content_free \
        == ("x",)
    for bad in (dict(calibration="zhao"), dict(score="max"), dict(content_free=[]),
                dict(content_free="N/A"), dict(pmi_premise=3)):
        with pytest.raises(ValueError):
            ScoringSettings(**bad)
    assert s.premise() == "Answer:"
    nli = Template(demo="Premise: {x}\nHypothesis: {y}\n", query="Premise: {x}\nHypothesis:")
    assert s.replace(template=nli).premise() == "Hypothesis:"
    assert [x for _, x in calibration_queries(s.replace(calibration="content_free"))] == \
        ["N/A", "", "[MASK]"]
    assert calibration_queries(s) == []


def test_score_cli_writes_raw_and_baseline(tmp_path, tiny, tiny_llama_dir):
    """``icqs-fast score --calibrate content_free --score mean``: each line keeps the raw loglik
    and the baseline, and its scores are those of their difference."""
    import json

    from icqs_fast.cli import main

    model_dir = tiny_llama_dir()

    def jsonl(name, rows):
        p = tmp_path / name
        p.write_text("".join(json.dumps({"x": x, "y": y}) + "\n" for x, y in rows))
        return p

    out = tmp_path / "out.jsonl"
    assert main(["score", str(jsonl("in.jsonl", RESPONSES)), "-o", str(out), "--good",
                 str(jsonl("g.jsonl", GOOD)), "--bad", str(jsonl("b.jsonl", BAD)), "--model",
                 str(model_dir), "--num-ratios", "3", "--demos-per-set", "4",
                 "--sets-per-ratio", "2", "--calibrate", "content_free", "--score", "mean",
                 "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(RESPONSES)
    for r in rows:
        ll = torch.tensor(r["loglik"], dtype=torch.float64)
        base = torch.tensor(r["loglik_baseline"], dtype=torch.float64)
        s, per = icqs_scores(ll - base, r["ratios"], "mean")
        assert abs(s - r["score"]) < 1e-5 and max(abs(a - b) for a, b in
                                                  zip(per, r["score_per_set"], strict=True)) < 1e-5
    from icqs_fast.io.runs import meta_path

    meta = json.loads(meta_path(out).read_text())
    assert "content_free" in json.dumps(meta) and "mean" in json.dumps(meta)
    # One content-free input (--content-free, repeatable): its own baseline, in the settings;
    # a resume with other inputs is refused.
    out1 = tmp_path / "one.jsonl"
    argv = [str(jsonl("in.jsonl", RESPONSES)), "--good", str(tmp_path / "g.jsonl"), "--bad",
            str(tmp_path / "b.jsonl"), "--model", str(model_dir), "--num-ratios", "3",
            "--demos-per-set", "4", "--sets-per-ratio", "2", "--calibrate", "content_free",
            "--quiet"]
    assert main(["score", "-o", str(out1), *argv, "--content-free", "N/A"]) == 0
    one = [json.loads(line) for line in out1.read_text().splitlines()]
    assert json.loads(meta_path(out1).read_text())["content_free"] == ["N/A"]
    # The raw log-likelihoods whatever the content-free inputs (within fp32 rounding: the
    # baseline rows may share a padded forward with them).
    assert all(sum(r["loglik"], []) == pytest.approx(sum(w["loglik"], []), rel=1e-6, abs=1e-5)
               for r, w in zip(one, rows, strict=True))
    assert any(r["loglik_baseline"] != w["loglik_baseline"] for r, w in zip(one, rows,
                                                                             strict=True))
    assert main(["score", "-o", str(out1), *argv, "--content-free", "None", "--resume"]) == 2


@pytest.mark.slow
def test_bench_icqs_calibrate_records_the_overhead():
    from icqs_fast.benchmarks import icqs as bench_icqs

    rec = bench_icqs.bench(2, "cpu", random_weights=True, config="tiny", measure_memory=False,
                           settings=dict(num_ratios=2, demos_per_set=2, sets_per_ratio=2),
                           cold_repeats=1, calibrate="content_free")
    assert rec["calibration"] == "content_free" and rec["calibration_overhead"] > 0
    # Both headlines' answers are labels: each (query, answer) pair once per context.
    assert 0 < rec["calibration_rows"] <= 3 * 2 * 4
    # The calibrated engine is checked against the reference, and the check is pass/fail.
    assert rec["max_abs_baseline_diff"] <= 1e-4 and rec["calibrated_score_agreement"] == 1.0
    assert set(bench_icqs.checks(calibrated=True)) >= {"max_abs_baseline_diff_per_token",
                                                        "calibrated_score_agreement"}
    from icqs_fast.benchmarks import check_fields

    bad = dict(rec, calibrated_score_agreement=0.5)
    assert check_fields(bad, bench_icqs.checks(calibrated=True)) == [
        "calibrated_score_agreement = 0.5 (want == 1.0)"]


@pytest.mark.slow
def test_bench_icqs_free_text_answers_share_no_baseline():
    """``--answers free-text``: a distinct answer per response, so every response adds its own
    baseline rows (3 content-free inputs x 4 contexts each)."""
    from icqs_fast.benchmarks import icqs as bench_icqs

    resp = bench_icqs.responses(4, "free-text")
    assert len({y for _, y in resp}) == 4 and all(len(y.split()) > 8 for _, y in resp)
    rec = bench_icqs.bench(3, "cpu", random_weights=True, config="tiny", measure_memory=False,
                           settings=dict(num_ratios=2, demos_per_set=2, sets_per_ratio=2),
                           cold_repeats=1, calibrate="content_free", answers="free-text")
    assert rec["answers"] == "free-text" and rec["calibration_rows"] == 3 * 3 * 4
    assert rec["max_abs_baseline_diff"] <= 1e-4 and rec["calibrated_score_agreement"] == 1.0
    with pytest.raises(ValueError, match="--answers"):
        bench_icqs.responses(2, "sentences")


@pytest.mark.slow
def test_eval_fpb_compare_and_pool_end_to_end(tmp_path, capsys, tiny_llama_dir):
    """``eval fpb --compare --json``: every calibration x score variant from one run, the
    selected one (--calibrate/--score) in the main table; ``--pool-json`` pools two runs."""
    import json

    from test_study import _write_fpb

    from icqs_fast.cli import main
    from icqs_fast.evals.calibration_study import VARIANTS

    model_dir = tiny_llama_dir()
    _write_fpb(tmp_path)
    docs = []
    for seed in (0, 1):
        argv = ["eval", "fpb", "--data", str(tmp_path), "--model", str(model_dir), "--limit",
                "2", "--pool", "2", "--demos-per-set", "2", "--num-ratios", "3", "--sets", "2",
                "--n-boot", "30", "--no-baselines", "--compare", "--calibrate", "pmi",
                "--score", "mean", "--seed", str(seed), "--json", "--quiet"]
        assert main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["settings"]["calibration"] == "pmi" and doc["settings"]["score"] == "mean"
        cmp = doc["compare"]
        assert list(cmp["variants"]) == VARIANTS
        for name in VARIANTS:
            v = cmp["variants"][name]
            a = v["auc_correct_vs_incorrect"]["icqs_epistemic"]
            assert a["value"] is None or 0.0 <= a["value"] <= 1.0
            assert "auc_semantic_vs_labeled_neutral" in v
            assert set(v["accuracy"]) == {"correct", "incorrect", "labeled_neutral",
                                          "semantic_neutral"}
        # The selected variant is the one the main table reports.
        sel = cmp["variants"]["pmi/mean"]["accuracy"]
        for g in sel:
            assert sel[g]["icqs_epistemic"] == pytest.approx(doc["groups"][g]["icqs_epistemic"])
        # none/argmax and none/mean share the raw log-likelihoods: means differ, argmax is
        # the ratio grid.
        ep = cmp["items"]["none/argmax"]["correct"]["icqs_epistemic"]
        assert all(s in (0.0, 0.5, 1.0) for s in ep)
        p = tmp_path / f"s{seed}.json"
        p.write_text(json.dumps(doc))
        docs.append(p)
    assert main(["eval", "fpb", "--pool-json", ",".join(map(str, docs)), "--n-boot", "30",
                 "--plot", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert "2 runs pooled" in out and "content_free/mean" in out and "pmi/argmax" in out
    assert (tmp_path / "fig" / "calibration_fpb_unstratified.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_chaosnli_compare_end_to_end(tmp_path, capsys, tiny_llama_dir):
    import json

    from test_study import _write_chaosnli

    from icqs_fast.cli import main
    from icqs_fast.evals.calibration_study import VARIANTS
    from icqs_fast.evals.study_metrics import mae

    model_dir = tiny_llama_dir()
    _write_chaosnli(tmp_path / "chaosNLI_snli.jsonl", n_each=3)
    base = ["eval", "chaosnli", "--data", str(tmp_path), "--model", str(model_dir), "--pool",
            "2", "--demos-per-set", "2", "--num-ratios", "3", "--sets", "2", "--n-boot", "30",
            "--no-baselines", "--compare", "--quiet"]
    docs = []
    for seed in (0, 1):
        assert main(base + ["--json", "--seed", str(seed)]) == 0
        doc = json.loads(capsys.readouterr().out)
        cmp = doc["compare"]
        assert list(cmp["variants"]) == VARIANTS
        for row in cmp["variants"].values():
            for m in ("icqs", "icqs_epistemic"):
                assert 0.0 <= row[m]["mae"]["value"] <= 2 / 3
        # The uncalibrated argmax variant is what the main table reports.
        assert cmp["variants"]["none/argmax"]["icqs_epistemic"]["mae"]["value"] == \
            pytest.approx(doc["icqs_epistemic"]["mae"])
        # The items reproduce the metrics (what --pool-json pools).
        human = np.asarray(cmp["items"]["human"])
        for name in VARIANTS:
            p = np.asarray(cmp["items"]["pred"][name]["icqs_epistemic"])
            assert p.shape == human.shape == (doc["n"], 3)
            assert np.allclose(p.sum(1), 1.0)
            assert mae(p, human) == pytest.approx(
                cmp["variants"][name]["icqs_epistemic"]["mae"]["value"])
        path = tmp_path / f"nli{seed}.json"
        path.write_text(json.dumps(doc))
        docs.append((path, doc))
    assert main(base) == 0
    assert "content_free/mean" in capsys.readouterr().out
    # Pooled: the metrics of the concatenated items; none/argmax's difference from itself is 0.
    pooled = ",".join(str(p) for p, _ in docs)
    assert main(["eval", "chaosnli", "--pool-json", pooled, "--n-boot", "30", "--json"]) == 0
    pl = json.loads(capsys.readouterr().out)
    human = np.concatenate([np.asarray(d["compare"]["items"]["human"]) for _, d in docs])
    p = np.concatenate([np.asarray(d["compare"]["items"]["pred"]["pmi/mean"]["icqs"])
                        for _, d in docs])
    assert pl["n"] == len(human) == 2 * docs[0][1]["n"]
    assert pl["variants"]["pmi/mean"]["icqs"]["mae"]["value"] == pytest.approx(mae(p, human))
    d0 = pl["variants"]["none/argmax"]["icqs"]["difference_vs_none_argmax"]
    assert all(d0[k]["value"] == 0.0 for k in ("mae", "ce", "spearman"))
    assert main(["eval", "chaosnli", "--pool-json", pooled, "--n-boot", "30", "--plot",
                 str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert "2 runs pooled" in out and "pmi/argmax" in out and "dspearman" in out
    png = tmp_path / "fig" / "calibration_chaosnli.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    # Runs that differ in more than the seed are not one sample: refused, naming the setting.
    other = dict(docs[1][1], settings=dict(docs[1][1]["settings"], num_ratios=4))
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["eval", "chaosnli", "--pool-json", f"{docs[0][0]},{tmp_path / 'other.json'}"]
                ) == 2
    assert "num_ratios" in capsys.readouterr().err
    # A document of another dataset is refused (exit 2), naming the file.
    assert main(["eval", "fpb", "--pool-json", str(docs[0][0])]) == 2
    assert "nli0.json" in capsys.readouterr().err
