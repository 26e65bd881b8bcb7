"""The FastAPI application of ``icqs-fast serve``: the :class:`Server` (model, queue, metrics,
the route handlers) and the module-level :data:`router` of its routes, whose handlers get the
server injected (:func:`server_of`: ``app.state.server`` of the app that received the request).

Routes (all behind the bearer-token check when the server has an API key; request and response
bodies typed in :mod:`icqs_fast.serve.schemas`, the schema at ``GET /openapi.json``):

* ``GET /v1/models``: the one served model.
* ``POST /v1/completions``: OpenAI legacy completions for scoring and greedy generation
  (:mod:`icqs_fast.serve.completions`).
* ``POST /v1/score``: ICQS scores and glass-box features of posted records
  (:mod:`icqs_fast.serve.scoring`).
* ``GET /health``: liveness and queue counters; ``GET /metrics``: Prometheus metrics.

Every limit is checked, and every request priced, before it is queued
(:mod:`icqs_fast.serve.admission`). Queued work is cut into chunks of about
``--max-batch-tokens`` tokens (a generated token is a step of its own) served round-robin
(:mod:`icqs_fast.serve.queue`). The server hooks the queue's check to every forward of the
model, so a request that ends (``--request-timeout``: 504; its client disconnects; the server
shuts down: 503) stops its running work at the next forward, not after it. On SIGTERM / SIGINT
(:meth:`Server.begin_shutdown`, called by :mod:`icqs_fast.serve.runner`) no new request is
admitted, those in flight have ``--shutdown-timeout`` seconds to finish and then get 503.
Errors: :mod:`icqs_fast.serve.errors`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from icqs_fast import backends
from icqs_fast.engine.batching import model_device
from icqs_fast.engine.capability import dense_head_weight, model_plan
from icqs_fast.engine.checks import model_max_length
from icqs_fast.engine.settings import ScoringSettings
from icqs_fast.options import declaration
from icqs_fast.serve.admission import ICQS_LIMITS, Admission
from icqs_fast.serve.completions import Completions
from icqs_fast.serve.config import ServeConfig
from icqs_fast.serve.dispatch import Dispatcher
from icqs_fast.serve.errors import ERROR_RESPONSES, APIError, error_body, validation_error
from icqs_fast.serve.guard import Guard
from icqs_fast.serve.logprobs import PromptPrefill, prompt_logprobs
from icqs_fast.serve.memory import Trimmer
from icqs_fast.serve.metrics import ServeMetrics
from icqs_fast.serve.queue import WorkQueue
from icqs_fast.serve.schemas import (
    CompletionRequest,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    ScoreRequest,
    ScoreResponse,
)
from icqs_fast.serve.scoring import Scoring
from icqs_fast.version import __version__

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ROUTES = ("/v1/models", "/v1/completions", "/v1/score", "/health", "/metrics", "/openapi.json")


def input_ids_count(args: tuple) -> int:
    """Token ids entering a forward, padding included, from the positional arguments of a
    forward pre-hook on the model's input embeddings (``args[0]``: ``[batch, tokens]`` ids;
    0 when there are none): what ``icqs_serve_forward_tokens_total`` counts."""
    ids = args[0] if args else None
    return int(ids.numel()) if hasattr(ids, "numel") else 0


class Server:
    """The model, its tokenizer, the work queue, the metrics and the route handlers
    (:class:`Completions`, :class:`Scoring`); :meth:`app` is the ASGI application.

    Args:
        model, tokenizer: the served model.
        config: the server's settings (default: every declared default).
        good, bad: the demonstration pools of ``/v1/score`` (both or neither; a request may
            send its own).
        icqs_options: the ICQS settings of ``/v1/score`` (a ScoringSettings, or the fields
            to change in the defaults), within the config's ``max_*`` limits; a request's
            ``icqs_options`` replace some. The engine's ``backend`` and ``token_budget`` are
            the config's.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 config: ServeConfig | None = None, *,
                 good: Sequence | None = None, bad: Sequence | None = None,
                 icqs_options: ScoringSettings | Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = cfg = config or ServeConfig()  # its bounds checked when it was built
        if (good is None) != (bad is None):
            raise ValueError("give both good and bad demonstrations, or neither")
        lim = model_max_length(model, None)
        self.vocab = int(dense_head_weight(model.get_output_embeddings()).shape[0])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab else 0
        # Freed activation memory goes back to the system (flat RSS under varied shapes).
        self.trimmer = Trimmer()
        self.queue = WorkQueue(self.run_logprobs, max_pending=cfg.max_queue,
                               batch_wait_s=cfg.batch_wait_ms / 1000.0,
                               chunk_tokens=cfg.max_batch_tokens,
                               max_live_steps=cfg.max_live_generations,
                               prefill_tokens=cfg.prefill_budget,
                               start_prefill=self.start_prefill
                               if PromptPrefill.supported(model) else None,
                               between_steps=self.trimmer)
        self.metrics = ServeMetrics(self.queue, ROUTES)
        try:  # a --backend that cannot run here is bad input (exit 2), not a fallback
            backend = backends.resolve(cfg.backend, model_device(model))
        except RuntimeError as exc:
            raise ValueError(f"--backend {cfg.backend}: {exc}") from exc
        self.plan = model_plan(model).as_meta(backend)  # in /metrics
        self.metrics.engine_plan(self.plan)
        self.admission = Admission(tokenizer, cfg, self.vocab, lim, count_tokens=lambda r, n:
                                   self.metrics.prompt_tokens.labels(r).inc(n))
        self.max_prompt_tokens = self.admission.max_prompt_tokens
        self.max_positions = lim
        # The server's one ScoringSettings; its engine options are the config's.
        given = icqs_options if isinstance(icqs_options, ScoringSettings) else None
        options = {} if given is not None else dict(icqs_options or {})
        settings = ScoringSettings.build(given, **{**options, "backend": cfg.backend,
                                                   "token_budget": cfg.token_budget})
        if good is not None:  # the server's own ICQS settings must be within its limits
            for name, flag, field in ICQS_LIMITS:
                if getattr(settings, name) > getattr(cfg, field):
                    raise ValueError(f"{declaration(settings, name).label} "
                                     f"{getattr(settings, name)} is over {flag} "
                                     f"{getattr(cfg, field)}")
        self.dispatcher = Dispatcher(self.queue, cfg.request_timeout)
        self.completions = Completions(model, tokenizer, self.admission, self.dispatcher,
                                       cfg.model_name, cfg.max_batch_tokens,
                                       prefill_budget=cfg.prefill_budget)
        self.scoring = Scoring(model, tokenizer, self.admission, self.dispatcher, cfg,
                               good=good, bad=bad, settings=settings)
        self.started = time.time()
        self._hook: Any = None
        self._abort_timer: threading.Timer | None = None

    # -- worker-thread work ---------------------------------------------------------------

    def run_logprobs(self, prompts: list[list[int]], top_n: int) -> list:
        """Echo log-probs of one batch of prompts (the queue's log-prob engine)."""
        return prompt_logprobs(self.model, prompts, top_n=top_n, pad_id=self.pad_id,
                               token_budget=self.config.token_budget)

    def start_prefill(self, prompt: list[int], top_n: int) -> PromptPrefill:
        """One long prompt's echo log-probs, a chunk per worker step (the queue's prefill)."""
        return PromptPrefill(self.model, prompt, top_n)

    def _check_hook(self, _module: Any, args: Any) -> None:
        self.queue.count_forward(input_ids_count(args))
        self.queue.check()

    def start(self) -> None:
        """Start the worker and hook its check to every forward of the model (the input
        embeddings: every forward of the engine, the features and generation starts there)."""
        self.queue.start()
        if self._hook is None:
            try:
                target = self.model.get_input_embeddings()
            except (AttributeError, NotImplementedError):
                target = None
            owner = target if target is not None else self.model
            self._hook = owner.register_forward_pre_hook(self._check_hook)

    def stop(self, timeout: float = 1.0) -> None:
        """End the worker (what is still admitted gets 503; the running work stops at its next
        forward, the worker is waited for at most ``timeout`` seconds: a daemon thread cannot
        keep the process alive) and remove the hook."""
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self.queue.stop(timeout=timeout)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def begin_shutdown(self) -> None:
        """SIGTERM / SIGINT: admit nothing new; what is in flight has ``shutdown_timeout``
        seconds to finish, then it ends with 503 (the running work stops at its next
        forward)."""
        self.queue.drain()
        if self._abort_timer is None:
            self._abort_timer = threading.Timer(self.config.shutdown_timeout, self.queue.abort)
            self._abort_timer.daemon = True
            self._abort_timer.start()

    # -- small routes -------------------------------------------------------------------------

    def models(self) -> ModelList:
        """``/v1/models``."""
        return ModelList(object="list", data=[ModelCard(
            id=self.config.model_name, object="model", created=int(self.started),
            owned_by="icqs-fast")])

    def health(self) -> dict:
        """``/health``: liveness and the queue's counters (a dict of :class:`Health`'s
        fields)."""
        q = self.queue
        return {"status": "ok", "pending": q.pending, "max_queue": q.max_pending,
                "batches": q.batches, "batched_prompts": q.batched_prompts,
                "largest_batch": q.largest_batch, "rejected": q.rejected, "chunks": q.chunks,
                "timed_out": q.timed_out, "cancelled": q.cancelled,
                "interrupted": q.interrupted, "live_generations": q.live_steps,
                "steps": q.steps, "decode_tokens": q.decode_tokens}

    # -- the ASGI app -----------------------------------------------------------------------

    def error_response(self, exc: APIError) -> JSONResponse:
        """``exc`` as OpenAI's error body, counted in the metrics (a 500 is not a refusal)."""
        if exc.status != 500:
            self.metrics.reject(exc.code)
        return JSONResponse(error_body(exc.status, exc.message, exc.code, exc.param),
                            status_code=exc.status, headers=exc.headers)

    def app(self) -> Any:
        """The FastAPI app of :data:`router`, wrapped in :class:`Guard`; its handlers find this
        server in ``app.state.server``, and starting it starts the worker thread."""
        api = FastAPI(title="icqs-fast", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json", lifespan=lifespan,
                      exception_handlers=EXCEPTION_HANDLERS)
        api.state.server = self
        api.include_router(router)
        api.openapi = partial(openapi_without_422, api, api.openapi)  # type: ignore[method-assign]
        return Guard(api, self.config.api_key, self.config.max_body_bytes, self.metrics)


# -- the routes: one module-level router; each handler gets its server injected. A handler's
# docstring is its description in /openapi.json (plain text there).


async def server_of(request: Request) -> Server:
    """The :class:`Server` whose app received ``request`` (async: FastAPI would run a plain
    function in its thread pool, for one attribute read)."""
    return request.app.state.server


ServerDep = Annotated[Server, Depends(server_of)]

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def models(server: ServerDep) -> ModelList:
    """The one served model."""
    return server.models()


@router.get("/health", response_model=Health, responses=ERROR_RESPONSES)
async def health(server: ServerDep) -> Health:
    """Liveness and the queue's counters."""
    return Health(**server.health())


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}},
          "description": "Prometheus text format"}, **ERROR_RESPONSES})
async def metrics(server: ServerDep) -> Response:
    """Prometheus metrics (text format)."""
    body, ctype = server.metrics.render()
    return Response(body, media_type=ctype)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request, server: ServerDep
                      ) -> CompletionResponse:
    """OpenAI legacy completions: echo log-probs (scoring) and greedy generation."""
    return await server.completions(body, request)


# Unset fields are left out: an item has "icqs" / "features" only when asked for,
# "loglik_baseline" only when calibrated.
@router.post("/v1/score", response_model=ScoreResponse, response_model_exclude_unset=True,
             responses=ERROR_RESPONSES)
async def score(body: ScoreRequest, request: Request, server: ServerDep) -> ScoreResponse:
    """ICQS scores and glass-box features of the posted records."""
    return await server.scoring(body, request)


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    """The app's lifetime: its server's worker runs while it does."""
    server: Server = api.state.server
    server.start()
    yield
    server.stop()


# -- errors: every one as OpenAI's body (exception handlers belong to the app, not a router) ---


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    """An :class:`APIError` a handler raised."""
    return request.app.state.server.error_response(exc)


async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails its pydantic model: 400, not FastAPI's 422."""
    return request.app.state.server.error_response(validation_error(exc))


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method, an unreadable body)."""
    if isinstance(exc.__cause__, APIError):  # raised while FastAPI read the body
        err = exc.__cause__
    elif exc.status_code == 404:
        err = APIError(404, f"no route {request.method} {request.url.path[:200]}", "not_found")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} is not allowed on "
                       f"{request.url.path[:200]}", "method_not_allowed")
    else:
        err = APIError(exc.status_code, str(exc.detail), "bad_request")
    return request.app.state.server.error_response(err)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything else: 500 with the exception's type and message."""
    return request.app.state.server.error_response(
        APIError(500, f"{type(exc).__name__}: {exc}", "internal_error"))


EXCEPTION_HANDLERS: dict[Any, Callable[..., Any]] = {
    APIError: on_api_error, RequestValidationError: on_invalid,
    StarletteHTTPException: on_http_error, Exception: on_unexpected}


def openapi_without_422(api: FastAPI, plain_openapi: Callable[[], dict]) -> dict:
    """FastAPI's schema of ``api`` (``plain_openapi``: its own generator) without its 422
    answers: validation errors are 400 here. Built once, then kept."""
    if api.openapi_schema is None:
        schema = plain_openapi()
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        api.openapi_schema = schema
    return api.openapi_schema


__all__ = ["APIError", "Guard", "ServeConfig", "Server", "error_body", "input_ids_count",
           "router", "server_of", "validation_error"]
