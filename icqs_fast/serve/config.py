"""The settings of one ``icqs-fast serve`` server, each declared once
(:func:`icqs_fast.options.option`: flag, default, help, bounds): ``serve``'s flags
(``icqs_fast.cli.serve``), their ``--help`` and the docs' table are derived from here, and the
bounds are checked here, so a server built in code is held to the same limits as one started
from the command line. No torch, no fastapi: ``serve --help`` reads this module."""

from __future__ import annotations

from dataclasses import dataclass

from icqs_fast.engine.settings import DEFAULT_TOKEN_BUDGET, MAX_TOKEN_BUDGET
from icqs_fast.options import check_declared, declaration, option


@dataclass(frozen=True)
class ServeConfig:
    """Settings of one server; each field's declaration says what it does (``serve --help``,
    docs/CLI.md). ValueError naming the flag when one is out of its bounds. Frozen: the
    values checked here are the values served."""

    model_name: str = option("icqs-fast", flag="--served-model-name", metavar="NAME",
                             help="the model id /v1/models lists; a request naming another "
                             "model gets 404 (serve's default: the --model folder, or "
                             "'embedded')")
    api_key: str | None = option(None, kind="str", metavar="KEY",
                                 help="bearer token every route requires (none: "
                                 "$ICQS_FAST_API_KEY, else no check, allowed only on a loopback "
                                 "address)")
    max_body_bytes: int = option(4 * 2**20, ge=1,
                                 help="largest request body in bytes; larger: 413")
    max_prompt_tokens: int = option(4096, ge=1,
                                    help="longest prompt (or /v1/score record, demonstration) "
                                    "in tokens, capped by the model's positions; longer: 400")
    max_request_tokens: int = option(65536, ge=1,
                                     help="the price of one request, checked before it is "
                                     "queued: the tokens it holds (prompts, records, "
                                     "demonstrations) and its work, tokens times the forward "
                                     "passes that read them (a generated token once; a record "
                                     "once per ICQS context and calibration baseline and once "
                                     "for the features; the contexts' demonstration prefixes "
                                     "once); more: 413")
    max_prompts: int = option(64, ge=1, help="prompts (or /v1/score records) per request, at "
                              "most --max-queue")
    max_logprobs: int = option(20, ge=1, help="largest logprobs=N (top-N alternatives) a "
                               "request may ask for")
    max_gen_tokens: int = option(256, ge=1, help="largest max_tokens (greedy generation)")
    # OpenAI takes 4 stop strings; 16 leaves room for chat templates' several end markers.
    max_stop: int = option(16, ge=0, help="most 'stop' strings per request (0: refused)")
    max_stop_chars: int = option(256, ge=1, help="longest 'stop' string, in characters")
    # Room to ban or force a few hundred tokens.
    max_logit_bias: int = option(300, ge=0, help="most 'logit_bias' entries per request "
                                 "(0: refused)")
    # Well above the paper's settings (M+1 = 5, L = 4, N = 8): room to study the parameters,
    # while one request cannot ask for millions of contexts.
    max_num_ratios: int = option(21, ge=1, help="/v1/score: largest num_ratios (M+1) a request "
                                 "(or the server's own --num-ratios) may ask for")
    max_sets_per_ratio: int = option(16, ge=1, help="/v1/score: largest sets_per_ratio (L)")
    max_demos_per_set: int = option(32, ge=1, help="/v1/score: largest demos_per_set (N)")
    max_live_generations: int = option(8, ge=1, help="generations holding a KV cache at once "
                                       "(each up to --max-prompt-tokens + --max-gen-tokens "
                                       "tokens of cache); others wait for a free one")
    max_queue: int = option(256, ge=1, help="prompts admitted and not yet answered; past it: "
                            "429")
    batch_wait_ms: float = option(5.0, ge=0, unit="ms", help="how long a request waits for "
                                  "others to share a batch with")
    max_batch_tokens: int = option(2048, ge=1, help="the chunk: tokens of work per engine step "
                                   "(for /v1/score, record tokens x forward passes); larger "
                                   "requests are cut into chunks served round-robin with the "
                                   "others, so no request waits for more than one chunk of "
                                   "another")
    # 256, measured for SmolLM2-135M on a 2-core AMD EPYC at bf16-mixed (a machine-tuned
    # default: override it with --prefill-budget): `bench serve --soak 150` with the issue-41 mix
    # at budgets 128 / 256 / 384 / 512 gave the server 0.55 / 0.81 / 0.85 / 0.81 of the
    # engine's token rate and an inter-token p99 of 0.42 / 0.65 / 0.96 / 1.22 s (each step
    # carries one forward per live generation beside its slice; a short slice pays them more
    # often). 256 is the largest with the p99 well under 1 s.
    prefill_budget: int = option(256, ge=1, help="prompt tokens (echo, prefill) per worker step "
                                 "beside one token of every live generation (continuous "
                                 "batching; with none live a step packs up to "
                                 "--max-batch-tokens): a larger log-prob chunk runs over "
                                 "several steps, a longer prompt in a step of its own; bounds "
                                 "the time between generated tokens")
    request_timeout: float = option(300.0, ge=0, unit="s", help="seconds a request may take "
                                    "from admission; past it: 504, its running work stops at "
                                    "the next forward or generated token and the rest is "
                                    "dropped (0: no limit)")
    shutdown_timeout: float = option(5.0, ge=0, unit="s", help="on SIGTERM / SIGINT, seconds "
                                     "the requests in flight have to finish before they get "
                                     "503 and the server exits")
    token_budget: int = option(DEFAULT_TOKEN_BUDGET, ge=1, le=MAX_TOKEN_BUDGET,
                               help="max rows x tokens per forward of the engine (echo "
                               "log-probs and /v1/score)")
    backend: str = option("auto", help="token-statistics backend of /v1/score: auto, torch, "
                          "cpp, triton")

    def __post_init__(self) -> None:
        check_declared(self)
        if self.max_prompts > self.max_queue:
            prompts, queue = (declaration(self, n).label for n in ("max_prompts", "max_queue"))
            raise ValueError(f"{prompts} ({self.max_prompts}) must not exceed {queue} "
                             f"({self.max_queue}): such a request could never be admitted")


__all__ = ["ServeConfig"]
