"""The settings of one ``icqs-fast serve`` server (no torch, no fastapi: ``serve --help``
reads its defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServeConfig:
    """Settings of one server (``icqs-fast serve`` flags of the same names).

    Attributes:
        model_name: the id ``/v1/models`` lists; requests naming another model get 404.
        api_key: bearer token every route requires (None: no check; only for 127.0.0.1).
        max_body_bytes: request bodies above this get 413.
        max_prompt_tokens: prompts (or ``/v1/score`` records, demonstrations) above this many
            tokens get 400 (capped by the model's positions).
        max_request_tokens: requests whose prompts (or records and demonstrations) hold more
            tokens in all get 413.
        max_prompts: prompts (or records) per request.
        max_logprobs: largest ``logprobs=N``.
        max_gen_tokens: largest ``max_tokens`` (greedy generation).
        max_queue: prompts admitted and not yet answered; past it 429.
        batch_wait_ms: how long a request waits for others to batch with.
        max_batch_tokens: the chunk: most tokens of work (prompt tokens; for ``/v1/score``,
            record tokens x forward passes) per step of the worker; a larger request is cut
            into chunks that interleave with other requests round-robin.
        request_timeout: seconds from admission to answer; past it 504 and the request's
            remaining chunks are dropped (0: no deadline).
        token_budget: tokens per forward of the engine.
        backend: token-statistics backend for ``/v1/score``.
    """

    model_name: str = "icqs-fast"
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int = 4096
    max_request_tokens: int = 65536
    max_prompts: int = 64
    max_logprobs: int = 20
    max_gen_tokens: int = 256
    max_queue: int = 256
    batch_wait_ms: float = 5.0
    max_batch_tokens: int = 2048
    request_timeout: float = 300.0
    token_budget: int = 16384
    backend: str = "auto"
