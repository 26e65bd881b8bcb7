"""The ICQS study's evaluations: data groups, judgment rules, metrics with bootstrap intervals.

This module is the library behind ``icqs-fast eval fpb|sst2|chaosnli`` (:mod:`icqs_fast.cli.eval`;
which study a data set gets is its registry kind, :mod:`icqs_fast.evals.study_kinds`).

Sentiment (Financial PhraseBank, SST-2)
---------------------------------------
Demonstration pools: *good* = sentences with their own label, *bad* = other sentences with the
opposite label (positive <-> negative; neutral sentences are never demonstrations). The test
responses are built from the remaining sentences (:func:`sentiment_groups`):

================  =============================================  ================
group             response                                       expected verdict
================  =============================================  ================
correct           a polar sentence with its own label            correct
incorrect         the same sentence with the opposite label      incorrect
labeled_neutral   the same sentence labelled "neutral" (FPB)     incorrect
semantic_neutral  a neutral sentence labelled "neutral" (FPB)    correct
================  =============================================  ================

The three polar groups use the same sentences (a paired design: group differences are not
sentence-sampling noise). A method's *accuracy* on a group is the fraction of its responses it
judges as the expected verdict. Judgment rules (:data:`RULES`):

* ICQS (per set): set ``l`` judges a response correct when ``score_per_set[l] >= 0.5``; the
  accuracy is averaged over the ``L`` sets (each item's accuracy is its fraction of agreeing sets).
* ICQS-Epistemic: correct when ``score >= 0.5``.
* ICL: :func:`icqs_fast.evals.baselines.icl_label` with ``N`` demonstrations from the good pool and
  the
  dataset's labels as candidates (FPB: positive, negative, neutral); correct when the response's
  label is the predicted one.
* Ask LLM: :func:`icqs_fast.evals.baselines.ask_llm`; correct when the expected rating is ``>= 3``
  (the middle of the 1-5 scale; ``ask_threshold``).

Synonym labels (``labels="synonyms"``): the *test responses* say good/bad or happy/sad (one pair
per sentence, seeded) instead of positive/negative while the demonstrations keep the original
words - whether ICQS transfers the notion of a correct label to other words. ICL's candidates are
then the response's own words (its pair, plus "neutral" on FPB).

Synthetic-LLM ranking (:func:`synthetic_ranking`): four "models" answer the correct group's
sentences with accuracy 100/75/50/25 % (exactly ``round(a n)`` right answers, which ones drawn
per model from the seed; a wrong answer is the opposite label); each answer's ICQS-Epistemic
score is its score as a response; the models are ranked by mean score and compared with the true
order by Spearman's rho.

ChaosNLI (SNLI part)
--------------------
An NLI pair is an ICQS response with ``x`` = premise and ``y`` = hypothesis. Good demonstrations
are pairs whose human majority is entailment, bad ones pairs whose majority is contradiction (the
polar pairs); every other pair (all three majorities) is a test item. The three-way distribution
``(p_e, p_n, p_c)`` is read from the scores with a "tent" map of a score ``s`` in [0, 1]
(:func:`tent`): ``e = max(0, 2s - 1)``, ``c = max(0, 1 - 2s)``, ``n = 1 - e - c`` - a hypothesis
that fits the all-good demonstrations is entailment, one that fits the all-bad ones is
contradiction, and one that fits half-and-half best is neutral (linear in between):

* ICQS (per set): the mean over the ``L`` sets of ``tent(score_per_set[l])`` (sets that disagree
  spread the mass);
* ICQS-Epistemic: the posterior over the ratios ``q_j = softmax_j(mean_l loglik[j, l])`` (uniform
  prior; its mode is the ICQS-Epistemic score), pushed through the tent: ``sum_j q_j tent(r_j)``;
* ICL: :func:`icqs_fast.evals.baselines.icl_label`'s probabilities over the labels entailment,
  neutral,
  contradiction, with ``N`` demonstrations drawn half from each polar pool (with their majority
  label: entailment / contradiction), the pair laid out as ``Premise: ...\\nHypothesis: ...``.

Metrics against the human ``label_dist`` (:func:`distribution_metrics`): MAE = mean over items and
the three labels of ``|p_k - h_k|``; CE = mean over items of ``-sum_k h_k log p~_k`` with
``p~ = (1 - eps) p + eps / 3``, ``eps = 0.01`` (so a zero probability costs ``log(300)``, not
infinity); Spearman = Spearman's rho over items of ``p_e - p_c`` against ``h_e - h_c``.

Every accuracy and metric gets a 95 % percentile bootstrap interval over items
(:func:`icqs_fast.metrics.bootstrap_ci`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from icqs_fast.engine.prompts import Template
from icqs_fast.evals.baselines import ask_llm, icl_label
from icqs_fast.evals.study_data import (
    NLI_LABELS,
    NLIData,
    Response,
    SentimentData,
)
from icqs_fast.evals.study_metrics import (
    CE_EPS,
    ICQS_THRESHOLD,
    accuracy_with_ci,
    distribution_metrics,
    epistemic_distribution,
    icqs_distribution,
    icqs_item_accuracy,
    synthetic_ranking,
    tent,
)
from icqs_fast.io.datasets import NLIItem, eval_dataset
from icqs_fast.io.strict_json import finite_or_none
from icqs_fast.progress import track

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EXPECTED = {"correct": True, "incorrect": False, "labeled_neutral": False,
            "semantic_neutral": True}
METHODS = ("icqs", "icqs_epistemic", "icl", "ask_llm")
NLI_METHODS = ("icqs", "icqs_epistemic", "icl")
ASK_THRESHOLD = 3.0

RULES = {
    "icqs": f"per set l: judged correct when score_per_set[l] >= {ICQS_THRESHOLD}; accuracy "
            "averaged over the L sets",
    "icqs_epistemic": f"judged correct when the ICQS-Epistemic score >= {ICQS_THRESHOLD}",
    "icl": "judged correct when the response's label is icl_label's prediction (N good "
           "demonstrations, the dataset's labels as candidates)",
    "ask_llm": "judged correct when the expected 1-5 rating >= the threshold "
               f"(default {ASK_THRESHOLD})",
    "accuracy": "fraction of a group's responses judged as the group's expected verdict "
                "(correct, semantic_neutral: correct; incorrect, labeled_neutral: incorrect)",
}
NLI_RULES = {
    "tent": "tent(s) = (e, n, c) = (max(0, 2s-1), 1-|2s-1|, max(0, 1-2s))",
    "icqs": "mean over the L sets of tent(score_per_set[l])",
    "icqs_epistemic": "sum_j q_j tent(r_j), q_j = softmax_j(mean_l loglik[j, l])",
    "icl": "icl_label probabilities over entailment/neutral/contradiction (N demonstrations, "
           "half majority-entailment, half majority-contradiction, with those labels)",
    "mae": "mean over items and labels of |p_k - h_k|",
    "ce": f"mean over items of -sum_k h_k log((1-eps) p_k + eps/3), eps = {CE_EPS}",
    "spearman": "Spearman over items of p_e - p_c against h_e - h_c",
}




# --------------------------------------------------------------------------- running


@dataclass
class StudySettings:
    """Settings shared by the study runs (see ``icqs-fast eval fpb --help``)."""

    demos_per_set: Sequence[int] = (8,)
    num_ratios: int = 5
    sets_per_ratio: int = 4
    seed: int = 0
    ask_threshold: float = ASK_THRESHOLD
    n_boot: int = 1000
    backend: str = "auto"
    quiet: bool = False
    baselines: bool = True
    stratify: bool = False
    calibration: str = "none"
    score: str = "argmax"
    tie_epsilon: float = 0.1  # --score tied / near_ties noise level (nats)
    compare: bool = False  # every calibration x score kind from one run (calibration_study)


def _icqs_scores(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good: Sequence,
                 bad: Sequence,
                 responses: Sequence[tuple[str, str]], n: int, st: StudySettings,
                 template: Any = None, desc: str = "ICQS") -> list:
    """ICQSResult per response (dedupe left to the caller), with a progress report."""
    sc = make_scorer(model, tok, good, bad, n, st, template)
    return list(track(sc.score(responses), total=len(responses), desc=f"{desc} N={n}",
                      unit="response", quiet=st.quiet))


def scoring_settings(n: int, st: StudySettings, template: Any = None) -> Any:
    """The :class:`icqs_fast.engine.settings.ScoringSettings` of a study run with ``n``
    demonstrations per set: label-stratified sets (fixed label order) when ``st.stratify``, else
    unstratified as in the study (explicitly: the engine's own default is ``stratify="auto"``);
    the oldest demonstrations dropped when a prompt is too long; ``st.calibration`` and
    ``st.score``."""
    from icqs_fast.engine.settings import ScoringSettings

    return ScoringSettings(num_ratios=st.num_ratios, demos_per_set=n,
                           sets_per_ratio=st.sets_per_ratio, seed=st.seed, template=template,
                           backend=st.backend, drop_oldest_demos=True,
                           stratify="y" if st.stratify else None,
                           calibration=st.calibration, score=st.score,
                           tie_epsilon=st.tie_epsilon)


def make_scorer(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good: Sequence, bad: Sequence,
                n: int, st: StudySettings,
                template: Any = None) -> Any:
    """The :class:`icqs_fast.engine.scorer.ICQSScorer` of a study run with ``n`` demonstrations per
    set, built from :func:`scoring_settings` (so the reference can be given the same)."""
    from icqs_fast.engine.scorer import ICQSScorer

    return ICQSScorer(model, tok, good, bad, scoring_settings(n, st, template))


def _demo_sample(pool: Sequence, n: int, seed: int) -> list:
    """``n`` demonstrations from ``pool`` (seeded, keeping pool order, which alternates labels)."""
    if n > len(pool):
        raise ValueError(f"{n} ICL demonstrations requested from a pool of {len(pool)}")
    idx = sorted(random.Random(seed).sample(range(len(pool)), n))
    return [pool[i] for i in idx]


def _unique(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(pairs))


def run_sentiment(model: PreTrainedModel, tok: PreTrainedTokenizerBase, data: SentimentData,
                  st: StudySettings
                  ) -> dict[str, Any]:
    """Score every group with ICQS, ICQS-Epistemic, ICL and Ask LLM for each ``N`` in
    ``st.demos_per_set``.

    Returns:
        ``{"per_n": {N: {"groups": {g: {m: {"value", "lo", "hi", "n"}}}, "ranking": ...}},
        "items": {N: {g: {"score": [...], "score_per_set": [[...]], "loglik": [n, M+1, L]}}},
        "ratios": [...]}`` - the summaries and the per-item values the plots use.
    """
    groups = data.groups
    responses = _unique((r.x, r.y) for g in groups.values() for r in g)
    ask: dict[tuple[str, str], float] = {}
    timing = {"ask_llm": 0.0, "icl": 0.0, "icqs": 0.0}
    t0 = time.perf_counter()
    if st.baselines:
        res = ask_llm(model, tok, [(_ask_question(data.dataset, r.candidates, x), y)
                                   for (x, y), r in zip(responses, _first_response(groups,
                                                                                   responses),
                                                        strict=True)],
                      backend=st.backend)
        ask = {xy: a.rating_expected for xy, a in zip(responses, res, strict=True)}
    timing["ask_llm"] = time.perf_counter() - t0
    per_n: dict[int, Any] = {}
    items: dict[int, Any] = {}
    ratios: list[float] = []
    for n in st.demos_per_set:
        t0 = time.perf_counter()
        variants = _variants(model, tok, data.good, data.bad, responses, n, st, timing)
        results = variants[f"{st.calibration}/{st.score}"] if variants else \
            _icqs_scores(model, tok, data.good, data.bad, responses, n, st)
        timing["icqs"] += time.perf_counter() - t0
        by = dict(zip(responses, results, strict=True))
        ratios = list(results[0].ratios)
        icl: dict[tuple[str, str], bool] = {}
        t0 = time.perf_counter()
        if st.baselines:
            demos = _demo_sample(data.good, n, st.seed)
            by_cand: dict[tuple[str, ...], list[str]] = {}
            for g in groups.values():
                for r in g:
                    by_cand.setdefault(r.candidates, [])
                    if r.x not in by_cand[r.candidates]:
                        by_cand[r.candidates].append(r.x)
            pred: dict[tuple[tuple[str, ...], str], str] = {}
            for cand, xs in by_cand.items():
                for x, pr in zip(xs, icl_label(model, tok, demos, xs, list(cand),
                                               backend=st.backend), strict=True):
                    pred[(cand, x)] = pr.label
            icl = {(r.x, r.y): pred[(r.candidates, r.x)] == r.y
                   for g in groups.values() for r in g}
        timing["icl"] += time.perf_counter() - t0
        summary: dict[str, Any] = {}
        item_vals: dict[str, Any] = {}
        for gname, g in groups.items():
            per_item: dict[str, list[float]] = {m: [] for m in METHODS}
            for r in g:
                res_r = by[(r.x, r.y)]
                per_item["icqs"].append(icqs_item_accuracy(res_r.score_per_set, r.expected))
                per_item["icqs_epistemic"].append(
                    float((res_r.score >= ICQS_THRESHOLD) == r.expected))
                if st.baselines:
                    per_item["icl"].append(float(icl[(r.x, r.y)] == r.expected))
                    per_item["ask_llm"].append(
                        float((ask[(r.x, r.y)] >= st.ask_threshold) == r.expected))
            summary[gname] = {m: accuracy_with_ci(v, n_boot=st.n_boot, seed=st.seed)
                              for m, v in per_item.items() if v}
            item_vals[gname] = {
                "score": [by[(r.x, r.y)].score for r in g],
                "score_per_set": [by[(r.x, r.y)].score_per_set for r in g],
                "loglik": np.stack([by[(r.x, r.y)].loglik.double().numpy() for r in g]),
                "ask_rating": [ask[(r.x, r.y)] for r in g] if st.baselines else [],
            }

        def lookup(pairs: Sequence[tuple[str, str]], by: dict = by, n: int = n) -> list[float]:
            missing = [p for p in pairs if p not in by]
            if missing:
                extra = _icqs_scores(model, tok, data.good, data.bad, _unique(missing), n, st,
                                     desc="ICQS ranking")
                by = {**by, **dict(zip(_unique(missing), extra, strict=True))}
            return [by[p].score for p in pairs]

        ranking = synthetic_ranking(data.polar, lookup, seed=st.seed, n_boot=st.n_boot)
        per_n[n] = {"groups": summary, "ranking": ranking,
                    "separation": _separation(item_vals, st.baselines, n_boot=st.n_boot,
                                              seed=st.seed)}
        if variants:
            from icqs_fast.evals.calibration_study import compare_sentiment

            per_n[n]["compare"] = compare_sentiment(
                {k: dict(zip(responses, v, strict=True)) for k, v in variants.items()}, groups,
                n_boot=st.n_boot, seed=st.seed)
        items[n] = item_vals
    return {"per_n": per_n, "items": items, "ratios": ratios,
            "timing": {k: round(v, 2) if isinstance(v, float) else v for k, v in timing.items()}}


def _variants(model: PreTrainedModel, tok: PreTrainedTokenizerBase, good: Sequence, bad: Sequence,
              responses: Sequence[tuple[str, str]], n: int, st: StudySettings,
              timing: dict[str, Any], template: Any = None) -> dict[str, list]:
    """With ``st.compare``: every calibration x score variant's results from one run
    (:func:`icqs_fast.evals.calibration_study.score_variants`), its timing in
    ``timing["calibration"]``; else {}."""
    if not st.compare:
        return {}
    from icqs_fast.evals.calibration_study import score_variants

    out, t = score_variants(model, tok, good, bad, responses, scoring_settings(n, st, template),
                            desc=f"ICQS N={n}", quiet=st.quiet)
    timing["calibration"] = t
    return out


def _separation(item_vals: dict[str, Any], baselines: bool, *, n_boot: int = 1000,
                seed: int = 0) -> dict[str, Any]:
    """Threshold-free view: mean score per group and the AUC of correct vs incorrect
    responses (ICQS-Epistemic score, mean per-set ICQS score, Ask LLM expected rating), with
    its 95 % bootstrap interval (``auc_correct_vs_incorrect_interval``: method -> [lo, hi];
    :func:`icqs_fast.evals.calibration_study.auc_ci`, each group resampled on its own)."""
    from icqs_fast.evals.calibration_study import auc_ci

    def per(g: str) -> dict[str, list[float]]:
        v = item_vals[g]
        d = {"icqs_epistemic": list(v["score"]),
             "icqs": [float(np.mean(s)) for s in v["score_per_set"]]}
        if baselines:
            d["ask_llm"] = list(v["ask_rating"])
        return d

    means = {g: {m: float(np.mean(x)) for m, x in per(g).items()} for g in item_vals}
    out: dict[str, Any] = {"mean": means}
    if "correct" in item_vals and "incorrect" in item_vals:
        c, i = per("correct"), per("incorrect")
        ci = {m: auc_ci(c[m], i[m], n_boot=n_boot, seed=seed) for m in c}
        out["auc_correct_vs_incorrect"] = {m: v["value"] for m, v in ci.items()}
        out["auc_correct_vs_incorrect_interval"] = {m: [v["lo"], v["hi"]] for m, v in ci.items()}
    return out


def _first_response(groups: dict[str, list[Response]], pairs: Sequence[tuple[str, str]]
                    ) -> list[Response]:
    first: dict[tuple[str, str], Response] = {}
    for g in groups.values():
        for r in g:
            first.setdefault((r.x, r.y), r)
    return [first[p] for p in pairs]


def _ask_question(dataset: str, candidates: Sequence[str], x: str) -> str:
    """The Ask LLM instruction for a sentiment sentence (the response is its label); what the
    sentence is comes from the data set's registry entry."""
    what = eval_dataset(dataset).subject or "sentence"
    opts = ", ".join(candidates[:-1]) + f" or {candidates[-1]}"
    return f"What is the sentiment of this {what}? Answer {opts}.\n\nSentence: {x}"


NLI_ICQS_TEMPLATE = dict(demo="Premise: {x}\nHypothesis: {y}\n", query="Premise: {x}\nHypothesis:",
                         response=" {y}\n", separator="\n")
NLI_ICL_TEMPLATE = dict(demo="{x}\nRelation: {y}\n", query="{x}\nRelation:", response=" {y}\n",
                        separator="\n")


def _nli_x(it: NLIItem) -> str:
    return f"Premise: {it.premise}\nHypothesis: {it.hypothesis}"


def run_chaosnli(model: PreTrainedModel, tok: PreTrainedTokenizerBase, data: NLIData,
                 st: StudySettings) -> dict[str, Any]:
    """ICQS, ICQS-Epistemic and ICL distributions of every test pair for each ``N``, with
    MAE / CE / Spearman against the human distributions.

    Returns:
        ``{"per_n": {N: {method: {metric: {"value", "lo", "hi"}}}}, "items": {N: {"pred":
        {method: [n, 3]}, "score": [...], "loglik": [n, M+1, L], "majority": [...]}},
        "human": [n, 3], "ratios": [...]}``.
    """
    tpl = Template(**NLI_ICQS_TEMPLATE)
    good = [(it.premise, it.hypothesis) for it in data.good]
    bad = [(it.premise, it.hypothesis) for it in data.bad]
    responses = [(it.premise, it.hypothesis) for it in data.test]
    human = np.asarray([it.label_dist for it in data.test], dtype=np.float64)
    per_n: dict[int, Any] = {}
    items: dict[int, Any] = {}
    ratios: list[float] = []
    timing = {"icl": 0.0, "icqs": 0.0}
    for n in st.demos_per_set:
        t0 = time.perf_counter()
        variants = _variants(model, tok, good, bad, responses, n, st, timing, template=tpl)
        results = variants[f"{st.calibration}/{st.score}"] if variants else \
            _icqs_scores(model, tok, good, bad, responses, n, st, template=tpl)
        timing["icqs"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        ratios = list(results[0].ratios)
        pred = _nli_preds(results)
        if st.baselines:
            k_e = n - n // 2
            demos_e = _demo_sample([(_nli_x(it), "entailment") for it in data.good], k_e, st.seed)
            demos_c = _demo_sample([(_nli_x(it), "contradiction") for it in data.bad], n // 2,
                                   st.seed + 1)
            # Interleaved so neither label sits only at the end of the prompt.
            demos = [d for pair in zip(demos_e, demos_c + [None], strict=False) for d in pair
                     if d is not None]
            res = icl_label(model, tok, demos, [_nli_x(it) for it in data.test],
                            list(NLI_LABELS), template=Template(**NLI_ICL_TEMPLATE),
                            backend=st.backend)
            pred["icl"] = np.asarray([[r.probs[lab] for lab in NLI_LABELS] for r in res])
        timing["icl"] += time.perf_counter() - t0
        per_n[n] = {m: distribution_metrics(p, human, n_boot=st.n_boot, seed=st.seed)
                    for m, p in pred.items()}
        if variants:
            from icqs_fast.evals.calibration_study import compare_nli

            per_n[n]["compare"] = compare_nli({name: _nli_preds(rs)
                                               for name, rs in variants.items()},
                                              human, n_boot=st.n_boot, seed=st.seed)
        items[n] = {"pred": pred, "score": [r.score for r in results],
                    "loglik": np.stack([r.loglik.double().numpy() for r in results]),
                    "majority": [it.majority for it in data.test]}
    return {"per_n": per_n, "items": items, "human": human, "ratios": ratios,
            "timing": {k: round(v, 2) if isinstance(v, float) else v for k, v in timing.items()}}


def _nli_preds(results: Sequence[Any]) -> dict[str, np.ndarray]:
    """ICQS and ICQS-Epistemic (e, n, c) distributions of (calibrated) results: the tent of each
    set's score averaged; Epistemic: the posterior over ratios pushed through the tent
    (``score="argmax"``), or the tent of the posterior-mean score (``score="mean"``)."""
    def epi(r: Any) -> np.ndarray:
        if r.score_kind == "mean":
            return tent(r.score)
        return epistemic_distribution(r.loglik_calibrated, r.ratios)

    return {"icqs": np.stack([icqs_distribution(r.score_per_set) for r in results]),
            "icqs_epistemic": np.stack([epi(r) for r in results])}


# --------------------------------------------------------------------------- JSON


def _v(d: dict[str, float]) -> float:
    return d["value"]


def sentiment_json(out: dict[str, Any], *, dataset: str, model: str, seconds: float,
                   st: StudySettings, labels: str) -> dict[str, Any]:
    """The ``eval fpb|sst2 --json`` document: ``{dataset, model, seconds, groups: {g: {method:
    accuracy}}, ranking: {spearman}}`` for the largest ``N``, plus intervals, the rules, the
    settings and the curve over ``N``."""
    ns = list(st.demos_per_set)
    main = out["per_n"][max(ns)]

    def flat(per: dict) -> dict[str, Any]:
        return {
            "groups": {g: {m: _v(v) for m, v in row.items()} for g, row in per["groups"].items()},
            "intervals": {g: {m: [v["lo"], v["hi"]] for m, v in row.items()}
                          for g, row in per["groups"].items()},
            "ranking": {"spearman": per["ranking"]["spearman"],
                        "interval": [per["ranking"]["spearman_lo"], per["ranking"]["spearman_hi"]],
                        "models": per["ranking"]["models"]},
            "separation": per["separation"],
            **({"compare": per["compare"]} if "compare" in per else {}),
        }

    doc = {"dataset": dataset, "model": model, "seconds": round(seconds, 2), **flat(main),
           "n": {g: row["icqs"]["n"] for g, row in main["groups"].items()},
           "expected": {g: "correct" if EXPECTED[g] else "incorrect" for g in main["groups"]},
           "rules": RULES, "labels": labels, "timing": out["timing"],
           "settings": {"demos_per_set": max(ns), "num_ratios": st.num_ratios,
                        "sets_per_ratio": st.sets_per_ratio, "seed": st.seed,
                        "ask_threshold": st.ask_threshold, "n_boot": st.n_boot,
                        "stratify": st.stratify, "calibration": st.calibration,
                        "score": st.score},
           "curve": [{"demos_per_set": n, **flat(out["per_n"][n])} for n in ns]}
    return finite_or_none(doc)


def chaosnli_json(out: dict[str, Any], *, model: str, seconds: float, st: StudySettings,
                  dataset: str = "chaosnli") -> dict[str, Any]:
    """The ``eval chaosnli --json`` document: ``{dataset, model, seconds, icqs, icqs_epistemic,
    icl: {mae, ce, spearman}}`` for the largest ``N``, plus intervals, rules, settings, curve
    (``dataset``: the registry name of a ``distributions`` data set)."""
    ns = list(st.demos_per_set)

    def flat(per: dict) -> dict[str, Any]:
        main = {m: row for m, row in per.items() if m != "compare"}
        d: dict[str, Any] = {m: {k: _v(v) for k, v in row.items()} for m, row in main.items()}
        d["intervals"] = {m: {k: [v["lo"], v["hi"]] for k, v in row.items()}
                          for m, row in main.items()}
        if "compare" in per:
            d["compare"] = per["compare"]
        return d

    doc = {"dataset": dataset, "model": model, "seconds": round(seconds, 2),
           **flat(out["per_n"][max(ns)]), "n": int(len(out["human"])), "rules": NLI_RULES,
           "timing": out["timing"],
           "settings": {"demos_per_set": max(ns), "num_ratios": st.num_ratios,
                        "sets_per_ratio": st.sets_per_ratio, "seed": st.seed,
                        "n_boot": st.n_boot, "stratify": st.stratify,
                        "calibration": st.calibration, "score": st.score},
           "curve": [{"demos_per_set": n, **flat(out["per_n"][n])} for n in ns]}
    return finite_or_none(doc)


def dumps(doc: dict[str, Any]) -> str:
    """Strict JSON text of a study document."""
    return json.dumps(doc, indent=1, allow_nan=False)
