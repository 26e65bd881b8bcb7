"""The layer-independent part of the cascade's one softmax pass per row
(:func:`icqs_fast.engine.cascade._one_pass`): where each prefix entry is cut, and the positions
and gather indices of the prefix and suffix calls, made once per plan and shared by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from icqs_fast import ops


@dataclass(frozen=True)
class OnePassIndices:
    """The layer-independent part of the one-pass cascade for one plan: each entry's prefix cut at
    the last multiple of :data:`~icqs_fast.ops.ATTENTION_KEY_BLOCK` (``c_max`` the largest),
    the prefix part's positions (``q_pre [G, n_max * group * S]``, ``k_pre [G, c_max]``, -1
    past an entry's cut), and the suffix part's: ``t_max`` prefix slots past the cuts at most,
    ``ent [R]`` each row's entry, ``tails [R, t_max]`` the slots it copies, ``src [R, t_max + S]``
    the gather from ``[tails; suffix]`` into position order, ``q_suf [R, S]`` and
    ``k_suf [R, t_max + S]`` (-1: masked)."""

    c_max: int
    q_pre: torch.Tensor
    k_pre: torch.Tensor
    t_max: int
    ent: torch.Tensor
    tails: torch.Tensor
    src: torch.Tensor
    q_suf: torch.Tensor
    k_suf: torch.Tensor

    @staticmethod
    def of(lengths: Sequence[int], counts: Sequence[int], s: int, group: int,
           dev: torch.device) -> OnePassIndices:
        """The indices of a plan whose row groups have prefixes of ``lengths`` and ``counts``
        rows, for suffixes of ``s`` tokens and ``group`` query heads per key head."""
        blk = ops.ATTENTION_KEY_BLOCK
        lens = torch.tensor(lengths, dtype=torch.long)
        cuts = lens // blk * blk
        rows_g = torch.repeat_interleave(torch.arange(len(counts)),
                                         torch.tensor(counts, dtype=torch.long))
        t = torch.arange(s)
        c_max = int(cuts.max())
        j = torch.arange(c_max)
        k_pre = torch.where(j[None] < cuts[:, None], j[None], -1).to(dev)
        q_pre = (lens[:, None] + torch.arange(max(counts) * group * s)[None] % s).to(dev)
        cut_r, len_r = cuts[rows_g], lens[rows_g]
        tail_r = len_r - cut_r
        t_max = int(tail_r.max())
        ent = rows_g.to(dev)
        q_suf = (len_r[:, None] + t[None, :]).to(dev)
        if t_max == 0:
            empty = torch.empty(0, dtype=torch.long, device=dev)
            return OnePassIndices(c_max, q_pre, k_pre, 0, ent, empty, empty, q_suf,
                                  (len_r[:, None] + t[None, :]).to(dev))
        j = torch.arange(t_max + s)
        src = torch.where(j[None] < tail_r[:, None], j[None],
                          t_max + j[None] - tail_r[:, None])  # [R, T2]
        real = j[None] < (tail_r[:, None] + s)
        src = torch.where(real, src, 0).to(dev)
        # The rows' entries' slots from the cut (kp holds the used entries in group order),
        # clamped into the bank's slots (past them only masked slots are read).
        tails = (cut_r[:, None] + torch.arange(t_max)[None]).clamp(max=max(lengths) - 1).to(dev)
        k_suf = torch.where(real, cut_r[:, None] + j[None], -1).to(dev)
        return OnePassIndices(c_max, q_pre, k_pre, t_max, ent, tails, src, q_suf, k_suf)
