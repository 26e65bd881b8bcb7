"""ICQS / ICQS-Epistemic scoring engine with a prefix-sharing batcher.

For every response (x, y) and every demonstration set (ratio j, set l),
``l_{j,l} = log P(y | demos_{j,l}, x)``; ICQS on set l is ``r_k``, ``k = argmax_j l_{j,l}``, and
ICQS-Epistemic is ``r_k`` with ``k = argmax_j mean_l l_{j,l}``.

The engine computes the KV caches of the ``(M+1) L`` demonstration prefixes once, then runs the
rest of many (response, context) prompts in padded forwards against them, and applies the LM
head only at the response positions, through :func:`icqs_fast.ops.linear_token_stats` (no
``[T, V]`` logits tensor).

Token ids are those of the whole prompt text (prefix + query + response as one string, BOS as
the tokenizer adds it), as a plain forward over the full text sees them; the response tokens
are found by character offsets (:func:`first_response_token`). The bank holds each prefix up to
a token boundary that the whole-text tokenization shares (:meth:`PromptTokens.entry_ids`,
checked per prompt), and the prefix's remaining tokens run with the query and response.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import ops
from .batching import PrefixBank, check_padded_kv, suffix_hidden
from .cascade import supports_cascade
from .prompts import DemoSet, Template, adds_bos, build_demo_sets
from .types import TokenStats

DEFAULT_TOKEN_BUDGET = 16384
# Suffix forwards with cascade attention on the CPU: at most this many rows x suffix tokens per
# forward (bigger forwards push the elementwise work out of the caches and measured slower on the
# shared 2-core CPU, and hold more activations: 16 responses x 20 contexts, peak RSS growth
# ~535 MB at 4096 vs ~250-300 MB at 1024, time no worse; the GPU uses the full token budget).
SUFFIX_CHUNK_CPU = 1024


@dataclass
class ICQSResult:
    """Scores of one response.

    Attributes:
        score: ICQS-Epistemic score, ``ratios[argmax_j mean_l loglik[j, l]]``.
        score_per_set: ``L`` floats, plain ICQS on each set l: ``ratios[argmax_j loglik[j, l]]``.
        loglik: ``[M+1, L]`` fp32, ``log P(y | demos_{j,l}, x)`` summed over y's tokens.
        ratios: ``M+1`` floats ``j / M``.
        n_response_tokens: number of scored tokens of y.
        n_prompt_tokens: ``[M+1, L]`` int64, prompt tokens before y (prefix + query) per context.
        n_dropped_demos: ``[M+1, L]`` int64, demonstrations dropped to fit the max length.
        token_stats: per-token statistics, each field ``[M+1, L, T]``, when requested.
        index: the response's position in the input stream.
    """

    score: float
    score_per_set: list[float]
    loglik: torch.Tensor
    ratios: list[float]
    n_response_tokens: int
    n_prompt_tokens: torch.Tensor
    n_dropped_demos: torch.Tensor
    token_stats: TokenStats | None = None
    index: int = 0


# --------------------------------------------------------------------------- shared helpers
# (the naive reference uses model_max_length, parse_response and summarise; it tokenizes the
# prompts with its own code, so a seam difference in the engine's tokenization shows in tests)


def model_max_length(model: Any, max_length: int | None) -> int | None:
    """The longest prompt the model takes: ``max_length`` if given, capped by the config's
    ``max_position_embeddings`` / ``n_positions``; None if neither is known."""
    cfg = model.config
    lim = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if max_length is not None:
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        return min(max_length, lim) if lim else max_length
    return int(lim) if lim else None


# Largest |log_softmax difference| accepted between the fused head and the model's own logits,
# relative to max(1, max |logit|): the fused head computes in fp32 from the body's hidden states
# while the model's lm_head rounds its logits to the model dtype (bf16: 2^-8 relative), so the
# tolerance follows the dtype. A logit scale or a softcap changes them by a whole factor.
HEAD_CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 8e-3,
                   torch.bfloat16: 4e-2}
# Models already checked, with what they were checked in: (dtype, device, head weight storage).
_HEAD_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _head_signature(model: Any) -> tuple:
    w = model.get_output_embeddings().weight
    return (w.dtype, w.device, w.data_ptr(), tuple(w.shape))


@torch.no_grad()
def check_model(model: Any) -> None:
    """Refuse models whose logits are not what the fused head computes.

    The engine (and the glass-box features) never run the model's LM head: they take the
    decoder body's final (normed) hidden states ``h`` and compute ``log_softmax(h @ W.T + b)``
    with :func:`icqs_fast.ops.linear_token_stats`. Any logit post-processing in the model's own
    ``forward`` (final-logit softcapping, a logit scale, a temperature baked into the head, ...)
    would then be dropped silently. So one short forward (4 tokens: BOS + 3 fixed ids) of the
    model itself is compared with the fused head on the body's hidden states of that same
    forward (captured by a hook: one forward in all); log-softmax is compared, so a per-row
    additive shift, which changes no statistic, passes. Cached per model object (and its head
    weight's dtype, device and storage), so repeated constructions cost nothing.

    Raises:
        NotImplementedError: naming the model class, the largest difference and the likely
            cause, when the two differ by more than ``HEAD_CHECK_RTOL[dtype] * max(1, max|z|)``.
        TypeError: when the model has no separate decoder body or no output embeddings.
    """
    from .batching import decoder_body, model_device

    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise TypeError(f"{type(model).__name__} has no linear output embeddings (LM head)")
    sig = _head_signature(model)
    if _HEAD_CHECKED.get(model) == sig:
        return
    body = decoder_body(model)
    v = int(head.weight.shape[0])
    bos = getattr(model.config, "bos_token_id", None)
    first = int(bos) if isinstance(bos, int) and 0 <= bos < v else 0
    ids = torch.tensor([[first, 1 % v, v // 2, v - 1]], device=model_device(model))
    seen: list[torch.Tensor] = []
    hook = body.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        hook.remove()
    if len(seen) != 1:
        raise TypeError(f"{type(model).__name__}: its decoder body ran {len(seen)} times in one "
                        "forward; the engine needs body -> LM head")
    h = seen[0][0]
    z = h.float() @ head.weight.float().t()
    if getattr(head, "bias", None) is not None:
        z = z + head.bias.float()
    diff = float((torch.log_softmax(z, -1) - torch.log_softmax(logits, -1)).abs().max())
    scale = max(1.0, float(logits.abs().max()), float(z.abs().max()))
    tol = HEAD_CHECK_RTOL.get(head.weight.dtype, 4e-2) * scale
    if not diff <= tol:  # also refuses NaN
        cfg = model.config
        hints = [f"{a}={getattr(cfg, a)}" for a in
                 ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
                 if getattr(cfg, a, None) not in (None, 1, 1.0)]
        likely = (f" (its config sets {', '.join(hints)})" if hints else
                  " (e.g. final-logit softcapping, a logit scale or temperature, or a head "
                  "other than one linear layer)")
        raise NotImplementedError(
            f"{type(model).__name__} post-processes its logits{likely}: its own logits differ "
            f"from the fused LM head (final hidden state @ lm_head.weight.T + bias) by up to "
            f"{diff:.3g} in log-probability (tolerance {tol:.2g} for {head.weight.dtype}); the "
            "engine only supports a plain linear LM head"
        )
    _HEAD_CHECKED[model] = sig


def parse_response(i: int, item: Any, *, noun: str = "response", allow_empty: bool = False
                   ) -> tuple[str, str]:
    """Validate the i-th response: an (x, y) pair or a dict with "x" and "y", both str, y
    non-empty unless ``allow_empty``; errors start with ``"{noun} {i}: "``."""
    if isinstance(item, dict):
        missing = [k for k in ("x", "y") if k not in item]
        if missing:
            raise ValueError(f"{noun} {i}: missing field(s) {missing} (need 'x' and 'y')")
        x, y = item["x"], item["y"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x, y = item
    else:
        raise TypeError(f"{noun} {i}: expected an (x, y) pair or a dict with 'x'/'y', "
                        f"got {type(item).__name__}")
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, str):
            raise TypeError(f"{noun} {i}: field '{name}' must be a str, got {type(v).__name__}")
    if y == "" and not allow_empty:
        raise ValueError(f"{noun} {i}: field 'y' is empty (nothing to score)")
    return x, y


class PromptTooLong(ValueError):
    """A response's prompt exceeds the model's max length (even after dropping the demonstrations
    it may drop); ``reason`` is the message without the leading ``"response i: "``."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"response {index}: {reason}")
        self.index = index
        self.reason = reason


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of one (response, context) prompt, tokenized as one string.

    Attributes:
        ids: BOS (when the tokenizer adds one) + the tokens of ``prefix + query + response``.
        n_prompt: tokens before the response: ``ids[n_prompt:]`` are the scored tokens.
        drop: the oldest demonstrations left out of the prefix (``drop_oldest_demos``).
    """

    ids: list[int]
    n_prompt: int
    drop: int


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
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

    def __init__(self, tokenizer: Any, template: Template, sets: list[list[DemoSet]]) -> None:
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
            m = min(_common_prefix(ids, other) for other, _ in rest)
            while m > 0 and offs[m - 1][1] >= len(p):  # never a token touching the seam
                m -= 1
            self._entry[key] = self.bos + ids[:m]
        return self._entry[key]

    def response_parts(self, i: int, x: str, y: str) -> tuple[list[int], list[int]]:
        """The query and response texts tokenized alone; raises ValueError when either has no
        tokens (the check the engine runs on each response; the scored ids come from
        :meth:`layouts`)."""
        q = self.encode(self.template.format_query(x))
        r = self.encode(self.template.format_response(y))
        if not q:
            raise ValueError(f"response {i}: the query part {self.template.format_query(x)!r} "
                             "has no tokens; the template's query must produce at least one")
        if not r:
            raise ValueError(f"response {i}: field 'y' gives no response tokens")
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
                    out[c] = PromptLayout(full, k0, drops[c])
                elif drop_oldest and drops[c] + 1 < len(self.flat[c].examples):
                    drops[c] += 1
                    nxt.append(c)
                else:
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


def summarise(index: int, loglik: torch.Tensor, ratios: list[float], n_resp: int,
              n_prompt: torch.Tensor, n_drop: torch.Tensor, stats: TokenStats | None
              ) -> ICQSResult:
    """Build an :class:`ICQSResult` from ``loglik`` ``[M+1, L]`` (fp32)."""
    ll = loglik.double()
    per_set = [ratios[int(k)] for k in torch.argmax(ll, dim=0)]
    score = ratios[int(torch.argmax(ll.mean(dim=1)))]
    return ICQSResult(score=score, score_per_set=per_set, loglik=loglik.float(), ratios=ratios,
                      n_response_tokens=n_resp, n_prompt_tokens=n_prompt,
                      n_dropped_demos=n_drop, token_stats=stats, index=index)


# --------------------------------------------------------------------------- the engine


class ICQSScorer:
    """ICQS / ICQS-Epistemic scorer with cached demonstration prefixes.

    Args:
        model: a causal LM (Llama-like or GPT-2-like: ``base_model`` body + linear
            ``get_output_embeddings()`` head), in eval mode.
        tokenizer: its tokenizer (needs a pad or eos token).
        good, bad: demonstration pools of (x, y) str pairs.
        num_ratios, demos_per_set, sets_per_ratio, seed, mixing, replacement, stratify,
            strata_order: see :func:`icqs_fast.prompts.build_demo_sets` (``M+1``, ``N``,
            ``L``; default ``stratify="auto"``: when the answers are labels, every set holds the
            same labels in the same positions at every ratio, so only correctness changes with
            the ratio (on FPB / SST-2 with the embedded model the correct-vs-incorrect AUC rose
            0.43 -> 0.60 and 0.56 -> 0.71, means of 3 seeds); ``"y"``: always by the answer;
            ``None``: unstratified).
        template: prompt formats; the default "Sentence/Answer" :class:`Template` if None.
        backend: backend of :func:`icqs_fast.ops.linear_token_stats`.
        token_budget: tokens per forward: rows x suffix tokens with cascade attention
            (Llama family, GPT-2: the prefix states are shared, not copied per row), rows x
            (prefix + suffix) tokens on the KV-copy fallback path; also the prefix forwards'
            rows x prefix tokens (capped at ``PREFIX_CHUNK_CPU`` on the CPU).
        cascade: suffix forwards with cascade attention (:mod:`icqs_fast.cascade`); None =
            when the model supports it, False = always the per-row KV-copy path.
        max_length: prompt length limit (default: the model's max positions).
        drop_oldest_demos: when a prompt is too long, drop that set's oldest demonstrations
            until it fits instead of raising.
        return_token_stats: attach per-token :class:`TokenStats` to each result.

    Token ids are those of each whole prompt text (:class:`PromptTokens`; a fast tokenizer is
    needed, for the offsets). ``seam_fallbacks`` counts the (response, context) prompts whose ids
    did not start with their context's cached prefix entry; each such prompt runs against an
    entry of its own (still exact, slower; a warning the first time).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        good: Sequence,
        bad: Sequence,
        *,
        num_ratios: int = 5,
        demos_per_set: int = 8,
        sets_per_ratio: int = 4,
        template: Template | None = None,
        seed: int = 0,
        mixing: str = "exact",
        replacement: bool = False,
        stratify: str | Sequence | None = "auto",
        strata_order: str = "fixed",
        backend: str = "auto",
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        max_length: int | None = None,
        drop_oldest_demos: bool = False,
        return_token_stats: bool = False,
        cascade: bool | None = None,
    ) -> None:
        check_padded_kv(model)
        check_model(model)
        if getattr(model, "training", False):
            warnings.warn("the model is in training mode (dropout is active); call model.eval() "
                          "for deterministic scores", stacklevel=2)
        if not isinstance(token_budget, int) or token_budget < 1:
            raise ValueError(f"token_budget must be an int >= 1, got {token_budget!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.template = template if template is not None else Template()
        self.sets = build_demo_sets(good, bad, num_ratios=num_ratios,
                                    demos_per_set=demos_per_set, sets_per_ratio=sets_per_ratio,
                                    seed=seed, mixing=mixing, replacement=replacement,
                                    stratify=stratify, strata_order=strata_order)
        self.ratios = [row[0].ratio for row in self.sets]
        self.num_ratios, self.sets_per_ratio = num_ratios, sets_per_ratio
        self.n_contexts = num_ratios * sets_per_ratio
        self.backend = backend
        self.token_budget = token_budget
        self.max_length = model_max_length(model, max_length)
        self.drop_oldest_demos = drop_oldest_demos
        self.return_token_stats = return_token_stats
        self.cascade = supports_cascade(model) if cascade is None else bool(cascade)
        self.tokens = PromptTokens(tokenizer, self.template, self.sets)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._bank: PrefixBank | None = None
        self._entry: dict[tuple[int, int], int | None] = {}
        # Bank entries computed per response where the whole-text ids did not start with the
        # context's cached entry (keyed by their ids), and how often that happened.
        self._fallback_entry: dict[tuple[int, ...], int] = {}
        self.seam_fallbacks = 0

    @property
    def _budget(self) -> int:
        """Tokens per suffix forward (see ``token_budget``)."""
        if self.cascade and next(self.model.parameters()).device.type == "cpu":
            return min(self.token_budget, SUFFIX_CHUNK_CPU)
        return self.token_budget

    # -- prefix caches --------------------------------------------------------------------
    @property
    def prefix_bank(self) -> PrefixBank:
        """The stored prefix KV states, computed on first use (all contexts, batched)."""
        if self._bank is None:
            bank = PrefixBank(self.model, self.pad_id, self.token_budget)
            ids = [self.tokens.entry_ids(c, 0) for c in range(self.n_contexts)]
            keep = [c for c in range(self.n_contexts) if ids[c]]
            for c in range(self.n_contexts):
                self._entry[(c, 0)] = None
            for c, e in zip(keep, bank.add([ids[c] for c in keep]), strict=True):
                self._entry[(c, 0)] = e
            self._bank = bank
        return self._bank

    def _entry_of(self, i: int, c: int, lay: PromptLayout) -> int:
        """The bank entry prompt ``lay`` (response i, context c) continues from: the context's
        cached entry when ``lay.ids`` starts with it (and it ends before the response), else
        an entry for the longest such common start, computed now (and kept for reuse)."""
        bank = self.prefix_bank
        key = (c, lay.drop)
        if key not in self._entry:
            ids = self.tokens.entry_ids(c, lay.drop)
            self._entry[key] = bank.add([ids])[0] if ids else None
        e = self._entry[key]
        if e is not None:
            n = bank.lengths[e]
            if n < lay.n_prompt and lay.ids[:n] == self.tokens.entry_ids(c, lay.drop):
                return e
            n = _common_prefix(lay.ids, self.tokens.entry_ids(c, lay.drop))
        else:  # no cached entry for this context: the first token alone (bounded, slow)
            n = 1
        # The entry must end before the response's first prediction (position n_prompt - 1).
        n = max(1, min(n, lay.n_prompt - 1))
        fkey = tuple(lay.ids[:n])
        if fkey not in self._fallback_entry:
            if not self._fallback_entry:
                warnings.warn(
                    f"response {i}: its whole-text token ids after context {c} do not start "
                    "with the cached prefix tokens (a tokenizer seam inside the demonstrations); "
                    "such prompts get a prefix entry of their own (exact, slower)", stacklevel=4)
            self._fallback_entry[fkey] = bank.add([list(fkey)])[0]
        self.seam_fallbacks += 1
        return self._fallback_entry[fkey]

    # -- scoring --------------------------------------------------------------------------
    def score_one(self, x: str, y: str) -> ICQSResult:
        """Score a single response (x, y)."""
        return next(iter(self.score([(x, y)])))

    def score(self, responses: Iterable) -> Iterator[ICQSResult]:
        """Score a stream of responses lazily, in order.

        Args:
            responses: iterable of (x, y) str pairs or dicts with "x" and "y".

        Yields:
            one :class:`ICQSResult` per response, in input order; input is pulled only as far
            as the current batch needs.
        """
        c_n = self.n_contexts
        pending: list[dict] = []  # prepared responses whose rows are not all done yet
        rows: list[tuple[dict, int]] = []  # queued (response, context) rows
        it = enumerate(responses)
        exhausted = False
        while True:
            # Fill the row queue until one forward's budget is reached (or the input ends).
            while not exhausted and self._queued_tokens(rows) < self._budget:
                try:
                    i, item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                rec = self._prepare(i, item)
                pending.append(rec)
                rows.extend((rec, c) for c in range(c_n))
            if not rows:
                break
            take = self._take(rows)
            batch, rows = rows[:take], rows[take:]
            self._run(batch)
            while pending and pending[0]["done"] == c_n:
                yield self._finish(pending.pop(0))
        while pending:  # only reached when every row ran
            yield self._finish(pending.pop(0))

    def _prepare(self, i: int, item: Any) -> dict:
        x, y = parse_response(i, item)
        self.tokens.response_parts(i, x, y)  # both parts must give tokens (clear errors)
        lays = self.tokens.layouts(i, x, y, self.max_length, self.drop_oldest_demos)
        entries = [self._entry_of(i, c, lay) for c, lay in enumerate(lays)]
        plen = [self.prefix_bank.lengths[e] for e in entries]
        # Row c runs ids[plen:-1] against its entry; suffix position n_prompt - 1 - plen + t
        # predicts response token t.
        return {"index": i, "resp": lays[0].ids[lays[0].n_prompt:],
                "suffix": [lay.ids[p:-1] for lay, p in zip(lays, plen, strict=True)],
                "rstart": [lay.n_prompt - 1 - p for lay, p in zip(lays, plen, strict=True)],
                "n_prompt": [lay.n_prompt for lay in lays], "drops": [lay.drop for lay in lays],
                "entries": entries, "plen": plen,
                "loglik": torch.zeros(self.n_contexts, dtype=torch.float64),
                "stats": [None] * self.n_contexts, "done": 0}

    def _row_cost(self, rows: list[tuple[dict, int]]) -> int:
        if not rows:
            return 0
        p = 0 if self.cascade else max(rec["plen"][c] for rec, c in rows)
        s = max(len(rec["suffix"][c]) for rec, c in rows)
        return len(rows) * (p + s)

    def _queued_tokens(self, rows: list[tuple[dict, int]]) -> int:
        return self._row_cost(rows)

    def _take(self, rows: list[tuple[dict, int]]) -> int:
        """Largest leading run of rows within the token budget (at least one); with cascade
        attention cut at a response boundary when one fits, so every prefix entry gets the same
        number of rows (the attention then runs as one batched call per layer)."""
        p = s = 0
        take = len(rows)
        for n, (rec, c) in enumerate(rows):
            p2 = 0 if self.cascade else max(p, rec["plen"][c])
            s2 = max(s, len(rec["suffix"][c]))
            if n > 0 and (n + 1) * (p2 + s2) > self._budget:
                take = n
                break
            p, s = p2, s2
        if self.cascade and take < len(rows):
            bounds = [n for n in range(1, take + 1) if rows[n][0] is not rows[n - 1][0]]
            if bounds:
                take = bounds[-1]
        return take

    @torch.no_grad()
    def _run(self, batch: list[tuple[dict, int]]) -> None:
        if self.cascade:  # entry-major rows: the cascade attention groups rows by entry
            batch = sorted(batch, key=lambda rc: rc[0]["entries"][rc[1]])
        entries = [rec["entries"][c] for rec, c in batch]
        suffixes = [rec["suffix"][c] for rec, c in batch]
        hidden, _ = suffix_hidden(self.model, self.prefix_bank, entries, suffixes, self.pad_id,
                                  cascade=self.cascade)
        rows_idx, pos_idx, targets, seg = [], [], [], []
        for b, (rec, c) in enumerate(batch):
            r0, nr = rec["rstart"][c], len(rec["resp"])
            rows_idx.extend([b] * nr)
            pos_idx.extend(range(r0, r0 + nr))
            targets.extend(rec["resp"])
            seg.append(nr)
        dev = hidden.device
        h = hidden[torch.tensor(rows_idx, device=dev), torch.tensor(pos_idx, device=dev)]
        head = self.model.get_output_embeddings()
        st = ops.linear_token_stats(h, head.weight, torch.tensor(targets, device=dev),
                                    bias=getattr(head, "bias", None), backend=self.backend)
        lp = st.logprob.detach().double().cpu()
        start = 0
        for (rec, c), nr in zip(batch, seg, strict=True):
            rec["loglik"][c] = lp[start:start + nr].sum()
            if self.return_token_stats:
                rec["stats"][c] = st.map(lambda t, a=start, b=start + nr: t[a:b].detach().cpu())
            rec["done"] += 1
            start += nr

    def _finish(self, rec: dict) -> ICQSResult:
        m1, ls = self.num_ratios, self.sets_per_ratio
        ll = rec["loglik"].float().reshape(m1, ls)
        n_prompt = torch.tensor(rec["n_prompt"], dtype=torch.long).reshape(m1, ls)
        n_drop = torch.tensor(rec["drops"], dtype=torch.long).reshape(m1, ls)
        stats = None
        if self.return_token_stats:
            parts = rec["stats"]
            stats = TokenStats(**{
                k: torch.stack([getattr(p, k) for p in parts]).reshape(m1, ls, -1)
                for k in parts[0].as_dict()
            })
        return summarise(rec["index"], ll, self.ratios, len(rec["resp"]), n_prompt, n_drop,
                         stats)
