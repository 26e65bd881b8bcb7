"""The memory plan before the first forward: the prefix bank, one forward's activations and the
fused head's partial states, from the model's config, against the device's free memory.

The bank is ``[entries, kv_heads, P_max, head_dim]`` keys and values per attention layer
(Llama-2-7B: 32 layers x 2 x 32 heads x 128 x 2 bytes = 0.5 MiB per stored token), so
``--num-ratios 21 --sets-per-ratio 16`` (336 entries) of 1,000-token prefixes needs 164 GiB
before a single response is scored. :func:`plan_memory` says so up front: a bank that does not
fit is refused with the numbers and the flags that shrink it; activations that do not fit lower
the token budget (the job splits its forwards) down to :data:`MIN_TOKEN_BUDGET`, below which
it is refused naming ``--token-budget``. On the CPU (no free-memory reading here) the plan is
only reported.

The activation figure is an estimate per token of a decoder layer's live tensors in the model
dtype (the residual stream and its norm, q / k / v, the attention output, the MLP's gate, up
and activation), which the forward's allocator holds at its peak; the fused head's partial
states are bounded by :data:`icqs_fast.kernels.linear_token_stats.PARTIAL_BUDGET`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast.engine.layout import text_config

if TYPE_CHECKING:
    from icqs_fast.engine.scorer import ICQSScorer

MIN_TOKEN_BUDGET = 256  # fewer tokens per forward than this: refused, not crawled through
HEADROOM = 0.9  # the share of the free memory the plan may use (allocator slack, CUDA context)
HEAD_PARTIALS = 64 << 20  # the fused head's partial states at most (kernels' PARTIAL_BUDGET)
GIB = float(1 << 30)


@dataclass(frozen=True)
class MemoryPlan:
    """What a run needs on its device and what it does about it.

    Attributes:
        bank_bytes: the prefix bank (keys and values of every entry, every attention layer).
        per_token_bytes: one forward's activations per token (estimate).
        head_bytes: the fused head's partial states, at most.
        free_bytes: the device's free memory (None: not known, the CPU).
        token_budget: the tokens per forward the run uses (the asked one, or lower to fit).
        asked_budget: the ``--token-budget`` asked for.
    """

    bank_bytes: int
    per_token_bytes: int
    head_bytes: int
    free_bytes: int | None
    token_budget: int
    asked_budget: int

    @property
    def split(self) -> bool:
        """Whether the forwards were made smaller than asked to fit."""
        return self.token_budget < self.asked_budget

    def line(self) -> str:
        """One line for the log: the figures, and what was done."""
        need = self.bank_bytes + self.head_bytes + self.per_token_bytes * self.token_budget
        free = "" if self.free_bytes is None else f" of {self.free_bytes / GIB:.1f} GiB free"
        text = (f"memory plan: prefix bank {self.bank_bytes / GIB:.2f} GiB + "
                f"{self.token_budget} tokens per forward x {self.per_token_bytes / 1024:.0f} KiB"
                f" + head {self.head_bytes / GIB:.2f} GiB = {need / GIB:.2f} GiB{free}")
        if self.split:
            text += (f"; --token-budget {self.asked_budget} lowered to {self.token_budget} "
                     "to fit")
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"bank_bytes": self.bank_bytes, "per_token_bytes": self.per_token_bytes,
                "head_bytes": self.head_bytes, "free_bytes": self.free_bytes,
                "token_budget": self.token_budget, "asked_budget": self.asked_budget}


def bank_bytes(config: Any, entries: int, p_max: int, element_size: int) -> int:
    """Bytes of a prefix bank of ``entries`` prefixes padded to ``p_max`` tokens."""
    cfg = text_config(config)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers) * 2 * entries * kv * p_max * d * element_size


def per_token_bytes(config: Any, element_size: int) -> int:
    """One forward's activations per token (see the module docstring)."""
    cfg = text_config(config)
    h = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or h // heads)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * h)
    # residual + norm + attention output + layer output; q, k, v; gate, up, activation
    return element_size * (4 * h + (heads + 2 * kv) * d + 3 * inter)


def plan_memory(config: Any, *, entries: int, p_max: int, token_budget: int,
                element_size: int, free_bytes: int | None) -> MemoryPlan:
    """The plan (see the module docstring) for a bank of ``entries`` prefixes of at most
    ``p_max`` tokens and forwards of ``token_budget`` tokens, in ``element_size``-byte values,
    against ``free_bytes`` (None: not known).

    Raises:
        ValueError: the bank, or the bank with the smallest forward, does not fit: the numbers
            and the flags to change.
    """
    bank = bank_bytes(config, entries, p_max, element_size)
    tok = per_token_bytes(config, element_size)
    head = HEAD_PARTIALS
    budget = token_budget
    if free_bytes is not None:
        room = int(free_bytes * HEADROOM) - bank - head
        if room < tok * min(MIN_TOKEN_BUDGET, token_budget):
            raise ValueError(
                f"the prefix bank needs {bank / GIB:.2f} GiB ({entries} demonstration contexts"
                f" x {p_max} tokens) and {MIN_TOKEN_BUDGET}-token forwards "
                f"{tok * MIN_TOKEN_BUDGET / GIB:.2f} GiB more, but the device has "
                f"{free_bytes / GIB:.2f} GiB free: lower --num-ratios / --sets-per-ratio (fewer "
                "contexts) or --demos-per-set (shorter ones)")
        budget = min(token_budget, room // tok)
    return MemoryPlan(bank_bytes=bank, per_token_bytes=tok, head_bytes=head,
                      free_bytes=free_bytes, token_budget=int(budget),
                      asked_budget=token_budget)


def free_device_bytes(device: Any) -> int | None:
    """The free memory of a CUDA ``device`` (``torch.cuda.mem_get_info``), None elsewhere."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(dev)
    return int(free)


def layer_devices(model: torch.nn.Module) -> list[Any]:
    """The device of each decoder layer of ``model`` (its first parameter's), in order; empty
    when its body has no ``layers`` list."""
    body = getattr(model, "base_model", model)
    out = []
    for layer in getattr(body, "layers", None) or ():
        p = next(layer.parameters(), None)
        if p is not None:
            out.append(p.device)
    return out


def model_free_bytes(model: torch.nn.Module) -> int | None:
    """The free memory the prefix bank and forwards of ``model`` can count on: its device's
    (:func:`free_device_bytes`), or for a model split over GPUs (``--device-map auto``) the
    least any of them allows. Each layer's bank lives on its layer's device, so a device with
    ``n`` of the ``L`` layers holds ``n / L`` of the bank: it fits when ``bank * n / L <=
    free``, i.e. ``bank <= free * L / n`` on every device. None off CUDA."""
    devices = layer_devices(model)
    if len({str(d) for d in devices}) <= 1:
        return free_device_bytes(devices[0] if devices else next(model.parameters()).device)
    counts: dict[str, int] = {}
    for d in devices:
        counts[str(d)] = counts.get(str(d), 0) + 1
    frees = {d: free_device_bytes(d) for d in counts}
    if any(f is None for f in frees.values()):
        return None
    return min(int(frees[d]) * len(devices) // n for d, n in counts.items())


def scorer_memory_plan(scorer: ICQSScorer, free_bytes: int | None) -> MemoryPlan:
    """:func:`plan_memory` for an :class:`~icqs_fast.engine.scorer.ICQSScorer` before its first
    forward: its demonstration contexts' prefixes (tokenized, not run; none on the plain path,
    which keeps no bank) and its token budget, in its model's dtype."""
    model = scorer.model
    entries = scorer.n_contexts if scorer.plan.bank else 0
    p_max = max((len(scorer.tokens.entry_ids(c, 0)) for c in range(entries)), default=0)
    size = next(model.parameters()).element_size()
    return plan_memory(model.config, entries=entries, p_max=p_max,
                       token_budget=scorer.token_budget, element_size=size,
                       free_bytes=free_bytes)


BANK_SHARE = 0.25  # of a GPU's free memory one continuation chunk's prefix bank may take
CPU_BANK_BYTES = 512 * 2**20  # the CPU's cap (no free-memory reading; a box's RAM is shared)


def bank_cap_bytes(device: Any, default: int = CPU_BANK_BYTES) -> int:
    """KV memory one chunk's prefix bank of :func:`icqs_fast.engine.continuations.
    score_continuations` may hold: ``default`` on the CPU, a quarter of the free memory on a
    GPU (never less than ``default``). A fixed 512 MiB is ~1,024 tokens of a 7B model: lm-eval
    then ran thousands of tiny forwards on an 80 GB GPU."""
    free = free_device_bytes(device)
    return default if free is None else max(default, int(free * BANK_SHARE))
