"""Pairs share their query's states (issue 50): per pair and context the query ``x`` runs once
(``ICQSScorer.score(share_query=True)``, what ``score_pairs`` asks for), both outputs continue
from it, and every log-likelihood, score and token statistic is the same bits as the output
scored as a record of its own."""

from __future__ import annotations

import pytest
import torch

from icqs_fast.engine.pairs import score_pairs
from icqs_fast.engine.prompt_tokens import common_prefix
from icqs_fast.engine.scorer import ICQSScorer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = [("Rewrite politely: give me the file", "Could you please send me the file?"),
        ("Summarise: the meeting moved to Friday at noon", "The meeting is now Friday, noon."),
        ("Translate to French: good morning", "Bonjour")]
BAD = [("Rewrite politely: give me the file", "FILE. NOW."),
       ("Summarise: the meeting moved to Friday at noon", "Meetings are important."),
       ("Translate to French: good morning", "Buenos dias")]
# Long queries (past several 64-key blocks of the cascade's one pass), short ones, outputs
# sharing their first words (the shared part stops before the first response token), and
# outputs of very different lengths.
LONG = ("Summarise the following letter in one sentence. " + "The committee met on Tuesday "
        "and discussed the budget, the new building, the parking rules and the library hours. "
        * 6)
PAIRS = [
    (LONG, "The committee discussed its budget and buildings.", "A letter."),
    ("Name a prime number.", "7", "Seven is a prime number, and so are 2, 3 and 5."),
    ("Translate to French: thank you", "Merci beaucoup", "Merci"),
    (LONG[:200], "It covers the budget.", "It covers the budget and the parking rules."),
]
OPTS = dict(num_ratios=2, demos_per_set=1, sets_per_ratio=2, seed=0)
STATS = ("logprob", "entropy", "varentropy", "max_logprob", "target_rank")


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    from icqs_fast import models

    d = tiny_llama_dir(layers=2, max_positions=1024)
    cache: dict[str, tuple] = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = models.load_model(d, dtype=dtype, device="cpu")
        return cache[dtype]
    return get


def _same(a, b) -> bool:
    return (torch.equal(a.loglik, b.loglik) and a.score == b.score
            and a.score_per_set == b.score_per_set
            and torch.equal(a.n_prompt_tokens, b.n_prompt_tokens)
            and (a.loglik_baseline is None or torch.equal(a.loglik_baseline, b.loglik_baseline))
            and all(torch.equal(getattr(a.token_stats, f), getattr(b.token_stats, f))
                    for f in STATS))


def _shared_tokens(sc: ICQSScorer, x: str, ya: str, yb: str) -> int:
    """Tokens both outputs' prompts share after each context's bank entry, up to the first
    position that predicts a response token: what runs once instead of twice, from the
    prompts' own layouts."""
    total = 0
    la = sc.tokens.layouts(0, x, ya, sc.max_length, sc.drop_oldest_demos)
    lb = sc.tokens.layouts(1, x, yb, sc.max_length, sc.drop_oldest_demos)
    for c, (a, b) in enumerate(zip(la, lb, strict=True)):
        assert a.drop == b.drop == 0
        n = min(common_prefix(a.ids, b.ids), a.n_prompt - 1, b.n_prompt - 1)
        total += n - len(sc.tokens.entry_ids(c, 0))
    return total


@pytest.mark.parametrize("dtype,calibration,budget", [
    ("float32", "none", 100_000), ("float32", "content_free", 300),
    ("bf16-mixed", "none", 100_000)])
def test_pairs_share_the_query_and_keep_every_bit(loaded, dtype, calibration, budget):
    model, tok = loaded(dtype)
    kw = dict(OPTS, calibration=calibration, token_budget=budget, return_token_stats=True)
    shared = ICQSScorer(model, tok, GOOD, BAD, **kw)
    assert shared.shares_query  # the tiny Llama on the CPU: the one-pass cascade
    got = list(score_pairs(shared, PAIRS))
    whole = ICQSScorer(model, tok, GOOD, BAD, **kw)
    before = list(score_pairs(whole, PAIRS, share_query=False))
    alone = ICQSScorer(model, tok, GOOD, BAD, **kw)
    for (x, ya, yb), g, w in zip(PAIRS, got, before, strict=True):
        for res, old, y in ((g.result_a, w.result_a, ya), (g.result_b, w.result_b, yb)):
            one = alone.score_one(x, y)
            assert _same(res, one) and _same(old, one), (dtype, x[:20], y)
        assert (g.score_a, g.score_b, g.preferred) == (w.score_a, w.score_b, w.preferred)
    # What ran once instead of twice: every pair's shared tokens, once per context.
    saved = sum(_shared_tokens(shared, *p) for p in PAIRS)
    assert shared.seam_fallbacks == 0  # every row continues its context's entry
    assert whole.suffix_tokens - shared.suffix_tokens == saved
    q = [len(tok(x, add_special_tokens=False).input_ids) for x, _, _ in PAIRS]
    assert saved >= shared.n_contexts * (sum(q) - 2 * len(PAIRS))  # x itself, at least


def test_query_tokens_run_once_per_pair_and_context(loaded, monkeypatch):
    """Counted at the forwards: each pair's query segment is one row of a forward of its own
    per context (kept for that batch only), and each output's rows then hold its own tokens."""
    import icqs_fast.engine.scorer as scorer_mod

    model, tok = loaded("float32")
    seen = []
    real = scorer_mod.suffix_hidden

    def spy(model_, bank, entries, suffixes, *a, capture=None, **k):
        seen.append((capture is not None, [tuple(s) for s in suffixes]))
        return real(model_, bank, entries, suffixes, *a, capture=capture, **k)

    monkeypatch.setattr(scorer_mod, "suffix_hidden", spy)
    sc = ICQSScorer(model, tok, GOOD, BAD, **OPTS)
    list(score_pairs(sc, PAIRS))
    segs = [s for cap, rows in seen if cap for s in rows]
    own = [s for cap, rows in seen if not cap for s in rows]
    assert len(segs) == len(PAIRS) * sc.n_contexts
    assert len(own) == 2 * len(PAIRS) * sc.n_contexts
    q = len(tok(LONG, add_special_tokens=False).input_ids)
    # The long query's tokens are in its segments (one per context), in no output's row.
    assert sum(len(s) >= q - 2 for s in segs) == sc.n_contexts
    assert max(map(len, own)) < q / 2


def test_share_query_changes_nothing_off_the_one_pass_path(loaded, monkeypatch):
    """Where cascade attention does not run as one pass (forced to the torch path here, as on
    a GPU), ``share_query`` is a no-op: the same rows as without it."""
    from icqs_fast.engine.cascade import ATTENTION_ENV

    monkeypatch.setenv(ATTENTION_ENV, "torch")
    model, tok = loaded("float32")
    sc = ICQSScorer(model, tok, GOOD, BAD, **OPTS)
    assert not sc.shares_query
    got = list(score_pairs(sc, PAIRS[1:3]))
    plain = ICQSScorer(model, tok, GOOD, BAD, **OPTS)
    want = list(score_pairs(plain, PAIRS[1:3], share_query=False))
    assert sc.suffix_tokens == plain.suffix_tokens
    assert [(g.score_a, g.score_b) for g in got] == [(w.score_a, w.score_b) for w in want]
