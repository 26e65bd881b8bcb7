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

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

# Prefix forwards on the CPU run in chunks of at most this many tokens: larger batches spill the
# elementwise work (SiLU, norms, RoPE) out of the caches and measured slower on a 2-core CPU
# (20 prefixes of ~215 tokens: 7.2 s in chunks of 2000 tokens, 8.3 s in one forward); chunks of
# 512 tokens measured as fast (8-10 s on the shared machine) and keep the activations' peak small
# next to the bank (bank + 2048-token chunk ~390 MB, bank + 512-token chunk ~240 MB).
PREFIX_CHUNK_CPU = 512


def decoder_body(model: Any) -> Any:
    """The decoder without the LM head (``model.model`` for Llama, ``model.transformer`` for
    GPT-2); its output hidden states are already final-normed for these architectures."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise TypeError(f"{type(model).__name__} has no separate decoder body (base_model)")
    return body


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # transformers >= 4.56 caches hold a list of layers with .keys/.values [B, H, T, D].
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v, *_ in cache]


class PrefixBank:
    """KV states of token prefixes, stored padded: per layer ``keys[layer]`` and
    ``values[layer]`` are ``[E, H_kv, P_bank, D]`` (model dtype) with entry ``e`` real in
    ``[:, :, :lengths[e]]``.

    Entries are only ever appended (by building new tensors); stored tensors are never written
    to after creation, so scoring cannot change them.
    """

    def __init__(self, model: Any, pad_id: int, token_budget: int) -> None:
        self.model = model
        self.body = decoder_body(model)
        self.pad_id = int(pad_id)
        self.token_budget = int(token_budget)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []

    def __len__(self) -> int:
        return len(self.lengths)

    @torch.no_grad()
    def add(self, prefixes: Sequence[Sequence[int]]) -> list[int]:
        """Compute and store the KV states of ``prefixes`` (lists of token ids, each non-empty),
        in padded batches of at most ``token_budget`` tokens; returns their entry indices.

        Each layer's keys/values are written straight into the new bank tensors while the
        forward runs (:class:`_BankWriter`), so building the bank never holds a second copy of
        it: the extra peak is one chunk's activations."""
        if not prefixes:
            return []
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("a prefix must hold at least one token")
        dev = model_device(self.model)
        budget = self.token_budget
        if dev.type == "cpu":
            budget = min(budget, PREFIX_CHUNK_CPU)
        first = len(self.lengths)
        new_len = [len(p) for p in prefixes]
        p_all = max([*new_len, *self.lengths])
        writer = _BankWriter(self.keys, self.values, first, first + len(new_len), p_all)
        start = 0
        while start < len(prefixes):
            # Greedy chunk: rows x longest row <= budget (at least one row).
            end, longest = start, 0
            while end < len(prefixes):
                ln = max(longest, new_len[end])
                if end > start and (end - start + 1) * ln > budget:
                    break
                longest, end = ln, end + 1
            rows = [list(prefixes[i]) for i in range(start, end)]
            ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), longest), dtype=torch.long)
            for r, p in enumerate(rows):
                ids[r, : len(p)] = torch.tensor(p, dtype=torch.long)
                mask[r, : len(p)] = 1
            pos = torch.arange(longest).expand(len(rows), -1)
            writer.rows = (first + start, first + end)
            self.body(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                      position_ids=pos.to(dev), past_key_values=writer, use_cache=True)
            start = end
        # Slots past a prefix's length hold zeros or its chunk's padding states: masked out in
        # attention, and finite, so their zero weights contribute exactly 0.
        self.keys, self.values = writer.keys, writer.values
        self.lengths = self.lengths + new_len
        return list(range(first, first + len(new_len)))

    def gather(self, entries: Sequence[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                      torch.Tensor, torch.Tensor]:
        """Fresh per-row copies of the entries' KV states, trimmed to the longest used.

        Returns:
            ``kv``: per layer (keys, values), each ``[R, H_kv, P, D]``; ``prefix_mask``:
            ``[R, P]`` int64, 1 on real prefix slots; ``lengths``: ``[R]`` int64.
        """
        dev = self.keys[0].device
        idx = torch.tensor(list(entries), dtype=torch.long, device=dev)
        lens = torch.tensor([self.lengths[e] for e in entries], dtype=torch.long)
        p = int(lens.max())
        kv = [(k.index_select(0, idx)[:, :, :p], v.index_select(0, idx)[:, :, :p])
              for k, v in zip(self.keys, self.values, strict=True)]
        mask = (torch.arange(p)[None, :] < lens[:, None]).long()
        return kv, mask, lens


class _BankWriter(DynamicCache):
    """A cache for a prefix forward from an empty cache that keeps nothing itself: each layer's
    new keys/values (``[rows, H_kv, T, D]``) are copied into slots ``rows`` of fresh bank tensors
    ``[E, H_kv, P, D]`` (zero-filled, entries ``[0, first)`` copied from ``old``) and returned
    unchanged for the attention. Its layers stay empty, so the model sees no past tokens."""

    def __init__(self, old_k: list[torch.Tensor], old_v: list[torch.Tensor], first: int,
                 total: int, p_all: int) -> None:
        super().__init__()
        self.old_k, self.old_v = old_k, old_v
        self.first, self.total, self.p_all = first, total, p_all
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = (first, first)

    def _layer(self, li: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= li:
            i = len(self.keys)
            shape = (self.total, like.shape[1], self.p_all, like.shape[3])
            k = like.new_zeros(shape)
            v = like.new_zeros(shape)
            if self.old_k:
                p_old = self.old_k[i].shape[2]
                k[: self.first, :, :p_old] = self.old_k[i]
                v[: self.first, :, :p_old] = self.old_v[i]
            self.keys.append(k)
            self.values.append(v)
        return self.keys[li], self.values[li]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._layer(layer_idx, key_states)
        r0, r1 = self.rows
        t = key_states.shape[2]
        k[r0:r1, :, :t] = key_states
        v[r0:r1, :, :t] = value_states
        return key_states, value_states


@torch.no_grad()
def suffix_hidden(
    model: Any,
    bank: PrefixBank,
    entries: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    pad_id: int,
    cascade: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded forward of ``R`` suffixes, row ``i`` continuing bank entry ``entries[i]``.

    Args:
        entries: ``R`` bank entry indices.
        suffixes: ``R`` non-empty token id lists.
        cascade: run the attention as cascade attention against the bank's shared prefix
            states (:mod:`icqs_fast.cascade`: no per-row KV copy; fastest when the rows are
            ordered by entry); None = when the model supports it (Llama family, GPT-2).
            False = the per-row KV-copy path below (any model with a transformers KV cache).

    Returns:
        ``hidden``: ``[R, S, H]`` final (normed) hidden states of the suffix tokens, model dtype;
        ``suffix_mask``: ``[R, S]`` bool, True on real tokens.
    """
    from . import cascade as casc

    if cascade is None:
        cascade = casc.supports_cascade(model)
    if cascade:
        return _suffix_hidden_cascade(model, bank, entries, suffixes, pad_id)
    dev = model_device(model)
    kv, prefix_mask, lens = bank.gather(entries)
    r = len(suffixes)
    s = max(len(x) for x in suffixes)
    ids = torch.full((r, s), int(pad_id), dtype=torch.long)
    smask = torch.zeros((r, s), dtype=torch.long)
    for i, x in enumerate(suffixes):
        ids[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        smask[i, : len(x)] = 1
    pos = lens[:, None] + torch.arange(s)[None, :]
    attn = torch.cat([prefix_mask, smask], dim=1)
    # A fresh cache object around per-batch copies of the stored states (the forward appends
    # to it, so the bank itself is never written).
    cache = DynamicCache(ddp_cache_data=kv)
    out = decoder_body(model)(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                              position_ids=pos.to(dev), past_key_values=cache, use_cache=True)
    return out.last_hidden_state, smask.bool().to(dev)


def _suffix_hidden_cascade(model: Any, bank: PrefixBank, entries: Sequence[int],
                           suffixes: Sequence[Sequence[int]], pad_id: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`suffix_hidden` through :func:`icqs_fast.cascade.cascade_attention`: the forward
    sees only the suffix tokens (no KV cache, explicit position ids ``p_i + t``); rows are put
    in entry-major order for the attention (and back afterwards, when they were not)."""
    from .cascade import CascadePlan, cascade_plan

    dev = model_device(model)
    r = len(suffixes)
    order = sorted(range(r), key=lambda i: entries[i])  # stable: keeps row order per entry
    ordered = order == list(range(r))
    ent = [entries[i] for i in order]
    s = max(len(x) for x in suffixes)
    ids = torch.full((r, s), int(pad_id), dtype=torch.long)
    smask = torch.zeros((r, s), dtype=torch.bool)
    for row, i in enumerate(order):
        x = suffixes[i]
        ids[row, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        smask[row, : len(x)] = True
    lens = torch.tensor([bank.lengths[e] for e in ent], dtype=torch.long)
    pos = lens[:, None] + torch.arange(s)[None, :]
    groups_e, starts, counts = [], [], []
    for row, e in enumerate(ent):
        if groups_e and groups_e[-1] == e:
            counts[-1] += 1
        else:
            groups_e.append(e)
            starts.append(row)
            counts.append(1)
    plan = CascadePlan(bank.keys, bank.values, groups_e, starts, counts,
                       [bank.lengths[e] for e in groups_e])
    with cascade_plan(model, plan):
        out = decoder_body(model)(input_ids=ids.to(dev), position_ids=pos.to(dev),
                                  use_cache=False)
    hidden = out.last_hidden_state
    if not ordered:
        inv = torch.empty(r, dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(r)
        hidden = hidden.index_select(0, inv.to(dev))
        smask = smask[inv]
    return hidden, smask.to(dev)
