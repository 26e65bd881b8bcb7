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
        max_request_tokens: the price of a request, checked before it is queued: the tokens
            it holds (prompts, or records and demonstrations) and the work it asks for, tokens
            times the forward passes that read them (a generated token is one token; a
            ``/v1/score`` record is read once per ICQS context, per calibration baseline and for
            the features; the ICQS contexts' demonstration prefixes once); more gets 413.
        max_prompts: prompts (or ``/v1/score`` records) per request.
        max_logprobs: largest ``logprobs=N``.
        max_gen_tokens: largest ``max_tokens`` (greedy generation).
        max_stop: most ``stop`` strings per request.
        max_stop_chars: longest ``stop`` string, in characters.
        max_logit_bias: most ``logit_bias`` entries per request.
        max_num_ratios, max_sets_per_ratio, max_demos_per_set: the largest ICQS ``num_ratios``
            (M+1), ``sets_per_ratio`` (L) and ``demos_per_set`` (N) a request (or the server's
            own defaults) may ask for.
        max_live_generations: generations holding a KV cache at once (each is up to
            ``max_prompt_tokens + max_gen_tokens`` tokens of cache); more wait for a free one.
        max_queue: prompts admitted and not yet answered; past it 429.
        batch_wait_ms: how long a request waits for others to batch with.
        max_batch_tokens: the chunk: most tokens of work (prompt tokens; for ``/v1/score``,
            record tokens x forward passes) per step of the worker; a larger request is cut
            into chunks that interleave with other requests round-robin.
        prefill_budget: tokens of prompt work (echo / prefill) a worker step packs beside one
            token of every live generation (continuous batching); a larger log-prob chunk runs
            over several steps, a prompt longer than this in a step of its own. It bounds the
            time between a generation's tokens.
        request_timeout: seconds from admission to answer; past it 504, the running chunk is
            stopped at its next forward (or generated token) and the remaining ones are dropped
            (0: no deadline).
        shutdown_timeout: seconds a SIGTERM / SIGINT leaves the requests in flight to finish;
            then they get 503 and the server exits.
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
    # OpenAI takes 4 stop strings; 16 leaves room for chat templates' several end markers.
    max_stop: int = 16
    max_stop_chars: int = 256
    max_logit_bias: int = 300  # room to ban or force a few hundred tokens
    # Well above the paper's settings (M+1 = 5, L = 4, N = 8): room to study the parameters,
    # while one request cannot ask for millions of contexts.
    max_num_ratios: int = 21
    max_sets_per_ratio: int = 16
    max_demos_per_set: int = 32
    max_live_generations: int = 8
    max_queue: int = 256
    batch_wait_ms: float = 5.0
    max_batch_tokens: int = 2048
    prefill_budget: int = 256
    request_timeout: float = 300.0
    shutdown_timeout: float = 5.0
    token_budget: int = 16384
    backend: str = "auto"
