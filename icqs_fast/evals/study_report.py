"""The printed tables of an ICQS study run (``icqs-fast eval fpb|sst2|chaosnli`` without
``--json``): one text report per task kind, built from the run's JSON document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from icqs_fast.io.datasets import EvalDataset


def fmt(v: float | None) -> str:
    """A metric with three decimals, ``nan`` for a missing one."""
    return "nan" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "    -" if v is None else f"{100 * v:5.1f}"


def _timing(doc: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in doc.get("timing", {}).items()
                     if isinstance(v, (int, float)))


def label_report(doc: dict[str, Any], path: Path, ds: EvalDataset) -> str:
    """A ``labels`` study (FPB, SST-2): accuracy per group and method with intervals, the
    synthetic ranking, the separation, the curve over N and the rules."""
    from icqs_fast.evals.calibration_study import compare_table

    out: list[str] = []
    s = doc["settings"]
    out.append(f"{ds.title} ({path}), model {doc['model']}, "
               f"N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}, "
               f"seed {s['seed']}, labels {doc['labels']}")
    methods = [m for m in ("icqs", "icqs_epistemic", "icl", "ask_llm")
               if m in doc["groups"]["correct"]]
    out.append(f"{'group':<17} {'n':>4} {'expect':>9} " + " ".join(f"{m:>22}" for m in methods))
    for g, row in doc["groups"].items():
        cells = []
        for m in methods:
            lo, hi = doc["intervals"][g][m]
            cells.append(f"{_pct(row[m])} [{_pct(lo)},{_pct(hi)}]".rjust(22))
        out.append(f"{g:<17} {doc['n'][g]:>4} {doc['expected'][g]:>9} " + " ".join(cells))
    r = doc["ranking"]
    means = ", ".join(f"{100 * m['accuracy']:.0f}%: {m['mean_score']:.3f}" for m in r["models"])
    rho = "nan" if r["spearman"] is None else f"{r['spearman']:+.3f}"
    ci = r["interval"]
    ci = "n/a" if not ci or any(v is None for v in ci) else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
    out.append(f"synthetic-LLM ranking: Spearman {rho} (95% CI {ci}); mean scores {means}")
    sep = doc["separation"]
    out.append("mean score per group: " + "; ".join(
        f"{g}: " + ", ".join(f"{m} {v:.3f}" for m, v in row.items())
        for g, row in sep["mean"].items()))
    if "auc_correct_vs_incorrect" in sep:
        ci = sep.get("auc_correct_vs_incorrect_interval", {})

        def auc_cell(m: str, v: float | None) -> str:
            lo, hi = ci.get(m, (None, None))
            return f"{m} {fmt(v)}" + ("" if m not in ci else f" [{fmt(lo)}, {fmt(hi)}]")

        out.append("AUC correct vs incorrect [bootstrap 95% CI]: " + ", ".join(
            auc_cell(m, v) for m, v in sep["auc_correct_vs_incorrect"].items()))
    if len(doc["curve"]) > 1:
        out.append("curve (accuracy % per N):")
        for pt in doc["curve"]:
            row = "; ".join(f"{g}: " + ", ".join(f"{m} {_pct(pt['groups'][g][m]).strip()}"
                                                  for m in methods)
                            for g in pt["groups"])
            out.append(f"  N={pt['demos_per_set']}: {row}")
    out.append("accuracy % [bootstrap 95% CI] = fraction judged as the expected verdict; rules: "
               "ICQS per set score >= 0.5, Epistemic score >= 0.5, ICL predicted label == "
               f"response, Ask LLM expected rating >= {s['ask_threshold']:g}")
    if "compare" in doc:
        out.append("calibration x score comparison (one run; the raw and content-free "
                   "log-likelihoods shared):")
        out.append(compare_table(doc["compare"]))
    out.append(f"time: {doc['seconds']:.1f} s ({_timing(doc)})")
    out.extend(f"wrote {p}" for p in doc.get("plots", []))
    return "\n".join(out)


def distribution_report(doc: dict[str, Any], path: Path, ds: EvalDataset) -> str:
    """A ``distributions`` study (ChaosNLI): each method's metrics (``ds.metrics``) with
    intervals, the curve over N, the comparison and the distribution rules."""
    from icqs_fast.evals.calibration_study import nli_compare_table

    out: list[str] = []
    s = doc["settings"]
    metrics = ds.metrics
    methods = [m for m in ("icqs", "icqs_epistemic", "icl") if m in doc]
    out.append(f"{ds.title} ({path}), model {doc['model']}, {doc['n']} test pairs, "
               f"N={s['demos_per_set']}, M+1={s['num_ratios']}, L={s['sets_per_ratio']}, seed "
               f"{s['seed']}")
    out.append(f"{'method':<15} " + " ".join(f"{k:>24}" for k in metrics))
    for m in methods:
        cells = []
        for k in metrics:
            v, (lo, hi) = doc[m][k], doc["intervals"][m][k]
            cells.append(("nan" if v is None else f"{v:.3f} [{fmt(lo)}, {fmt(hi)}]").rjust(24))
        out.append(f"{m:<15} " + " ".join(cells))
    if len(doc["curve"]) > 1:
        out.append(f"curve ({' / '.join(metrics)} per N):")
        for pt in doc["curve"]:
            row = "; ".join(f"{m}: " + "/".join(fmt(pt[m][k]) for k in metrics)
                            for m in ("icqs", "icqs_epistemic", "icl") if m in pt)
            out.append(f"  N={pt['demos_per_set']}: {row}")
    if "compare" in doc:
        out.append("calibration x score comparison (one run):")
        out.append(nli_compare_table(doc["compare"]))
    out.append("distribution rules: " + "; ".join(f"{k}: {v}" for k, v in doc["rules"].items()))
    out.append(f"time: {doc['seconds']:.1f} s ({_timing(doc)})")
    out.extend(f"wrote {p}" for p in doc.get("plots", []))
    return "\n".join(out)
