"""``POST /v1/score``: ICQS scores (good / bad demonstrations given at server start or in the
request) and glass-box features of posted records.

The request is priced before it is queued (:func:`icqs_fast.serve.admission.score_price`:
each record read once per ICQS context and calibration baseline and once for the features, the
contexts' demonstration prefixes once) and cut into chunks of about ``--prefill-budget``
token-passes (at most ``--max-batch-tokens``; a record whose work is larger is a chunk of its
own): a chunk is the slice of a worker step beside the live generations' tokens. The
demonstration prefixes are one unit before the records'. Every forward checks whether the
request has ended (deadline, disconnect, shutdown), so a record's work stops part-way; the
server's own scorer, whose prefixes it keeps between requests, is then rebuilt on its next use,
since its caches may hold work that was cut.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.io.schema import pair_row, result_row
from icqs_fast.io.strict_json import finite_or_none
from icqs_fast.serve.admission import Admission, score_price
from icqs_fast.serve.config import ServeConfig
from icqs_fast.serve.dispatch import Dispatcher
from icqs_fast.serve.errors import APIError
from icqs_fast.serve.queue import Unit
from icqs_fast.serve.schemas import (
    IcqsScore,
    PairScore,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from icqs_fast.engine.scorer import ICQSScorer


def icqs_item(res: Any) -> IcqsScore:
    """One :class:`icqs_fast.engine.scorer.ICQSResult` as the response's
    :class:`~icqs_fast.serve.schemas.IcqsScore`: its declared result fields
    (:func:`icqs_fast.io.schema.result_row`, as in a ``score`` line), non-finite numbers as
    null."""
    return IcqsScore(**finite_or_none(result_row(res)))


def pair_item(res: Any) -> PairScore:
    """One :class:`icqs_fast.engine.pairs.PairResult` as the response's
    :class:`~icqs_fast.serve.schemas.PairScore`: its declared result fields
    (:func:`icqs_fast.io.schema.pair_row`, as in a ``score --pairs`` line)."""
    return PairScore(**finite_or_none(pair_row(res)))


def _pair_records(i: int, p: Any) -> list[dict]:
    """Pair ``i`` as its two records, (x, y_a) then (x, y_b)."""
    x = next((v for v in (p.x, p.instruction, p.prompt) if v is not None), None)
    if x is None:
        raise APIError(400, f"pair {i}: needs a string field 'x' (or 'instruction', 'prompt')",
                       "invalid_request", param=f"pairs[{i}]")
    return [{"x": x, "y": p.y_a, "reference": None}, {"x": x, "y": p.y_b, "reference": None}]


def _record(i: int, r: Any) -> dict:
    x = next((v for v in (r.x, r.instruction, r.prompt) if v is not None), None)
    y = next((v for v in (r.y, r.response) if v is not None), None)
    if x is None or y is None:
        raise APIError(400, f"record {i}: needs string fields 'x' (or 'instruction', 'prompt') "
                       "and 'y' (or 'response')", "invalid_request", param=f"records[{i}]")
    return {"x": x, "y": y, "reference": r.reference}


def plain_path(model: PreTrainedModel) -> bool:
    """True when the engine scores ``model`` without a prefix bank."""
    from icqs_fast.engine.capability import model_plan

    try:
        return not model_plan(model).bank
    except TypeError:  # no LM head at all: /v1/score fails per request, priced as plain
        return True


def _pool(items: list) -> list[tuple[str, str]]:
    return [(it[0], it[1]) if isinstance(it, list) else (it.x, it.y) for it in items]


class RequestScorer:
    """One ``/v1/score`` request's ICQS scorer: built by the request's first unit (its
    demonstration prefixes) and used by each of its chunks; made again (``make``) when another
    request's chunk cut it mid-forward (its bank is then freed)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.scorer: Any = None

    def build(self) -> None:
        """Make the scorer (the request's first unit)."""
        self.scorer = self.make()

    def current(self, cut: Container[Any]) -> Any:
        """The scorer, made first when there is none yet or it is in ``cut``."""
        if self.scorer is None or self.scorer in cut:
            self.scorer = self.make()
        return self.scorer


class Scoring:
    """The ``/v1/score`` handler of one server.

    Args:
        model, tokenizer: the served model.
        admission: the server's limits.
        dispatcher: puts the request's work on the queue and waits for it.
        config: the server's settings (its model id, the chunk: ``prefill_budget`` token-passes,
            at most ``max_batch_tokens``; the ICQS engine's ``backend`` and ``token_budget``).
        good, bad: the server's demonstrations (None: none).
        settings: the server's ICQS settings, its engine options (``backend``,
            ``token_budget``) included; a request's ``icqs_options`` replace some of them.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 admission: Admission, dispatcher: Dispatcher,
                 config: ServeConfig, *, good: Sequence | None = None,
                 bad: Sequence | None = None, settings: ScoringSettings) -> None:
        if (good is None) != (bad is None):
            raise ValueError("give both good and bad demonstrations, or neither")
        self.model, self.tokenizer = model, tokenizer
        self.admission, self.dispatcher = admission, dispatcher
        self.model_name = config.model_name
        # A chunk of records is a worker step's slice beside the live generations' tokens, so
        # it holds at most the step's budget (a record whose work is larger: alone).
        self.chunk_cost = min(int(config.max_batch_tokens), int(config.prefill_budget))
        self.backend = config.backend
        self.good, self.bad = good, bad
        self.settings = settings
        # Without a prefix bank every ICQS row runs its context again (priced so); decided now,
        # on the caller's thread, so that no request's deadline can cut the capability probes.
        self.plain = plain_path(model)
        self._scorer: Any = None
        # Scorers whose work was cut part-way: their caches (calibration rows, bank entries)
        # may hold work that never ran, so no later chunk may use them.
        self._cut: weakref.WeakSet = weakref.WeakSet()
        self._server_demo_tokens: float | None = None
        # The self-check of the server's own pools and settings (run_self_check), whose map
        # gives p_good_calibrated to what the server's kept scorer scores; None: not run.
        self.check: Any = None

    # -- worker-thread work -----------------------------------------------------------------

    def settings_for(self, options: Mapping[str, Any]) -> ScoringSettings:
        """The server's settings with a request's ``icqs_options`` (field names) in place of
        its own; ValueError naming the option's flag, TypeError for an unknown one."""
        return self.settings.replace(**options)

    def new_scorer(self, good: Sequence | None, bad: Sequence | None,
                   options: Mapping[str, Any]) -> Any:
        """The ICQS scorer of a request (its pools, None: the server's; its ``icqs_options``),
        its demonstration prefixes computed (the server's own scorer is built once and
        kept)."""
        from icqs_fast.engine.scorer import ICQSScorer

        settings = self.settings_for(options)
        if good is None and settings == self.settings:
            if self._scorer is None:
                self._scorer = ICQSScorer(self.model, self.tokenizer, self.good, self.bad,
                                          settings)
                if self.check is not None and self.check.ok:
                    self._scorer.self_check = self.check
            scorer = self._scorer
        else:
            scorer = ICQSScorer(self.model, self.tokenizer, self.good if good is None else good,
                                self.bad if bad is None else bad, settings)
        try:
            _ = scorer.prefix_bank  # a property: computing it here keeps it out of the records
        except BaseException:
            self._forget(scorer)
            raise
        return scorer

    def run_self_check(self, **kw: Any) -> Any:
        """The self-check from the server's pools under its own settings
        (:func:`icqs_fast.engine.selfcheck.run_self_check` keywords), run once before serving;
        records scored with the server's pools and settings then carry ``p_good_calibrated``
        (a request's own pools or options: null, a self-check per request costs too much)."""
        from icqs_fast.engine.selfcheck import run_self_check

        if self.good is None or self.bad is None:
            raise ValueError("the self-check needs the server's --good and --bad")
        scorer = self.new_scorer(None, None, {})
        self.check = run_self_check(scorer, self.good, self.bad, **kw)
        if self.check.ok:
            scorer.self_check = self.check
        return self.check

    def _forget(self, scorer: ICQSScorer | None) -> None:
        """``scorer``'s work was cut part-way: no chunk uses it again (the server's kept one is
        rebuilt on its next use)."""
        if scorer is not None:
            self._cut.add(scorer)
            if scorer is self._scorer:
                self._scorer = None

    def score_pair_chunk(self, records: list[dict], offset: int, held: RequestScorer,
                         tie_margin: float) -> list[ScoreItem]:
        """The judgements of one chunk of pairs (``records``: each pair's two, a then b;
        ``offset``: the first pair's index): both outputs in one scoring stream
        (:func:`icqs_fast.engine.pairs.score_pairs`), as ``score --pairs`` judges them."""
        from icqs_fast.engine.pairs import score_pairs

        scorer = held.current(self._cut)  # made again if another request's chunk cut it
        items = [(a["x"], a["y"], b["y"]) for a, b in zip(records[::2], records[1::2],
                                                          strict=True)]
        try:
            judged = [pair_item(r) for r in score_pairs(scorer, items, tie_margin=tie_margin)]
        except BaseException:
            self._forget(scorer)
            raise
        return [ScoreItem(index=offset + i, pair=p) for i, p in enumerate(judged)]

    def score_chunk(self, records: list[dict], offset: int, held: RequestScorer | None,
                    features: list[str] | None) -> list[ScoreItem]:
        """Scores and features of one chunk of records (``offset``: the first one's index;
        ``held``: the request's scorer, None without ICQS)."""
        icqs: list[IcqsScore | None] = [None] * len(records)
        feats: list[dict | None] = [None] * len(records)
        scorer = None
        if held is not None:
            scorer = held.current(self._cut)  # made again if another request's chunk cut it
            try:
                icqs = [icqs_item(res) for res in scorer.score([(r["x"], r["y"])
                                                                for r in records])]
            except BaseException:
                self._forget(scorer)
                raise
        if features:
            from icqs_fast.features.extract import glassbox

            items = [{"instruction": r["x"], "response": r["y"],
                      **({"reference": r["reference"]} if r.get("reference") else {})}
                     for r in records]
            rows = glassbox(self.model, self.tokenizer, items, features=features,
                            backend=self.backend)
            feats = [finite_or_none(dict(row)) for row in rows]
        out = []
        for i, (sc, ft) in enumerate(zip(icqs, feats, strict=True)):
            # Only what was asked for is set (the route leaves unset fields out).
            kw: dict[str, Any] = {}
            if scorer is not None:
                kw["icqs"] = sc
            if features:
                kw["features"] = ft
            out.append(ScoreItem(index=offset + i, **kw))
        return out

    # -- admission (event loop, tokenizing in a thread) ---------------------------------------

    def _demo_tokens(self, pool: Sequence, name: str) -> tuple[int, float]:
        """Tokens of a demonstration pool (each pair within the per-prompt limit): the total
        and the mean per demonstration."""
        enc = self.admission.encode([s for pair in pool for s in pair], name)
        total = 0
        for i in range(len(pool)):
            n = len(enc[2 * i]) + len(enc[2 * i + 1])
            self.admission.prompt(n, f"{name}[{i}]")
            total += n
        return total, total / max(1, len(pool))

    def _tokens(self, records: list[dict], good: list | None, bad: list | None,
                want_icqs: bool) -> tuple[list[int], int, float]:
        """Tokens of each record (query, response, reference; each within the per-record
        limit), the tokens the request holds (records and its demonstrations) and the mean
        tokens of a demonstration of the pools it is scored with (0 without ICQS)."""
        adm = self.admission
        texts = [r[k] or "" for r in records for k in ("x", "y", "reference")]
        enc = adm.encode(texts, "records")
        rec_tokens = [sum(len(ids) for ids in enc[3 * i: 3 * i + 3])
                      for i in range(len(records))]
        for i, n in enumerate(rec_tokens):
            adm.prompt(n, f"records[{i}]")
        held = sum(rec_tokens)
        demo_mean = 0.0
        if good is not None and bad is not None:
            (tg, mg), (tb, mb) = self._demo_tokens(good, "good"), self._demo_tokens(bad, "bad")
            held += tg + tb
            demo_mean = max(mg, mb)
        elif want_icqs and self.good is not None and self.bad is not None:
            if self._server_demo_tokens is None:  # the server's pools: once
                self._server_demo_tokens = max(self._demo_tokens(self.good, "--good")[1],
                                               self._demo_tokens(self.bad, "--bad")[1])
            demo_mean = self._server_demo_tokens
        return rec_tokens, held, demo_mean

    # -- the route ----------------------------------------------------------------------------

    async def __call__(self, req: ScoreRequest, request: Request | None = None
                       ) -> ScoreResponse:
        """Checks, limits and the price, then the records in chunks of work."""
        from icqs_fast.engine.calibration import calibration_queries
        from icqs_fast.features.names import ALL_FEATURES

        adm = self.admission
        adm.model(req.model)
        if (req.records is None) == (req.pairs is None):
            raise APIError(400, "send 'records' or 'pairs' (one of them)", "invalid_request",
                           param="records")
        if req.pairs is not None:
            if req.features or req.icqs is False:
                raise APIError(400, "'pairs' are judged with ICQS: leave out 'features' and "
                               "'icqs' (send 'records' for features)", "invalid_request",
                               param="features" if req.features else "icqs")
            adm.count(2 * len(req.pairs), "records")
            records = [r for i, p in enumerate(req.pairs) for r in _pair_records(i, p)]
        else:
            if req.tie_margin is not None:
                raise APIError(400, "'tie_margin' is for 'pairs'", "invalid_request",
                               param="tie_margin")
            adm.count(len(req.records), "records")
            records = [_record(i, r) for i, r in enumerate(req.records)]
        step = 2 if req.pairs is not None else 1  # a pair's two records share a chunk
        feats: list[str] | None
        if req.features is True:
            feats = list(ALL_FEATURES)
        elif not req.features:
            feats = None
        else:
            feats = list(dict.fromkeys(req.features))
        if (req.good is None) != (req.bad is None):
            raise APIError(400, "send both 'good' and 'bad' demonstrations, or neither",
                           "invalid_request", param="good" if req.bad is None else "bad")
        good = bad = None
        if req.good is not None and req.bad is not None:
            good, bad = _pool(req.good), _pool(req.bad)
        want_icqs = req.icqs if req.icqs is not None else (good is not None
                                                           or self.good is not None)
        options = req.icqs_options.model_dump(exclude_none=True) if req.icqs_options else {}
        try:  # the engine's own checks, before the request is queued
            settings = self.settings_for(options)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"'icqs_options': {exc}", "invalid_request",
                           param="icqs_options") from None
        if not want_icqs and not feats:
            raise APIError(400, "nothing to compute: ask for 'icqs' and/or 'features'",
                           "invalid_request", param="icqs")
        if want_icqs and good is None and self.good is None:
            raise APIError(400, "no demonstrations: start the server with --good/--bad or send "
                           "'good' and 'bad' in the request", "no_demonstrations", param="good")
        if want_icqs:
            adm.icqs_settings(settings)
        rec_tokens, held, demo_mean = await asyncio.to_thread(self._tokens, records, good, bad,
                                                              want_icqs)
        n_contexts = settings.num_ratios * settings.sets_per_ratio if want_icqs else 0
        rows = n_contexts * (1 + len(calibration_queries(settings)))
        context_tokens = math.ceil(settings.demos_per_set * demo_mean) if want_icqs else 0
        adm.request(held, score_price(rec_tokens, rows, bool(feats), context_tokens,
                                      n_contexts, self.plain), "/v1/score")

        def cost(i: int) -> int:  # one record's token-passes
            return score_price([rec_tokens[i]], rows, bool(feats), context_tokens, 0,
                               self.plain)

        scorer: RequestScorer | None = None
        units: list[Unit] = []
        if want_icqs:  # the demonstration prefixes: once, before the records' chunks
            scorer = RequestScorer(lambda: self.new_scorer(good, bad, options))
            units.append(Unit("call", context_tokens * n_contexts, scorer.build))

        def cost_of(k: int) -> int:  # the k-th item's (a record, or a pair's two)
            return sum(cost(i) for i in range(k * step, (k + 1) * step))

        n_items = len(records) // step
        start = 0
        while start < n_items:
            end, total = start + 1, cost_of(start)
            while end < n_items and total + cost_of(end) <= self.chunk_cost:
                total += cost_of(end)
                end += 1
            if step == 2:
                work = (lambda a=start, b=end: self.score_pair_chunk(
                    records[2 * a:2 * b], a, scorer, req.tie_margin or 0.0))
            else:
                work = (lambda a=start, b=end: self.score_chunk(records[a:b], a, scorer,
                                                                feats))
            units.append(Unit("call", total, work, (end - start) * step))
            start = end
        parts = await self.dispatcher.run(units, len(records), request)
        data = [o for part in parts[1 if want_icqs else 0:] for o in part]
        own = (want_icqs and good is None and settings == self.settings
               and self.check is not None)
        return ScoreResponse(object="list", model=self.model_name, data=data,
                             self_check=self.check.summary_dict() if own else None)


__all__ = ["RequestScorer", "Scoring", "icqs_item", "pair_item", "plain_path"]
