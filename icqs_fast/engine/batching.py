"""Prefix-sharing batcher: cache the KV states of every demonstration prefix once, then score
many (context, suffix) rows in padded forwards that attend to those cached prefixes.

Layout of one suffix forward with ``R`` rows (row ``i`` uses prefix entry ``e_i`` of length
``p_i``; ``P = max p_i`` over the rows; ``S`` = longest suffix)::

    cache slots   0 .. p_i-1        real prefix keys/values of entry e_i (positions 0..p_i-1)
                  p_i .. P-1        padding, masked out in the 2D attention mask
    query slots   P .. P+S-1        the suffix tokens, position ids p_i + t

Causality is by slot index (transformers builds it from the cache length), so every suffix token
sees all real prefix slots and the earlier suffix tokens; the explicit ``position_ids`` give RoPE
and absolute-position models the positions the tokens would have in an unpadded prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from icqs_fast.engine.cascade import (
    CascadePlan,
    PositionPlan,
    cascade_plan,
    position_plan,
    positional_kernel,
)
from icqs_fast.engine.layout import DeviceCopies, LayerAttention
from icqs_fast.engine.one_pass import QueryPart

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# A CPU prefix forward's chunk in tokens, and what one more forward costs in tokens of compute
# (GPU, CPU; it reads every weight once whatever its size): docs/DECISIONS.md, "CPU chunks" and
# "Forward cost in tokens". Shared runs of prefix tokens that save less than a forward are
# recomputed per prefix; a chunk takes that much padding rather than a forward of its own.
PREFIX_CHUNK_CPU = 4096
FORWARD_COST_TOKENS = (1024, 150)
# The CPU value is the embedded model's, H (4 H + 3 I) = 576 x 6912 weights a layer: a forward's
# fixed cost grows with the layers, a token's with the weights, so a model with more weights a
# layer pays fewer tokens for a forward, down to the floor.
FORWARD_COST_WEIGHTS_CPU = 576 * 6912
FORWARD_COST_FLOOR_CPU = 40


_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(body: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` for a forward that takes ``cache`` (transformers >= 5.24 deprecates
    ``past_key_values``, with a FutureWarning per call), else ``{"past_key_values": cache}``."""
    name = _CACHE_KWARG.get(type(body))
    if name is None:
        import inspect

        params = inspect.signature(body.forward).parameters
        name = _CACHE_KWARG[type(body)] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


def decoder_body(model: PreTrainedModel) -> Any:
    """The decoder without the LM head (``model.model`` for Llama, ``model.transformer`` for
    GPT-2); its output hidden states are already final-normed for these architectures."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise TypeError(f"{type(model).__name__} has no separate decoder body (base_model)")
    return body


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def forward_cost_tokens(model: torch.nn.Module, device: torch.device) -> int:
    """What one more forward of ``model`` costs on ``device``, in tokens of compute:
    :data:`FORWARD_COST_TOKENS`, on the CPU scaled by the embedded model's weights a layer over
    ``model``'s, ``H (4 H + 3 I)`` from the config (at least :data:`FORWARD_COST_FLOOR_CPU`, at
    most the table's value; the table's value without a hidden and an intermediate size)."""
    gpu, cpu = FORWARD_COST_TOKENS
    if device.type != "cpu":
        return gpu
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    h, i = getattr(cfg, "hidden_size", None), getattr(cfg, "intermediate_size", None)
    if not isinstance(h, int) or not isinstance(i, int) or h < 1 or i < 1:
        return cpu
    return min(cpu, max(FORWARD_COST_FLOOR_CPU, round(cpu * FORWARD_COST_WEIGHTS_CPU
                                                     / (h * (4 * h + 3 * i)))))


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # transformers >= 4.56 caches hold a list of layers with .keys/.values [B, H, T, D].
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v, *_ in cache]


class PrefixBank:
    """KV states of token prefixes, stored padded: per layer ``keys[layer]`` and
    ``values[layer]`` are ``[E, H_kv, P_bank, D]`` (model dtype; ``P_bank`` = the longest
    entry) with entry ``e`` real in ``[:, :, :lengths[e]]`` and zeros past it.

    They are views of capacity buffers ``[E_cap, H_kv, P_cap, D]`` that grow geometrically
    (:data:`BANK_GROWTH` over entries and over prefix length, the first :meth:`add` exactly to
    size): appending one entry at a time (``drop_oldest_demos`` adds one per dropped set) writes
    into spare rows and copies the bank only when a capacity is exceeded, so ``k`` appends copy
    ``O(total)`` bytes in all (``copied_bytes``), not ``O(k * total)``. Entries are only ever
    appended; an entry's slots are never written after its :meth:`add` returns, so scoring
    cannot change them (rows past ``E`` are not part of the views).
    """

    def __init__(self, model: PreTrainedModel, pad_id: int, token_budget: int, *, body: Any = None,
                 layers: Sequence[LayerAttention] | None = None) -> None:
        self.model = model
        self.body = decoder_body(model) if body is None else body
        # With local (sliding-window / chunked) layers the trie forwards take their masks from
        # token positions (:func:`~icqs_fast.engine.cascade.positional_attention`): the pasts
        # are padded, and transformers' window masks count cache slots.
        # So do every model's where a fused kernel takes positions (the cpp attention on the CPU):
        # no [rows, keys] mask tensors, and the kernel's speed for the bank's long prefixes.

        self.layers = tuple(layers) if layers is not None else None
        self.positional = bool(self.layers) and (any(la.local for la in self.layers)
                                                 or positional_kernel(model, model_device(model)))
        self.pad_id = int(pad_id)
        self.token_budget = int(token_budget)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        # The capacity buffers behind keys/values, per layer [E_cap, H_kv, P_cap, D].
        self._kbuf: list[torch.Tensor] = []
        self._vbuf: list[torch.Tensor] = []
        # Tokens run through prefix forwards so far, padding included (trie sharing makes this
        # smaller than the prefixes' total length).
        self.forward_tokens = 0
        # Bytes of stored entries copied into bigger buffers so far (keys and values).
        self.copied_bytes = 0

    def __len__(self) -> int:
        return len(self.lengths)

    @torch.no_grad()
    def add(self, prefixes: Sequence[Sequence[int]]) -> list[int]:
        """Compute and store the KV states of ``prefixes`` (lists of token ids, each non-empty);
        returns their entry indices.

        Tokens the new prefixes share are computed once: the prefixes form a token trie (all
        demonstration prefixes start with the same BOS + system text, and sets often share
        their first demonstrations) and each trie edge is one row of a forward that continues
        from its parent's states, already in the bank (:func:`_trie_edges`); on the embedded
        model's benchmark prompts (20 prefixes, 4256 tokens) the edges hold 3771 tokens. The
        trie runs level by level (shared runs too short to pay for a forward are not split off,
        :data:`FORWARD_COST_TOKENS`); a level's edges run sorted by length, in chunks of at most
        ``token_budget`` rows x longest edge.

        Each layer's keys/values are written straight into the bank's buffers while the
        forward runs (:class:`_BankWriter`): into spare capacity when it suffices (no copy, no
        extra memory), else into grown buffers the stored entries are copied to (the old ones are
        dropped when the add returns: old + grown bank at the peak, at the rare adds that grow
        it). The other extra peak is one chunk's activations."""
        if not prefixes:
            return []
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("a prefix must hold at least one token")
        dev = model_device(self.model)
        budget = self.token_budget
        if dev.type == "cpu":
            budget = min(budget, PREFIX_CHUNK_CPU)
        first = len(self.lengths)
        seqs = [list(map(int, p)) for p in prefixes]
        new_len = [len(p) for p in seqs]
        build = _BankBuild(self._kbuf, self._vbuf, first, first + len(seqs),
                           max([*new_len, *self.lengths]), max(self.lengths, default=0))
        cost = forward_cost_tokens(self.model, dev)
        for level in _trie_edges(seqs, cost):
            level = sorted(level, key=lambda e: e[1] - e[0])
            start = 0
            while start < len(level):
                # Greedy chunk: rows x longest edge <= budget (at least one row); an edge joins
                # when the padding it adds costs less than another forward would.
                end, longest = start, 0
                while end < len(level):
                    ln = level[end][1] - level[end][0]
                    n = end - start
                    if n > 0 and ((n + 1) * ln > budget or n * (ln - longest) > cost):
                        break
                    longest, end = ln, end + 1
                self._forward_edges(build, seqs, level[start:end], dev)
                start = end
        # Slots past a prefix's length hold zeros: masked out in attention, and finite, so their
        # zero weights contribute exactly 0.
        self._kbuf, self._vbuf = build.keys, build.values
        self.copied_bytes += build.copied_bytes
        self.lengths = self.lengths + new_len
        e, p = len(self.lengths), max(self.lengths)
        self.keys = [k[:e, :, :p] for k in self._kbuf]
        self.values = [v[:e, :, :p] for v in self._vbuf]
        return list(range(first, first + len(seqs)))

    @property
    def capacity(self) -> tuple[int, int]:
        """``(E_cap, P_cap)`` of the buffers behind ``keys``/``values``."""
        if not self._kbuf:
            return (0, 0)
        return (int(self._kbuf[0].shape[0]), int(self._kbuf[0].shape[2]))

    def _forward_edges(self, build: _BankBuild, seqs: list[list[int]],
                       edges: list[tuple[int, int, list[int]]], dev: torch.device) -> None:
        """One padded forward of trie edges ``(depth, end, rows)``: row ``i`` is tokens
        ``[depth_i, end_i)`` of the sequences ``rows_i``, after a past of ``depth_i`` tokens whose
        states are stored in bank row ``rows_i[0]`` (the pasts are padded to the longest and
        masked, as in :func:`suffix_hidden`'s KV-copy path)."""
        n = len(edges)
        d_max = max(d for d, _, _ in edges)
        t_max = max(e - d for d, e, _ in edges)
        ids = torch.full((n, t_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, d_max + t_max), dtype=torch.long)
        pos = torch.empty((n, t_max), dtype=torch.long)
        for i, (d, e, rows) in enumerate(edges):
            ids[i, : e - d] = torch.tensor(seqs[rows[0]][d:e], dtype=torch.long)
            mask[i, :d] = 1
            mask[i, d_max: d_max + e - d] = 1
            pos[i] = d + torch.arange(t_max)
        past = None
        if d_max > 0:
            # On each layer's device (a split model's layers live on several).
            src = DeviceCopies(torch.tensor([build.first + rows[0] for _, _, rows in edges]))
            past = [(k[:, :, :d_max].index_select(0, src.on(k.device)),
                     v[:, :, :d_max].index_select(0, src.on(v.device)))
                    for k, v in zip(build.keys, build.values, strict=True)]
        targets = [([build.first + r for r in rows], d, e - d) for d, e, rows in edges]
        self.forward_tokens += n * t_max
        run = lambda: self.body(  # noqa: E731
            input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
            **cache_kwarg(self.body, _BankWriter(build, targets, past)), use_cache=True)
        if not self.positional:
            run()
            return

        # Key slots: the padded past (slot j is position j of a real token when j < depth_i),
        # then the new tokens at depth_i + t.
        slot = torch.arange(d_max)
        depth = torch.tensor([d for d, _, _ in edges])
        k_past = torch.where(slot[None, :] < depth[:, None], slot[None, :], -1)
        k_pos = torch.cat([k_past, pos], dim=1)
        with position_plan(self.model, PositionPlan(pos.to(dev), k_pos.to(dev), self.layers)):
            run()

    def gather(self, entries: Sequence[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                      torch.Tensor, torch.Tensor]:
        """Fresh per-row copies of the entries' KV states, trimmed to the longest used.

        Returns:
            ``kv``: per layer (keys, values), each ``[R, H_kv, P, D]``; ``prefix_mask``:
            ``[R, P]`` int64, 1 on real prefix slots; ``lengths``: ``[R]`` int64.
        """
        # The index on each layer's device: a model split over GPUs (--device-map auto) keeps
        # each layer's keys/values on that layer's device.
        idx = DeviceCopies(torch.tensor(list(entries), dtype=torch.long))
        lens = torch.tensor([self.lengths[e] for e in entries], dtype=torch.long)
        p = int(lens.max())
        kv = [(k.index_select(0, idx.on(k.device))[:, :, :p],
               v.index_select(0, idx.on(v.device))[:, :, :p])
              for k, v in zip(self.keys, self.values, strict=True)]
        mask = (torch.arange(p)[None, :] < lens[:, None]).long()
        return kv, mask, lens


def _trie_edges(seqs: list[list[int]], forward_cost: int = 0
                ) -> list[list[tuple[int, int, list[int]]]]:
    """The edges of the token trie of ``seqs``, by level (a level's parents are in earlier
    levels).

    An edge ``(depth, end, rows)`` is the run of tokens ``[depth, end)`` that exactly the
    sequences ``rows`` share after sharing their first ``depth`` tokens (a single sequence's
    edge runs to its end). A sequence that is a prefix of another, or equal to it, ends on a
    node. A shared edge that would save fewer than ``forward_cost`` tokens
    (``(len(rows) - 1) * (end - depth)``) is not kept: each of its children (and the sequences
    ending on it) runs from ``depth`` instead, since a level costs at least one more forward.
    """
    def split(depth: int, rows: list[int]) -> list[list]:
        groups: dict[int, list[int]] = {}
        for r in rows:
            if len(seqs[r]) > depth:
                groups.setdefault(seqs[r][depth], []).append(r)
        out = []
        for g in groups.values():
            end, lim, lead = depth + 1, min(len(seqs[r]) for r in g), seqs[g[0]]
            while end < lim and all(seqs[r][end] == lead[end] for r in g[1:]):
                end += 1
            out.append([depth, end, g])
        return out

    levels: list[list[tuple[int, int, list[int]]]] = []
    todo = split(0, list(range(len(seqs))))
    while todo:
        level, nxt = [], []
        while todo:
            d, e, rows = todo.pop()
            longer = [r for r in rows if len(seqs[r]) > e]
            if not longer:  # a leaf (one sequence, or identical ones)
                level.append((d, e, rows))
                continue
            kids = split(e, longer)
            if (len(rows) - 1) * (e - d) < forward_cost:
                ending = [r for r in rows if len(seqs[r]) == e]
                todo.extend([d, ke, kr] for _, ke, kr in kids)
                if ending:
                    level.append((d, e, ending))
                continue
            level.append((d, e, rows))
            nxt.extend(kids)
        levels.append(level)
        todo = nxt
    return levels


# Growth factor of the bank's capacity, over entries and over prefix length. With g, k
# one-entry appends copy at most ~ total / (g - 1) per dimension; 1.5 keeps the spare capacity
# (memory never used) at most a third of the buffer, where doubling would allow half: the bank
# is the engine's largest allocation (197 MB for the embedded model's 20 prefixes).
BANK_GROWTH = 1.5


class _BankBuild:
    """The bank's buffers while :meth:`PrefixBank.add` runs, per layer ``[E_cap, H_kv, P_cap,
    D]``, resolved at the layer's first write (shapes and dtype from the model's states): the
    old buffer when entries ``[first, total)`` and length ``p_all`` fit in it (those rows are
    zeroed first: a failed earlier add may have left states there), else a zero-filled buffer
    grown by :data:`BANK_GROWTH` into which the ``first`` stored entries (``p_used`` slots) are
    copied."""

    def __init__(self, old_k: list[torch.Tensor], old_v: list[torch.Tensor], first: int,
                 total: int, p_all: int, p_used: int) -> None:
        self.old_k, self.old_v = old_k, old_v
        self.first, self.total, self.p_all, self.p_used = first, total, p_all, p_used
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.copied_bytes = 0

    @staticmethod
    def _grow(cap: int, need: int) -> int:
        return cap if need <= cap else max(need, math.ceil(cap * BANK_GROWTH))

    def layer(self, li: int, like: torch.Tensor, like_v: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        # Values may have another head size than keys (multi-head latent attention).
        like_v = like if like_v is None else like_v
        while len(self.keys) <= li:
            i = len(self.keys)
            shape = (like.shape[1], like.shape[3])
            shape_v = (like_v.shape[1], like_v.shape[3])
            if i < len(self.old_k):
                ok, ov = self.old_k[i], self.old_v[i]
                e_cap, p_cap = ok.shape[0], ok.shape[2]
                fits = (self.total <= e_cap and self.p_all <= p_cap and ok.dtype == like.dtype
                        and ok.device == like.device and (ok.shape[1], ok.shape[3]) == shape
                        and (ov.shape[1], ov.shape[3]) == shape_v)
                if fits:
                    ok[self.first:self.total].zero_()
                    ov[self.first:self.total].zero_()
                    self.keys.append(ok)
                    self.values.append(ov)
                    continue
                e_cap, p_cap = self._grow(e_cap, self.total), self._grow(p_cap, self.p_all)
            else:
                e_cap, p_cap = self.total, self.p_all  # the first add: exactly to size
            k = like.new_zeros((e_cap, shape[0], p_cap, shape[1]))
            v = like_v.new_zeros((e_cap, shape_v[0], p_cap, shape_v[1]))
            if i < len(self.old_k) and self.first:
                src_k = self.old_k[i][: self.first, :, : self.p_used]
                src_v = self.old_v[i][: self.first, :, : self.p_used]
                k[: self.first, :, : self.p_used] = src_k
                v[: self.first, :, : self.p_used] = src_v
                self.copied_bytes += 2 * src_k.numel() * k.element_size()
            self.keys.append(k)
            self.values.append(v)
        return self.keys[li], self.values[li]


class _BankWriter(DynamicCache):
    """The cache of one trie-edge forward. It holds the rows' pasts (``[n, H_kv, d_max, D]``,
    padded and masked) so the model sees those tokens, and never grows: each layer's new
    keys/values ``[n, H_kv, T, D]`` are copied (row ``i``'s first ``t_i`` tokens) into slots
    ``[depth_i, depth_i + t_i)`` of every bank entry under edge ``i``, then returned after the
    past for the attention."""

    def __init__(self, build: _BankBuild, targets: list[tuple[list[int], int, int]],
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        if past:
            super().__init__(ddp_cache_data=past)
        else:
            super().__init__()
        self.build, self.targets = build, targets
        self.has_past = bool(past)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.build.layer(layer_idx, key_states, value_states)
        for i, (rows, d, t) in enumerate(self.targets):
            for r in rows:
                k[r, :, d:d + t] = key_states[i, :, :t]
                v[r, :, d:d + t] = value_states[i, :, :t]
        if not self.has_past:
            return key_states, value_states
        layer = self.layers[layer_idx]
        return (torch.cat([layer.keys, key_states], dim=2),
                torch.cat([layer.values, value_states], dim=2))


def last_hidden(out: Any) -> torch.Tensor:
    """The final hidden states of a decoder body's output (a ModelOutput or a tuple)."""
    h = getattr(out, "last_hidden_state", None)
    return h if h is not None else out[0]


@torch.no_grad()
def suffix_hidden(
    model: PreTrainedModel,
    bank: PrefixBank,
    entries: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    cascade: bool = True,
    *,
    capture: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    query: QueryPart | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded forward of ``R`` suffixes, row ``i`` continuing bank entry ``entries[i]``.

    Args:
        entries: ``R`` bank entry indices.
        suffixes: ``R`` non-empty token id lists.
        cascade: run the attention as cascade attention against the bank's shared prefix
            states (:mod:`icqs_fast.engine.cascade`: no per-row KV copy; fastest when the rows are
            ordered by entry; the capability check, :func:`icqs_fast.engine.capability.
            model_plan`, says whether a model supports it). False = the per-row KV-copy path
            below (a transformers KV cache per row; local layers get positional masks).
        capture: (cascade only; rows in entry order) filled with each layer's suffix
            keys/values, for a later forward's ``query``.
        query: (cascade only) shared query tokens between each row's entry and its suffix
            (:class:`~icqs_fast.engine.one_pass.QueryPart`, ``rows`` / ``lengths`` in input
            order): row ``i``'s suffix then starts at position ``lengths[e_i] +
            query.lengths[i]``.

    The bank's ``body`` runs the forward and its ``layers`` give each layer's mask.

    Returns:
        ``hidden``: ``[R, S, H]`` final (normed) hidden states of the suffix tokens, model dtype;
        ``suffix_mask``: ``[R, S]`` bool, True on real tokens.
    """
    if cascade:
        return _suffix_hidden_cascade(model, bank, entries, suffixes, pad_id, capture, query)
    if capture is not None or query is not None:
        raise ValueError("shared query states need cascade attention")
    dev = model_device(model)
    kv, prefix_mask, lens = bank.gather(entries)
    ids, smask = right_padded(suffixes, pad_id)
    pos = lens[:, None] + torch.arange(ids.shape[1])[None, :]
    attn = torch.cat([prefix_mask, smask], dim=1)
    # A fresh cache object around per-batch copies of the stored states (the forward appends
    # to it, so the bank itself is never written).
    cache = DynamicCache(ddp_cache_data=kv)
    body = bank.body
    run = lambda: body(  # noqa: E731
        input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
        **cache_kwarg(body, cache), use_cache=True)
    if not bank.positional:
        hidden = last_hidden(run())
        return hidden, smask.bool().to(hidden.device)  # a split model's last layer's device

    # Key slots: the padded prefix (slot j real when j < length), then the suffix at length + t.
    p = prefix_mask.shape[1]
    slot = torch.arange(p)
    k_pos = torch.cat([torch.where(slot[None, :] < lens[:, None], slot[None, :], -1), pos], 1)
    with position_plan(model, PositionPlan(pos.to(dev), k_pos.to(dev), bank.layers)):
        hidden = last_hidden(run())
    return hidden, smask.bool().to(hidden.device)


def _suffix_hidden_cascade(model: PreTrainedModel, bank: PrefixBank, entries: Sequence[int],
                           suffixes: Sequence[Sequence[int]], pad_id: int,
                           capture: dict | None = None, query: QueryPart | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`suffix_hidden` through :func:`icqs_fast.engine.cascade.cascade_attention`: the forward
    sees only the suffix tokens (no KV cache, explicit position ids ``p_i + t``); rows are put
    in entry-major order for the attention (and back afterwards, when they were not)."""
    dev = model_device(model)
    r = len(suffixes)
    order = sorted(range(r), key=lambda i: entries[i])  # stable: keeps row order per entry
    ordered = order == list(range(r))
    ent = [entries[i] for i in order]
    ids, smask = right_padded([suffixes[i] for i in order], pad_id)
    smask, s = smask.bool(), ids.shape[1]
    lens = torch.tensor([bank.lengths[e] for e in ent], dtype=torch.long)
    if query is not None:  # in entry-major order; the suffix after the shared query tokens
        query = QueryPart(query.kv, [query.rows[i] for i in order],
                          [query.lengths[i] for i in order])
        lens = lens + torch.tensor(query.lengths, dtype=torch.long)
    pos = lens[:, None] + torch.arange(s)[None, :]
    groups_e, starts, counts = [], [], []
    for row, e in enumerate(ent):
        if groups_e and groups_e[-1] == e:
            counts[-1] += 1
        else:
            groups_e.append(e)
            starts.append(row)
            counts.append(1)
    if capture is not None and not ordered:
        raise ValueError("capturing suffix states needs the rows in entry order")
    plan = CascadePlan(bank.keys, bank.values, groups_e, starts, counts,
                       [bank.lengths[e] for e in groups_e], bank.layers, capture, query)
    with cascade_plan(model, plan):
        out = bank.body(input_ids=ids.to(dev), position_ids=pos.to(dev), use_cache=False)
    hidden = last_hidden(out)
    if not ordered:
        inv = torch.empty(r, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(r)
        hidden = hidden.index_select(0, inv.to(hidden.device))
        smask = smask[inv]
    return hidden, smask.to(hidden.device)  # a split model: its last layer's device


@torch.no_grad()
def plain_hidden(body: Any, seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                 pad_safe: bool = True, layers: Sequence[LayerAttention] | None = None
                 ) -> torch.Tensor:
    """One right-padded forward of whole sequences through ``body`` (no prefix sharing): the
    path of models the prefix bank cannot serve (recurrent / SSM layers, unknown layouts).
    Right padding keeps every real token at its own position and in front of the padding, so a
    causal model computes each row as it would alone; a model for which that does not hold
    (``pad_safe=False``, found by the capability check) runs each sequence alone.

    On the CPU, with ``layers`` (the model's layer descriptions) and a fused kernel that takes token
    positions (the cpp attention on the CPU: :func:`~icqs_fast.engine.cascade.positional_kernel`),
    the attention runs through that kernel on positions, as the prefix bank's forwards and the
    cascade do: a sequence's numbers are then the same bits here, alone, and continued from a
    shared prefix.

    Returns:
        ``[R, T, H]`` final hidden states (model dtype), ``T`` the longest sequence (rows run
        alone are zero past their length).
    """
    return _plain_forward(lambda ids, mask: last_hidden(body(
        input_ids=ids, attention_mask=mask, use_cache=False)), seqs, pad_id, device, pad_safe,
        body, layers)


def _plain_forward(run: Any, seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                   pad_safe: bool, model: PreTrainedModel | None = None,
                   layers: Sequence[LayerAttention] | None = None) -> torch.Tensor:
    if layers and torch.device(device).type == "cpu":
        from icqs_fast.engine.cascade import PositionPlan, position_plan, positional_kernel

        if positional_kernel(model, device):
            inner = run

            def run(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                # Right padding: slot j is position j; padding keys masked (position -1).
                pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
                k_pos = torch.where(mask.bool(), pos, -1)
                with position_plan(model, PositionPlan(pos, k_pos, tuple(layers))):
                    return inner(ids, mask)
    ids, mask = right_padded(seqs, pad_id)
    if pad_safe or len(seqs) == 1:
        return run(ids.to(device), mask.to(device))
    out = None
    for i, x in enumerate(seqs):
        one = run(ids[i: i + 1, : len(x)].to(device), mask[i: i + 1, : len(x)].to(device))
        if out is None:
            out = one.new_zeros((len(seqs), ids.shape[1], one.shape[-1]))
        out[i, : len(x)] = one[0]
    return out


def right_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [R, T]`` int64 (``pad_id`` after each sequence) and ``mask [R, T]`` int64 (1 on real
    tokens), ``T`` the longest sequence."""
    r = len(seqs)
    t = max(len(x) for x in seqs)
    ids = torch.full((r, t), int(pad_id), dtype=torch.long)
    mask = torch.zeros((r, t), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        mask[i, : len(x)] = 1
    return ids, mask


@torch.no_grad()
def plain_logits(model: PreTrainedModel, seqs: Sequence[Sequence[int]], pad_id: int,
                 device: torch.device,
                 pad_safe: bool = True, layers: Sequence[LayerAttention] | None = None
                 ) -> torch.Tensor:
    """:func:`plain_hidden` through the whole model: its own logits ``[R, T, V]`` (for heads the
    fused statistics cannot reproduce; the full ``[tokens, vocab]`` tensor is built)."""
    return _plain_forward(lambda ids, mask: model(
        input_ids=ids, attention_mask=mask, use_cache=False).logits, seqs, pad_id, device,
        pad_safe, model, layers)
