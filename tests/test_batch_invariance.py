"""Batch-invariant mode (``deterministic=True``): a response's numbers are
bit-identical (``torch.equal``) to scoring it alone, whatever else is in the input, its
position, the order and the token budget - for the ICQS engine, ``score_continuations`` (the
lm-eval model) and the glass-box features. And the default mode is *not* always bit-identical,
so these tests would catch a deterministic path that fell back to shared batches."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_icqs import BAD, GOOD, _tiny

from icqs_fast import ICQSScorer
from icqs_fast.engine.continuations import score_continuations
from icqs_fast.models import embedded_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KW = dict(num_ratios=3, demos_per_set=2, sets_per_ratio=2, seed=0)
POOL = [
    ("a wonderful time", "positive"),
    ("awful", "negative"),
    ("what was it", "a long and pointless exercise in tedium, truly the worst film of the year, "
     "with wooden acting and a plot that goes nowhere at all, negative"),
    ("not bad at all", "positive"),
    ("meh", "neutral, I suppose"),
    ("the plot made no sense whatsoever but the music was lovely", "positive"),
]
BUDGETS = (48, 300, 1024, 100_000)
STAT_FIELDS = ("logprob", "entropy", "varentropy", "logprob_var", "max_logprob", "is_greedy",
               "target_rank")


@functools.cache
def _tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@functools.cache
def _model(kind: str):
    return _tiny(kind, "sdpa", len(_tok()))


def _scorer(kind: str, budget: int, deterministic: bool, **kw):
    return ICQSScorer(_model(kind), _tok(), GOOD, BAD, token_budget=budget,
                      deterministic=deterministic, return_token_stats=True, **KW, **kw)


@functools.cache
def _alone(kind: str, i: int, drop: bool):
    kw = dict(max_length=64, drop_oldest_demos=True) if drop else {}
    return _scorer(kind, 100_000, True, **kw).score_one(*POOL[i])


def _same(a, b) -> bool:
    return (torch.equal(a.loglik, b.loglik) and a.score == b.score
            and a.score_per_set == b.score_per_set
            and torch.equal(a.n_prompt_tokens, b.n_prompt_tokens)
            and torch.equal(a.n_dropped_demos, b.n_dropped_demos)
            and all(torch.equal(getattr(a.token_stats, f), getattr(b.token_stats, f))
                    for f in STAT_FIELDS))


@settings(max_examples=6)
@given(kind=st.sampled_from(["llama", "gpt2"]),
       order=st.permutations(range(len(POOL))).flatmap(
           lambda p: st.integers(1, len(p)).map(lambda n: p[:n])),
       repeat=st.booleans(), budget=st.sampled_from(BUDGETS), drop=st.booleans())
@pytest.mark.slow
def test_icqs_deterministic_equals_alone(kind, order, repeat, budget, drop):
    """Random batch compositions (a subset of the pool, in random order, possibly with a
    response twice), random token budgets, with or without dropped demonstrations: every result
    is bit-identical to the response scored alone."""
    idx = list(order) + ([order[0]] if repeat else [])
    kw = dict(max_length=64, drop_oldest_demos=True) if drop else {}
    got = list(_scorer(kind, budget, True, **kw).score([POOL[i] for i in idx]))
    for i, res in zip(idx, got, strict=True):
        assert _same(res, _alone(kind, i, drop)), (kind, idx, budget, i)


def test_icqs_default_mode_is_not_batch_invariant():
    """The default mode batches the rows of several responses into one padded forward (and
    one LM-head call); on this machine a Llama response's log-likelihood then differs in its
    last bits from the response scored alone (measured: 1.9e-6 nats on POOL[3] with all four
    first responses in one forward). If a platform happens to give identical bits, the
    property above still holds; the test says so instead of failing."""
    s = _scorer("llama", 100_000, False)
    together = list(s.score(POOL[:4]))
    alone = [_scorer("llama", 100_000, False).score_one(*r) for r in POOL[:4]]
    same = [_same(a, b) for a, b in zip(together, alone, strict=True)]
    for a, b in zip(together, alone, strict=True):  # equal to rounding all the same
        torch.testing.assert_close(a.loglik, b.loglik, atol=1e-5, rtol=0)
    if all(same):
        pytest.skip("the default mode happened to be bit-identical here (no regression signal)")
    assert not all(same)


@pytest.mark.parametrize("calibration", ["content_free", "pmi"])
def test_icqs_deterministic_runs_calibration_baselines(calibration):
    """Batch-invariant mode with a calibration: the baselines' rows run too (each baseline in
    a forward of its own; they were once left unscored, a zero baseline), so a result equals the
    default mode's to rounding and the response scored alone bit for bit."""
    idx = [3, 4, 3]  # the second 3 reuses the first one's cached baseline
    det = list(_scorer("llama", 300, True, calibration=calibration).score(
        [POOL[i] for i in idx]))
    dflt = list(_scorer("llama", 100_000, False, calibration=calibration).score(
        [POOL[i] for i in idx]))
    alone = {i: _scorer("llama", 100_000, True, calibration=calibration).score_one(*POOL[i])
             for i in set(idx)}
    for i, a, b in zip(idx, det, dflt, strict=True):
        assert a.loglik_baseline.abs().min() > 0  # a scored baseline: a log-probability < 0
        torch.testing.assert_close(a.loglik_baseline, b.loglik_baseline, atol=1e-4, rtol=0)
        torch.testing.assert_close(a.loglik_calibrated, b.loglik_calibrated, atol=1e-4, rtol=0)
        assert _same(a, alone[i]) and torch.equal(a.loglik_baseline, alone[i].loglik_baseline)


# --------------------------------------------------------------------------- continuations


def _cont_requests(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    shared, q = ids(30), ids(7)
    return [(shared + q, ids(1)), (shared + q, ids(4)), (shared + ids(5), ids(3)),
            (shared[:10], ids(6)), (ids(1), ids(3)), (ids(12), ids(2)), (shared + q, ids(9))]


@settings(max_examples=6)
@given(kind=st.sampled_from(["llama", "gpt2"]), data=st.data(),
       budget=st.sampled_from(BUDGETS), bank=st.sampled_from([None, 16]))
def test_continuations_deterministic_equals_alone(kind, data, budget, bank):
    model = _model(kind)
    reqs = _cont_requests(3, len(_tok()))
    order = data.draw(st.permutations(range(len(reqs))))
    n = data.draw(st.integers(1, len(reqs)))
    idx = list(order[:n])
    got = score_continuations(model, [reqs[i] for i in idx], token_budget=budget,
                              max_bank_tokens=bank, deterministic=True,
                              return_token_stats=True)
    for i, r in zip(idx, got, strict=True):
        (a,) = score_continuations(model, [reqs[i]], deterministic=True, return_token_stats=True)
        assert r.loglik == a.loglik and r.token_logprobs == a.token_logprobs, (kind, idx, i)
        assert r.is_greedy == a.is_greedy
        for f in STAT_FIELDS:
            assert torch.equal(getattr(r.stats, f), getattr(a.stats, f))


# --------------------------------------------------------------------------- glass-box


def test_glassbox_deterministic_equals_alone():
    from icqs_fast.features.extract import glassbox

    model, tok = _model("llama"), _tok()
    items = [(x, y) for x, y in POOL]
    feats = ["sent_logprob", "softmax_ent", "softmax_var", "token_prob_var"]
    for bs in (1, 3, 8):
        rows = glassbox(model, tok, items[::-1], features=feats, batch_size=bs,
                        deterministic=True)
        for it, row in zip(items[::-1], rows, strict=True):
            (alone,) = glassbox(model, tok, [it], features=feats, deterministic=True)
            assert row == alone
