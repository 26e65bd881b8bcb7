"""The FastAPI application of ``icqs-fast serve``.

Routes (all behind the bearer-token check when the server has an API key):

* ``GET /v1/models``: the one served model.
* ``POST /v1/completions``: OpenAI legacy completions for scoring: ``echo=True, max_tokens=0,
  logprobs=N`` gives every prompt token's log-prob and the top-N alternatives
  (``choices[].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``, the first
  position ``null``). ``max_tokens=1`` (what lm-eval's ``local-completions`` sends) appends the
  greedy next token, with its log-prob, from the same batched pass; ``max_tokens > 1`` generates
  greedily with ``model.generate`` (one prompt at a time: correct, not accelerated; ``stop``
  strings honoured). Sampling (``temperature > 0``) is refused with 400.
* ``POST /v1/score``: ICQS scores (good / bad demonstrations given at server start or in the
  request) and glass-box features of posted records.
* ``GET /health``: liveness and queue counters.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "code"}}``: 400 for a bad request,
401 for a missing or wrong key, 404 for an unknown model or route, 413 for a body over the
limit, 429 when the queue is full; a failure inside the engine is a 500 with its message and
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
from fastapi.responses import JSONResponse

from icqs_fast.serve.config import ServeConfig
from icqs_fast.serve.logprobs import prompt_logprobs
from icqs_fast.serve.queue import QueueFull, WorkQueue

# /v1/score's "icqs_options": integers, and the calibration / score kind (issue 17) as strings.
ICQS_INT_OPTIONS = ("num_ratios", "demos_per_set", "sets_per_ratio", "seed")
ICQS_STR_OPTIONS = ("calibration", "score")
ICQS_OPTIONS = ICQS_INT_OPTIONS + ICQS_STR_OPTIONS


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers


_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "error"),
                      "param": None, "code": code}}


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.code), status_code=exc.status,
                        headers=exc.headers)


# --------------------------------------------------------------------------- ASGI guard


class _TooLarge(APIError):
    """A chunked body grew past the limit while it was read (the app answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes",
                         "body_too_large")


class Guard:
    """Pure ASGI middleware: the bearer token on every HTTP route and the body-size limit
    (by ``Content-Length`` before reading, and by counting a chunked body while it arrives)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = int(max_body_bytes)

    async def _send_error(self, send: Any, status: int, message: str, code: str,
                          extra: list | None = None) -> None:
        body = json.dumps(error_body(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
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
                                       f"the limit of {self.max_body}", "body_too_large")
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

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge as exc:
            if not started:
                await self._send_error(send, 413, exc.message, exc.code or "body_too_large")


# --------------------------------------------------------------------------- the server


class Server:
    """The model, its tokenizer, the work queue and the ICQS scorer built from the server's
    demonstrations (if any); :meth:`app` is the ASGI application."""

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
                               max_batch_tokens=cfg.max_batch_tokens)
        self.started = time.time()

    # -- worker-thread work -------------------------------------------------------------

    def _run_logprobs(self, prompts: list[list[int]], top_n: int) -> list:
        return prompt_logprobs(self.model, prompts, top_n=top_n, pad_id=self.pad_id,
                               token_budget=self.config.token_budget)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], max_new: int, top_n: int,
                  stop: list[str] | None) -> list[list[tuple[int, float, list]]]:
        """Greedy continuations of ``prompts`` (``model.generate``, one prompt at a time):
        per prompt ``(token id, log-prob, top-N pairs)`` of each new token, EOS included."""
        dev = next(self.model.parameters()).device
        out = []
        for ids in prompts:
            inp = torch.tensor([ids], dtype=torch.long, device=dev)
            kw = {"stop_strings": stop, "tokenizer": self.tokenizer} if stop else {}
            gen = self.model.generate(input_ids=inp, attention_mask=torch.ones_like(inp),
                                      max_new_tokens=max_new, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=self.pad_id, **kw)
            new = gen.sequences[0, len(ids):].tolist()
            steps = []
            for tid, logits in zip(new, gen.logits, strict=False):
                lp = torch.log_softmax(logits[0].float(), dim=-1)
                top = []
                if top_n > 0:
                    tv, ti = lp.topk(min(top_n, lp.shape[-1]))
                    top = list(zip(ti.tolist(), tv.tolist(), strict=True))
                steps.append((int(tid), float(lp[tid]), top))
                if tid == self.tokenizer.eos_token_id:
                    break
            out.append(steps)
        return out

    def _scorer_for(self, good: Sequence | None, bad: Sequence | None, options: dict) -> Any:
        from icqs_fast.engine.scorer import ICQSScorer

        if good is None:
            if self.good is None:
                raise APIError(400, "no demonstrations: start the server with --good/--bad or "
                               "send 'good' and 'bad' in the request", "no_demonstrations")
            if options and options != self.icqs_options:
                return ICQSScorer(self.model, self.tokenizer, self.good, self.bad,
                                  backend=self.config.backend, **options)
            if self._scorer is None:
                self._scorer = ICQSScorer(self.model, self.tokenizer, self.good, self.bad,
                                          backend=self.config.backend, **self.icqs_options)
            return self._scorer
        return ICQSScorer(self.model, self.tokenizer, good, bad, backend=self.config.backend,
                          **{**self.icqs_options, **options})

    def _score(self, records: list[dict], want_icqs: bool, features: list[str] | None,
               good: Sequence | None, bad: Sequence | None, options: dict) -> list[dict]:
        out: list[dict] = [{"index": i} for i in range(len(records))]
        if want_icqs:
            scorer = self._scorer_for(good, bad, options)
            pairs = [(r["x"], r["y"]) for r in records]
            for o, res in zip(out, scorer.score(pairs), strict=True):
                o["icqs"] = {"score": res.score, "score_per_set": res.score_per_set,
                             "loglik": res.loglik.tolist(), "ratios": res.ratios,
                             "n_response_tokens": res.n_response_tokens}
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
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            with self._text_lock:
                self._token_text[tid] = s
        return s

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                           f"{self.config.model_name!r}", "model_not_found")

    def _prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """``(token ids, text or None)`` of each prompt: a string, a list of strings, a list
        of token ids or a list of token-id lists."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise APIError(400, "'prompt' must be a non-empty string, list of strings, list of "
                           "token ids or list of token-id lists", "invalid_prompt")
        if len(items) > self.config.max_prompts:
            raise APIError(400, f"{len(items)} prompts in one request; at most "
                           f"{self.config.max_prompts}", "too_many_prompts")
        out = []
        for i, p in enumerate(items):
            if isinstance(p, str):
                ids, text = list(self.tokenizer(p)["input_ids"]), p
            elif isinstance(p, list) and all(_is_int(t) for t in p):
                ids, text = [int(t) for t in p], None
                bad = [t for t in ids if not 0 <= t < self.vocab]
                if bad:
                    raise APIError(400, f"prompt {i}: token id {bad[0]} is outside the "
                                   f"vocabulary [0, {self.vocab})", "invalid_prompt")
            else:
                raise APIError(400, f"prompt {i}: expected a string or a list of token ids, got "
                               f"{type(p).__name__}", "invalid_prompt")
            if not ids:
                raise APIError(400, f"prompt {i} is empty (no tokens)", "invalid_prompt")
            if len(ids) > self.max_prompt_tokens:
                raise APIError(400, f"prompt {i} has {len(ids)} tokens, more than the limit of "
                               f"{self.max_prompt_tokens}", "context_length_exceeded")
            out.append((ids, text))
        return out

    async def _wait(self, fut: Any) -> Any:
        try:
            return await asyncio.wrap_future(fut)
        except QueueFull as exc:
            raise APIError(503, str(exc), "shutting_down") from None
        except APIError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise APIError(400, str(exc), "invalid_request") from None
        except Exception as exc:  # an engine failure: this request's 500, not the server's end
            raise APIError(500, f"{type(exc).__name__}: {exc}", "internal_error") from None

    def _submit(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except QueueFull as exc:
            raise APIError(429, str(exc), "queue_full", {"Retry-After": "1"}) from None

    async def completions(self, body: dict) -> dict:
        self._check_model(body)
        for key, why in (("stream", "streaming is not supported"),
                         ("suffix", "'suffix' is not supported")):
            if body.get(key):
                raise APIError(400, why, "unsupported")
        for key in ("n", "best_of"):
            if body.get(key) not in (None, 1):
                raise APIError(400, f"'{key}' must be 1 (one choice per prompt)", "unsupported")
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise APIError(400, "'echo' must be a boolean", "invalid_request")
        max_tokens = body.get("max_tokens", 16)
        if not _is_int(max_tokens) or max_tokens < 0:
            raise APIError(400, f"'max_tokens' must be an integer >= 0, got {max_tokens!r}",
                           "invalid_request")
        if max_tokens > self.config.max_gen_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of "
                           f"{self.config.max_gen_tokens} (it is built for scoring: "
                           "max_tokens=0, echo=true, logprobs=N)", "max_tokens_too_large")
        temp = body.get("temperature")
        if temp is not None and (not isinstance(temp, (int, float)) or isinstance(temp, bool)):
            raise APIError(400, "'temperature' must be a number", "invalid_request")
        if max_tokens > 0 and temp not in (None, 0):
            raise APIError(400, f"temperature={temp}: sampling is not supported; generation is "
                           "greedy (temperature 0)", "sampling_not_supported")
        n_lp = body.get("logprobs")
        if n_lp is not None and (not _is_int(n_lp) or not 0 <= n_lp <= self.config.max_logprobs):
            raise APIError(400, f"'logprobs' must be an integer in [0, "
                           f"{self.config.max_logprobs}], got {n_lp!r}", "invalid_request")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str)
                                                                    for s in stop)):
            raise APIError(400, "'stop' must be a string or a list of strings", "invalid_request")
        # Tokenizing a long body takes a while: off the event loop.
        prompts = await asyncio.to_thread(self._prompts, body.get("prompt"))
        if self.max_positions and max_tokens > 1:
            longest = max(len(p) for p, _ in prompts)
            if longest + max_tokens > self.max_positions:
                raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) is "
                               f"over the model's {self.max_positions} positions",
                               "context_length_exceeded")
        top_n = int(n_lp or 0)
        ids_list = [p for p, _ in prompts]
        results: list = [None] * len(prompts)
        if echo or max_tokens == 1:
            fut = self._submit(self.queue.submit_logprobs, ids_list, top_n)
            results = await self._wait(fut)
        gens: list[list[tuple[int, float, list]]] = [[] for _ in prompts]
        if max_tokens == 1:
            gens = [[(r.next_token, r.next_logprob, r.next_top)] for r in results]
        elif max_tokens > 1:
            fut = self._submit(self.queue.submit_call,
                               lambda: self._generate(ids_list, max_tokens, top_n, stop),
                               len(prompts))
            gens = await self._wait(fut)
        choices = []
        n_prompt = n_gen = 0
        for i, ((ids, text), res, gen) in enumerate(zip(prompts, results, gens, strict=True)):
            n_prompt += len(ids)
            choices.append(self._choice(i, ids, text, res, echo, gen, max_tokens, n_lp, stop))
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

    async def score(self, body: dict) -> dict:
        self._check_model(body)
        recs = body.get("records")
        if not isinstance(recs, list) or not recs:
            raise APIError(400, "'records' must be a non-empty list of {\"x\": ..., \"y\": ...} "
                           "objects", "invalid_request")
        if len(recs) > self.config.max_prompts:
            raise APIError(400, f"{len(recs)} records in one request; at most "
                           f"{self.config.max_prompts}", "too_many_records")
        records = [_record(i, r) for i, r in enumerate(recs)]
        feats = body.get("features", False)
        if feats is True:
            from icqs_fast.features.extract import ALL_FEATURES

            feats = list(ALL_FEATURES)
        elif feats in (False, None):
            feats = None
        elif not (isinstance(feats, list) and all(isinstance(f, str) for f in feats)):
            raise APIError(400, "'features' must be true, false or a list of feature names",
                           "invalid_request")
        if feats:
            from icqs_fast.features.extract import ALL_FEATURES

            unknown = [f for f in feats if f not in ALL_FEATURES]
            if unknown:
                raise APIError(400, f"unknown feature(s) {unknown}; known: {list(ALL_FEATURES)}",
                               "invalid_request")
        good, bad = body.get("good"), body.get("bad")
        if (good is None) != (bad is None):
            raise APIError(400, "send both 'good' and 'bad' demonstrations, or neither",
                           "invalid_request")
        if good is not None:
            good, bad = _pool(good, "good"), _pool(bad, "bad")
        want_icqs = body.get("icqs", good is not None or self.good is not None)
        if not isinstance(want_icqs, bool):
            raise APIError(400, "'icqs' must be a boolean", "invalid_request")
        options = body.get("icqs_options") or {}
        if not isinstance(options, dict) or any(k not in ICQS_OPTIONS for k in options) or \
                not all(_is_int(v) if k in ICQS_INT_OPTIONS else isinstance(v, str)
                        for k, v in options.items()):
            raise APIError(400, f"'icqs_options' must be an object with integer "
                           f"{list(ICQS_INT_OPTIONS)} and string {list(ICQS_STR_OPTIONS)}",
                           "invalid_request")
        if options:
            from icqs_fast.engine.settings import ScoringSettings

            try:  # the engine's own checks, before the request is queued
                ScoringSettings.build(**{**self.icqs_options, **options})
            except ValueError as exc:
                raise APIError(400, f"'icqs_options': {exc}", "invalid_request") from None
        if not want_icqs and not feats:
            raise APIError(400, "nothing to compute: ask for 'icqs' and/or 'features'",
                           "invalid_request")
        fut = self._submit(self.queue.submit_call,
                           lambda: self._score(records, want_icqs, feats, good, bad, options),
                           len(records))
        data = await self._wait(fut)
        return {"object": "list", "model": self.config.model_name, "data": _clean(data)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                            "created": int(self.started),
                                            "owned_by": "icqs-fast"}]}

    def health(self) -> dict:
        q = self.queue
        return {"status": "ok", "pending": q.pending, "max_queue": q.max_pending,
                "batches": q.batches, "batched_prompts": q.batched_prompts,
                "largest_batch": q.largest_batch, "rejected": q.rejected}

    # -- the ASGI app -----------------------------------------------------------------------

    def app(self) -> Any:
        """The FastAPI app wrapped in :class:`Guard`; starting it starts the worker thread."""
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_app: FastAPI):
            self.queue.start()
            yield
            self.queue.stop()

        api = FastAPI(title="icqs-fast", docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=lifespan)

        @api.exception_handler(APIError)
        async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
            return _error_response(exc)

        @api.exception_handler(404)
        async def _not_found(req: Request, _exc: Exception) -> JSONResponse:
            return _error_response(APIError(404, f"no route {req.method} {req.url.path}",
                                            "not_found"))

        @api.exception_handler(405)
        async def _not_allowed(req: Request, _exc: Exception) -> JSONResponse:
            return _error_response(APIError(405, f"method {req.method} is not allowed on "
                                            f"{req.url.path}", "method_not_allowed"))

        @api.exception_handler(Exception)
        async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
            return _error_response(APIError(500, f"{type(exc).__name__}: {exc}",
                                            "internal_error"))

        async def _json(req: Request) -> dict:
            raw = await req.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the body is not valid JSON: {exc}", "invalid_json") \
                    from None
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object", "invalid_json")
            return body

        @api.get("/v1/models")
        async def _models() -> dict:
            return self.models()

        @api.get("/health")
        async def _health() -> dict:
            return self.health()

        @api.post("/v1/completions")
        async def _completions(req: Request) -> JSONResponse:
            return JSONResponse(await self.completions(await _json(req)))

        @api.post("/v1/score")
        async def _score(req: Request) -> JSONResponse:
            return JSONResponse(await self.score(await _json(req)))

        return Guard(api, self.config.api_key, self.config.max_body_bytes)


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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    if not isinstance(r, dict):
        raise APIError(400, f"record {i}: expected an object, got {type(r).__name__}",
                       "invalid_request")
    x = next((r[k] for k in ("x", "instruction", "prompt") if k in r), None)
    y = next((r[k] for k in ("y", "response") if k in r), None)
    if not isinstance(x, str) or not isinstance(y, str):
        raise APIError(400, f"record {i}: needs string fields 'x' (or 'instruction', 'prompt') "
                       "and 'y' (or 'response')", "invalid_request")
    ref = r.get("reference")
    if ref is not None and not isinstance(ref, str):
        raise APIError(400, f"record {i}: 'reference' must be a string", "invalid_request")
    return {"x": x, "y": y, "reference": ref}


def _pool(items: Any, name: str) -> list[tuple[str, str]]:
    if not isinstance(items, list) or not items:
        raise APIError(400, f"'{name}' must be a non-empty list of [x, y] pairs or "
                       "{\"x\", \"y\"} objects", "invalid_request")
    out = []
    for i, it in enumerate(items):
        if isinstance(it, dict) and isinstance(it.get("x"), str) and isinstance(it.get("y"), str):
            out.append((it["x"], it["y"]))
        elif (isinstance(it, list) and len(it) == 2 and all(isinstance(s, str) for s in it)):
            out.append((it[0], it[1]))
        else:
            raise APIError(400, f"'{name}' item {i}: expected [x, y] or {{\"x\", \"y\"}} "
                           "strings", "invalid_request")
    return out


__all__ = ["APIError", "Guard", "ServeConfig", "Server", "error_body"]
