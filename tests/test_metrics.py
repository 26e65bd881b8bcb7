"""Correlation metrics vs scipy, ties and undefined inputs."""

import math

import numpy as np
import pytest
from scipy import stats

from icqs_fast.metrics import correlations, kendall, pearson, spearman


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
