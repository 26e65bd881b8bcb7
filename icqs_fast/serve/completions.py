"""``POST /v1/completions``: OpenAI legacy completions for scoring, and greedy generation.

``echo=True, max_tokens=0, logprobs=N`` gives every prompt token's log-prob and the top-N
alternatives (``choices[].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``, the
first position ``null``), in chunks of log-prob work batched with other requests'.
``max_tokens=1`` (what lm-eval's ``local-completions`` sends) appends the greedy next token, with
its log-prob, from the same batched pass; ``max_tokens > 1`` (or a ``logit_bias``) generates
greedily a token per step of the worker (:mod:`icqs_fast.serve.generation`), so other requests
are served between tokens and a generation whose request ended stops at the next token.
``stop`` strings are honoured; sampling (``temperature > 0``) is refused with 400.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from icqs_fast.serve.admission import Admission, completion_price
from icqs_fast.serve.dispatch import Dispatcher
from icqs_fast.serve.errors import APIError
from icqs_fast.serve.generation import (
    GenerationOptions,
    GenStep,
    GreedyGeneration,
    StopStrings,
)
from icqs_fast.serve.queue import Unit, chunk_prompts
from icqs_fast.serve.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from icqs_fast.serve.streaming import TextDelta, TokenFeed, stream_events

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# What a -inf log-prob is sent as (JSON has no infinity; vLLM sends the same).
NEG_INF_LOGPROB = -9999.0


def finite(x: float) -> float:
    """``x``, or :data:`NEG_INF_LOGPROB` when it is not finite."""
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def text_offsets(tokenizer: PreTrainedTokenizerBase, text: str, toks: list[str]) -> list[int]:
    """Start character of each token of ``text`` (the fast tokenizer's offsets; else the
    running length of the token texts)."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        offs = [int(a) for a, _ in enc["offset_mapping"]]
        if len(offs) == len(toks):
            return offs
    except (NotImplementedError, TypeError, ValueError, KeyError):
        pass
    out, pos = [], 0
    for s in toks:
        out.append(pos)
        pos += len(s)
    return out


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The token ids that end a generation: the tokenizer's EOS and the model's generation
    config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple, set)) else [gen_eos])
    return frozenset(int(t) for t in ids if isinstance(t, int))


class Completions:
    """The ``/v1/completions`` handler of one server.

    Args:
        model, tokenizer: the served model.
        admission: the server's limits.
        dispatcher: puts the request's work on the queue and waits for it.
        model_name: the served model id.
        max_batch_tokens: the chunk of log-prob work (tokens).
        prefill_budget: most prompt tokens per forward of a generation (a longer prompt is
            prefilled in chunks over several worker steps); None: the whole prompt at once.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 admission: Admission, dispatcher: Dispatcher,
                 model_name: str, max_batch_tokens: int,
                 prefill_budget: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.admission = admission
        self.dispatcher = dispatcher
        self.model_name = model_name
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefill_budget = prefill_budget
        self.eos_ids = eos_ids(model, tokenizer)
        self._token_text: dict[int, str] = {}
        self._text_lock = threading.Lock()

    def token_text(self, tid: int) -> str:
        """The text of one token id (cached)."""
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            with self._text_lock:
                self._token_text[tid] = s
        return s

    # -- checks -----------------------------------------------------------------------------

    @staticmethod
    def refuse_unsupported(req: CompletionRequest, max_tokens: int) -> None:
        """OpenAI fields we accept only at their neutral value: 400 naming the field."""
        refusals = (("stream_options", req.stream_options is not None and not req.stream,
                     "'stream_options' is allowed only with stream=true"),
                    ("suffix", bool(req.suffix), "'suffix' is not supported"),
                    ("n", req.n not in (None, 1), "'n' must be 1 (one choice per prompt)"),
                    ("best_of", req.best_of not in (None, 1), "'best_of' must be 1"),
                    ("presence_penalty", req.presence_penalty not in (None, 0),
                     "'presence_penalty' is not supported (must be 0)"),
                    ("frequency_penalty", req.frequency_penalty not in (None, 0),
                     "'frequency_penalty' is not supported (must be 0)"),
                    ("temperature", max_tokens > 0 and req.temperature not in (None, 0),
                     f"temperature={req.temperature}: sampling is not supported; generation "
                     "is greedy (temperature 0)"))
        for field, refused, why in refusals:
            if refused:
                code = "sampling_not_supported" if field == "temperature" else "unsupported"
                raise APIError(400, why, code, param=field)

    def prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """``(token ids, text or None)`` of each prompt (a string, a list of strings, a list of
        token ids or a list of token-id lists; the types are checked by the schema), each
        within the per-prompt limit."""
        adm = self.admission
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items: list = [prompt]
        else:
            items = list(prompt)
        adm.count(len(items), "prompts")
        texts = [p for p in items if isinstance(p, str)]
        encoded = iter(adm.encode(texts, "prompt"))
        out = []
        for i, p in enumerate(items):
            if isinstance(p, str):
                ids, text = next(encoded), p
            else:
                ids, text = [int(t) for t in p], None
                bad = [t for t in ids if not 0 <= t < adm.vocab]
                if bad:
                    raise APIError(400, f"prompt {i}: token id {bad[0]} is outside the "
                                   f"vocabulary [0, {adm.vocab})", "invalid_prompt",
                                   param="prompt")
            if not ids:
                raise APIError(400, f"prompt {i} is empty (no tokens)", "invalid_prompt",
                               param="prompt")
            adm.prompt(len(ids), f"prompt {i}")
            out.append((ids, text))
        return out

    # -- the route --------------------------------------------------------------------------

    async def __call__(self, req: CompletionRequest, request: Request | None = None
                       ) -> CompletionResponse | StreamingResponse:
        """Checks and limits, then the queued work, then the answer (with ``stream``: the
        server-sent events of :mod:`icqs_fast.serve.streaming`, once the request is
        admitted)."""
        adm = self.admission
        adm.model(req.model)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self.refuse_unsupported(req, max_tokens)
        adm.max_tokens(max_tokens)
        n_lp = req.logprobs
        adm.logprobs(n_lp)
        stop = adm.stop(req.stop)
        bias = adm.logit_bias(req.logit_bias)
        # Tokenizing a long body takes a while: off the event loop.
        prompts = await asyncio.to_thread(self.prompts, req.prompt)
        positions = adm.max_positions
        if positions and max_tokens > 1:
            longest = max(len(p) for p, _ in prompts)
            if longest + max_tokens > positions:
                raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) is "
                               f"over the model's {positions} positions",
                               "context_length_exceeded", param="max_tokens")
        top_n = int(n_lp or 0)
        ids_list = [p for p, _ in prompts]
        # The batched pass gives the greedy next token too, but not a biased one: with a
        # logit_bias, max_tokens=1 generates like max_tokens > 1.
        batched_next = max_tokens == 1 and not bias
        scored = bool(req.echo or batched_next)
        generate = max_tokens > 0 and not batched_next
        lengths = [len(p) for p in ids_list]
        adm.request(sum(lengths), completion_price(lengths, scored,
                                                   max_tokens if generate else 0),
                    "/v1/completions")
        units: list[Unit] = []
        if scored:
            units += [Unit("logprobs", sum(len(p) for p in ch), (ch, top_n), len(ch))
                      for ch in chunk_prompts(ids_list, self.max_batch_tokens)]
        n_lp_units = len(units)
        stops = StopStrings(stop)
        # Streamed token by token: a generation without log-probs (the rest comes whole).
        feed = TokenFeed(asyncio.get_running_loop()) if (req.stream and generate
                                                         and n_lp is None) else None
        if generate:
            options = GenerationOptions(max_tokens, top_n, stops, bias, self.eos_ids,
                                        prefill_chunk=self.prefill_budget)

            def generation(ids: list[int], i: int) -> GreedyGeneration:
                gen = GreedyGeneration(self.model, self.tokenizer, ids, options)
                gen.on_step = feed.hook(i) if feed is not None else None
                return gen

            units += [Unit("steps", len(ids) + max_tokens,
                           lambda ids=ids, i=i: generation(ids, i))
                      for i, ids in enumerate(ids_list)]
        shape = ChoiceShape(req.echo, max_tokens, n_lp, stops)
        if req.stream:
            return self.stream(req, prompts, units, (n_lp_units, batched_next, generate),
                               shape, feed)
        parts = await self.dispatcher.run(units, len(prompts), request) if units else []
        return self.response(prompts, parts, (n_lp_units, batched_next, generate), shape)

    def _choices(self, prompts: list[tuple[list[int], str | None]], parts: list,
                 kinds: tuple[int, bool, bool], shape: ChoiceShape
                 ) -> tuple[list[CompletionChoice], Usage]:
        """The choices and usage from the queue's results ``parts`` (``kinds``: the number of
        log-prob units, whether the next token came from the batched pass, whether the request
        generates)."""
        n_lp_units, batched_next, generate = kinds
        results: list = [None] * len(prompts)
        gens: list[list[GenStep]] = [[] for _ in prompts]
        if parts:
            if n_lp_units:
                results = [r for part in parts[:n_lp_units] for r in part]
            if batched_next:
                gens = [[(r.next_token, r.next_logprob, r.next_top)] for r in results]
            elif generate:
                gens = list(parts[n_lp_units:])
        choices = []
        n_prompt = n_gen = 0
        for i, ((ids, text), res, gen) in enumerate(zip(prompts, results, gens, strict=True)):
            n_prompt += len(ids)
            choices.append(self.choice(i, (ids, text), res, gen, shape))
            n_gen += len(gen)
        return choices, Usage(prompt_tokens=n_prompt, completion_tokens=n_gen,
                              total_tokens=n_prompt + n_gen)

    def response(self, prompts: list[tuple[list[int], str | None]], parts: list,
                 kinds: tuple[int, bool, bool], shape: ChoiceShape) -> CompletionResponse:
        """The non-streamed answer."""
        choices, usage = self._choices(prompts, parts, kinds, shape)
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
            model=self.model_name, choices=choices, usage=usage)

    def stream(self, req: CompletionRequest, prompts: list[tuple[list[int], str | None]],
               units: list[Unit], kinds: tuple[int, bool, bool], shape: ChoiceShape,
               feed: TokenFeed | None) -> StreamingResponse:
        """The streamed answer: the ticket is submitted now (a full queue or a shutdown is
        still a plain 429 / 503), the events follow as its work runs."""
        ticket = self.dispatcher.submit(units, len(prompts)) if units else None
        waiter = asyncio.ensure_future(self.dispatcher.wait(ticket, None) if ticket is not None
                                       else _nothing())
        # The echoed prompt is the choice's text before its tokens: sent first.
        deltas: list[TextDelta | None] = [
            TextDelta(self.tokenizer, self.eos_ids, shape.stops,
                      echo=(text if text is not None else
                            "".join(self.token_text(t) for t in ids)) if req.echo else "")
            if feed is not None else None for ids, text in prompts]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def finish(parts: list) -> tuple[list[dict], dict | None]:
            choices, usage = self._choices(prompts, parts, kinds, shape)
            pieces = []
            for c, delta in zip(choices, deltas, strict=True):
                d = c.model_dump()
                if delta is not None:
                    d["text"] = delta.rest(c.text[len(delta.echo):])
                pieces.append(d)
            return pieces, (usage.model_dump() if include_usage else None)

        def cancel(exc: BaseException) -> None:
            if ticket is not None:
                self.dispatcher.queue.cancel(ticket, exc)

        return StreamingResponse(stream_events(ticket, waiter, feed, deltas, head, finish,
                                               cancel),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # -- the answer -------------------------------------------------------------------------

    def _top(self, pairs: list[tuple[int, float]], n: int, chosen: int, chosen_lp: float
             ) -> dict[str, float]:
        d: dict[str, float] = {}
        for tid, lp in pairs[:n]:
            d.setdefault(self.token_text(tid), finite(lp))
        d.setdefault(self.token_text(chosen), finite(chosen_lp))  # as vLLM: the chosen token too
        return d

    def choice(self, i: int, prompt: tuple[list[int], str | None], res: Any,
               gen: list[GenStep], shape: ChoiceShape) -> CompletionChoice:
        """One prompt's choice (``prompt``: its ids and text, None for a prompt given as ids):
        the echoed prompt (with its log-probs) and the generated text, cut before the first
        stop string."""
        ids, text = prompt
        echo, max_tokens, n_lp, stops = shape.echo, shape.max_tokens, shape.n_lp, shape.stops
        toks: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        out_text = ""
        if echo:
            toks = [self.token_text(t) for t in ids]
            if text is None:
                text = "".join(toks)
                pos = 0
                for s in toks:
                    offsets.append(pos)
                    pos += len(s)
            else:
                offsets = text_offsets(self.tokenizer, text, toks)
            out_text = text
            if n_lp is not None:
                lps = [None, *map(finite, res.token_logprobs)]
                tops = [None] + [self._top(pairs, n_lp, t, lp) for pairs, t, lp in
                                 zip(res.top, ids[1:], res.token_logprobs, strict=True)]
        finish = "length" if len(gen) >= max_tokens else "stop"
        new_ids = [tid for tid, _, _ in gen if tid not in self.eos_ids]
        new_text = self.tokenizer.decode(new_ids, skip_special_tokens=False) if new_ids else ""
        if gen and gen[-1][0] in self.eos_ids:
            finish = "stop"
        cut = stops.first(new_text) if stops else None
        if cut is not None:
            finish, new_text = "stop", new_text[:cut]
        base = len(out_text)
        pos = 0
        for tid, lp, top in gen:
            if cut is not None and pos >= len(new_text):
                break  # the stop string's tokens (and any after) are not returned
            offsets.append(base + pos)
            piece = self.token_text(tid)
            pos += len(piece) if tid not in self.eos_ids else 0
            toks.append(piece)
            if n_lp is not None:
                lps.append(finite(lp))
                tops.append(self._top(top, n_lp, tid, lp))
        out_text += new_text
        logprobs = None
        if n_lp is not None:
            logprobs = CompletionLogprobs(tokens=toks, token_logprobs=lps, top_logprobs=tops,
                                          text_offset=offsets)
        return CompletionChoice(index=i, text=out_text, logprobs=logprobs,
                                finish_reason=finish)


async def _nothing() -> list:
    """The result of a request with no queued work."""
    return []


@dataclass(frozen=True)
class ChoiceShape:
    """What a request asks of each of its choices: echo the prompt, at most ``max_tokens``
    new tokens, ``n_lp`` top log-probs per token (None: no log-probs), the stop strings."""

    echo: bool
    max_tokens: int
    n_lp: int | None
    stops: StopStrings


__all__ = ["NEG_INF_LOGPROB", "Completions", "eos_ids", "finite", "text_offsets"]
