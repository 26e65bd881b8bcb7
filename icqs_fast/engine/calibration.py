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

``score`` (same object): ``"argmax"`` (the paper: ``r_k``, ``k = argmax_j``) or ``"mean"`` (the
posterior mean ``sum_j q_j r_j``, ``q = softmax_j(mean_l l_{j,l})`` for ICQS-Epistemic and
``softmax_j(l_{j,l})`` per set: a uniform prior over the ratios, whose mode is the argmax score).
"""

from __future__ import annotations

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


def icqs_scores(loglik: torch.Tensor, ratios: Sequence[float], kind: str = "argmax"
                ) -> tuple[float, list[float]]:
    """``(score, score_per_set)`` of the (calibrated) ``loglik`` ``[M+1, L]``: ICQS-Epistemic
    from ``mean_l loglik[j, l]``, plain ICQS from each column; ``kind`` "argmax" (the ratio of
    the most likely context) or "mean" (the posterior mean of the ratio, in [0, 1])."""
    ll = loglik.double()
    if kind == "argmax":
        per_set = [float(ratios[int(k)]) for k in torch.argmax(ll, dim=0)]
        return float(ratios[int(torch.argmax(ll.mean(dim=1)))]), per_set
    if kind != "mean":
        raise ValueError(f"score must be 'argmax' or 'mean', got {kind!r}")
    r = torch.tensor([float(v) for v in ratios], dtype=torch.float64)
    lo, hi = float(r.min()), float(r.max())
    per_set = (torch.softmax(ll, dim=0) * r[:, None]).sum(dim=0).clamp(lo, hi)
    score = float((torch.softmax(ll.mean(dim=1), dim=0) * r).sum().clamp(lo, hi))
    return score, [float(v) for v in per_set]
