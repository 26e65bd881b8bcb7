"""Token ids of the engine's prompts, as a plain forward over the whole prompt text sees them.

:class:`PromptTokens` tokenizes each (demonstration set, query, response) prompt as one string
(BOS as the tokenizer adds it) and finds the response tokens by character offsets
(:func:`first_response_token`); :meth:`PromptTokens.entry_ids` gives the prefix-bank entry of a
context up to a token boundary the whole-text tokenization shares, and :class:`PromptLayout`
where a prompt's context, query and response tokens lie. :class:`PromptTooLong` is raised for a
prompt over the length limit (unless the oldest demonstrations may be dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from icqs_fast.engine.prompts import DemoSet, Template, adds_bos

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptTooLong(ValueError):
    """A response's prompt exceeds the model's max length (even after dropping the demonstrations
    it may drop); ``reason`` is the message without the leading ``"response i: "``."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"response {index}: {reason}")
        self.index = index
        self.reason = reason


class EmptyPart(ValueError):
    """A response whose query part (``part="x"``) or response part (``"y"``) gives no tokens;
    ``reason`` is the message without the leading ``"response i: "`` (and the field)."""

    def __init__(self, index: int, part: str, reason: str) -> None:
        super().__init__(f"response {index}: " + (f"field 'y' {reason}" if part == "y"
                                                   else reason))
        self.index, self.part, self.reason = index, part, reason


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of one (response, context) prompt, tokenized as one string.

    Attributes:
        ids: BOS (when the tokenizer adds one) + the tokens of ``prefix + query + response``.
        n_prompt: tokens before the response: ``ids[n_prompt:]`` are the scored tokens.
        drop: the oldest demonstrations left out of the prefix (``drop_oldest_demos``).
        join: the response's first token merges with the context under whole-text
            tokenization: it begins before the response's first character (it holds the end of
            the query text too; it is scored with the response, see
            :func:`first_response_token`).
    """

    ids: list[int]
    n_prompt: int
    drop: int
    join: bool = False


def first_response_token(offsets: Sequence[tuple[int, int]], start: int) -> int:
    """Index of the first token that belongs to text starting at character ``start``.

    A token belongs to the prompt when its character span lies entirely before ``start``
    (``end <= start`` and ``begin < start``); every later token belongs to the response. So a
    token straddling the seam (it begins in the prompt and holds response characters) is
    scored with the response: every character of the response is scored, and a response is
    never left without tokens by a merge at the seam. ``offsets`` are the tokenizer's
    ``(begin, end)`` character spans, non-decreasing (fast tokenizers give them so).
    """
    k = len(offsets)
    while k > 0:
        a, b = offsets[k - 1]
        if b <= start and a < start:
            break
        k -= 1
    return k


def joins_response(offsets: Sequence[tuple[int, int]], start: int) -> bool:
    """Whether the first token of text starting at character ``start``
    (:func:`first_response_token`) begins before ``start``: it spans the prompt/response join."""
    k = first_response_token(offsets, start)
    return k < len(offsets) and offsets[k][0] < start


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


class PromptTokens:
    """Whole-text tokenization of the ICQS prompts, and the cached prefix ids the bank holds.

    The scored ids of a (response, context) prompt are those of ``prefix + query + response``
    tokenized as one string (BOS first when the tokenizer adds one), exactly as a plain forward
    over the full text sees them; the response tokens are found by character offsets
    (:func:`first_response_token`). Tokenizing the parts separately differs at the seams (the
    embedded SmolLM2 tokenizer gives ``"\\n\\n"`` at the end of a prefix alone as one token
    ``ĊĊ`` but as ``Ċ``, ``Ċ`` before ``Sentence``), which moves the response's log-likelihood
    by 0.1-0.3 nats.

    ``entry_ids(c, drop)`` is what the prefix bank stores for context ``c`` (flat index
    ``j * L + l``) without its ``drop`` oldest demonstrations: BOS + the prefix's leading tokens
    up to a boundary the whole-text tokenization shares - the prefix tokenized alone and followed
    by two probe queries, cut to their common leading tokens and before any token that touches
    the prefix's last character. The engine still checks, per response and context, that the
    whole-text ids start with the entry (and uses a shorter entry when they don't).

    Needs a fast (Rust-backed) tokenizer, for the offsets.
    """

    # Probe (x, y) pairs whose query + response text follows each prefix when the bank boundary
    # is chosen: different first characters, so a template whose query starts with {x} shows
    # which prefix tokens the query may merge with.
    PROBES = (("a", "a"), ("0 .", "B"))
    LAYOUT_CACHE = 32

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: Template,
                 sets: list[list[DemoSet]]) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer: the ICQS "
                            "engine needs character offsets (return_offsets_mapping) to find the "
                            "response tokens in the whole prompt; load it with use_fast=True")
        self.tok = tokenizer
        self.template = template
        self.flat = [s for row in sets for s in row]
        self.bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        self._text: dict[tuple[int, int], str] = {}
        self._prefix: dict[tuple[int, int], list[int]] = {}
        self._entry: dict[tuple[int, int], list[int]] = {}
        # The layouts of the last few responses: a caller that checks a record with
        # layouts() before the engine scores it (the score CLI) tokenizes it once.
        self._layouts: OrderedDict[tuple, list[PromptLayout]] = OrderedDict()
        self._parts: OrderedDict[tuple, tuple[list[int], list[int]]] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` alone (no special tokens added)."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def tokenize(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """``(ids, offsets)`` of each text (one batched call; no special tokens added)."""
        enc = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(list(ids), [tuple(o) for o in offs])
                for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]

    def prefix_text(self, c: int, drop: int = 0) -> str:
        """The demonstration prefix text of context ``c`` without its ``drop`` oldest demos."""
        key = (c, drop)
        if key not in self._text:
            self._text[key] = self.template.format_prefix(self.flat[c].examples[drop:])
        return self._text[key]

    def prefix_ids(self, c: int, drop: int = 0) -> list[int]:
        """BOS + the prefix text tokenized alone (its own seam at the end: not what the engine
        scores; see :meth:`entry_ids`)."""
        key = (c, drop)
        if key not in self._prefix:
            self._prefix[key] = self.bos + self.encode(self.prefix_text(c, drop))
        return self._prefix[key]

    def entry_ids(self, c: int, drop: int = 0) -> list[int]:
        """The ids the prefix bank stores for context ``c`` (see the class docstring); may be
        empty (no BOS and a prefix of one pre-token), then the engine falls back per response."""
        key = (c, drop)
        if key not in self._entry:
            p = self.prefix_text(c, drop)
            probes = [self.template.format_query(x) + self.template.format_response(y)
                      for x, y in self.PROBES]
            (ids, offs), *rest = self.tokenize([p] + [p + t for t in probes])
            m = min(common_prefix(ids, other) for other, _ in rest)
            while m > 0 and offs[m - 1][1] >= len(p):  # never a token touching the seam
                m -= 1
            self._entry[key] = self.bos + ids[:m]
        return self._entry[key]

    def response_parts(self, i: int, x: str, y: str) -> tuple[list[int], list[int]]:
        """The query and response texts tokenized alone; raises :class:`EmptyPart` (a
        ValueError) when either has no tokens (the check the engine runs on each response; the
        scored ids come from :meth:`layouts`). Cached like :meth:`layouts`: a caller that checks
        a record before the engine scores it (the score job) tokenizes it once."""
        key = (x, y)
        if key in self._parts:
            self._parts.move_to_end(key)
            return self._parts[key]
        q = self.encode(self.template.format_query(x))
        r = self.encode(self.template.format_response(y))
        if not q:
            raise EmptyPart(i, "x", f"the query part {self.template.format_query(x)!r} has no "
                            "tokens; the template's query must produce at least one")
        if not r:
            raise EmptyPart(i, "y", "gives no response tokens")
        self._parts[key] = (q, r)
        if len(self._parts) > self.LAYOUT_CACHE:
            self._parts.popitem(last=False)
        return q, r

    def layouts(self, i: int, x: str, y: str, max_len: int | None, drop_oldest: bool
                ) -> list[PromptLayout]:
        """The whole-text ids of response ``(x, y)`` after every context, each dropping as few
        oldest demonstrations as it needs to fit ``max_len`` (at least one demonstration kept).

        Raises:
            PromptTooLong: a prompt does not fit (and may not, or can't, drop enough).
            ValueError: a prompt with fewer than two tokens before the response, or a response
                split into different tokens after different contexts.
        """
        key = (x, y, max_len, bool(drop_oldest))
        if key in self._layouts:
            self._layouts.move_to_end(key)
            return self._layouts[key]
        lays = self._layouts_uncached(i, x, y, max_len, drop_oldest)
        self._layouts[key] = lays
        if len(self._layouts) > self.LAYOUT_CACHE:
            self._layouts.popitem(last=False)
        return lays

    def _layouts_uncached(self, i: int, x: str, y: str, max_len: int | None, drop_oldest: bool
                          ) -> list[PromptLayout]:
        q = self.template.format_query(x)
        qr = q + self.template.format_response(y)
        n_ctx = len(self.flat)
        drops = [0] * n_ctx
        out: list[PromptLayout | None] = [None] * n_ctx
        todo = list(range(n_ctx))
        while todo:
            encs = self.tokenize([self.prefix_text(c, drops[c]) + qr for c in todo])
            nxt = []
            for c, (ids, offs) in zip(todo, encs, strict=True):
                start = len(self.prefix_text(c, drops[c])) + len(q)
                full = self.bos + ids
                k0 = len(self.bos) + first_response_token(offs, start)
                if max_len is None or len(full) <= max_len:
                    out[c] = PromptLayout(full, k0, drops[c], joins_response(offs, start))
                elif drop_oldest and drops[c] + 1 < len(self.flat[c].examples):
                    drops[c] += 1
                    nxt.append(c)
                else:
                    alone = len(self.bos) + len(self.tokenize([qr])[0][0])
                    if alone >= max_len:  # no demonstration count can help
                        raise PromptTooLong(i, (
                            f"the query and response alone are {alone} tokens, not less than "
                            f"the model's max length {max_len}: no prompt with demonstrations "
                            "fits; shorten the response or raise the max length"))
                    ds = self.flat[c]
                    raise PromptTooLong(i, (
                        f"prompt of {len(full)} tokens (prefix and query {k0} + response "
                        f"{len(full) - k0}) for ratio {ds.ratio:g} set {ds.set_index} exceeds "
                        f"the model's max length {max_len}"
                        + (" even with a single demonstration" if drop_oldest
                           else "; pass drop_oldest_demos=True to drop demonstrations")))
            todo = nxt
        lays = [lay for lay in out if lay is not None]
        resp = lays[0].ids[lays[0].n_prompt:]
        for c, lay in enumerate(lays):
            if lay.n_prompt < 2:
                raise ValueError(f"response {i}: the prompt before the response has "
                                 f"{lay.n_prompt} token(s); the engine needs at least two")
            if lay.ids[lay.n_prompt:] != resp:
                raise ValueError(
                    f"response {i}: the tokenizer splits the response differently after "
                    f"context {c} than after context 0 ({lay.ids[lay.n_prompt:]} vs {resp}); "
                    "ICQS compares the same tokens across contexts - use a template whose "
                    "query starts with fixed text")
        return lays

    def fit(self, i: int, c: int, n_suffix: int, max_len: int | None, drop_oldest: bool) -> int:
        """How many oldest demonstrations context ``c`` must drop so that its prefix tokenized
        alone + ``n_suffix`` tokens fit in ``max_len`` (an estimate from the split lengths,
        kept for callers that pre-check records; the engine uses :meth:`layouts`, exact)."""
        if max_len is None:
            return 0
        n_demos = len(self.flat[c].examples)
        full = len(self.prefix_ids(c, 0)) + n_suffix
        if full <= max_len:
            return 0
        if drop_oldest:
            for d in range(1, n_demos):  # keep at least one demonstration
                if len(self.prefix_ids(c, d)) + n_suffix <= max_len:
                    return d
        ds = self.flat[c]
        raise ValueError(
            f"response {i}: prompt of {full} tokens (prefix {full - n_suffix} + query/response "
            f"{n_suffix}) for ratio {ds.ratio:g} set {ds.set_index} exceeds the model's max "
            f"length {max_len}"
            + (" even with a single demonstration" if drop_oldest
               else "; pass drop_oldest_demos=True to drop demonstrations")
        )
