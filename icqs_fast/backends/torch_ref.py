"""Torch reference backend: small and obviously correct; what the tests compare the others to.

It materialises ``[N, V]`` intermediates, so it is the slow, memory-hungry path: use it to check,
not to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The torch block reduction and soft-cap epilogue of the chunked ops (ops picks
# `mod.reduce_block` and `mod.tanh_logits` per backend).
from icqs_fast.backends.state import reduce_block, tanh_logits  # noqa: F401
from icqs_fast.types import TokenStats


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> TokenStats:
    """Reference statistics; see :func:`icqs_fast.ops.token_stats` for the contract.

    Non-finite logits (-inf, +inf, NaN) are masked vocabulary entries, as in every backend
    (:mod:`icqs_fast.backends.state`): left out of the softmax and its moments; ``target_rank``
    still counts entries that compare larger; ``is_greedy`` needs a finite target logit."""
    z = logits.to(compute_dtype)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long()
    x = z / temperature
    finite = torch.isfinite(x)
    has = finite.any(-1)
    xf = x.masked_fill(~finite, float("-inf"))
    # Relative to the row's max, from its logsumexp (not log_softmax: torch's CPU log_softmax
    # sums a long row less accurately, 1.2e-5 against 7e-7 in the log-sum at V = 151936 in fp32).
    top = torch.where(has, xf.amax(-1), torch.zeros_like(xf[:, 0]))
    xs = xf - top[:, None]
    lse_s = torch.logsumexp(xs, dim=-1)
    lse = lse_s + top  # -inf for a row with no finite entry
    logp = (xs - lse_s[:, None]).masked_fill(~finite, 0.0)
    p = logp.exp().masked_fill(~finite, 0.0)
    entropy = -(p * logp).sum(-1)
    # Var_p[-log p] in two passes (E[x^2] - E[x]^2 cancels badly in fp32).
    varentropy = (p * (logp + entropy[:, None]).square()).sum(-1)
    n_fin = finite.sum(-1)
    mean = logp.sum(-1) / n_fin.clamp_min(1)
    dev = torch.where(finite, logp - mean[:, None], torch.zeros_like(logp))
    logprob_var = (dev * dev).sum(-1) / (n_fin - 1).clamp_min(1)
    tgt_logit = z.gather(-1, safe_t[:, None])[:, 0]
    logprob = (tgt_logit / temperature - top) - lse_s  # a large common offset costs nothing
    zero = torch.zeros_like(lse)
    max_logprob = torch.where(has, -lse_s, zero)
    cols = torch.arange(z.shape[-1], device=z.device)[None, :]
    target_rank = (z > tgt_logit[:, None]).sum(-1)
    tie_before = ((z == tgt_logit[:, None]) & (cols < safe_t[:, None])).sum(-1)
    is_greedy = torch.isfinite(tgt_logit) & (target_rank == 0) & (tie_before == 0)
    out = TokenStats(
        logprob=logprob,
        entropy=torch.where(has, entropy, zero),
        varentropy=torch.where(has, varentropy, zero),
        logprob_var=logprob_var,
        max_logprob=max_logprob,
        is_greedy=is_greedy,
        target_rank=target_rank.long(),
        valid=valid,
    )
    return _zero_invalid(out, valid)


def _zero_invalid(s: TokenStats, valid: torch.Tensor) -> TokenStats:
    def z(x: torch.Tensor) -> torch.Tensor:
        x = x.float() if x.is_floating_point() else x
        return torch.where(valid, x, torch.zeros_like(x))

    res = s.map(z)
    res.valid = valid
    return res


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
) -> TokenStats:
    """Reference: materialise the logits in fp32, then :func:`token_stats`."""
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return token_stats(logits, targets, ignore_index=ignore_index, temperature=temperature)

# ------------------------------------------------------------------ attention entropy (torch)


def _entropy_rows(s: torch.Tensor, allow: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax over the last dim of fp32 scores ``s [..., K]``, restricted to
    ``allow`` (bool, broadcastable to ``s``; None = every key); 0 for rows with no allowed key.
    Shifted form ``H = log l - t / l`` with ``l = sum e^z``, ``t = sum e^z z``, ``z = s - max``.
    ``s`` is overwritten (in place keeps the CPU path at two score-sized buffers)."""
    if allow is not None:
        s.masked_fill_(~allow, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if allow is not None:
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = s.sub_(m)
    e = torch.exp(z)
    l_ = e.sum(-1)
    if allow is not None:
        z.masked_fill_(~allow, 0.0)  # e = 0 there; avoid 0 * -inf
    t = e.mul_(z).sum(-1)
    ok = l_ > 0
    safe = torch.where(ok, l_, torch.ones_like(l_))
    return torch.where(ok, (torch.log(safe) - t / safe).clamp_min(0.0), torch.zeros_like(l_))


def attention_entropy_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_range: torch.Tensor,
    query_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    chunk: int = 512,
    ent_chunk: int | None = None,
    *,
    window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch forward with entropy (inputs already validated by ``icqs_fast.ops``).

    The output comes from ``scaled_dot_product_attention`` one block of ``chunk`` query rows at a
    time (its mask block is ``[B, 1, chunk, Tk]`` bool; with ``softcap`` or ``sinks`` an explicit
    fp32 softmax of the block instead); the entropy is computed only for the flagged rows and
    only over the key range, ``ent_chunk`` rows at a time (scores ``[Hq, ent_chunk, k1 - k0]``
    fp32; by default about 1M scores, at most ``chunk`` rows). Memory is O(B * Hq * chunk * Tk),
    never ``[B, Hq, Tq, Tk]`` for ``Tq > chunk``.

    Args:
        q: ``[B, Hq, Tq, D]``; k ``[B, Hk, Tk, D]``, v ``[B, Hk, Tk, Dv]``; key_range ``[B, 2]``
        int64; query_mask ``[B, Tq]`` bool; attention_mask ``[B, Tk]`` bool or None; causal;
        scale; chunk: query rows per masked block; ent_chunk: flagged rows per entropy block
        (None = automatic); window, chunk_size (the ``chunk`` of ``ops.attention_entropy``: keys
        in the query's chunk), softcap, sinks ``[Hq]``: the layer's variant (see
        :func:`icqs_fast.ops.attention_entropy`).

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype and ``entropy [B, Hq, Tq]`` fp32.
    """
    bsz, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    group = hq // hk
    off = tk - tq
    dev = q.device
    kpos = torch.arange(tk, device=dev)
    local = window is not None or chunk_size is not None

    def position_ok(qpos: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
        """``[n, K]``: the window / chunk rule between query and key positions."""
        ok = torch.ones(qpos.shape[0], kp.shape[0], dtype=torch.bool, device=dev)
        if window is not None:
            ok = ok & (qpos[:, None] - kp[None, :] < window)
        if chunk_size is not None:
            ok = ok & (torch.div(kp, chunk_size, rounding_mode="floor")[None, :]
                       == torch.div(qpos, chunk_size, rounding_mode="floor")[:, None])
        return ok

    # ---- output
    explicit = softcap is not None or sinks is not None or v.shape[-1] != d
    if attention_mask is None and (not causal or tq == tk) and not local and not explicit:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and tq > 1, scale=scale,
                                             enable_gqa=group > 1)
    else:
        out = torch.empty(bsz, hq, tq, v.shape[-1], device=dev, dtype=q.dtype)
        for r0 in range(0, tq, chunk):
            r1 = min(tq, r0 + chunk)
            allow = torch.ones(bsz, 1, r1 - r0, tk, dtype=torch.bool, device=dev)
            if attention_mask is not None:
                allow = allow & attention_mask[:, None, None, :].bool()
            qpos = off + torch.arange(r0, r1, device=dev)
            if causal:
                allow = allow & (kpos[None, :] <= qpos[:, None])[None, None]
            if local:
                allow = allow & position_ok(qpos, kpos)[None, None]
            if explicit:
                o = _explicit_attention(q[:, :, r0:r1], k, v, allow, scale, softcap, sinks)
            else:
                o = F.scaled_dot_product_attention(q[:, :, r0:r1], k, v, attn_mask=allow,
                                                   scale=scale, enable_gqa=group > 1)
            # Rows with no allowed key: SDPA may return NaN there; the contract is 0.
            o = torch.where(allow.any(-1, keepdim=True), o, torch.zeros((), dtype=o.dtype,
                                                                         device=dev))
            out[:, :, r0:r1] = o

    # ---- entropy of the flagged rows over their key range
    ent = torch.zeros(bsz, hq, tq, device=dev, dtype=torch.float32)
    kr = key_range.tolist()
    for b in range(bsz):
        k0, k1 = max(0, int(kr[b][0])), min(tk, int(kr[b][1]))
        rows = query_mask[b].nonzero()[:, 0]
        if k1 <= k0 or rows.numel() == 0:
            continue
        kb = k[b, :, k0:k1].float()  # [Hk, K, D]
        key_ok = (attention_mask[b, k0:k1].bool() if attention_mask is not None
                  else torch.ones(k1 - k0, dtype=torch.bool, device=dev))
        all_keys_ok = bool(key_ok.all())
        # About 1M scores (4 MB) per block: cache-friendly on the CPU and a small peak.
        step = ent_chunk or min(chunk, max(16, (1 << 20) // (hq * (k1 - k0))))
        for r0 in range(0, rows.numel(), step):
            idx = rows[r0:r0 + step]
            n = idx.numel()
            qb = q[b][:, idx].float()  # [Hq, n, D]
            # GQA: query head h uses key head h // group, so group the query heads per key head.
            s = torch.matmul(qb.reshape(hk, group * n, d), kb.transpose(1, 2)) * scale
            s = s.reshape(hq, n, k1 - k0)
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            # A mask only where some key of the range is hidden from some row of the chunk
            # (the common case, response rows over instruction keys, needs none).
            allow = None
            if not all_keys_ok or local or (causal and off + int(idx[0]) < k1 - 1):
                allow = key_ok[None, :].expand(n, -1)
                if causal:
                    allow = allow & (kpos[None, k0:k1] <= (off + idx)[:, None])
                if local:
                    allow = allow & position_ok(off + idx, kpos[k0:k1])
                allow = allow[None]
            ent[b][:, idx] = _entropy_rows(s, allow)
    return out, ent


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor,
                        scale: float, softcap: float | None, sinks: torch.Tensor | None
                        ) -> torch.Tensor:
    """fp32 softmax attention of one query block ``q [B, Hq, n, D]`` with an explicit bool mask
    ``[B, 1, n, Tk]``, score softcapping and sink logits ``[Hq]`` in the denominator."""
    return _attention_block(q, k, v, allow, scale, softcap, sinks)[0]


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor,
                     scale: float, softcap: float | None, sinks: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_explicit_attention`'s output (q's dtype) and the fp32 log-sum-exp ``[B, Hq, n]``
    of the allowed scores (the sinks not included; -inf for a row with no allowed key)."""
    bsz, hq, n, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    s = torch.matmul(q.float().reshape(bsz, hk, group * n, d), k.float().transpose(-1, -2))
    s = s.reshape(bsz, hq, n, -1) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allow, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    total = lse
    if sinks is not None:
        total = torch.logaddexp(lse, sinks.float().view(1, hq, 1, 1).expand_as(lse))
    p = torch.exp(s - torch.where(torch.isfinite(total), total, 0.0))
    o = torch.matmul(p.reshape(bsz, hk, group * n, -1), v.float())
    return o.reshape(bsz, hq, n, -1).to(q.dtype), lse[..., 0]


def attention_entropy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_range: torch.Tensor, query_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None, causal: bool, scale: float, *,
                      window: int | None = None, chunk: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend of :func:`icqs_fast.ops.attention_entropy` (same arguments, already
    validated there): :func:`attention_entropy_torch` with the default blocks."""
    return attention_entropy_torch(q, k, v, key_range, query_mask, attention_mask, causal, scale,
                                   window=window, chunk_size=chunk, softcap=softcap, sinks=sinks)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_mask: torch.Tensor | None, causal: bool, scale: float, *,
                  softcap: float | None = None, window: int | None = None,
                  chunk: int | None = None,
                  positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                  dot_dtype: torch.dtype | None = None,
                  key_batch: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, with_lse: bool = True,
                  rows: int = 512) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of :func:`icqs_fast.ops.attention_lse` (inputs validated there): fp32 scores
    of ``rows`` query rows at a time (``[B, Hq, rows, Tk]``), GQA by grouping the query heads
    per key head, no ``repeat_kv`` copy.

    Args:
        q: ``[B, Hq, Tq, D]``; k ``[B, Hk, Tk, D]``; v ``[B, Hk, Tk, Dv]``; attention_mask
            ``[B, Tk]`` bool or None; causal; scale; softcap ``c`` (scores ``c tanh(s / c)``)
            or None; window / chunk (a local layer's mask on the positions) or None; positions
            ``(q_pos [B, Tq], k_pos [B, Tk])`` (negative key position = masked key) or None
            (query i at ``Tk - Tq + i``, key j at ``j``); dot_dtype (q, k, v rounded to it
            first, the products still in fp32) or None; key_batch ``[B]`` (query batch b
            reads k, v, the mask and key positions of batch ``key_batch[b]``) or None;
            out_dtype (the output rounded to it at the end) or None; with_lse (False: None
            for the lse).

    Returns:
        ``out [B, Hq, Tq, Dv]`` in q's dtype (0 for a row with no allowed key) and ``lse
        [B, Hq, Tq]`` fp32 (-inf for such a row), or None without ``with_lse``.
    """
    if key_batch is not None:  # the reference gathers what the kernel reads in place
        k, v = k.index_select(0, key_batch), v.index_select(0, key_batch)
        if attention_mask is not None:
            attention_mask = attention_mask.index_select(0, key_batch)
        if positions is not None:
            positions = (positions[0], positions[1].index_select(0, key_batch))
    if dot_dtype is not None:
        q, k, v = (x.to(dot_dtype).to(x.dtype) for x in (q, k, v))
    bsz, hq, tq, _ = q.shape
    tk = k.shape[2]
    dev = q.device
    if positions is None:
        q_all = (tk - tq + torch.arange(tq, device=dev)).expand(bsz, tq)
        k_all = torch.arange(tk, device=dev).expand(bsz, tk)
    else:
        q_all, k_all = positions[0].long(), positions[1].long()
    out = torch.empty(bsz, hq, tq, v.shape[-1], dtype=q.dtype, device=dev)
    lse = torch.empty(bsz, hq, tq, dtype=torch.float32, device=dev)
    for r0 in range(0, tq, rows):
        r1 = min(tq, r0 + rows)
        qp, kp = q_all[:, r0:r1, None], k_all[:, None, :]  # [B, n, 1], [B, 1, Tk]
        allow = (kp >= 0).expand(bsz, r1 - r0, tk)
        if attention_mask is not None:
            allow = allow & attention_mask[:, None, :]
        if causal:
            allow = allow & (kp <= qp)
        if window is not None:
            allow = allow & (qp - kp < window)
        if chunk is not None:
            allow = allow & (torch.div(kp, chunk, rounding_mode="floor")
                             == torch.div(qp, chunk, rounding_mode="floor"))
        out[:, :, r0:r1], lse[:, :, r0:r1] = _attention_block(q[:, :, r0:r1], k, v,
                                                              allow[:, None], scale, softcap,
                                                              None)
    return (out if out_dtype is None else out.to(out_dtype)), lse if with_lse else None


def bf16_terms(x: torch.Tensor, terms: int) -> list[torch.Tensor]:
    """``x`` (fp32) as ``terms`` bf16-valued fp32 tensors: each the round-to-nearest-even of
    what the previous ones left (their sum is ``x`` exactly for 3 terms)."""
    out, rest = [], x.float()
    for _ in range(terms):
        t = rest.bfloat16().float()
        out.append(t)
        rest = rest - t
    return out


def pack_linear(weight: torch.Tensor, products: str) -> torch.Tensor:
    """The reference keeps the weight as it computes with it: fp32, or rounded to bf16."""
    w = weight.float()
    return w.clone() if products == "fp32" else w.bfloat16().float()


def unpack_linear(packed: torch.Tensor, n: int, k: int, products: str) -> torch.Tensor:
    """The reference's packed weight is the ``[n, k]`` weight itself."""
    return packed.clone()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, products: str,
           bias: torch.Tensor | None, up: torch.Tensor | None = None,
           residual: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32,
           rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The products of :func:`icqs_fast.ops.linear` in float64 (the input's bf16 terms, the
    weight as packed), summed in float64 and rounded once to fp32: within fp32 rounding of
    every backend's result (not bit for bit). With ``up`` (:func:`icqs_fast.ops.linear`'s gated
    product): ``silu(x W^T) * (x up^T)``, all in float64; with ``residual``: it is added in
    float64 too. The result is fp32, then rounded to ``out_dtype``; with ``rotary`` (``(cos,
    sin)`` ``[B or 1, T, D]``), each D-wide head of the fp32 result is rotated by
    :func:`rotary` (rows ``B T``)."""
    terms = {"fp32": None, "bf16": 1, "bf16x2": 2, "bf16x3": 3}[products]
    xs = [x.float()] if terms is None else bf16_terms(x, terms)
    acc = sum(t.double() @ packed.double().t() for t in xs)
    if bias is not None:
        acc = acc + bias.double()
    if up is not None:
        acc = acc * torch.sigmoid(acc) * sum(t.double() @ up.double().t() for t in xs)
    if residual is not None:
        acc = acc + residual.double()
    out = acc.float()
    return (out if rotary is None else _rotate_heads(out, *rotary)).to(out_dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`icqs_fast.ops.rotary`: ``x * cos + rotate_half(x) * sin`` with the
    halves swapped and the first negated, in ``x``'s dtype."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin[:, None]


def _rotate_heads(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``out [B T, N]``'s D-wide heads rotated by :func:`rotary` (``cos``, ``sin``: ``[B or 1,
    T, D]``)."""
    t, d = cos.shape[1], cos.shape[2]
    heads = out.view(-1, t, out.shape[-1] // d, d).transpose(1, 2)
    return rotary(heads, cos, sin).transpose(1, 2).reshape(out.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of :func:`icqs_fast.ops.rms_norm`, in float64, rounded once to ``x``'s dtype
    (then to ``out_dtype`` when given)."""
    xd = x.double()
    out = (xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)
    return out if out_dtype is None else out.to(out_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 normed_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`icqs_fast.ops.add_rms_norm`: the sum in ``x``'s dtype (what it
    is defined as), then :func:`rms_norm`'s float64 reference of that sum (rounded on to
    ``normed_dtype`` when given)."""
    total = residual + x
    normed = rms_norm(total, weight, eps)
    return total, normed if normed_dtype is None else normed.to(normed_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`icqs_fast.ops.silu_mul`, in float64, rounded once to the dtype."""
    g = gate.double()
    return (g * torch.sigmoid(g) * up.double()).to(gate.dtype)


def concat_slots(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 width: int) -> torch.Tensor:
    """Reference of :func:`icqs_fast.ops.concat_slots`: a row and a part at a time."""
    src0 = parts[0][0]
    r = parts[0][1].shape[0]
    out = torch.zeros(r, src0.shape[1], width, src0.shape[3], dtype=src0.dtype,
                      device=src0.device)
    for i in range(r):
        at = 0
        for p, (src, rows, starts, counts) in enumerate(parts):
            row, st, n = int(rows[i]), int(starts[i]), int(counts[i])
            if not (0 <= row < src.shape[0] and st >= 0 and n >= 0 and st + n <= src.shape[2]):
                raise IndexError(f"concat_slots: part {p}, row {i}: source row {row} of "
                                 f"{src.shape[0]}, slots [{st}, {st + n}) of {src.shape[2]}")
            if at + n > width:
                raise IndexError(f"concat_slots: row {i} holds more than the width {width}")
            out[i, :, at:at + n] = src[row, :, st:st + n]
            at += n
    return out
