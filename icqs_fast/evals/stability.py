"""Scores across configurations: the same responses scored under two configurations (another
dtype, kernel backend, batch-invariant mode or token budget) and how much each ICQS score kind
moves: which kinds that rounding noise alone can flip, so a report can say which to trust.

Every score kind (argmax, tied, mean) is computed from each side's own ``[M+1, L]``
log-likelihoods (:func:`icqs_fast.engine.calibration.icqs_scores`), so one run per side gives
the whole table. Besides the scores, the rounding noise itself: the change of the per-context
log-likelihoods and of the gaps between two ratios' log-likelihoods (what an argmax compares),
and how many sets sit closer to a tie than that noise.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from icqs_fast.backends import BACKENDS
from icqs_fast.engine.calibration import icqs_margins, icqs_scores
from icqs_fast.engine.settings import SCORE_KINDS
from icqs_fast.progress import track

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# A score change at most this large counts as "within" (the stability goal: >= 99 % of records
# within 0.01 between fp32 and bf16).
WITHIN = 0.01
SPEC_HELP = ("float32|bfloat16|float16 (the model in that dtype), torch|cpp|triton (the kernel "
             "backend), deterministic (batch-invariant mode), budget=N (token budget)")


def parse_config(spec: str) -> dict[str, Any]:
    """The other side of a stability run from its ``--stability`` spec (see :data:`SPEC_HELP`):
    ``{"dtype": torch.dtype}``, ``{"backend": str}``, ``{"deterministic": True}`` or
    ``{"token_budget": int}``; ValueError naming the spec otherwise."""
    s = str(spec).strip().lower()
    if s in DTYPES:
        return {"dtype": DTYPES[s]}
    if s in BACKENDS:
        return {"backend": s}
    if s == "deterministic":
        return {"deterministic": True}
    if s.startswith("budget="):
        try:
            n = int(s.split("=", 1)[1])
        except ValueError:
            n = 0
        if n >= 1:
            return {"token_budget": n}
    raise ValueError(f"--stability {spec!r}: expected {SPEC_HELP}")


def score_side(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good: Sequence, bad: Sequence,
               responses: Sequence[tuple[str, str]], settings: Any,
               config: dict[str, Any] | None = None, *, quiet: bool = True,
               desc: str = "ICQS") -> tuple[list, float, str]:
    """Score ``responses`` with ``settings`` changed by ``config`` (a dtype makes a copy of the
    model in that dtype): ``(results, seconds, label)``."""
    from icqs_fast.engine.scorer import ICQSScorer

    config = dict(config or {})
    m = model
    if "dtype" in config:
        m = copy.deepcopy(model).to(config.pop("dtype")).eval()
    st = settings.replace(**config) if config else settings
    p = next(m.parameters())
    label = (f"{str(p.dtype).removeprefix('torch.')}, backend {st.backend}"
             + (", deterministic" if st.deterministic else "")
             + (f", budget {st.token_budget}" if st.token_budget != type(st)().token_budget
                else ""))
    t0 = time.perf_counter()
    sc = ICQSScorer(m, tok, good, bad, st)
    res = list(track(sc.score(responses), total=len(responses), desc=desc, unit="response",
                     quiet=quiet))
    return res, time.perf_counter() - t0, label


def _spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    from scipy.stats import spearmanr

    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def agreement(a: Sequence[Any], b: Sequence[Any], tie_epsilon: float) -> dict[str, Any]:
    """How the scores of the same responses move from side ``a`` to side ``b`` (lists of
    :class:`~icqs_fast.engine.scorer.ICQSResult`, same order).

    Returns:
        ``{"n", "kinds": {kind: {"same", "within", "max_change", "mean_change", "spearman",
        "same_per_set"}}, "noise": {...}, "margins": {...}}``: per score kind the share of
        responses with the identical ICQS-Epistemic score, the share within :data:`WITHIN`, the
        largest and mean absolute change, the Spearman correlation of the scores over the
        responses and the share of identical per-set scores; ``noise``: the absolute change of
        each context's log-likelihood and of each gap ``l_j - l_k`` between two ratios of a set
        (median, p99, max, nats); ``margins``: side ``a``'s per-set margins (median, the share
        below 0.03 nats and below ``tie_epsilon``, and the share of sets whose best ratio
        changes).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"agreement: {len(a)} and {len(b)} results (need the same, >= 1)")
    ratios = list(a[0].ratios)
    kinds: dict[str, Any] = {}
    for kind in SCORE_KINDS:
        sa, sb, pa, pb = [], [], [], []
        for ra, rb in zip(a, b, strict=True):
            s1, p1 = icqs_scores(ra.loglik_calibrated, ratios, kind, tie_epsilon)
            s2, p2 = icqs_scores(rb.loglik_calibrated, ratios, kind, tie_epsilon)
            sa.append(s1)
            sb.append(s2)
            pa += p1
            pb += p2
        d = np.abs(np.asarray(sa) - np.asarray(sb))
        kinds[kind] = {"same": float(np.mean(d == 0)), "within": float(np.mean(d <= WITHIN)),
                       "max_change": float(d.max()), "mean_change": float(d.mean()),
                       "spearman": _spearman(sa, sb),
                       "same_per_set": float(np.mean(np.asarray(pa) == np.asarray(pb)))}
    ll_d, gap_d, margins, flips = [], [], [], []
    for ra, rb in zip(a, b, strict=True):
        la, lb = ra.loglik_calibrated.double(), rb.loglik_calibrated.double()
        ll_d.append((la - lb).abs().flatten())
        # Every pair of ratios within a set: how much rounding moves what an argmax compares.
        ga = la[:, None, :] - la[None, :, :]
        gb = lb[:, None, :] - lb[None, :, :]
        iu = torch.triu_indices(la.shape[0], la.shape[0], 1)
        gap_d.append((ga - gb)[iu[0], iu[1]].abs().flatten())
        margins += icqs_margins(la)[1]
        flips += (la.argmax(0) != lb.argmax(0)).tolist()
    ll_all, gap_all = torch.cat(ll_d).numpy(), torch.cat(gap_d).numpy()
    m = np.asarray(margins)

    def stats(x: np.ndarray) -> dict[str, float]:
        return {"median": float(np.median(x)), "p99": float(np.quantile(x, 0.99)),
                "max": float(x.max())}

    return {"n": len(a), "tie_epsilon": tie_epsilon, "kinds": kinds,
            "noise": {"loglik": stats(ll_all), "gap": stats(gap_all)},
            "margins": {"median": float(np.median(m)), "below_0.03": float(np.mean(m < 0.03)),
                        "below_tie_epsilon": float(np.mean(m < tie_epsilon)),
                        "best_ratio_changed": float(np.mean(flips))}}


def _pct(v: float) -> str:
    return f"{100 * v:5.1f}%"


def table(doc: dict[str, Any]) -> str:
    """The agreement as printed text: one row per score kind, then the noise and margins."""
    lines = [f"{'score':8s} {'same':>7s} {'<=0.01':>7s} {'max chg':>8s} {'mean chg':>9s} "
             f"{'Spearman':>9s} {'per set':>8s}"]
    for kind, k in doc["kinds"].items():
        sp = "-" if k["spearman"] is None else f"{k['spearman']:.4f}"
        lines.append(f"{kind:8s} {_pct(k['same']):>7s} {_pct(k['within']):>7s} "
                     f"{k['max_change']:8.4f} {k['mean_change']:9.5f} {sp:>9s} "
                     f"{_pct(k['same_per_set']):>8s}")
    n, g, mg = doc["noise"]["loglik"], doc["noise"]["gap"], doc["margins"]
    lines.append(f"log-likelihood change per context (nats): median {n['median']:.2g}, p99 "
                 f"{n['p99']:.2g}, max {n['max']:.2g}; gap l_j - l_k change: median "
                 f"{g['median']:.2g}, p99 {g['p99']:.2g}, max {g['max']:.2g}")
    lines.append(f"set margins (best - second ratio): median {mg['median']:.3g} nats; "
                 f"{_pct(mg['below_0.03'])} below 0.03, {_pct(mg['below_tie_epsilon'])} below "
                 f"tie_epsilon {doc['tie_epsilon']:g}; best ratio changed in "
                 f"{_pct(mg['best_ratio_changed'])} of the sets")
    return "\n".join(lines)
