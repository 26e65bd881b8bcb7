"""Streamed ``/v1/completions`` (``stream: true``): server-sent events as OpenAI sends them.

Each event is ``data: {CompletionChunk}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. A
generation without log-probs streams its text as its tokens are chosen: the worker's
:class:`icqs_fast.serve.generation.GreedyGeneration` calls :meth:`TokenFeed.push` per token and
:class:`TextDelta` turns the tokens into text pieces, holding back the text that a stop string
might still remove (the longest tail that begins a stop string) and an incomplete character (a
trailing replacement character). Everything else (echo-only scoring, ``max_tokens=1``, any
request with log-probs) is one chunk per choice once its work is done, made by the same code as
the non-streamed answer, so the concatenated text of a stream always equals the non-streamed
``text``. ``stream_options.include_usage`` adds a last chunk with no choices and the usage.

An error after the response started (a deadline: 504, the server shutting down: 503, an engine
failure: 500) is sent as one ``data: {"error": ...}`` event (what the ``openai`` client raises as
an error) and ends the stream. A client that disconnects cancels the stream (Starlette cancels
the body iterator): its ticket is dropped and its generation stops at its next forward.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from icqs_fast.serve.errors import APIError, error_body
from icqs_fast.serve.generation import GenStep, StopStrings
from icqs_fast.serve.queue import Cancelled

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class TokenFeed:
    """Generated tokens from the worker thread to the event loop, in order.

    Args:
        loop: the event loop of the streaming response.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, GenStep]] = asyncio.Queue()

    def hook(self, index: int) -> Callable[[GenStep], None]:
        """The ``on_step`` callback of choice ``index``'s generation."""
        return lambda step: self.push(index, step)

    def push(self, index: int, step: GenStep) -> None:
        """Called on the worker thread: never blocks."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, step))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def held_back(text: str, stops: StopStrings | None) -> int:
    """How many trailing characters of ``text`` must wait: a tail that begins a stop string (a
    later token may complete it, and then it is cut), or incomplete characters (the decoder
    shows a token that ends mid-character as U+FFFD)."""
    n = len(text) - len(text.rstrip("\ufffd"))
    if stops:
        for s in stops.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    n = max(n, k)
                    break
    return n


class TextDelta:
    """The streamed text of one generated choice.

    Args:
        tokenizer: decodes the generated ids.
        eos_ids: end-of-sequence ids (never part of the text).
        stops: the request's stop strings.
        echo: the echoed prompt (sent before the tokens; "" without echo).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: frozenset[int],
                 stops: StopStrings,
                 echo: str = "") -> None:
        self.echo = echo
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stops = stops if stops else None
        self.ids: list[int] = []
        self.sent = ""  # the text streamed so far

    def add(self, tid: int) -> str:
        """The new text that is safe to send after token ``tid`` (may be empty)."""
        if tid in self.eos_ids:
            return ""
        self.ids.append(tid)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        cut = self.stops.first(text) if self.stops else None
        safe = text[:cut] if cut is not None else text[:len(text) - held_back(text, self.stops)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        piece, self.sent = safe[len(self.sent):], safe
        return piece

    def rest(self, final: str) -> str:
        """What is left to send of the choice's final generated text ``final``."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


async def stream_events(ticket: Any, waiter: asyncio.Task, feed: TokenFeed | None,
                        deltas: list[TextDelta | None], head: dict,
                        finish: Callable[[Any], tuple[list[dict], dict | None]],
                        cancel: Callable[[Any], None]) -> AsyncIterator[bytes]:
    """The events of one streamed request.

    Args:
        ticket: the request's queue ticket.
        waiter: the task that awaits the ticket's result (the dispatcher's: deadline and error
            mapping included).
        feed: the generated tokens (None: nothing streams token by token).
        deltas: per choice, its :class:`TextDelta` (None: the choice comes whole at the end).
        head: ``id`` / ``object`` / ``created`` / ``model`` of every chunk.
        finish: the ticket's result -> the last piece of each choice (dicts of
            :class:`icqs_fast.serve.schemas.CompletionStreamChoice`) and the usage chunk's
            usage (None: no usage chunk).
        cancel: drops the ticket (called when the stream ends before its work did).
    """
    try:
        for index, delta in enumerate(deltas):
            if delta is not None and delta.echo:
                yield sse({**head, "choices": [{"index": index, "text": delta.echo,
                                                "logprobs": None, "finish_reason": None}]})
        if feed is not None:
            while True:
                get = asyncio.ensure_future(feed.queue.get())
                done, _ = await asyncio.wait({get, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break
                index, step = get.result()
                delta = deltas[index]
                piece = delta.add(step[0]) if delta is not None else ""
                if piece:
                    yield sse({**head, "choices": [{"index": index, "text": piece,
                                                    "logprobs": None,
                                                    "finish_reason": None}]})
            while not feed.queue.empty():  # tokens pushed before the ticket was answered
                index, step = feed.queue.get_nowait()
                delta = deltas[index]
                piece = delta.add(step[0]) if delta is not None else ""
                if piece:
                    yield sse({**head, "choices": [{"index": index, "text": piece,
                                                    "logprobs": None,
                                                    "finish_reason": None}]})
        try:
            result = await waiter
        except APIError as exc:
            yield sse(error_body(exc.status, exc.message, exc.code, exc.param))
            return
        pieces, usage = finish(result)
        for piece in pieces:
            yield sse({**head, "choices": [piece]})
        if usage is not None:
            yield sse({**head, "choices": [], "usage": usage})
        yield DONE
    finally:
        if not waiter.done():
            waiter.cancel()
            cancel(Cancelled("the client disconnected"))


__all__ = ["DONE", "TextDelta", "TokenFeed", "held_back", "sse", "stream_events"]
