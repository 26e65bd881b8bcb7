"""Does the self-check predict the truth? The pools' self-check against labelled test responses.

Per dataset (SST-2, FPB, ChaosNLI) and seed (:func:`run_one`): the study's pools (SST-2 / FPB:
``pool`` good sentences with their own label, ``pool`` other ones with the label flipped;
ChaosNLI: ``pool`` majority-entailment premise / hypothesis pairs as good, ``pool``
majority-contradiction ones as bad; :mod:`icqs_fast.evals.study_data`) build one
:class:`~icqs_fast.engine.scorer.ICQSScorer` at the default scoring settings (demonstration sets
seeded with the seed). The self-check cross-fits the held-out pool members
(:func:`icqs_fast.engine.selfcheck.crossfit_heldout`); the same scorer then scores ``n_test``
test sentences answered right and the same ones answered with the flipped label (the study's
correct / incorrect groups; ChaosNLI: ``n_test`` entailment and ``n_test`` contradiction pairs
whose premise is in neither pool). The raw scores, every response's log-likelihood matrix and
the held-out items' clean-context masks are kept, so :func:`analyse` can refit and recompute
scores offline.

:func:`analyse` compares, per run: the self-check's AUC and its interval with the test AUC (inside
the interval?), and the ECE / Brier of ``p_good_calibrated`` on the test responses with those of
the uncalibrated ``p_good`` and of a constant 0.5 (Brier 0.25), and the test AUC again with every
test response scored from a held-out item's clean contexts only (:func:`matched_test_auc`: the
self-check's handicap given to the test responses, to tell "fewer contexts" from "pool items
are not like responses" when the two AUCs differ). :func:`summarise` gives the per-dataset
bias table; :func:`exchange_null` / :func:`exchange_summary` test whether held-out items are
scored like test responses at all (a permutation null); :func:`add_test_responses` enlarges a
stored run's test set with the run's own scorer. The cost of the self-check per record is
timed in the same run (held-out items and test records go through the same scorer and prefix
bank).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from icqs_fast import metrics
from icqs_fast.engine.selfcheck import (
    DEFAULT_MAX_HELDOUT,
    crossfit_heldout,
    crossfit_score,
    fit_self_check,
)
from icqs_fast.io.files import write_whole

DATASETS = ("sst2", "fpb", "chaosnli")
# Draws of the held-out masks per test response in :func:`matched_test_auc` (averaged).
MATCH_DRAWS = 20
# Permutations per run in :func:`exchange_null` (the null of the per-dataset means).
PERMUTATIONS = 200
# Partitions into folds per permutation of :func:`exchange_null`: one, where the self-check
# averages 20 (``CV_REPEATS``), for a null 20 times cheaper (200 permutations x 20 partitions x 5
# Platt fits took ~2 minutes per run). A single partition's expected accuracy varies more, so
# the null of the accuracy gap is a little wider than the observed statistic's (conservative);
# the AUC, interval and score statistics do not depend on it.
NULL_CV_REPEATS = 1
# Records of the job the self-check's cost is stated against.
JOB_RECORDS = 10_000


def study_pools(dataset: str, *, pool: int, n_test: int, seed: int
                ) -> tuple[list, list, list[tuple[str, str, int]], Any]:
    """``(good, bad, test, template)``: the study's pools, the test responses as ``(x, y, 1 if
    right else 0)`` (right ones first) and the template (None: the default one).

    SST-2 / FPB: ``n_test`` sentences answered right and the same ones flipped. ChaosNLI: ``n_test``
    majority-entailment (1) and ``n_test`` majority-contradiction (0) pairs, drawn with the seed
    from the pairs whose premise is in neither pool (a premise shared with a pool item would give
    the test response a leak the held-out items are denied)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if dataset == "chaosnli":
        import random

        from icqs_fast.engine.prompts import Template
        from icqs_fast.evals.study import NLI_ICQS_TEMPLATE
        from icqs_fast.evals.study_data import chaosnli_data

        nli = chaosnli_data(pool=pool, seed=seed)
        good = [(it.premise, it.hypothesis) for it in nli.good]
        bad = [(it.premise, it.hypothesis) for it in nli.bad]
        seen = {x for x, _ in good + bad}
        rng = random.Random(seed)
        test = []
        for lab, maj in ((1, "e"), (0, "c")):
            cand = [it for it in nli.test if it.majority == maj and it.premise not in seen]
            test += [(it.premise, it.hypothesis, lab)
                     for it in rng.sample(cand, min(n_test, len(cand)))]
        return good, bad, test, Template(**NLI_ICQS_TEMPLATE)
    from icqs_fast.evals.study_data import fpb_data, sst2_data

    load = sst2_data if dataset == "sst2" else fpb_data
    data = load(pool=pool, limit=n_test, seed=seed)
    test = [(r.x, r.y, 1) for r in data.groups["correct"]] + \
        [(r.x, r.y, 0) for r in data.groups["incorrect"]]
    return data.good, data.bad, test, None


def run_one(model: Any, tok: Any, dataset: str, seed: int, *, pool: int = 32, n_test: int = 100,
            max_heldout: int = DEFAULT_MAX_HELDOUT, quiet: bool = True) -> dict[str, Any]:
    """Score one (dataset, seed) (:func:`run_pools` on :func:`study_pools`) at the default
    settings (``seed`` = the demonstration sets' seed). Returns the raw JSON-able record."""
    from icqs_fast.engine.settings import ScoringSettings

    good, bad, test, tpl = study_pools(dataset, pool=pool, n_test=n_test, seed=seed)
    settings = ScoringSettings(seed=seed, template=tpl)
    raw = run_pools(model, tok, good, bad, test, settings, max_heldout=max_heldout, seed=seed,
                    desc=f"{dataset} s{seed}", quiet=quiet)
    return {"dataset": dataset, "pool": pool, **raw}


def run_pools(model: Any, tok: Any, good: Sequence, bad: Sequence,
              test: Sequence[tuple[str, str, int]], settings: Any, *,
              max_heldout: int = DEFAULT_MAX_HELDOUT, seed: int = 0, desc: str = "",
              quiet: bool = True) -> dict[str, Any]:
    """The self-check's held-out items, then the ``test`` responses ``(x, y, label)``, through
    one :class:`~icqs_fast.engine.scorer.ICQSScorer` built from ``good`` / ``bad`` with
    ``settings`` (the held-out draw seeded with ``seed``).

    Returns the raw JSON-able record: per held-out item its label, cross-fitted and full score,
    clean-context mask ``[M+1, L]`` (0/1) and log-likelihood matrix ``[M+1, L]`` (calibrated as
    the score uses it); per test response its label, score, ``p_good`` and matrix; the score
    kind, ratios and tie epsilon (to recompute a score from a matrix); the timings."""
    import torch

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.models import dtype_name
    from icqs_fast.progress import track

    sc = ICQSScorer(model, tok, good, bad, settings)
    t0 = time.perf_counter()
    _ = sc.prefix_bank  # built once, before both (a job builds it before its records too)
    t1 = time.perf_counter()
    kept: list[Any] = []

    def bar(it: Iterable, total: int, what: str = "self-check") -> Iterable:
        def tap(stream: Iterable) -> Iterator:
            for r in stream:  # keep the results the self-check reduces to one score each
                kept.append(r)
                yield r
        return track(tap(it), total=total, desc=f"{what} {desc}", unit="item", quiet=quiet)

    cf = crossfit_heldout(sc, good, bad, max_heldout=max_heldout, seed=seed, progress=bar)
    held = list(kept)
    kept.clear()
    t2 = time.perf_counter()
    res = list(bar(sc.score([(x, y) for x, y, _ in test]), len(test), "test"))
    t3 = time.perf_counter()
    first = (held or res)[0]
    return {
        "seed": seed, "n_test": len(test), "settings": settings.asdict(),
        "max_heldout": max_heldout, "torch_threads": torch.get_num_threads(),
        "dtype": dtype_name(model),
        "score_kind": first.score_kind, "ratios": [float(r) for r in first.ratios],
        "tie_epsilon": float(first.tie_epsilon),
        "heldout": {"labels": cf.labels.tolist(), "scores": _nan_none(cf.scores),
                    "full_scores": _nan_none(cf.full_scores),
                    "clean_contexts": cf.clean.sum(axis=(1, 2)).tolist(),
                    "n_contexts": int(cf.clean.shape[1] * cf.clean.shape[2]),
                    "clean": cf.clean.astype(np.int8).tolist(),
                    "loglik": [_matrix(r) for r in held]},
        "test": {"labels": [lab for _, _, lab in test], "scores": [r.score for r in res],
                 "p_good": [r.p_good for r in res], "loglik": [_matrix(r) for r in res]},
        "seconds": {"prefix_bank": round(t1 - t0, 2), "heldout": round(t2 - t1, 2),
                    "test": round(t3 - t2, 2)},
    }


def add_test_responses(model: Any, tok: Any, raw: dict[str, Any], n_more: int, *,
                       quiet: bool = True) -> dict[str, Any]:
    """``raw`` (a :func:`run_one` record) with ``n_more`` more test responses per class, scored
    by the run's own scorer (same pools, settings and demonstration sets; the held-out part is
    kept as it is). The new responses are drawn as :func:`study_pools` draws them, from a
    larger draw, leaving out those the run holds already; ``n_test_scored_first`` keeps the
    run's first count. A smaller test set gives the test AUC as much sampling error as the
    self-check's own, so larger ones are what can show the interval's coverage."""
    ds, seed = raw["dataset"], raw["seed"]
    t = raw["test"]
    good, bad, held, tpl = scored_tests(raw)
    if [lab for *_, lab in held] != t["labels"]:
        raise ValueError(f"{ds} s{seed}: the stored test responses are not study_pools' draw")
    new = more_tests(raw, held, good, bad, n_more)
    sc = run_scorer(model, tok, raw, good, bad, tpl)
    from icqs_fast.progress import track

    t0 = time.perf_counter()
    # The run's first test response once more: the same scorer must give its score back.
    pairs = [(x, y) for x, y, _ in new] + [held[0][:2]]
    res = list(track(sc.score(pairs), total=len(pairs), desc=f"more tests {ds} s{seed}",
                     unit="item", quiet=quiet))
    again = res.pop()
    if abs(again.score - t["scores"][0]) > 0.01:
        raise ValueError(f"{ds} s{seed}: the rebuilt scorer gives {again.score:.4f} for a "
                         f"stored test response scored {t['scores'][0]:.4f}")
    sec = time.perf_counter() - t0
    test = {"labels": t["labels"] + [lab for *_, lab in new],
            "scores": t["scores"] + [r.score for r in res],
            "p_good": t["p_good"] + [r.p_good for r in res],
            "loglik": t["loglik"] + [_matrix(r) for r in res]}
    return {**raw, "test": test, "n_test": len(test["labels"]),
            "n_test_scored_first": raw.get("n_test_scored_first", raw["n_test"]),
            "test_added_per_class": added_per_class(raw) + [n_more],
            "seconds": {**raw["seconds"], "test_added": round(sec, 2)}}


def run_scorer(model: Any, tok: Any, raw: dict[str, Any], good: Sequence, bad: Sequence,
               template: Any) -> Any:
    """The :class:`~icqs_fast.engine.scorer.ICQSScorer` of ``raw`` (a :func:`run_one` record)
    rebuilt from its pools ``good`` / ``bad`` and ``template`` as :func:`run_one` built it,
    after checking that it is the run's: the same scoring settings and the model's dtype."""
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.engine.settings import ScoringSettings
    from icqs_fast.models import dtype_name

    ds, seed = raw["dataset"], raw["seed"]
    sc = ICQSScorer(model, tok, good, bad, ScoringSettings(seed=seed, template=template))
    if sc.settings.asdict() != raw["settings"]:
        raise ValueError(f"{ds} s{seed}: the scoring settings differ from the run's")
    if dtype_name(model) != raw["dtype"]:
        raise ValueError(f"{ds} s{seed}: the run was scored at {raw['dtype']}, the model is "
                         f"{dtype_name(model)}")
    return sc


def added_per_class(raw: dict[str, Any]) -> list[int]:
    """The test responses per class each :func:`add_test_responses` call appended to ``raw``, in
    order (a record written before the list was kept had at most one such call)."""
    if "test_added_per_class" in raw:
        return list(raw["test_added_per_class"])
    first = raw.get("n_test_scored_first")
    return [] if first is None or first == raw["n_test"] else [(raw["n_test"] - first) // 2]


def more_tests(raw: dict[str, Any], held: list, good: list, bad: list, n_more: int) -> list:
    """``n_more`` test responses per class (class 1 first) that ``held`` (the run's, in order)
    lacks, as :func:`study_pools` draws them from a larger draw."""
    ds, seed, pool = raw["dataset"], raw["seed"], raw["pool"]
    g2, b2, bigger, _ = study_pools(ds, pool=pool, n_test=len(held) // 2 + 4 * n_more,
                                    seed=seed)
    if (g2, b2) != (good, bad):
        raise ValueError(f"{ds} s{seed}: a larger test draw changes the pools")
    have = set(held)
    new = []
    for lab in (1, 0):
        more = [r for r in bigger if r[2] == lab and r not in have][:n_more]
        if len(more) < n_more:
            raise ValueError(f"{ds} s{seed}: only {len(more)} more test responses of class {lab}")
        new += more
    return new


def scored_tests(raw: dict[str, Any]) -> tuple[list, list, list, Any]:
    """``(good, bad, test, template)`` as :func:`study_pools` gives them, with the test
    responses ``(x, y, label)`` the run holds, in their stored order: :func:`study_pools`' first
    draw, then each :func:`add_test_responses` call's (:func:`added_per_class`)."""
    ds, seed, pool = raw["dataset"], raw["seed"], raw["pool"]
    first = raw.get("n_test_scored_first", raw["n_test"])
    good, bad, held, tpl = study_pools(ds, pool=pool, n_test=first // 2, seed=seed)
    for n in added_per_class(raw):
        held = held + more_tests(raw, held, good, bad, n)
    return good, bad, held, tpl


def first_tests(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with only the test responses scored with the run (the first
    ``n_test_scored_first``; :func:`add_test_responses` appends the others): the run as it
    was before its test set was enlarged. ``raw`` itself when it was not."""
    n = raw.get("n_test_scored_first")
    if n is None:
        return raw
    t = raw["test"]
    return {**raw, "n_test": n, "test": {k: v[:n] for k, v in t.items()}}


def stored_runs(folder: str, seeds: Sequence[int], datasets: Sequence[str],
                score: Any, *, analyse_only: bool = False) -> list[dict[str, Any]]:
    """The raw run of every (dataset, seed), seed-major (a study stopped early still covers
    every data set): read from ``folder/{dataset}_s{seed}.json`` when it is there, else
    ``score(dataset, seed)`` (the raw record) written there whole (a killed run leaves no half
    file), unless ``analyse_only``, which skips the missing ones."""
    import json
    import os
    import sys

    os.makedirs(folder, exist_ok=True)
    raws = []
    for seed in seeds:
        for ds in datasets:
            path = os.path.join(folder, f"{ds}_s{seed}.json")
            if not os.path.exists(path):
                if analyse_only:
                    continue
                t0 = time.perf_counter()
                raw = score(ds, seed)
                write_whole(path, json.dumps(raw))
                print(f"{ds} s{seed}: {time.perf_counter() - t0:.0f} s -> {path}",
                      file=sys.stderr, flush=True)
            with open(path) as f:
                raws.append(json.load(f))
    return raws


def _matrix(res: Any) -> list[list[float]]:
    """The ``[M+1, L]`` log-likelihoods a score is computed from (the baseline subtracted, as
    :func:`~icqs_fast.engine.selfcheck.crossfit_score` does), rounded to 1e-5 nats."""
    ll = res.loglik.double()
    if res.loglik_baseline is not None:
        ll = ll - res.loglik_baseline.double()
    return [[round(float(v), 5) for v in row] for row in ll.tolist()]


def stored_result(raw: dict[str, Any], matrix: Sequence) -> Any:
    """A stand-in result for :func:`~icqs_fast.engine.selfcheck.crossfit_score` from a stored
    matrix (no baseline: it is already subtracted)."""
    import torch

    return SimpleNamespace(loglik=torch.tensor(matrix, dtype=torch.float64),
                           loglik_baseline=None, ratios=raw["ratios"],
                           score_kind=raw["score_kind"], tie_epsilon=raw["tie_epsilon"])


def matched_test_auc(raw: dict[str, Any], *, draws: int = MATCH_DRAWS,
                     effects: np.ndarray | None = None) -> float:
    """The test AUC with each test response scored only from the clean contexts of a held-out
    item of its own class (drawn at random, seeded by the run's seed; mean AUC over ``draws``
    draws): what the test AUC would be under the self-check's handicap of fewer contexts.
    ``effects``: subtract these set effects (:func:`set_effects`) first. NaN without stored
    matrices."""
    h, t = raw["heldout"], raw["test"]
    if "loglik" not in t or "clean" not in h:
        return math.nan
    hy = np.asarray(h["labels"])
    masks = {lab: [np.asarray(m, dtype=bool) for m, y in zip(h["clean"], hy, strict=True)
                   if y == lab] for lab in (0, 1)}
    ty = np.asarray(t["labels"])
    eff = np.zeros(np.shape(t["loglik"])[1:]) if effects is None else effects
    rng = np.random.default_rng(raw["seed"])
    aucs = []
    for _ in range(draws):
        drawn = [masks[int(y)][rng.integers(len(masks[int(y)]))] for y in ty]
        s = adjusted_scores(raw, t["loglik"], drawn, eff)
        ok = np.isfinite(s)
        aucs.append(metrics.auc(ty[ok], s[ok]))
    return float(np.mean(aucs))


def set_effects(loglik: np.ndarray, clean: np.ndarray, iters: int = 20) -> np.ndarray:
    """``[M+1, L]`` float64: each context's shift shared by every response (the demonstration
    set's own effect), fitted on the held-out items' clean contexts only.

    The additive model ``loglik[i, j, l] = a[i, j] + e[j, l]`` with ``sum_l e[j, l] = 0`` is fitted
    by alternating means over the clean entries (``clean[i, j, l]``; the leaked ones are missing).
    A test response uses every context, so the ``e[j, :]`` of a ratio cancel in its per-ratio mean;
    a held-out item misses the sets that hold it, so without this they do not cancel and turn
    into per-item noise that is worst exactly where the classes differ (a good item misses
    all-good sets, a bad one all-bad sets).

    Args:
        loglik: ``[n, M+1, L]`` the held-out items' (calibrated) log-likelihoods.
        clean: ``[n, M+1, L]`` bool, the contexts each item may use.
    """
    ll = np.asarray(loglik, dtype=np.float64)
    c = np.asarray(clean, dtype=bool)
    w = c.astype(np.float64)
    e = np.zeros(ll.shape[1:])
    for _ in range(iters):
        a = ((ll - e) * w).sum(axis=2) / np.maximum(w.sum(axis=2), 1.0)  # [n, M+1]
        e = ((ll - a[:, :, None]) * w).sum(axis=0) / np.maximum(w.sum(axis=0), 1.0)
        e = e - e.mean(axis=1, keepdims=True)
    return e


def adjusted_scores(raw: dict[str, Any], matrices: Sequence, masks: Sequence,
                    effects: np.ndarray) -> np.ndarray:
    """``[n]`` float64: each matrix's score from its ``masks`` contexts after subtracting the
    set ``effects`` (:func:`set_effects`); NaN where a ratio has no clean context."""
    import torch

    out = []
    for m, mask in zip(matrices, masks, strict=True):
        adj = np.asarray(m, dtype=np.float64) - effects
        out.append(crossfit_score(stored_result(raw, adj.tolist()),
                                  torch.as_tensor(np.asarray(mask, dtype=bool))))
    return np.asarray(out, dtype=np.float64)


def shared_inputs(good: Sequence, bad: Sequence) -> int:
    """How many pool items share their input ``x`` with another pool item (either pool): the
    items the ``input`` leak rule takes more than their own contexts from, and whose
    demonstrations could otherwise hold their own input with another answer."""
    from collections import Counter

    xs = [it[0] for it in list(good) + list(bad)]
    count = Counter(xs)
    return sum(count[x] > 1 for x in xs)


def matched_score_table(raw: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(table, y)``: ``table[t, k]`` float64 ``[n_test, K]``, test response ``t``
    scored from the clean contexts of the ``k``-th held-out item of its own class (the
    self-check's handicap), ``y`` ``[n_test]`` its 0/1 label. Needs the stored matrices."""
    h, t = raw["heldout"], raw["test"]
    hy = np.asarray(h["labels"])
    ok = np.isfinite(nan_array(h["scores"]))  # a skipped item's mask leaves a ratio empty
    masks = {lab: [np.asarray(m, dtype=bool) for m, y, o in zip(h["clean"], hy, ok, strict=True)
                   if y == lab and o] for lab in (0, 1)}
    ty = np.asarray(t["labels"], dtype=np.int64)
    zero = np.zeros(np.shape(t["loglik"])[1:])
    table = [adjusted_scores(raw, [m] * len(masks[int(y)]), masks[int(y)], zero)
             for m, y in zip(t["loglik"], ty, strict=True)]
    width = max(len(r) for r in table)  # both classes hold as many items (class-balanced)
    return np.asarray([np.resize(r, width) for r in table], dtype=np.float64), ty


def exchange_null(raw: dict[str, Any], *, perms: int = PERMUTATIONS, n_boot: int = 200,
                  cv_repeats: int = NULL_CV_REPEATS) -> dict[str, Any] | None:
    """What the self-check against the test set looks like when held-out items and test
    responses ARE scored alike: a permutation null for one run with stored matrices (None
    without them).

    Each test response is scored from the clean contexts of a held-out item of its own class
    (drawn anew per permutation: :func:`matched_score_table`), so both groups carry the same
    handicap; then, per class, the held-out items' scores and these are pooled and dealt out
    again at the run's sizes, the self-check is fitted on the "held-out" share
    (``fit_self_check``, ``n_boot`` bootstrap draws, ``cv_repeats`` partitions into folds) and
    compared with the "test" share. Seeded by the run's seed.

    Returns per permutation ``[perms]`` lists: ``gap`` (expected accuracy minus the test
    accuracy at the self-check's threshold), ``auc_diff`` (self-check minus test AUC),
    ``inside`` (test AUC inside the interval, 0/1), ``shift_good`` / ``shift_bad`` (mean
    held-out score minus mean test score of the class), ``spread`` (the held-out scores' SD
    within a class minus the test scores', mean of the two classes); and the run's own
    ``observed_shift_good`` / ``observed_shift_bad`` / ``observed_spread`` (plain test
    scores)."""
    if "loglik" not in raw["test"] or "clean" not in raw["heldout"]:
        return None
    h = raw["heldout"]
    hs, hy = nan_array(h["scores"]), np.asarray(h["labels"], dtype=np.int64)
    fin = np.isfinite(hs)
    hs, hy = hs[fin], hy[fin]
    table, ty = matched_score_table(raw)
    ts = nan_array(raw["test"]["scores"])
    rng = np.random.default_rng([raw["seed"], 40])
    out: dict[str, list[float]] = {k: [] for k in ("gap", "auc_diff", "inside", "shift_good",
                                                   "shift_bad", "spread")}
    for k in range(perms):
        drawn = table[np.arange(len(ty)), rng.integers(table.shape[1], size=len(ty))]
        new_h, new_t = np.empty_like(hs), np.empty_like(drawn)
        for lab in (0, 1):
            both = rng.permutation(np.concatenate([hs[hy == lab], drawn[ty == lab]]))
            n_h = int((hy == lab).sum())
            new_h[hy == lab], new_t[ty == lab] = both[:n_h], both[n_h:]
        chk = fit_self_check(new_h, hy, seed=k, n_boot=n_boot, cv_repeats=cv_repeats)
        if not chk.ok:
            continue
        t_auc = metrics.auc(ty, new_t)
        out["gap"].append(chk.expected_accuracy
                          - float(((new_t >= chk.threshold) == (ty == 1)).mean()))
        out["auc_diff"].append(chk.auc - t_auc)
        out["inside"].append(float(chk.auc_lo <= t_auc <= chk.auc_hi))
        for lab, name in ((1, "shift_good"), (0, "shift_bad")):
            out[name].append(float(new_h[hy == lab].mean() - new_t[ty == lab].mean()))
        out["spread"].append(_spread(new_h, hy, new_t, ty))
    return {"perms": perms, "n_boot": n_boot, "cv_repeats": cv_repeats, **out,
            "observed_shift_good": float(hs[hy == 1].mean() - ts[ty == 1].mean()),
            "observed_shift_bad": float(hs[hy == 0].mean() - ts[ty == 0].mean()),
            "observed_spread": _spread(hs, hy, ts, ty)}


def _spread(hs: np.ndarray, hy: np.ndarray, ts: np.ndarray, ty: np.ndarray) -> float:
    """The held-out scores' within-class SD minus the test scores', mean of the classes."""
    return float(np.mean([hs[hy == lab].std(ddof=1) - ts[ty == lab].std(ddof=1)
                          for lab in (0, 1)]))


def exchange_summary(rows: Sequence[dict[str, Any]], nulls: Sequence[dict[str, Any] | None]
                     ) -> dict[str, Any]:
    """Per dataset (and ``"all"``), over the runs with a null (:func:`exchange_null`; ``rows``
    the matching :func:`analyse` rows): each statistic observed (mean over the runs) against
    its permutation null (the mean over the runs of one permutation each, permutation ``k``
    of every run together), with the null's mean, its 2.5-97.5 % range and the two-sided
    p-value (share of null means at least as far from the null's centre). Statistics: the
    signed and the absolute accuracy gap, the AUC difference, the share of runs with the test
    AUC inside, the class shifts and the spread."""
    out: dict[str, Any] = {}
    pairs = [(r, n) for r, n in zip(rows, nulls, strict=True) if n is not None and n["gap"]]
    for ds in sorted({r["dataset"] for r, _ in pairs}) + ["all"]:
        sel = [(r, n) for r, n in pairs if ds in (r["dataset"], "all")]
        if not sel:
            continue
        k = min(len(n["gap"]) for _, n in sel)
        stats = {
            "accuracy_gap": ([r["accuracy_gap"] for r, _ in sel], [n["gap"] for _, n in sel]),
            "abs_accuracy_gap": ([abs(r["accuracy_gap"]) for r, _ in sel],
                                 [np.abs(n["gap"]) for _, n in sel]),
            "auc_diff": ([r["selfcheck_auc"] - r["test_auc"] for r, _ in sel],
                         [n["auc_diff"] for _, n in sel]),
            "inside": ([float(r["inside"]) for r, _ in sel], [n["inside"] for _, n in sel]),
            "shift_good": ([n["observed_shift_good"] for _, n in sel],
                           [n["shift_good"] for _, n in sel]),
            "shift_bad": ([n["observed_shift_bad"] for _, n in sel],
                          [n["shift_bad"] for _, n in sel]),
            "spread": ([n["observed_spread"] for _, n in sel], [n["spread"] for _, n in sel]),
        }
        d: dict[str, Any] = {"runs": len(sel), "perms": k}
        for name, (obs, null) in stats.items():
            o = float(np.mean(obs))
            means = np.mean([np.asarray(v, dtype=np.float64)[:k] for v in null], axis=0)
            c = float(means.mean())
            d[name] = {"observed": o, "null_mean": c,
                       "null_lo": float(np.quantile(means, 0.025)),
                       "null_hi": float(np.quantile(means, 0.975)),
                       "p": float((np.abs(means - c) >= abs(o - c) - 1e-12).mean())}
        out[ds] = d
    return out


def exchange_markdown(summary: dict[str, Any]) -> str:
    """The permutation table of bench/reports/2026-11-28-selfcheck-bias.md (one line per
    dataset of :func:`exchange_summary`): observed mean, then [null 95 % range] and p."""
    cols = (("accuracy_gap", "signed acc. gap"), ("abs_accuracy_gap", "abs. acc. gap"),
            ("auc_diff", "AUC bias"), ("inside", "share inside"),
            ("shift_good", "shift good"), ("shift_bad", "shift bad"),
            ("spread", "spread"))
    lines = ["| dataset | runs | " + " | ".join(f"{c} [null 95 %] p" for _, c in cols) + " |",
             "|" + "---|" * (2 + len(cols))]
    for ds, d in summary.items():
        cells = [f"{d[k]['observed']:+.3f} [{d[k]['null_lo']:+.3f}, {d[k]['null_hi']:+.3f}] "
                 f"{d[k]['p']:.2f}" for k, _ in cols]
        lines.append(f"| {ds} | {d['runs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def simulate_expected_accuracy(auc: float, *, n_per_class: int = 32, runs: int = 200,
                               seed: int = 0) -> dict[str, float]:
    """Is the self-check's expected accuracy itself biased? Binormal scores (unit variances,
    means ``sqrt(2) Phi^-1(auc)`` apart), ``n_per_class`` per class, ``runs`` times: the mean and
    sd of (expected accuracy - the true accuracy of the self-check's own threshold), and the
    mean of each. Seeded."""
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    d = math.sqrt(2) * float(norm.ppf(auc))
    y = np.r_[np.ones(n_per_class), np.zeros(n_per_class)].astype(np.int64)
    est, true = [], []
    for k in range(runs):
        sc = np.concatenate([rng.normal(d, 1, n_per_class), rng.normal(0, 1, n_per_class)])
        chk = fit_self_check(sc, y, seed=k, n_boot=20)
        t = chk.threshold
        est.append(chk.expected_accuracy)
        true.append(0.5 * float(norm.sf(t - d)) + 0.5 * float(norm.cdf(t)))
    diff = np.asarray(est) - np.asarray(true)
    return {"auc": auc, "n_per_class": n_per_class, "runs": runs,
            "mean_expected": float(np.mean(est)), "mean_true": float(np.mean(true)),
            "bias": float(diff.mean()), "sd": float(diff.std(ddof=1))}


def _nan_none(a: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(v) else float(v) for v in a.tolist()]


def nan_array(v: Sequence) -> np.ndarray:
    """``v`` as float64, None (a skipped item's score in a stored run) as NaN."""
    return np.asarray([math.nan if x is None else x for x in v], dtype=np.float64)


def analyse(raw: dict[str, Any], *, method: str = "auto", n_boot: int = 1000,
            adjust: bool = False) -> dict[str, Any]:
    """One table row of a :func:`run_one` record: the self-check (fitted on the held-out scores,
    seeded with the run's seed) against the test responses. ``adjust``: the held-out scores
    with the set effects removed (:func:`set_effects`, :func:`adjusted_scores`; needs the
    stored matrices), the matched test AUC likewise."""
    h, t = raw["heldout"], raw["test"]
    hs = nan_array(h["scores"])
    effects = None
    if adjust:
        effects = set_effects(h["loglik"], h["clean"])
        hs = adjusted_scores(raw, h["loglik"], h["clean"], effects)
    chk = fit_self_check(hs, h["labels"], method=method, seed=raw["seed"], n_boot=n_boot)
    y = np.asarray(t["labels"], dtype=np.int64)
    s = nan_array(t["scores"])
    p_raw = nan_array(t["p_good"])
    test_auc = metrics.auc(y, s)
    row: dict[str, Any] = {
        "dataset": raw["dataset"], "seed": raw["seed"], "adjusted": adjust,
        "dtype": raw.get("dtype", "float32"), "status": chk.status,
        "n_heldout": chk.n_good + chk.n_bad, "n_skipped": chk.n_skipped, "n_test": int(y.size),
        "selfcheck_auc": chk.auc, "auc_lo": chk.auc_lo, "auc_hi": chk.auc_hi,
        "test_auc": test_auc,
        "leaky_auc": metrics.auc(np.asarray(h["labels"]), nan_array(h["full_scores"])),
        "selfcheck_brier": chk.brier, "selfcheck_ece": chk.ece,
        "expected_accuracy": chk.expected_accuracy,
        "method": chk.config.get("method_used"),
    }
    row["inside"] = bool(chk.ok and chk.auc_lo <= test_auc <= chk.auc_hi)
    if chk.ok:
        # The interval covers the self-check's sampling error only; the test AUC has its own.
        # z of the difference (both standard errors from the bootstrap intervals' widths) and
        # the coverage an unbiased self-check would have here: P(|N(0, sd_diff)| <= half-width).
        _, tlo, thi = metrics.auc_stratified_ci(y, s, n_resamples=n_boot, seed=raw["seed"])
        z95 = 2 * 1.959964
        se_sc, se_t = (chk.auc_hi - chk.auc_lo) / z95, (thi - tlo) / z95
        sd = math.hypot(se_sc, se_t)
        row.update({"test_auc_lo": tlo, "test_auc_hi": thi,
                    "auc_z": (chk.auc - test_auc) / sd if sd > 0 else math.nan,
                    "coverage_if_unbiased": math.erf(1.959964 * se_sc / sd / math.sqrt(2))
                    if sd > 0 else math.nan})
    row["matched_test_auc"] = matched_test_auc(raw, effects=effects)
    if chk.ok:
        hy = np.asarray(h["labels"])
        fin = np.isfinite(hs)
        # The threshold's accuracy on the very items it was fitted on (optimistic), beside the
        # out-of-fold expected accuracy (pessimistic: each fold's threshold saw 4/5 of them).
        row["insample_accuracy"] = float(((hs[fin] >= chk.threshold) == (hy[fin] == 1)).mean())
        p = chk.apply(s)
        row.update({
            "test_ece": metrics.ece(y, p), "test_brier": metrics.brier(y, p),
            "test_accuracy": float(((s >= chk.threshold) == (y == 1)).mean()),
            "threshold": chk.threshold,
            "test_p_calibrated": [float(v) for v in p],
        })
        row["accuracy_gap"] = row["expected_accuracy"] - row["test_accuracy"]
    row["test_labels"] = y.tolist()
    row["test_p_good"] = p_raw.tolist()
    row.update({"raw_p_good_ece": metrics.ece(y, p_raw),
                "raw_p_good_brier": metrics.brier(y, p_raw), "constant_brier": 0.25})
    sec = raw["seconds"]
    n_h = len(h["labels"])
    per_record = sec["test"] / max(1, raw.get("n_test_scored_first", raw["n_test"]))
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
    """Per dataset: means over seeds, in how many seeds the test AUC was inside, the AUC bias
    (self-check minus test, mean and its standard error over seeds), the expected accuracy's
    gap to the test accuracy (mean of the absolute gaps, the largest, the signed mean), and the
    ECE / Brier of the test responses of every seed pooled (each calibrated by its own seed's
    map). The last entry, ``"all"``, pools every dataset."""
    out: dict[str, Any] = {}
    for ds in sorted({r["dataset"] for r in rows}) + ["all"]:
        rs = [r for r in rows if ds in (r["dataset"], "all")]

        def vals(k: str, rs: list = rs) -> np.ndarray:
            v = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            return np.asarray([x for x in v if math.isfinite(x)], dtype=np.float64)

        def mean(k: str) -> float:
            v = vals(k)
            return float(v.mean()) if v.size else math.nan

        ok = [r for r in rs if "test_p_calibrated" in r]
        y = np.concatenate([r["test_labels"] for r in ok]) if ok else np.zeros(0)
        p = np.concatenate([r["test_p_calibrated"] for r in ok]) if ok else np.zeros(0)
        q = np.concatenate([r["test_p_good"] for r in ok]) if ok else np.zeros(0)
        pooled = {"pooled_n_test": int(y.size)}
        if y.size:
            pooled.update(pooled_ece=metrics.ece(y, p), pooled_brier=metrics.brier(y, p),
                          pooled_raw_ece=metrics.ece(y, q), pooled_raw_brier=metrics.brier(y, q))
        bias = np.asarray([r["selfcheck_auc"] - r["test_auc"] for r in ok])
        z = vals("auc_z")
        gap = vals("accuracy_gap")
        # What fewer contexts alone cost the test AUC, over the runs with stored matrices.
        fewer = np.asarray([r["matched_test_auc"] - r["test_auc"] for r in ok
                            if math.isfinite(r.get("matched_test_auc", math.nan))])
        # The mean |gap| sampling noise alone gives: both accuracies are binomial (held-out
        # items out of fold, test responses), E|N(0, sd)| = sd sqrt(2 / pi).
        floor = [math.sqrt(2 / math.pi) * math.sqrt(
            r["test_accuracy"] * (1 - r["test_accuracy"]) * (1 / r["n_test"] + 1 / r["n_heldout"]))
            for r in ok]
        out[ds] = {"seeds": len(rs), "inside": sum(r["inside"] for r in rs), **pooled,
                   "auc_bias": float(bias.mean()) if bias.size else math.nan,
                   "auc_bias_se": (float(bias.std(ddof=1) / math.sqrt(bias.size))
                                   if bias.size > 1 else math.nan),
                   "mean_abs_accuracy_gap": float(np.abs(gap).mean()) if gap.size else math.nan,
                   "max_abs_accuracy_gap": float(np.abs(gap).max()) if gap.size else math.nan,
                   "noise_abs_accuracy_gap": float(np.mean(floor)) if floor else math.nan,
                   "within_two_sample": int((np.abs(z) <= 1.959964).sum()),
                   # ~ N(0, 1 / runs) for an unbiased self-check.
                   "mean_auc_z": float(z.mean()) if z.size else math.nan,
                   "coverage_if_unbiased": mean("coverage_if_unbiased"),
                   "fewer_contexts_auc_change": float(fewer.mean()) if fewer.size else math.nan,
                   "fewer_contexts_runs": int(fewer.size),
                   **{k: mean(k) for k in ("selfcheck_auc", "test_auc", "matched_test_auc",
                                           "test_ece", "test_brier", "raw_p_good_ece",
                                           "raw_p_good_brier", "expected_accuracy",
                                           "insample_accuracy", "test_accuracy",
                                           "accuracy_gap", "cost_pct_job_at_max")}}
    return out


def bias_markdown(per_dataset: dict[str, dict[str, Any]]) -> str:
    """The bias table of bench/reports/2026-11-28-selfcheck-bias.md: one line per dataset of
    :func:`summarise`."""
    def f(v: Any, d: int = 3) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}"

    lines = ["| dataset | runs | self-check AUC | test AUC | AUC bias (+-SE) | test AUC inside "
             "(expected if unbiased) | two-sample abs(z) <= 1.96 (mean z) | "
             "test AUC change, fewer contexts (runs) | exp. acc. (in-sample) / test acc. | "
             "abs. acc. gap: mean / max (noise alone) | pooled ECE calibrated (raw) | pooled n |",
             "|" + "---|" * 12]
    for ds, d in per_dataset.items():
        lines.append(
            f"| {ds} | {d['seeds']} | {f(d['selfcheck_auc'])} | {f(d['test_auc'])} | "
            f"{f(d['auc_bias'])} (+-{f(d['auc_bias_se'])}) | {d['inside']} of {d['seeds']} "
            f"({f(d['coverage_if_unbiased'], 2)}) | {d['within_two_sample']} of {d['seeds']} "
            f"({f(d['mean_auc_z'], 2)}) | "
            f"{f(d['fewer_contexts_auc_change'])} ({d['fewer_contexts_runs']}) | "
            f"{f(d['expected_accuracy'])} ({f(d['insample_accuracy'])}) / "
            f"{f(d['test_accuracy'])} | {f(d['mean_abs_accuracy_gap'])} / "
            f"{f(d['max_abs_accuracy_gap'])} ({f(d['noise_abs_accuracy_gap'])}) | "
            f"{f(d.get('pooled_ece'))} ({f(d.get('pooled_raw_ece'))}) | {d['pooled_n_test']} |")
    return "\n".join(lines)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The per-run table of bench/reports/2026-11-27-selfcheck.md and
    2026-11-28-selfcheck-bias.md (one line per dataset and seed)."""
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
