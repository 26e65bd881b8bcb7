"""Calibrated ICQS: what the log-likelihoods are normalised by, and the continuous score.

``calibration`` (a :class:`~icqs_fast.engine.settings.ScoringSettings` field):

* ``"none"``: ``l_{j,l} = log P(y | demos_{j,l}, x)`` as in the paper.
* ``"content_free"`` (contextual calibration, Zhao et al. 2021, "Calibrate Before Use"):
  ``l_{j,l} - mean_cf log P(y | demos_{j,l}, x_cf)``, each content-free input ``x_cf`` of
  ``settings.content_free`` put in the template's query in place of ``x``. The context's own
  prior for the answer cancels: a context the model likes for ``y`` whatever the input no longer
  wins for that alone.
* ``"pmi"`` (domain-conditional PMI, Holtzman et al. 2021, "Surface Form Competition"):
  ``l_{j,l} - log P(y | demos_{j,l}, premise)``, the short domain premise
  (:meth:`ScoringSettings.premise`, e.g. "Answer:") replacing the whole query.

The baseline term depends on (context, y) only, never on ``x``: the engine scores each
(query, y) pair once per context and caches it (:class:`icqs_fast.engine.scorer.ICQSScorer`), so
label-like answers add almost nothing; free-text answers add one row per query and context.

``score`` (same object): ``"argmax"`` (the paper: ``r_k``, ``k = argmax_j``), ``"tied"`` (tie-aware
argmax: the mean of the ratios ``r_j`` whose ``l_j`` lies within ``tie_epsilon`` nats of the
best; equal to the argmax score whenever the best leads by more than ``tie_epsilon``, and it
cannot jump from one ratio to a distant one when a rounding change of less than that reorders
two near-equal contexts) or ``"mean"`` (the posterior mean ``sum_j q_j r_j``,
``q = softmax_j(mean_l l_{j,l})`` for ICQS-Epistemic and ``softmax_j(l_{j,l})`` per set: a
uniform prior over the ratios, whose mode is the argmax score).

Stability diagnostics (:func:`icqs_margins`): per set, the margin in nats between the best and
the second mixture ratio; a set whose margin is below the noise level (``tie_epsilon``) has an
argmax that rounding may decide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from icqs_fast.engine.prompts import Template
from icqs_fast.engine.settings import ScoringSettings


def calibration_queries(st: ScoringSettings) -> list[tuple[Template, str]]:
    """The (template, x) pairs whose ``log P(y | demos, template.format_query(x))`` make the
    baseline of ``st.calibration`` (empty for "none"): the settings' template with each
    content-free input, or, for "pmi", a template whose query is the bare premise."""
    tpl = st.template
    if st.calibration == "content_free":
        return [(tpl, x) for x in st.content_free]
    if st.calibration == "pmi":
        bare = Template(demo=tpl.demo, query="{x}", response=tpl.response,
                        separator=tpl.separator, system=tpl.system)
        return [(bare, st.premise())]
    return []


def icqs_scores(loglik: torch.Tensor, ratios: Sequence[float], kind: str = "argmax",
                tie_epsilon: float = 0.1) -> tuple[float, list[float]]:
    """``(score, score_per_set)`` of the (calibrated) ``loglik`` ``[M+1, L]``: ICQS-Epistemic
    from ``mean_l loglik[j, l]``, plain ICQS from each column; ``kind`` "argmax" (the ratio of
    the most likely context), "tied" (the mean ratio of the contexts within ``tie_epsilon``
    nats of the most likely) or "mean" (the posterior mean of the ratio, in [0, 1])."""
    ll = loglik.double()
    if kind == "argmax":
        per_set = [float(ratios[int(k)]) for k in torch.argmax(ll, dim=0)]
        return float(ratios[int(torch.argmax(ll.mean(dim=1)))]), per_set
    r = torch.tensor([float(v) for v in ratios], dtype=torch.float64)
    if kind == "tied":
        def tied(col: torch.Tensor) -> float:
            near = col >= col.max() - tie_epsilon
            return float(r[near].mean())

        return tied(ll.mean(dim=1)), [tied(ll[:, j]) for j in range(ll.shape[1])]
    if kind != "mean":
        raise ValueError(f"score must be 'argmax', 'tied' or 'mean', got {kind!r}")
    lo, hi = float(r.min()), float(r.max())
    per_set = (torch.softmax(ll, dim=0) * r[:, None]).sum(dim=0).clamp(lo, hi)
    score = float((torch.softmax(ll.mean(dim=1), dim=0) * r).sum().clamp(lo, hi))
    return score, [float(v) for v in per_set]


def implied_slope(mean: float, ratios: Sequence[float]) -> float:
    """The readable scale of the posterior-mean score: the slope ``b`` (nats per unit of mixture
    ratio) of the log-linear posterior ``q_j ~ exp(b r_j)`` whose mean is ``mean``.

    The mean of that posterior rises strictly with ``b`` (it is an exponential family in ``b``),
    so ``b`` is a strictly increasing function of the score: it keeps the ranking exactly while
    spreading the values that crowd near the middle. Read it as "the response's log-likelihood
    rises by ``b`` nats from all-bad to all-good demonstrations" (``b = 0``: no preference);
    ``sigmoid(b)`` (:attr:`ICQSResult.p_good`) is then the posterior probability of the
    all-good context against the all-bad one. Clamped to ``[-50, 50]`` at the ends of the
    ratio range. Solved by bisection in float64 (60 steps: exact to rounding)."""
    r = torch.tensor([float(v) for v in ratios], dtype=torch.float64)
    lo_r, hi_r = float(r.min()), float(r.max())
    if not math.isfinite(mean):
        return float("nan")
    if mean <= lo_r:
        return -50.0
    if mean >= hi_r:
        return 50.0
    lo, hi = -50.0, 50.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if float((torch.softmax(mid * r, 0) * r).sum()) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def icqs_margins(loglik: torch.Tensor) -> tuple[float, list[float]]:
    """Stability diagnostics of the (calibrated) ``loglik`` ``[M+1, L]``: ``(margin, margins)``,
    the gap in nats between the best and the second mixture ratio of ``mean_l loglik`` (what
    ICQS-Epistemic's argmax decides on) and of each set's column. A margin below the rounding
    noise of the configuration (``tie_epsilon``) is an argmax that a change of dtype, backend or
    batch may flip."""
    ll = loglik.double()
    top = ll.topk(2, dim=0).values  # [2, L]
    epi = ll.mean(dim=1).topk(2).values
    return float(epi[0] - epi[1]), [float(v) for v in top[0] - top[1]]
