"""Admission: every limit of a request, checked before it is queued, and its price.

Every option that multiplies work has a limit named by a flag (:class:`ServeConfig` fields of
the same names): prompts or records per request (``--max-prompts``), tokens per prompt or record
(``--max-prompt-tokens``), ``max_tokens`` (``--max-gen-tokens``), ``logprobs``
(``--max-logprobs``), ``stop`` strings (``--max-stop`` strings of at most ``--max-stop-chars``
characters), ``logit_bias`` entries (``--max-logit-bias``) and the ICQS settings
(``--max-num-ratios``, ``--max-sets-per-ratio``, ``--max-demos-per-set``). On top of them the
request's *price*, tokens times the forward passes that read them (:func:`completion_price`,
:func:`score_price`), must stay within ``--max-request-tokens``. A violation is a 400 (one
option) or 413 (the whole request) whose message names the flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from icqs_fast.options import declaration
from icqs_fast.serve.config import ServeConfig
from icqs_fast.serve.errors import APIError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LOGIT_BIAS_MAX = 100.0  # OpenAI's range for logit_bias values


def limit_flag(field: str) -> str:
    """The ``serve`` flag of a :class:`ServeConfig` limit (from its declaration), as messages
    name it."""
    return declaration(ServeConfig, field).flag


# The ICQS options a request may set, the flag that bounds each and its config field.
ICQS_LIMITS = tuple((name, limit_flag(field), field) for name, field in (
    ("num_ratios", "max_num_ratios"), ("sets_per_ratio", "max_sets_per_ratio"),
    ("demos_per_set", "max_demos_per_set")))


def completion_price(lengths: Sequence[int], scored: bool, max_new: int) -> int:
    """Token-passes of a ``/v1/completions`` request: each prompt's tokens once when its
    log-probs (echo, or the batched next token) are computed, and once more, plus one per new
    token, when it is continued by generation (``max_new > 0``)."""
    per = (1 if scored else 0) + (1 if max_new > 0 else 0)
    return sum(n * per + max_new for n in lengths) if max_new > 0 else sum(lengths) * per


def score_price(record_tokens: Sequence[int], rows_per_record: int, features: bool,
                context_tokens: int, n_contexts: int, plain: bool) -> int:
    """Token-passes of a ``/v1/score`` request: each record is read once per ICQS row
    (``rows_per_record``: contexts times one plus the calibration baselines) and once for the
    features; the contexts' demonstration prefixes (``context_tokens`` each, ``n_contexts``)
    are computed once, or, on the plain path (no prefix bank), again with every row."""
    total = sum(record_tokens) * (rows_per_record + (1 if features else 0))
    if rows_per_record:
        total += context_tokens * (n_contexts + (rows_per_record * len(record_tokens)
                                                 if plain else 0))
    return total


class Admission:
    """The limits of one server (see the module docstring).

    Args:
        tokenizer: the served model's tokenizer (user text is encoded with it).
        config: the server's settings.
        vocab: the LM head's rows (valid token ids are ``[0, vocab)``).
        max_positions: the model's positions (None: unknown); caps ``--max-prompt-tokens``.
        count_tokens: called with ``(route, tokens)`` for every admitted request (metrics).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ServeConfig, vocab: int,
                 max_positions: int | None, count_tokens: Any = None) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.vocab = int(vocab)
        self.max_positions = max_positions
        self.max_prompt_tokens = (min(config.max_prompt_tokens, max_positions)
                                  if max_positions else config.max_prompt_tokens)
        self.count_tokens = count_tokens

    # -- text and counts ------------------------------------------------------------------

    def model(self, name: str | None) -> None:
        """The request's ``model``: 404 unless it is the served one (or left out)."""
        if name is not None and name != self.config.model_name:
            raise APIError(404, f"model {name!r} is not served here; this server serves "
                           f"{self.config.model_name!r}", "model_not_found", param="model")

    def encode(self, texts: list[str], what: str) -> list[list[int]]:
        """Token ids of user texts; a tokenizer failure is the request's 400, not a 500."""
        if not texts:
            return []
        try:
            return [list(ids) for ids in self.tokenizer(texts)["input_ids"]]
        except Exception as exc:  # noqa: BLE001 (any tokenizer error on user input)
            raise APIError(400, f"{what}: the tokenizer cannot encode it "
                           f"({type(exc).__name__})", "invalid_text", param=what) from None

    def prompt(self, n: int, what: str) -> None:
        """One prompt, record or demonstration of ``n`` tokens: 400 over the limit."""
        if n > self.max_prompt_tokens:
            why = (f"{limit_flag('max_prompt_tokens')} {self.config.max_prompt_tokens}"
                   if self.max_prompt_tokens == self.config.max_prompt_tokens
                   else f"the model's {self.max_positions} positions")
            raise APIError(400, f"{what} has {n} tokens, more than the limit of "
                           f"{self.max_prompt_tokens} ({why}; raise it with "
                           f"{limit_flag('max_prompt_tokens')})", "context_length_exceeded",
                           param=what)

    def count(self, n: int, what: str) -> None:
        """``n`` prompts or records in one request: 400 over ``--max-prompts``."""
        if n > self.config.max_prompts:
            raise APIError(400, f"{n} {what} in one request; at most {self.config.max_prompts} "
                           f"({limit_flag('max_prompts')})", f"too_many_{what}", param=what)

    def request(self, held: int, price: int, route: str) -> None:
        """The whole request: the tokens it holds and its price in token-passes, each within
        ``--max-request-tokens`` (413)."""
        limit = self.config.max_request_tokens
        if held > limit:
            raise APIError(413, f"the request holds {held} tokens, more than the limit of "
                           f"{limit} per request (raise it with "
                           f"{limit_flag('max_request_tokens')}, or split the request)",
                           "request_too_large")
        if price > limit:
            raise APIError(413, f"the request asks for {price} tokens of work (tokens times "
                           f"the forward passes that read them), more than the limit of {limit}"
                           f" per request (raise it with "
                           f"{limit_flag('max_request_tokens')}, or ask for less: "
                           "fewer prompts or records, a smaller max_tokens or ICQS settings)",
                           "request_too_large")
        if self.count_tokens is not None:
            self.count_tokens(route, held)

    # -- /v1/completions options ------------------------------------------------------------

    def max_tokens(self, n: int) -> None:
        if n > self.config.max_gen_tokens:
            raise APIError(400, f"max_tokens={n} is over this server's limit of "
                           f"{self.config.max_gen_tokens} ({limit_flag('max_gen_tokens')}; it is "
                           "built for "
                           "scoring: max_tokens=0, echo=true, logprobs=N)",
                           "max_tokens_too_large", param="max_tokens")

    def logprobs(self, n: int | None) -> None:
        if n is not None and n > self.config.max_logprobs:
            raise APIError(400, f"'logprobs' must be an integer in [0, "
                           f"{self.config.max_logprobs}] ({limit_flag('max_logprobs')}), got {n}",
                           "invalid_request", param="logprobs")

    def stop(self, stop: str | list[str] | None) -> list[str]:
        """The request's stop strings as a list, within ``--max-stop`` and
        ``--max-stop-chars``."""
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > self.config.max_stop:
            raise APIError(400, f"'stop' holds {len(stops)} strings; at most "
                           f"{self.config.max_stop} ({limit_flag('max_stop')})",
                           "too_many_stop_strings",
                           param="stop")
        for i, s in enumerate(stops):
            if len(s) > self.config.max_stop_chars:
                raise APIError(400, f"stop[{i}] has {len(s)} characters; at most "
                               f"{self.config.max_stop_chars} ({limit_flag('max_stop_chars')})",
                               "stop_string_too_long", param="stop")
        return stops

    def logit_bias(self, raw: dict[str, float] | None) -> dict[int, float]:
        """``logit_bias`` as token id -> bias, within ``--max-logit-bias`` entries, every key a
        token id and every bias in [-100, 100]."""
        raw = raw or {}
        if len(raw) > self.config.max_logit_bias:
            raise APIError(400, f"logit_bias has {len(raw)} entries; at most "
                           f"{self.config.max_logit_bias} ({limit_flag('max_logit_bias')})",
                           "too_many_logit_bias", param="logit_bias")
        out: dict[int, float] = {}
        for key, val in raw.items():
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

    # -- /v1/score options ------------------------------------------------------------------

    def icqs_settings(self, settings: Any, param: str = "icqs_options") -> None:
        """The ICQS settings' multipliers (``num_ratios``, ``sets_per_ratio``,
        ``demos_per_set``) within their flags (400)."""
        for name, flag, field in ICQS_LIMITS:
            value, limit = getattr(settings, name), getattr(self.config, field)
            if value > limit:
                raise APIError(400, f"'{param}.{name}' = {value} is over this server's limit "
                               f"of {limit} ({flag})", "icqs_option_too_large",
                               param=f"{param}.{name}")


__all__ = ["ICQS_LIMITS", "LOGIT_BIAS_MAX", "Admission", "completion_price", "limit_flag",
           "score_price"]
