"""Triton backend: ``token_stats``, ``linear_token_stats``, ``attention_entropy`` and
``attention_lse`` on the kernels in ``icqs_fast.kernels`` (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``).

The kernels write the per-row fp32 state of :mod:`icqs_fast.backends.state`; this wrapper checks
inputs, allocates outputs, merges partial states and calls :func:`state.finalize`.
"""

from __future__ import annotations

import math

import torch

from icqs_fast.backends import state as _state
from icqs_fast.types import TokenStats

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available() -> tuple[bool, str]:
    """(True, version) when triton imports and can run here (a CUDA device or the interpreter)."""
    from icqs_fast.kernels.launch import triton_interpreting

    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return False, f"triton does not import: {exc}"
    try:
        from icqs_fast.kernels import linear_token_stats, token_stats  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return False, f"icqs_fast.kernels does not import: {exc}"
    note = f"; {token_stats.COMBINE_NOTE}" if token_stats.COMBINE_NOTE else ""
    if torch.cuda.is_available():
        return True, f"ok (triton {triton.__version__}, CUDA{note})"
    if triton_interpreting():
        return True, f"ok (triton {triton.__version__}, CPU interpreter: slow, for tests{note})"
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"


def _prepare(targets: torch.Tensor, ignore_index: int):
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long().contiguous()
    return valid, safe_t


def _finite_var_rows(chunks) -> torch.Tensor:
    """Sample variance (n - 1 denominator, 0 below 2 entries) of the finite entries of some
    rows, from float64 column chunks ``[R, Vc]`` (Chan et al.'s pairwise combination of
    (count, mean, M2), so no chunk's magnitude cancels against another's)."""
    n = mean = m2 = None
    for x in chunks:
        fin = torch.isfinite(x)
        nc = fin.sum(-1).double()
        xs = x.masked_fill(~fin, 0.0)
        mc = xs.sum(-1) / nc.clamp_min(1)
        m2c = ((x - mc[:, None]).masked_fill(~fin, 0.0) ** 2).sum(-1)
        if n is None:
            n, mean, m2 = nc, mc, m2c
            continue
        tot = n + nc
        delta = mc - mean
        frac = torch.where(tot > 0, nc / tot.clamp_min(1), torch.zeros_like(tot))
        m2 = m2 + m2c + delta * delta * n * frac
        mean = mean + delta * frac
        n = tot
    return m2 / (n - 1).clamp_min(1)


def _fix_nonfinite_target_var(out: TokenStats, z_t: torch.Tensor, valid: torch.Tensor,
                              row_chunks) -> None:
    """The kernels keep the log-prob-variance sums relative to the target's logit, which has
    no finite value on a row whose target logit is -inf/+inf/NaN (a masked entry): there they
    fall back to origin 0, and fp32 sums of logits far from 0 cancel. Such rows are rare
    (masked vocabulary entries as targets), so their ``logprob_var`` is recomputed directly in
    float64 from ``row_chunks(rows)``, an iterator of ``[R, Vc]`` float64 ``x = z / T``.

    Finding those rows on the host would stop the GPU queue once per call; on a GPU the fix
    is left pending on ``out`` (``TokenStats.defer_var_fix``) and done when the results are
    read: ``TokenStats.to_host`` reads the row flags in the same one copy as the results."""
    bad = valid & ~torch.isfinite(z_t)

    def fix(rows: torch.Tensor) -> torch.Tensor:
        return _finite_var_rows(row_chunks(rows))

    if z_t.device.type != "cpu":
        out.defer_var_fix(bad, fix)
        return
    rows = bad.nonzero()[:, 0]
    if rows.numel():
        out.logprob_var[rows] = fix(rows).to(out.logprob_var.dtype)


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
    *,
    block_v: int | None = None,
    splits: int | None = None,
) -> TokenStats:
    """Token statistics of ``logits [N, V]`` (fp32/fp16/bf16) at ``targets [N]`` int64, reading
    each logit once (one program per row, or per vocabulary chunk when N is small).
    float64 logits go to the torch reference. ``block_v`` and ``splits`` override the launch
    settings (tests use small blocks and split rows to exercise the rescaling and the merge).

    Extra memory: ``[S, N, 7]`` fp32 + ``[S, N, 2]`` int64 partial states, ``S = 1`` unless N is
    small (then ``S * N`` is a few hundred)."""
    if logits.dtype not in _DTYPES:
        from icqs_fast.backends import torch_ref

        return torch_ref.token_stats(logits, targets, ignore_index, temperature,
                                     compute_dtype=logits.dtype)
    from icqs_fast.kernels import token_stats as _k

    n, v = logits.shape
    if v == 0 and n:
        raise ValueError("logits have an empty vocabulary dimension (V = 0)")
    z = logits if (v <= 1 or logits.stride(1) == 1) else logits.contiguous()
    valid, safe_t = _prepare(targets, ignore_index)
    z_t = z.gather(1, safe_t[:, None])[:, 0].float().contiguous()
    if n == 0:
        st, counts = _state.empty(0, device=z.device)
        return _state.finalize(st, counts, z_t.double(), valid, temperature)
    if splits is None and z.device.type != "cuda":
        from icqs_fast.kernels.launch import triton_interpreting

        # The CPU interpreter pays per program, not per SM: one program per row there.
        splits = 1 if triton_interpreting() else None
    cfg = _k.token_stats_settings(n, v, z.dtype, block_v, splits)
    st = _state.new_buffer(cfg.splits, n, _state.STATE_WIDTH, dtype=torch.float32,
                           device=z.device)
    counts = _state.new_buffer(cfg.splits, n, 2, dtype=torch.int64, device=z.device)
    _k.launch_token_stats(z, safe_t, z_t, temperature, st, counts, cfg)
    if cfg.splits > 1:
        st64, counts = merge_partials(st, counts)
    else:
        st64, counts = st[0].double(), counts[0]
    out = _state.finalize(st64, counts, z_t.double(), valid, temperature)
    _fix_nonfinite_target_var(out, z_t, valid,
                              lambda rows: iter([z[rows].double() / temperature]))
    return out


def merge_partials(pstate: torch.Tensor, pcounts: torch.Tensor,
                   log2_origin: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[C, N, 7]`` partial states of disjoint vocabulary chunks into ``[N, 7]`` float64
    and ``[C, N, 2]`` integer counts into ``[N, 2]`` int64 (all chunks at once; the algebra of
    :func:`state.merge`).

    Args:
        pstate: ``[C, N, 7]`` fp32 ``(m, s0, s1, s2, n, u1, u2)``, natural units, or with
            ``log2_origin`` given, log2 units relative to it (the fused linear kernel's form:
            it reduces ``y = (x - origin) log2(e)``), converted back after the merge, in
            float64.
        pcounts: ``[C, N, 2]`` int32/int64 rank counts.
        log2_origin: ``[N]`` per-row origin ``K`` in natural ``x`` units (float64 preferred).
    """
    s = pstate.double()
    unit = 1.0 if log2_origin is None else math.log(2.0)
    m = s[..., 0].amax(0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    nonempty = s[..., 1] > 0
    d = torch.where(nonempty, s[..., 0] - m_safe, torch.zeros_like(s[..., 0]))
    w = torch.where(nonempty, torch.exp(d * unit), torch.zeros_like(d))
    s0, s1, s2 = s[..., 1], s[..., 2], s[..., 3]
    out = torch.stack([
        m,
        (w * s0).sum(0),
        (w * (s1 + d * s0)).sum(0),
        (w * (s2 + 2 * d * s1 + d * d * s0)).sum(0),
        s[..., 4].sum(0), s[..., 5].sum(0), s[..., 6].sum(0),
    ], dim=-1)
    if log2_origin is not None:
        # Back to natural units: x = origin + y ln 2; u sums are relative to K = origin.
        out *= out.new_tensor([unit, 1.0, unit, unit * unit, 1.0, unit, unit * unit])
        out[:, 0] += log2_origin.double()
    return out, pcounts.sum(0, dtype=torch.int64)


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    tiles: int | None = None,
    tanh_scale: float | None = None,
) -> TokenStats:
    """Fused ``hidden @ weight.T`` + statistics (see :mod:`icqs_fast.kernels.linear_token_stats`).

    ``tanh_scale`` ``a``: the soft-cap epilogue, every logit ``z`` (the target's too) becomes
    ``tanh(a z)`` in the kernels' fp32 epilogue (the ``HAS_SOFTCAP`` variant), the ranks
    compare the uncapped logits; the caller passes the matching temperature
    (``ops.linear_token_stats`` maps its arguments).

    Block sizes, warps, stages and grid come from ``kernels.linear_token_stats.launch_settings``
    (the explicit block arguments override it; tests use small blocks to exercise the merge).
    Extra memory: ``[C, N, 7]`` fp32 + ``[C, N, 2]`` int64 partial states (44 bytes per chunk
    and row) with ``C = cdiv(V, block_n * tiles)`` chunks, about 140 bytes per chunk and row at
    the peak while :func:`merge_partials` folds them in float64, plus ``O(N)`` per-row vectors;
    never ``[N, V]`` nor ``[N, H]``.
    """
    from icqs_fast.kernels import linear_token_stats as _k
    from icqs_fast.kernels.launch import triton_interpreting

    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share a float32/float16/bfloat16 dtype, got "
                        f"{hidden.dtype} and {weight.dtype}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError("hidden, weight and targets must be on one device")
    n, hdim = hidden.shape
    v = weight.shape[0]
    valid, safe_t = _prepare(targets, ignore_index)
    if bias is not None:
        bias = bias.contiguous()
    # Target logits, one fp32 row-wise dot product each, read straight from hidden and weight
    # (the kernel compares every logit to them): [N] out, no [N, H] gather.
    z_t = _state.new_buffer(n, dtype=torch.float32, device=hidden.device)
    z_raw = None
    if tanh_scale is None:
        _k.target_logits(hidden, weight, bias, safe_t, z_t)
    else:  # the soft cap: z_t capped, z_raw uncapped (for the ranks)
        z_raw = _state.new_buffer(n, dtype=torch.float32, device=hidden.device)
        _k.target_logits(hidden, weight, bias, safe_t, z_t, tanh_scale=tanh_scale,
                         raw_out=z_raw)
    interp = triton_interpreting() and hidden.device.type != "cuda"
    # Block sizes, warps, stages and grid come from the one settings function that
    # kernels.linear_token_stats.gpu_launches also describes.
    cfg = _k.launch_settings(n, hdim, v, hidden.dtype, interpret=interp, block_m=block_m,
                             block_n=block_n, block_k=block_k, tiles=tiles)
    chunks = cfg.chunks
    pstate = _state.new_buffer(chunks, n, _state.STATE_WIDTH, dtype=torch.float32,
                         device=hidden.device)
    pcounts = _state.new_buffer(chunks, n, 2, dtype=torch.int64, device=hidden.device)
    if n and v:
        if tanh_scale is None:
            _k.launch(hidden, weight, bias, safe_t, z_t, temperature, pstate, pcounts, cfg)
        else:
            _k.launch(hidden, weight, bias, safe_t, z_t, temperature, pstate, pcounts, cfg,
                      tanh_scale=tanh_scale, z_raw=z_raw)
    # The kernel's partials are in log2 units relative to x_ref = zref / T (zref: the target
    # logit when finite, else 0).
    zt64 = z_t.double()
    origin = torch.where(torch.isfinite(zt64), zt64, torch.zeros_like(zt64)) / temperature
    st, counts = (merge_partials(pstate, pcounts, origin) if chunks
                  else _state.empty(n, hidden.device))
    out = _state.finalize(st, counts, z_t.double(), valid, temperature)

    def logit_chunks(rows: torch.Tensor, width: int = 8192):
        # [R, width] float64 logits at a time: never a float64 copy of the whole head.
        h64 = hidden[rows].double()
        for v0 in range(0, v, width):
            z = h64 @ weight[v0:v0 + width].double().t()
            if bias is not None:
                z = z + bias[v0:v0 + width].double()
            if tanh_scale is not None:
                z = torch.tanh(z * tanh_scale)
            yield z / temperature

    _fix_nonfinite_target_var(out, z_t, valid, logit_chunks)
    return out


def attention_entropy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_range: torch.Tensor, query_mask: torch.Tensor,
                      attention_mask: torch.Tensor | None, causal: bool, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused attention with entropy (:mod:`icqs_fast.kernels.attention_entropy`): key
    padding and plain causality only (the table of :mod:`icqs_fast.backends.support` sends the
    layer variants elsewhere). Inputs validated by :func:`icqs_fast.ops.attention_entropy`."""
    from icqs_fast.kernels import attention_entropy as _k

    return _k.attention_entropy(q, k, v, key_range, query_mask, attention_mask, causal, scale)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attention_mask: torch.Tensor | None, causal: bool, scale: float, *,
                  softcap: float | None = None, window: int | None = None,
                  chunk: int | None = None,
                  positions: tuple[torch.Tensor, torch.Tensor] | None = None,
                  dot_dtype: torch.dtype | None = None, with_lse: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused attention with its log-sum-exp output (``RETURN_LSE``, no entropy state):
    scores stay in registers, never a ``[.., Tq, Tk]`` tensor. The layer variants (score
    softcap, sliding window, chunks, token positions with padded slots, ``Dv != D``,
    ``dot_dtype=torch.bfloat16``: bf16 products) are constexpr switches of the one kernel;
    nothing here reads a device value on the host.
    Inputs validated by :func:`icqs_fast.ops.attention_lse`."""
    from icqs_fast.kernels.attention_entropy import attention_lse as _lse

    out, lse = _lse(q, k, v, scale=scale, causal=causal, attention_mask=attention_mask,
                    window=window, chunk=chunk, softcap=softcap, positions=positions,
                    dot_bf16=dot_dtype == torch.bfloat16)
    return out, lse if with_lse else None
