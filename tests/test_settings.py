"""One settings object for the engine and its reference: :class:`ScoringSettings` is frozen and
validated, its fingerprint is stable JSON, and ``ICQSScorer`` and ``icqs_naive`` given the same
settings (every ``stratify`` / ``strata_order`` variant) use the same demonstration sets and
give the same log-likelihoods on a tiny random Llama."""

import dataclasses
import json

import pytest
import torch
from _helpers import assert_same_scores

from icqs_fast.engine.prompts import Template, build_demo_sets
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.engine.scorer import ICQSScorer
from icqs_fast.engine.settings import ENGINE_FIELDS, RESULT_FIELDS, ScoringSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Labels as answers: 2 strata, 2 of each per set of N = 4 in both pools, so stratify="auto"
# does stratify here.
GOOD = [("the movie was great", "positive"), ("I loved it", "positive"),
        ("superb acting and a moving story", "positive"), ("dull", "negative"),
        ("a tedious, overlong mess", "negative"), ("nothing happens for two hours", "negative")]
BAD = [("terrible film", "positive"), ("boring", "positive"),
       ("a slow and empty remake", "positive"), ("wonderful", "negative"),
       ("I would watch it again tomorrow", "negative"), ("a joyous celebration", "negative")]
RESPONSES = [("a wonderful time", "positive"), ("awful", "negative")]
SMALL = dict(num_ratios=3, demos_per_set=4, sets_per_ratio=2, seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_llama_model):
    return tiny_llama_model


# --------------------------------------------------------------------------- the object


def test_defaults_frozen_and_hashable():
    s = ScoringSettings()
    assert (s.num_ratios, s.demos_per_set, s.sets_per_ratio, s.seed) == (5, 8, 4, 0)
    assert s.stratify == "auto" and s.strata_order == "fixed" and s.template == Template()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]
    assert hash(s) == hash(ScoringSettings())
    # Explicit strata become tuples, so the object stays hashable.
    t = ScoringSettings(stratify=[["a", "b"], ["b", "a"]])
    assert t.stratify == (("a", "b"), ("b", "a"))
    hash(t)


# The message names the option's command-line flag (its declaration, icqs_fast/options.py);
# an option without a flag by its field name.
@pytest.mark.parametrize("field, value, match", [
    ("num_ratios", 1, "--num-ratios must be an int >= 2, got 1"),
    ("demos_per_set", 0, "--demos-per-set"),
    ("sets_per_ratio", 2.0, "--sets-per-ratio"),
    ("seed", "0", "--seed"),
    ("mixing", "random", "--mixing"),
    ("replacement", 1, "--replacement must be a bool"),
    ("stratify", "label", "stratify"),
    ("stratify", 3, "stratify"),
    ("strata_order", "random", "--strata-order"),
    ("max_length", 0, "--max-length"),
    ("drop_oldest_demos", "yes", "--drop-oldest-demos"),
    ("token_budget", 0, "--token-budget"),
    ("cascade", "no", "cascade"),
    ("tie_epsilon", float("inf"), "--tie-epsilon must be a finite number >= 0"),
])
def test_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        ScoringSettings(**{field: value})


def test_build_replace_and_unknown_option():
    base = ScoringSettings(**SMALL)
    assert ScoringSettings.build(base) is base
    assert ScoringSettings.build(base, seed=9) == dataclasses.replace(base, seed=9)
    assert base.replace(stratify=None).stratify is None
    with pytest.raises(TypeError, match="demos_per_sett"):
        ScoringSettings.build(demos_per_sett=3)
    with pytest.raises(TypeError, match="template must be a Template"):
        ScoringSettings(template={"demo": "x"})
    assert ScoringSettings(template=None).template == Template()


def test_fingerprint_is_stable_json():
    s = ScoringSettings(template=Template(system="Rate it.\n"), stratify=("a", "b"),
                        backend="torch", token_budget=99, cascade=False, **SMALL)
    fp = s.fingerprint()
    # tie_epsilon only changes the "tied" score, so only its fingerprint holds it.
    assert tuple(fp) == tuple(k for k in RESULT_FIELDS if k != "tie_epsilon")
    assert tuple(s.replace(score="tied").fingerprint()) == RESULT_FIELDS
    assert not set(ENGINE_FIELDS) & set(fp)  # engine-only options do not change a result
    assert fp["template"]["system"] == "Rate it.\n" and fp["stratify"] == ["a", "b"]
    text = json.dumps(fp, sort_keys=True)
    assert json.loads(text) == fp
    # The same settings built again (or only engine options changed): the same fingerprint.
    again = ScoringSettings(template=Template(system="Rate it.\n"), stratify=["a", "b"], **SMALL)
    assert json.dumps(again.fingerprint(), sort_keys=True) == text
    assert s.replace(seed=4).fingerprint() != fp
    everything = s.asdict()
    assert everything == {**fp, "backend": "torch", "token_budget": 99, "cascade": False,
                          "deterministic": False}
    assert s.replace(deterministic=True).fingerprint() == fp  # engine-only
    json.dumps(everything)
    assert ScoringSettings.from_dict(everything) == s


# --------------------------------------------------------------------------- engine vs reference


@pytest.mark.parametrize("stratify, strata_order", [
    ("auto", "fixed"), ("y", "shuffled"), (None, "fixed"), ("auto", "shuffled"),
])
def test_engine_and_reference_share_the_settings(tiny, stratify, strata_order):
    model, tok = tiny
    st = ScoringSettings(stratify=stratify, strata_order=strata_order, **SMALL)
    scorer = ICQSScorer(model, tok, GOOD, BAD, st)
    assert scorer.settings is st
    assert scorer.sets == build_demo_sets(GOOD, BAD, **st.demo_set_options())
    # "auto" stratifies these label answers; None does not.
    assert (scorer.sets[0][0].strata is None) == (stratify is None)
    got = list(scorer.score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, st, compute_dtype=torch.float64)
    for a, b in zip(got, ref, strict=True):
        # Same demonstration sets: the same prompt lengths in every context.
        assert torch.equal(a.n_prompt_tokens, b.n_prompt_tokens)
        torch.testing.assert_close(a.loglik, b.loglik, atol=1e-4, rtol=0)
        assert_same_scores(a, b)
    # The keywords build the same settings (and the same results).
    kw = ICQSScorer(model, tok, GOOD, BAD, stratify=stratify, strata_order=strata_order, **SMALL)
    assert kw.settings == st and kw.sets == scorer.sets


def test_stratify_changes_the_reference(tiny):
    """The reference honours ``stratify``: stratified and unstratified sets differ here, and so
    do its prompts (a reference ignoring it would give equal prompt lengths)."""
    model, tok = tiny
    strat = build_demo_sets(GOOD, BAD, **ScoringSettings(stratify="y", **SMALL)
                            .demo_set_options())
    plain = build_demo_sets(GOOD, BAD, **ScoringSettings(stratify=None, **SMALL)
                            .demo_set_options())
    assert strat != plain
    a = icqs_naive(model, tok, GOOD, BAD, RESPONSES[:1], stratify="y", **SMALL)[0]
    b = icqs_naive(model, tok, GOOD, BAD, RESPONSES[:1], stratify=None, **SMALL)[0]
    assert not torch.equal(a.n_prompt_tokens, b.n_prompt_tokens)
