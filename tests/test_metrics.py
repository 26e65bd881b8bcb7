"""Correlation metrics vs scipy, ties and undefined inputs."""

import math
import warnings

import numpy as np
import pytest
from scipy import stats

from icqs_fast.metrics import (
    accuracy,
    auc,
    bootstrap_ci,
    cohen_kappa,
    correlations,
    f1,
    kendall,
    pearson,
    spearman,
)


@pytest.mark.parametrize("ties", [False, True])
def test_metrics_match_scipy(ties):
    rng = np.random.default_rng(0)
    x = rng.normal(size=60)
    y = x * 0.5 + rng.normal(size=60)
    if ties:
        x = np.round(x)  # many ties
        y = rng.integers(1, 11, size=60).astype(float)  # GPT-4-like 1..10 scores
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
    assert kendall(x, y) == pytest.approx(stats.kendalltau(x, y, variant="b")[0], abs=1e-12)


def test_metrics_perfect_and_reversed():
    x = [1.0, 2.0, 3.0, 4.0]
    assert correlations(x, x) == pytest.approx({"pearson": 1, "spearman": 1, "kendall": 1})
    assert correlations(x, x[::-1]) == pytest.approx({"pearson": -1, "spearman": -1,
                                                      "kendall": -1})


def test_metrics_undefined_are_nan_with_warning():
    with pytest.warns(RuntimeWarning, match="constant"):
        assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    with pytest.warns(RuntimeWarning, match="constant"):
        assert math.isnan(kendall([1, 2, 3], [5, 5, 5]))
    with pytest.warns(RuntimeWarning, match="fewer than 2"):
        assert math.isnan(spearman([1.0], [2.0]))
    # NaN pairs are dropped, not propagated.
    assert pearson([1, 2, float("nan"), 3], [1, 2, 7, 3]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different lengths"):
        pearson([1, 2], [1, 2, 3])


# --- classification metrics: hand-checked small cases -------------------------------------

def test_accuracy_hand_checked():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == pytest.approx(0.5)
    assert accuracy(["pos", "neg", "neu"], ["pos", "neg", "neg"]) == pytest.approx(2 / 3)
    with pytest.warns(RuntimeWarning, match="no items"):
        assert math.isnan(accuracy([], []))
    with pytest.raises(ValueError, match="different lengths"):
        accuracy([1, 2], [1])


def test_f1_hand_checked():
    # tp=2 (items 0, 3), fp=1 (item 1), fn=1 (item 2): 2*2 / (2*2 + 1 + 1) = 2/3.
    assert f1([1, 0, 1, 1, 0], [1, 1, 0, 1, 0]) == pytest.approx(2 / 3)
    # Multi-class labels, F1 of one class: "neg" tp=1, fp=1, fn=1 -> 2/4.
    assert f1(["neg", "pos", "neg", "neu"], ["neg", "neg", "pos", "neu"],
              positive="neg") == pytest.approx(0.5)
    # Positives exist but none predicted: F1 = 0, defined.
    assert f1([1, 0, 0], [0, 0, 0]) == 0.0
    with pytest.warns(RuntimeWarning, match="neither"):
        assert math.isnan(f1([0, 0], [0, 0]))


def test_auc_hand_checked_and_vs_pair_count():
    # 2 positives x 2 negatives = 4 pairs; pos 0.8 beats both, pos 0.4 beats 0.3 only,
    # ties count 1/2: (2 + 1) / 4.
    assert auc([1, 0, 1, 0], [0.8, 0.5, 0.4, 0.3]) == pytest.approx(0.75)
    assert auc([True, False, True, False], [0.5, 0.5, 0.9, 0.1]) == pytest.approx(
        (1.5 + 2) / 4)
    assert auc(["good", "bad", "good"], [3.0, 1.0, 2.0], positive="good") == 1.0
    # Independent reference: Mann-Whitney U / (n_pos n_neg), on data with ties.
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=80)
    s = np.round(rng.normal(size=80) + y, 1)
    u = stats.mannwhitneyu(s[y == 1], s[y == 0]).statistic
    assert auc(y, s) == pytest.approx(u / ((y == 1).sum() * (y == 0).sum()), abs=1e-12)
    # Non-finite scores dropped; a single class left is undefined.
    assert auc([1, 0, 1], [0.9, 0.1, float("nan")]) == 1.0
    with pytest.warns(RuntimeWarning, match="one class"):
        assert math.isnan(auc([1, 1, 0], [0.2, 0.3, float("inf")]))


def test_cohen_kappa_hand_checked():
    # 2x2 table: agree yes 20, agree no 15, a-yes/b-no 5, a-no/b-yes 10 (n = 50).
    a = ["y"] * 20 + ["n"] * 15 + ["y"] * 5 + ["n"] * 10
    b = ["y"] * 20 + ["n"] * 15 + ["n"] * 5 + ["y"] * 10
    po = 35 / 50
    pe = (25 / 50) * (30 / 50) + (25 / 50) * (20 / 50)
    assert cohen_kappa(a, b) == pytest.approx((po - pe) / (1 - pe), abs=1e-12)
    assert cohen_kappa([1, 2, 3], [1, 2, 3]) == pytest.approx(1.0)
    with pytest.warns(RuntimeWarning, match="same label"):
        assert math.isnan(cohen_kappa([2, 2], [2, 2]))


# --- bootstrap intervals -------------------------------------------------------------------

def test_bootstrap_ci_mean_matches_normal_theory_and_scipy():
    rng = np.random.default_rng(2)
    x = rng.normal(loc=3.0, scale=2.0, size=400)
    lo, hi = bootstrap_ci(np.mean, x, n_resamples=2000, level=0.95, seed=0)
    half = 1.959964 * x.std(ddof=1) / math.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - half, abs=0.04)
    assert hi == pytest.approx(x.mean() + half, abs=0.04)
    ref = stats.bootstrap((x,), np.mean, n_resamples=2000, method="percentile",
                          confidence_level=0.95, random_state=1).confidence_interval
    assert lo == pytest.approx(ref.low, abs=0.04) and hi == pytest.approx(ref.high, abs=0.04)
    # Seeded: same seed same interval, another seed (slightly) another one.
    assert bootstrap_ci(np.mean, x, n_resamples=2000, seed=0) == (lo, hi)
    assert bootstrap_ci(np.mean, x, n_resamples=2000, seed=5) != (lo, hi)
    # A wider level gives a wider interval.
    lo99, hi99 = bootstrap_ci(np.mean, x, n_resamples=2000, level=0.99, seed=0)
    assert lo99 < lo and hi99 > hi


def test_bootstrap_ci_resamples_items_jointly():
    rng = np.random.default_rng(3)
    x = rng.normal(size=50)
    # y is a strictly increasing function of x: any joint resample keeps Spearman at 1;
    # resampling the arrays independently would not.
    y = np.exp(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # constant resamples never happen with n = 50
        lo, hi = bootstrap_ci(spearman, x, y, n_resamples=200, seed=0)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different lengths"):
        bootstrap_ci(spearman, x, y[:10])


def test_bootstrap_ci_skips_nan_resamples():
    # Three items, two classes: some resamples hold one class only (AUC undefined, NaN).
    y = [1, 0, 0]
    s = [0.9, 0.1, 0.2]
    with pytest.warns(RuntimeWarning, match="skipped"):
        lo, hi = bootstrap_ci(auc, y, s, n_resamples=100, seed=0)
    assert lo == hi == 1.0  # every defined resample separates the classes perfectly
    with pytest.warns(RuntimeWarning, match="every resample"):
        assert all(math.isnan(v) for v in bootstrap_ci(pearson, [1.0, 1.0], [2.0, 3.0],
                                                       n_resamples=20))
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci(np.mean, [1.0, 2.0], level=95)
