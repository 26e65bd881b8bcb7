"""The cascade's one softmax pass per row (:func:`one_pass`, taken by
:func:`icqs_fast.engine.cascade.cascade_attention` where the kernel continues its running state):
where each prefix entry is cut, the positions and gather indices of the prefix and suffix calls
(made once per plan and shared by every layer), and the shared query tokens
(:class:`QueryPart`) a row may continue between its bank entry and its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import ops
from icqs_fast.backends import support

if TYPE_CHECKING:
    from icqs_fast.engine.layout import LayerAttention


@dataclass(frozen=True)
class QueryPart:
    """Query tokens several rows of a suffix forward share after their bank entry (both outputs
    of a pair after one context): computed once by an earlier forward whose keys/values were
    captured (:attr:`icqs_fast.engine.cascade.CascadePlan.capture`), read here by each row as
    keys between its entry's and its own.

    Attributes:
        kv: per layer, the earlier forward's keys and values ``[Rq, Hk, Sq, D]`` / ``Dv``.
        rows: per row of this forward (in its order), the earlier forward's row it continues.
        lengths: per row, how many of that row's tokens it continues (0: none).
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    rows: list[int]
    lengths: list[int]


@dataclass(frozen=True)
class OnePassIndices:
    """The layer-independent part of the one-pass cascade for one plan: each entry's prefix cut at
    the last multiple of :data:`~icqs_fast.ops.ATTENTION_KEY_BLOCK` (``c_max`` the largest),
    the prefix part's key positions (``k_pre [G, c_max]``, -1 past an entry's cut; its queries
    are at ``q_suf``), and the suffix part's: ``t_max`` prefix slots past the cuts at most,
    ``m_max`` shared query tokens at most, per row (``[R]`` int64 on the CPU, the
    :func:`~icqs_fast.ops.concat_slots` runs of its keys in position order) ``ent`` its entry,
    ``cut`` where its entry's last partial block starts and ``tail`` its length, ``mid`` its
    shared query tokens, ``own`` ``arange(R)``, ``zero`` zeros and ``full`` ``S``; then
    ``q_suf [R, S]`` and ``k_suf [R, t_max + m_max + S]`` (-1: masked)."""

    c_max: int
    k_pre: torch.Tensor
    t_max: int
    m_max: int
    ent: torch.Tensor
    cut: torch.Tensor
    tail: torch.Tensor
    mid: torch.Tensor
    own: torch.Tensor
    zero: torch.Tensor
    full: torch.Tensor
    q_suf: torch.Tensor
    k_suf: torch.Tensor

    @staticmethod
    def of(lengths: Sequence[int], counts: Sequence[int], s: int, dev: torch.device,
           mids: Sequence[int] | None = None) -> OnePassIndices:
        """The indices of a plan whose row groups have prefixes of ``lengths`` and ``counts``
        rows, for suffixes of ``s`` tokens; ``mids``: per row, the shared query tokens between
        its entry and its suffix (none if None)."""
        blk = ops.ATTENTION_KEY_BLOCK
        lens = torch.tensor(lengths, dtype=torch.long)
        cuts = lens // blk * blk
        rows_g = torch.repeat_interleave(torch.arange(len(counts)),
                                         torch.tensor(counts, dtype=torch.long))
        mid_r = torch.zeros(len(rows_g), dtype=torch.long) if mids is None else \
            torch.tensor(list(mids), dtype=torch.long)
        t = torch.arange(s)
        c_max = int(cuts.max())
        j = torch.arange(c_max)
        k_pre = torch.where(j[None] < cuts[:, None], j[None], -1).to(dev)
        cut_r, len_r = cuts[rows_g], lens[rows_g]
        tail_r = len_r - cut_r
        t_max, m_max = int(tail_r.max()), int(mid_r.max())
        r = len(rows_g)
        q_suf = (len_r[:, None] + mid_r[:, None] + t[None, :]).to(dev)
        # Slot j of row i is position cut_i + j: its entry's tail, its query tokens, its own.
        j = torch.arange(t_max + m_max + s)
        real = j[None] < (tail_r + mid_r)[:, None] + s
        k_suf = torch.where(real, cut_r[:, None] + j[None], -1).to(dev)
        return OnePassIndices(c_max, k_pre, t_max, m_max, rows_g, cut_r, tail_r, mid_r,
                              torch.arange(r), torch.zeros(r, dtype=torch.long),
                              torch.full((r,), s, dtype=torch.long), q_suf, k_suf)


def one_pass(plan: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kp: torch.Tensor, vp: torch.Tensor, scale: float, kernel: str,
             lay: LayerAttention | None, dot: torch.dtype | None, softcap: float | None,
             sinks: torch.Tensor | None, layer: int, out_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, None]:
    """The cascade (``plan``: a :class:`~icqs_fast.engine.cascade.CascadePlan`; ``layer``: the
    layer's index) as one softmax pass per row, the same bits as a plain forward's attention
    over ``[prefix; suffix]`` (:func:`~icqs_fast.engine.cascade.positional_attention`, one call
    over all keys) on a kernel that continues its running state
    (:func:`icqs_fast.ops.attention_lse`'s ``state``): the prefix part covers each entry's keys
    up to the last multiple of :data:`~icqs_fast.ops.ATTENTION_KEY_BLOCK` below its length
    (shared by the entry's rows, no copy) and returns the rows' state; the suffix part continues
    it over the rest of the prefix (at most a block's worth, copied per row), the row's shared
    query tokens (``plan.query``, copied per row) and the row's own keys, in slot = position
    order. So the key blocks are those of one call over all the keys, and a row's result does
    not depend on where its prefix was cut, whether its query's states came from another
    forward, or what shares its forward. ``out_dtype``: the output in it (the kernel writes
    bf16 where it takes that)."""
    r, hq, s, d = query.shape
    dev = query.device
    ix = plan.one_pass_indices(s, dev)
    state = None
    if ix.c_max > 0:
        # Prefix part: each row's queries against its entry's keys up to the cut (the rest of the
        # slots masked by position -1), read in place (key_batch: the row's entry); the state
        # comes out in the rows' own layout, which the suffix part continues (a row's sums do
        # not depend on what shares the call).
        state, _ = ops.attention_lse(query, kp[:, :, :ix.c_max], vp[:, :, :ix.c_max],
                                     scale=scale, causal=True, positions=(ix.q_suf, ix.k_pre),
                                     dot_dtype=dot, softcap=softcap, backend=kernel,
                                     return_state=True, key_batch=ix.ent, **local_args(lay))
    # Suffix part: slot j of row i is position cut_i + j: the prefix's last partial block
    # (tails), the shared query tokens, then the suffix tokens, then nothing (masked).
    if ix.t_max == 0 and ix.m_max == 0:
        k2, v2 = key, value
    else:
        width = ix.k_suf.shape[1]
        parts_k, parts_v = [], []
        if ix.t_max:
            parts_k.append((kp.to(key.dtype), ix.ent, ix.cut, ix.tail))
            parts_v.append((vp.to(value.dtype), ix.ent, ix.cut, ix.tail))
        if ix.m_max:
            qk, qv = plan.query.kv[layer]
            rows = plan.query_rows(torch.device("cpu"))
            parts_k.append((qk, rows, ix.zero, ix.mid))
            parts_v.append((qv, rows, ix.zero, ix.mid))
        k2 = ops.concat_slots([*parts_k, (key, ix.own, ix.zero, ix.full)], width)
        v2 = ops.concat_slots([*parts_v, (value, ix.own, ix.zero, ix.full)], width)
    k_pos, q_pos = ix.k_suf, ix.q_suf
    direct = out_dtype if sinks is None and kernel_out(kernel, out_dtype) else None
    out, lse = ops.attention_lse(query, k2, v2, scale=scale, causal=True,
                                 positions=(q_pos, k_pos), dot_dtype=dot, softcap=softcap,
                                 backend=kernel, state=state, out_dtype=direct,
                                 with_lse=sinks is not None, **local_args(lay))
    if sinks is not None:  # as positional_attention does, so the two stay equal
        keep = torch.exp(lse - torch.logaddexp(lse, sinks.float().view(1, hq, 1)))
        out = (out.float() * keep[..., None]).to(out.dtype)
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out.transpose(1, 2).contiguous(), None


def kernel_out(kernel: str, out_dtype: torch.dtype | None) -> bool:
    """Whether ``kernel`` writes :func:`icqs_fast.ops.attention_lse`'s output in
    ``out_dtype`` itself (bf16 on the cpp backend)."""
    s = support.entry("attention_lse", kernel)
    return out_dtype is not None and s is not None and "bf16_out" in s.options


def local_args(la: LayerAttention | None) -> dict[str, int]:
    """The ``window`` / ``chunk`` keyword of :func:`icqs_fast.ops.attention_lse` for a local
    layer ``la`` (none for a full one, or None)."""
    local = {}
    if la is not None and la.kind == "sliding" and la.window is not None:
        local["window"] = int(la.window)
    if la is not None and la.kind == "chunked" and la.chunk is not None:
        local["chunk"] = int(la.chunk)
    return local
