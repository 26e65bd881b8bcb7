"""The self-check's abstain band, its plain "do not trust" warning, its size following the job
and its cache of cross-fitted scores (issue 40, items 2 and 4)."""

import itertools
import json
import math

import numpy as np
import pytest
from _helpers import sentiment_pools as pools
from _helpers import shorter_is_good_pools, tiny_llama

from icqs_fast.engine.abstain import (
    AbstainBand,
    abstain_band,
    band_verdicts,
    coverage_curve,
    fit_band,
)
from icqs_fast.engine.scorer import ICQSScorer
from icqs_fast.engine.selfcheck import (
    ADVICE,
    CV_FOLDS,
    LEVEL,
    N_BOOT,
    SelfCheck,
    fit_self_check,
    run_self_check,
    select_heldout,
    sized_max_heldout,
)
from icqs_fast.io.cache import ENV, JsonCache, digest

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTS = dict(folds=CV_FOLDS, seed=0, n_boot=N_BOOT, level=LEVEL)  # the self-check's own


def gaussians(n: int, shift: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` good scores ~ N(shift, 1) then ``n`` bad ~ N(0, 1), with their 0/1 labels."""
    s = np.concatenate([rng.normal(shift, 1.0, n), rng.normal(0.0, 1.0, n)])
    return s, np.r_[np.ones(n), np.zeros(n)].astype(np.int64)


def outside_accuracy(s, y, lo, hi) -> tuple[float, float]:
    v = band_verdicts(s, lo, hi)
    cov = v != "abstain"
    right = ((v == "good") & (y == 1)) | ((v == "bad") & (y == 0))
    return float(cov.mean()), float(right.sum() / cov.sum())


# --------------------------------------------------------------------------- the band


def test_fit_band_is_the_widest_band_reaching_the_target_by_brute_force():
    rng = np.random.default_rng(3)
    s, y = gaussians(15, 1.2, rng)
    s = np.round(s, 1)  # ties, so that cuts between equal scores are never taken
    u = np.unique(s)
    cuts = [-math.inf, *((u[1:] + u[:-1]) / 2), math.inf]
    for target in (0.7, 0.8, 0.9, 1.0):
        best = None
        for lo, hi in itertools.combinations_with_replacement(cuts, 2):
            cov, acc = outside_accuracy(s, y, lo, hi) if (
                band_verdicts(s, lo, hi) != "abstain").any() else (0.0, 0.0)
            if cov > 0 and acc >= target - 1e-12 and (best is None or (cov, acc) > best):
                best = (cov, acc)
        band = fit_band(s, y, target)
        assert (band is None) == (best is None)
        if band is not None:
            assert outside_accuracy(s, y, *band) == pytest.approx(best)


def test_accuracy_outside_the_band_on_held_out_data_is_within_its_interval():
    rng = np.random.default_rng(0)
    s, y = gaussians(128, 1.0, rng)  # a self-check's 256 held-out items, AUC about 0.76
    band = abstain_band(s, y, 0.85, **OPTS)
    assert band.reached and band.lo < band.hi and band.aim >= 0.85
    assert band.coverage_lo <= band.coverage <= band.coverage_hi
    assert band.accuracy_lo <= band.accuracy <= band.accuracy_hi
    st, yt = gaussians(100_000, 1.0, rng)  # the records the band is then used on
    cov, acc = outside_accuracy(st, yt, band.lo, band.hi)
    assert band.accuracy_lo <= acc <= band.accuracy_hi
    assert band.coverage_lo <= cov <= band.coverage_hi
    # The verdict of a record follows the band: bad below, abstain inside, good above.
    assert [band.verdict(v) for v in (band.lo - 1, (band.lo + band.hi) / 2, band.hi)] == [
        "bad", "abstain", "good"]


def test_coverage_curve_is_non_increasing_and_ends_at_the_plain_threshold():
    s, y = gaussians(60, 1.5, np.random.default_rng(4))
    curve = coverage_curve(s, y)
    cov = [c for c, _ in curve]
    acc = [a for _, a in curve]
    assert cov == sorted(cov) and cov[-1] == 1.0
    assert all(a >= b for a, b in zip(acc, acc[1:], strict=False))
    assert acc[0] == 1.0  # a narrow enough side is always right on distinct scores


def test_an_unreachable_target_abstains_on_everything():
    y = np.r_[np.ones(30), np.zeros(30)].astype(np.int64)
    s = np.random.default_rng(0).permutation(np.repeat([0.4, 0.6], 30))  # one score per half
    band = abstain_band(s, y, 0.99, **OPTS)
    assert not band.reached and band.coverage == 0.0
    assert {band.verdict(v) for v in (0.0, 0.5, 1.0)} == {"abstain"}
    assert "every record is 'abstain'" in band.text()


def test_band_travels_in_the_self_check_and_gives_verdicts():
    s, y = gaussians(100, 1.5, np.random.default_rng(2))
    chk = fit_self_check(s, y, target_accuracy=0.9)
    assert chk.band is not None and chk.target_accuracy == 0.9
    assert any("abstain band for accuracy 0.9" in line for line in chk.lines())
    back = SelfCheck.from_dict(json.loads(json.dumps(chk.to_dict(), allow_nan=False)))
    assert back.to_dict() == chk.to_dict()
    assert back.verdict(chk.band.hi + 0.01) == "good" and back.verdict(chk.band.lo - 1) == "bad"
    # Without a target: good / bad at the equal-error threshold; no estimate: no verdict.
    plain = fit_self_check(s, y)
    assert plain.band is None
    assert plain.verdict(plain.threshold) == "good"
    assert plain.verdict(plain.threshold - 1e-9) == "bad"
    assert fit_self_check(s[:10], y[:10]).verdict(0.5) is None
    # An infinite side survives JSON (as null).
    d = AbstainBand(0.8, -math.inf, 0.5, True, level=LEVEL).to_dict()
    assert d["lo"] is None and AbstainBand.from_dict(d).lo == -math.inf
    with pytest.raises(ValueError, match="target accuracy"):
        fit_self_check(s, y, target_accuracy=1.5)


# --------------------------------------------------------------------------- trust


def test_random_labels_say_plainly_not_to_trust_the_scores():
    rng = np.random.default_rng(7)
    s, y = rng.uniform(size=120), rng.integers(0, 2, 120)  # a scorer that does not separate
    chk = fit_self_check(s, y)
    assert chk.ok and not chk.trusted
    assert chk.auc_lo <= 0.5 <= chk.auc_hi
    assert "do not trust" in chk.warning and ADVICE in chk.warning
    assert any(line.startswith("self-check WARNING: do not trust") for line in chk.lines())
    assert SelfCheck.from_dict(chk.to_dict()).warning == chk.warning
    good = fit_self_check(*gaussians(100, 2.0, rng))
    assert good.trusted and good.warning == ""


# --------------------------------------------------------------------------- size and cache


class Counting:
    """A scorer wrapper counting the items it scores."""

    def __init__(self, scorer):
        self.inner, self.scored = scorer, 0
        self.sets, self.settings, self.model = scorer.sets, scorer.settings, scorer.model
        self.tokens, self.template = scorer.tokens, scorer.template

    def score(self, items):
        for res in self.inner.score(items):
            self.scored += 1
            yield res


class NoScoring:
    def score(self, items):
        raise AssertionError("scored")


def test_size_follows_the_job():
    assert sized_max_heldout(256, None) == 256
    assert sized_max_heldout(256, 30) == 30 and sized_max_heldout(256, 10_000) == 256
    # A 30-record job: at most 30 held-out items (15 per class), too few: nothing is scored,
    # so the self-check costs nothing, and it says why.
    chk = run_self_check(NoScoring(), *pools(40), job_records=30)
    assert chk.status == "too_small" and "the job has 30 records" in chk.message
    assert chk.config["sized_by_job"] == {"asked": 256, "job_records": 30}


@pytest.fixture(scope="module")
def scorer():
    model, tok = tiny_llama(device="cpu")
    good, bad = pools(24)
    return ICQSScorer(model, tok, good, bad, num_ratios=3, demos_per_set=4, sets_per_ratio=3,
                      seed=1), good, bad


def test_a_second_self_check_reuses_the_cached_scores(scorer, tmp_path, monkeypatch):
    sc, good, bad = scorer
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    cache = JsonCache("selfcheck")
    first = Counting(sc)
    a = run_self_check(first, good, bad, max_heldout=48, cache=cache)
    assert first.scored == 48 and a.config["cache"] == "stored"
    # one entry of scores, one of the baselines' values
    assert len(list((tmp_path / "cache" / "selfcheck").glob("*.json"))) == 2
    second = Counting(sc)
    b = run_self_check(second, good, bad, max_heldout=48, cache=cache, target_accuracy=0.8)
    assert second.scored == 0 and b.config["cache"] == "hit"
    assert "reused from the cache" in b.message
    assert (b.auc, b.brier, b.threshold) == (a.auc, a.brier, a.threshold)
    # Another draw of the same items (another seed) reuses them: a score depends on the item,
    # not on the draw.
    seeded = Counting(sc)
    run_self_check(seeded, good, bad, max_heldout=48, seed=1, cache=cache)
    assert seeded.scored == 0
    # Another leak rule, pools or settings: another key, scored again.
    third = Counting(sc)
    run_self_check(third, good, bad, max_heldout=48, leak="pair", cache=cache)
    assert third.scored == 48
    fewer = Counting(sc)
    run_self_check(fewer, good[:-1], bad, max_heldout=48, cache=cache)
    assert fewer.scored == 46
    # Turned off: nothing stored, nothing read.
    monkeypatch.setenv(ENV, "off")
    off = JsonCache("selfcheck")
    assert not off.enabled and off.put("k", {}) is None and off.get("k") is None


def test_a_check_after_a_capped_self_check_scores_only_the_items_it_lacks(
        scorer, tmp_path, monkeypatch):
    """A job of 40 records caps its self-check to 40 items (20 per class); ``check`` (no job)
    then draws all 24 + 24: the 40 are reused from the cache, only the 8 others are scored."""
    sc, good, bad = scorer
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    cache = JsonCache("selfcheck")
    job = Counting(sc)
    a = run_self_check(job, good, bad, job_records=40, cache=cache)
    assert job.scored == 40 and a.config["scored"] == 40 and a.config["cache"] == "stored"
    check = Counting(sc)
    b = run_self_check(check, good, bad, cache=cache)
    assert check.scored == 8 and (b.config["reused"], b.config["scored"]) == (40, 8)
    assert b.n_good + b.n_bad + b.n_skipped == 48
    assert "40 of 48 held-out scores reused from the cache" in b.message
    again = Counting(sc)
    c = run_self_check(again, good, bad, cache=cache)
    assert again.scored == 0 and c.config["cache"] == "hit" and c.auc == b.auc
    # The reused scores are the ones scoring them anew gives (no cache).
    fresh = run_self_check(sc, good, bad)
    assert (fresh.auc, fresh.brier) == (b.auc, b.brier)


def test_a_larger_draw_holds_every_item_of_a_smaller_one():
    for n_good, n_bad, seed in ((24, 24, 0), (50, 30, 3), (200, 200, 1)):
        small = select_heldout(n_good, n_bad, 40, seed)
        large = select_heldout(n_good, n_bad, 256, seed)
        assert set(small[0]) <= set(large[0]) and set(small[1]) <= set(large[1])


def test_cache_entries_are_keyed_by_content_and_survive_damage(tmp_path):
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    c = JsonCache("x", root=tmp_path)
    assert c.get("k") is None
    c.put("k", {"v": 1})
    assert c.get("k") == {"v": 1}
    c.path("k").write_text("{cut off", encoding="utf-8")
    assert c.get("k") is None  # unreadable: computed again, never an error


# --------------------------------------------------------------------------- baselines


def test_the_self_check_says_when_length_beats_icqs(tmp_path, monkeypatch):
    model, tok = tiny_llama(device="cpu")
    good, bad = shorter_is_good_pools()
    sc = ICQSScorer(model, tok, good, bad, num_ratios=3, demos_per_set=4, sets_per_ratio=3,
                    seed=1)
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    chk = run_self_check(sc, good, bad, cache=JsonCache("selfcheck"))
    by = {b["name"]: b for b in chk.baselines}
    assert list(by) == ["length_tokens", "length_chars", "logprob_sum", "logprob_mean",
                        "entropy_mean", "loglik_good_sum", "loglik_good_mean"]
    assert by["length_chars"]["auc"] == pytest.approx(1.0)
    assert by["length_chars"]["direction"] == "lower"
    assert by["length_tokens"]["auc_lo"] > chk.auc_hi  # the case in question
    assert chk.beaten.startswith("response length in tokens beats ICQS on these pools (the "
                                 "shorter answer is the good one): AUC 1.000")
    assert f"against ICQS's {chk.auc:.3f} [{chk.auc_lo:.3f}, {chk.auc_hi:.3f}]" in chk.beaten
    assert "length-balanced pool" in chk.beaten and "features" in chk.beaten
    assert "--model" in chk.beaten
    lines = chk.lines()
    assert f"self-check WARNING: {chk.beaten}" in lines
    assert any(ln.startswith("self-check: baselines on the same held-out items") for ln in lines)
    # The meta file's dict carries them, and reads back.
    back = SelfCheck.from_dict(json.loads(json.dumps(chk.to_dict())))
    assert back.baselines == chk.baselines and back.beaten == chk.beaten
    # A second self-check reads the baselines' values from the cache: no forward at all.
    import icqs_fast.engine.continuations as cont

    def no_forward(*a, **k):
        raise AssertionError("a forward")

    monkeypatch.setattr(cont, "score_continuations", no_forward)
    counted = Counting(sc)
    again = run_self_check(counted, good, bad, cache=JsonCache("selfcheck"))
    assert counted.scored == 0 and again.baselines == chk.baselines


def test_no_baseline_beats_a_scorer_that_separates():
    rng = np.random.default_rng(0)
    s, y = gaussians(40, 3.0, rng)
    values = [{"length_tokens": float(rng.integers(1, 9)), "length_chars": float(i % 7)}
              for i in range(80)]
    chk = fit_self_check(s, y, baseline_values=values)
    assert [b["name"] for b in chk.baselines] == ["length_tokens", "length_chars"]
    assert chk.beaten == "" and all(b["auc_hi"] < chk.auc_lo for b in chk.baselines)
    lm = chk.length_matched
    assert lm is not None and lm["strata"] >= 2 and lm["auc"] > 0.9  # not length's doing
