"""Demonstration sets and templates (no model needed)."""

import math

import pytest

from icqs_fast.engine.prompts import Template, build_demo_sets

GOOD = [(f"good x {i}", f"good y {i}") for i in range(12)]
BAD = [(f"bad x {i}", f"bad y {i}") for i in range(10)]


def _n_good_expected(r: float, n: int) -> int:
    return int(math.floor(r * n + 0.5))


@pytest.mark.parametrize("num_ratios,n", [(2, 1), (3, 4), (5, 8), (4, 7)])
def test_exact_counts_and_ratios(num_ratios, n):
    sets = build_demo_sets(GOOD, BAD, num_ratios=num_ratios, demos_per_set=n, sets_per_ratio=3,
                           seed=3)
    assert len(sets) == num_ratios
    ratios = [row[0].ratio for row in sets]
    assert ratios[0] == 0.0 and ratios[-1] == 1.0
    assert ratios == pytest.approx([j / (num_ratios - 1) for j in range(num_ratios)])
    good_set, bad_set = set(GOOD), set(BAD)
    for j, row in enumerate(sets):
        assert len(row) == 3
        for li, ds in enumerate(row):
            assert (ds.ratio_index, ds.set_index) == (j, li)
            assert len(ds.examples) == n == len(ds.is_good)
            assert ds.n_good == _n_good_expected(ds.ratio, n)
            # Flags tell the truth about the pool each example came from.
            for ex, g in zip(ds.examples, ds.is_good, strict=True):
                assert ex in (good_set if g else bad_set)
            # Without replacement: distinct examples within a set.
            assert len(set(ds.examples)) == n


def test_seeded_and_deterministic():
    a = build_demo_sets(GOOD, BAD, num_ratios=5, demos_per_set=6, sets_per_ratio=4, seed=7)
    b = build_demo_sets(GOOD, BAD, num_ratios=5, demos_per_set=6, sets_per_ratio=4, seed=7)
    c = build_demo_sets(GOOD, BAD, num_ratios=5, demos_per_set=6, sets_per_ratio=4, seed=8)
    assert a == b
    assert a != c
    # The L sets of a ratio differ (shuffled order / different draws).
    assert len({ds.examples for ds in a[2]}) > 1


def test_exact_mixing_shuffles_positions():
    sets = build_demo_sets(GOOD, BAD, num_ratios=3, demos_per_set=8, sets_per_ratio=20, seed=0)
    patterns = {ds.is_good for ds in sets[1]}
    assert len(patterns) > 1  # good demos are not always in the same slots


def test_bernoulli_reproducible_and_plausible():
    kw = dict(num_ratios=5, demos_per_set=8, sets_per_ratio=50, seed=11, mixing="bernoulli",
              replacement=True)
    a = build_demo_sets(GOOD, BAD, **kw)
    assert a == build_demo_sets(GOOD, BAD, **kw)
    assert a != build_demo_sets(GOOD, BAD, **{**kw, "seed": 12})
    # r=0 and r=1 are deterministic in composition; intermediate ratios vary around r*N.
    assert all(ds.n_good == 0 for ds in a[0]) and all(ds.n_good == 8 for ds in a[-1])
    counts = [ds.n_good for ds in a[2]]
    assert len(set(counts)) > 1
    mean = sum(counts) / len(counts)
    assert abs(mean - 4.0) < 1.0  # 50 sets x 8 Bernoulli(0.5): sd of the mean ~0.28


def test_too_few_examples_names_counts():
    with pytest.raises(ValueError, match=r"3 good and 10 bad"):
        build_demo_sets(GOOD[:3], BAD, num_ratios=3, demos_per_set=4, sets_per_ratio=1)
    with pytest.raises(ValueError, match=r"12 good and 2 bad"):
        build_demo_sets(GOOD, BAD[:2], num_ratios=3, demos_per_set=4, sets_per_ratio=1)
    # With replacement a tiny pool is fine.
    sets = build_demo_sets(GOOD[:2], BAD[:1], num_ratios=3, demos_per_set=4, sets_per_ratio=2,
                           replacement=True)
    assert sets[-1][0].examples[0] in GOOD[:2]
    with pytest.raises(ValueError, match=r"0 good"):
        build_demo_sets([], BAD, num_ratios=3, demos_per_set=1, sets_per_ratio=1,
                        replacement=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_ratios"):
        build_demo_sets(GOOD, BAD, num_ratios=1, demos_per_set=2, sets_per_ratio=1)
    with pytest.raises(ValueError, match="mixing"):
        build_demo_sets(GOOD, BAD, num_ratios=3, demos_per_set=2, sets_per_ratio=1,
                        mixing="half")
    with pytest.raises(TypeError, match=r"good\[1\]\.y must be a str"):
        build_demo_sets([("a", "b"), ("c", 3)] + GOOD, BAD, num_ratios=3, demos_per_set=2,
                        sets_per_ratio=1)
    with pytest.raises(ValueError, match=r"bad\[0\]: a dict example needs"):
        build_demo_sets(GOOD, [{"x": "a"}] + BAD, num_ratios=3, demos_per_set=2,
                        sets_per_ratio=1)


def test_dict_examples_accepted():
    good = [{"x": x, "y": y} for x, y in GOOD]
    assert build_demo_sets(good, BAD, num_ratios=3, demos_per_set=3, sets_per_ratio=2,
                           seed=1) == build_demo_sets(GOOD, BAD, num_ratios=3, demos_per_set=3,
                                                      sets_per_ratio=2, seed=1)


def test_template_formats():
    t = Template()
    assert t.format_prefix([("a b", "pos"), ("c", "neg")]) == (
        "Sentence: a b\nAnswer: pos\n\nSentence: c\nAnswer: neg\n\n")
    assert t.format_query("z") == "Sentence: z\nAnswer:"
    assert t.format_response("pos") == " pos\n"
    # Braces in the data are not format fields.
    assert t.format_query("{y} {0}") == "Sentence: {y} {0}\nAnswer:"
    custom = Template(demo="Q: {x} A: {y}", query="Q: {x} A:", response=" {y}", separator="\n",
                      system="Rate it.\n")
    assert custom.format_prefix([("1", "2")]) == "Rate it.\nQ: 1 A: 2\n"
    with pytest.raises(ValueError, match="response must contain"):
        Template(response="no field")
    with pytest.raises(ValueError, match="query must contain"):
        Template(query="Answer:")


def test_template_field_text_not_substituted_twice():
    t = Template()
    assert t.format_demo("{y}", "pos") == "Sentence: {y}\nAnswer: pos\n"
    assert t.format_response("{x}") == " {x}\n"


# --------------------------------------------------------------------------- stratified sets
# Pools whose stated labels (y) are unbalanced, as random draws from them would be.
S_GOOD = [(f"g{i}", "pos") for i in range(9)] + [(f"h{i}", "neg") for i in range(4)]
S_BAD = [(f"b{i}", "pos") for i in range(4)] + [(f"c{i}", "neg") for i in range(7)]


def _stratum_of(ex):
    return ex[1]  # the label the example states


@pytest.mark.parametrize("mixing,replacement,order", [
    ("exact", False, "fixed"), ("bernoulli", False, "fixed"), ("exact", True, "fixed"),
    ("exact", False, "shuffled"), ("bernoulli", True, "shuffled")])
def test_stratified_counts_fixed_at_every_ratio(mixing, replacement, order):
    n = 4
    sets = build_demo_sets(S_GOOD, S_BAD, num_ratios=5, demos_per_set=n, sets_per_ratio=6,
                           seed=5, mixing=mixing, replacement=replacement, stratify="y",
                           strata_order=order)
    # Fixed order: one label sequence everywhere; shuffled: the sequences vary between sets.
    n_orders = len({ds.strata for row in sets for ds in row})
    assert n_orders == 1 if order == "fixed" else n_orders > 1
    good_set, bad_set = set(S_GOOD), set(S_BAD)
    for row in sets:
        for ds in row:
            labels = [_stratum_of(ex) for ex in ds.examples]
            assert labels.count("pos") == 2 and labels.count("neg") == 2
            assert list(ds.strata) == labels
            if mixing == "exact":
                assert ds.n_good == _n_good_expected(ds.ratio, n)
            for ex, g in zip(ds.examples, ds.is_good, strict=True):
                assert ex in (good_set if g else bad_set)
            if not replacement:
                assert len(set(ds.examples)) == n
            # Good demos split over the strata as evenly as the count allows.
            per = [sum(g for g, s in zip(ds.is_good, ds.strata, strict=True) if s == lab)
                   for lab in ("neg", "pos")]
            assert abs(per[0] - per[1]) <= 1


def test_stratified_without_it_label_counts_vary():
    # The reason for stratifying: plain draws from these pools change the label mix with r.
    plain = build_demo_sets(S_GOOD, S_BAD, num_ratios=3, demos_per_set=4, sets_per_ratio=30,
                            seed=0)
    mixes = {sum(ex[1] == "pos" for ex in ds.examples) for row in plain for ds in row}
    assert len(mixes) > 1
    assert all(ds.strata is None for row in plain for ds in row)


def test_stratified_remainder_rule_and_forms():
    # N=5 over 2 strata: the first in sorted order ("neg") holds 3, "pos" 2, in every set.
    a = build_demo_sets(S_GOOD, S_BAD, num_ratios=3, demos_per_set=5, sets_per_ratio=4,
                        seed=2, stratify="y")
    for row in a:
        for ds in row:
            assert sorted(ds.strata) == ["neg"] * 3 + ["pos"] * 2
    gs = [y for _, y in S_GOOD]
    bs = [y for _, y in S_BAD]
    kw = dict(num_ratios=3, demos_per_set=5, sets_per_ratio=4, seed=2)
    assert build_demo_sets(S_GOOD, S_BAD, stratify=(gs, bs), **kw) == a
    assert build_demo_sets(S_GOOD, S_BAD, stratify=gs + bs, **kw) == a
    assert build_demo_sets(S_GOOD, S_BAD, stratify="y", **{**kw, "seed": 3}) != a
    # Strata other than y: three groups, 6 demos -> 2 each.
    gx = [f"s{i % 3}" for i in range(len(S_GOOD))]
    bx = [f"s{i % 3}" for i in range(len(S_BAD))]
    for row in build_demo_sets(S_GOOD, S_BAD, num_ratios=4, demos_per_set=6, sets_per_ratio=3,
                               seed=1, stratify=(gx, bx)):
        for ds in row:
            assert sorted(ds.strata) == ["s0", "s0", "s1", "s1", "s2", "s2"]
            for ex, g, s in zip(ds.examples, ds.is_good, ds.strata, strict=True):
                pool, strata = (S_GOOD, gx) if g else (S_BAD, bx)
                assert strata[pool.index(ex)] == s


def test_stratified_errors_name_the_problem():
    kw = dict(num_ratios=3, demos_per_set=10, sets_per_ratio=1)
    # 10 demos over 2 strata need 5 "neg" in the good pool, which has 4.
    with pytest.raises(ValueError, match=r"stratum 'neg' has 4 good and 7 bad"):
        build_demo_sets(S_GOOD, S_BAD, stratify="y", **kw)
    # A stratum only the good pool has can't fill the r=0 sets.
    with pytest.raises(ValueError, match=r"stratum 'neu' has 1 good and 0 bad"):
        build_demo_sets(S_GOOD + [("n", "neu")], S_BAD, num_ratios=3, demos_per_set=3,
                        sets_per_ratio=1, stratify="y")
    # With replacement one example per stratum and pool suffices.
    build_demo_sets(S_GOOD, S_BAD, stratify="y", replacement=True, **kw)
    with pytest.raises(ValueError, match=r"12 strata for 13 good \+ 11 bad"):
        build_demo_sets(S_GOOD, S_BAD, stratify=["pos"] * 12, **kw)
    with pytest.raises(ValueError, match=r"3 good strata for 13 good"):
        build_demo_sets(S_GOOD, S_BAD, stratify=(["pos"] * 3, ["pos"] * 11), **kw)
    with pytest.raises(TypeError, match=r"stratify\[1\]\[0\] must be a str"):
        build_demo_sets(S_GOOD, S_BAD, stratify=(["pos"] * 13, [1] * 11), **kw)
    with pytest.raises(ValueError, match=r"stratify must be 'y'"):
        build_demo_sets(S_GOOD, S_BAD, stratify="label", **kw)


@pytest.mark.parametrize("mixing", ["exact", "bernoulli"])
def test_stratified_fixed_order_same_strata_at_every_position(mixing):
    sets = build_demo_sets(S_GOOD, S_BAD, num_ratios=5, demos_per_set=6, sets_per_ratio=5,
                           seed=4, mixing=mixing, stratify="y", strata_order="fixed")
    first = [ex[1] for ex in sets[0][0].examples]
    assert sorted(first) == ["neg"] * 3 + ["pos"] * 3
    good_set, bad_set = set(S_GOOD), set(S_BAD)
    patterns = set()
    for row in sets:
        for ds in row:
            # The label at each position is the same in every set (the last one included).
            assert [ex[1] for ex in ds.examples] == first == list(ds.strata)
            if mixing == "exact":
                assert ds.n_good == _n_good_expected(ds.ratio, 6)
            for ex, g in zip(ds.examples, ds.is_good, strict=True):
                assert ex in (good_set if g else bad_set)
            assert len(set(ds.examples)) == 6
            patterns.add(ds.is_good)
    assert len(patterns) > 3  # which positions are good still varies
    with pytest.raises(ValueError, match="strata_order must be"):
        build_demo_sets(S_GOOD, S_BAD, stratify="y", strata_order="sorted")


def test_stratify_auto_only_for_label_answers():
    kw = dict(num_ratios=3, demos_per_set=4, sets_per_ratio=3, seed=6)
    # Two labels, enough of each in both pools: the same sets as stratify="y".
    assert build_demo_sets(S_GOOD, S_BAD, stratify="auto", **kw) == \
        build_demo_sets(S_GOOD, S_BAD, stratify="y", **kw)
    # Free-text answers (every y distinct): not stratified, the plain sets.
    plain = build_demo_sets(GOOD, BAD, **kw)
    assert build_demo_sets(GOOD, BAD, stratify="auto", **kw) == plain
    # Labels, but a pool short of one (N=8 needs 4 "neg" good; there are 4 -> fits; N=10 not).
    assert build_demo_sets(S_GOOD, S_BAD, stratify="auto", **{**kw, "demos_per_set": 8})[0][0] \
        .strata is not None
    big = build_demo_sets(S_GOOD, S_BAD, stratify="auto", **{**kw, "demos_per_set": 10})
    assert big == build_demo_sets(S_GOOD, S_BAD, **{**kw, "demos_per_set": 10})
    # More labels than N // 2: not stratified.
    three = [(x, f"l{i % 3}") for i, (x, _) in enumerate(GOOD)]
    three_b = [(x, f"l{i % 3}") for i, (x, _) in enumerate(BAD)]
    assert build_demo_sets(three, three_b, stratify="auto", **kw)[0][0].strata is None
    assert build_demo_sets(three, three_b, stratify="auto", **{**kw, "demos_per_set": 6}
                           )[0][0].strata is not None
