"""The ICQS study (icqs_fast.evals.study, `icqs-fast eval fpb|sst2|chaosnli`): group construction,
the ChaosNLI distribution rule and metrics on hand-checked cases, the synthetic-LLM ranking
with fake scorers, and tiny end-to-end runs on a random Llama and generated data."""

import json
import math

import numpy as np
import pytest

from icqs_fast import metrics
from icqs_fast.evals import study, study_data, study_metrics
from icqs_fast.io import datasets
from icqs_fast.io.records import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FPB_ROWS = [  # (sentence, gold)
    ("Profit rose 10 %.", "positive"), ("Sales fell.", "negative"),
    ("Orders grew strongly.", "positive"), ("The loss widened.", "negative"),
    ("The company is based in Espoo.", "neutral"), ("Margins improved.", "positive"),
    ("Revenue dropped 5 %.", "negative"), ("The CEO is Jane Doe.", "neutral"),
    ("The report is due in May.", "neutral"),
]


# --------------------------------------------------------------------------- groups


def test_sentiment_groups_fpb_hand_checked():
    groups, polar = study_data.sentiment_groups(FPB_ROWS, limit=4, seed=3, neutral=True)
    assert set(groups) == set(study_data.SENTIMENT_GROUPS)
    gold = dict(FPB_ROWS)
    # 4 polar sentences, two of each label (balanced), the same in the three polar groups.
    xs = [r.x for r in groups["correct"]]
    assert len(xs) == 4 and len(set(xs)) == 4
    assert sorted(gold[x] for x in xs) == ["negative", "negative", "positive", "positive"]
    assert [r.x for r in groups["incorrect"]] == xs == [r.x for r in groups["labeled_neutral"]]
    flip = {"positive": "negative", "negative": "positive"}
    for r in groups["correct"]:
        assert (r.y, r.expected, r.gold) == (gold[r.x], True, gold[r.x])
    for r in groups["incorrect"]:
        assert (r.y, r.expected) == (flip[gold[r.x]], False)
    for r in groups["labeled_neutral"]:
        assert (r.y, r.expected) == ("neutral", False)
    # All 3 neutral sentences (limit 4 > 3), labelled neutral, judged correct.
    sem = groups["semantic_neutral"]
    assert sorted(r.x for r in sem) == sorted(x for x, y in FPB_ROWS if y == "neutral")
    assert all(r.y == "neutral" and r.expected for r in sem)
    assert all(r.candidates == ("positive", "negative", "neutral")
               for g in groups.values() for r in g)
    assert [p[0] for p in polar] == xs
    # Seeded: the same call gives the same groups.
    assert study_data.sentiment_groups(FPB_ROWS, limit=4, seed=3, neutral=True)[0] == groups


def test_sentiment_groups_sst2_and_synonyms():
    rows = [(x, y) for x, y in FPB_ROWS if y != "neutral"]
    groups, _ = study_data.sentiment_groups(rows, limit=None, seed=0, neutral=False,
                                       labels="synonyms")
    assert set(groups) == {"correct", "incorrect"}
    assert len(groups["correct"]) == 6
    pairs = {("good", "bad"), ("happy", "sad")}
    for c, i in zip(groups["correct"], groups["incorrect"], strict=True):
        pos, neg = c.candidates
        assert (pos, neg) in pairs and i.candidates == c.candidates
        want = pos if c.gold == "positive" else neg
        assert c.y == want and i.y == (neg if want == pos else pos)
    with pytest.raises(ValueError, match="labels"):
        study_data.sentiment_groups(rows, limit=2, seed=0, neutral=False, labels="other")


def test_polar_pools():
    good, bad, rest = study_data.polar_pools(FPB_ROWS, n_good=2, n_bad=2, seed=1)
    gold = dict(FPB_ROWS)
    assert all(gold[x] == y for x, y in good)
    assert all(gold[x] != y and y in ("positive", "negative") for x, y in bad)
    # Each pool alternates the labels; pools and rest are disjoint and cover the data.
    assert sorted(y for _, y in good) == ["negative", "positive"]
    used = {x for x, _ in good + bad}
    assert len(used) == 4 and not used & {x for x, _ in rest}
    assert len(rest) == len(FPB_ROWS) - 4
    with pytest.raises(ValueError, match="need 8"):
        study_data.polar_pools(FPB_ROWS, n_good=4, n_bad=4, seed=0)


def test_read_sst2(tmp_path):
    p = tmp_path / "dev.tsv"
    p.write_text("sentence\tlabel\ngreat film .\t1\nawful .\t0\n")
    assert datasets.read_sst2(p) == [(2, "great film .", "positive"), (3, "awful .", "negative")]
    p.write_text("sentence\tlabel\ngreat film .\t1\nawful .\t2\n")
    with pytest.raises(InputError, match=r"dev.tsv:3: field 'label'") as e:
        datasets.read_sst2(p)
    assert (e.value.line, e.value.field) == (3, "label")
    p.write_text("text\tlabel\nx\t1\n")
    with pytest.raises(InputError, match="'sentence'"):
        datasets.read_sst2(p)


# --------------------------------------------------------------------------- ChaosNLI


def test_tent_and_distributions_hand_checked():
    np.testing.assert_allclose(study_metrics.tent([1.0, 0.0, 0.5, 0.75, 0.25]),
                               [[1, 0, 0], [0, 0, 1], [0, 1, 0], [.5, .5, 0], [0, .5, .5]])
    np.testing.assert_allclose(study_metrics.icqs_distribution([1.0, 0.5]), [.5, .5, 0])
    np.testing.assert_allclose(study_metrics.icqs_distribution([1.0, 0.0, 0.0, 0.5]),
                               [.25, .25, .5])
    # mean_l loglik = [log 1, log 1, log 2] (with an offset) -> q = [.25, .25, .5]
    ll = np.array([[-3.0, -1.0], [-2.5, -1.5], [-2.0 + math.log(2), -2.0 + math.log(2)]])
    np.testing.assert_allclose(study_metrics.epistemic_distribution(ll, [0.0, 0.5, 1.0]),
                               [.5, .25, .25])
    with pytest.raises(ValueError):
        study_metrics.tent(1.5)
    with pytest.raises(ValueError):
        study_metrics.epistemic_distribution(ll, [0.0, 1.0])


def test_distribution_metrics_hand_checked():
    p = np.array([[1, 0, 0], [0, 0, 1], [.5, .5, 0]], dtype=float)
    h = np.array([[.5, .5, 0], [0, 0, 1], [.2, .8, 0]], dtype=float)
    m = study_metrics.distribution_metrics(p, h, n_boot=50)
    assert m["mae"]["value"] == pytest.approx((1.0 + 0 + 0.6) / 9)
    big, small = 0.99 + 0.01 / 3, 0.01 / 3
    half = 0.99 * 0.5 + 0.01 / 3
    ce = [-(.5 * math.log(big) + .5 * math.log(small)), -math.log(big),
          -(.2 * math.log(half) + .8 * math.log(half))]
    assert m["ce"]["value"] == pytest.approx(sum(ce) / 3)
    # p_e - p_c = [1, -1, .5], h_e - h_c = [.5, -1, .2]: same order -> rho 1
    assert m["spearman"]["value"] == pytest.approx(1.0)
    for v in m.values():
        assert v["lo"] <= v["value"] + 1e-12 or math.isnan(v["lo"])
    # h_e - h_c = [.5, -.7, .9] (ranks 2 1 3), p_e - p_c = [.3, -.5, .1] (ranks 3 1 2):
    # rho = 1 - 6 * 2 / (3 * 8) = 0.5
    h2 = np.array([[.5, .5, 0], [.1, .1, .8], [.9, .1, 0]])
    p2 = np.array([[.5, .3, .2], [.1, .3, .6], [.4, .3, .3]])
    assert study_metrics.distribution_metrics(p2, h2, n_boot=20)["spearman"]["value"] == \
        pytest.approx(0.5)
    with pytest.raises(ValueError):
        study_metrics.distribution_metrics(p[:, :2], h[:, :2])


def _chaos_line(uid, dist, maj, prem="A man runs.", hyp="A person moves."):
    return json.dumps({"uid": uid, "label_dist": dist, "majority_label": maj,
                       "example": {"uid": uid, "premise": prem, "hypothesis": hyp}})


def _write_chaosnli(path, n_each=4):
    lines = []
    for k in range(n_each):
        lines.append(_chaos_line(f"e{k}", [0.8, 0.1, 0.1], "e", f"A dog {k} runs.",
                                 "An animal moves."))
        lines.append(_chaos_line(f"n{k}", [0.2, 0.6, 0.2], "n", f"A girl {k} sings.",
                                 "She is on stage."))
        lines.append(_chaos_line(f"c{k}", [0.0, 0.1, 0.9], "c", f"A cat {k} sleeps.",
                                 "The cat is running."))
    path.write_text("\n".join(lines) + "\n")


def test_chaosnli_read_and_split(tmp_path):
    p = tmp_path / "chaosNLI_snli.jsonl"
    _write_chaosnli(p)
    d = study_data.chaosnli_data(p, pool=2, limit=None, seed=0)
    assert [it.majority for it in d.good] == ["e", "e"]
    assert [it.majority for it in d.bad] == ["c", "c"]
    pools = {it.uid for it in d.good + d.bad}
    assert len(d.test) == 8 and not pools & {it.uid for it in d.test}
    lim = study_data.chaosnli_data(p, pool=2, limit=1, seed=0)
    assert sorted(it.majority for it in lim.test) == ["c", "e", "n"]
    p.write_text(_chaos_line("x", [0.5, 0.6, 0.1], "e") + "\n")
    with pytest.raises(InputError, match="label_dist"):
        datasets.read_chaosnli(p)
    p.write_text(_chaos_line("x", [0.5, 0.4, 0.1], "q") + "\n")
    with pytest.raises(InputError, match=r":1: field 'majority_label'"):
        datasets.read_chaosnli(p)


# --------------------------------------------------------------------------- synthetic ranking


def _polar(n=8):
    labs = ["positive", "negative"]
    return [(f"s{k}", labs[k % 2], {"positive": "positive", "negative": "negative"})
            for k in range(n)]


def test_synthetic_answers_counts():
    ans = study_data.synthetic_answers(_polar(10), seed=4)
    assert ans.sum(axis=1).tolist() == [10, 8, 5, 3]  # round half up of 10 a


def test_synthetic_ranking_fake_scorers():
    polar = _polar(8)
    gold = {x: g for x, g, _ in polar}
    calls = []

    def oracle(pairs):
        calls.append(len(pairs))
        return [1.0 if y == gold[x] else 0.0 for x, y in pairs]

    r = study_metrics.synthetic_ranking(polar, oracle, seed=0, n_boot=100)
    assert calls == [16]  # every sentence's right and wrong answer, once
    assert [m["mean_score"] for m in r["models"]] == [1.0, 0.75, 0.5, 0.25]
    assert r["spearman"] == pytest.approx(1.0)
    # A scorer that prefers wrong answers ranks the models backwards.
    r = study_metrics.synthetic_ranking(
        polar, lambda ps: [0.4 if y == gold[x] else 0.6 for x, y in ps], seed=0, n_boot=20)
    assert r["spearman"] == pytest.approx(-1.0)
    assert r["models"][0]["mean_score"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="returned"):
        study_metrics.synthetic_ranking(polar, lambda ps: [0.0], n_boot=5)


def test_accuracy_with_ci():
    a = study_metrics.accuracy_with_ci([1, 1, 0, 1], n_boot=200, seed=0)
    assert a["value"] == 0.75 and a["n"] == 4 and 0.0 <= a["lo"] <= 0.75 <= a["hi"] <= 1.0
    assert study_metrics.icqs_item_accuracy([1.0, 0.25, 0.5, 0.0], True) == 0.5
    assert study_metrics.icqs_item_accuracy([1.0, 0.25, 0.5, 0.0], False) == 0.5
    assert study_metrics.icqs_item_accuracy([0.75, 0.75], False) == 0.0


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from _helpers import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("study_model"))


def _write_fpb(d):
    (d / "fpb").mkdir()
    lines = [f"{x}@{y}" for x, y in FPB_ROWS]
    lines += ["Net sales increased by 3 %.@positive", "Costs rose sharply.@negative",
              "Shares gained 2 %.@positive", "The unit was closed with losses.@negative"]
    (d / "fpb" / "Sentences_AllAgree.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_eval_fpb_json_end_to_end(tmp_path, tiny_model, capsys):
    from icqs_fast.cli import main
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.models import load_model

    _write_fpb(tmp_path)
    plots = tmp_path / "plots"
    argv = ["eval", "fpb", "--data", str(tmp_path), "--model", str(tiny_model), "--limit", "2",
            "--pool", "2", "--demos-per-set", "1,2", "--num-ratios", "3", "--sets", "2",
            "--n-boot", "50", "--json", "--quiet", "--plot", str(plots)]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dataset"] == "fpb" and doc["model"] == str(tiny_model) and doc["seconds"] > 0
    assert set(doc["groups"]) == set(study_data.SENTIMENT_GROUPS)
    for g, row in doc["groups"].items():
        assert set(row) == set(study.METHODS)
        assert all(0.0 <= v <= 1.0 for v in row.values())
        for m, (lo, hi) in doc["intervals"][g].items():
            assert lo <= row[m] + 1e-12 and row[m] <= hi + 1e-12
    assert doc["n"] == {"correct": 2, "incorrect": 2, "labeled_neutral": 2,
                        "semantic_neutral": 2}
    rho = doc["ranking"]["spearman"]
    assert rho is None or -1.0 <= rho <= 1.0
    assert [pt["demos_per_set"] for pt in doc["curve"]] == [1, 2]
    assert doc["curve"][-1]["groups"] == doc["groups"]
    # Independent check of the epistemic accuracies: the engine scored directly.
    data = study_data.fpb_data(tmp_path / "fpb" / "Sentences_AllAgree.txt", pool=2, limit=2, seed=0)
    model, tok = load_model(str(tiny_model))
    sc = ICQSScorer(model, tok, data.good, data.bad, num_ratios=3, demos_per_set=2,
                    sets_per_ratio=2, seed=0, drop_oldest_demos=True, stratify=None,
                    score="argmax")
    direct = {}
    for g, want_correct in (("correct", True), ("incorrect", False)):
        res = list(sc.score([(r.x, r.y) for r in data.groups[g]]))
        direct[g] = {"icqs_epistemic": [r.score for r in res],
                     "icqs": [float(np.mean(r.score_per_set)) for r in res]}
        acc = np.mean([(r.score >= 0.5) == want_correct for r in res])
        assert doc["groups"][g]["icqs_epistemic"] == pytest.approx(acc)
    # The AUC of correct vs incorrect and its interval: the engine's scores through the
    # stratified bootstrap, with the run's seed and --n-boot.
    sep = doc["separation"]
    for m in ("icqs_epistemic", "icqs"):
        c, i = direct["correct"][m], direct["incorrect"][m]
        want, lo, hi = metrics.auc_stratified_ci([1] * len(c) + [0] * len(i), c + i,
                                                 n_resamples=50, seed=0)
        assert sep["auc_correct_vs_incorrect"][m] == pytest.approx(
            metrics.auc([1] * len(c) + [0] * len(i), c + i))
        assert sep["auc_correct_vs_incorrect"][m] == pytest.approx(want)
        assert sep["auc_correct_vs_incorrect_interval"][m] == pytest.approx([lo, hi])
        assert lo <= want <= hi
    # The printed report carries the same interval.
    from icqs_fast.evals.study_report import label_report

    text = label_report(doc, tmp_path, datasets.eval_dataset("fpb"))
    line = next(t for t in text.splitlines() if t.startswith("AUC correct vs incorrect"))
    lo, hi = sep["auc_correct_vs_incorrect_interval"]["icqs"]
    assert f"icqs {sep['auc_correct_vs_incorrect']['icqs']:.3f} [{lo:.3f}, {hi:.3f}]" in line
    # Plots: real PNG files of some size.
    names = {p.name for p in plots.iterdir()}
    assert {"fpb_loglik.png", "fpb_hist.png", "fpb_curve_correct.png"} <= names
    for p in plots.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_eval_chaosnli_json_end_to_end(tmp_path, tiny_model, capsys):
    from icqs_fast.cli import main

    _write_chaosnli(tmp_path / "chaosNLI_snli.jsonl", n_each=3)
    argv = ["eval", "chaosnli", "--data", str(tmp_path), "--model", str(tiny_model),
            "--pool", "2", "--demos-per-set", "2", "--num-ratios", "3", "--sets", "2",
            "--n-boot", "30", "--json", "--quiet"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dataset"] == "chaosnli" and doc["n"] == 5
    for m in study.NLI_METHODS:
        assert set(doc[m]) >= {"mae", "ce", "spearman"}
        assert 0.0 <= doc[m]["mae"] <= 2 / 3 and 0.0 < doc[m]["ce"] <= math.log(300)


def test_eval_bad_input_exit_2(tmp_path, tiny_model, capsys):
    from icqs_fast.cli import main

    (tmp_path / "dev.tsv").write_text("sentence\tlabel\ngood .\t1\nbad .\tx\n")
    argv = ["eval", "sst2", "--data", str(tmp_path / "dev.tsv"), "--model", str(tiny_model)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "dev.tsv:3" in err and "'label'" in err
    assert main(["eval", "fpb", "--data", str(tmp_path / "nope")]) == 2
    assert main(["eval", "fpb", "--demos-per-set", "2,x"]) == 2


def test_make_scorer_stratified_sets(tiny_model):
    from collections import Counter

    from icqs_fast.models import load_model

    model, tok = load_model(str(tiny_model))
    good = [(f"g{k}", ("positive", "negative")[k % 2]) for k in range(8)]
    bad = [(f"b{k}", ("negative", "positive")[k % 2]) for k in range(8)]
    st = study.StudySettings(num_ratios=5, sets_per_ratio=3, seed=2, stratify=True)
    sc = study.make_scorer(model, tok, good, bad, 4, st)
    for row in sc.sets:
        for ds in row:
            # Every set: 2 positive + 2 negative demonstrations, whatever the ratio.
            assert Counter(y for _, y in ds.examples) == {"positive": 2, "negative": 2}
            assert ds.n_good == int(ds.ratio * 4 + 0.5)
    # The prompts the engine scores are those of the stratified sets.
    assert sc.tokens.prefix_ids(0)[-3:] == sc.tokens.encode(
        sc.template.format_prefix(sc.sets[0][0].examples))[-3:]


def test_study_scoring_settings():
    """The study's settings object: what make_scorer builds the engine from."""
    st = study.StudySettings(num_ratios=3, sets_per_ratio=2, seed=5, backend="torch")
    s = study.scoring_settings(4, st)
    assert (s.num_ratios, s.demos_per_set, s.sets_per_ratio, s.seed) == (3, 4, 2, 5)
    assert s.stratify is None and s.drop_oldest_demos and s.backend == "torch"
    assert study.scoring_settings(4, study.StudySettings(stratify=True)).stratify == "y"


def test_separation_auc_interval_uses_the_runs_seed_and_resamples():
    """The AUC of correct vs incorrect answers with its stratified bootstrap interval, from the
    study's per-item scores (hand-made here), seeded by the run's seed and --n-boot."""
    rng = np.random.default_rng(7)
    c, i = list(rng.uniform(0.3, 1.0, 15)), list(rng.uniform(0.0, 0.7, 12))

    def vals(s):
        return {"score": s, "score_per_set": [[v, v - 0.1] for v in s]}

    items = {"correct": vals(c), "incorrect": vals(i)}
    y = [1] * len(c) + [0] * len(i)
    sep = study._separation(items, False, n_boot=300, seed=3)
    want = metrics.auc(y, c + i)
    assert 0.7 < want < 1.0  # the two groups overlap: the interval has a width
    _, lo, hi = metrics.auc_stratified_ci(y, c + i, n_resamples=300, seed=3)
    for m in ("icqs_epistemic", "icqs"):  # the per-set mean is the score shifted: same ranks
        assert sep["auc_correct_vs_incorrect"][m] == pytest.approx(want)
        assert sep["auc_correct_vs_incorrect_interval"][m] == pytest.approx([lo, hi])
        assert lo < want < hi
    other = study._separation(items, False, n_boot=300, seed=4)
    assert other["auc_correct_vs_incorrect_interval"]["icqs"] != [lo, hi]
    assert other["auc_correct_vs_incorrect"] == sep["auc_correct_vs_incorrect"]
