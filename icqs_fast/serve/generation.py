"""Greedy generation one token per step, for the work queue's ``steps`` units.

``model.generate`` runs a whole generation in one call that nothing can stop, and its
``stop_strings`` build a table over the whole vocabulary for every request (10,000 stop strings
held the worker for minutes). Here a generation is a :class:`GreedyGeneration`: each
:meth:`~GreedyGeneration.step` is one forward (the prompt first, then one new token against the
KV cache; a prompt longer than ``prefill_chunk`` in chunks over several steps) and the choice
of one token, so the queue serves other requests between tokens and
drops the generation between any two of them when its request ends. Stop strings
(:class:`StopStrings`) are searched only in the text the last token added (and the characters
before it that a stop string could span).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast.engine.batching import cache_kwarg
from icqs_fast.engine.capability import dense_head_weight

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# (token id, log-prob, [(token id, log-prob)] of the top-N) of one generated token.
GenStep = tuple[int, float, list[tuple[int, float]]]


class StopStrings:
    """The stop strings of one request (empty ones ignored, duplicates once).

    Args:
        stops: the request's ``stop`` strings.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first(self, text: str, new_from: int = 0) -> int | None:
        """The start of the earliest stop string in ``text``, given that none occurs in
        ``text[:new_from]`` (the text before the last token): only the tail from
        ``new_from - longest + 1`` is searched. None when there is none."""
        start = max(0, new_from - self.longest + 1)
        tail = text[start:]
        best = None
        for s in self.stops:
            k = tail.find(s)
            if k >= 0 and (best is None or k < best):
                best = k
        return None if best is None else start + best


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class GenerationOptions:
    """What a request asks of one greedy generation (the same for each of its prompts).

    Args:
        max_new: most tokens to generate (>= 1).
        top_n: alternatives (with log-probs) kept per generated token.
        stops: the request's stop strings (the generation ends at the first one).
        bias: token id -> logit bias added to the logits that choose each token; the log-probs
            are of that biased distribution.
        eos_ids: token ids that end the generation (kept as its last token).
        prefill_chunk: most prompt tokens per forward (None: the whole prompt in one): a longer
            prompt runs over several steps, a chunk each against the KV cache of the chunks
            before, so that no worker step carries more than the server's prefill budget; the
            first token comes with the step of the last chunk.
    """

    max_new: int
    top_n: int = 0
    stops: StopStrings | None = None
    bias: dict[int, float] | None = None
    eos_ids: Iterable[int] = ()
    prefill_chunk: int | None = None


class GreedyGeneration:
    """The greedy continuation of one prompt, a token per :meth:`step` (a
    :class:`icqs_fast.serve.queue.Stepper`).

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer (decodes the text the stop strings are searched in).
        ids: the prompt's token ids.
        options: the request's :class:`GenerationOptions`.

    Attributes:
        on_step: None, or called on the worker thread with each generated token's
            :data:`GenStep` right after it is chosen (streaming; it must not block).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 ids: Sequence[int],
                 options: GenerationOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.ids = [int(t) for t in ids]
        self.max_new = int(options.max_new)
        self.top_n = int(options.top_n)
        self.stops = options.stops if options.stops else None
        self.eos_ids = frozenset(int(t) for t in options.eos_ids)
        bias, prefill_chunk = options.bias, options.prefill_chunk
        self.dev = next(model.parameters()).device
        self.bias_vec: torch.Tensor | None = None
        if bias:
            vocab = int(dense_head_weight(model.get_output_embeddings()).shape[0])
            self.bias_vec = torch.zeros(vocab, dtype=torch.float32, device=self.dev)
            for tid, b in bias.items():
                self.bias_vec[tid] = b
        self.prefill_chunk = None if prefill_chunk is None else max(1, int(prefill_chunk))
        self._fed = 0  # prompt tokens in the KV cache (chunked prefill)
        self.on_step: Callable[[GenStep], None] | None = None
        self.steps: list[GenStep] = []
        self._past: Any = None
        self._cached = True  # False once the model returned no KV cache: full forwards
        self._text = ""
        self.done = False

    @torch.no_grad()
    def _logits(self) -> torch.Tensor:
        """fp32 logits ``[V]`` of the next token: the prompt's forward first, then the last
        token's against the cache."""
        new = [t for t, _, _ in self.steps]
        if not self._cached or (self._past is None and not self._fed):
            inp = torch.tensor([self.ids + new], dtype=torch.long, device=self.dev)
            out = self.model(input_ids=inp, attention_mask=torch.ones_like(inp),
                             use_cache=self._cached)
        elif not new:  # the prompt's last chunk
            out = self._forward(self.ids[self._fed:], self._fed)
        else:  # the last token; the cache holds the prompt and the tokens before it
            out = self._forward(new[-1:], len(self.ids) + len(new) - 1)
        self._keep_cache(out)
        return out.logits[0, -1].float()

    def _keep_cache(self, out: Any) -> bool:
        """Keep the KV cache ``out`` returned; False (and full forwards from now on) when the
        model returned none."""
        # transformers >= 5.24 names the returned cache "cache", older ones "past_key_values".
        past = getattr(out, "cache", None)
        if past is None:
            past = getattr(out, "past_key_values", None)
        if past is None:
            self._cached = False
        self._past = past
        return past is not None

    def _forward(self, tokens: list[int], in_cache: int) -> Any:
        """``tokens`` against the KV cache of the ``in_cache`` tokens before them (none yet: a
        new cache)."""
        inp = torch.tensor([tokens], dtype=torch.long, device=self.dev)
        mask = torch.ones((1, in_cache + len(tokens)), dtype=torch.long, device=self.dev)
        return self.model(input_ids=inp, attention_mask=mask, use_cache=True,
                          **cache_kwarg(self.model, self._past))

    @torch.no_grad()
    def _prefill(self) -> None:
        """The prompt's next ``prefill_chunk`` tokens into the KV cache (no token chosen)."""
        chunk = self.ids[self._fed: self._fed + self.prefill_chunk]
        # No cache returned: the next step runs the whole prompt.
        if self._keep_cache(self._forward(chunk, self._fed)):
            self._fed += len(chunk)

    def step(self) -> bool:
        """One forward and one chosen token (in a chunked prefill, before the prompt's last
        chunk: one chunk and no token); True when the generation is done (``max_new`` tokens,
        an end-of-sequence token or a stop string)."""
        if self.done:
            return True
        if (self.prefill_chunk is not None and self._cached and not self.steps
                and len(self.ids) - self._fed > self.prefill_chunk):
            self._prefill()
            return False
        row = self._logits()
        if self.bias_vec is not None:
            row = row + self.bias_vec[: row.shape[-1]]
        lp = torch.log_softmax(row, dim=-1)
        best = torch.argmax(row)
        # One host read per token: the token, its log-prob and the top-N, packed in float64
        # (ids < 2^53 and fp32 values convert exactly), instead of one read each.
        parts = [best.double().view(1), lp[best].double().view(1)]
        k = min(self.top_n, lp.shape[-1]) if self.top_n > 0 else 0
        if k:
            tv, ti = lp.topk(k)
            parts += [ti.double(), tv.double()]
        host = torch.cat(parts).tolist()
        tid = int(host[0])
        top = list(zip((int(t) for t in host[2:2 + k]), host[2 + k:], strict=True))
        self.steps.append((tid, host[1], top))
        if self.on_step is not None:
            self.on_step(self.steps[-1])
        if tid in self.eos_ids or len(self.steps) >= self.max_new:
            self.done = True
        elif self.stops is not None:
            text = self.tokenizer.decode([t for t, _, _ in self.steps],
                                         skip_special_tokens=False)
            # A token may complete a character the previous text showed as a replacement
            # character: search from where the texts first differ.
            if self.stops.first(text, _common_prefix(self._text, text)) is not None:
                self.done = True
            self._text = text
        if self.done:
            self.close()
        return self.done

    def result(self) -> list[GenStep]:
        """``(token id, log-prob, top-N pairs)`` of each generated token, in order (an
        end-of-sequence token included, a stop string's tokens too: the caller cuts the
        text)."""
        return self.steps

    def close(self) -> None:
        """Drop the KV cache."""
        self._past = None


__all__ = ["GenStep", "GenerationOptions", "GreedyGeneration", "StopStrings"]
