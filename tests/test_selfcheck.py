"""The self-check from the demonstration pools: cross-fitting without leaks, the calibration map,
ECE / Brier, seeded intervals, the "too small" verdict, the JSON round trip and ``icqs-fast
check`` end to end (tiny random Llama, tiny settings)."""

import json
import math

import numpy as np
import pytest
import torch
from _helpers import save_tiny_llama, tiny_llama, write_jsonl
from _helpers import sentiment_pools as pools

from icqs_fast import metrics
from icqs_fast.engine.calibration import icqs_scores
from icqs_fast.engine.scorer import ICQSScorer, summarise
from icqs_fast.engine.selfcheck import (
    MIN_PER_CLASS,
    CalibrationMap,
    SelfCheck,
    clean_contexts,
    crossfit_heldout,
    crossfit_score,
    equal_error_threshold,
    fit_self_check,
    precision_threshold,
    run_self_check,
    select_heldout,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def synthetic(n: int, a: float, b: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Scores ~ U(0, 1) and labels ~ Bernoulli(sigmoid(a s + b)): a known calibration."""
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.0, 1.0, n)
    y = (rng.uniform(0.0, 1.0, n) < 1.0 / (1.0 + np.exp(-(a * s + b)))).astype(np.int64)
    return s, y


# --------------------------------------------------------------------------- cross-fitting


@pytest.fixture(scope="module")
def crossfit():
    model, tok = tiny_llama(device="cpu")
    good, bad = pools(24)
    sc = ICQSScorer(model, tok, good, bad, num_ratios=3, demos_per_set=4, sets_per_ratio=3,
                    seed=1)
    return sc, good, bad, crossfit_heldout(sc, good, bad, max_heldout=32, seed=0)


def test_no_heldout_item_is_scored_under_a_set_holding_it(crossfit):
    sc, good, bad, cf = crossfit
    assert len(cf.items) == 32 and cf.labels.tolist() == [1] * 16 + [0] * 16
    held_out_sets = 0
    for item, clean in zip(cf.items, cf.clean, strict=True):
        for j, row in enumerate(sc.sets):
            for li, s in enumerate(row):
                holds = any(x == item[0] for x, _ in s.examples)
                # A context is used exactly when its set holds no demonstration with the
                # item's input.
                assert bool(clean[j, li]) is (not holds), (item, j, li)
                held_out_sets += holds
    assert held_out_sets > 0  # the pools are small: some sets do hold held-out items


def test_crossfit_score_ignores_the_leaky_contexts():
    ratios = [0.0, 0.5, 1.0]
    gen = torch.Generator().manual_seed(0)
    ll = -5 + torch.randn(3, 4, generator=gen)
    clean = torch.tensor([[True, False, True, True], [False, True, True, False],
                          [True, True, False, True]])
    n = torch.zeros(3, 4, dtype=torch.long)
    for kind in ("mean", "argmax", "tied"):
        res = summarise(0, ll, ratios, 2, n, n, None, score_kind=kind)
        poisoned = ll.clone()
        poisoned[~clean] = 50.0  # what a leak would do: the held-out item's own context wins
        res_p = summarise(0, poisoned, ratios, 2, n, n, None, score_kind=kind)
        got = crossfit_score(res, clean)
        assert crossfit_score(res_p, clean) == got
        # The engine's own score function on the per-ratio means of the clean contexts.
        col = torch.stack([ll[j][clean[j]].double().mean() for j in range(3)])
        assert got == pytest.approx(icqs_scores(col[:, None], ratios, kind)[0], abs=1e-12)
        # Every context clean: the engine's score itself.
        assert crossfit_score(res, torch.ones(3, 4, dtype=torch.bool)) == \
            pytest.approx(res.score, abs=1e-12)
    no_clean = clean.clone()
    no_clean[1] = False
    assert math.isnan(crossfit_score(summarise(0, ll, ratios, 2, n, n, None), no_clean))


def test_crossfit_scores_with_every_context_equal_the_engine_scores(crossfit):
    sc, _, _, cf = crossfit
    full = [r.score for r in sc.score(cf.items)]
    assert np.allclose(cf.full_scores, full, atol=1e-9)
    all_clean = cf.clean.all(axis=(1, 2))
    assert np.allclose(cf.scores[all_clean], cf.full_scores[all_clean], atol=1e-9)


def test_leak_pair_drops_only_the_same_pair():
    good, bad = pools(24)
    sc_sets = [[type("S", (), {"examples": ((good[0][0], "negative"),)})()]]
    assert not clean_contexts(sc_sets, good[0], "input")[0, 0]
    assert clean_contexts(sc_sets, good[0], "pair")[0, 0]
    with pytest.raises(ValueError, match="leak"):
        clean_contexts(sc_sets, good[0], "x")


def test_heldout_draw_is_class_balanced_and_seeded():
    g, b = select_heldout(30, 50, 40, seed=3)
    assert len(g) == len(b) == 20 and g == sorted(g) and max(b) < 50
    assert select_heldout(30, 50, 40, seed=3) == (g, b)
    assert select_heldout(30, 50, 40, seed=4) != (g, b)
    assert select_heldout(12, 50, 256, seed=0)[1].__len__() == 12


# --------------------------------------------------------------------------- map and metrics


def test_platt_map_recovers_a_known_calibration():
    s, y = synthetic(6000, a=8.0, b=-4.0)
    cmap = CalibrationMap.fit(s, y, "platt")
    assert cmap.a == pytest.approx(8.0, rel=0.1) and cmap.b == pytest.approx(-4.0, rel=0.1)
    grid = np.linspace(-0.5, 1.5, 101)
    p = cmap.apply(grid)
    assert np.all(np.diff(p) >= 0)
    assert np.max(np.abs(p - 1 / (1 + np.exp(-(8 * grid - 4))))) < 0.05


def test_isotonic_map_is_monotone_and_close_to_the_truth():
    s, y = synthetic(6000, a=8.0, b=-4.0, seed=1)
    cmap = CalibrationMap.fit(s, y, "isotonic")
    grid = np.linspace(-0.5, 1.5, 401)
    p = cmap.apply(grid)
    assert np.all(np.diff(p) >= 0)
    assert np.all((p > 0) & (p < 1))  # Platt's targets keep the end steps off 0 and 1
    inner = np.linspace(0.1, 0.9, 17)
    assert np.max(np.abs(cmap.apply(inner) - 1 / (1 + np.exp(-(8 * inner - 4))))) < 0.08
    # Outside the knots: clipped to the end values.
    assert cmap.apply(-10.0) == cmap.apply(float(min(cmap.x)))


def test_a_decreasing_score_gives_a_constant_map():
    s, y = synthetic(500, a=-6.0, b=3.0)
    cmap = CalibrationMap.fit(s, y, "platt")
    assert cmap.a == 0.0
    assert cmap.apply(0.0) == cmap.apply(1.0)


def test_brier_and_ece_by_hand():
    y = [1, 0, 1, 1, 1, 0]
    p = [0.9, 0.2, 0.6, 0.35, 0.12, 0.18]
    assert metrics.brier(y, p) == pytest.approx(
        (0.01 + 0.04 + 0.16 + 0.4225 + 0.7744 + 0.0324) / 6, abs=1e-12)
    # Bins of width 0.1: 0.9 -> |1 - 0.9|, 0.2 -> |0 - 0.2|, 0.6 -> |1 - 0.6|, 0.35 ->
    # |1 - 0.35|, and bin [0.1, 0.2) holds 0.12 and 0.18: |0.5 - 0.15| for two items.
    assert metrics.ece(y, p) == pytest.approx((0.1 + 0.2 + 0.4 + 0.65 + 2 * 0.35) / 6,
                                              abs=1e-12)
    assert metrics.brier([1, 0], [0.5, 0.5]) == 0.25
    bins = metrics.reliability_bins([1, 0], [1.0, 0.0], n_bins=4)
    assert [b["count"] for b in bins] == [1, 0, 0, 1]  # 1.0 falls in the last, closed bin
    assert metrics.ece([1, 0], [1.0, 0.0]) == 0.0


def test_equal_error_and_precision_thresholds():
    s = [0.6, 0.7, 0.8, 0.9, 0.1, 0.2, 0.3, 0.65]
    y = [1, 1, 1, 1, 0, 0, 0, 0]
    assert equal_error_threshold(s, y) == pytest.approx(0.625)  # FNR = FPR = 1/4
    t, prec, rec = precision_threshold(s, y, 1.0)
    assert t == pytest.approx(0.675) and prec == 1.0 and rec == 0.75


def test_equal_error_threshold_matches_an_exact_scan():
    """The ROC-based threshold against a scan of every candidate in exact fractions (ties on
    tied scores included; one class only gives NaN)."""
    from fractions import Fraction

    def scan(s, y):
        n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
        if not (n_pos and n_neg):
            return math.nan
        u = np.unique(s)
        best, key = math.nan, None
        for t in np.concatenate([u[:1], (u[1:] + u[:-1]) / 2]):
            fnr = Fraction(int(((s < t) & (y == 1)).sum()), n_pos)
            fpr = Fraction(int(((s >= t) & (y == 0)).sum()), n_neg)
            k = (abs(fnr - fpr), fnr + fpr)
            if key is None or k < key:
                best, key = float(t), k
        return best

    rng = np.random.default_rng(7)
    for i in range(400):
        n = int(rng.integers(1, 30))
        s = (rng.integers(0, 5, n) / 4.0) if i % 2 else rng.normal(size=n)
        y = rng.integers(0, 2, n)
        want, got = scan(s, y), equal_error_threshold(s, y)
        assert got == want or (math.isnan(got) and math.isnan(want)), (s, y, got, want)


# --------------------------------------------------------------------------- the result


def test_self_check_is_deterministic_by_seed():
    s, y = synthetic(80, a=6.0, b=-3.0, seed=2)
    a = metrics.auc_stratified_ci(y, s, seed=5)
    assert a == metrics.auc_stratified_ci(y, s, seed=5)
    assert a[1:] != metrics.auc_stratified_ci(y, s, seed=6)[1:]
    assert a[0] == pytest.approx(metrics.auc(y, s), abs=1e-12)
    assert a[1] < a[0] < a[2]
    c1, c2 = fit_self_check(s, y, seed=5), fit_self_check(s, y, seed=5)
    assert c1.to_dict() == c2.to_dict()
    assert c1.ok and c1.auc_lo == a[1] and c1.auc_hi == a[2]


def test_self_check_estimates_on_synthetic_scores():
    s, y = synthetic(400, a=8.0, b=-4.0, seed=3)
    chk = fit_self_check(s, y, method="auto", seed=0, target_precision=0.8)
    assert chk.ok and chk.config["method_used"] == "isotonic"  # >= 100 per class
    assert chk.ece < 0.1 and chk.brier < 0.25
    p = chk.apply(s)
    assert isinstance(p, np.ndarray) and p.shape == s.shape
    assert isinstance(chk.apply(0.5), float)
    assert 0.6 < chk.expected_accuracy < 0.95
    assert chk.precision >= 0.8 and 0 < chk.recall <= 1
    assert len(chk.lines()) == 2


def test_repeated_partitions_average_the_single_ones():
    """The expected accuracy, Brier and ECE are the means over ``cv_repeats`` partitions, the
    r-th being the single-partition fit seeded ``seed + r``; the diagram is the first one's."""
    from icqs_fast.engine.selfcheck import CV_REPEATS

    s, y = synthetic(64, a=3.0, b=-1.5, seed=4)
    singles = [fit_self_check(s, y, seed=7 + r, cv_repeats=1) for r in range(4)]
    many = fit_self_check(s, y, seed=7, cv_repeats=4)
    assert many.expected_accuracy == pytest.approx(
        np.mean([c.expected_accuracy for c in singles]), abs=1e-12)
    assert many.brier == pytest.approx(np.mean([c.brier for c in singles]), abs=1e-12)
    assert many.ece == pytest.approx(np.mean([c.ece for c in singles]), abs=1e-12)
    assert many.reliability == singles[0].reliability
    assert len({round(c.expected_accuracy, 9) for c in singles}) > 1  # the partitions differ
    assert many.config["cv_repeats"] == 4
    assert fit_self_check(s, y, seed=7).config["cv_repeats"] == CV_REPEATS > 1


def test_too_small_pools_give_the_plain_verdict():
    s, y = synthetic(400, a=8.0, b=-4.0, seed=4)
    pos, neg = np.flatnonzero(y == 1)[:MIN_PER_CLASS - 1], np.flatnonzero(y == 0)[:30]
    idx = np.concatenate([pos, neg])
    chk = fit_self_check(s[idx], y[idx])
    assert chk.status == "too_small" and not chk.ok
    assert f"at least {MIN_PER_CLASS} of each" in chk.message
    assert chk.calibration is None and math.isnan(chk.apply(0.5))
    assert chk.record_value(0.5) is None
    # Skipped items (NaN scores) do not count towards the size, and are counted.
    s2 = np.concatenate([s[idx], [math.nan] * 5])
    assert fit_self_check(s2, np.concatenate([y[idx], [1] * 5])).n_skipped == 5


def test_too_small_pools_are_not_scored():
    class NoScoring:
        def score(self, items):
            raise AssertionError("scored")

    good, bad = pools(MIN_PER_CLASS - 1)
    chk = run_self_check(NoScoring(), good, bad)
    assert chk.status == "too_small" and "19 good and 19 bad" in chk.message
    assert run_self_check(NoScoring(), *pools(40), max_heldout=20).status == "too_small"
    assert run_self_check(NoScoring(), *pools(40), max_heldout=0).status == "off"


@pytest.mark.parametrize("method", ["platt", "isotonic"])
def test_json_round_trip(method):
    s, y = synthetic(120, a=6.0, b=-3.0, seed=5)
    chk = fit_self_check(s, y, method=method, target_precision=0.9)
    d = json.loads(json.dumps(chk.to_dict(), allow_nan=False))
    back = SelfCheck.from_dict(d)
    assert back.to_dict() == chk.to_dict()
    grid = np.linspace(-0.2, 1.2, 57)
    assert np.array_equal(back.apply(grid), chk.apply(grid))
    small = fit_self_check(s[:10], y[:10])
    assert SelfCheck.from_dict(json.loads(json.dumps(small.to_dict()))).status == "too_small"
    with pytest.raises(ValueError, match="version"):
        SelfCheck.from_dict({"status": "ok"})
    with pytest.raises(ValueError, match="knots"):
        CalibrationMap.from_dict({"method": "isotonic", "x": [0.2, 0.1], "y": [0.1, 0.2]})


# --------------------------------------------------------------------------- icqs-fast check


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _check(tmp_path, model_dir, n, *extra):
    from icqs_fast.cli import main

    good, bad = pools(n)
    g = write_jsonl(tmp_path / "good.jsonl", [{"x": x, "y": y} for x, y in good])
    b = write_jsonl(tmp_path / "bad.jsonl", [{"x": x, "y": y} for x, y in bad])
    return main(["check", "--good", str(g), "--bad", str(b), "--model", str(model_dir),
                 "--num-ratios", "2", "--demos-per-set", "2", "--sets-per-ratio", "2",
                 "--threads", "1", "--quiet", *extra])


def test_check_cli_end_to_end(tmp_path, tiny_model_dir, capsys):
    rc = _check(tmp_path, tiny_model_dir, 24, "--json", "--plot", str(tmp_path / "plots"))
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    # 24 + 24 held out (the default --self-check-max allows 128 per class), a few skipped: with
    # L = 2 sets per ratio, both sets of a ratio may hold an item.
    assert d["status"] == "ok" and d["n_good"] + d["n_bad"] + d["n_skipped"] == 48
    assert min(d["n_good"], d["n_bad"]) >= MIN_PER_CLASS
    assert d["auc_lo"] <= d["auc"] <= d["auc_hi"]
    assert (tmp_path / "plots" / "reliability.png").stat().st_size > 1000
    assert SelfCheck.from_dict({k: v for k, v in d.items() if k != "plot"}).ok
    rc = _check(tmp_path, tiny_model_dir, 24)
    out = capsys.readouterr().out
    assert rc == 0 and "AUC" in out and "expected accuracy" in out and "threshold" in out


def test_check_cli_small_pools_and_bad_input(tmp_path, tiny_model_dir, capsys):
    assert _check(tmp_path, tiny_model_dir, 8) == 0
    out = capsys.readouterr().out
    assert "8 good and 8 bad" in out and f"at least {MIN_PER_CLASS}" in out
    rc = _check(tmp_path, tiny_model_dir, 8, "--target-precision", "2")
    assert rc == 2 and "--target-precision" in capsys.readouterr().err
