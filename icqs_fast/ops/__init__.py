"""Public ops, one function each, dispatching to the ``triton``, ``cpp`` or ``torch`` backend.

Kernels hold no model logic and model code holds no kernel code: everything the scoring methods
need from the softmax, and the attention they run through a kernel, goes through these
functions. Which backend can run which call (dtypes, devices, options) is the table of
:mod:`icqs_fast.backends.support`: the ``"auto"`` choice and the errors of a backend named for
something it lacks come from there.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from icqs_fast import backends
from icqs_fast.backends import state as _state
from icqs_fast.backends import support

# The attention ops live in their own module (this one was at the module size cap); they are
# ops like the rest, taken from here.
from icqs_fast.ops.attention import (  # noqa: F401
    ATTENTION_KEY_BLOCK,
    attention_entropy,
    attention_lse,
)
from icqs_fast.types import PRODUCTS, PackedLinear, TokenStats

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# linear_token_stats: what every backend's kernels take (float64 is not one of them).
_LINEAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_common(targets: torch.Tensor, n: int, v: int, ignore_index: int, temperature: float
                  ) -> torch.Tensor | None:
    """Argument checks of both ops. The targets' range is checked here on the CPU (free); on
    a GPU it would cost a host sync per call, so there it is computed on the device: returns
    ``bad [N]`` bool (the targets outside ``[0, v)`` that are not ``ignore_index``) for
    :func:`_settle_targets`, or None."""
    ok = isinstance(temperature, (int, float)) and math.isfinite(temperature)
    if not (ok and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape [{n}], got {list(targets.shape)}")
    if not n:
        return None
    valid = targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= v))
    if targets.device.type != "cpu":
        return bad
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(_TARGET_ERROR.format(i=i, value=int(targets[i]), v=v,
                                              ignore_index=ignore_index))
    return None


_TARGET_ERROR = ("targets[{i}] = {value} is outside the vocabulary [0, {v}) and is not "
                 "ignore_index ({ignore_index})")


def _safe_targets(targets: torch.Tensor, bad: torch.Tensor | None, ignore_index: int
                  ) -> torch.Tensor:
    """``targets`` with the out-of-vocabulary ones (``bad``) set to ``ignore_index``, so no
    kernel reads outside the head or the logits."""
    if bad is None:
        return targets
    return torch.where(bad, torch.full_like(targets, ignore_index), targets)


def _settle_targets(out: TokenStats, targets: torch.Tensor, bad: torch.Tensor | None, v: int,
                    ignore_index: int) -> TokenStats:
    """The GPU form of the target check: the bad rows' statistics are NaN (``valid`` False),
    and the ValueError is raised when the results are read (``TokenStats.to_host``, in the
    same one copy as the results, or any field access that resolves them)."""
    if bad is None:
        return out
    nan = torch.full((), math.nan, device=bad.device)
    for name in ("logprob", "entropy", "varentropy", "max_logprob"):
        t = getattr(out, name)
        setattr(out, name, torch.where(bad, nan.to(t.dtype), t))
    out.defer_error(bad, targets, _TARGET_ERROR.replace("{v}", str(v)).replace(
        "{ignore_index}", str(ignore_index)))
    return out


def token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    backend: str = "auto",
) -> TokenStats:
    """Per-token statistics of softmax(logits / temperature) in one read of each row.

    Args:
        logits: ``[N, V]`` (or ``[..., V]``, flattened) float32, float16 or bfloat16; rows may be
            strided (the last dimension must be contiguous for the cpp and triton backends,
            otherwise it is copied).
        targets: ``[N]`` (or ``[...]``) int64 target ids; ``ignore_index`` marks rows to skip;
            on ``logits``' device (else a ValueError, the same on every backend). A target
            outside ``[0, V)`` that is not ``ignore_index`` is a ValueError: at once on the
            CPU; on a GPU (no host sync per call) its row's float statistics are NaN, ``valid``
            False, and the error is raised when the result is read (``TokenStats.to_host``,
            ``map``, ``as_dict``).
        ignore_index: target value of masked rows; their outputs are 0 and ``valid`` False.
        temperature: T > 0; statistics are of softmax(z / T).
        backend: ``"auto"`` (triton on CUDA, cpp on CPU when built, torch otherwise),
            ``"triton"``, ``"cpp"`` or ``"torch"``.

    Returns:
        :class:`TokenStats` with fields shaped like ``targets``: fp32 ``logprob``, ``entropy``,
        ``varentropy``, ``logprob_var``, ``max_logprob``; bool ``is_greedy``; int64
        ``target_rank``; bool ``valid``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise TypeError("logits must be a tensor of shape [N, V]")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    lead = logits.shape[:-1]
    if targets.shape != lead:
        raise ValueError(
            f"targets shape {list(targets.shape)} does not match logits' leading shape {list(lead)}"
        )
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    t = targets.reshape(-1)
    # Before anything reads the targets' values, so every backend gives this same error.
    if targets.device != logits.device:
        raise ValueError(f"token_stats needs all inputs on one device; got logits on "
                         f"{logits.device}, targets on {targets.device}")
    bad = _check_common(t, z.shape[0], v, ignore_index, temperature)
    name = backends.choose("token_stats", backend, logits.device, logits.dtype)
    out = backends.module(name).token_stats(z, _safe_targets(t, bad, ignore_index).long(),
                                            ignore_index, float(temperature))
    out = _settle_targets(out, t, bad, v, ignore_index)
    return out.map(lambda x: x.reshape(lead)) if len(lead) != 1 else out


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    backend: str = "auto",
    chunk_tokens: int = 256,
    chunk_vocab: int = 16384,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    products: str = "fp32",
) -> TokenStats:
    """Token statistics of ``softmax(z / T)``, never building ``[N, V]``, where::

        z = (hidden @ weight.T + bias) * logit_scale
        z = softcap * tanh(z / softcap)          # only if softcap is not None

    (the logit post-processing of Cohere / Granite / MiniCPM3, ``logit_scale``, and of
    Gemma 2/3 / RecurrentGemma, ``softcap`` = ``final_logit_softcapping``). Every statistic is
    of this ``z``; the target logit goes through the same epilogue. ``target_rank`` and
    ``is_greedy`` order the logits before the cap (tanh is increasing, so that is the order of
    the exact capped logits: logits the cap saturates, ``|z| / softcap`` above ~9 in fp32,
    are not made ties by rounding, on any backend). The soft cap turns a ``-inf`` logit into
    the finite ``-softcap`` (no longer masked out); NaN stays masked.

    The product is computed block by block: for each chunk of ``c = min(chunk_tokens, N)``
    tokens, the chunk's target logits (from its ``[c, H]`` gathered weight rows), then the fp32
    logits of each ``c x b`` block, ``b = min(chunk_vocab, V)``, each reduced to a mergeable
    per-row state and dropped. Peak extra memory on the cpp/torch backends, beyond the inputs,
    in bytes (``s``: bytes per weight element; ``[...]``: only when that input is not fp32)::

        72 N                          per-token states and outputs
      + [4 c H]                       fp32 copy of the token chunk's hidden rows
      + max(4 c b + [4 b H] + R,      logits block + the vocabulary block's fp32 weight rows
            c H (s + [4]))            (converted once per call) + block reduction; target step

    where ``R`` is 72 c on cpp and 18 c b on torch (float64 temporaries), plus the BLAS
    library's GEMM workspace. It grows with N only through ``72 N``: never ``N x V`` nor
    ``N x H``. With the default chunks and fp32 inputs that is 16 MiB (cpp) or 88 MiB (torch)
    + 72 bytes per token; a bf16 weight adds ``4 b H`` (256 MiB at H = 4096
    with the default ``chunk_vocab``: pass a smaller one to lower it). The triton backend fuses
    the product and the reduction: ``[C, N]`` partial states, ``C = cdiv(V, block_n * tiles)``,
    about 140 bytes per chunk and token at the peak (see
    :func:`icqs_fast.backends.triton_backend.linear_token_stats`), plus ``O(N)``.

    Dtype and device policy (the same on every backend, applied here before dispatch):
    ``hidden``, ``weight`` and ``bias`` may mix float32/float16/bfloat16; they are all cast to
    ``torch.promote_types`` of their dtypes first (an fp32 head on a bf16 body computes in
    fp32 on the CPU and on the GPU alike; casting the weight costs one ``[V, H]`` copy per
    call, so keep it in the body's dtype or wider). Any other dtype is a TypeError. ``hidden``,
    ``weight``, ``targets`` and ``bias`` must be on one device, else a ValueError naming the
    devices. Out-of-vocabulary targets: as in :func:`token_stats` (on a GPU, raised when the
    result is read).

    Args:
        hidden: ``[N, H]`` float32/float16/bfloat16 hidden states (e.g. before the LM head).
        weight: ``[V, H]`` float32/float16/bfloat16 LM-head weight (promoted with ``hidden``).
        targets: ``[N]`` int64 target ids; ``ignore_index`` rows are skipped.
        bias: optional ``[V]`` float32/float16/bfloat16 bias (promoted with the others).
        temperature, ignore_index, backend: as in :func:`token_stats`.
        chunk_tokens, chunk_vocab: block sizes of the cpp/torch path.
        logit_scale: finite, non-zero multiplier of the logits (1.0: none).
        softcap: finite cap > 0, or None (no soft cap).
        products: the logits' products on the cpp backend (:func:`linear`'s, e.g. ``"bf16x3"``
            for a bf16-valued weight: exact products); the blocks multiply there through
            :func:`linear` with the weight's blocks packed once per weight (kept while the
            weight lives and is unchanged: extra memory of one fp32 copy of the weight for
            ``"fp32"``, one bf16 copy otherwise), so each row's statistics are the same bits
            whatever rows share the call. The torch backend multiplies with torch (fp32).

    How each backend computes it (the defaults cost nothing and change no bit): the scale
    alone is folded into the temperature (``T / |logit_scale|``; a negative scale negates
    ``hidden`` and ``bias``, exact, one ``[N, H]`` copy); with a soft cap every logit ``r``
    becomes ``tanh(r * logit_scale / softcap)`` in fp32 as the reduction reads it (fused into
    the C++ pass and the Triton epilogue, a constexpr variant; a torch op per block on the
    torch backend), at temperature ``T / softcap``.

    Returns:
        :class:`TokenStats` as in :func:`token_stats`.

    Raises:
        ValueError: ``logit_scale`` not finite or 0, ``softcap`` not finite or <= 0 (or their
            ratios outside float32's range), besides the shape/device checks above.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H]; got {list(hidden.shape)} and "
            f"{list(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    hidden, weight, bias = _common_dtype_device(hidden, weight, targets, bias)
    n, v = hidden.shape[0], weight.shape[0]
    bad = _check_common(targets, n, v, ignore_index, temperature)
    checked, targets = targets, _safe_targets(targets, bad, ignore_index)
    negate, temperature, tanh_scale = _epilogue(logit_scale, softcap, float(temperature))
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError("chunk_tokens and chunk_vocab must be >= 1")
    opts = support.requested(bias=bias, logit_scale=float(logit_scale) != 1.0, softcap=softcap)
    name = backends.choose("linear_token_stats", backend, hidden.device, hidden.dtype, opts)
    mod = backends.module(name)
    if negate:
        # z = r * s with s < 0 is (-r) * |s|, and -r = (-hidden) @ W.T + (-bias) exactly.
        hidden = -hidden
        bias = None if bias is None else -bias
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
    if support.entry("linear_token_stats", name).chunked:
        product = (_invariant_blocks(weight, bias, products) if name == "cpp"
                   else _torch_blocks(weight, bias))
        out = _chunked_linear(hidden, weight, targets.long(), bias, ignore_index, temperature,
                              chunk_tokens, chunk_vocab, mod.reduce_block, tanh_scale,
                              getattr(mod, "tanh_logits", None), product)
    else:
        out = mod.linear_token_stats(hidden, weight, targets.long(), bias, ignore_index,
                                     temperature, tanh_scale=tanh_scale)
    return _settle_targets(out, checked, bad, v, ignore_index)


def _epilogue(logit_scale: float, softcap: float | None, temperature: float
              ) -> tuple[bool, float, float | None]:
    """Validate ``logit_scale`` / ``softcap`` and map them onto what the backends compute:
    ``(negate, T', a)``: with ``r = hidden @ weight.T + bias``, negated if ``negate``, the
    backends reduce ``r``, or ``tanh(a r)`` when ``a`` is not None, at temperature ``T'``.

    ``r s / T = (+-r) / (T / |s|)`` and ``c tanh(r s / c) / T = tanh(a (+-r)) / (T / c)`` with
    ``a = |s| / c > 0`` (so ranks of ``+-r`` are ranks of the capped logits); at the defaults
    ``T' = T / 1.0 = T`` bit for bit and nothing else changes."""
    real = (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
            and math.isfinite(x))
    if not (real(logit_scale) and logit_scale != 0):
        raise ValueError(f"logit_scale must be a finite number != 0, got {logit_scale!r}")
    if softcap is not None and not (real(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    s = float(logit_scale)
    if softcap is None:
        t_eff, a = temperature / abs(s), None
    else:
        t_eff, a = temperature / float(softcap), abs(s) / float(softcap)
    negate = s < 0
    # The kernels take 1 / T' and a as fp32: they must stay normal, finite floats there.
    lo, hi = 1e-37, 1e37
    if (s != 1.0 or a is not None) and not (lo < t_eff < hi and (a is None or lo < abs(a) < hi)):
        raise ValueError(
            f"temperature {temperature!r}, logit_scale {logit_scale!r} and softcap {softcap!r} "
            "give factors outside float32's range (temperature / |logit_scale|, temperature / "
            "softcap and logit_scale / softcap must lie within 1e-37 .. 1e37)")
    return negate, t_eff, a


def _common_dtype_device(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``linear_token_stats``' dtype/device policy, before any backend sees the inputs (the
    backends used to differ: triton refused mixed dtypes that cpp/torch upcast silently, and
    only triton checked devices)."""
    named = [("hidden", hidden), ("weight", weight), ("targets", targets)]
    if bias is not None:
        named.append(("bias", bias))
    if len({t.device for _, t in named}) > 1:
        where = ", ".join(f"{k} on {t.device}" for k, t in named)
        raise ValueError(f"linear_token_stats needs all inputs on one device; got {where}")
    floats = [(k, t) for k, t in named if k != "targets"]
    for k, t in floats:
        if t.dtype not in _LINEAR_DTYPES:
            raise TypeError(f"{k} must be float32, float16 or bfloat16, got {t.dtype}")
    dt = hidden.dtype
    for _, t in floats[1:]:
        dt = torch.promote_types(dt, t.dtype)
    cast = (lambda t: t if t is None or t.dtype == dt else t.to(dt))  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)


def _invariant_blocks(weight, bias, products):
    """The logits of a block, ``rows @ weight[c0:c1].T + bias[c0:c1]``, through :func:`linear`
    with the block packed once per weight (repacked when the weight changed)."""
    def product(h, c0, c1):
        key = (c0, c1 - c0, products, "cpp")
        packed = _cached_pack(weight, key)
        if packed is None:
            block = pack_linear(weight[c0:c1], products, backend="cpp")
            # The block's view has its own data_ptr: the whole weight's tells a change.
            packed = PackedLinear(block.data, block.out_features, block.in_features, products,
                                  "cpp", (weight.data_ptr(), weight._version))
            _keep_pack(weight, key, packed)
        return linear(h, packed, None if bias is None else bias[c0:c1].float())
    return product


def _torch_blocks(weight, bias):
    # The vocabulary blocks come outside, token chunks inside: a 16-bit weight block is converted
    # to fp32 once per call, not once per token chunk.
    last: dict = {}

    def product(h, c0, c1):
        if last.get("at") != c0:
            last.clear()
            last.update(at=c0, w=weight[c0:c1].float().t(),
                        b=None if bias is None else bias[c0:c1].float())
        z = h @ last["w"]
        if last["b"] is not None:
            z += last["b"]
        return z
    return product


def _chunked_linear(hidden, weight, targets, bias, ignore_index, temperature, ct, cv, reduce_block,
                    tanh_scale=None, tanh_logits=None, product=None):
    n, v = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets))
    spans = [(r0, min(n, r0 + ct)) for r0 in range(0, n, ct)]
    if not spans:
        z_t = torch.zeros(0, dtype=torch.float64, device=hidden.device)
        return _state.finalize(*_state.empty(0, hidden.device), z_t, valid, temperature)
    heads = []  # per token chunk: (targets, z_t, capped z_t, shift); O(c) each, never N x H
    for r0, r1 in spans:
        h = hidden[r0:r1].float()
        t = safe_t[r0:r1]
        # This chunk's target logits, from the same fp32 operands as its blocks (row-wise dot
        # product): [ct, H] gathered weight rows, never [N, H].
        z_t = weight.index_select(0, t).float().mul_(h).sum(-1).double()
        if bias is not None:
            z_t += bias.index_select(0, t).double()
        # Soft cap: the blocks' ranks compare uncapped logits with z_t, their sums use capped
        # ones (by the same epilogue code as the target's here, zc_t).
        zc_t = z_t if tanh_scale is None else tanh_logits(z_t, tanh_scale).double()
        shift = torch.where(torch.isfinite(zc_t), zc_t / temperature, torch.zeros_like(zc_t))
        heads.append((t, z_t, zc_t, shift))
        del h
    accs = [_state.empty(r1 - r0, hidden.device) for r0, r1 in spans]
    # Vocabulary blocks outside, token chunks inside (the same c x b products and the same
    # merge order per chunk, so the same numbers bit for bit).
    product = product or _torch_blocks(weight, bias)
    for c0 in range(0, v, cv):
        c1 = min(v, c0 + cv)
        for i, ((r0, r1), (t, z_t, _zc, shift)) in enumerate(zip(spans, heads, strict=True)):
            # The hidden rows are converted per block (c x H, a no-op at fp32): keeping them all
            # in fp32 would hold N x H.
            z = product(hidden[r0:r1].float(), c0, c1)
            blk = (reduce_block(z, t - c0, z_t, shift, temperature) if tanh_scale is None
                   else reduce_block(z, t - c0, z_t, shift, temperature, tanh_scale))
            accs[i] = _state.merge(accs[i], blk)
            del z, blk
    parts = [_state.finalize(*acc, zc_t, valid[r0:r1], temperature)
             for acc, (_t, _z, zc_t, _s), (r0, r1) in zip(accs, heads, spans, strict=True)]
    return TokenStats.cat(parts)


def pack_linear(weight: torch.Tensor, products: str = "fp32", *, backend: str = "auto",
                cache: bool = False) -> PackedLinear:
    """Pack a linear layer's ``weight [N, K]`` once for :func:`linear`.

    Args:
        weight: ``[N, K]`` float32 / bfloat16 / float16 (``y = x @ weight.T``).
        products: one of :data:`icqs_fast.types.PRODUCTS`: ``"fp32"`` (fp32 products), ``"bf16"``
            (inputs and weight rounded to bf16, fp32 accumulation), ``"bf16x2"`` / ``"bf16x3"``
            (the input as 2 / 3 bf16 terms: for a bf16-valued weight, 3 terms make every
            product exact).
        backend: ``"cpp"`` (the C++ kernel, CPU), ``"torch"`` (the float64 reference) or
            ``"auto"``.
        cache: keep the packed weight while ``weight`` lives, and return it again while the
            weight is unchanged (a head that many calls multiply with).

    Returns:
        :class:`icqs_fast.types.PackedLinear` (extra memory: ``N K`` fp32 values for ``fp32``,
        bf16 values otherwise, rounded up to whole panels of 32 rows and 32 columns).
    """
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got {products!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {weight.dtype} "
                         f"{list(weight.shape)}")
    name = backends.choose("linear", backend, weight.device, weight.dtype)
    key = (0, int(weight.shape[0]), products, name)
    if cache:
        hit = _cached_pack(weight, key)
        if hit is not None:
            return hit
    data = backends.module(name).pack_linear(weight.detach(), products)
    packed = PackedLinear(data, int(weight.shape[0]), int(weight.shape[1]), products, name,
                          (weight.data_ptr(), weight._version))
    if cache:
        _keep_pack(weight, key, packed)
    return packed


def unpack_linear(weight: PackedLinear) -> torch.Tensor:
    """The ``[N, K]`` weight a :func:`pack_linear` result holds, as a new tensor: float32 for
    ``"fp32"`` products, the bf16-rounded values (bfloat16 on the cpp backend) otherwise. Exact:
    a weight that the packing did not round comes back equal (what lets
    :func:`icqs_fast.invariant_linears.use_invariant_linears` drop the layer's own copy)."""
    return backends.module(weight.backend).unpack_linear(
        weight.data, weight.out_features, weight.in_features, weight.products)


# id(weight) -> (weakref to it, {(first row, rows, products, backend): PackedLinear}):
# pack_linear(cache=True)'s packs and the cpp head's vocabulary blocks, dropped with the weight
# (tensors compare element-wise, so they cannot be WeakKeyDictionary keys).
_PACKS: dict[int, tuple[weakref.ref, dict]] = {}
_PACK_LOCK = threading.Lock()


def _cached_pack(weight: torch.Tensor, key: tuple) -> PackedLinear | None:
    with _PACK_LOCK:
        entry = _PACKS.get(id(weight))
        hit = entry[1].get(key) if entry is not None and entry[0]() is weight else None
    return hit if hit is not None and hit.is_current(weight) else None


def _keep_pack(weight: torch.Tensor, key: tuple, packed: PackedLinear) -> None:
    with _PACK_LOCK:
        entry = _PACKS.get(id(weight))
        if entry is None or entry[0]() is not weight:
            wid = id(weight)
            entry = (weakref.ref(weight, lambda _r: _PACKS.pop(wid, None)), {})
            _PACKS[wid] = entry
        entry[1][key] = packed


def linear(x: torch.Tensor, weight: PackedLinear, bias: torch.Tensor | None = None, *,
           up: PackedLinear | None = None, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype = torch.float32,
           rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with a weight packed by :func:`pack_linear`, batch-invariant: on the
    cpp backend each output element is summed in one fixed order that depends only on ``K``
    and ``weight.products``, so a row's result is the same bits whatever the other rows, their
    number, its place among them and the thread count (a library GEMM picks its kernel by the
    row count). The products are ``weight.products``; the accumulation is fp32.

    Args:
        x: ``[..., K]`` float32 / bfloat16 / float16 (16-bit inputs widen exactly; float64 on
            the torch backend).
        weight: the :class:`icqs_fast.types.PackedLinear`.
        bias: optional ``[N]`` (added in fp32 after the sum).
        up: a second weight packed alike (no bias): ``silu(x @ W.T) * (x @ up.T)``, on cpp
            :func:`silu_mul`'s bits of the two products, which never reach memory.
        residual: optional ``[..., N]`` float32 (not with ``up``), added last: on cpp the bits
            of ``residual + linear(x, weight, bias)``, without the pass the add takes.
        out_dtype: float32, or bfloat16 with ``up``: the gated output rounded to bf16 (round
            to nearest even), as a bf16-products linear rounds its input, so the next product
            reads it in place (a bf16 ``x`` of bf16 products is not converted at all).
        rotary: ``(cos, sin)`` float32 ``[B or 1, T, D]`` for ``x [B, T, K]`` (not with ``up``
            or ``residual``; ``D`` even, dividing ``N`` and 256): each ``D``-wide head of the
            output rotated as :func:`rotary` rotates it (its bits on cpp, in the product's
            pass: a query or key projection and its rotary embedding).

    Returns:
        ``[..., N]`` ``out_dtype`` on ``x``'s device.
    """
    k = weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}], got {list(x.shape)}")
    if bias is not None and bias.shape != (weight.out_features,):
        raise ValueError(f"bias must be [{weight.out_features}], got {list(bias.shape)}")
    like = (k, weight.out_features, weight.products, weight.backend)
    got = None if up is None else (up.in_features, up.out_features, up.products, up.backend)
    if got is not None and (bias is not None or residual is not None or got != like):
        raise ValueError(f"up must be packed like the weight {like} (no bias, no residual), "
                         f"got {got}")
    want = (*x.shape[:-1], weight.out_features)
    if residual is not None and (tuple(residual.shape), residual.dtype) != (want, torch.float32):
        raise ValueError(f"residual must be float32 {list(want)}, got {residual.dtype} "
                         f"{list(residual.shape)}")
    bf16_out = out_dtype == torch.bfloat16
    if out_dtype != torch.float32 and not (bf16_out and up is not None):
        raise ValueError(f"out_dtype must be float32, or bfloat16 with up; got {out_dtype}")
    if rotary is not None:
        _check_linear_rotary(x, weight.out_features, rotary, up is not None or residual is not None)
    backends.choose("linear", weight.backend, x.device, x.dtype,
                    support.requested(gated=up is not None, residual=residual is not None,
                                      bf16_out=bf16_out, rotary=rotary is not None))
    rows = x.reshape(-1, k)
    if x.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        rows = rows.float()  # widens exactly (a bf16 x the backends take as it is)
    out = backends.module(weight.backend).linear(
        rows, weight.data, weight.out_features, weight.products, bias,
        None if up is None else up.data,
        None if residual is None else residual.reshape(-1, weight.out_features), out_dtype,
        rotary)
    return out.reshape(want)


def _check_linear_rotary(x: torch.Tensor, n: int, rotary: tuple, other: bool) -> None:
    """``linear``'s ``rotary``: ``(cos, sin)`` fp32 ``[B or 1, T, D]`` for ``x [B, T, K]``,
    ``D`` even and dividing ``N`` and 256 (a task's columns hold whole heads)."""
    ok = (isinstance(rotary, tuple) and len(rotary) == 2 and x.dim() == 3 and not other
          and all(isinstance(c, torch.Tensor) and c.dim() == 3 and c.dtype == torch.float32
                  and c.device == x.device for c in rotary))
    if ok:
        cos, sin = rotary
        d = cos.shape[2]
        ok = (cos.shape == sin.shape and cos.shape[0] in (1, x.shape[0])
              and cos.shape[1] == x.shape[1] and d >= 2 and d % 2 == 0 and n % d == 0
              and 256 % d == 0)
    if not ok:
        raise ValueError("rotary must be (cos, sin) float32 [B or 1, T, D] for x [B, T, K] on "
                         "its device, D even and dividing N and 256, without up or residual")


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto"
           ) -> torch.Tensor:
    """Rotary position embedding: ``x * cos + rotate_half(x) * sin``, where
    ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])`` (transformers' form), each product and
    the sum rounded once in ``x``'s dtype: on the cpp backend the same bits as that expression in
    torch, in one pass.

    Args:
        x: ``[B, H, T, D]`` float (any strides), ``D`` even.
        cos, sin: ``[B, T, D]`` or ``[1, T, D]`` (broadcast over the batch), ``x``'s dtype.

    Returns:
        ``[B, H, T, D]`` in ``x``'s dtype and layout.
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [B, H, T, D] with D even, got {list(x.shape)}")
    b, _, t, d = x.shape
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 3 or c.shape[0] not in (1, b) or c.shape[1:] != (t, d):
            raise ValueError(f"{name} must be [{b} or 1, {t}, {d}], got {list(c.shape)}")
        if c.dtype != x.dtype:
            raise TypeError(f"{name} must be {x.dtype} like x, got {c.dtype}")
    name = backends.choose("rotary", backend, x.device, x.dtype)
    return backends.module(name).rotary(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2, -1) + eps) * weight`` per row of ``x [..., D]`` (``weight [D]``,
    ``x``'s dtype): ``[..., D]`` contiguous, ``x``'s dtype. The cpp backend reads ``x`` once and
    writes once, each row's sum of squares in one order fixed by ``D`` (16 interleaved partial
    sums, then pairwise): a row's bits depend on nothing else (rows, threads, ISA); within fp32
    rounding of ``F.rms_norm``, not its bits. ``out_dtype=torch.bfloat16`` (fp32 ``x``): the
    result rounded to bf16 (nearest even), a bf16-products :func:`linear`'s input read in
    place, with the bits it would give the fp32 norm."""
    _check_norm_weight(x, weight)
    bf16 = _bf16_rows(x, out_dtype, "out_dtype")
    name = backends.choose("rms_norm", backend, x.device, x.dtype,
                           support.requested(bf16_out=bf16))
    if not bf16:
        return backends.module(name).rms_norm(x, weight, float(eps))
    return backends.module(name).rms_norm(x, weight, float(eps), torch.bfloat16)


def _bf16_rows(x: torch.Tensor, dtype: torch.dtype | None, name: str) -> bool:
    """Whether a norm's rows go out in bf16 (``dtype``: None, x's, or bf16 for fp32 ``x``)."""
    bf16 = dtype == torch.bfloat16
    if dtype not in (None, x.dtype) and not (bf16 and x.dtype == torch.float32):
        raise ValueError(f"{name} must be x's dtype, or bfloat16 for float32 x; got {dtype} "
                         f"for {x.dtype}")
    return bf16


def _check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [{x.shape[-1] if x.dim() else '?'}] like x's last dim, "
                         f"got {list(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"weight is {weight.dtype} on {weight.device}, x {x.dtype} on {x.device}")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 normed_dtype: torch.dtype | None = None, backend: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's residual add and the next norm: ``(s, rms_norm(s))`` with ``s =
    residual + x`` (``x``, ``residual``: ``[..., D]``, one dtype; ``weight [D]``), both
    ``[..., D]`` contiguous in ``x``'s dtype. On cpp one pass, ``s`` the bits of torch's add
    and the norm :func:`rms_norm`'s bits of ``s``. ``normed_dtype=torch.bfloat16`` (fp32
    ``x``): the norm rounded to bf16 (round to nearest even), the input a bf16-products
    :func:`linear` reads in place, with the bits it would give the fp32 norm."""
    if (x.shape, x.dtype, x.device) != (residual.shape, residual.dtype, residual.device):
        raise ValueError(f"x and residual must match: {x.dtype} {list(x.shape)} on {x.device} "
                         f"against {residual.dtype} {list(residual.shape)} on {residual.device}")
    _check_norm_weight(x, weight)
    bf16 = _bf16_rows(x, normed_dtype, "normed_dtype")
    name = backends.choose("add_rms_norm", backend, x.device, x.dtype,
                           support.requested(bf16_normed=bf16))
    if not bf16:
        return backends.module(name).add_rms_norm(x, residual, weight, float(eps))
    return backends.module(name).add_rms_norm(x, residual, weight, float(eps), torch.bfloat16)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """A gated MLP's ``silu(gate) * up`` (``gate``, ``up``: ``[..., N]``, one dtype, any row
    strides): ``[..., N]`` contiguous. One pass on the cpp backend, element-wise (so
    batch-invariant), within a few fp32 ulps of ``F.silu(gate) * up`` (gates below -87: -0)."""
    if (gate.shape, gate.dtype, gate.device) != (up.shape, up.dtype, up.device):
        raise ValueError(f"gate and up must match: {gate.dtype} {list(gate.shape)} on "
                         f"{gate.device} against {up.dtype} {list(up.shape)} on {up.device}")
    name = backends.choose("silu_mul", backend, gate.device, gate.dtype)
    return backends.module(name).silu_mul(gate, up)


def concat_slots(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 width: int, *, backend: str = "auto") -> torch.Tensor:
    """Per row, runs of slots from several sources placed back to back along the slot dim,
    then zeros: the cascade's keys (or values) of each row in position order, without a
    gather (a copy: the same bits in any dtype).

    Args:
        parts: ``(src, rows, starts, counts)`` each; ``src`` ``[N, H, T, D]`` (any strides but
            a unit last-dim one; every part of one dtype, device, ``H`` and ``D``); ``rows``,
            ``starts``, ``counts`` ``[R]`` int64 on the CPU: row ``r`` takes
            ``src[rows[r], :, starts[r]:starts[r] + counts[r]]`` after its earlier parts'.
        width: slots per output row (at least each row's total count).

    Returns:
        ``[R, H, width, D]`` contiguous, the sources' dtype; slots past a row's runs are 0.

    Raises:
        IndexError: a row, start or count out of its source's range, or a row over ``width``.
    """
    if not parts:
        raise ValueError("concat_slots needs at least one part")
    src0 = parts[0][0]
    r = parts[0][1].shape[0]
    for i, (src, *idx) in enumerate(parts):
        if src.dim() != 4 or src.shape[1] != src0.shape[1] or src.shape[3] != src0.shape[3]:
            raise ValueError(f"part {i}: src must be [N, {src0.shape[1]}, T, {src0.shape[3]}], "
                             f"got {list(src.shape)}")
        if src.dtype != src0.dtype or src.device != src0.device:
            raise TypeError(f"part {i}: src is {src.dtype} on {src.device}, part 0 {src0.dtype} "
                            f"on {src0.device}")
        if any(t.shape != (r,) or t.dtype != torch.int64 or t.device.type != "cpu" for t in idx):
            raise ValueError(f"part {i}: rows, starts and counts must be [{r}] int64 CPU tensors")
    name = backends.choose("concat_slots", backend, src0.device, src0.dtype)
    return backends.module(name).concat_slots(parts, int(width))
