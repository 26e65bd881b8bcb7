"""The self-check's cache: the cross-fitted scores of held-out pool items (minutes of model
time) stored under a hash of everything that decides them, so that a second ``score`` or
``check`` with the same pools, settings, model and dtype reuses them
(:func:`icqs_fast.engine.selfcheck.run_self_check`'s ``cache``; where it lives and how to turn
it off: :mod:`icqs_fast.io.cache`). Only the scores are stored: the map, intervals, threshold
and abstain band are fitted again from them (seconds), so a new target reuses them too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from icqs_fast.engine.prompts import check_pool
from icqs_fast.io.cache import digest

__all__ = ["KEY_VERSION", "crossfit_key", "load_crossfit", "scorer_identity", "store_crossfit"]

# The layout of a cached entry and of its key; a change makes old entries unreachable.
KEY_VERSION = 1


def scorer_identity(scorer: Any) -> dict[str, Any]:
    """What, besides the pools and the self-check's options, decides a scorer's cross-fitted
    scores: its settings' fingerprint, the model's name or path, its parameter count and dtype
    (a model re-written in place under the same path and size is not told apart: clear the
    cache, ``icqs_fast.io.cache``)."""
    model = scorer.model
    p = next(model.parameters())
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return {"settings": scorer.settings.fingerprint(), "model": str(name),
            "n_params": int(sum(q.numel() for q in model.parameters())),
            "dtype": str(p.dtype).removeprefix("torch."), "device": p.device.type}


def crossfit_key(scorer: Any, good: Sequence, bad: Sequence, *, per_class: int, seed: int,
                 leak: str) -> str:
    """The cache key of the self-check's cross-fitted scores: a hash of the pools' items, the
    scorer (:func:`scorer_identity`) and what picks and cleans the held-out items: the items
    drawn per class (not the ``--self-check-max`` asked: a job capped to 60 and a ``check``
    asking 256 of 24 + 24 pools draw the same 24 + 24), the seed and the leak rule."""
    return digest({"version": KEY_VERSION, "good": [list(e) for e in check_pool(good, "good")],
                   "bad": [list(e) for e in check_pool(bad, "bad")],
                   "scorer": scorer_identity(scorer), "per_class": per_class,
                   "seed": seed, "leak": leak})


def store_crossfit(cache: Any, key: str, scores: Any, labels: Any) -> bool:
    """Store cross-fitted ``scores`` ``[n]`` (NaN: skipped) and 0/1 ``labels`` ``[n]`` under
    ``key``; whether it was stored."""
    doc = {"scores": [None if not math.isfinite(v) else float(v) for v in scores],
           "labels": [int(v) for v in labels]}
    return cache.put(key, doc) is not None


def load_crossfit(cache: Any, key: str) -> tuple[Any, Any] | None:
    """``(scores, labels)`` stored under ``key``, or None (absent or malformed)."""
    import numpy as np

    doc = cache.get(key)
    try:
        scores = np.array([math.nan if v is None else float(v) for v in doc["scores"]])
        labels = np.array([int(v) for v in doc["labels"]], dtype=np.int64)
    except (TypeError, KeyError, ValueError):
        return None
    return (scores, labels) if scores.shape == labels.shape else None
