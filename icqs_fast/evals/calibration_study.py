"""Calibrated ICQS in the study: every calibration x score kind from ONE scoring run.

The raw log-likelihoods and the content-free baselines come from one engine run with
``calibration="content_free"`` (its results keep the raw ``loglik``); the PMI baselines depend on
the answer only, so :meth:`icqs_fast.engine.scorer.ICQSScorer.baselines` computes them once per
distinct answer. Each variant's scores are then recomputed from ``loglik - baseline``
(:func:`icqs_fast.engine.calibration.icqs_scores`), so the variants differ in nothing else.

Per variant (:func:`compare_sentiment`): AUC correct-vs-incorrect of the ICQS-Epistemic score
and of the mean per-set ICQS score, AUC semantic-neutral vs labeled-neutral (FPB; a neutral label
on a neutral sentence should score above one on a polar sentence), and accuracy per group with
the study's rules (score >= 0.5 judges correct). Intervals: 95 % percentile bootstrap, each group
resampled on its own. :func:`pool` merges the per-item scores of several ``--json`` documents
(seeds) into one table. ChaosNLI (:func:`compare_nli`, :func:`pool_nli`): MAE / CE / Spearman
of each variant's (e, n, c) distributions against the human ones.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from icqs_fast.engine.calibration import icqs_scores
from icqs_fast.engine.settings import CALIBRATIONS, SCORE_KINDS
from icqs_fast.evals.study_metrics import NLI_METRICS, distribution_metrics
from icqs_fast.progress import track

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

VARIANTS = [f"{c}/{k}" for c in CALIBRATIONS for k in SCORE_KINDS]
THRESHOLD = 0.5
EXPECTED = {"correct": True, "incorrect": False, "labeled_neutral": False,
            "semantic_neutral": True}


def score_variants(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good: Sequence,
                   bad: Sequence,
                   responses: Sequence[tuple[str, str]], settings: Any, *, desc: str = "ICQS",
                   quiet: bool = False) -> tuple[dict[str, list], dict[str, float]]:
    """``({"cal/kind": [ICQSResult per response]}, timing)`` for every variant, from one run
    with content-free calibration plus the PMI baselines of the distinct answers."""
    from icqs_fast.engine.scorer import ICQSScorer

    t0 = time.perf_counter()
    sc = ICQSScorer(model, tok, good, bad, settings.replace(calibration="content_free"))
    res = list(track(sc.score(responses), total=len(responses), desc=desc, unit="response",
                     quiet=quiet))
    t1 = time.perf_counter()
    answers = list(dict.fromkeys(y for _, y in responses))
    pmi_sc = ICQSScorer(model, tok, good, bad, settings.replace(calibration="pmi"))
    pmi = dict(zip(answers, pmi_sc.baselines(answers), strict=True))
    t2 = time.perf_counter()
    base = {"none": [None] * len(res), "content_free": [r.loglik_baseline for r in res],
            "pmi": [pmi[y] for _, y in responses]}
    out: dict[str, list] = {}
    for cal in CALIBRATIONS:
        for kind in SCORE_KINDS:
            rows = []
            for r, b in zip(res, base[cal], strict=True):
                ll = r.loglik.double() if b is None else r.loglik.double() - b.double()
                s, per = icqs_scores(ll, r.ratios, kind, settings.tie_epsilon)
                rows.append(dataclasses.replace(r, score=s, score_per_set=per,
                                                loglik_baseline=b, calibration=cal,
                                                score_kind=kind))
            out[f"{cal}/{kind}"] = rows
    timing = {"raw_and_content_free": round(t1 - t0, 2), "pmi_baselines": round(t2 - t1, 2),
              "calibration_rows": sc.calibration_rows + pmi_sc.calibration_rows,
              "response_rows": len(responses) * sc.n_contexts}
    return out, timing


def auc_ci(pos: Sequence[float], neg: Sequence[float], *, n_boot: int = 1000, seed: int = 0
           ) -> dict[str, float]:
    """AUC of ``pos`` above ``neg`` (ties count half) with a 95 % percentile bootstrap interval
    (each side resampled on its own: :func:`icqs_fast.metrics.auc_stratified_ci`):
    ``{"value", "lo", "hi", "n_pos", "n_neg"}``."""
    from icqs_fast.metrics import auc_stratified_ci

    p = np.asarray(pos, dtype=np.float64)
    q = np.asarray(neg, dtype=np.float64)
    if p.size == 0 or q.size == 0:
        return {"value": float("nan"), "lo": float("nan"), "hi": float("nan"),
                "n_pos": int(p.size), "n_neg": int(q.size)}
    y = np.concatenate([np.ones(p.size), np.zeros(q.size)])
    value, lo, hi = auc_stratified_ci(y, np.concatenate([p, q]), n_resamples=n_boot, seed=seed)
    return {"value": value, "lo": lo, "hi": hi, "n_pos": int(p.size), "n_neg": int(q.size)}


def auc_difference(pos_a: Sequence[float], neg_a: Sequence[float], pos_b: Sequence[float],
                   neg_b: Sequence[float], *, n_boot: int = 1000, seed: int = 0
                   ) -> dict[str, float]:
    """AUC(a) - AUC(b) of two scorings of the SAME items (paired: each resample draws the same
    positive and negative items for both; the classes are resampled on their own), with its
    95 % percentile bootstrap interval."""
    from icqs_fast.metrics import auc_resampler, bootstrap_distribution, percentile_interval

    pa, na, pb, nb = (np.asarray(v, dtype=np.float64) for v in (pos_a, neg_a, pos_b, neg_b))
    if pa.shape != pb.shape or na.shape != nb.shape or pa.size == 0 or na.size == 0:
        return {"value": float("nan"), "lo": float("nan"), "hi": float("nan")}
    # The same item indices for both scorings (paired); the classes resampled on their own.
    auc_a, auc_b = auc_resampler(pa, na), auc_resampler(pb, nb)

    def diff(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return auc_a(i, j) - auc_b(i, j)

    ip, jn = np.arange(pa.size), np.arange(na.size)
    vals = bootstrap_distribution(diff, ip, jn, paired=False, vectorized=True,
                                  n_resamples=n_boot, seed=seed)
    lo, hi, _ = percentile_interval(vals, 0.95)
    return {"value": float(diff(ip[None], jn[None])[0]), "lo": lo, "hi": hi}


def item_scores(results_by: dict, groups: dict[str, list]) -> dict[str, dict[str, list]]:
    """Per group: the ICQS-Epistemic scores and the mean per-set ICQS scores of its items."""
    out: dict[str, dict[str, list]] = {}
    for g, items in groups.items():
        rs = [results_by[(r.x, r.y)] for r in items]
        out[g] = {"icqs_epistemic": [float(r.score) for r in rs],
                  "icqs": [float(np.mean(r.score_per_set)) for r in rs],
                  "icqs_acc": [float(np.mean([(s >= THRESHOLD) == EXPECTED[g]
                                              for s in r.score_per_set])) for r in rs]}
    return out


def summarise_items(items: dict[str, dict[str, list]], *, n_boot: int = 1000, seed: int = 0
                    ) -> dict[str, Any]:
    """AUCs and accuracies of one variant's :func:`item_scores` (see the module docstring)."""
    out: dict[str, Any] = {"auc_correct_vs_incorrect": {}, "accuracy": {}}
    if "correct" in items and "incorrect" in items:
        for m in ("icqs_epistemic", "icqs"):
            out["auc_correct_vs_incorrect"][m] = auc_ci(items["correct"][m],
                                                        items["incorrect"][m], n_boot=n_boot,
                                                        seed=seed)
    if "semantic_neutral" in items and "labeled_neutral" in items:
        out["auc_semantic_vs_labeled_neutral"] = {
            m: auc_ci(items["semantic_neutral"][m], items["labeled_neutral"][m], n_boot=n_boot,
                      seed=seed) for m in ("icqs_epistemic", "icqs")}
    for g, v in items.items():
        epi = [float((s >= THRESHOLD) == EXPECTED[g]) for s in v["icqs_epistemic"]]
        out["accuracy"][g] = {"icqs_epistemic": float(np.mean(epi)),
                              "icqs": float(np.mean(v["icqs_acc"])), "n": len(epi)}
    return out


def compare_sentiment(variants: dict[str, dict], groups: dict[str, list], *, n_boot: int = 1000,
                      seed: int = 0) -> dict[str, Any]:
    """``{"variants": {name: summary}, "items": {name: item_scores}}`` of every variant
    (``variants``: name -> {(x, y): ICQSResult})."""
    items = {name: item_scores(by, groups) for name, by in variants.items()}
    return {"variants": {name: summarise_items(it, n_boot=n_boot, seed=seed)
                         for name, it in items.items()}, "items": items}


def pool(docs: Sequence[dict], *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Merge the ``compare`` items of several ``eval fpb|sst2 --compare --json`` documents (e.g.
    seeds) and summarise them as one sample; ``per_doc`` keeps each document's Epistemic AUC."""
    names = list(docs[0]["compare"]["items"])
    merged: dict[str, dict[str, dict[str, list]]] = {}
    for name in names:
        m: dict[str, dict[str, list]] = {}
        for d in docs:
            for g, v in d["compare"]["items"][name].items():
                for k, xs in v.items():
                    m.setdefault(g, {}).setdefault(k, []).extend(xs)
        merged[name] = m
    ref = names[0]  # none/argmax: today's score
    summ = {n: summarise_items(merged[n], n_boot=n_boot, seed=seed) for n in names}
    for n in names:
        m, r = merged[n], merged[ref]
        if "correct" in m and "incorrect" in m:
            summ[n]["auc_difference_vs_" + ref.replace("/", "_")] = {
                k: auc_difference(m["correct"][k], m["incorrect"][k], r["correct"][k],
                                  r["incorrect"][k], n_boot=n_boot, seed=seed)
                for k in ("icqs_epistemic", "icqs")}
    return {"variants": summ, "reference": ref,
            "per_doc": {n: [d["compare"]["variants"][n]["auc_correct_vs_incorrect"]
                            .get("icqs_epistemic", {}).get("value") for d in docs]
                        for n in names},
            "seeds": [d.get("settings", {}).get("seed") for d in docs]}


def compare_nli(preds: dict[str, dict[str, Any]], human: Any, *, n_boot: int = 1000,
                seed: int = 0) -> dict[str, Any]:
    """ChaosNLI: ``{"variants": {name: {method: {metric: {"value", "lo", "hi"}}}}, "items":
    {"human": [n, 3], "pred": {name: {method: [n, 3]}}}}`` (``preds``: name -> method ->
    ``[n, 3]`` (e, n, c) distributions); the items let :func:`pool_nli` pool runs."""
    h = np.asarray(human, dtype=np.float64)
    return {"variants": {name: {m: distribution_metrics(p, h, n_boot=n_boot, seed=seed)
                                for m, p in by.items()} for name, by in preds.items()},
            "items": {"human": h.tolist(),
                      "pred": {name: {m: np.asarray(p, dtype=np.float64).tolist()
                                      for m, p in by.items()} for name, by in preds.items()}}}


def pool_nli(docs: Sequence[dict], *, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Merge the ``compare`` items of several ``eval chaosnli --compare --json`` documents
    (e.g. seeds) and summarise them as one sample: per variant and method MAE / CE / Spearman
    with intervals, and each metric's paired difference from ``none/argmax`` (the same items
    resampled for both: :func:`icqs_fast.metrics.bootstrap_ci` keeps arrays paired)."""
    from icqs_fast.metrics import bootstrap_ci

    names = list(docs[0]["compare"]["variants"])
    human = np.concatenate([np.asarray(d["compare"]["items"]["human"], dtype=np.float64)
                            for d in docs])
    preds = {n: {m: np.concatenate([np.asarray(d["compare"]["items"]["pred"][n][m],
                                               dtype=np.float64) for d in docs])
                 for m in docs[0]["compare"]["items"]["pred"][n]} for n in names}
    ref = names[0]  # none/argmax: today's score
    out: dict[str, Any] = {}
    for n in names:
        out[n] = {m: distribution_metrics(p, human, n_boot=n_boot, seed=seed)
                  for m, p in preds[n].items()}
        for m, p in preds[n].items():
            q = preds[ref][m]
            diff = {}
            for k, fn in NLI_METRICS.items():
                def stat(a: np.ndarray, b: np.ndarray, h: np.ndarray, fn: Any = fn) -> float:
                    return float(fn(a, h) - fn(b, h))
                lo, hi = bootstrap_ci(stat, p, q, human, n_resamples=n_boot, seed=seed)
                diff[k] = {"value": stat(p, q, human), "lo": lo, "hi": hi}
            out[n][m]["difference_vs_" + ref.replace("/", "_")] = diff
    return {"variants": out, "reference": ref, "n": int(len(human)),
            "per_doc": {n: [d["compare"]["variants"][n]["icqs_epistemic"]["spearman"]["value"]
                            for d in docs] for n in names},
            "seeds": [d.get("settings", {}).get("seed") for d in docs]}


def _ci_cell(d: dict | None, width: int) -> str:
    """``value [lo,hi]`` right-aligned in ``width`` ("-" for a missing or NaN value)."""
    if not d or d["value"] is None or d["value"] != d["value"]:
        return "-".rjust(width)
    return f"{d['value']:.3f} [{d['lo']:.2f},{d['hi']:.2f}]".rjust(width)


def nli_compare_table(cmp: dict[str, Any]) -> str:
    """ChaosNLI comparison (one run's ``compare`` or :func:`pool_nli`) as text: one line per
    variant and method, MAE / CE / Spearman with intervals (and, pooled, the paired difference
    of each from the reference variant)."""
    def ci(d: dict) -> str:
        return _ci_cell(d, 22)

    ref = cmp.get("reference")
    dkey = "difference_vs_" + ref.replace("/", "_") if ref else None
    head = f"{'calibration/score':<22} {'method':<15} " + " ".join(
        f"{k:>22}" for k in ("mae", "ce", "spearman"))
    if dkey:
        head += "  " + " ".join(f"{'d' + k + ' vs ' + ref:>26}" for k in ("mae", "ce",
                                                                         "spearman"))
    lines = [head]
    for name, row in cmp["variants"].items():
        for m in ("icqs_epistemic", "icqs"):
            if m not in row:
                continue
            line = f"{name:<22} {m:<15} " + " ".join(ci(row[m][k]) for k in ("mae", "ce",
                                                                               "spearman"))
            if dkey and dkey in row[m]:
                line += "  " + " ".join(
                    f"{row[m][dkey][k]['value']:+.3f} [{row[m][dkey][k]['lo']:+.2f},"
                    f"{row[m][dkey][k]['hi']:+.2f}]".rjust(26) for k in ("mae", "ce",
                                                                          "spearman"))
            lines.append(line)
    lines.append("value [bootstrap 95% CI over items]; lower MAE / CE and higher Spearman are "
                 "better" + ("; d: paired bootstrap of the difference (same items)" if dkey
                             else ""))
    return "\n".join(lines)


def compare_table(cmp: dict[str, Any]) -> str:
    """The comparison as text: one line per variant."""
    def ci(d: dict | None) -> str:
        return _ci_cell(d, 19)

    groups = list(next(iter(cmp["variants"].values()))["accuracy"])
    head = (f"{'calibration/score':<22} {'AUC c-vs-i Epi.':>19} {'AUC c-vs-i set':>19} "
            f"{'AUC sem-vs-lab Epi.':>19} " + " ".join(f"{g[:10]:>10}" for g in groups))
    ref = cmp.get("reference")
    dkey = "auc_difference_vs_" + ref.replace("/", "_") if ref else None
    if dkey:
        head += f" {'dAUC Epi. vs ' + ref:>26}"
    lines = [head]
    for name, v in cmp["variants"].items():
        a = v["auc_correct_vs_incorrect"]
        sn = v.get("auc_semantic_vs_labeled_neutral", {})
        acc = " ".join(f"{100 * v['accuracy'][g]['icqs_epistemic']:10.1f}" for g in groups)
        d = ""
        if dkey and dkey in v:
            dv = v[dkey]["icqs_epistemic"]
            d = f" {dv['value']:+.3f} [{dv['lo']:+.2f},{dv['hi']:+.2f}]".rjust(27)
        lines.append(f"{name:<22} {ci(a.get('icqs_epistemic'))} {ci(a.get('icqs'))} "
                     f"{ci(sn.get('icqs_epistemic'))} {acc}{d}")
    lines.append("AUC [bootstrap 95% CI]; accuracy % = ICQS-Epistemic judged as the group's "
                 "expected verdict (score >= 0.5 = correct)"
                 + ("; dAUC: paired bootstrap of the difference (same items)" if dkey else ""))
    return "\n".join(lines)


def _bars(ax: Any, names: Sequence[str], vals: Sequence[dict]) -> None:
    """One bar per variant (``{"value", "lo", "hi"}``) with its interval, a colour per
    calibration (lighter: the mean score), and short tick labels."""
    y = [v["value"] for v in vals]
    err = [[v["value"] - v["lo"] for v in vals], [v["hi"] - v["value"] for v in vals]]
    ax.bar(range(len(names)), y, yerr=err, capsize=3,
           color=["#888", "#bbb", "#37c", "#8be", "#c63", "#eb8"][:len(names)])
    # "content_free/argmax" -> three short lines, so neighbouring labels do not overlap.
    ax.set_xticks(range(len(names)),
                  [n.replace("content_free", "content-\nfree").replace("/", "\n")
                   for n in names], fontsize=7)


def plot_pooled(tables: dict[str, dict[str, Any]], path: str) -> str:
    """One panel per pooled comparison (``{title: pool(...)}``): the ICQS-Epistemic
    correct-vs-incorrect AUC of each variant with its 95 % interval; a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables), 3.6), sharey=True,
                             squeeze=False)
    for ax, (title, cmp) in zip(axes[0], tables.items(), strict=True):
        names = list(cmp["variants"])
        vals = [cmp["variants"][n]["auc_correct_vs_incorrect"]["icqs_epistemic"] for n in names]
        _bars(ax, names, vals)
        ax.axhline(0.5, color="k", lw=0.6, ls=":")
        ax.axhline(0.8, color="#c00", lw=0.6, ls="--")  # the goal
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("AUC correct vs incorrect (Epistemic)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pooled_nli(tables: dict[str, dict[str, Any]], path: str) -> str:
    """ChaosNLI (``{title: pool_nli(...)}``): per table, two panels, the ICQS-Epistemic MAE
    and Spearman of each variant with its 95 % interval; a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("mae", "MAE (lower is better)"), ("spearman", "Spearman (higher is better)"))
    fig, axes = plt.subplots(len(tables), 2, figsize=(8.4, 3.6 * len(tables)), squeeze=False)
    for row, (title, cmp) in zip(axes, tables.items(), strict=True):
        names = list(cmp["variants"])
        for ax, (k, label) in zip(row, metrics, strict=True):
            vals = [cmp["variants"][n]["icqs_epistemic"][k] for n in names]
            _bars(ax, names, vals)
            ax.axhline(0.0, color="k", lw=0.6)
            ax.set_title(f"{title}: {label}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
