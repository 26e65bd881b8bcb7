"""Correlation metrics vs scipy, ties and undefined inputs."""

import math
import warnings

import numpy as np
import pytest
from scipy import stats

from icqs_fast.metrics import (
    accuracy,
    auc,
    auc_resampler,
    auc_stratified_ci,
    bootstrap_ci,
    bootstrap_distribution,
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


def test_bootstrap_distribution_paired_and_per_stratum():
    rng = np.random.default_rng(11)
    x = rng.normal(size=40)
    # Vectorised and one-by-one give the same resamples (the same item indices by seed).
    one = bootstrap_distribution(np.mean, x, n_resamples=300, seed=3)
    vec = bootstrap_distribution(lambda a: a.mean(-1), x, vectorized=True, n_resamples=300,
                                 seed=3)
    np.testing.assert_allclose(one, vec, rtol=0, atol=1e-12)
    assert one.shape == (300,) and np.unique(one).size > 100
    # Per stratum: each sample keeps its size and its own items on every resample.
    a, b = np.zeros(7), np.ones(5)
    sizes = bootstrap_distribution(lambda p, q: p.size + 10 * q.sum(), a, b, paired=False,
                                   n_resamples=50, seed=0)
    assert np.all(sizes == 7 + 50)
    with pytest.raises(ValueError, match="different lengths"):
        bootstrap_distribution(np.mean, a, b)
    # A stratum of one item resamples to itself (scipy needs two; it is held fixed).
    d = bootstrap_distribution(lambda p, q: p[0] - q.mean(), np.array([5.0]),
                               np.array([0.0, 2.0]), paired=False, n_resamples=400, seed=1)
    assert set(np.unique(d)) == {3.0, 4.0, 5.0}
    assert np.all(bootstrap_distribution(np.mean, [2.5], n_resamples=3) == 2.5)


def test_auc_resampler_and_stratified_interval_match_sklearn():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(12)
    pos = np.round(rng.normal(1.0, 1.0, size=30), 1)  # rounded: ties count half
    neg = np.round(rng.normal(0.0, 1.0, size=20), 1)
    neg[:3] = pos[:3]  # exact ties across the classes too
    ip, jn = rng.integers(0, 30, size=(6, 30)), rng.integers(0, 20, size=(6, 20))
    y = np.r_[np.ones(30), np.zeros(20)]
    want = [roc_auc_score(y, np.r_[pos[i], neg[j]]) for i, j in zip(ip, jn, strict=True)]
    np.testing.assert_allclose(auc_resampler(pos, neg)(ip, jn), want, rtol=0, atol=1e-12)
    v, lo, hi = auc_stratified_ci(y, np.r_[pos, neg], n_resamples=2000, seed=0)
    assert v == pytest.approx(roc_auc_score(y, np.r_[pos, neg]), abs=1e-12) and lo < v < hi
    # The per-class bootstrap agrees with scipy's own percentile interval of the same AUC.
    ref = stats.bootstrap((pos, neg), lambda p, n, axis=-1: np.array(
        [roc_auc_score(y, np.r_[a, b]) for a, b in zip(p, n, strict=True)]),
        vectorized=True, n_resamples=2000, method="percentile",
        rng=np.random.default_rng(99)).confidence_interval
    assert lo == pytest.approx(ref.low, abs=0.03) and hi == pytest.approx(ref.high, abs=0.03)


def test_study_auc_intervals_use_the_shared_bootstrap():
    from icqs_fast.evals.calibration_study import auc_ci, auc_difference

    rng = np.random.default_rng(13)
    pa, na = rng.normal(1.0, 1.0, 60), rng.normal(0.0, 1.0, 40)
    y = np.r_[np.ones(60), np.zeros(40)]
    got = auc_ci(pa, na, n_boot=500, seed=4)
    assert (got["value"], got["lo"], got["hi"]) == auc_stratified_ci(
        y, np.r_[pa, na], n_resamples=500, seed=4)
    # Paired: a scoring against itself differs by exactly 0 on every resample.
    same = auc_difference(pa, na, pa, na, n_boot=200)
    assert same == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    # A noisier copy of the same scores loses AUC; the interval sits around the difference.
    d = auc_difference(pa, na, pa + rng.normal(0, 2, 60), na + rng.normal(0, 2, 40),
                       n_boot=500, seed=0)
    assert 0.0 < d["lo"] < d["value"] < d["hi"]
