"""The self-check bias study (bench/studies/selfcheck_study.py) on a tiny random Llama and
embedded pools: the stored matrices give back the scores, the matched-context test AUC, the
per-dataset summary and its table."""

import math

import numpy as np
import pytest
import torch
from _helpers import sentiment_pools as pools
from _helpers import tiny_llama

from bench.studies import selfcheck_outside as outside
from bench.studies import selfcheck_study as study
from icqs_fast import metrics
from icqs_fast.engine.selfcheck import crossfit_score
from icqs_fast.engine.settings import ScoringSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# Scoring 56 responses on the tiny model takes ~10-25 s on the shared machine.
slow = pytest.mark.slow

@pytest.fixture(scope="module")
def raw():
    model, tok = tiny_llama(device="cpu")
    good, bad = pools(22)
    tg, tb = pools(6, start=100)
    test = [(x, y, 1) for x, y in tg] + [(x, y, 0) for x, y in tb]
    st = ScoringSettings(num_ratios=3, demos_per_set=4, sets_per_ratio=3, seed=1)
    r = study.run_pools(model, tok, good, bad, test, st, max_heldout=44, seed=0)
    return {"dataset": "toy", "pool": 22, **r}


@slow
def test_stored_matrices_give_back_the_scores(raw):
    h, t = raw["heldout"], raw["test"]
    assert len(h["loglik"]) == len(h["labels"]) == 44 and len(t["loglik"]) == 12
    assert np.shape(h["clean"]) == (44, 3, 3)
    for m, mask, s, full in zip(h["loglik"], h["clean"], h["scores"], h["full_scores"],
                                strict=True):
        res = study.stored_result(raw, m)
        got = crossfit_score(res, torch.tensor(mask, dtype=torch.bool))
        assert (s is None and math.isnan(got)) or got == pytest.approx(s, abs=1e-6)
        every = torch.ones(3, 3, dtype=torch.bool)
        assert crossfit_score(res, every) == pytest.approx(full, abs=1e-6)
    for m, s in zip(t["loglik"], t["scores"], strict=True):
        assert crossfit_score(study.stored_result(raw, m), torch.ones(3, 3, dtype=torch.bool)) == \
            pytest.approx(s, abs=1e-6)
    assert raw["dtype"] == "float32" and raw["score_kind"] in ("argmax", "tied", "mean")


@slow
def test_matched_auc_is_the_test_auc_when_every_context_is_clean(raw):
    full = {**raw, "heldout": {**raw["heldout"],
                               "clean": np.ones_like(raw["heldout"]["clean"]).tolist()}}
    want = metrics.auc(np.asarray(raw["test"]["labels"]), np.asarray(raw["test"]["scores"]))
    assert study.matched_test_auc(full, draws=3) == pytest.approx(want, abs=1e-9)
    # With the held-out masks some contexts go: a (seeded) different value, the same twice.
    a = study.matched_test_auc(raw, draws=3)
    assert a == study.matched_test_auc(raw, draws=3) and 0.0 <= a <= 1.0
    assert math.isnan(study.matched_test_auc({**raw, "test": {"labels": [1]}}))


@slow
def test_analyse_summarise_and_table(raw):
    row = study.analyse(raw, n_boot=50)
    assert row["status"] == "ok" and row["n_test"] == 12
    assert row["accuracy_gap"] == pytest.approx(row["expected_accuracy"] - row["test_accuracy"])
    assert 0.0 <= row["insample_accuracy"] <= 1.0
    rows = [row, {**row, "seed": 1, "selfcheck_auc": row["selfcheck_auc"] + 0.1,
                  "accuracy_gap": -0.2, "inside": False}]
    summ = study.summarise(rows)
    assert set(summ) == {"toy", "all"} and summ["all"]["seeds"] == 2
    s = summ["toy"]
    assert s["seeds"] == 2 and s["inside"] == int(row["inside"])
    assert s["auc_bias"] == pytest.approx(row["selfcheck_auc"] + 0.05 - row["test_auc"])
    assert s["auc_bias_se"] == pytest.approx(0.05)  # std (ddof 1) of a 0.1 step / sqrt 2
    assert s["max_abs_accuracy_gap"] == pytest.approx(max(0.2, abs(row["accuracy_gap"])))
    assert s["mean_abs_accuracy_gap"] == pytest.approx((0.2 + abs(row["accuracy_gap"])) / 2)
    assert s["pooled_n_test"] == 24
    table = study.bias_markdown({"toy": s}).splitlines()
    assert len(table) == 3 and table[2].startswith("| toy | 2 |")
    assert table[0].count("|") == table[2].count("|")


def toy_raw(n: int = 40, seed: int = 0) -> tuple[dict, np.ndarray, np.ndarray]:
    """Matrices ``a[i, j] + e[j, l]`` (item level plus a large set effect, no other noise) and
    random clean masks with at least one clean set per ratio."""
    rng = np.random.default_rng(seed)
    j_, l_ = 5, 4
    a = rng.normal(0.0, 1.0, (n, j_))
    e = rng.normal(0.0, 3.0, (j_, l_))
    e -= e.mean(axis=1, keepdims=True)
    clean = rng.uniform(size=(n, j_, l_)) > 0.3
    clean[:, :, 0] = True
    raw = {"seed": seed, "ratios": [j / (j_ - 1) for j in range(j_)], "score_kind": "mean",
           "tie_epsilon": 0.1}
    return raw, a[:, :, None] + e[None], clean


def test_set_effects_are_recovered_and_removed():
    raw, ll, clean = toy_raw()
    e = study.set_effects(ll, clean, iters=200)
    want = ll[0] - ll[0].mean(axis=1, keepdims=True)  # e, centred per ratio
    assert np.allclose(e, want, atol=1e-6)
    adj = study.adjusted_scores(raw, ll, clean, e)
    every = np.ones_like(clean)
    # Removing the set effects makes the score independent of which contexts are clean ...
    assert np.allclose(adj, study.adjusted_scores(raw, ll, every, e), atol=1e-9)
    # ... and with every context clean it is the plain score (the effects cancel in the mean).
    plain = study.adjusted_scores(raw, ll, every, np.zeros_like(e))
    assert np.allclose(adj, plain, atol=1e-9)
    # Without the adjustment the dropped sets move the scores.
    assert not np.allclose(study.adjusted_scores(raw, ll, clean, np.zeros_like(e)), plain,
                           atol=1e-3)


@slow  # a lab study's simulation: seconds, not the product's fast loop
def test_expected_accuracy_simulation_is_seeded_and_sane():
    a = study.simulate_expected_accuracy(0.75, n_per_class=25, runs=12, seed=3)
    assert a == study.simulate_expected_accuracy(0.75, n_per_class=25, runs=12, seed=3)
    # The best balanced accuracy at AUC 0.75 (binormal) is Phi(Phi^-1(0.75) / sqrt 2) = 0.684.
    assert 0.6 < a["mean_true"] <= 0.685 and abs(a["bias"]) < 0.08 and a["sd"] > 0


def toy_study(slope_test: float = 1.0, seed: int = 0, n_h: int = 24, n_t: int = 20) -> dict:
    """A raw run without a model: log-likelihoods ``+-slope * r_j`` plus unit noise per context
    (good items rise with the ratio, bad ones fall), held-out items with random clean masks
    (one context of the item's own side dropped now and then), test responses with
    ``slope_test`` times the held-out slope (1: exchangeable with the held-out items)."""
    rng = np.random.default_rng(seed)
    ratios = np.array([0.0, 0.5, 1.0])
    raw = {"dataset": "toy", "seed": seed, "ratios": ratios.tolist(), "score_kind": "mean",
           "tie_epsilon": 0.1, "n_test": 2 * n_t}

    def mats(n: int, slope: float) -> tuple[list, list]:
        y = [1] * n + [0] * n
        ll = [(0.6 * slope * (1 if v else -1) * ratios[:, None]
               + rng.normal(0.0, 1.0, (3, 4))).tolist() for v in y]
        return ll, y

    hl, hy = mats(n_h, 1.0)
    clean = rng.uniform(size=(2 * n_h, 3, 4)) > 0.15
    clean[:, :, 0] = True
    tl, ty = mats(n_t, slope_test)
    zero = np.zeros((3, 4))
    hs = study.adjusted_scores(raw, hl, clean, zero)
    ts = study.adjusted_scores(raw, tl, np.ones((2 * n_t, 3, 4), dtype=bool), zero)
    raw["heldout"] = {"labels": hy, "scores": hs.tolist(), "full_scores": hs.tolist(),
                      "loglik": hl, "clean": clean.astype(int).tolist()}
    raw["test"] = {"labels": ty, "scores": ts.tolist(), "p_good": ts.tolist(), "loglik": tl}
    raw.update(max_heldout=2 * n_h, seconds={"heldout": 1.0, "test": 1.0})  # for analyse()
    return raw


def test_shared_inputs_counts_every_item_whose_input_recurs():
    good = [("p1", "a"), ("p2", "b"), ("p3", "c")]
    bad = [("p1", "not a"), ("p4", "d"), ("p2", "b'")]
    assert study.shared_inputs(good, bad) == 4
    assert study.shared_inputs(good, [("q", "z")]) == 0


def test_matched_score_table_uses_the_held_out_masks_of_the_class():
    raw = toy_study(n_h=21)
    table, y = study.matched_score_table(raw)
    assert table.shape == (40, 21) and y.tolist() == raw["test"]["labels"]
    every = {**raw, "heldout": {**raw["heldout"],
                                "clean": np.ones((42, 3, 4), dtype=int).tolist()}}
    full, _ = study.matched_score_table(every)
    assert np.allclose(full, np.asarray(raw["test"]["scores"])[:, None], atol=1e-12)
    assert not np.allclose(table, full, atol=1e-3)  # some contexts went


@slow  # a lab study's simulation: seconds, not the product's fast loop
def test_exchange_null_centres_on_zero_and_finds_a_scored_differently_test_set():
    same = [toy_study(seed=s) for s in range(3)]
    nulls = [study.exchange_null(r, perms=24, n_boot=20) for r in same]
    assert nulls[0] == study.exchange_null(same[0], perms=24, n_boot=20)  # seeded
    n = nulls[0]
    assert len(n["gap"]) == len(n["inside"]) == len(n["spread"]) == 24
    hs, hy = np.asarray(same[0]["heldout"]["scores"]), np.asarray(same[0]["heldout"]["labels"])
    ts, ty = np.asarray(same[0]["test"]["scores"]), np.asarray(same[0]["test"]["labels"])
    assert n["observed_shift_good"] == pytest.approx(hs[hy == 1].mean() - ts[ty == 1].mean())
    rows = [study.analyse(r, n_boot=50) for r in same]
    summ = study.exchange_summary(rows, nulls)
    d = summ["toy"]
    assert d["runs"] == 3 and d["perms"] == 24 and set(summ) == {"toy", "all"}
    for k in ("accuracy_gap", "auc_diff", "shift_good", "spread"):
        assert abs(d[k]["null_mean"]) < 0.05, k  # exchanged groups: no difference on average
        assert d[k]["null_lo"] <= d[k]["null_mean"] <= d[k]["null_hi"]
    # Test responses that separate three times as well: the AUC reads low beyond the null.
    sharp = [toy_study(slope_test=3.0, seed=s) for s in range(3)]
    ds = study.exchange_summary([study.analyse(r, n_boot=50) for r in sharp],
                                [study.exchange_null(r, perms=24, n_boot=20) for r in sharp])
    assert ds["toy"]["auc_diff"]["observed"] < ds["toy"]["auc_diff"]["null_lo"]
    assert ds["toy"]["auc_diff"]["p"] < 0.05
    assert study.exchange_null({**same[0], "test": {"labels": [1], "scores": [0.5]}}) is None
    table = study.exchange_markdown(summ).splitlines()
    assert len(table) == 4 and table[2].startswith("| toy | 3 |")
    assert table[0].count("|") == table[2].count("|")


@slow
def test_add_test_responses_extends_a_run_with_new_pairs_from_its_own_scorer():
    from _helpers import skip_unless_in_ci

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.io.datasets import eval_dataset

    if not eval_dataset("chaosnli").default_path().exists():
        skip_unless_in_ci("ChaosNLI data (../shared/data) missing")
    model, tok = tiny_llama(device="cpu")
    raw = study.run_one(model, tok, "chaosnli", 0, pool=8, n_test=3, max_heldout=0)
    more = study.add_test_responses(model, tok, raw, 2)
    t0, t1 = raw["test"], more["test"]
    assert more["n_test"] == 10 and more["n_test_scored_first"] == 6
    assert t1["labels"] == t0["labels"] + [1, 1, 0, 0] and t1["scores"][:6] == t0["scores"]
    assert len(t1["loglik"]) == 10 and more["heldout"] == raw["heldout"]
    # The added ones: the first new pairs of each class in the study's larger draw, scored by
    # a scorer built as the run's.
    good, bad, first, tpl = study.study_pools("chaosnli", pool=8, n_test=3, seed=0)
    _, _, bigger, _ = study.study_pools("chaosnli", pool=8, n_test=11, seed=0)
    new = [r for lab in (1, 0) for r in [r for r in bigger if r[2] == lab and r not in first][:2]]
    sc = ICQSScorer(model, tok, good, bad, ScoringSettings(seed=0, template=tpl))
    want = [r.score for r in sc.score([(x, y) for x, y, _ in new])]
    assert t1["scores"][6:] == pytest.approx(want, abs=1e-6)
    # A second enlargement appends pairs the run does not hold yet, after the first ones
    # (each call's draw is rebuilt from the record: test_added_per_class).
    again = study.add_test_responses(model, tok, more, 1)
    assert again["test_added_per_class"] == [2, 1] and again["n_test"] == 12
    assert again["test"]["labels"] == t1["labels"] + [1, 0]
    assert again["test"]["scores"][:10] == t1["scores"]
    _, _, held, _ = study.scored_tests(again)
    assert held[:10] == first + new and len(set(held)) == 12
    # A record written before the list was kept (one enlargement) reads the same.
    old = {k: v for k, v in more.items() if k != "test_added_per_class"}
    assert study.added_per_class(old) == [2] and study.scored_tests(old)[2] == held[:10]
    with pytest.raises(ValueError, match="settings differ"):
        study.add_test_responses(model, tok, {**raw, "settings": {**raw["settings"],
                                                                   "seed": 9}}, 1)


@slow  # a lab study's simulation: seconds, not the product's fast loop
def test_outside_run_scores_the_held_out_items_with_another_seeds_scorer():
    from _helpers import skip_unless_in_ci

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.selfcheck import select_heldout
    from icqs_fast.io.datasets import eval_dataset

    if not eval_dataset("chaosnli").default_path().exists():
        skip_unless_in_ci("ChaosNLI data (../shared/data) missing")
    model, tok = tiny_llama(device="cpu")
    # Pools of 16: the default sets (8 demonstrations, 4 per ratio) leave each item clean sets.
    r0 = study.run_one(model, tok, "chaosnli", 0, pool=16, n_test=2, max_heldout=6)
    r1 = study.run_one(model, tok, "chaosnli", 1, pool=16, n_test=2, max_heldout=6)
    out = outside.outside_run(model, tok, r0, r1)
    assert out["scorer_seed"] == 1 and len(out["labels"]) + out["left_out"] == 6
    # The items: run 0's held-out ones minus those whose input is in run 1's pools, scored by
    # a scorer built as run 1's.
    good, bad, _, tpl = study.study_pools("chaosnli", pool=16, n_test=1, seed=0)
    ig, ib = select_heldout(16, 16, 6, 0)
    g1, b1, _, _ = study.study_pools("chaosnli", pool=16, n_test=1, seed=1)
    seen = {x for x, _ in g1 + b1}
    items = [it for it in [good[i] for i in ig] + [bad[i] for i in ib] if it[0] not in seen]
    sc = ICQSScorer(model, tok, g1, b1, ScoringSettings(seed=1, template=tpl))
    assert out["scores"] == pytest.approx([r.score for r in sc.score(items)], abs=1e-6)
    summ = outside.outside_summary([r0, r1], [out])["chaosnli"]
    assert summ["runs"] == 1 and np.isfinite(summ["crossfit_auc"])
    assert summ["in_pool_step"] == pytest.approx(summ["crossfit_auc"] - summ["outside_auc"])
    assert summ["items_step"] == pytest.approx(summ["outside_auc"] - summ["test_auc"])
    with pytest.raises(ValueError, match="another seed"):
        outside.outside_run(model, tok, r0, r0)


def test_first_tests_gives_back_the_run_before_its_test_set_was_enlarged():
    raw = toy_study()
    assert study.first_tests(raw) is raw
    more = {**raw, "n_test_scored_first": 10, "n_test": 40}
    first = study.first_tests(more)
    assert first["n_test"] == 10
    assert all(v == raw["test"][k][:10] for k, v in first["test"].items())
    assert first["heldout"] is raw["heldout"]
