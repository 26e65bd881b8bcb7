"""Judge bias statistics (icqs_fast.allure.bias): hand-computed values on small fixed inputs,
equality with scikit-learn / scipy, the bootstrap intervals, the order-averaged verdict's
order invariance, the both-orders scoring in the loop, and `audit --task llmbar` end to end."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import pointbiserialr, spearmanr
from sklearn.metrics import cohen_kappa_score, confusion_matrix

from icqs_fast.allure import LLMBAR_TASK, AcceptAll, AuditRecord, Judgment, audit, custom_task
from icqs_fast.allure import bias as B
from icqs_fast.allure.evaluators import OrderAveragedEvaluator, evaluate_both_orders
from icqs_fast.allure.studies import round_bias

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRUTH = list("AABBA")
FWD = list("AABBA")  # given order
SWP = list("ABBAB")  # swapped order, mapped back: flips on pairs 1, 3, 4


def test_flip_rate_and_first_position_by_hand():
    jb = B.judge_bias(B.Verdicts(TRUTH, FWD, ["A", "B"], pairwise=True, swapped=SWP))
    s = jb.swap
    assert s.n_pairs == 5 and s.flips == 3 and s.flip_rate.estimate == pytest.approx(0.6)
    # First position chosen: given order A on 3 pairs, swapped order (mapped back) B on 3
    # pairs (its first output is the original second one): 6 of 10 verdicts.
    assert s.first_position_rate.estimate == pytest.approx(0.6)
    assert s.debiased is None  # no probabilities: no order-averaged verdict
    assert jb.length is None and any("no lengths" in n for n in jb.notes)
    # A judge that always picks the first position flips on every pair.
    always = B.judge_bias(B.Verdicts(TRUTH, ["A"] * 5, ["A", "B"], pairwise=True,
                                     swapped=["B"] * 5))
    assert always.swap.flip_rate.estimate == 1.0 and always.swap.first_position_rate.estimate == 1
    assert (always.swap.flip_rate.lo, always.swap.flip_rate.hi) == (1.0, 1.0)


def test_kappa_confusion_and_correlations_equal_sklearn_scipy():
    rng = np.random.default_rng(3)
    n = 40
    truth = list(rng.choice(["A", "B"], n))
    verdict = [t if rng.random() < 0.7 else ("B" if t == "A" else "A") for t in truth]
    length = rng.normal(0, 100, n).round()
    score = rng.random(n)
    jb = B.judge_bias(B.Verdicts(truth, verdict, ["A", "B"], score=list(score), pairwise=True,
                                 length=list(length)), n_resamples=200)
    a = jb.agreement
    assert a.kappa.estimate == pytest.approx(cohen_kappa_score(truth, verdict))
    assert a.confusion == confusion_matrix(truth, verdict, labels=["A", "B"]).tolist()
    assert a.accuracy.estimate == pytest.approx(np.mean(np.array(truth) == np.array(verdict)))
    chose = np.array([v == "A" for v in verdict], dtype=float)
    assert jb.length.point_biserial.estimate == pytest.approx(pointbiserialr(chose, length)[0])
    assert jb.length.spearman.estimate == pytest.approx(spearmanr(score, length)[0])
    ok = length != 0
    assert jb.length.longer_preferred_rate.estimate == pytest.approx(
        np.mean((chose == (length > 0))[ok]))
    assert jb.swap is None and any("not judged in the swapped order" in x for x in jb.notes)
    # The vectorised per-resample statistics equal the library ones row by row.
    t = np.array([v == "B" for v in truth], dtype=np.int64)
    p = np.array([v == "B" for v in verdict], dtype=np.int64)
    idx = rng.integers(0, n, size=(20, n))
    rows = B._kappa_rows(t[idx], p[idx], 2)
    for i in range(20):
        want = cohen_kappa_score(t[idx[i]], p[idx[i]]) if len(set(t[idx[i]]) | set(p[idx[i]])) > 1 \
            else math.nan
        assert rows[i] == pytest.approx(want, nan_ok=True)
    r = B._spearman_rows(score[idx], length[idx])
    assert r == pytest.approx([spearmanr(score[j], length[j])[0] for j in idx])


def test_interval_contains_estimate_narrows_with_n_and_is_seeded():
    truth = list("AABBABABBA")
    verdict = list("AABABABBBA")
    length = [30, -10, 5, -40, 12, 8, -3, -25, 16, 2]
    widths = []
    for k in (1, 4, 16):
        v = B.Verdicts(truth * k, verdict * k, ["A", "B"], pairwise=True, swapped=verdict[::-1] * k,
                       length=length * k)
        jb = B.judge_bias(v, n_resamples=1000, seed=0)
        for iv in (jb.agreement.kappa, jb.agreement.accuracy, jb.swap.flip_rate,
                   jb.length.point_biserial):
            assert iv.finite() and iv.lo <= iv.estimate <= iv.hi and iv.level == 0.95
        widths.append(jb.agreement.kappa.hi - jb.agreement.kappa.lo)
        assert jb.to_json() == B.judge_bias(v, n_resamples=1000, seed=0).to_json()  # seeded
    assert widths[0] > widths[1] > widths[2]


def test_undefined_statistics_and_non_pairwise():
    # A constant verdict: kappa 0, the point-biserial correlation undefined (a note says so).
    jb = B.judge_bias(B.Verdicts(list("0101"), ["1"] * 4, ["1", "0"], score=[.9, .8, .7, .95],
                                 length=[10, 20, 30, 40]))
    assert jb.swap is None and any("not a pairwise judge" in n for n in jb.notes)
    assert math.isnan(jb.length.point_biserial.estimate)
    assert any("point-biserial undefined" in n for n in jb.notes)
    assert jb.length.longer_preferred_rate is None and jb.length.spearman.finite()
    assert jb.agreement.kappa.estimate == 0.0
    with pytest.raises(ValueError, match="pairwise"):
        B.Verdicts(list("01"), list("01"), ["0", "1"], swapped=list("01"))
    with pytest.raises(ValueError, match="not one of"):
        B.Verdicts(list("01"), list("02"), ["0", "1"])
    with pytest.raises(ValueError, match="no records"):
        B.judge_bias(B.Verdicts([], [], ["0", "1"]))


def test_order_average_is_order_invariant():
    rng = np.random.default_rng(0)
    for f0, s0 in rng.random((500, 2)):
        f, s = (f0, 1 - f0), (s0, 1 - s0)
        lab, p = B.order_average(f, s, ["A", "B"], first_wins_tie=False)
        # The same pair given in the other order: its given order is the original swapped one
        # and vice versa, each with the outputs' roles exchanged.
        lab2, p2 = B.order_average(s[::-1], f[::-1], ["A", "B"], first_wins_tie=True)
        assert lab2 == ("B" if lab == "A" else "A") and p2 == pytest.approx(1 - p)
        assert p == pytest.approx((f0 + s0) / 2)
    # A position-only judge: an exact tie, which follows the rule given (evaluators.
    # order_averaged: the outputs' texts).
    x = 1 / (1 + math.exp(-1.0))
    assert B.order_average((x, 1 - x), (1 - x, x), ["A", "B"]) == ("A", pytest.approx(0.5))
    assert B.order_average((x, 1 - x), (1 - x, x), ["A", "B"], first_wins_tie=False)[0] == "B"


# --------------------------------------------------------------------------- both orders


class PositionBiasedJudge:
    """A fake pairwise judge: P(A) = sigmoid(quality(output_1) - quality(output_2) + BIAS), the
    quality being the count of "good" in an output; BIAS favours the first position. Pairs of
    equal quality are judged by position only: their order-averaged P(A) is 0.5, a tie."""

    spec = LLMBAR_TASK
    BIAS = 0.5

    def describe(self):
        return "position-biased fake"

    def evaluate(self, records, memory, *, progress=None):
        out = []
        for r in records:
            q = r.fields["output_1"].count("good") - r.fields["output_2"].count("good")
            pa = 1 / (1 + math.exp(-(q + self.BIAS)))
            out.append(Judgment("A" if pa >= 0.5 else "B", {"A": pa, "B": 1 - pa},
                                {"A": math.log(pa), "B": math.log(1 - pa)}, {"f": pa}))
        if progress is not None:
            progress(len(records))
        return out


def _pairs(n):
    out = []
    for i in range(n):
        g1, g2 = i % 3, (i * 2) % 3
        out.append(AuditRecord(f"p{i}", {"instruction": f"task {i}",
                                         "output_1": "good " * g1 + "x" * (i % 4),
                                         "output_2": "good " * g2},
                               "A" if g1 >= g2 else "B"))
    return out


def test_debiased_verdict_is_order_invariant_and_swap_is_counted():
    judge = PositionBiasedJudge()
    recs = _pairs(12)
    deb = OrderAveragedEvaluator(judge)
    a = deb.evaluate(recs, [])
    b = deb.evaluate([LLMBAR_TASK.swapped(r) for r in recs], [])
    for r, ja, jb_ in zip(recs, a, b, strict=True):
        if r.fields["output_1"] == r.fields["output_2"]:
            continue  # identical outputs: both labels name the same text
        assert jb_.label == LLMBAR_TASK.swap_label(ja.label)  # names the same output
        assert jb_.probs["A"] == pytest.approx(ja.probs["B"])
    # Equal-quality pairs: the biased judge says A in both orders, i.e. flips.
    both = evaluate_both_orders(judge, recs, [])
    flips = sum(j.orders[0].label != j.orders[1].label for j in both)
    want = sum(r.fields["output_1"].count("good") == r.fields["output_2"].count("good")
               for r in recs)
    assert flips == want > 0
    # In the loop: held-out pairs judged in both orders, per round, and the statistics of it.
    ticks = []
    res = audit(judge, recs[:6], recs[6:], rounds=0, auditor=AcceptAll(), swap=True,
                progress=lambda d, n: ticks.append)
    rnd = res.rounds[0]
    assert set(rnd.heldout_orders) == {r.id for r in recs[6:]}
    jb = round_bias(LLMBAR_TASK, recs[6:], rnd, n_resamples=100)
    assert jb.swap.flips == sum(j.orders[0].label != j.orders[1].label for j in both[6:])
    assert jb.swap.debiased is not None and jb.length is not None
    # Not pairwise: the swap is refused; round_bias reports its absence without crashing.
    spec = custom_task()
    with pytest.raises(ValueError, match="not pairwise"):
        spec.swapped(AuditRecord("x", {"task": "t", "response": "r"}, "1"))
    res2 = audit(judge, recs[:6], recs[6:], rounds=0, auditor=AcceptAll(), swap=False)
    assert res2.rounds[0].heldout_orders == {}
    assert round_bias(LLMBAR_TASK, recs[6:], res2.rounds[0], n_resamples=50).swap is None


@pytest.mark.subprocess
def test_bias_module_imports_no_torch():
    code = ("import importlib.util, sys\n"
            "s = importlib.util.spec_from_file_location('bias', 'icqs_fast/allure/bias.py')\n"
            "m = sys.modules['bias'] = importlib.util.module_from_spec(s)\n"
            "s.loader.exec_module(m)\n"
            "m.judge_bias(m.Verdicts(list('AB'), list('AA'), ['A', 'B']), n_resamples=10)\n"
            "assert 'torch' not in sys.modules\n")
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# --------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from icqs_fast import models

    d = tiny_llama_dir(layers=1, max_positions=2048)
    return d, models.load_model(d, dtype="float32", device="cpu")


@pytest.mark.slow
def test_cli_audit_llmbar_reports_judge_bias(tiny, tmp_path, monkeypatch, capsys):
    from icqs_fast import models
    from icqs_fast.allure.data import default_path
    from icqs_fast.cli import main

    data = default_path("llmbar")
    if not data.is_file():
        pytest.skip(f"LLMBar data not found at {data} (../shared/data)")
    model_dir, loaded = tiny
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded)
    base = ["audit", "--task", "llmbar", "--model", str(model_dir), "--limit", "6", "--rounds",
            "0", "--quiet", "--sweep-seeds", "0", "--clusters", "0", "--attn-items", "0",
            "--bootstrap", "200"]
    assert main(base + ["--json", "--plot", str(tmp_path / "plots")]) == 0
    rep = json.loads(capsys.readouterr().out)
    jb = rep["judge_bias"]
    assert jb["round"] == 0 and jb["n"] == rep["n_heldout"] == 3 and rep["debias"] is False
    for iv in (jb["swap"]["flip_rate"], jb["swap"]["first_position_rate"],
               jb["agreement"]["accuracy"], jb["length"]["human_point_biserial"]):
        assert all(isinstance(iv[k], float) and math.isfinite(iv[k])
                   for k in ("estimate", "lo", "hi")), iv
    assert 0 <= jb["swap"]["flips"] <= 3 and jb["n_resamples"] == 200
    for key in ("kappa", "confusion"):
        assert key in jb["agreement"] and key in jb["swap"]["debiased"]
    assert {"point_biserial", "spearman", "longer_preferred_rate"} <= set(jb["length"])
    assert rep["rounds"][0]["bias"]["flip_rate"][0] == jb["swap"]["flip_rate"]["estimate"]
    assert (tmp_path / "plots" / "bias.png").stat().st_size > 0
    # Text report, with the order-averaged verdict as the evaluator's.
    assert main(base + ["--debias"]) == 0
    out = capsys.readouterr().out
    assert "position swap: flip rate " in out and "order-averaged verdict (used)" in out
    assert "length bias (length(output 1) - length(output 2), characters)" in out
    assert "agreement with human labels: kappa " in out and "95% percentile bootstrap" in out
    assert "averaged over both orders" in out
    # --debias on a task that is not pairwise is refused (exit 2).
    assert main(["audit", "--task", "summeval", "--debias", "--model", str(model_dir),
                 "--quiet"]) == 2
