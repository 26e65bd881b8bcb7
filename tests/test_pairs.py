"""Pairs as judges are evaluated (issue 50, part 2; the library subset): both outputs of a pair
in one scoring stream, ``preferred`` / margin / P(a better) declared once, pairwise accuracy with
its interval, and the length judge beside it - on LLMBar's natural set."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
from _helpers import skip_unless_in_ci, tiny_llama

from icqs_fast.engine.pairs import (
    length_preferences,
    p_a_better,
    pairwise_accuracy,
    score_pairs,
)
from icqs_fast.io.schema import PAIR_FIELDS, pair_row

LLMBAR = Path(__file__).resolve().parents[2] / "shared" / "data" / "llmbar" / "natural.json"


@dataclass
class Res:
    score: float
    p_good_calibrated: float | None = None


class Fake:
    """A scorer whose score is the response's length: what it was asked, in order."""

    def __init__(self, p=None):
        self.seen, self.calls, self.p = [], 0, p

    def score(self, items):
        self.calls += 1
        for x, y in items:
            self.seen.append((x, y))
            yield Res(float(len(y)), None if self.p is None else self.p(y))


def test_both_outputs_in_one_stream_and_the_declared_fields():
    fake = Fake(p=lambda y: min(0.9, 0.1 * len(y)))
    pairs = [("q1", "aaaa", "bb"), ("q2", "c", "ddd"), ("q3", "ee", "ff")]
    got = list(score_pairs(fake, pairs, tie_margin=0.5))
    assert fake.calls == 1  # one stream: one prefix bank for every output of every pair
    assert fake.seen == [("q1", "aaaa"), ("q1", "bb"), ("q2", "c"), ("q2", "ddd"),
                         ("q3", "ee"), ("q3", "ff")]
    assert [r.preferred for r in got] == ["a", "b", "tie"]
    assert [r.margin for r in got] == [2.0, -2.0, 0.0]
    pa, pb = 0.4, 0.2
    assert got[0].p_a_better == pytest.approx(pa * (1 - pb) / (pa * (1 - pb) + pb * (1 - pa)))
    assert got[2].p_a_better == pytest.approx(0.5)
    row = pair_row(got[0])
    assert list(row) == [f.name for f in PAIR_FIELDS]
    assert row["preferred"] == "a" and row["score_a"] == 4.0
    # Without a self-check map: no P(a better), and the field is left out.
    plain = next(score_pairs(Fake(), pairs[:1]))
    assert plain.p_a_better is None and "p_a_better" not in pair_row(plain)
    with pytest.raises(ValueError, match="tie_margin"):
        list(score_pairs(Fake(), pairs, tie_margin=-1))


def test_p_a_better_and_accuracy_with_its_interval():
    assert p_a_better(0.5, 0.5) == 0.5 and p_a_better(1.0, 1.0) == 0.5
    assert p_a_better(0.9, 0.1) > 0.98 and p_a_better(None, 0.3) is None
    acc, lo, hi = pairwise_accuracy(["a", "b", "tie", "a"], ["a", "a", "b", "a"], n_boot=500)
    assert acc == pytest.approx((1 + 0 + 0.5 + 1) / 4) and lo <= acc <= hi
    assert pairwise_accuracy(["a"] * 30, ["a"] * 30)[1:] == (1.0, 1.0)
    with pytest.raises(ValueError, match="'a' or 'b'"):
        pairwise_accuracy(["a"], ["c"])
    assert length_preferences([("x", "ab", "abc"), ("x", "abcd", "a"), ("x", "a", "b")]) == [
        "a", "b", "tie"]
    assert length_preferences([("x", "ab", "abc")], shorter=False) == ["b"]


def _llmbar():
    if not LLMBAR.exists():
        skip_unless_in_ci("LLMBar data (../shared/data/llmbar) missing")
    rows = json.loads(LLMBAR.read_text(encoding="utf-8"))
    pairs = [(r["input"], r["output_1"], r["output_2"]) for r in rows]
    better = ["a" if int(r["label"]) == 1 else "b" for r in rows]
    return pairs, better


@pytest.mark.slow
def test_llmbar_natural_pairs_with_the_length_judge_beside():
    """Demonstrations from the first 60 pairs (good = the better output, bad = the worse),
    the other 40 judged: pairwise accuracy with its interval, the length judge's beside it,
    each pair's two outputs scored in the same stream."""
    from icqs_fast.engine.scorer import ICQSScorer

    pairs, better = _llmbar()
    assert len(pairs) == 100
    train, test = range(60), range(60, 100)
    good = [(pairs[i][0], pairs[i][1 if better[i] == "a" else 2]) for i in train]
    bad = [(pairs[i][0], pairs[i][2 if better[i] == "a" else 1]) for i in train]
    model, tok = tiny_llama(device="cpu")
    scorer = ICQSScorer(model, tok, good, bad, num_ratios=2, demos_per_set=1,
                        sets_per_ratio=1, seed=0, drop_oldest_demos=True)
    judged = list(score_pairs(scorer, [pairs[i] for i in test]))
    assert len(judged) == 40 and all(math.isfinite(r.margin) for r in judged)
    truth = [better[i] for i in test]
    acc, lo, hi = pairwise_accuracy([r.preferred for r in judged], truth, n_boot=500)
    assert 0.0 <= lo <= acc <= hi <= 1.0 and hi - lo < 0.5
    short = length_preferences([pairs[i] for i in test])
    s_acc, s_lo, s_hi = pairwise_accuracy(short, truth, n_boot=500)
    # The length judge's accuracy is exactly the share of pairs whose better output is the
    # shorter (no tie in these 40).
    assert s_acc == sum((len(pairs[i][1]) < len(pairs[i][2])) == (better[i] == "a")
                        for i in test) / 40
    assert s_lo <= s_acc <= s_hi
