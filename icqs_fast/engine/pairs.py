"""Pairs as judges are evaluated: which of two answers to one instruction is better.

LLMBar, MT-Bench pairwise, reward-model benchmarks and A/B tests give an instruction ``x`` and
two outputs ``y_a``, ``y_b``. :func:`score_pairs` scores both outputs of every pair in ONE
stream of the scorer (one prefix bank: the demonstration prefixes are computed once for all
pairs; per context the query ``x`` runs once for both outputs, and each output only its own
tokens after it: ``ICQSScorer.score(share_query=True)``, the same bits), and gives per pair a
:class:`PairResult`: both scores, ``preferred`` ("a", "b", or "tie" within ``tie_margin``), the
margin, and P(a better) from the self-check's calibrated P(good) of each output when the scorer
has one (:attr:`~icqs_fast.engine.scorer.ICQSScorer.self_check`). The fields are declared once, in
:data:`icqs_fast.io.schema.PAIR_FIELDS` (:func:`icqs_fast.io.schema.pair_row`).

:func:`pairwise_accuracy` is the share of pairs whose ``preferred`` is the labelled better
output (a tie counts half), with a percentile bootstrap interval over pairs
(:func:`icqs_fast.metrics.bootstrap_distribution`); :func:`length_preferences` is the trivial
judge every pairwise result should be read beside: the shorter (or longer) output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from icqs_fast.engine.scorer import ICQSScorer

__all__ = ["PREFERRED", "PairResult", "length_preferences", "p_a_better", "pairwise_accuracy",
           "score_pairs"]

PREFERRED = ("a", "b", "tie")


@dataclass
class PairResult:
    """One pair's judgement.

    Attributes:
        score_a, score_b: ICQS scores of ``y_a`` and ``y_b``.
        preferred: "a", "b", or "tie" when ``|margin| <= tie_margin``.
        margin: ``score_a - score_b``.
        p_a_better: P(a better) from the self-check's P(good) of each output,
            ``pa (1 - pb) / (pa (1 - pb) + pb (1 - pa))`` (a Bradley-Terry reading of two
            independent calibrated probabilities); None without a self-check map.
        result_a, result_b: the two :class:`~icqs_fast.engine.scorer.ICQSResult` s.
    """

    score_a: float
    score_b: float
    preferred: str
    margin: float
    p_a_better: float | None
    result_a: Any = None
    result_b: Any = None


def p_a_better(pa: float | None, pb: float | None) -> float | None:
    """P(a better) of two calibrated P(good) (see :class:`PairResult`); None when either is
    missing, 0.5 when both are certain alike."""
    if pa is None or pb is None or not (math.isfinite(pa) and math.isfinite(pb)):
        return None
    num, other = pa * (1 - pb), pb * (1 - pa)
    return 0.5 if num + other == 0 else num / (num + other)


def score_pairs(scorer: ICQSScorer, pairs: Iterable[tuple[str, str, str]], *,
                tie_margin: float = 0.0, share_query: bool = True) -> Iterator[PairResult]:
    """Judge ``(x, y_a, y_b)`` pairs with an
    :class:`~icqs_fast.engine.scorer.ICQSScorer`, lazily, in input order: both outputs go into
    one scoring stream (``(x, y_a), (x, y_b), ...``), so they share the scorer's prefix bank,
    and with ``share_query`` each context's query states (scores unchanged to the bit; False:
    each output's prompt runs whole after the bank, as a record of its own would).

    Raises:
        ValueError: ``tie_margin`` negative (or the scorer's own errors for a bad output).
    """
    if not tie_margin >= 0:
        raise ValueError(f"tie_margin must be >= 0, got {tie_margin!r}")

    def items() -> Iterator[tuple[str, str]]:
        for x, ya, yb in pairs:
            yield (x, ya)
            yield (x, yb)

    stream = iter(scorer.score(items(), share_query=share_query))
    for ra in stream:
        rb = next(stream)
        margin = float(ra.score) - float(rb.score)
        pref = "tie" if abs(margin) <= tie_margin else ("a" if margin > 0 else "b")
        yield PairResult(float(ra.score), float(rb.score), pref, margin,
                         p_a_better(ra.p_good_calibrated, rb.p_good_calibrated), ra, rb)


def pairwise_accuracy(preferred: Sequence[str], better: Sequence[str], *, n_boot: int = 1000,
                      level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """``(accuracy, lo, hi)``: the share of pairs whose ``preferred`` ("a" / "b" / "tie") is
    the labelled ``better`` ("a" / "b"), a tie counting half, with a percentile bootstrap
    interval over pairs (``n_boot`` resamples, ``seed``)."""
    import numpy as np

    from icqs_fast.metrics import bootstrap_distribution, percentile_interval

    if len(preferred) != len(better) or not preferred:
        raise ValueError(f"pairwise_accuracy: {len(preferred)} judgements for "
                         f"{len(better)} labels")
    bad = sorted({b for b in better if b not in ("a", "b")})
    if bad:
        raise ValueError(f"pairwise_accuracy: the better output is 'a' or 'b', got {bad[0]!r}")
    right = np.array([0.5 if p == "tie" else float(p == b)
                      for p, b in zip(preferred, better, strict=True)])
    vals = bootstrap_distribution(lambda r: r.mean(axis=-1), right, vectorized=True,
                                  n_resamples=n_boot, seed=seed)
    lo, hi, _ = percentile_interval(vals, level)
    return float(right.mean()), lo, hi


def length_preferences(pairs: Sequence[tuple[str, str, str]], *, shorter: bool = True
                       ) -> list[str]:
    """The trivial judge: per pair "a" or "b", whichever output is shorter in characters
    (``shorter=False``: longer), "tie" for equal lengths."""
    out = []
    for _, ya, yb in pairs:
        d = len(ya) - len(yb)
        out.append("tie" if d == 0 else ("a" if (d < 0) == shorter else "b"))
    return out
