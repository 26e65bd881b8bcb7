"""The self-check's cache: the cross-fitted score of each held-out pool item (minutes of model
time in all) stored under a hash of everything that decides it, so that a second ``score`` or
``check`` with the same pools, settings, model and dtype reuses them
(:func:`icqs_fast.engine.selfcheck.run_self_check`'s ``cache``; where it lives and how to turn
it off: :mod:`icqs_fast.io.cache`).

The entry holds **one score per item**, not one list per draw: an item's cross-fitted score
depends on the pools (which build the demonstration sets), the scorer and the leak rule, never
on which other items were drawn. So a ``check`` after a ``score`` whose self-check the job's
size capped (fewer items drawn: other options, same items) reuses every item it has and scores
only the held-out items it lacks. Only the scores are stored: the map, intervals, threshold and
abstain band are fitted again from them (seconds), so a new target reuses them too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from icqs_fast.engine.prompts import check_pool
from icqs_fast.io.cache import digest

if TYPE_CHECKING:
    from icqs_fast.engine.scorer import ICQSScorer

__all__ = ["KEY_VERSION", "item_id", "items_key", "load_items", "scorer_identity",
           "store_items"]

# The layout of a cached entry and of its key; a change makes old entries unreachable.
# 3: per item a dict (its score and the free baselines' values); 2: per item a score;
# 1: one list per draw.
KEY_VERSION = 3


def scorer_identity(scorer: ICQSScorer) -> dict[str, Any]:
    """What, besides the pools and the self-check's options, decides a scorer's cross-fitted
    scores: its settings' fingerprint, the model's name or path, its parameter count and dtype
    (a model re-written in place under the same path and size is not told apart: clear the
    cache, ``icqs_fast.io.cache``)."""
    from icqs_fast.invariant_linears import parameter_count  # torch: only once a scorer exists

    model = scorer.model
    p = next(model.parameters())
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return {"settings": scorer.settings.fingerprint(), "model": str(name),
            "n_params": parameter_count(model),
            "dtype": str(p.dtype).removeprefix("torch."), "device": p.device.type}


def items_key(scorer: ICQSScorer, good: Sequence, bad: Sequence, *, leak: str,
              part: str = "scores") -> str:
    """The cache key of the per-item cross-fitted scores: a hash of the pools' items, the
    scorer (:func:`scorer_identity`) and the leak rule - what decides an item's score. Not
    the draw (seed, ``--self-check-max``, the job's cap): those pick items, whose scores the
    entry holds one by one (:func:`item_id`). ``part``: ``"scores"`` (the cross-fitted
    scores) or ``"baselines"`` (the trivial scorers' values of the same items)."""
    return digest({"version": KEY_VERSION, "good": [list(e) for e in check_pool(good, "good")],
                   "bad": [list(e) for e in check_pool(bad, "bad")],
                   "scorer": scorer_identity(scorer), "leak": leak, "part": part})


def item_id(item: Sequence[str]) -> str:
    """An item's name in an entry: the hash of its ``(x, y)``."""
    return digest(list(item))


def _json(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _json(u) for k, u in v.items()}
    return None if not math.isfinite(v) else float(v)


def _value(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _value(u) for k, u in v.items()}
    return math.nan if v is None else float(v)


def store_items(cache: Any, key: str, items: Mapping[str, Any]) -> bool:
    """Store each item's value (:func:`item_id` -> a score, or a dict of named values; NaN:
    none) under ``key``; whether it was stored."""
    doc = {"items": {k: _json(v) for k, v in items.items()}}
    return cache.put(key, doc) is not None


def load_items(cache: Any, key: str, *, values: bool = False) -> dict[str, Any]:
    """The per-item values stored under ``key``: scores, or with ``values`` dicts of named
    values (empty: absent or malformed)."""
    doc = cache.get(key)
    try:
        out = {str(k): _value(v) for k, v in doc["items"].items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return {}
    kind = dict if values else float
    return out if all(isinstance(v, kind) for v in out.values()) else {}
