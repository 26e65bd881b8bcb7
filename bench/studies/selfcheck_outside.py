"""Is a self-check / test gap from the cross-fitting or from the pool items? Each run's held-out
pool items scored again as outside responses, by another seed's scorer (:func:`outside_run`),
and the two steps between the self-check AUC, those items' AUC and that scorer's test AUC
(:func:`outside_summary`). The runs are :mod:`bench.studies.selfcheck_study` records.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.studies.selfcheck_study import nan_array, run_scorer, study_pools
from icqs_fast import metrics
from icqs_fast.engine.selfcheck import heldout_items


def outside_run(model: Any, tok: Any, raw: dict[str, Any], other: dict[str, Any], *,
                quiet: bool = True) -> dict[str, Any]:
    """``raw``'s held-out pool items scored as outside responses by ``other``'s scorer (another
    seed's pools and demonstration sets, rebuilt as
    :func:`~bench.studies.selfcheck_study.run_one` built them; items whose
    input is in those pools are left out): the same items without the cross-fitting. Their AUC
    against ``raw``'s self-check AUC (the same items cross-fitted) and ``other``'s test AUC
    (the same scorer, test responses) splits a self-check / test gap into "being in the pool"
    and "pool items are not like the test responses" (:func:`outside_summary`)."""
    from icqs_fast.progress import track

    ds, seed, pool = raw["dataset"], raw["seed"], raw["pool"]
    if other["dataset"] != ds or other["seed"] == seed:
        raise ValueError(f"outside_run: {ds} s{seed} needs another seed's run of {ds}")
    good, bad, _, _ = study_pools(ds, pool=pool, n_test=1, seed=seed)
    items, labels = heldout_items(good, bad, raw["max_heldout"], seed)
    if labels.tolist() != raw["heldout"]["labels"]:
        raise ValueError(f"{ds} s{seed}: the stored held-out items are not select_heldout's")
    g2, b2, _, tpl2 = study_pools(ds, pool=other["pool"], n_test=1, seed=other["seed"])
    seen = {x for x, _ in g2 + b2}
    keep = [(it, int(lab)) for it, lab in zip(items, labels, strict=True) if it[0] not in seen]
    sc = run_scorer(model, tok, other, g2, b2, tpl2)
    t0 = time.perf_counter()
    res = list(track(sc.score([it for it, _ in keep]), total=len(keep),
                     desc=f"outside {ds} s{seed} by s{other['seed']}", unit="item", quiet=quiet))
    return {"dataset": ds, "seed": seed, "scorer_seed": other["seed"],
            "labels": [lab for _, lab in keep], "scores": [r.score for r in res],
            "left_out": len(items) - len(keep), "seconds": round(time.perf_counter() - t0, 2)}


def outside_summary(raws: Sequence[dict[str, Any]], outs: Sequence[dict[str, Any]]
                    ) -> dict[str, Any]:
    """Per dataset, over the :func:`outside_run` records ``outs``: the mean AUC of the held-out
    items cross-fitted by their own run (the self-check), of the same items scored as outside
    responses, and of the outside scorer's test responses, with the two steps between them."""
    by = {(r["dataset"], r["seed"]): r for r in raws}
    per: dict[str, dict[str, list[float]]] = {}
    for o in outs:
        own, oth = by[(o["dataset"], o["seed"])], by[(o["dataset"], o["scorer_seed"])]
        h = own["heldout"]
        hs, hy = nan_array(h["scores"]), np.asarray(h["labels"])
        ok = np.isfinite(hs)
        d = per.setdefault(o["dataset"], {"crossfit": [], "outside": [], "test": []})
        d["crossfit"].append(metrics.auc(hy[ok], hs[ok]))
        d["outside"].append(metrics.auc(np.asarray(o["labels"]), np.asarray(o["scores"])))
        d["test"].append(metrics.auc(np.asarray(oth["test"]["labels"]),
                                     np.asarray(oth["test"]["scores"])))
    out = {}
    for ds, d in per.items():
        c, o, t = (np.asarray(d[k]) for k in ("crossfit", "outside", "test"))
        out[ds] = {"runs": len(c), "crossfit_auc": float(c.mean()),
                   "outside_auc": float(o.mean()), "test_auc": float(t.mean()),
                   "in_pool_step": float((c - o).mean()), "in_pool_step_se": _se(c - o),
                   "items_step": float((o - t).mean()), "items_step_se": _se(o - t)}
    return out


def _se(v: np.ndarray) -> float:
    """The standard error of ``v``'s mean (NaN for fewer than two values)."""
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else math.nan
