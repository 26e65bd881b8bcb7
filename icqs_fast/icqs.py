"""ICQS / ICQS-Epistemic scoring engine with a prefix-sharing batcher.

For every response (x, y) and every demonstration set (ratio j, set l),
``l_{j,l} = log P(y | demos_{j,l}, x)``; ICQS on set l is ``r_k``, ``k = argmax_j l_{j,l}``, and
ICQS-Epistemic is ``r_k`` with ``k = argmax_j mean_l l_{j,l}``.

The engine computes the KV caches of the ``(M+1) L`` demonstration prefixes once, then runs the
query + response tokens of many (response, context) rows in padded forwards against them, and
applies the LM head only at the response positions, through
:func:`icqs_fast.ops.linear_token_stats` (no ``[T, V]`` logits tensor).
"""

from __future__ import annotations

import warnings
import weakref
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
# (the naive reference uses these too, so both see the same demo sets and the same token ids)


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


def parse_response(i: int, item: Any) -> tuple[str, str]:
    """Validate the i-th response: an (x, y) pair or a dict with "x" and "y", both str, y
    non-empty."""
    if isinstance(item, dict):
        missing = [k for k in ("x", "y") if k not in item]
        if missing:
            raise ValueError(f"response {i}: missing field(s) {missing} (need 'x' and 'y')")
        x, y = item["x"], item["y"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x, y = item
    else:
        raise TypeError(f"response {i}: expected an (x, y) pair or a dict with 'x'/'y', "
                        f"got {type(item).__name__}")
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, str):
            raise TypeError(f"response {i}: field '{name}' must be a str, got {type(v).__name__}")
    if y == "":
        raise ValueError(f"response {i}: field 'y' is empty (nothing to score)")
    return x, y


class PromptTokens:
    """Tokenises prompt parts separately (prefix, query, response) with caching of prefixes.

    ``prefix_ids(c, drop)`` is the prefix of context ``c`` (flat index ``j * L + l``) without
    its ``drop`` oldest demonstrations; BOS is prepended when the tokenizer normally adds it.
    """

    def __init__(self, tokenizer: Any, template: Template, sets: list[list[DemoSet]]) -> None:
        self.tok = tokenizer
        self.template = template
        self.flat = [s for row in sets for s in row]
        self.bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
        self._prefix: dict[tuple[int, int], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prefix_ids(self, c: int, drop: int = 0) -> list[int]:
        key = (c, drop)
        if key not in self._prefix:
            demos = self.flat[c].examples[drop:]
            self._prefix[key] = self.bos + self.encode(self.template.format_prefix(demos))
        return self._prefix[key]

    def response_parts(self, i: int, x: str, y: str) -> tuple[list[int], list[int]]:
        q = self.encode(self.template.format_query(x))
        r = self.encode(self.template.format_response(y))
        if not q:
            raise ValueError(f"response {i}: the query part {self.template.format_query(x)!r} "
                             "has no tokens; the template's query must produce at least one")
        if not r:
            raise ValueError(f"response {i}: field 'y' gives no response tokens")
        return q, r

    def fit(self, i: int, c: int, n_suffix: int, max_len: int | None, drop_oldest: bool) -> int:
        """How many oldest demonstrations context ``c`` must drop so that prefix + ``n_suffix``
        tokens fit in ``max_len``; raises ValueError when it can't (or may not) drop."""
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
        num_ratios, demos_per_set, sets_per_ratio, seed, mixing, replacement: see
            :func:`icqs_fast.prompts.build_demo_sets` (``M+1``, ``N``, ``L``).
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
                                    seed=seed, mixing=mixing, replacement=replacement)
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
        self._entry: dict[tuple[int, int], int] = {}

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
            ids = [self.tokens.prefix_ids(c, 0) for c in range(self.n_contexts)]
            for c, e in enumerate(bank.add(ids)):
                self._entry[(c, 0)] = e
            self._bank = bank
        return self._bank

    def _entry_of(self, c: int, drop: int) -> int:
        bank = self.prefix_bank
        if (c, drop) not in self._entry:
            self._entry[(c, drop)] = bank.add([self.tokens.prefix_ids(c, drop)])[0]
        return self._entry[(c, drop)]

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
        q, r = self.tokens.response_parts(i, x, y)
        n_suf = len(q) + len(r)
        drops = [self.tokens.fit(i, c, n_suf, self.max_length, self.drop_oldest_demos)
                 for c in range(self.n_contexts)]
        entries = [self._entry_of(c, d) for c, d in enumerate(drops)]
        bank = self.prefix_bank
        return {"index": i, "query": q, "resp": r, "suffix": q + r[:-1], "drops": drops,
                "entries": entries, "plen": [bank.lengths[e] for e in entries],
                "loglik": torch.zeros(self.n_contexts, dtype=torch.float64),
                "stats": [None] * self.n_contexts, "done": 0}

    def _row_cost(self, rows: list[tuple[dict, int]]) -> int:
        if not rows:
            return 0
        p = 0 if self.cascade else max(rec["plen"][c] for rec, c in rows)
        s = max(len(rec["suffix"]) for rec, _ in rows)
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
            s2 = max(s, len(rec["suffix"]))
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
        suffixes = [rec["suffix"] for rec, _ in batch]
        hidden, _ = suffix_hidden(self.model, self.prefix_bank, entries, suffixes, self.pad_id,
                                  cascade=self.cascade)
        # Suffix position q-1+t predicts response token t.
        rows_idx, pos_idx, targets, seg = [], [], [], []
        for b, (rec, _) in enumerate(batch):
            nq, nr = len(rec["query"]), len(rec["resp"])
            rows_idx.extend([b] * nr)
            pos_idx.extend(range(nq - 1, nq - 1 + nr))
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
        nq = len(rec["query"])
        n_prompt = torch.tensor([p + nq for p in rec["plen"]], dtype=torch.long).reshape(m1, ls)
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
