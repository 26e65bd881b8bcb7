"""The trivial scorers a self-check compares ICQS with, on the same held-out items.

On some tasks the good answers are simply the shorter ones (or the ones the model finds more
likely without any demonstration), and a user cannot tell from ICQS's AUC alone that a one-line
rule does better. So every self-check (:func:`icqs_fast.engine.selfcheck.fit_self_check`)
scores the same held-out items with each baseline of :data:`BASELINES`:

* ``length_tokens`` / ``length_chars``: the response's length in tokens (the scorer's
  tokenizer, the response part alone) and in characters;
* ``logprob_sum`` / ``logprob_mean``: the response's summed and per-token log-probability
  with **no demonstrations** (the template's query alone before it: one short forward per
  item, :func:`item_values`), and ``entropy_mean``, the mean next-token entropy over the
  response, from the same forward (a glass-box feature at no extra forward);
* ``loglik_good_sum`` / ``loglik_good_mean``: the response's raw log-likelihood under the
  all-good demonstration sets (the clean ones), which ICQS's own forward already holds
  (:func:`icqs_fast.engine.crossfit.free_values`: no forward at all).

A baseline has no known direction (longer may be better or worse), so its direction is fitted
out of fold: per fold of the self-check's stratified folds, the sign that gives the larger AUC
on the other folds is applied to the fold (:func:`out_of_fold_signs`). Its AUC and bootstrap
interval then come from :func:`icqs_fast.metrics.auc_stratified_ci` with the self-check's
resamples, level and seed. :func:`length_matched_auc` gives ICQS's AUC over good / bad pairs of
the same length stratum only: how much of its score is length. :func:`beaten_by` is the plain
sentence when a baseline's interval lies above ICQS's.

The per-item values are cached beside the cross-fitted scores
(:mod:`icqs_fast.engine.selfcheck_cache`), so a second ``check`` runs no forward for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from icqs_fast.engine.prompt_tokens import first_response_token

if TYPE_CHECKING:
    from icqs_fast.engine.scorer import ICQSScorer

__all__ = ["BASELINES", "LENGTH_STRATA", "Baseline", "baseline_aucs", "beaten_by",
           "item_values", "length_matched_auc", "out_of_fold_signs"]


@dataclass(frozen=True)
class Baseline:
    """One trivial scorer: its ``name`` (the key in the meta file and the tables) and what it
    is, in words (``text``); ``forward``: it needs the no-demonstration forward."""

    name: str
    text: str
    forward: bool


# Every baseline, declared once: the meta file's ``self_check.baselines``, ``check``'s table,
# the summary, the report page and the docs take their names and words from here.
BASELINES = (
    Baseline("length_tokens", "response length in tokens", False),
    Baseline("length_chars", "response length in characters", False),
    Baseline("logprob_sum", "summed log-prob of the response, no demonstrations", True),
    Baseline("logprob_mean", "mean log-prob per response token, no demonstrations", True),
    Baseline("entropy_mean", "mean next-token entropy over the response, no demonstrations",
             True),
    Baseline("loglik_good_sum", "summed log-likelihood under the all-good demonstration "
             "sets (ICQS's own forward)", False),
    Baseline("loglik_good_mean", "log-likelihood per response token under the all-good "
             "demonstration sets (ICQS's own forward)", False),
)
# Length strata of the length-matched AUC: quantile bins of the held-out items' token length.
LENGTH_STRATA = 4
# What to try when a baseline beats ICQS (said after the sentence naming them).
TRY = ("try a length-balanced pool (good and bad answers of like lengths), the glass-box "
       "features ('icqs-fast features'), or a larger --model")


def item_values(scorer: ICQSScorer, items: Sequence[tuple[str, str]]) -> list[dict[str, float]]:
    """Per item, the value of every baseline of :data:`BASELINES` (:func:`baseline_aucs` fits
    their directions): lengths from the scorer's tokenizer, log-probs and entropy from one
    forward of ``template prefix (no demonstrations) + query + response`` tokenized whole
    (through :func:`icqs_fast.engine.continuations.score_continuations`)."""
    from icqs_fast.engine.continuations import score_continuations

    tokens, template = scorer.tokens, scorer.template
    head = template.format_prefix([])
    requests, at = [], []
    out: list[dict[str, float]] = []
    for i, (x, y) in enumerate(items):
        prompt = head + template.format_query(x)
        (ids, offs), = tokens.tokenize([prompt + template.format_response(y)])
        k = first_response_token(offs, len(prompt))
        ctx, cont = tokens.bos + ids[:k], ids[k:]
        out.append({"length_tokens": float(len(tokens.encode(template.format_response(y)))),
                    "length_chars": float(len(y)), "logprob_sum": math.nan,
                    "logprob_mean": math.nan, "entropy_mean": math.nan})
        if ctx and cont:  # else (no token before the seam) no log-prob baseline: NaN
            requests.append((ctx, cont))
            at.append(i)
    results = score_continuations(scorer.model, requests, return_token_stats=True,
                                  backend=scorer.settings.backend)
    for i, res in zip(at, results, strict=True):
        ent = res.stats.entropy.double() if res.stats is not None else None
        out[i].update({"logprob_sum": float(res.loglik),
                       "logprob_mean": float(res.loglik) / max(res.n_tokens, 1),
                       "entropy_mean": float(ent.mean()) if ent is not None and ent.numel()
                       else math.nan})
    return out


def out_of_fold_signs(values: np.ndarray, labels: np.ndarray, folds: int, seed: int
                      ) -> np.ndarray:
    """``values`` with each fold's sign fitted on the other folds (stratified folds shuffled
    with ``seed``, as the self-check's own): +1 where the other folds' AUC of ``values`` is at
    least 0.5, else -1. What a user who fitted "longer is better" (or worse) on part of the
    pools would get on the rest."""
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold

    k = min(folds, int((labels == 1).sum()), int((labels == 0).sum()))
    out = np.full(values.shape, np.nan)
    for tr, te in StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(
            values, labels):
        ok = np.isfinite(values[tr])
        ytr = labels[tr][ok]
        up = (len(set(ytr.tolist())) < 2
              or roc_auc_score(ytr, values[tr][ok]) >= 0.5)
        out[te] = values[te] if up else -values[te]
    return out


def baseline_aucs(values: Sequence[dict[str, float]], labels: np.ndarray, *, folds: int,
                  seed: int, n_boot: int, level: float) -> list[dict[str, Any]]:
    """Per baseline of :data:`BASELINES` with finite values: ``{"name", "text", "auc",
    "auc_lo", "auc_hi", "direction"}`` - the AUC of its out-of-fold signed values
    (:func:`out_of_fold_signs`) with the self-check's bootstrap interval (same resamples,
    level and seed), and the direction the whole pools favour ("higher" / "lower")."""
    from icqs_fast import metrics

    y = np.asarray(labels, dtype=np.int64)
    out = []
    for b in BASELINES:
        v = np.array([row.get(b.name, math.nan) for row in values], dtype=np.float64)
        if v.shape != y.shape or not np.isfinite(v).all():
            continue
        signed = out_of_fold_signs(v, y, folds, seed)
        auc, lo, hi = metrics.auc_stratified_ci(y, signed, n_resamples=n_boot, level=level,
                                                seed=seed)
        whole = metrics.auc(y, v)
        out.append({"name": b.name, "text": b.text, "auc": float(auc), "auc_lo": float(lo),
                    "auc_hi": float(hi), "direction": "higher" if whole >= 0.5 else "lower"})
    return out


def length_matched_auc(scores: np.ndarray, labels: np.ndarray, lengths: np.ndarray, *,
                       n_boot: int, level: float, seed: int,
                       strata: int = LENGTH_STRATA) -> dict[str, Any] | None:
    """ICQS's AUC over the good / bad pairs of the same length stratum only (``strata``
    quantile bins of ``lengths``), with a bootstrap interval resampling each stratum's good and
    bad items on their own: ``{"auc", "auc_lo", "auc_hi", "strata", "pairs"}``, or None when
    no stratum holds both classes. Near ICQS's AUC: little of the score is length; near 0.5:
    most of it is."""
    from icqs_fast.metrics import bootstrap_distribution, percentile_interval

    s, y, n = (np.asarray(a, dtype=np.float64) for a in (scores, labels, lengths))
    edges = np.unique(np.quantile(n, np.linspace(0, 1, strata + 1)[1:-1]))
    bins = np.searchsorted(edges, n, side="right")
    groups = []
    for b in np.unique(bins):
        pos, neg = s[(bins == b) & (y == 1)], s[(bins == b) & (y == 0)]
        if pos.size and neg.size:
            groups += [pos, neg]
    if not groups:
        return None

    def pooled(*g: np.ndarray) -> float:
        wins = pairs = 0.0
        for pos, neg in zip(g[::2], g[1::2], strict=True):
            d = pos[:, None] - neg[None, :]
            wins += float((d > 0).sum() + 0.5 * (d == 0).sum())
            pairs += d.size
        return wins / pairs

    vals = bootstrap_distribution(pooled, *groups, paired=False, n_resamples=n_boot,
                                  seed=seed)
    lo, hi, _ = percentile_interval(vals, level)
    return {"auc": pooled(*groups), "auc_lo": lo, "auc_hi": hi, "strata": len(groups) // 2,
            "pairs": int(sum(a.size * b.size for a, b in zip(groups[::2], groups[1::2],
                                                               strict=True)))}


def beaten_by(baselines: Sequence[dict[str, Any]], auc: float, auc_lo: float,
              auc_hi: float) -> str:
    """The plain sentence when some baseline's AUC interval lies above ICQS's (the best such
    baseline named, both AUCs with intervals, what to try); "" when none does."""
    above = [b for b in baselines if b["auc_lo"] > auc_hi]
    if not above:
        return ""
    b = max(above, key=lambda r: r["auc"])
    way = "shorter" if b["direction"] == "lower" and b["name"].startswith("length") else None
    hint = f" (the {way} answer is the good one)" if way else ""
    return (f"{b['text']} beats ICQS on these pools{hint}: AUC {b['auc']:.3f} "
            f"[{b['auc_lo']:.3f}, {b['auc_hi']:.3f}] against ICQS's {auc:.3f} "
            f"[{auc_lo:.3f}, {auc_hi:.3f}]; {TRY}")
