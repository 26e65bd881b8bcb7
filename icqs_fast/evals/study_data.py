"""The study's data: demonstration pools and response groups built from FPB, SST-2 and ChaosNLI.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from icqs_fast.io.datasets import NLI_GROUPS, EvalDataset, NLIItem, eval_dataset
from icqs_fast.io.records import PathLike

SENTIMENT_GROUPS = ("correct", "incorrect", "labeled_neutral", "semantic_neutral")
NLI_LABELS = ("entailment", "neutral", "contradiction")
FLIP = {"positive": "negative", "negative": "positive"}
SYNONYMS = (("good", "bad"), ("happy", "sad"))


# Accuracies of the synthetic answer sets of the ranking check.
SYNTHETIC_ACCURACIES = (1.0, 0.75, 0.5, 0.25)


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


def polar_pools(rows: Sequence[tuple[str, str]], *, n_good: int, n_bad: int, seed: int,
                max_chars: int | None = 200
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """Good and bad demonstration pools from labelled sentences, plus the unused rows.

    Good = polar sentences with their own label, bad = other polar sentences with the opposite
    label; both alternate positive/negative while the data allow (the rule of
    :func:`icqs_fast.io.datasets.fpb_examples`). Only sentences of at most ``max_chars`` characters
    are
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


def sentiment_data(dataset: str | EvalDataset, path: PathLike | None = None, *, pool: int = 32,
                   limit: int | None = None, seed: int = 0, labels: str = "original"
                   ) -> SentimentData:
    """The study data of a ``labels`` data set of the registry
    (:data:`icqs_fast.io.datasets.EVAL_DATASETS`; default file there): pools of ``pool`` good
    and ``pool`` bad demonstrations (:func:`polar_pools`) and the test groups
    (:func:`sentiment_groups`; the neutral ones when the data set has a neutral class)."""
    ds = dataset if isinstance(dataset, EvalDataset) else eval_dataset(dataset)
    if ds.kind != "labels":
        raise ValueError(f"{ds.name} is a {ds.kind!r} data set, not 'labels'")
    rows = ds.read(Path(path) if path is not None else ds.default_path())
    good, bad, rest = polar_pools(rows, n_good=pool, n_bad=pool, seed=seed)
    groups, polar = sentiment_groups(rest, limit=limit, seed=seed, neutral=ds.neutral,
                                     labels=labels)
    return SentimentData(ds.name, good, bad, groups, polar)


def fpb_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
             seed: int = 0, labels: str = "original") -> SentimentData:
    """Financial PhraseBank study data (:func:`sentiment_data`): the pools (the rule of
    :func:`icqs_fast.io.datasets.fpb_examples`) and the four groups."""
    return sentiment_data("fpb", path, pool=pool, limit=limit, seed=seed, labels=labels)


def sst2_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
              seed: int = 0, labels: str = "original") -> SentimentData:
    """SST-2 study data (:func:`sentiment_data`): pools and the correct / incorrect groups (no
    neutral class)."""
    return sentiment_data("sst2", path, pool=pool, limit=limit, seed=seed, labels=labels)


@dataclass
class NLIData:
    """ChaosNLI study data: polar pools (as NLI items) and the test items."""

    good: list[NLIItem]
    bad: list[NLIItem]
    test: list[NLIItem]


def chaosnli_data(path: PathLike | None = None, *, pool: int = 32, limit: int | None = None,
                  seed: int = 0, dataset: str | EvalDataset = "chaosnli") -> NLIData:
    """Pools of ``pool`` majority-entailment (good) and ``pool`` majority-contradiction (bad)
    pairs, drawn with the seed; the test items are every other pair, or ``limit`` per majority
    label (seeded) when given, in file order. ``dataset``: the registry's ``distributions``
    entry (its reader and default file)."""
    ds = dataset if isinstance(dataset, EvalDataset) else eval_dataset(dataset)
    p = Path(path) if path is not None else ds.default_path()
    items = ds.read(p)
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
