"""Scores that survive a change of hardware: the tie-aware score, the margin
diagnostics, the agreement table of ``eval --stability`` and the output fields."""

import json

import pytest
import torch
from _helpers import tiny_llama

from icqs_fast.engine.calibration import icqs_margins, icqs_scores
from icqs_fast.engine.reference import icqs_naive
from icqs_fast.engine.scorer import ICQSScorer, summarise
from icqs_fast.engine.settings import TIE_EPSILON, ScoringSettings
from icqs_fast.evals import stability

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RATIOS = [0.0, 0.25, 0.5, 0.75, 1.0]
GOOD = [("the movie was great", "positive"), ("I loved it", "positive"), ("dull", "negative"),
        ("a tedious, overlong mess", "negative")]
BAD = [("terrible film", "positive"), ("boring", "positive"), ("wonderful", "negative"),
       ("a joyous celebration", "negative")]
RESPONSES = [("a wonderful time", "positive"), ("awful", "negative"),
             ("a long, slow film", "positive")]
SMALL = dict(num_ratios=3, demos_per_set=2, sets_per_ratio=2, seed=1)


def test_tied_score_hand_checked():
    """Ratios within epsilon of the best are averaged; a clear winner gives the argmax score;
    epsilon 0 is the argmax (bar exact ties)."""
    ll = torch.tensor([[-5.0, -1.00], [-1.00, -3.0], [-1.05, -1.02], [-9.0, -1.5],
                       [-9.0, -9.0]], dtype=torch.float64)
    s, per = icqs_scores(ll, RATIOS, "tied", 0.1)
    # mean over sets: [-3, -2, -1.035, -5.25, -9]: only ratio 0.5 is within 0.1 of its best
    assert s == 0.5
    # set 0: -1.00 (0.25) and -1.05 (0.5) tie; set 1: -1.00 (0.0) and -1.02 (0.5)
    assert per == [pytest.approx(0.375), pytest.approx(0.25)]
    assert icqs_scores(ll, RATIOS, "tied", 0.0) == icqs_scores(ll, RATIOS, "argmax")
    # Rounding that reorders two near-equal contexts cannot move the tied score.
    ll2 = ll.clone()
    ll2[2, 0] = -0.99
    assert icqs_scores(ll2, RATIOS, "argmax")[1][0] != icqs_scores(ll, RATIOS, "argmax")[1][0]
    assert icqs_scores(ll2, RATIOS, "tied", 0.1)[1][0] == per[0]


def test_margins_hand_checked():
    ll = torch.tensor([[-5.0, -1.0], [-1.0, -3.0], [-1.25, -1.5]], dtype=torch.float64)
    m, per = icqs_margins(ll)
    assert per == [pytest.approx(0.25), pytest.approx(0.5)]
    assert m == pytest.approx(-1.375 - (-2.0))  # means [-3, -2, -1.375]
    r = summarise(0, ll, RATIOS[:3], 1, torch.zeros(3, 2), torch.zeros(3, 2), None,
                  tie_epsilon=0.3)
    assert r.margins == per and r.margin == pytest.approx(m) and r.near_ties == 1


def test_settings_tie_epsilon():
    s = ScoringSettings()
    assert s.tie_epsilon == TIE_EPSILON
    # Only the tied score depends on it: other scores' fingerprints (and resumes) are unchanged.
    assert "tie_epsilon" not in s.fingerprint()
    assert "tie_epsilon" not in s.replace(tie_epsilon=0.5).fingerprint()
    tied = s.replace(score="tied")
    assert tied.fingerprint()["tie_epsilon"] == TIE_EPSILON
    assert tied.replace(tie_epsilon=0.5).fingerprint() != tied.fingerprint()
    assert ScoringSettings.from_dict(tied.replace(tie_epsilon=0.2).asdict()).tie_epsilon == 0.2
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="--tie-epsilon"):
            ScoringSettings(tie_epsilon=bad)


def test_engine_tied_score_and_margins_match_reference():
    model, tok = tiny_llama(device="cpu")
    st = ScoringSettings(**SMALL, score="tied", tie_epsilon=0.05)
    got = list(ICQSScorer(model, tok, GOOD, BAD, st).score(RESPONSES))
    ref = icqs_naive(model, tok, GOOD, BAD, RESPONSES, st, compute_dtype=torch.float64)
    for g, r in zip(got, ref, strict=True):
        assert g.score_kind == "tied" and g.tie_epsilon == 0.05
        assert g.score == pytest.approx(r.score, abs=1e-9)
        assert g.margins == pytest.approx(r.margins, abs=1e-4)
        assert g.near_ties == sum(m < 0.05 for m in g.margins)


def test_agreement_table_and_parse():
    model, tok = tiny_llama(device="cpu")
    st = ScoringSettings(**SMALL)
    a, _, la = stability.score_side(model, tok, GOOD, BAD, RESPONSES, st)
    b, _, lb = stability.score_side(model, tok, GOOD, BAD, RESPONSES, st,
                                    stability.parse_config("bfloat16"))
    assert la.startswith("float32") and lb.startswith("bfloat16")
    same = stability.agreement(a, a, 0.1)
    for k in ("argmax", "tied", "mean"):
        assert same["kinds"][k]["same"] == 1.0 and same["kinds"][k]["max_change"] == 0.0
    assert same["noise"]["loglik"]["max"] == 0.0
    doc = stability.agreement(a, b, 0.1)
    assert doc["n"] == 3 and 0 < doc["noise"]["loglik"]["max"] < 5
    # The mean score moves with any rounding; the table says by how much.
    assert doc["kinds"]["mean"]["max_change"] > 0
    text = stability.table(doc)
    assert text.splitlines()[0].split()[:3] == ["score", "same", "<=0.01"]
    assert "gap l_j - l_k change" in text
    assert stability.parse_config("cpp") == {"backend": "cpp"}
    assert stability.parse_config("budget=64") == {"token_budget": 64}
    assert stability.parse_config("deterministic") == {"deterministic": True}
    for bad in ("bf17", "budget=0", "budget=x"):
        with pytest.raises(ValueError, match="--stability"):
            stability.parse_config(bad)


@pytest.mark.slow
def test_eval_stability_end_to_end(tmp_path, capsys, tiny_llama_dir):
    """``eval fpb --stability deterministic`` on a tiny model: both sides scored, the table per
    score kind (the deterministic mode agrees with the default to rounding), AUC per side."""
    from test_study import _write_fpb

    from icqs_fast.cli import main

    _write_fpb(tmp_path)
    model = tiny_llama_dir()
    argv = ["eval", "fpb", "--data", str(tmp_path), "--model", str(model), "--limit", "2",
            "--pool", "2", "--demos-per-set", "2", "--num-ratios", "3", "--sets", "2",
            "--n-boot", "50", "--quiet", "--stability", "deterministic", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["side_b"].endswith("deterministic") and doc["n"] == 8
    assert set(doc["kinds"]) == {"argmax", "tied", "mean"}
    assert doc["kinds"]["argmax"]["within"] == 1.0
    assert set(doc["auc"]) == {f"{s}/{k}" for s in "ab" for k in ("argmax", "tied", "mean")}
    assert main(argv[:-1]) == 0
    assert "score       same" in capsys.readouterr().out
    assert main([*argv[:-3], "--stability", "fp8"]) == 2
    assert "--stability 'fp8'" in capsys.readouterr().err


def test_readable_scale_keeps_the_mean_scores_ranking():
    """``slope`` / ``p_good`` are strictly increasing in the posterior-mean score (the same
    ranking), 0 / 0.5 at no preference, and spread values that crowd near 0.5."""
    from icqs_fast.engine.calibration import implied_slope

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(200):
        ll = torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.3
        r = summarise(0, ll, RATIOS, 1, torch.zeros(5, 4), torch.zeros(5, 4), None,
                      score_kind="mean")
        rows.append((r.score, r.slope, r.p_good))
    rows.sort()
    slopes = [s for _, s, _ in rows]
    assert all(a < b for a, b in zip(slopes, slopes[1:], strict=False))
    assert all(0.0 < p < 1.0 for *_, p in rows)
    assert implied_slope(0.5, RATIOS) == pytest.approx(0.0, abs=1e-12)
    # The posterior of the implied slope has the score as its mean (the definition).
    for m in (0.3, 0.52, 0.8):
        b = implied_slope(m, RATIOS)
        q = torch.softmax(b * torch.tensor(RATIOS, dtype=torch.float64), 0)
        assert float((q * torch.tensor(RATIOS, dtype=torch.float64)).sum()) == \
            pytest.approx(m, abs=1e-12)
    spread = (max(p for *_, p in rows) - min(p for *_, p in rows))
    # d p_good / d mean = sigmoid'(0) / Var(r) = 2 at the middle (5 ratios), less further out.
    assert spread > 1.5 * (rows[-1][0] - rows[0][0])
    assert implied_slope(1.0, RATIOS) == 50.0 and implied_slope(0.0, RATIOS) == -50.0
