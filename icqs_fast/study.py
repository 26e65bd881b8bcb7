"""The ICQS study's evaluations: data groups, judgment rules, metrics with bootstrap intervals.

This module is the library behind ``icqs-fast eval fpb|sst2|chaosnli`` (:mod:`icqs_fast.study_cli`).

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
* ICL: :func:`icqs_fast.baselines.icl_label` with ``N`` demonstrations from the good pool and the
  dataset's labels as candidates (FPB: positive, negative, neutral); correct when the response's
  label is the predicted one.
* Ask LLM: :func:`icqs_fast.baselines.ask_llm`; correct when the expected rating is ``>= 3``
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
* ICL: :func:`icqs_fast.baselines.icl_label`'s probabilities over the labels entailment, neutral,
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

import csv
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .io import InputError, PathLike, shared_data_dir

SENTIMENT_GROUPS = ("correct", "incorrect", "labeled_neutral", "semantic_neutral")
EXPECTED = {"correct": True, "incorrect": False, "labeled_neutral": False,
            "semantic_neutral": True}
METHODS = ("icqs", "icqs_epistemic", "icl", "ask_llm")
NLI_METHODS = ("icqs", "icqs_epistemic", "icl")
NLI_LABELS = ("entailment", "neutral", "contradiction")
NLI_GROUPS = {"e": "entailment", "n": "neutral", "c": "contradiction"}
FLIP = {"positive": "negative", "negative": "positive"}
SYNONYMS = (("good", "bad"), ("happy", "sad"))
ICQS_THRESHOLD = 0.5
ASK_THRESHOLD = 3.0
CE_EPS = 0.01
SYNTHETIC_ACCURACIES = (1.0, 0.75, 0.5, 0.25)

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


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Response:
    """One test response of a sentiment group.

    Attributes:
        x: the sentence; y: the label word the response gives.
        group: one of :data:`SENTIMENT_GROUPS`.
        expected: True when the response is correct (the verdict a method should give).
        gold: the sentence's true label (original words).
        candidates: ICL's candidate labels for this response (the words its vocabulary uses).
    """

    x: str
    y: str
    group: str
    expected: bool
    gold: str
    candidates: tuple[str, ...]


@dataclass
class SentimentData:
    """A sentiment study: demonstration pools and the test groups.

    Attributes:
        dataset: "fpb" or "sst2".
        good, bad: demonstration pools of (sentence, label) pairs.
        groups: group name -> responses (only the groups the dataset has).
        polar: the polar test sentences as (sentence, gold label, vocabulary) triples, in the
            order of the correct group (the synthetic ranking answers these).
    """

    dataset: str
    good: list[tuple[str, str]]
    bad: list[tuple[str, str]]
    groups: dict[str, list[Response]]
    polar: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)


def read_sst2(path: PathLike) -> list[tuple[int, str, str]]:
    """SST-2 TSV rows (``sentence<TAB>label``, header row, 1 = positive, 0 = negative) as
    ``(line, sentence, "positive"|"negative")``.

    Raises:
        FileNotFoundError: no file.
        InputError: a missing header column, a row without two fields, an empty sentence or a
            label other than 0/1, naming the file, line and field.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"SST-2 file not found: {p}")
    out = []
    with open(p, encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None:
            raise InputError(p, None, None, "empty file (expected a 'sentence<TAB>label' header)")
        cols = [h.strip() for h in header]
        for need in ("sentence", "label"):
            if need not in cols:
                raise InputError(p, 1, need, f"no {need!r} column in the header {cols}")
        i_s, i_l = cols.index("sentence"), cols.index("label")
        for lineno, row in enumerate(rows, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) <= max(i_s, i_l):
                raise InputError(p, lineno, "label" if len(row) > i_s else "sentence",
                                 f"{len(row)} field(s), expected {len(cols)}")
            sentence, lab = row[i_s].strip(), row[i_l].strip()
            if not sentence:
                raise InputError(p, lineno, "sentence", "empty sentence")
            if lab not in ("0", "1"):
                raise InputError(p, lineno, "label", f"expected 0 or 1, got {lab!r}")
            out.append((lineno, sentence, "positive" if lab == "1" else "negative"))
    return out


def polar_pools(rows: Sequence[tuple[str, str]], *, n_good: int, n_bad: int, seed: int,
                max_chars: int | None = 200
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Good and bad demonstration pools from labelled sentences, plus the unused rows.

    Good = polar sentences with their own label, bad = other polar sentences with the opposite
    label; both alternate positive/negative while the data allow (the rule of
    :func:`icqs_fast.io.fpb_examples`). Only sentences of at most ``max_chars`` characters are
    drawn (short prompts).

    Args:
        rows: (sentence, label) pairs; labels positive/negative(/neutral).

    Returns:
        ``(good, bad, rest)``; ``rest`` keeps the input order.
    """
    rng = random.Random(seed)
    idx = {lab: [i for i, (x, y) in enumerate(rows)
                 if y == lab and (max_chars is None or len(x) <= max_chars)] for lab in FLIP}
    for lst in idx.values():
        rng.shuffle(lst)
    need = n_good + n_bad
    if sum(len(v) for v in idx.values()) < need:
        raise ValueError(f"only {sum(len(v) for v in idx.values())} usable positive/negative "
                         f"sentences, need {need}")
    order: list[int] = []
    while len(order) < need:
        for lab in FLIP:
            if idx[lab] and len(order) < need:
                order.append(idx[lab].pop())
    good = [rows[i] for i in order[:n_good]]
    bad = [(rows[i][0], FLIP[rows[i][1]]) for i in order[n_good:need]]
    used = set(order)
    rest = [r for i, r in enumerate(rows) if i not in used]
    return good, bad, rest


def _balanced(rng: random.Random, items: list, key: Callable[[Any], str], limit: int | None
              ) -> list:
    """Seeded sample of up to ``limit`` items alternating between the keys' classes (all items,
    shuffled the same way, when ``limit`` is None)."""
    by: dict[str, list] = {}
    for it in items:
        by.setdefault(key(it), []).append(it)
    for k in sorted(by):
        rng.shuffle(by[k])
    n = len(items) if limit is None else min(limit, len(items))
    out: list = []
    while len(out) < n:
        for k in sorted(by):
            if by[k] and len(out) < n:
                out.append(by[k].pop())
    return out


def sentiment_groups(rest: Sequence[tuple[str, str]], *, limit: int | None, seed: int,
                     neutral: bool, labels: str = "original"
                     ) -> tuple[dict[str, list[Response]], list[tuple[str, str, dict]]]:
    """The test groups from the sentences not used as demonstrations.

    Args:
        rest: (sentence, gold label) pairs.
        limit: sentences per group (seeded; polar ones balanced positive/negative); None = all.
        seed: sampling seed.
        neutral: build labeled_neutral / semantic_neutral (FPB) or not (SST-2).
        labels: "original" (positive/negative) or "synonyms" (good/bad or happy/sad per
            sentence, seeded).

    Returns:
        ``(groups, polar)``: group -> responses, and the polar sentences as (sentence, gold,
        vocabulary) where vocabulary maps positive/negative(/neutral) to the words used.
    """
    if labels not in ("original", "synonyms"):
        raise ValueError(f"labels must be 'original' or 'synonyms', got {labels!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    rng = random.Random(seed)
    polar_rows = [r for r in rest if r[1] in FLIP]
    sel = _balanced(rng, polar_rows, lambda r: r[1], limit)
    if not sel:
        raise ValueError("no positive/negative test sentences left after the demonstration pools")
    polar = []
    for x, gold in sel:
        if labels == "synonyms":
            pos, neg = SYNONYMS[rng.randrange(len(SYNONYMS))]
        else:
            pos, neg = "positive", "negative"
        vocab = {"positive": pos, "negative": neg}
        if neutral:
            vocab["neutral"] = "neutral"
        polar.append((x, gold, vocab))
    groups: dict[str, list[Response]] = {"correct": [], "incorrect": []}
    if neutral:
        groups["labeled_neutral"] = []
    for x, gold, vocab in polar:
        cand = tuple(vocab.values())
        groups["correct"].append(Response(x, vocab[gold], "correct", True, gold, cand))
        groups["incorrect"].append(Response(x, vocab[FLIP[gold]], "incorrect", False, gold, cand))
        if neutral:
            groups["labeled_neutral"].append(
                Response(x, "neutral", "labeled_neutral", False, gold, cand))
    if neutral:
        neu = [r for r in rest if r[1] == "neutral"]
        rng.shuffle(neu)
        neu = neu if limit is None else neu[:limit]
        if not neu:
            raise ValueError("no neutral test sentences for the semantic_neutral group")
        cand = ("positive", "negative", "neutral") if labels == "original" else None
        groups["semantic_neutral"] = []
        for x, gold in neu:
            c = cand
            if c is None:
                pos, neg = SYNONYMS[rng.randrange(len(SYNONYMS))]
                c = (pos, neg, "neutral")
            groups["semantic_neutral"].append(
                Response(x, "neutral", "semantic_neutral", True, gold, c))
    return groups, polar


def fpb_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
             seed: int = 0, labels: str = "original") -> SentimentData:
    """Financial PhraseBank study data: pools of ``pool`` good and ``pool`` bad demonstrations
    (:func:`icqs_fast.io.fpb_examples`) and the four groups (:func:`sentiment_groups`)."""
    from .io import fpb_examples

    good, bad, rest = fpb_examples(path, n_good=pool, n_bad=pool, seed=seed)
    groups, polar = sentiment_groups([(r.x, r.y) for r in rest], limit=limit, seed=seed,
                                     neutral=True, labels=labels)
    return SentimentData("fpb", good, bad, groups, polar)


def sst2_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
              seed: int = 0, labels: str = "original") -> SentimentData:
    """SST-2 study data (default ``../shared/data/sst2/dev.tsv``): pools and the correct /
    incorrect groups (no neutral class)."""
    p = Path(path) if path is not None else shared_data_dir() / "sst2" / "dev.tsv"
    rows = [(x, y) for _, x, y in read_sst2(p)]
    good, bad, rest = polar_pools(rows, n_good=pool, n_bad=pool, seed=seed)
    groups, polar = sentiment_groups(rest, limit=limit, seed=seed, neutral=False, labels=labels)
    return SentimentData("sst2", good, bad, groups, polar)


@dataclass(frozen=True)
class NLIItem:
    """One ChaosNLI pair: premise, hypothesis, the human distribution ``[e, n, c]`` (sums to 1)
    and the majority label ("e", "n" or "c")."""

    uid: str
    premise: str
    hypothesis: str
    label_dist: tuple[float, float, float]
    majority: str


def read_chaosnli(path: PathLike) -> list[NLIItem]:
    """ChaosNLI JSONL (``uid``, ``label_dist`` = [e, n, c], ``majority_label``,
    ``example.premise``, ``example.hypothesis``).

    Raises:
        FileNotFoundError: no file.
        InputError: invalid JSON or a missing / malformed field, naming the file, line and field.
    """
    from .io import field_of, read_json_objects

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ChaosNLI file not found: {p}")
    out = []
    for i, (line, obj) in enumerate(read_json_objects(p)):
        def get(f: str, kind: Any, line: int = line, obj: dict = obj, i: int = i) -> Any:
            return field_of(obj, f, kind, path=p, line=line, index=i)

        dist = get("label_dist", list)
        if len(dist) != 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                     and v >= 0 for v in dist):
            raise InputError(p, line, "label_dist", f"expected 3 non-negative numbers, got {dist}")
        s = float(sum(dist))
        if not abs(s - 1.0) < 1e-3:
            raise InputError(p, line, "label_dist", f"sums to {s:g}, expected 1")
        maj = get("majority_label", str)
        if maj not in NLI_GROUPS:
            raise InputError(p, line, "majority_label", f"expected e, n or c, got {maj!r}")
        prem, hyp = get("example.premise", str).strip(), get("example.hypothesis", str).strip()
        for name, v in (("example.premise", prem), ("example.hypothesis", hyp)):
            if not v:
                raise InputError(p, line, name, "empty text")
        out.append(NLIItem(str(get("uid", str)), prem, hyp,
                           tuple(float(v) / s for v in dist), maj))  # type: ignore[arg-type]
    if not out:
        raise InputError(p, None, None, "no records")
    return out


@dataclass
class NLIData:
    """ChaosNLI study data: polar pools (as NLI items) and the test items."""

    good: list[NLIItem]
    bad: list[NLIItem]
    test: list[NLIItem]


def chaosnli_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
                  seed: int = 0) -> NLIData:
    """Pools of ``pool`` majority-entailment (good) and ``pool`` majority-contradiction (bad)
    pairs, drawn with the seed; the test items are every other pair, or ``limit`` per majority
    label (seeded) when given, in file order."""
    p = Path(path) if path is not None else \
        shared_data_dir() / "chaosnli" / "chaosNLI_snli.jsonl"
    items = read_chaosnli(p)
    rng = random.Random(seed)
    ent = [i for i, it in enumerate(items) if it.majority == "e"]
    con = [i for i, it in enumerate(items) if it.majority == "c"]
    if len(ent) < pool or len(con) < pool:
        raise ValueError(f"{p}: {len(ent)} majority-entailment and {len(con)} majority-"
                         f"contradiction pairs; need {pool} of each for the pools")
    g, b = rng.sample(ent, pool), rng.sample(con, pool)
    used = set(g) | set(b)
    test_idx = [i for i in range(len(items)) if i not in used]
    if limit is not None:
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
        keep: list[int] = []
        for lab in NLI_GROUPS:
            cand = [i for i in test_idx if items[i].majority == lab]
            keep.extend(rng.sample(cand, min(limit, len(cand))))
        test_idx = sorted(keep)
    return NLIData([items[i] for i in g], [items[i] for i in b], [items[i] for i in test_idx])


# --------------------------------------------------------------------------- rules and metrics


def accuracy_with_ci(correct: Sequence[float], *, n_boot: int = 1000, seed: int = 0
                     ) -> dict[str, float]:
    """Mean of per-item correctness values in [0, 1] with a percentile bootstrap 95 % interval
    over items: ``{"value", "lo", "hi", "n"}`` (NaN when there are no items)."""
    from .metrics import bootstrap_ci

    a = np.asarray(correct, dtype=np.float64)
    if a.size == 0:
        return {"value": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    lo, hi = bootstrap_ci(np.mean, a, n_resamples=n_boot, seed=seed)
    return {"value": float(a.mean()), "lo": lo, "hi": hi, "n": int(a.size)}


def icqs_item_accuracy(score_per_set: Sequence[float], expected: bool,
                       threshold: float = ICQS_THRESHOLD) -> float:
    """Fraction of the L sets whose verdict (``score >= threshold`` = correct) is ``expected``."""
    v = [(s >= threshold) == expected for s in score_per_set]
    return sum(v) / len(v)


def tent(s: float | np.ndarray) -> np.ndarray:
    """``(e, n, c)`` of a score ``s`` in [0, 1]: ``e = max(0, 2s-1)``, ``c = max(0, 1-2s)``,
    ``n = 1 - e - c``; shape ``[..., 3]`` float64."""
    s = np.asarray(s, dtype=np.float64)
    if np.any((s < 0) | (s > 1)) or not np.all(np.isfinite(s)):
        raise ValueError("tent: scores must be finite and in [0, 1]")
    e = np.maximum(0.0, 2 * s - 1)
    c = np.maximum(0.0, 1 - 2 * s)
    return np.stack([e, 1 - e - c, c], axis=-1)


def icqs_distribution(score_per_set: Sequence[float]) -> np.ndarray:
    """ICQS (per set) three-way distribution: the mean of ``tent`` over the sets; ``[3]``."""
    return tent(np.asarray(score_per_set, dtype=np.float64)).mean(axis=0)


def epistemic_distribution(loglik: Any, ratios: Sequence[float]) -> np.ndarray:
    """ICQS-Epistemic three-way distribution ``sum_j q_j tent(r_j)`` with the posterior
    ``q_j = softmax_j(mean_l loglik[j, l])``.

    Args:
        loglik: ``[M+1, L]`` log-likelihoods (tensor or array).
        ratios: the ``M+1`` ratios.

    Returns:
        ``[3]`` float64 (e, n, c).
    """
    ll = np.asarray(loglik, dtype=np.float64)
    if ll.ndim != 2 or ll.shape[0] != len(ratios):
        raise ValueError(f"loglik must be [M+1={len(ratios)}, L], got shape {ll.shape}")
    m = ll.mean(axis=1)
    q = np.exp(m - m.max())
    q /= q.sum()
    return q @ tent(np.asarray(ratios, dtype=np.float64))


def _mae(p: np.ndarray, h: np.ndarray) -> float:
    return float(np.abs(p - h).mean())


def _ce(p: np.ndarray, h: np.ndarray, eps: float = CE_EPS) -> float:
    ps = (1 - eps) * p + eps / 3
    return float(-(h * np.log(ps)).sum(axis=1).mean())


def _polar_spearman(p: np.ndarray, h: np.ndarray) -> float:
    from .metrics import spearman

    return spearman(p[:, 0] - p[:, 2], h[:, 0] - h[:, 2])


NLI_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "mae": _mae, "ce": _ce, "spearman": _polar_spearman}


def distribution_metrics(pred: Any, human: Any, *, n_boot: int = 1000, seed: int = 0
                         ) -> dict[str, dict[str, float]]:
    """MAE, cross-entropy and Spearman of predicted against human distributions (rules in
    :data:`NLI_RULES`), each ``{"value", "lo", "hi"}`` with a bootstrap 95 % interval over items.

    Args:
        pred, human: ``[n, 3]`` (e, n, c) distributions.
    """
    from .metrics import bootstrap_ci

    p = np.asarray(pred, dtype=np.float64)
    h = np.asarray(human, dtype=np.float64)
    if p.shape != h.shape or p.ndim != 2 or p.shape[1] != 3:
        raise ValueError(f"pred and human must both be [n, 3], got {p.shape} and {h.shape}")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("pred holds negative or non-finite probabilities")
    out = {}
    for name, fn in NLI_METRICS.items():
        if len(p) == 0:
            out[name] = {"value": math.nan, "lo": math.nan, "hi": math.nan}
            continue
        lo, hi = bootstrap_ci(fn, p, h, n_resamples=n_boot, seed=seed)
        out[name] = {"value": fn(p, h), "lo": lo, "hi": hi}
    return out


def synthetic_answers(polar: Sequence[tuple[str, str, dict]], *,
                      accuracies: Sequence[float] = SYNTHETIC_ACCURACIES, seed: int = 0
                      ) -> np.ndarray:
    """Which sentences each synthetic model answers correctly: ``[n_models, n]`` bool, exactly
    ``round(a n)`` (half up) True per model, positions drawn per model from the seed."""
    n = len(polar)
    rng = np.random.default_rng(seed)
    out = np.zeros((len(accuracies), n), dtype=bool)
    for m, a in enumerate(accuracies):
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"accuracy {a} is not in [0, 1]")
        k = int(math.floor(a * n + 0.5))
        out[m, rng.permutation(n)[:k]] = True
    return out


def synthetic_ranking(polar: Sequence[tuple[str, str, dict]],
                      score: Callable[[Sequence[tuple[str, str]]], Sequence[float]], *,
                      accuracies: Sequence[float] = SYNTHETIC_ACCURACIES, seed: int = 0,
                      n_boot: int = 1000) -> dict[str, Any]:
    """Rank synthetic LLMs of known accuracy by their mean ICQS score.

    Args:
        polar: (sentence, gold label, vocabulary) triples the models answer.
        score: maps (x, y) responses to scores (higher = better); called once with every
            distinct answer (each sentence's right and wrong answer).
        accuracies: the models' true accuracies.

    Returns:
        ``{"spearman", "spearman_lo", "spearman_hi", "models": [{"accuracy", "mean_score"}]}``;
        the interval resamples sentences (each model keeps its answers to the drawn ones).
    """
    from .metrics import bootstrap_ci, spearman

    if len(accuracies) < 2:
        raise ValueError("need at least two synthetic models")
    right = [(x, v[g]) for x, g, v in polar]
    wrong = [(x, v[FLIP[g]]) for x, g, v in polar]
    s = np.asarray(list(score(right + wrong)), dtype=np.float64)
    if s.shape != (2 * len(polar),):
        raise ValueError(f"score returned {s.shape[0]} values for {2 * len(polar)} responses")
    s_right, s_wrong = s[: len(polar)], s[len(polar):]
    ans = synthetic_answers(polar, accuracies=accuracies, seed=seed)
    acc = np.asarray(accuracies, dtype=np.float64)

    def stat(sr: np.ndarray, sw: np.ndarray, *cols: np.ndarray) -> float:
        a = np.stack(cols)  # [models, n]
        means = np.where(a, sr[None, :], sw[None, :]).mean(axis=1)
        return spearman(acc, means)

    cols = [ans[m] for m in range(len(acc))]
    means = np.where(ans, s_right[None, :], s_wrong[None, :]).mean(axis=1)
    rho = spearman(acc, means)
    lo, hi = bootstrap_ci(stat, s_right, s_wrong, *cols, n_resamples=n_boot, seed=seed)
    return {"spearman": rho, "spearman_lo": lo, "spearman_hi": hi,
            "models": [{"accuracy": float(a), "mean_score": float(m)}
                       for a, m in zip(acc, means, strict=True)]}


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


def _icqs_scores(model: Any, tok: Any, good: Sequence, bad: Sequence,
                 responses: Sequence[tuple[str, str]], n: int, st: StudySettings,
                 template: Any = None, desc: str = "ICQS") -> list:
    """ICQSResult per response (dedupe left to the caller), with a progress report."""
    from .progress import track

    sc = make_scorer(model, tok, good, bad, n, st, template)
    return list(track(sc.score(responses), total=len(responses), desc=f"{desc} N={n}",
                      unit="response", quiet=st.quiet))


def make_scorer(model: Any, tok: Any, good: Sequence, bad: Sequence, n: int, st: StudySettings,
                template: Any = None) -> Any:
    """The :class:`icqs_fast.icqs.ICQSScorer` of a study run with ``n`` demonstrations per set:
    label-stratified sets (fixed label order) when ``st.stratify``, else unstratified as in the
    study (explicitly: the engine's own default is ``stratify="auto"``)."""
    from .icqs import ICQSScorer

    return ICQSScorer(model, tok, good, bad, num_ratios=st.num_ratios, demos_per_set=n,
                      sets_per_ratio=st.sets_per_ratio, seed=st.seed, template=template,
                      backend=st.backend, drop_oldest_demos=True,
                      stratify="y" if st.stratify else None)


def _demo_sample(pool: Sequence, n: int, seed: int) -> list:
    """``n`` demonstrations from ``pool`` (seeded, keeping pool order, which alternates labels)."""
    if n > len(pool):
        raise ValueError(f"{n} ICL demonstrations requested from a pool of {len(pool)}")
    idx = sorted(random.Random(seed).sample(range(len(pool)), n))
    return [pool[i] for i in idx]


def _unique(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(pairs))


def run_sentiment(model: Any, tok: Any, data: SentimentData, st: StudySettings
                  ) -> dict[str, Any]:
    """Score every group with ICQS, ICQS-Epistemic, ICL and Ask LLM for each ``N`` in
    ``st.demos_per_set``.

    Returns:
        ``{"per_n": {N: {"groups": {g: {m: {"value", "lo", "hi", "n"}}}, "ranking": ...}},
        "items": {N: {g: {"score": [...], "score_per_set": [[...]], "loglik": [n, M+1, L]}}},
        "ratios": [...]}`` - the summaries and the per-item values the plots use.
    """
    from .baselines import ask_llm, icl_label

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
        results = _icqs_scores(model, tok, data.good, data.bad, responses, n, st)
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
                    "separation": _separation(item_vals, st.baselines)}
        items[n] = item_vals
    return {"per_n": per_n, "items": items, "ratios": ratios,
            "timing": {k: round(v, 2) for k, v in timing.items()}}


def _separation(item_vals: dict[str, Any], baselines: bool) -> dict[str, Any]:
    """Threshold-free view: mean score per group and the AUC of correct vs incorrect
    responses (ICQS-Epistemic score, mean per-set ICQS score, Ask LLM expected rating)."""
    from .metrics import auc

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
        out["auc_correct_vs_incorrect"] = {
            m: auc([1] * len(c[m]) + [0] * len(i[m]), c[m] + i[m]) for m in c}
    return out


def _first_response(groups: dict[str, list[Response]], pairs: Sequence[tuple[str, str]]
                    ) -> list[Response]:
    first: dict[tuple[str, str], Response] = {}
    for g in groups.values():
        for r in g:
            first.setdefault((r.x, r.y), r)
    return [first[p] for p in pairs]


def _ask_question(dataset: str, candidates: Sequence[str], x: str) -> str:
    """The Ask LLM instruction for a sentiment sentence (the response is its label)."""
    what = "financial news sentence" if dataset == "fpb" else "movie review sentence"
    opts = ", ".join(candidates[:-1]) + f" or {candidates[-1]}"
    return f"What is the sentiment of this {what}? Answer {opts}.\n\nSentence: {x}"


NLI_ICQS_TEMPLATE = dict(demo="Premise: {x}\nHypothesis: {y}\n", query="Premise: {x}\nHypothesis:",
                         response=" {y}\n", separator="\n")
NLI_ICL_TEMPLATE = dict(demo="{x}\nRelation: {y}\n", query="{x}\nRelation:", response=" {y}\n",
                        separator="\n")


def _nli_x(it: NLIItem) -> str:
    return f"Premise: {it.premise}\nHypothesis: {it.hypothesis}"


def run_chaosnli(model: Any, tok: Any, data: NLIData, st: StudySettings) -> dict[str, Any]:
    """ICQS, ICQS-Epistemic and ICL distributions of every test pair for each ``N``, with
    MAE / CE / Spearman against the human distributions.

    Returns:
        ``{"per_n": {N: {method: {metric: {"value", "lo", "hi"}}}}, "items": {N: {"pred":
        {method: [n, 3]}, "score": [...], "loglik": [n, M+1, L], "majority": [...]}},
        "human": [n, 3], "ratios": [...]}``.
    """
    from .baselines import icl_label
    from .prompts import Template

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
        results = _icqs_scores(model, tok, good, bad, responses, n, st, template=tpl)
        timing["icqs"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        ratios = list(results[0].ratios)
        pred = {"icqs": np.stack([icqs_distribution(r.score_per_set) for r in results]),
                "icqs_epistemic": np.stack([epistemic_distribution(r.loglik, r.ratios)
                                            for r in results])}
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
        items[n] = {"pred": pred, "score": [r.score for r in results],
                    "loglik": np.stack([r.loglik.double().numpy() for r in results]),
                    "majority": [it.majority for it in data.test]}
    return {"per_n": per_n, "items": items, "human": human, "ratios": ratios,
            "timing": {k: round(v, 2) for k, v in timing.items()}}


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
        }

    doc = {"dataset": dataset, "model": model, "seconds": round(seconds, 2), **flat(main),
           "n": {g: row["icqs"]["n"] for g, row in main["groups"].items()},
           "expected": {g: "correct" if EXPECTED[g] else "incorrect" for g in main["groups"]},
           "rules": RULES, "labels": labels, "timing": out["timing"],
           "settings": {"demos_per_set": max(ns), "num_ratios": st.num_ratios,
                        "sets_per_ratio": st.sets_per_ratio, "seed": st.seed,
                        "ask_threshold": st.ask_threshold, "n_boot": st.n_boot,
                        "stratify": st.stratify},
           "curve": [{"demos_per_set": n, **flat(out["per_n"][n])} for n in ns]}
    return _finite(doc)


def chaosnli_json(out: dict[str, Any], *, model: str, seconds: float, st: StudySettings
                  ) -> dict[str, Any]:
    """The ``eval chaosnli --json`` document: ``{dataset, model, seconds, icqs, icqs_epistemic,
    icl: {mae, ce, spearman}}`` for the largest ``N``, plus intervals, rules, settings, curve."""
    ns = list(st.demos_per_set)

    def flat(per: dict) -> dict[str, Any]:
        d: dict[str, Any] = {m: {k: _v(v) for k, v in row.items()} for m, row in per.items()}
        d["intervals"] = {m: {k: [v["lo"], v["hi"]] for k, v in row.items()}
                          for m, row in per.items()}
        return d

    doc = {"dataset": "chaosnli", "model": model, "seconds": round(seconds, 2),
           **flat(out["per_n"][max(ns)]), "n": int(len(out["human"])), "rules": NLI_RULES,
           "timing": out["timing"],
           "settings": {"demos_per_set": max(ns), "num_ratios": st.num_ratios,
                        "sets_per_ratio": st.sets_per_ratio, "seed": st.seed,
                        "n_boot": st.n_boot, "stratify": st.stratify},
           "curve": [{"demos_per_set": n, **flat(out["per_n"][n])} for n in ns]}
    return _finite(doc)


def _finite(obj: Any) -> Any:
    """NaN / inf -> None, so the document is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(doc: dict[str, Any]) -> str:
    """Strict JSON text of a study document."""
    return json.dumps(doc, indent=1, allow_nan=False)
