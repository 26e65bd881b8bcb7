"""Drift between two scoring runs: did anything move between a baseline output and a new one,
beyond noise, and by how much.

:func:`compare_runs` reads both outputs once each (:func:`icqs_fast.report.run_output.summarise`,
bounded samples plus compact per-record columns) and compares:

* the ``score`` and ``p_good_calibrated`` distributions: the two-sample Kolmogorov-Smirnov test
  (``scipy.stats.ks_2samp`` on the reservoir samples: every record up to 20,000 per run) and
  the population stability index (PSI over the baseline's deciles; the usual reading: < 0.1
  stable, 0.1-0.25 moderate, > 0.25 major);
* the self-checks stored in the meta files: the AUC difference against its standard error
  (each from its bootstrap interval), the expected accuracy at the threshold (two
  proportions over the held-out items, Wilson intervals), Brier, ECE and threshold side by
  side;
* the accuracy of the verdicts against the labels, when both runs have good / bad labels;
* the records present in both (matched by ``id``; by ``index`` when a run has records without
  one): the per-record change of ``score``, the verdict flips (the record's ``verdict`` field
  when present, else good / bad from each run's own self-check threshold) and changed labels.

What counts as beyond noise is :class:`DriftRules` (a test at level ``alpha`` AND a material
size, so that neither a tiny sample's scatter nor a million records' trivial offset is called
drift). :attr:`Drift.verdict` says "no change beyond noise" or names each thing that moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from icqs_fast.report.run_output import RunOutput, RunSummary, open_run, summarise

__all__ = ["DriftRules", "DriftItem", "Drift", "compare_runs", "compare_summaries",
           "read_self_check", "psi", "wilson", "NO_CHANGE"]

NO_CHANGE = "no change beyond noise"


@dataclass(frozen=True)
class DriftRules:
    """What counts as a change beyond noise.

    Attributes:
        alpha: the level of every test (KS, AUC difference, two proportions).
        ks_min: a distribution moved when KS p < alpha and (KS statistic >= ks_min or PSI >=
            psi_moderate).
        psi_moderate, psi_major: the usual PSI bands (reported as stable / moderate / major).
        record_tol: the paired records moved when the mean |score change| is at least this
            (scores lie in [0, 1]).
        flip_rate: the verdicts moved when the Wilson lower bound (at 1 - alpha) of the share
            of matched records whose verdict flipped is at least this.
        accuracy_tol: an accuracy (self-check or against the labels) moved when the two
            proportions differ at level alpha and by at least this much.
    """

    alpha: float = 0.01
    ks_min: float = 0.05
    psi_moderate: float = 0.1
    psi_major: float = 0.25
    record_tol: float = 0.02
    flip_rate: float = 0.02
    accuracy_tol: float = 0.02


@dataclass
class DriftItem:
    """One comparison: ``name``, whether it ``moved`` beyond noise, one plain ``text`` line and
    its numbers (``details``)."""

    name: str
    moved: bool
    text: str
    details: dict = field(default_factory=dict)


@dataclass
class Drift:
    """The comparison of a new run with a baseline (:func:`compare_runs`)."""

    baseline: str
    new: str
    items: list[DriftItem]
    changed: list[dict]  # the matched records that changed most: index / id / both scores
    notes: list[str]

    @property
    def moved(self) -> bool:
        return any(i.moved for i in self.items)

    @property
    def verdict(self) -> str:
        """One line: :data:`NO_CHANGE`, or "drift: " and each thing that moved."""
        if not self.moved:
            return NO_CHANGE
        return "drift: " + "; ".join(i.text for i in self.items if i.moved)

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "new": self.new, "moved": self.moved,
                "verdict": self.verdict, "notes": self.notes, "changed": self.changed,
                "items": [{"name": i.name, "moved": i.moved, "text": i.text, **i.details}
                          for i in self.items]}


# --------------------------------------------------------------------------- statistics


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (NaN, NaN when n == 0)."""
    if n <= 0:
        return math.nan, math.nan
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + level / 2))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


PSI_BINS = 10


def psi(base: Any, new: Any, bins: int = PSI_BINS) -> float:
    """Population stability index of ``new`` against ``base`` (1-D float arrays): over the
    baseline's quantile bins (``bins`` of them, merged where quantiles tie), sum of
    ``(q - p) ln(q / p)``, empty bins counted as 0.5 records (so a bin that empties does not
    make it infinite). NaN when either is empty."""
    import numpy as np

    a, b = np.asarray(base, dtype=np.float64), np.asarray(new, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        return math.nan
    edges = np.unique(np.quantile(a, np.linspace(0, 1, bins + 1)[1:-1]))
    ca = np.bincount(np.searchsorted(edges, a, side="right"), minlength=edges.size + 1)
    cb = np.bincount(np.searchsorted(edges, b, side="right"), minlength=edges.size + 1)
    p = np.maximum(ca, 0.5) / a.size
    q = np.maximum(cb, 0.5) / b.size
    return float(np.sum((q - p) * np.log(q / p)))


def _two_proportions(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided p-value of equal proportions (pooled z test; 1.0 when undefined)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    from scipy.stats import norm

    pool = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0 if k1 / n1 == k2 / n2 else 0.0
    return float(2 * norm.sf(abs(k1 / n1 - k2 / n2) / se))


def _f(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) \
        else format(v, spec)


def read_self_check(meta: dict) -> Any:
    """The run's :class:`~icqs_fast.engine.selfcheck.SelfCheck` from its metadata (None
    without one or in a form this version does not read)."""
    from icqs_fast.engine.selfcheck import SelfCheck

    d = meta.get("self_check")
    if not isinstance(d, dict):
        return None
    try:
        return SelfCheck.from_dict(d)
    except (ValueError, TypeError, KeyError):
        return None


# --------------------------------------------------------------------------- comparisons


def _distribution(name: str, what: str, a: RunSummary, b: RunSummary, rules: DriftRules
                  ) -> DriftItem | None:
    import numpy as np
    from scipy.stats import ks_2samp

    x = np.asarray(a.samples[what].values)
    y = np.asarray(b.samples[what].values)
    if x.size < 2 or y.size < 2:
        return None
    ks = ks_2samp(x, y)
    p_i = psi(x, y)
    band = ("major" if p_i >= rules.psi_major else "moderate" if p_i >= rules.psi_moderate
            else "stable")
    moved = ks.pvalue < rules.alpha and (ks.statistic >= rules.ks_min
                                        or p_i >= rules.psi_moderate)
    ma, mb = float(np.mean(x)), float(np.mean(y))
    # PSI is a symmetric KL divergence: two samples of ONE distribution give about
    # (bins - 1)(1/n1 + 1/n2) on average (its chi-square approximation). Where that is not small
    # the band alone means little, and the text says so.
    null = (PSI_BINS - 1) * (1 / x.size + 1 / y.size)
    noise = f"; sampling alone gives ~{null:.2f} on average at these sizes" if null >= 0.05 \
        else ""
    # The band is the usual reading of a PSI alone; a PSI that a test puts within noise is
    # said so, not called moderate or major beside a "within noise" mark.
    said = band if moved or band == "stable" else (
        f"within noise: KS p {ks.pvalue:.2g}; the usual bands alone would say {band}")
    text = (f"{name} distribution: mean {ma:.3f} -> {mb:.3f} ({mb - ma:+.3f}), KS D "
            f"{ks.statistic:.3f} (p {ks.pvalue:.2g}), PSI {p_i:.3f} ({said}{noise})")
    return DriftItem(f"{name}_distribution", bool(moved), text,
                     {"ks_statistic": float(ks.statistic), "ks_pvalue": float(ks.pvalue),
                      "psi": p_i, "psi_band": band, "psi_sampling": null,
                      "mean_baseline": ma, "mean_new": mb,
                      "n_baseline": a.samples[what].n, "n_new": b.samples[what].n})


def _self_check(ca: Any, cb: Any, rules: DriftRules) -> list[DriftItem]:
    from scipy.stats import norm

    if ca is None or cb is None or not (ca.ok and cb.ok):
        return []
    out = []
    z = float(norm.ppf(0.5 + ca.level / 2))
    se_a = (ca.auc_hi - ca.auc_lo) / (2 * z)
    se_b = (cb.auc_hi - cb.auc_lo) / (2 * z)
    se = math.hypot(se_a, se_b)
    d = cb.auc - ca.auc
    p = float(2 * norm.sf(abs(d) / se)) if se > 0 else (1.0 if d == 0 else 0.0)
    out.append(DriftItem(
        "self_check_auc", p < rules.alpha,
        f"self-check AUC {ca.auc:.3f} [{ca.auc_lo:.3f}, {ca.auc_hi:.3f}] -> {cb.auc:.3f} "
        f"[{cb.auc_lo:.3f}, {cb.auc_hi:.3f}] ({d:+.3f}, p {p:.2g})",
        {"auc_baseline": ca.auc, "auc_new": cb.auc, "difference": d, "pvalue": p,
         "difference_interval": [d - z * se, d + z * se]}))
    na, nb = ca.n_good + ca.n_bad, cb.n_good + cb.n_bad
    ka, kb = round(ca.expected_accuracy * na), round(cb.expected_accuracy * nb)
    if na and nb and math.isfinite(ca.expected_accuracy) and math.isfinite(cb.expected_accuracy):
        p = _two_proportions(ka, na, kb, nb)
        da = cb.expected_accuracy - ca.expected_accuracy
        ia, ib = wilson(ka, na), wilson(kb, nb)
        out.append(DriftItem(
            "self_check_accuracy", p < rules.alpha and abs(da) >= rules.accuracy_tol,
            f"self-check expected accuracy {ca.expected_accuracy:.3f} [{ia[0]:.3f}, "
            f"{ia[1]:.3f}] -> {cb.expected_accuracy:.3f} [{ib[0]:.3f}, {ib[1]:.3f}] "
            f"({da:+.3f}, p {p:.2g})",
            {"baseline": ca.expected_accuracy, "new": cb.expected_accuracy, "pvalue": p,
             "interval_baseline": list(ia), "interval_new": list(ib)}))
    out.append(DriftItem(
        "self_check_calibration", False,
        f"self-check calibration: Brier {_f(ca.brier)} -> {_f(cb.brier)}, ECE {_f(ca.ece)} -> "
        f"{_f(cb.ece)}, threshold {_f(ca.threshold, '.4f')} -> {_f(cb.threshold, '.4f')} "
        "(shown, not tested: the meta file holds no interval for them)",
        {"brier": [ca.brier, cb.brier], "ece": [ca.ece, cb.ece],
         "threshold": [ca.threshold, cb.threshold], "tested": False}))
    return out


def _label_accuracy(a: RunSummary, b: RunSummary, rules: DriftRules) -> DriftItem | None:
    def acc(s: RunSummary) -> tuple[int, int]:
        n = sum(c for (cls, v), c in s.confusion.items() if v in ("good", "bad"))
        k = s.confusion.get((1, "good"), 0) + s.confusion.get((0, "bad"), 0)
        return k, n

    (ka, na), (kb, nb) = acc(a), acc(b)
    if not na or not nb:
        return None
    p = _two_proportions(ka, na, kb, nb)
    d = kb / nb - ka / na
    ia, ib = wilson(ka, na), wilson(kb, nb)
    return DriftItem(
        "label_accuracy", p < rules.alpha and abs(d) >= rules.accuracy_tol,
        f"accuracy against the labels {ka / na:.3f} [{ia[0]:.3f}, {ia[1]:.3f}] -> {kb / nb:.3f} "
        f"[{ib[0]:.3f}, {ib[1]:.3f}] ({d:+.3f}, p {p:.2g})",
        {"baseline": ka / na, "new": kb / nb, "pvalue": p, "n_baseline": na, "n_new": nb})


def _paired(a: RunSummary, b: RunSummary, rules: DriftRules, k: int
            ) -> tuple[list[DriftItem], list[dict], list[str]]:
    import numpy as np

    notes: list[str] = []
    by = "id" if a.keyed_by == "id" and b.keyed_by == "id" else "index"
    ca, cb = a.columns, b.columns
    assert ca is not None and cb is not None
    ka = np.frombuffer(ca["key" if by == "id" else "index"], dtype=np.int64)
    kb = np.frombuffer(cb["key" if by == "id" else "index"], dtype=np.int64)
    if by == "index" and (a.keyed_by == "id" or b.keyed_by == "id"):
        notes.append("records matched by index: one of the outputs has records without an id")
    # Keys that occur more than once in a run are left out (a duplicate id matches nothing).
    ua, ia_first, cnt_a = np.unique(ka, return_index=True, return_counts=True)
    ub, ib_first, cnt_b = np.unique(kb, return_index=True, return_counts=True)
    dup = int((cnt_a > 1).sum() + (cnt_b > 1).sum())
    if dup:
        notes.append(f"{dup} {by}(s) occur more than once in a run and were not matched")
    ua, ia_first = ua[cnt_a == 1], ia_first[cnt_a == 1]
    ub, ib_first = ub[cnt_b == 1], ib_first[cnt_b == 1]
    _, xa, xb = np.intersect1d(ua, ub, assume_unique=True, return_indices=True)
    ia, ib = ia_first[xa], ib_first[xb]
    n = int(ia.size)
    notes.append(f"{n} records in both runs (matched by {by}); {len(ka) - n} only in the "
                 f"baseline, {len(kb) - n} only in the new run")
    if n == 0:
        return [], [], notes
    sa = np.frombuffer(ca["score"], dtype=np.float64)[ia]
    sb = np.frombuffer(cb["score"], dtype=np.float64)[ib]
    d = sb - sa
    ad = np.abs(d)
    mean_d = float(d.mean())
    half = 1.96 * float(d.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
    items = [DriftItem(
        "record_scores", float(ad.mean()) >= rules.record_tol,
        f"per-record score change: mean {mean_d:+.4f} [{mean_d - half:+.4f}, "
        f"{mean_d + half:+.4f}], mean |change| {float(ad.mean()):.4f}, largest "
        f"{float(ad.max()):.4f}, {int((ad >= 0.05).sum())} of {n} records moved by >= 0.05",
        {"n_matched": n, "mean_change": mean_d, "mean_abs_change": float(ad.mean()),
         "max_abs_change": float(ad.max()), "p95_abs_change": float(np.quantile(ad, 0.95))})]
    va = np.frombuffer(ca["verdict"], dtype=np.int8)[ia]
    vb = np.frombuffer(cb["verdict"], dtype=np.int8)[ib]
    both = (va >= 0) & (vb >= 0)
    nv = int(both.sum())
    if nv:
        flips = int((va[both] != vb[both]).sum())
        lo, hi = wilson(flips, nv, 1 - rules.alpha)
        names = {0: "bad", 1: "good", 2: "abstain"}
        kinds: dict[str, int] = {}
        for x, y in zip(va[both].tolist(), vb[both].tolist(), strict=True):
            if x != y:
                key = f"{names[x]}->{names[y]}"
                kinds[key] = kinds.get(key, 0) + 1
        how = ", ".join(f"{c} {k}" for k, c in sorted(kinds.items())) or "none"
        items.append(DriftItem(
            "verdict_flips", lo >= rules.flip_rate,
            f"verdict flips: {flips} of {nv} matched records ({flips / nv:.1%}; "
            f"{1 - rules.alpha:.0%} interval [{lo:.1%}, {hi:.1%}]): {how}",
            {"flips": flips, "n": nv, "interval": [lo, hi], "kinds": kinds}))
    else:
        notes.append("no verdict flips counted: a run has neither a verdict field nor a "
                     "self-check threshold")
    la = np.frombuffer(ca["label"], dtype=np.int64)[ia]
    lb = np.frombuffer(cb["label"], dtype=np.int64)[ib]
    has = (la != 0) | (lb != 0)
    if has.any():
        ch = int((la[has] != lb[has]).sum())
        items.append(DriftItem(
            "labels", ch > 0,
            f"labels changed on {ch} of {int(has.sum())} matched records "
            f"({ch / int(has.sum()):.1%})", {"changed": ch, "n": int(has.sum())}))
    top = np.argsort(-ad, kind="stable")[:k]
    ixa = np.frombuffer(ca["index"], dtype=np.int64)[ia]
    ixb = np.frombuffer(cb["index"], dtype=np.int64)[ib]
    changed = [{"index_baseline": int(ixa[t]), "index_new": int(ixb[t]),
                "score_baseline": float(sa[t]), "score_new": float(sb[t]),
                "change": float(d[t])} for t in top.tolist() if ad[t] > 0]
    return items, changed, notes


def compare_summaries(a: RunSummary, b: RunSummary, *, check_a: Any = None, check_b: Any = None,
                      names: tuple[str, str] = ("baseline", "new"),
                      rules: DriftRules = DriftRules(), k: int = 10) -> Drift:
    """The :class:`Drift` of summary ``b`` (the new run) against ``a`` (the baseline), both
    from :func:`~icqs_fast.report.run_output.summarise` with ``columns=True``; ``check_a`` /
    ``check_b``: their self-checks (:func:`read_self_check`; None without one)."""
    items: list[DriftItem] = []
    notes: list[str] = []
    for name, what in (("score", "score"), ("p_good_calibrated", "p")):
        it = _distribution(name, what, a, b, rules)
        if it is not None:
            items.append(it)
        elif what == "p":
            notes.append("p_good_calibrated not compared: a run has none (no self-check "
                         "estimate)")
    sc = _self_check(check_a, check_b, rules)
    if not sc:
        notes.append("self-checks not compared: a run has no self-check estimate")
    items += sc
    la = _label_accuracy(a, b, rules)
    if la is not None:
        items.append(la)
    changed: list[dict] = []
    if a.columns is not None and b.columns is not None:
        pi, changed, pn = _paired(a, b, rules, k)
        items += pi
        notes += pn
    return Drift(names[0], names[1], items, changed, notes)


def compare_runs(baseline: str | RunOutput, new: str | RunOutput, *,
                 rules: DriftRules = DriftRules(), k: int = 10) -> Drift:
    """Compare the output ``new`` with the output ``baseline`` (paths of JSONL / Parquet
    outputs or ``--ray`` folders, or :class:`RunOutput` s), each read once.

    Raises:
        FileNotFoundError / InputError: an output that is missing or not readable.
    """
    ra = baseline if isinstance(baseline, RunOutput) else open_run(baseline)
    rb = new if isinstance(new, RunOutput) else open_run(new)
    ca, cb = read_self_check(ra.meta), read_self_check(rb.meta)
    sa = summarise(ra, threshold=_threshold(ca), columns=True)
    sb = summarise(rb, threshold=_threshold(cb), columns=True)
    return compare_summaries(sa, sb, check_a=ca, check_b=cb, names=(ra.path, rb.path),
                             rules=rules, k=k)


def _threshold(check: Any) -> float:
    return float(check.threshold) if check is not None and check.ok else math.nan
