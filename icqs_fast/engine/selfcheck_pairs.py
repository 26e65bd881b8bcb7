"""The pairwise self-check: how often the scorer picks the better of two answers to one
instruction, from the pools, with whole instructions held out.

``score --pairs`` asks which of two outputs is better, so its self-check must answer that
question, not the pointwise one. When the pools hold good and bad answers to the same
instructions (``--good-bad-pairs``, or ``--good`` / ``--bad`` files that share inputs), the
self-check (:func:`icqs_fast.engine.selfcheck.run_self_check` with ``pairwise=True``) draws
its held-out items **by instruction** (:func:`instruction_heldout`): every drawn instruction
brings its good and its bad answers, and the leak rule ``input`` already keeps every
demonstration set holding that instruction out of their scores, so an instruction leaves
whole. Its cross-fitted scores, cached per item as always, then give over the held-out pairs
(:func:`pairwise_self_check`):

* ICQS's expected pairwise accuracy (the good answer scored above the bad one; within
  ``tie_margin`` a tie, counted half) with a percentile bootstrap interval over pairs
  (:func:`icqs_fast.engine.pairs.pairwise_accuracy`);
* each trivial scorer's pairwise accuracy (:data:`~icqs_fast.engine.selfcheck_baselines.
  BASELINES`: lengths first), its direction fitted out of fold over instruction folds, as the
  pointwise baselines' are;
* with a target accuracy, the abstain band over pairs: a pair whose ``|score_a - score_b|``
  is at most its margin is a tie (sent to a person), fitted and measured out of fold over
  instruction folds as the pointwise band is (:func:`margin_band`, an
  :class:`~icqs_fast.engine.abstain.AbstainBand` from ``-t`` to ``t``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from icqs_fast.engine.abstain import AbstainBand, band_intervals, lowest_aim
from icqs_fast.engine.pairs import pairwise_accuracy
from icqs_fast.engine.prompts import Example, check_pool
from icqs_fast.engine.selfcheck_baselines import BASELINES

__all__ = ["instruction_heldout", "item_pairs", "margin_band", "pair_band_verdict",
           "pairwise_lines", "pairwise_self_check"]


def instruction_heldout(good: Sequence, bad: Sequence, max_heldout: int, seed: int
                        ) -> tuple[list[Example], np.ndarray] | None:
    """The held-out items of the pairwise self-check, drawn by instruction: the instructions
    ``x`` with answers in both pools, in a seeded order (``random.Random(seed)``), each
    bringing ``m = min(its good, its bad)`` answers of each pool (the first in pool order, so
    the classes stay even), while at most ``max_heldout`` items in all (a larger draw holds
    every instruction of a smaller one). Good items first, then bad, as
    :func:`icqs_fast.engine.crossfit.heldout_items` orders them, with their labels ``[n]``
    int64 (1 = good). None when no instruction has answers in both pools."""
    g, b = check_pool(good, "good"), check_pool(bad, "bad")
    by_x: dict[str, tuple[list[int], list[int]]] = {}
    for side, pool in enumerate((g, b)):
        for i, (x, _) in enumerate(pool):
            by_x.setdefault(x, ([], []))[side].append(i)
    both = [x for x, (ig, ib) in by_x.items() if ig and ib]
    if not both:
        return None
    ig: list[int] = []
    ib: list[int] = []
    for x in random.Random(seed).sample(both, len(both)):
        xg, xb = by_x[x]
        m = min(len(xg), len(xb))
        if len(ig) + len(ib) + 2 * m > max_heldout:
            break
        ig += xg[:m]
        ib += xb[:m]
    ig.sort()
    ib.sort()
    labels = np.array([1] * len(ig) + [0] * len(ib), dtype=np.int64)
    return [g[i] for i in ig] + [b[i] for i in ib], labels


def item_pairs(items: Sequence[Example], labels: Sequence[int]) -> list[tuple[int, int]]:
    """``(i, j)`` item indices of every good item ``i`` and bad item ``j`` with the same
    instruction, by ``i`` then ``j``."""
    bad_of: dict[str, list[int]] = {}
    for j, ((x, _), lab) in enumerate(zip(items, labels, strict=True)):
        if int(lab) == 0:
            bad_of.setdefault(x, []).append(j)
    return [(i, j) for i, ((x, _), lab) in enumerate(zip(items, labels, strict=True))
            if int(lab) == 1 for j in bad_of.get(x, ())]


def _instruction_folds(groups: np.ndarray, folds: int, seed: int) -> list[np.ndarray]:
    """Per fold the pair indices it holds: instructions (``groups`` ``[n]``) dealt to
    ``min(folds, instructions)`` folds in a seeded order, a pair going with its
    instruction."""
    uniq = np.unique(groups)
    order = np.random.default_rng(seed).permutation(uniq.size)
    fold_of = np.empty(uniq.size, dtype=np.int64)
    fold_of[order] = np.arange(uniq.size) % max(1, min(folds, uniq.size))
    at = fold_of[np.searchsorted(uniq, groups)]
    return [np.flatnonzero(at == f) for f in range(int(at.max()) + 1)]


def _preferred(d: Any, tie: float = 0.0) -> list[str]:
    """"a" / "b" / "tie" of oriented differences (``a`` = the good side)."""
    return ["tie" if not abs(v) > tie else ("a" if v > 0 else "b") for v in d]


def pairwise_self_check(scores: np.ndarray, labels: np.ndarray, items: Sequence[Example],
                        values: Sequence[dict[str, float]] | None = None, *,
                        tie_margin: float = 0.0, target_accuracy: float | None = None,
                        folds: int, seed: int, n_boot: int, level: float
                        ) -> dict[str, Any] | None:
    """The pairwise part of a self-check (see the module docstring), JSON-able (NaN as None),
    or None when the held-out items make no pair.

    Args:
        scores: ``[n]`` float64 cross-fitted scores of ``items`` (NaN: skipped; such a pair
            is left out).
        labels: ``[n]`` int64, 1 = good pool.
        items: the held-out ``(x, y)`` items; a pair is a good and a bad item with one ``x``.
        values: per item the trivial scorers' values
            (:func:`icqs_fast.engine.selfcheck_baselines.item_values`); None: no baselines.
        tie_margin: ``|margin|`` at most this is a tie (``--tie-margin``).
        target_accuracy: also the abstain band over pairs for it.
        folds, seed, n_boot, level: the self-check's folds, seed, resamples and level.

    Returns:
        ``{"pairs", "instructions", "accuracy", "accuracy_lo", "accuracy_hi", "ties",
        "tie_margin", "level", "baselines": [{"name", "text", "accuracy", "accuracy_lo",
        "accuracy_hi", "direction"}], "band": AbstainBand dict or None, "beaten"}``.
    """
    s = np.asarray(scores, dtype=np.float64)
    pairs = [(i, j) for i, j in item_pairs(items, labels)
             if math.isfinite(s[i]) and math.isfinite(s[j])]
    if not pairs:
        return None
    gi = np.array([i for i, _ in pairs])
    bi = np.array([j for _, j in pairs])
    xs = [items[i][0] for i in gi]
    _, groups = np.unique(np.array(xs, dtype=object).astype(str), return_inverse=True)
    d = s[gi] - s[bi]
    pref = _preferred(d, tie_margin)
    right = ["a"] * len(pairs)
    acc, lo, hi = pairwise_accuracy(pref, right, n_boot=n_boot, level=level, seed=seed)
    fold_idx = _instruction_folds(groups, folds, seed)
    base = []
    for b in BASELINES if values is not None else ():
        v = np.array([values[k].get(b.name, math.nan) for k in range(len(values))],
                     dtype=np.float64)
        if not np.isfinite(v).all():
            continue
        dv = v[gi] - v[bi]
        signed = np.empty_like(dv)
        for te in fold_idx:
            tr = np.setdiff1d(np.arange(dv.size), te)
            # The sign that wins more of the other folds' pairs (all of them when one fold).
            ref = dv[tr] if tr.size else dv
            up = float(np.sign(ref).sum()) >= 0.0
            signed[te] = dv[te] if up else -dv[te]
        bacc, blo, bhi = pairwise_accuracy(_preferred(signed), right, n_boot=n_boot,
                                           level=level, seed=seed)
        base.append({"name": b.name, "text": b.text, "accuracy": bacc, "accuracy_lo": blo,
                     "accuracy_hi": bhi,
                     "direction": "higher" if float(np.sign(dv).sum()) >= 0 else "lower"})
    band = (margin_band(d, groups, target_accuracy, folds=folds, seed=seed, n_boot=n_boot,
                        level=level).to_dict() if target_accuracy is not None else None)
    above = [b for b in base if b["accuracy_lo"] > hi]
    beaten = ""
    if above:
        w = max(above, key=lambda r: r["accuracy"])
        beaten = (f"{w['text']} beats ICQS on the held-out pairs: pairwise accuracy "
                  f"{w['accuracy']:.3f} [{w['accuracy_lo']:.3f}, {w['accuracy_hi']:.3f}] "
                  f"against ICQS's {acc:.3f} [{lo:.3f}, {hi:.3f}]")
    return {"pairs": len(pairs), "instructions": int(groups.max()) + 1, "accuracy": acc,
            "accuracy_lo": lo, "accuracy_hi": hi, "ties": pref.count("tie"),
            "tie_margin": float(tie_margin), "level": level, "baselines": base, "band": band,
            "beaten": beaten}


def _fit_margin(d: np.ndarray, aim: float) -> float | None:
    """The smallest ``t >= 0`` (0, or midway between two ``|d|``) whose pairs with ``|d| > t``
    are at least ``aim`` right (``d > 0``) - the largest coverage; None when none is."""
    a = np.sort(np.abs(d))
    cuts = np.unique(np.concatenate([[0.0], (a[1:] + a[:-1]) / 2]))
    for t in cuts:
        out = np.abs(d) > t
        if out.any() and (d[out] > 0).mean() >= aim - 1e-9:
            return float(t)
    return None


def margin_band(d: np.ndarray, groups: np.ndarray, target: float, *, folds: int, seed: int,
                n_boot: int, level: float) -> AbstainBand:
    """The abstain band over pairs: a pair whose ``|margin| <= t`` is a tie (sent to a
    person), the rest judged by the margin's sign, ``t`` the smallest whose outside reaches
    ``target`` (the largest coverage). Symmetric, since which output is a is arbitrary. As
    :func:`icqs_fast.engine.abstain.abstain_band` does for single items: fitted for the
    lowest in-sample accuracy ("aim", from ``target`` up in steps of 0.01) that reaches
    ``target`` out of fold (instruction folds, :func:`_instruction_folds`), its coverage and
    accuracy measured out of fold with percentile bootstrap intervals over pairs; an
    :class:`~icqs_fast.engine.abstain.AbstainBand` with ``lo = -t``, ``hi = t``.

    Args:
        d: ``[n]`` float64 oriented margins, score of the better output minus the other's.
        groups: ``[n]`` int, each pair's instruction.
    """
    t_all = _fit_margin(d, target)
    if t_all is None:
        return AbstainBand(target, -math.inf, math.inf, False, coverage=0.0, level=level)
    parts = _instruction_folds(groups, folds, seed)

    def out_of_fold(aim: float) -> tuple[np.ndarray, np.ndarray]:
        covered = np.zeros(d.shape, dtype=bool)
        correct = np.zeros(d.shape, dtype=bool)
        for te in parts:
            tr = np.setdiff1d(np.arange(d.size), te)
            t = _fit_margin(d[tr], aim) if tr.size else None
            if t is not None:
                covered[te] = np.abs(d[te]) > t
                correct[te] = covered[te] & (d[te] > 0)
        return covered, correct

    aim, covered, correct = lowest_aim(target, out_of_fold)
    t = _fit_margin(d, aim)
    t = t_all if t is None else t
    n_cov = int(covered.sum())
    c_lo, c_hi, a_lo, a_hi = band_intervals(covered, correct, n_boot=n_boot, seed=seed,
                                            level=level)
    return AbstainBand(target, -t, t, True, coverage=float(covered.mean()), coverage_lo=c_lo,
                       coverage_hi=c_hi, accuracy=correct.sum() / n_cov if n_cov else math.nan,
                       accuracy_lo=a_lo, accuracy_hi=a_hi, level=level, aim=aim)


def pair_band_verdict(band: dict[str, Any], margin: float) -> str:
    """"a", "b" or "tie" of one pair's ``margin`` (``score_a - score_b``) under a pairwise
    band (:func:`pairwise_self_check`'s ``band``, :func:`margin_band`): "tie" when
    ``|margin| <= t`` (and for every margin when no band reaches the target), else the
    higher-scored output."""
    b = AbstainBand.from_dict(band)
    if not b.reached or not abs(margin) > b.hi:
        return "tie"
    return "a" if margin > 0 else "b"


def _iv(v: Any, lo: Any, hi: Any) -> str:
    def f(u: Any) -> str:
        return "n/a" if u is None or not math.isfinite(u) else f"{u:.3f}"

    return f"{f(v)} [{f(lo)}, {f(hi)}]"


def pairwise_lines(p: dict[str, Any] | None) -> list[str]:
    """The pairwise self-check in plain lines for the summary and ``check`` ([] without)."""
    if not p:
        return []
    lvl = p.get("level") or 0.95
    tie = p.get("tie_margin") or 0.0
    out = [f"pairwise ({p['pairs']} held-out pairs of {p['instructions']} instructions, whole "
           f"instructions held out): expected pairwise accuracy "
           f"{_iv(p['accuracy'], p['accuracy_lo'], p['accuracy_hi'])} ({lvl:.0%} interval"
           + (f"; {p['ties']} ties within --tie-margin {tie:g}" if p["ties"] else "") + ")"]
    if p["baselines"]:
        out.append("pairwise baselines (direction fitted out of fold): " + ", ".join(
            f"{b['name']} {_iv(b['accuracy'], b['accuracy_lo'], b['accuracy_hi'])} "
            f"({b['direction']} is better)" for b in p["baselines"]))
    if p.get("beaten"):
        out.append(f"WARNING: {p['beaten']}")
    band = p.get("band")
    if band is not None:
        b = AbstainBand.from_dict(band)
        if not b.reached:
            out.append(f"pairwise abstain band: no margin band reaches accuracy {b.target:g} "
                       "on the held-out pairs; every pair is a tie")
        else:
            acc = ("n/a" if math.isnan(b.accuracy) else
                   _iv(b.accuracy, b.accuracy_lo, b.accuracy_hi))
            out.append(f"pairwise abstain band for accuracy {b.target:g}: tie when "
                       f"|margin| <= {b.hi:.4f}, else the higher-scored output; coverage "
                       f"{_iv(b.coverage, b.coverage_lo, b.coverage_hi)} of the pairs, "
                       f"accuracy outside the band {acc} (out of fold)"
                       + ("" if math.isnan(b.accuracy) or b.accuracy >= b.target else
                          "; under the target out of fold: do not rely on it"))
    return out
