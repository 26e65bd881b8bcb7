"""The attention ops: :func:`attention_entropy` and :func:`attention_lse`, dispatching like the
other ops (:mod:`icqs_fast.ops`, which exports them) to the ``triton``, ``cpp`` or ``torch``
backend that :mod:`icqs_fast.backends.support` says can run the call."""

from __future__ import annotations

import math

import torch

from icqs_fast import backends
from icqs_fast.backends import support


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_range: torch.Tensor,
    query_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output plus the entropy of flagged rows over a key range, without ever building
    the ``[B, Hq, Tq, Tk]`` attention matrix.

    For query row i with scores ``s_ij = q_i . k_j * scale`` over its allowed keys (causal: key
    position <= ``Tk - Tq + i``; not padded), the entropy is that of ``softmax_j(s_ij)``
    renormalised over ``key_range[b] = [k0, k1)``. A row with no allowed key in the range gets
    entropy 0; a row with no allowed key at all gets output 0.

    A layer's own attention variant (one per call, as transformers' layers have): ``window``
    (sliding window: query at position ``p`` sees keys ``p - window < j <= p``), ``chunk``
    (keys in the query's chunk ``j // chunk == p // chunk``), ``softcap`` (scores
    ``c * tanh(s / c)``, Gemma 2), ``sinks`` (``[Hq]`` logits of attention sinks, gpt-oss: they
    take a share of each row's softmax mass, so the output shrinks by ``1 / (1 + e^(sink - lse))``;
    the entropy, renormalised over the key range, is unchanged). Positions are key slots:
    queries at the last ``Tq`` slots, right padding only. These variants (and a value head size
    other than ``D``) run on the torch backend, and all but ``softcap`` on the cpp one
    (``"auto"`` picks a backend that has the call's variant; the table of
    :mod:`icqs_fast.backends.support` says which).

    Args:
        q: ``[B, Hq, Tq, D]`` float32/float16/bfloat16.
        k, v: ``[B, Hk, Tk, D]`` (v may have another head size, ``Dv``), same dtype and device;
            ``Hq`` a multiple of ``Hk`` (GQA).
        key_range: ``[B, 2]`` int64 ``(start, end)`` key positions (clipped to ``[0, Tk]``).
        query_mask: ``[B, Tq]`` bool, rows whose entropy is wanted.
        attention_mask: ``[B, Tk]`` bool (True = real token, False = padding) or None.
        causal: causal masking with queries at the last ``Tq`` positions.
        scale: score multiplier, ``1 / sqrt(D)`` if None.
        backend: ``"auto"`` (triton on CUDA, cpp on the CPU when the extension is built, else
            torch), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"cpp"`` (CPU:
            two calls of the C++ flash kernel of :func:`attention_lse`, fp32 arithmetic) or
            ``"torch"``; a backend named for a variant it lacks is a ValueError.
        window, chunk, softcap, sinks: the layer's attention variant (see above), or None.

    Returns:
        ``(out [B, Hq, Tq, Dv]`` in q's dtype, ``entropy [B, Hq, Tq]`` fp32, 0 where
        ``query_mask`` is False).
    """
    _check_attention(q, k, v, attention_mask, causal)
    b, hq, tq, d = q.shape
    if key_range.shape != (b, 2) or key_range.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"key_range must be [{b}, 2] int64, got {list(key_range.shape)} "
                         f"{key_range.dtype}")
    if query_mask.shape != (b, tq) or query_mask.dtype != torch.bool:
        raise ValueError(f"query_mask must be [{b}, {tq}] bool, got {list(query_mask.shape)} "
                         f"{query_mask.dtype}")
    for name, val in (("window", window), ("chunk", chunk)):
        if val is not None and (not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {val!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [{hq}] (one logit per query head), got "
                         f"{list(sinks.shape)}")
    opts = support.requested(window=window, chunk=chunk, softcap=softcap, sinks=sinks,
                             value_dim=v.shape[3] != d)
    name = backends.choose("attention_entropy", backend, q.device, q.dtype, opts)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    key_range = key_range.to(q.device).long()
    query_mask = query_mask.to(q.device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(q.device)
    # Only the options the call sets: the table said the backend has each of them.
    variant = {opt: x for opt, x in (("window", window), ("chunk", chunk), ("softcap", softcap),
                                     ("sinks", sinks)) if x is not None}
    return backends.module(name).attention_entropy(q, k, v, key_range, query_mask,
                                                   attention_mask, bool(causal), float(scale),
                                                   **variant)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    dot_dtype: torch.dtype | None = None,
    backend: str = "auto",
    state: torch.Tensor | None = None,
    return_state: bool = False,
    key_batch: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention returning the output and the log-sum-exp of each row's scores, so that
    partial attentions over disjoint key sets merge exactly (cascade attention's prefix and
    suffix parts), without building the ``[B, Hq, Tq, Tk]`` matrix on the triton and cpp
    backends.

    For query row i, scores ``s_ij = q_i . k_j * scale`` (then ``c * tanh(s / c)`` with a
    ``softcap`` ``c``) over its allowed keys: not padded; with ``causal`` key position <= query
    position; with ``window`` ``w`` query position - key position < ``w`` (sliding window);
    with ``chunk`` ``c`` both in the same chunk ``position // c``. Positions are the key slots
    (query i at ``Tk - Tq + i``, key j at ``j``) unless ``positions`` gives them.

    Args:
        q: ``[B, Hq, Tq, D]`` float32/float16/bfloat16.
        k, v: ``[B, Hk, Tk, D]`` and ``[B, Hk, Tk, Dv]``, q's dtype and device; ``Hq`` a multiple
            of ``Hk`` (GQA: query head h reads key head ``h // (Hq / Hk)``).
        scale: score multiplier, ``1 / sqrt(D)`` if None.
        causal: causal masking (on the positions).
        attention_mask: ``[B, Tk]`` bool (True = real key) or None.
        softcap: score soft cap ``c > 0`` or None.
        window, chunk: an int >= 1 (sliding window / chunked attention, a local layer's mask)
            or None.
        positions: ``(q_pos [B, Tq], k_pos [B, Tk])`` integer token positions, a negative key
            position marking a masked key (e.g. a bank's padding inside sequences), or None.
        dot_dtype: ``torch.bfloat16``: q, k and v enter both products rounded to bf16, with
            fp32 accumulation (mixed precision: fp32 activations, bf16 products), or None.
        backend: ``"auto"`` (triton on CUDA and cpp on the CPU for what their kernels take,
            torch otherwise), ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``),
            ``"cpp"`` (the C++ extension, CPU tensors) or ``"torch"`` (the reference, fp32
            scores); the table of :mod:`icqs_fast.backends.support` says which variants each
            takes.
        state, return_state: one softmax pass over keys split across calls (the cpp backend):
            ``return_state=True`` returns ``(state, None)``, the rows' running state after these
            keys, instead of normalising; a later call with ``state=`` continues it over its
            own keys. When the first call's keys end on a multiple of
            :data:`ATTENTION_KEY_BLOCK` slots and the second's start there (both in slot =
            position order), the result is the same bits as one call over all the keys: what
            lets the cascade match a plain forward exactly.
        key_batch: ``[B]`` integer, each in ``[0, Bk)``: query batch ``b`` attends to batch
            ``key_batch[b]`` of ``k``, ``v`` (``[Bk, Hk, Tk, D]``), ``attention_mask`` and the
            key positions (``[Bk, Tk]``), as if they had been gathered (rows that share a
            prefix's keys read them once, in place on cpp); or None (``Bk = B``).
        out_dtype: ``torch.bfloat16`` (float32 ``q``, not with ``return_state``): the output
            rounded to bf16 (nearest even), written so on cpp, the input a bf16-products
            :func:`icqs_fast.ops.linear` then reads in place; or None (``q``'s dtype).
        with_lse: False: ``lse`` is None (a caller that only wants the output; the cpp
            kernel then skips the log it takes per row).

    Returns:
        ``(out [B, Hq, Tq, Dv]`` in q's dtype, ``lse [B, Hq, Tq]`` fp32: natural log of the sum
        of ``exp(score)`` over the allowed keys; a row with none has ``lse = -inf`` and output 0,
        so it drops out of a log-sum-exp merge exactly; None without ``with_lse``).
    """
    b, _, tq, d = q.shape
    bk = b
    if key_batch is not None:
        bk = k.shape[0]
        if (not isinstance(key_batch, torch.Tensor) or key_batch.shape != (b,)
                or key_batch.is_floating_point() or key_batch.dtype == torch.bool):
            raise ValueError(f"key_batch must be a [{b}] integer tensor or None")
        key_batch = key_batch.to(q.device)
        if b and key_batch.device.type == "cpu" and not (
                0 <= int(key_batch.min()) and int(key_batch.max()) < bk):
            raise ValueError(f"key_batch values must be in [0, {bk}) (the key batches)")
    # With positions, causality compares them, not slots: more queries than keys is fine.
    _check_attention(q, k, v, attention_mask, causal and positions is None, bk)
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap)
                                    and softcap > 0):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    for name, val in (("window", window), ("chunk", chunk)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {val!r}")
    if positions is not None:
        ok = isinstance(positions, (tuple, list)) and len(positions) == 2 and all(
            isinstance(p, torch.Tensor) and not p.is_floating_point() and not p.is_complex()
            and p.dtype != torch.bool for p in positions)
        if not ok or positions[0].shape != (b, tq) or positions[1].shape != (bk, k.shape[2]):
            raise ValueError(f"positions must be (q_pos [{b}, {tq}], k_pos [{bk}, {k.shape[2]}]) "
                             "integer tensors or None")
        positions = (positions[0].to(q.device), positions[1].to(q.device))
    if dot_dtype not in (None, torch.bfloat16):
        raise ValueError(f"dot_dtype must be torch.bfloat16 or None, got {dot_dtype!r}")
    if out_dtype not in (None, q.dtype) and not (
            out_dtype == torch.bfloat16 and q.dtype == torch.float32 and not return_state):
        raise ValueError(f"out_dtype must be q's dtype, or bfloat16 for float32 q without "
                         f"return_state; got {out_dtype!r}")
    out_dtype = None if out_dtype == q.dtype else out_dtype
    opts = support.requested(softcap=softcap, value_dim=v.shape[3] != d, window=window,
                             chunk=chunk, positions=positions is not None,
                             dot_dtype=dot_dtype is not None and dot_dtype != q.dtype,
                             state=state is not None or return_state,
                             key_batch=key_batch is not None,
                             bf16_out=out_dtype is not None)
    name = backends.choose("attention_lse", backend, q.device, q.dtype, opts)
    if attention_mask is not None:
        attention_mask = attention_mask.to(q.device)
    # Only the options the call sets: the table said the backend has each of them.
    variant = {opt: x for opt, x in (("softcap", None if softcap is None else float(softcap)),
                                     ("window", window), ("chunk", chunk),
                                     ("positions", positions),
                                     ("dot_dtype", dot_dtype if "dot_dtype" in opts else None))
               if x is not None}
    if state is not None or return_state:
        variant.update(state=state, return_state=bool(return_state))
    if key_batch is not None:
        variant["key_batch"] = key_batch
    if out_dtype is not None:
        variant["out_dtype"] = out_dtype
    if not with_lse and not return_state:
        variant["with_lse"] = False
    return backends.module(name).attention_lse(
        q, k, v, attention_mask, bool(causal), 1.0 / math.sqrt(d) if scale is None
        else float(scale), **variant)


ATTENTION_KEY_BLOCK = 64
"""Key slots per block of every CPU attention kernel's online softmax (a multiple of each
kernel's own block): a split of the keys at a multiple of it continues the same pass."""


def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attention_mask: torch.Tensor | None, causal: bool,
                     kb: int | None = None) -> None:
    """The argument checks the attention ops share (shapes, dtypes, devices, GQA, causality,
    the key mask; ``kb``: the key batches, ``B`` if None); no host sync."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4D tensor [B, H, T, D], got "
                             f"{getattr(t, 'shape', type(t))}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    b, hq, tq, d = q.shape
    kb = b if kb is None else kb
    if k.shape[:3] != v.shape[:3] or k.shape[0] != kb or k.shape[3] != d:
        raise ValueError(f"k must be [B={kb}, Hk, Tk, D={d}] and v [B, Hk, Tk, Dv]; got k "
                         f"{list(k.shape)}, v {list(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError("q, k and v must share dtype and device")
    hk, tk = k.shape[1], k.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if causal and tq > tk:
        raise ValueError(f"causal attention needs Tq <= Tk, got Tq={tq}, Tk={tk}")
    if attention_mask is not None and (attention_mask.shape != (kb, tk)
                                       or attention_mask.dtype != torch.bool):
        raise ValueError(f"attention_mask must be [{kb}, {tk}] bool or None, got "
                         f"{list(attention_mask.shape)} {attention_mask.dtype}")
