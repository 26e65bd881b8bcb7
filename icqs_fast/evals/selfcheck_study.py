"""Does the self-check predict the truth? The pools' self-check against labelled test responses.

Per dataset (SST-2, FPB) and seed (:func:`run_one`): the study's pools (``pool`` good sentences
with their own label, ``pool`` other ones with the label flipped;
:mod:`icqs_fast.evals.study_data`) build one :class:`~icqs_fast.engine.scorer.ICQSScorer` at the
default scoring settings (demonstration sets seeded with the seed). The self-check cross-fits the
held-out pool members (:func:`icqs_fast.engine.selfcheck.crossfit_heldout`); the same scorer then
scores ``n_test`` test sentences answered right and the same ones answered with the flipped label
(the study's correct / incorrect groups). The raw scores are kept, so :func:`analyse` can refit.

:func:`analyse` compares, per run: the self-check's AUC and its interval with the test AUC (inside
the interval?), and the ECE / Brier of ``p_good_calibrated`` on the test responses with those of
the uncalibrated ``p_good`` and of a constant 0.5 (Brier 0.25). The cost of the self-check per
record is timed in the same run (held-out items and test records go through the same scorer and
prefix bank).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from icqs_fast import metrics
from icqs_fast.engine.selfcheck import (
    DEFAULT_MAX_HELDOUT,
    crossfit_heldout,
    fit_self_check,
)

DATASETS = ("sst2", "fpb")
# Records of the job the self-check's cost is stated against.
JOB_RECORDS = 10_000


def study_pools(dataset: str, *, pool: int, n_test: int, seed: int
                ) -> tuple[list, list, list[tuple[str, str, int]]]:
    """``(good, bad, test)``: the study's pools and ``n_test`` right plus ``n_test`` flipped
    answers as ``(x, y, 1 if right else 0)`` (right ones first)."""
    from icqs_fast.evals.study_data import fpb_data, sst2_data

    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    load = sst2_data if dataset == "sst2" else fpb_data
    data = load(pool=pool, limit=n_test, seed=seed)
    test = [(r.x, r.y, 1) for r in data.groups["correct"]] + \
        [(r.x, r.y, 0) for r in data.groups["incorrect"]]
    return data.good, data.bad, test


def run_one(model: Any, tok: Any, dataset: str, seed: int, *, pool: int = 32, n_test: int = 100,
            max_heldout: int = DEFAULT_MAX_HELDOUT, quiet: bool = True) -> dict[str, Any]:
    """Score one (dataset, seed): the self-check's held-out items, then the test responses, with
    one scorer at the default settings (``seed`` = its demonstration sets' seed). Returns the raw
    JSON-able record (scores, labels, timings)."""
    import torch

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.progress import track

    good, bad, test = study_pools(dataset, pool=pool, n_test=n_test, seed=seed)
    settings = ScoringSettings(seed=seed)
    sc = ICQSScorer(model, tok, good, bad, settings)
    t0 = time.perf_counter()
    _ = sc.prefix_bank  # built once, before both (a job builds it before its records too)
    t1 = time.perf_counter()

    def bar(it: Any, total: int, desc: str = f"self-check {dataset} s{seed}") -> Any:
        return track(it, total=total, desc=desc, unit="item", quiet=quiet)

    cf = crossfit_heldout(sc, good, bad, max_heldout=max_heldout, seed=seed, progress=bar)
    t2 = time.perf_counter()
    res = list(bar(sc.score([(x, y) for x, y, _ in test]), len(test),
                   desc=f"test {dataset} s{seed}"))
    t3 = time.perf_counter()
    return {
        "dataset": dataset, "seed": seed, "pool": pool, "n_test": len(test),
        "settings": settings.asdict(), "max_heldout": max_heldout,
        "torch_threads": torch.get_num_threads(),
        "heldout": {"labels": cf.labels.tolist(), "scores": _nan_none(cf.scores),
                    "full_scores": _nan_none(cf.full_scores),
                    "clean_contexts": cf.clean.sum(axis=(1, 2)).tolist(),
                    "n_contexts": int(cf.clean.shape[1] * cf.clean.shape[2])},
        "test": {"labels": [lab for _, _, lab in test], "scores": [r.score for r in res],
                 "p_good": [r.p_good for r in res]},
        "seconds": {"prefix_bank": round(t1 - t0, 2), "heldout": round(t2 - t1, 2),
                    "test": round(t3 - t2, 2)},
    }


def _nan_none(a: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(v) else float(v) for v in a.tolist()]


def _arr(v: Sequence) -> np.ndarray:
    return np.asarray([math.nan if x is None else x for x in v], dtype=np.float64)


def analyse(raw: dict[str, Any], *, method: str = "auto", n_boot: int = 1000
            ) -> dict[str, Any]:
    """One table row of a :func:`run_one` record: the self-check (fitted on the held-out scores,
    seeded with the run's seed) against the test responses."""
    h, t = raw["heldout"], raw["test"]
    chk = fit_self_check(_arr(h["scores"]), h["labels"], method=method, seed=raw["seed"],
                         n_boot=n_boot)
    y = np.asarray(t["labels"], dtype=np.int64)
    s = _arr(t["scores"])
    p_raw = _arr(t["p_good"])
    test_auc = metrics.auc(y, s)
    row: dict[str, Any] = {
        "dataset": raw["dataset"], "seed": raw["seed"], "status": chk.status,
        "n_heldout": chk.n_good + chk.n_bad, "n_skipped": chk.n_skipped, "n_test": int(y.size),
        "selfcheck_auc": chk.auc, "auc_lo": chk.auc_lo, "auc_hi": chk.auc_hi,
        "test_auc": test_auc,
        "leaky_auc": metrics.auc(np.asarray(h["labels"]), _arr(h["full_scores"])),
        "selfcheck_brier": chk.brier, "selfcheck_ece": chk.ece,
        "expected_accuracy": chk.expected_accuracy,
        "method": chk.config.get("method_used"),
    }
    row["inside"] = bool(chk.ok and chk.auc_lo <= test_auc <= chk.auc_hi)
    if chk.ok:
        p = chk.apply(s)
        row.update({
            "test_ece": metrics.ece(y, p), "test_brier": metrics.brier(y, p),
            "test_accuracy": float(((s >= chk.threshold) == (y == 1)).mean()),
            "threshold": chk.threshold,
            "test_p_calibrated": [float(v) for v in p],
        })
    row["test_labels"] = y.tolist()
    row["test_p_good"] = p_raw.tolist()
    row.update({"raw_p_good_ece": metrics.ece(y, p_raw),
                "raw_p_good_brier": metrics.brier(y, p_raw), "constant_brier": 0.25})
    sec = raw["seconds"]
    n_h = len(h["labels"])
    per_record = sec["test"] / max(1, raw["n_test"])
    per_heldout = sec["heldout"] / max(1, n_h)
    row.update({
        "s_per_record": per_record, "s_per_heldout": per_heldout,
        # What the self-check at --self-check-max would cost a 10,000-record job, from this
        # run's per-item times (held-out items cost what records cost: the same scorer/bank).
        "cost_pct_job_at_max": 100.0 * raw["max_heldout"] * per_heldout
        / (JOB_RECORDS * per_record),
        "cost_pct_job_this_pool": 100.0 * n_h * per_heldout / (JOB_RECORDS * per_record),
    })
    return row


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per dataset: means over seeds, in how many seeds the test AUC was inside, and the ECE /
    Brier of the test responses of every seed pooled (each calibrated by its own seed's map)."""
    out: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in rows}):
        rs = [r for r in rows if r["dataset"] == ds]

        def mean(k: str, rs: list = rs) -> float:
            v = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            return float(np.mean(v)) if v else math.nan

        ok = [r for r in rs if "test_p_calibrated" in r]
        y = np.concatenate([r["test_labels"] for r in ok]) if ok else np.zeros(0)
        p = np.concatenate([r["test_p_calibrated"] for r in ok]) if ok else np.zeros(0)
        q = np.concatenate([r["test_p_good"] for r in ok]) if ok else np.zeros(0)
        pooled = {"pooled_n_test": int(y.size)}
        if y.size:
            pooled.update(pooled_ece=metrics.ece(y, p), pooled_brier=metrics.brier(y, p),
                          pooled_raw_ece=metrics.ece(y, q), pooled_raw_brier=metrics.brier(y, q))
        out[ds] = {"seeds": len(rs), "inside": sum(r["inside"] for r in rs), **pooled,
                   **{k: mean(k) for k in ("selfcheck_auc", "test_auc", "test_ece",
                                           "test_brier", "raw_p_good_ece", "raw_p_good_brier",
                                           "expected_accuracy", "test_accuracy",
                                           "cost_pct_job_at_max")}}
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table of docs/RESULTS.md (one line per dataset and seed)."""
    head = ("| dataset | seed | held out (skipped) | self-check AUC [95 % CI] | test AUC | inside "
            "| ECE test (raw p_good) | Brier test (raw p_good) | exp. acc. / test acc. |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        def f(k: str, d: int = 3, r: dict = r) -> str:
            v = r.get(k)
            return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"

        lines.append(
            f"| {r['dataset']} | {r['seed']} | {r['n_heldout']} ({r['n_skipped']}) | "
            f"{f('selfcheck_auc')} [{f('auc_lo')}, {f('auc_hi')}] | {f('test_auc')} | "
            f"{'yes' if r['inside'] else 'no'} | {f('test_ece')} ({f('raw_p_good_ece')}) | "
            f"{f('test_brier')} ({f('raw_p_good_brier')}) | "
            f"{f('expected_accuracy', 2)} / {f('test_accuracy', 2)} |")
    return "\n".join(lines)
