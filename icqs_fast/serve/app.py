"""The FastAPI application of ``icqs-fast serve``.

Routes (all behind the bearer-token check when the server has an API key; request and response
bodies typed in :mod:`icqs_fast.serve.schemas`, the schema at ``GET /openapi.json``):

* ``GET /v1/models``: the one served model.
* ``POST /v1/completions``: OpenAI legacy completions for scoring: ``echo=True, max_tokens=0,
  logprobs=N`` gives every prompt token's log-prob and the top-N alternatives
  (``choices[].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``, the first
  position ``null``). ``max_tokens=1`` (what lm-eval's ``local-completions`` sends) appends the
  greedy next token, with its log-prob, from the same batched pass; ``max_tokens > 1`` generates
  greedily with ``model.generate`` (one prompt per unit of work: correct, not accelerated;
  ``stop`` strings honoured). ``logit_bias`` biases the choice of generated tokens. Sampling
  (``temperature > 0``) is refused with 400.
* ``POST /v1/score``: ICQS scores (good / bad demonstrations given at server start or in the
  request) and glass-box features of posted records.
* ``GET /health``: liveness and queue counters; ``GET /metrics``: Prometheus metrics.

Every limit is checked before a request is queued, in tokens: per prompt / record
(``--max-prompt-tokens``, 400) and per request (``--max-request-tokens``, 413), besides the
body size (``--max-body-bytes``, 413) and the prompts per request (``--max-prompts``). Queued
work is cut into chunks of about ``--max-batch-tokens`` tokens served round-robin
(:mod:`icqs_fast.serve.queue`); a request still unanswered after ``--request-timeout`` seconds
gets 504 and its remaining chunks are dropped, as are those of a client that disconnects.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
request (an unknown or unsupported field names itself in ``param``), 401 for a missing or wrong
key, 404 for an unknown model or route, 413 for a body or request over its limit, 429 when the
queue is full, 504 past the deadline; a failure inside the engine is a 500 with its message and
never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from icqs_fast.serve.config import ServeConfig
from icqs_fast.serve.logprobs import prompt_logprobs
from icqs_fast.serve.metrics import ServeMetrics
from icqs_fast.serve.queue import (
    Cancelled,
    DeadlineExceeded,
    QueueFull,
    Ticket,
    Unit,
    WorkQueue,
    chunk_prompts,
)
from icqs_fast.serve.schemas import (
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
    ScoreRequest,
    ScoreResponse,
)

# /v1/score's "icqs_options" (issue 17: calibration and the score kind as strings).
ICQS_OPTIONS = ("num_ratios", "demos_per_set", "sets_per_ratio", "seed", "calibration", "score",
                "tie_epsilon")
# What a client that went away is logged with (nginx's "client closed request"; never sent).
CLIENT_CLOSED = 499
ROUTES = ("/v1/models", "/v1/completions", "/v1/score", "/health", "/metrics", "/openapi.json")
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for logit_bias values


class APIError(Exception):
    """A request's error: its status, message, code and (optionally) the field it names."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers
        self.param = param


_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "server_error", 504: "timeout_error", CLIENT_CLOSED: "client_closed"}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "error"),
                      "param": param, "code": code}}


# Documented on every route of the schema (a fuzzer checks each answer's status against it).
_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse, "description": d} for s, d in (
        (400, "bad request (the field in error.param)"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "body or request over its limit"),
        (429, "queue full; retry after Retry-After seconds"), (500, "engine failure"),
        (503, "shutting down"), (504, "deadline (--request-timeout) passed"))}


# --------------------------------------------------------------------------- ASGI guard


class _TooLarge(APIError):
    """A chunked body grew past the limit while it was read (the app answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes "
                         "(--max-body-bytes)", "body_too_large")


class Guard:
    """Pure ASGI middleware: the bearer token on every HTTP route, the body-size limit (by
    ``Content-Length`` before reading, and by counting a chunked body while it arrives), and
    the request metrics (route, status, latency) of every answer, refusals included."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 metrics: ServeMetrics | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = int(max_body_bytes)
        self.metrics = metrics

    async def _send_error(self, send: Any, status: int, message: str, code: str,
                          extra: list | None = None) -> None:
        if self.metrics is not None:
            self.metrics.reject(code)
        body = json.dumps(error_body(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = CLIENT_CLOSED  # unless a response starts

        async def tracking_send(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        try:
            await self._guarded(scope, receive, tracking_send)
        finally:
            if self.metrics is not None:
                self.metrics.observe(scope.get("path", ""), status, time.perf_counter() - t0)

    async def _guarded(self, scope: dict, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        if self.key is not None:
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + self.key):
                await self._send_error(send, 401, "missing or invalid API key: send "
                                       "'Authorization: Bearer <key>'", "invalid_api_key",
                                       [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                await self._send_error(send, 400, "bad Content-Length", "bad_request")
                return
            if too_big:
                await self._send_error(send, 413, f"request body of {int(length)} bytes is over "
                                       f"the limit of {self.max_body} (--max-body-bytes)",
                                       "body_too_large")
                return
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge(self.max_body)
            return msg

        async def started_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, started_send)
        except _TooLarge as exc:
            if not started:
                await self._send_error(send, 413, exc.message, exc.code or "body_too_large")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is
    the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# --------------------------------------------------------------------------- the server


class Server:
    """The model, its tokenizer, the work queue, the metrics and the ICQS scorer built from the
    server's demonstrations (if any); :meth:`app` is the ASGI application."""

    def __init__(self, model: Any, tokenizer: Any, config: ServeConfig | None = None, *,
                 good: Sequence | None = None, bad: Sequence | None = None,
                 icqs_options: dict | None = None) -> None:
        from icqs_fast.engine.checks import model_max_length

        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or ServeConfig()
        if cfg.max_prompts > cfg.max_queue:
            raise ValueError(f"max_prompts ({cfg.max_prompts}) must not exceed max_queue "
                             f"({cfg.max_queue}): such a request could never be admitted")
        lim = model_max_length(model, None)
        self.max_prompt_tokens = min(cfg.max_prompt_tokens, lim) if lim else cfg.max_prompt_tokens
        self.max_positions = lim
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab else 0
        if (good is None) != (bad is None):
            raise ValueError("give both good and bad demonstrations, or neither")
        self.good, self.bad = good, bad
        self.icqs_options = dict(icqs_options or {})
        self._scorer: Any = None
        self._token_text: dict[int, str] = {}
        self._text_lock = threading.Lock()
        self.queue = WorkQueue(self._run_logprobs, max_pending=cfg.max_queue,
                               batch_wait_s=cfg.batch_wait_ms / 1000.0,
                               chunk_tokens=cfg.max_batch_tokens)
        self.metrics = ServeMetrics(self.queue, ROUTES)
        self.started = time.time()

    # -- worker-thread work -------------------------------------------------------------

    def _run_logprobs(self, prompts: list[list[int]], top_n: int) -> list:
        return prompt_logprobs(self.model, prompts, top_n=top_n, pad_id=self.pad_id,
                               token_budget=self.config.token_budget)

    @torch.no_grad()
    def _generate(self, ids: list[int], max_new: int, top_n: int, stop: list[str] | None,
                  bias: dict[int, float] | None = None) -> list[tuple[int, float, list]]:
        """The greedy continuation of one prompt (``model.generate``): ``(token id, log-prob,
        top-N pairs)`` of each new token, EOS included. ``bias`` (token id -> logit bias) is
        added to the logits that choose each token, and the log-probs are of that biased
        distribution."""
        from transformers import LogitsProcessor, LogitsProcessorList

        dev = next(self.model.parameters()).device
        bias_vec = None
        kw: dict[str, Any] = {"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}
        if bias:
            bias_vec = torch.zeros(self.vocab, dtype=torch.float32, device=dev)
            for tid, b in bias.items():
                bias_vec[tid] = b

            class _Bias(LogitsProcessor):
                def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor
                             ) -> torch.Tensor:
                    return scores + bias_vec[: scores.shape[-1]].to(scores.dtype)

            kw["logits_processor"] = LogitsProcessorList([_Bias()])
        inp = torch.tensor([ids], dtype=torch.long, device=dev)
        gen = self.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                                  max_new_tokens=max_new, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=self.pad_id, **kw)
        new = gen.sequences[0, len(ids):].tolist()
        steps = []
        for tid, logits in zip(new, gen.logits, strict=False):
            row = logits[0].float()  # the raw logits: the bias is added here, as generate did
            if bias_vec is not None:
                row = row + bias_vec[: row.shape[-1]]
            lp = torch.log_softmax(row, dim=-1)
            top = []
            if top_n > 0:
                tv, ti = lp.topk(min(top_n, lp.shape[-1]))
                top = list(zip(ti.tolist(), tv.tolist(), strict=True))
            steps.append((int(tid), float(lp[tid]), top))
            if tid == self.tokenizer.eos_token_id:
                break
        return steps

    def _new_scorer(self, good: Sequence | None, bad: Sequence | None, options: dict) -> Any:
        """The ICQS scorer of a request, its demonstration prefixes computed (the server's own
        scorer is built once and kept)."""
        from icqs_fast.engine.scorer import ICQSScorer

        if good is None:
            if not options or options == self.icqs_options:
                if self._scorer is None:
                    self._scorer = ICQSScorer(self.model, self.tokenizer, self.good, self.bad,
                                              backend=self.config.backend, **self.icqs_options)
                scorer = self._scorer
            else:
                scorer = ICQSScorer(self.model, self.tokenizer, self.good, self.bad,
                                    backend=self.config.backend, **options)
        else:
            scorer = ICQSScorer(self.model, self.tokenizer, good, bad,
                                backend=self.config.backend, **{**self.icqs_options, **options})
        _ = scorer.prefix_bank  # a property: computing it here keeps it out of the records' chunks
        return scorer

    def _score(self, records: list[dict], offset: int, scorer: Any,
               features: list[str] | None) -> list[dict]:
        """Scores and features of one chunk of records (``offset``: the first one's index)."""
        out: list[dict] = [{"index": offset + i} for i in range(len(records))]
        if scorer is not None:
            pairs = [(r["x"], r["y"]) for r in records]
            for o, res in zip(out, scorer.score(pairs), strict=True):
                o["icqs"] = {"score": res.score, "score_per_set": res.score_per_set,
                             "loglik": res.loglik.tolist(), "ratios": res.ratios,
                             "n_response_tokens": res.n_response_tokens,
                             "margin": res.margin, "margins": res.margins,
                             "near_ties": res.near_ties, "slope": res.slope,
                             "p_good": res.p_good}
                if res.loglik_baseline is not None:  # calibrated: the raw loglik stays
                    o["icqs"]["loglik_baseline"] = res.loglik_baseline.tolist()
        if features:
            from icqs_fast.features.extract import glassbox

            items = [{"instruction": r["x"], "response": r["y"],
                      **({"reference": r["reference"]} if r.get("reference") else {})}
                     for r in records]
            rows = glassbox(self.model, self.tokenizer, items, features=features,
                            backend=self.config.backend)
            for o, row in zip(out, rows, strict=True):
                o["features"] = dict(row)
        return out

    # -- request handling (event loop) ----------------------------------------------------

    def token_text(self, tid: int) -> str:
        """The text of one token id (cached)."""
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            with self._text_lock:
                self._token_text[tid] = s
        return s

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                           f"{self.config.model_name!r}", "model_not_found", param="model")

    def _encode(self, texts: list[str], what: str) -> list[list[int]]:
        """Token ids of user texts; a tokenizer failure is the request's 400, not a 500."""
        if not texts:
            return []
        try:
            return [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        except Exception as exc:  # noqa: BLE001 (any tokenizer error on user input)
            raise APIError(400, f"{what}: the tokenizer cannot encode it "
                           f"({type(exc).__name__})", "invalid_text", param=what) from None

    def _limit_prompt(self, n: int, what: str) -> None:
        if n > self.max_prompt_tokens:
            why = (f"--max-prompt-tokens {self.config.max_prompt_tokens}"
                   if self.max_prompt_tokens == self.config.max_prompt_tokens
                   else f"the model's {self.max_positions} positions")
            raise APIError(400, f"{what} has {n} tokens, more than the limit of "
                           f"{self.max_prompt_tokens} ({why}; raise it with "
                           "--max-prompt-tokens)", "context_length_exceeded", param=what)

    def _limit_request(self, total: int, route: str) -> None:
        if total > self.config.max_request_tokens:
            raise APIError(413, f"the request holds {total} tokens, more than the limit of "
                           f"{self.config.max_request_tokens} per request (raise it with "
                           "--max-request-tokens, or split the request)", "request_too_large")
        self.metrics.prompt_tokens.labels(route).inc(total)

    def _limit_count(self, n: int, what: str) -> None:
        if n > self.config.max_prompts:
            raise APIError(400, f"{n} {what} in one request; at most {self.config.max_prompts} "
                           "(--max-prompts)", f"too_many_{what}", param=what)

    def _prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """``(token ids, text or None)`` of each prompt (a string, a list of strings, a list of
        token ids or a list of token-id lists; the types are checked by the schema), each
        within the per-prompt limit and all within the per-request limit."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items: list = [prompt]
        else:
            items = list(prompt)
        self._limit_count(len(items), "prompts")
        texts = [p for p in items if isinstance(p, str)]
        encoded = iter(self._encode(texts, "prompt"))
        out = []
        for i, p in enumerate(items):
            if isinstance(p, str):
                ids, text = next(encoded), p
            else:
                ids, text = [int(t) for t in p], None
                bad = [t for t in ids if not 0 <= t < self.vocab]
                if bad:
                    raise APIError(400, f"prompt {i}: token id {bad[0]} is outside the "
                                   f"vocabulary [0, {self.vocab})", "invalid_prompt",
                                   param="prompt")
            if not ids:
                raise APIError(400, f"prompt {i} is empty (no tokens)", "invalid_prompt",
                               param="prompt")
            self._limit_prompt(len(ids), f"prompt {i}")
            out.append((ids, text))
        self._limit_request(sum(len(ids) for ids, _ in out), "/v1/completions")
        return out

    async def _wait(self, ticket: Ticket, request: Request | None) -> Any:
        """The ticket's result; 504 at its deadline and a dropped ticket when the client goes
        away (its remaining work never runs)."""
        fut = asyncio.wrap_future(ticket.future)
        # A ticket failed by cancel() after we stopped waiting: its exception is expected.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        waits: set[asyncio.Future] = {fut}
        gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
        if gone is not None:
            waits.add(gone)
        timeout = None if ticket.deadline is None else max(0.0, ticket.deadline
                                                           - time.monotonic())
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone.cancel()
        if fut not in done:
            if gone is not None and gone in done:
                self.queue.cancel(ticket, Cancelled("the client disconnected"))
                raise APIError(CLIENT_CLOSED, "the client disconnected", "client_disconnected")
            self.queue.cancel(ticket, DeadlineExceeded("deadline"))
        try:
            return fut.result() if fut.done() else await fut
        except DeadlineExceeded:
            raise APIError(504, f"the request was not answered within --request-timeout "
                           f"{self.config.request_timeout:g} s; its remaining work was "
                           "dropped", "deadline_exceeded") from None
        except Cancelled:
            raise APIError(CLIENT_CLOSED, "the client disconnected",
                           "client_disconnected") from None
        except QueueFull as exc:
            raise APIError(503, str(exc), "shutting_down") from None
        except APIError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise APIError(400, str(exc), "invalid_request") from None
        except Exception as exc:  # an engine failure: this request's 500, not the server's end
            raise APIError(500, f"{type(exc).__name__}: {exc}", "internal_error") from None

    def _submit(self, units: list[Unit], size: int) -> Ticket:
        timeout = self.config.request_timeout or None
        try:
            return self.queue.submit(units, size, timeout_s=timeout)
        except QueueFull as exc:
            raise APIError(429, str(exc), "queue_full", {"Retry-After": "1"}) from None

    def _logit_bias(self, raw: dict[str, float] | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, val in (raw or {}).items():
            try:
                tid = int(key)
            except ValueError:
                tid = -1
            if not (key.strip().isdigit() and 0 <= tid < self.vocab):
                raise APIError(400, f"logit_bias: key {key[:20]!r} is not a token id in [0, "
                               f"{self.vocab})", "invalid_request", param="logit_bias")
            if not (math.isfinite(val) and -LOGIT_BIAS_MAX <= val <= LOGIT_BIAS_MAX):
                raise APIError(400, f"logit_bias: the bias of token {tid} must be in "
                               f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]", "invalid_request",
                               param="logit_bias")
            out[tid] = float(val)
        return out

    def _refuse_unsupported(self, req: CompletionRequest, max_tokens: int) -> None:
        """OpenAI fields we accept only at their neutral value: 400 naming the field."""
        refusals = (("stream", bool(req.stream), "streaming is not supported"),
                    ("stream_options", req.stream_options is not None,
                     "streaming is not supported"),
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

    async def completions(self, req: CompletionRequest, request: Request | None = None) -> dict:
        """``/v1/completions``: checks and limits, then the queued work, then the answer."""
        self._check_model(req.model)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self._refuse_unsupported(req, max_tokens)
        if max_tokens > self.config.max_gen_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of "
                           f"{self.config.max_gen_tokens} (--max-gen-tokens; it is built for "
                           "scoring: max_tokens=0, echo=true, logprobs=N)",
                           "max_tokens_too_large", param="max_tokens")
        n_lp = req.logprobs
        if n_lp is not None and n_lp > self.config.max_logprobs:
            raise APIError(400, f"'logprobs' must be an integer in [0, "
                           f"{self.config.max_logprobs}] (--max-logprobs), got {n_lp}",
                           "invalid_request", param="logprobs")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        bias = self._logit_bias(req.logit_bias)
        # Tokenizing a long body takes a while: off the event loop.
        prompts = await asyncio.to_thread(self._prompts, req.prompt)
        if self.max_positions and max_tokens > 1:
            longest = max(len(p) for p, _ in prompts)
            if longest + max_tokens > self.max_positions:
                raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) is "
                               f"over the model's {self.max_positions} positions",
                               "context_length_exceeded", param="max_tokens")
        top_n = int(n_lp or 0)
        ids_list = [p for p, _ in prompts]
        # The batched pass gives the greedy next token too, but not a biased one: with a
        # logit_bias, max_tokens=1 generates like max_tokens > 1.
        batched_next = max_tokens == 1 and not bias
        units: list[Unit] = []
        if req.echo or batched_next:
            units += [Unit("logprobs", sum(len(p) for p in ch), (ch, top_n), len(ch))
                      for ch in chunk_prompts(ids_list, self.config.max_batch_tokens)]
        n_lp_units = len(units)
        if max_tokens > 0 and not batched_next:
            units += [Unit("call", len(ids) + max_tokens,
                           lambda ids=ids: self._generate(ids, max_tokens, top_n, stop, bias))
                      for ids in ids_list]
        results: list = [None] * len(prompts)
        gens: list[list[tuple[int, float, list]]] = [[] for _ in prompts]
        if units:
            parts = await self._wait(self._submit(units, len(prompts)), request)
            if n_lp_units:
                results = [r for part in parts[:n_lp_units] for r in part]
            if batched_next:
                gens = [[(r.next_token, r.next_logprob, r.next_top)] for r in results]
            elif max_tokens > 0:
                gens = list(parts[n_lp_units:])
        choices = []
        n_prompt = n_gen = 0
        for i, ((ids, text), res, gen) in enumerate(zip(prompts, results, gens, strict=True)):
            n_prompt += len(ids)
            choices.append(self._choice(i, ids, text, res, req.echo, gen, max_tokens, n_lp,
                                        stop))
            n_gen += len(gen)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.config.model_name,
                "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                          "total_tokens": n_prompt + n_gen}}

    def _top(self, pairs: list[tuple[int, float]], n: int, chosen: int, chosen_lp: float
             ) -> dict[str, float]:
        d: dict[str, float] = {}
        for tid, lp in pairs[:n]:
            d.setdefault(self.token_text(tid), _finite(lp))
        d.setdefault(self.token_text(chosen), _finite(chosen_lp))  # as vLLM: the chosen token too
        return d

    def _choice(self, i: int, ids: list[int], text: str | None, res: Any, echo: bool,
                gen: list[tuple[int, float, list]], max_tokens: int, n_lp: int | None,
                stop: list[str] | None) -> dict:
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
                offsets = _offsets(self.tokenizer, text, toks)
            out_text = text
            if n_lp is not None:
                lps = [None, *map(_finite, res.token_logprobs)]
                tops = [None] + [self._top(pairs, n_lp, t, lp) for pairs, t, lp in
                                 zip(res.top, ids[1:], res.token_logprobs, strict=True)]
        finish = "length" if len(gen) >= max_tokens else "stop"
        eos = self.tokenizer.eos_token_id
        new_ids = [tid for tid, _, _ in gen if tid != eos]
        new_text = self.tokenizer.decode(new_ids, skip_special_tokens=False) if new_ids else ""
        if gen and gen[-1][0] == eos:
            finish = "stop"
        hits = [new_text.find(s) for s in stop or () if s and s in new_text]
        if hits:
            finish, new_text = "stop", new_text[: min(hits)]
        base = len(out_text)
        pos = 0
        for tid, lp, top in gen:
            if hits and pos >= len(new_text):
                break  # the stop string's tokens (and any after) are not returned
            offsets.append(base + pos)
            piece = self.token_text(tid)
            pos += len(piece) if tid != eos else 0
            toks.append(piece)
            if n_lp is not None:
                lps.append(_finite(lp))
                tops.append(self._top(top, n_lp, tid, lp))
        out_text += new_text
        logprobs = None
        if n_lp is not None:
            logprobs = {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops,
                        "text_offset": offsets}
        return {"index": i, "text": out_text, "logprobs": logprobs, "finish_reason": finish}

    async def score(self, req: ScoreRequest, request: Request | None = None) -> dict:
        """``/v1/score``: checks and limits, then the records in chunks of work."""
        from icqs_fast.engine.settings import ScoringSettings
        from icqs_fast.features.names import ALL_FEATURES

        self._check_model(req.model)
        self._limit_count(len(req.records), "records")
        records = [_record(i, r) for i, r in enumerate(req.records)]
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
            settings = ScoringSettings.build(**{**self.icqs_options, **options})
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"'icqs_options': {exc}", "invalid_request",
                           param="icqs_options") from None
        if not want_icqs and not feats:
            raise APIError(400, "nothing to compute: ask for 'icqs' and/or 'features'",
                           "invalid_request", param="icqs")
        if want_icqs and good is None and self.good is None:
            raise APIError(400, "no demonstrations: start the server with --good/--bad or send "
                           "'good' and 'bad' in the request", "no_demonstrations", param="good")
        rec_tokens = await asyncio.to_thread(self._score_tokens, records, good, bad)
        # A chunk's cost: the record's tokens times the forward passes it takes (one per ICQS
        # demonstration set, one for the features).
        passes = (settings.num_ratios * settings.sets_per_ratio if want_icqs else 0) + \
            (1 if feats else 0)
        held: dict[str, Any] = {}
        units: list[Unit] = []
        if want_icqs:  # the demonstration prefixes: once, before the records' chunks
            units.append(Unit("call", 0, lambda: held.update(
                scorer=self._new_scorer(good, bad, options))))
        start = 0
        while start < len(records):
            end, cost = start + 1, rec_tokens[start] * passes
            while end < len(records) and cost + rec_tokens[end] * passes <= \
                    self.config.max_batch_tokens:
                cost += rec_tokens[end] * passes
                end += 1
            units.append(Unit("call", cost, lambda a=start, b=end: self._score(
                records[a:b], a, held.get("scorer"), feats), end - start))
            start = end
        parts = await self._wait(self._submit(units, len(records)), request)
        data = [o for part in parts[1 if want_icqs else 0:] for o in part]
        return {"object": "list", "model": self.config.model_name, "data": _clean(data)}

    def _score_tokens(self, records: list[dict], good: list | None, bad: list | None
                      ) -> list[int]:
        """Tokens of each record (query, response, reference), each within the per-record
        limit; with the request's demonstrations, all within the per-request limit."""
        texts = [r[k] or "" for r in records for k in ("x", "y", "reference")]
        enc = self._encode(texts, "records")
        rec_tokens = [sum(len(ids) for ids in enc[3 * i: 3 * i + 3])
                      for i in range(len(records))]
        for i, n in enumerate(rec_tokens):
            self._limit_prompt(n, f"records[{i}]")
        demo_total = 0
        for name, pool in (("good", good), ("bad", bad)):
            if pool:
                enc = self._encode([s for pair in pool for s in pair], name)
                for i in range(len(pool)):
                    n = len(enc[2 * i]) + len(enc[2 * i + 1])
                    self._limit_prompt(n, f"{name}[{i}]")
                    demo_total += n
        self._limit_request(sum(rec_tokens) + demo_total, "/v1/score")
        return rec_tokens

    def models(self) -> dict:
        """``/v1/models``."""
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": int(self.started),
                                            "owned_by": "icqs-fast"}]}

    def health(self) -> dict:
        """``/health``: liveness and the queue's counters."""
        q = self.queue
        return {"status": "ok", "pending": q.pending, "max_queue": q.max_pending,
                "batches": q.batches, "batched_prompts": q.batched_prompts,
                "largest_batch": q.largest_batch, "rejected": q.rejected, "chunks": q.chunks,
                "timed_out": q.timed_out, "cancelled": q.cancelled}

    # -- the ASGI app -----------------------------------------------------------------------

    def _error_response(self, exc: APIError) -> JSONResponse:
        if exc.status != 500:
            self.metrics.reject(exc.code)
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param),
                            status_code=exc.status, headers=exc.headers)

    def app(self) -> Any:
        """The FastAPI app wrapped in :class:`Guard`; starting it starts the worker thread."""
        from contextlib import asynccontextmanager

        from icqs_fast.version import __version__

        @asynccontextmanager
        async def lifespan(_app: FastAPI):
            self.queue.start()
            yield
            self.queue.stop()

        api = FastAPI(title="icqs-fast", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json", lifespan=lifespan)

        @api.exception_handler(APIError)
        async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
            return self._error_response(exc)

        @api.exception_handler(RequestValidationError)
        async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
            return self._error_response(validation_error(exc))

        @api.exception_handler(StarletteHTTPException)
        async def _http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
            if isinstance(exc.__cause__, APIError):  # raised while FastAPI read the body
                return self._error_response(exc.__cause__)
            if exc.status_code == 404:
                err = APIError(404, f"no route {req.method} {req.url.path[:200]}", "not_found")
            elif exc.status_code == 405:
                err = APIError(405, f"method {req.method} is not allowed on "
                               f"{req.url.path[:200]}", "method_not_allowed")
            else:
                err = APIError(exc.status_code, str(exc.detail), "bad_request")
            return self._error_response(err)

        @api.exception_handler(Exception)
        async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
            return self._error_response(APIError(500, f"{type(exc).__name__}: {exc}",
                                                 "internal_error"))

        @api.get("/v1/models", response_model=ModelList, responses=_ERRORS)
        async def _models() -> JSONResponse:
            return JSONResponse(self.models())

        @api.get("/health", response_model=Health, responses=_ERRORS)
        async def _health() -> JSONResponse:
            return JSONResponse(self.health())

        @api.get("/metrics", response_class=Response, responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                  "description": "Prometheus text format"}, **_ERRORS})
        async def _metrics() -> Response:
            body, ctype = self.metrics.render()
            return Response(body, media_type=ctype)

        # The routes return JSONResponse: the dicts are built to the response models (the
        # schema says so, the fuzzing test checks it) without a second validation pass.
        @api.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
        async def _completions(body: CompletionRequest, request: Request) -> JSONResponse:
            return JSONResponse(await self.completions(body, request))

        @api.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS)
        async def _score(body: ScoreRequest, request: Request) -> JSONResponse:
            return JSONResponse(await self.score(body, request))

        plain_openapi = api.openapi

        def openapi() -> dict:
            """FastAPI's schema without its 422 answers: validation errors are 400 here."""
            if api.openapi_schema is None:
                schema = plain_openapi()
                for ops in schema.get("paths", {}).values():
                    for op in ops.values():
                        op.get("responses", {}).pop("422", None)
                for name in ("HTTPValidationError", "ValidationError"):
                    schema.get("components", {}).get("schemas", {}).pop(name, None)
                api.openapi_schema = schema
            return api.openapi_schema

        api.openapi = openapi  # type: ignore[method-assign]
        return Guard(api, self.config.api_key, self.config.max_body_bytes, self.metrics)


# pydantic's error types that are union-member tags in an error's location, not fields.
_LOC_TAGS = {"str", "int", "bool", "float", "none", "list", "dict"}


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation error as a 400 naming the field (``param``). The offending input is
    never echoed (it may not even be encodable, e.g. a lone surrogate)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", "invalid_request")
    e = errors[0]
    parts: list[str] = []
    for x in e.get("loc", ())[1:] if e.get("loc", ("",))[0] == "body" else e.get("loc", ()):
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif x in _LOC_TAGS or any(c in x for c in "[(-"):
            continue
        else:
            parts.append(("." if parts else "") + x)
    param = "".join(parts) or None
    kind = e.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the body is not valid JSON", "invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type", "missing",
                                  "model_type"):
        return APIError(400, "the body must be a JSON object", "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unsupported field '{param}': this server does not implement it "
                        "(see /openapi.json for the fields it reads)", "unsupported_field",
                        param=param)
    if kind == "missing":
        return APIError(400, f"'{param}' is required", "invalid_request", param=param)
    return APIError(400, f"'{param}': {e.get('msg', 'invalid value')}", "invalid_request",
                    param=param)


# What a -inf log-prob is sent as (JSON has no infinity; vLLM sends the same).
NEG_INF_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def _clean(x: Any) -> Any:
    """``x`` with every non-finite float as None (JSON has no NaN or infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _offsets(tokenizer: Any, text: str, toks: list[str]) -> list[int]:
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


def _record(i: int, r: Any) -> dict:
    x = next((v for v in (r.x, r.instruction, r.prompt) if v is not None), None)
    y = next((v for v in (r.y, r.response) if v is not None), None)
    if x is None or y is None:
        raise APIError(400, f"record {i}: needs string fields 'x' (or 'instruction', 'prompt') "
                       "and 'y' (or 'response')", "invalid_request", param=f"records[{i}]")
    return {"x": x, "y": y, "reference": r.reference}


def _pool(items: list) -> list[tuple[str, str]]:
    return [(it[0], it[1]) if isinstance(it, list) else (it.x, it.y) for it in items]


__all__ = ["APIError", "Guard", "ServeConfig", "Server", "error_body", "validation_error"]
