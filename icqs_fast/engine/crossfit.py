"""Cross-fitting the self-check's held-out pool members (:mod:`icqs_fast.engine.selfcheck`):
which items are held out (a nested, class-balanced, seeded draw), which contexts each may be
scored from (the demonstration sets that do not hold it), their scores from those contexts
only, and the same read from / stored in the per-item cache
(:mod:`icqs_fast.engine.selfcheck_cache`) with the trivial scorers' values beside them
(:mod:`icqs_fast.engine.selfcheck_baselines`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from icqs_fast.engine.prompts import DemoSet, Example, check_pool
from icqs_fast.engine.selfcheck_baselines import item_values
from icqs_fast.engine.selfcheck_cache import item_id, items_key, load_items, store_items
from icqs_fast.engine.settings import DEFAULT_MAX_HELDOUT
from icqs_fast.engine.settings import SELF_CHECK_LEAKS as LEAKS

if TYPE_CHECKING:
    import torch

    from icqs_fast.engine.scorer import ICQSScorer


def clean_contexts(sets: Sequence[Sequence[DemoSet]], item: Example, leak: str = "input"
                   ) -> torch.Tensor:
    """``[M+1, L]`` bool: True where demonstration set ``sets[j][l]`` does not hold ``item``.

    ``leak="input"`` (default) counts any demonstration with the item's input ``x`` as holding
    it (the same question answered either way, e.g. good and bad answers to one prompt, would
    tell the model the item's answer); ``"pair"`` only the same ``(x, y)`` (for data whose
    pools share inputs by design, e.g. one fixed instruction).
    """
    import torch

    if leak not in LEAKS:
        raise ValueError(f"leak must be one of {LEAKS}, got {leak!r}")
    x, y = item
    if leak == "input":
        def holds(s: DemoSet) -> bool:
            return any(ex[0] == x for ex in s.examples)
    else:
        def holds(s: DemoSet) -> bool:
            return any(ex == (x, y) for ex in s.examples)
    return torch.tensor([[not holds(s) for s in row] for row in sets], dtype=torch.bool)


def crossfit_score(res: Any, clean: torch.Tensor) -> float:
    """The score of ``res`` (an :class:`~icqs_fast.engine.scorer.ICQSResult`) from its clean
    contexts only: per ratio ``j`` the mean over the clean sets ``l`` of the (calibrated)
    log-likelihood, then the engine's ICQS-Epistemic score of that column
    (:func:`~icqs_fast.engine.calibration.icqs_scores`, the result's score kind). Equal to
    ``res.score`` when every context is clean; NaN when a ratio has no clean set.

    Args:
        res: the item's result (``loglik`` and ``loglik_baseline`` ``[M+1, L]``).
        clean: ``[M+1, L]`` bool, from :func:`clean_contexts`.
    """
    import torch

    from icqs_fast.engine.calibration import icqs_scores

    ll = res.loglik.double()
    if res.loglik_baseline is not None:
        ll = ll - res.loglik_baseline.double()
    if clean.shape != ll.shape:
        raise ValueError(f"clean has shape {tuple(clean.shape)}, the result {tuple(ll.shape)}")
    count = clean.sum(dim=1)
    if bool((count == 0).any()):
        return math.nan
    col = torch.where(clean, ll, torch.zeros_like(ll)).sum(dim=1) / count
    score, _ = icqs_scores(col[:, None], res.ratios, res.score_kind, res.tie_epsilon)
    return score


def heldout_per_class(n_good: int, n_bad: int, max_heldout: int) -> int:
    """Held-out items drawn from each pool: ``min(max_heldout // 2, n_good, n_bad)``."""
    return min(max_heldout // 2, n_good, n_bad)


def select_heldout(n_good: int, n_bad: int, max_heldout: int, seed: int
                   ) -> tuple[list[int], list[int]]:
    """Pool indices of the held-out items: ``k = min(max_heldout // 2, n_good, n_bad)`` of each
    pool (the same count of each, so the calibrated probability is for an even mix), in pool
    order: the first ``k`` of a seeded order of each pool (``random.Random(seed)``), so a
    larger draw holds every item of a smaller one with the same seed (a ``check`` after a
    ``score`` whose self-check the job capped scores only the items it adds: the cache holds
    scores per item)."""
    if not isinstance(max_heldout, int) or max_heldout < 0:
        raise ValueError(f"max_heldout must be an int >= 0, got {max_heldout!r}")
    k = heldout_per_class(n_good, n_bad, max_heldout)
    rng = random.Random(seed)
    order_good, order_bad = rng.sample(range(n_good), n_good), rng.sample(range(n_bad), n_bad)
    return sorted(order_good[:k]), sorted(order_bad[:k])


def heldout_items(good: Sequence, bad: Sequence, max_heldout: int, seed: int
                  ) -> tuple[list[Example], np.ndarray]:
    """The held-out pool members, good ones first, and their labels ``[n]`` int64 (1 = good
    pool), as :func:`crossfit_heldout` scores them (:func:`select_heldout`'s draw)."""
    g, b = check_pool(good, "good"), check_pool(bad, "bad")
    ig, ib = select_heldout(len(g), len(b), max_heldout, seed)
    labels = np.array([1] * len(ig) + [0] * len(ib), dtype=np.int64)
    return [g[i] for i in ig] + [b[i] for i in ib], labels


@dataclass
class CrossFit:
    """Cross-fitted scores of the held-out pool members.

    Attributes:
        items: the held-out (x, y) pairs, good ones first.
        labels: ``[n]`` int64, 1 for a good-pool item, 0 for a bad one.
        scores: ``[n]`` float64, each item's score from its clean contexts (NaN: skipped).
        full_scores: ``[n]`` float64, the item's score from every context (leaky; kept to
            show what the cross-fitting changes).
        clean: ``[n, M+1, L]`` bool, the contexts each score used.
        free: per item, what ICQS's own forward gives a baseline at no extra cost
            (:func:`free_values`).
    """

    items: list[Example]
    labels: np.ndarray
    scores: np.ndarray
    full_scores: np.ndarray
    clean: np.ndarray
    free: list[dict[str, float]] = field(default_factory=list)

    @property
    def n_skipped(self) -> int:
        return int((~np.isfinite(self.scores)).sum())


def crossfit_heldout(scorer: ICQSScorer, good: Sequence, bad: Sequence, *,
                     max_heldout: int = DEFAULT_MAX_HELDOUT, seed: int = 0,
                     leak: str = "input",
                     progress: Callable[[Iterable, int], Iterable] | None = None) -> CrossFit:
    """Score the held-out pool members with ``scorer`` and cross-fit their scores.

    Args:
        scorer: the run's :class:`~icqs_fast.engine.scorer.ICQSScorer`, built from ``good`` and
            ``bad`` (its demonstration sets and prefix bank are used as they are).
        good, bad: the pools the scorer was built from ((x, y) pairs or dicts).
        max_heldout: at most this many items in all (:func:`select_heldout`).
        seed: the draw of the held-out items.
        leak: see :func:`clean_contexts`.
        progress: wraps the result stream (e.g. a progress bar): ``progress(iterable, total)``.
    """
    items, labels = heldout_items(good, bad, max_heldout, seed)
    return crossfit_items(scorer, items, labels, leak=leak, progress=progress)


def crossfit_items(scorer: ICQSScorer, items: Sequence[Example], labels: np.ndarray, *,
                   leak: str = "input",
                   progress: Callable[[Iterable, int], Iterable] | None = None) -> CrossFit:
    """Score ``items`` (pool members, with their 0/1 ``labels``) with ``scorer`` and cross-fit
    each one's score (:func:`clean_contexts`, :func:`crossfit_score`): the step of
    :func:`crossfit_heldout` after the draw."""
    import torch

    items = list(items)
    masks = [clean_contexts(scorer.sets, it, leak) for it in items]
    stream: Iterable = scorer.score(items)
    if progress is not None:
        stream = progress(stream, len(items))
    scores, full, free = [], [], []
    for res, mask in zip(stream, masks, strict=True):
        scores.append(crossfit_score(res, mask))
        full.append(float(res.score))
        free.append(free_values(res, mask))
    m1, ls = len(scorer.sets), len(scorer.sets[0])
    clean = (torch.stack(masks).numpy() if masks else np.zeros((0, m1, ls), dtype=bool))
    return CrossFit(items, labels, np.asarray(scores, dtype=np.float64),
                    np.asarray(full, dtype=np.float64), clean, free)


def free_values(res: Any, clean: torch.Tensor) -> dict[str, float]:
    """The baselines ICQS's own forward already holds for one item: the raw log-likelihood of
    the response under the all-good demonstration sets (ratio 1, the clean sets only, mean
    over them), summed and per response token (NaN without a clean all-good set)."""
    row, keep = res.loglik[-1].double(), clean[-1]
    total = float(row[keep].mean()) if bool(keep.any()) else math.nan
    return {"loglik_good_sum": total,
            "loglik_good_mean": total / max(int(res.n_response_tokens), 1)}


def cached_crossfit(scorer: ICQSScorer, good: Sequence, bad: Sequence, *, max_heldout: int,
                    seed: int, leak: str, cache: Any = None,
                    progress: Callable[[Iterable, int], Iterable] | None = None,
                    config: dict[str, Any] | None = None,
                    drawn: tuple[list[Example], np.ndarray] | None = None
                    ) -> tuple[list[Example], np.ndarray, np.ndarray, int, list[dict]]:
    """The held-out draw (:func:`heldout_items`) and its cross-fitted scores and labels, each
    item's score read from ``cache`` when it holds it and scored otherwise (only the items it
    lacks, then stored with the rest: :mod:`icqs_fast.engine.selfcheck_cache`); how many were
    reused; and each item's :func:`free_values` (stored beside its score). ``config`` gets
    ``"cache"``: ``"hit"`` (all reused), ``"stored"`` (some scored and stored) and
    ``"reused"`` / ``"scored"``: the counts. ``drawn``: ``(items, labels)`` drawn otherwise
    (the pairwise self-check's whole instructions,
    :func:`icqs_fast.engine.selfcheck_pairs.instruction_heldout`) instead of the draw."""
    items, labels = drawn if drawn is not None else heldout_items(good, bad, max_heldout, seed)
    key = (items_key(scorer, good, bad, leak=leak)
           if cache is not None and cache.enabled else None)
    known = load_items(cache, key, values=True) if key is not None else {}
    ids = [item_id(it) for it in items]
    missing = [i for i, k in enumerate(ids) if k not in known or "score" not in known[k]]
    if missing:
        cf = crossfit_items(scorer, [items[i] for i in missing], labels[missing], leak=leak,
                            progress=progress)
        known.update({ids[i]: {"score": float(v), **f}
                      for i, v, f in zip(missing, cf.scores, cf.free, strict=True)})
    scores = np.array([known[k]["score"] for k in ids], dtype=np.float64)
    free = [{n: v for n, v in known[k].items() if n != "score"} for k in ids]
    reused = len(items) - len(missing)
    if config is not None and key is not None:
        config["reused"], config["scored"] = reused, len(missing)
        if not missing:
            config["cache"] = "hit"
        elif store_items(cache, key, known):
            config["cache"] = "stored"
    return items, scores, labels, reused, free


def cached_baselines(scorer: ICQSScorer, good: Sequence, bad: Sequence, items: Sequence[Example], *,
                     leak: str, cache: Any = None) -> list[dict[str, float]]:
    """The trivial scorers' values of ``items``
    (:func:`icqs_fast.engine.selfcheck_baselines.item_values`), read from ``cache`` per item
    where it holds them (beside the cross-fitted scores, under their own key) and computed
    for the rest."""
    key = (items_key(scorer, good, bad, leak=leak, part="baselines")
           if cache is not None and cache.enabled else None)
    known = load_items(cache, key, values=True) if key is not None else {}
    ids = [item_id(it) for it in items]
    missing = [i for i, k in enumerate(ids) if k not in known]
    if missing:
        new = item_values(scorer, [items[i] for i in missing])
        known.update({ids[i]: v for i, v in zip(missing, new, strict=True)})
        if key is not None:
            store_items(cache, key, known)
    return [known[k] for k in ids]
