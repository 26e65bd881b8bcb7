"""Mergeable per-row softmax state: what every backend's one-pass reduction produces.

A backend reduces a block of logits ``z`` (scaled to ``x = z / T``) for each row into a float64
state ``[N, 7]`` plus int64 counts ``[N, 2]``:

    state[:, 0] m   running max of x over finite entries (-inf if none)
    state[:, 1] s0  sum exp(x - m)
    state[:, 2] s1  sum exp(x - m) (x - m)
    state[:, 3] s2  sum exp(x - m) (x - m)^2
    state[:, 4] n   number of finite entries
    state[:, 5] u1  sum (x - K)        over finite entries, K = per-row shift given by the caller
    state[:, 6] u2  sum (x - K)^2      over finite entries
    counts[:, 0]    entries j != t with z_j > z_t          (t = target index, z_t its logit)
    counts[:, 1]    entries j < t  with z_j == z_t

Moments are kept relative to the running max (the *shifted* form), so a large common offset on
every logit costs no precision; ``u`` sums use the caller's shift K (the target's x) for the same
reason. States of disjoint vocabulary blocks merge exactly with :func:`merge`, which is what lets
``linear_token_stats`` chunk over the vocabulary.
"""

from __future__ import annotations

import torch

from icqs_fast.types import TokenStats

STATE_WIDTH = 7


def new_buffer(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu"
               ) -> torch.Tensor:
    """Uninitialised output buffer for a kernel to fill. Every backend allocates through this
    one function so tests can swap in a poisoned allocator (NaN / sentinel-filled) and catch any
    element a kernel forgets to write."""
    return torch.empty(*shape, dtype=dtype, device=device)


def empty(n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    state = torch.zeros(n, STATE_WIDTH, dtype=torch.float64, device=device)
    state[:, 0] = float("-inf")
    return state, torch.zeros(n, 2, dtype=torch.int64, device=device)


def tanh_logits(z: torch.Tensor, tanh_scale: float) -> torch.Tensor:
    """The soft-cap epilogue of the torch backend: ``tanh(tanh_scale * z)`` in fp32 (``z`` any
    float dtype, any shape; a new fp32 tensor). +-inf gives +-1, NaN stays NaN."""
    return torch.tanh(z.float() * tanh_scale)


def reduce_block(
    z: torch.Tensor,
    t_local: torch.Tensor,
    z_t: torch.Tensor,
    shift: torch.Tensor,
    temperature: float,
    tanh_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of one block's state.

    Works in place on one float64 copy of the block: the temporaries are two float64 and a few
    bool ``[N, Vb]`` arrays (about 20 bytes per logit, i.e. ~5x an fp32 block).

    Args:
        z: ``[N, Vb]`` logits of one vocabulary block, any float dtype.
        t_local: ``[N]`` int64 target index relative to the block's first column (may lie
            outside the block).
        z_t: ``[N]`` float64 target logits (unscaled; the rank counts compare ``z`` with it).
        shift: ``[N]`` float64 shift K for the u sums (in x = z/T units).
        temperature: T > 0.
        tanh_scale: if not None, the soft-cap epilogue: every sum is over
            ``tanh_logits(z, tanh_scale)``, while the rank counts still compare the uncapped
            ``z`` and ``z_t`` (tanh is increasing: the order of the exact capped logits, without
            the ties rounding makes where the cap saturates).
    """
    x = (z if tanh_scale is None else tanh_logits(z, tanh_scale)).to(torch.float64, copy=True)
    x.div_(temperature)
    nonfin = ~torch.isfinite(x)
    x.masked_fill_(nonfin, float("-inf"))
    m = x.amax(-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    n_fin = x.shape[1] - nonfin.sum(-1)
    u = (x - shift[:, None]).masked_fill_(nonfin, 0.0)  # x - K over finite entries
    u1 = u.sum(-1)
    u2 = u.square_().sum(-1)
    del u
    d = x.sub_(m_safe[:, None])  # x - m; -inf where not finite, so e = 0 there
    e = torch.exp(d)
    d.masked_fill_(nonfin, 0.0)
    s0 = e.sum(-1)
    s1 = e.mul_(d).sum(-1)
    s2 = e.mul_(d).sum(-1)
    del d, e
    state = torch.stack([m, s0, s1, s2, n_fin.double(), u1, u2], dim=-1)
    cols = torch.arange(z.shape[1], device=z.device)[None, :]
    z_t2 = z_t[:, None]
    greater = ((z > z_t2) & (cols != t_local[:, None])).sum(-1)
    eq_before = ((z == z_t2) & (cols < t_local[:, None])).sum(-1)
    return state, torch.stack([greater, eq_before], dim=-1)


def merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the states of two disjoint vocabulary blocks (exact up to rounding)."""
    sa, ca = a
    sb, cb = b
    m = torch.maximum(sa[:, 0], sb[:, 0])
    parts = []
    for s in (sa, sb):
        nonempty = s[:, 1] > 0
        d = torch.where(nonempty, s[:, 0] - m, torch.zeros_like(m))
        w = torch.where(nonempty, torch.exp(d), torch.zeros_like(m))
        s0, s1, s2 = s[:, 1], s[:, 2], s[:, 3]
        parts.append((w * s0, w * (s1 + d * s0), w * (s2 + 2 * d * s1 + d * d * s0)))
    out = torch.stack(
        [m, parts[0][0] + parts[1][0], parts[0][1] + parts[1][1], parts[0][2] + parts[1][2],
         sa[:, 4] + sb[:, 4], sa[:, 5] + sb[:, 5], sa[:, 6] + sb[:, 6]],
        dim=-1,
    )
    return out, ca + cb


def finalize(
    state: torch.Tensor,
    counts: torch.Tensor,
    z_t: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
) -> TokenStats:
    """Turn a full-vocabulary state into :class:`TokenStats` (fp32 outputs, zero where invalid)."""
    m, s0, s1, s2, n, u1, u2 = state.unbind(-1)
    s0_safe = torch.where(s0 > 0, s0, torch.ones_like(s0))
    log_s0 = torch.log(s0_safe)
    lse = m + log_s0
    x_t = z_t.double() / temperature
    mean_d = s1 / s0_safe
    entropy = log_s0 - mean_d
    varentropy = (s2 / s0_safe - mean_d * mean_d).clamp_min(0)
    n_safe = n.clamp_min(1)
    logprob_var = ((u2 - u1 * u1 / n_safe) / (n - 1).clamp_min(1)).clamp_min(0)
    greedy = (counts[:, 0] == 0) & (counts[:, 1] == 0) & torch.isfinite(x_t)

    def f(v: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, v, torch.zeros_like(v)).float()

    return TokenStats(
        logprob=f(x_t - lse),
        entropy=f(entropy),
        varentropy=f(varentropy),
        logprob_var=f(logprob_var),
        max_logprob=f(-log_s0),
        is_greedy=greedy & valid,
        target_rank=torch.where(valid, counts[:, 0], torch.zeros_like(counts[:, 0])),
        valid=valid.clone(),
    )
