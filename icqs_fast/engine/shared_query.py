"""Responses with the same query share its states (``ICQSScorer.score(share_query=True)``, what
:func:`icqs_fast.engine.pairs.score_pairs` asks for): consecutive responses with the same ``x``
form a group (:func:`query_runs`), each context's tokens their rows share after the bank entry
become one :class:`QuerySegment` (:func:`segment_group`), run once per batch, and the rows
continuing it run in forwards by length (:func:`length_runs`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from icqs_fast.engine.checks import parse_response
from icqs_fast.engine.prompt_tokens import common_prefix

# At most this many consecutive responses share one query's states (a pair is two; the cap
# bounds what one group holds in flight).
QUERY_GROUP_MAX = 16


@dataclass(eq=False)
class QuerySegment:
    """Query tokens that the rows of a group's responses continue after one context's bank
    entry: their common start after the entry, run once per suffix forward that holds those rows
    (in one more forward before it, whose keys/values the rows then read:
    :class:`~icqs_fast.engine.one_pass.QueryPart`), and kept no longer."""

    entry: int
    ids: list[int]


def query_runs(responses: Iterable) -> Iterator[list[tuple[int, Any]]]:
    """``(index, item)`` of ``responses`` in runs of consecutive items with the same ``x`` (at
    most :data:`QUERY_GROUP_MAX`), each run yielded once the next item shows it ended."""
    run: list[tuple[int, Any]] = []
    x0 = None
    for i, item in enumerate(responses):
        x, _ = parse_response(i, item)
        if run and (x != x0 or len(run) == QUERY_GROUP_MAX):
            yield run
            run = []
        run.append((i, item))
        x0 = x
    if run:
        yield run


def segment_group(recs: Sequence[Any]) -> None:
    """Give the engine's states ``recs`` (:class:`~icqs_fast.engine.scorer.ResponseState`, the
    same ``x``) one :class:`QuerySegment` per context where they continue the same bank entry:
    the tokens all their suffixes start with, cut before the position predicting any of their
    first response tokens; their suffixes then start after it."""
    if len(recs) < 2:
        return
    first = recs[0]
    for c, e in enumerate(first.entries):
        if e is None or any(r.entries[c] != e for r in recs):
            continue  # e.g. demonstrations dropped for one response only
        m = min(r.rstart[c] for r in recs)
        for r in recs[1:]:
            m = min(m, common_prefix(first.suffix[c], r.suffix[c]))
        if m <= 0:
            continue
        seg = QuerySegment(e, first.suffix[c][:m])
        for r in recs:
            r.seg[c], r.suffix[c], r.rstart[c] = seg, r.suffix[c][m:], r.rstart[c] - m
            r.group = first


def length_runs(lengths: list[int], forward_cost: int) -> list[list[int]]:
    """Row indices in runs of similar length, longest first: the split of the rows sorted by
    length that pads the fewest tokens, ``forward_cost`` counted per run."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the first j rows; a run i..j-1 pads to lengths[i]
        for i in range(j):
            cost = best[i] + (j - i) * lengths[order[i]] + forward_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]
