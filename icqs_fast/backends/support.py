"""What each backend supports, per operation: one table, read by :mod:`icqs_fast.ops` (dispatch,
the ``"auto"`` choice, the errors of a backend named for something it cannot do) and by every
caller that picks a path (the attention-entropy capture, cascade attention).

A backend runs an operation when the table has an entry for the pair and the call's device,
dtype and options are in it (:func:`refusal`). :func:`icqs_fast.backends.choose` applies it:
``"auto"`` takes the first backend in :data:`PREFERENCE` that does and is available here; a
backend named explicitly that does not is refused with an error that says what it lacks and
which backends have it.

Adding a backend or a capability is one edit here (plus its code); ``tests/test_registries.py``
walks the table: every declared capability is run against the torch reference, every undeclared
one must be refused by ``ops`` (or routed elsewhere by ``"auto"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from icqs_fast.kernels.launch import triton_interpreting

# Every backend, in the order "auto" tries them: the fused GPU kernels, the CPU extension, the
# reference.
PREFERENCE = ("triton", "cpp", "torch")
REFERENCE = "torch"
"""The small, obviously correct backend every other one is checked against; it runs everything."""

FLOAT16_32 = (torch.float32, torch.float16, torch.bfloat16)
FLOATS = FLOAT16_32 + (torch.float64,)


@dataclass(frozen=True)
class Support:
    """One backend's support of one operation.

    Attributes:
        dtypes: the input float dtypes it takes.
        devices: the device types it runs on (``"auto"`` may pick it there); None = any.
        options: the optional features of the operation it implements (names from
            :data:`OPTIONS`).
        interpreted: device types it runs on only under Triton's CPU interpreter
            (``TRITON_INTERPRET=1``), and only when named: ``"auto"`` never picks it there.
        chunked: ``ops`` computes the logits block by block and the backend reduces each block
            (its ``reduce_block``), rather than the backend fusing the product itself.
    """

    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...] | None
    options: frozenset[str] = frozenset()
    interpreted: tuple[str, ...] = ()
    chunked: bool = False


OPTIONS: dict[str, dict[str, str]] = {
    "token_stats": {},
    "linear": {"gated": "a second weight: silu(x W^T) * (x U^T)",
               "residual": "a residual added to the output",
               "bf16_out": "the gated output rounded to bf16 (the next product's input)",
               "rotary": "each head of the output rotated (rotary position embedding)"},
    "rotary": {},
    "concat_slots": {},
    "rms_norm": {"bf16_out": "the normed rows rounded to bf16 (a product's input)"},
    "add_rms_norm": {"bf16_normed": "the normed rows rounded to bf16 (a product's input)"},
    "silu_mul": {},
    "linear_token_stats": {
        "bias": "a bias added to the logits",
        "logit_scale": "a logit multiplier other than 1",
        "softcap": "a final-logit soft cap",
    },
    "attention_entropy": {
        "window": "a sliding window",
        "chunk": "chunked attention",
        "softcap": "a score soft cap",
        "sinks": "attention sinks",
        "value_dim": "a value head size other than the query/key head size",
    },
    "attention_lse": {
        "softcap": "a score soft cap",
        "value_dim": "a value head size other than the query/key head size",
        "window": "a sliding window",
        "chunk": "chunked attention",
        "positions": "explicit query/key token positions",
        "dot_dtype": "bf16 products of fp32 inputs (mixed precision)",
        "state": "a running softmax state continued or returned (one pass in several calls)",
        "key_batch": "query batch rows reading another row's keys (keys shared, not copied)",
        "bf16_out": "the output written in bf16 (a bf16-products linear's input)",
    },
}
"""Each operation's optional features, with what each means (for the error messages)."""

_ATTENTION_VARIANTS = frozenset(OPTIONS["attention_entropy"])
_LSE_VARIANTS = frozenset(OPTIONS["attention_lse"])
_LINEAR = frozenset(OPTIONS["linear_token_stats"])

TABLE: dict[str, dict[str, Support]] = {
    # The batch-invariant linear layer (csrc/linear.cpp): the C++ kernel on the CPU; the torch
    # reference anywhere (float64 products of the same bf16 terms, rounded once to fp32).
    "linear": {
        "cpp": Support(FLOAT16_32, ("cpu",), frozenset(OPTIONS["linear"])),
        "torch": Support(FLOATS, None, frozenset(OPTIONS["linear"])),
    },
    # Rotary embedding: the C++ pass where transformers' arithmetic runs in fp32 (the same
    # bits); the torch reference for everything else.
    "rotary": {
        "cpp": Support((torch.float32,), ("cpu",)),
        "torch": Support(FLOATS, None),
    },
    # The cascade's per-row key runs: a copy, so every dtype; C++ on the CPU.
    "concat_slots": {
        "cpp": Support(FLOATS, ("cpu",)),
        "torch": Support(FLOATS, None),
    },
    # The bf16-products forward's row-wise fp32 passes (csrc/rowwise.cpp); the float64
    # reference anywhere.
    "rms_norm": {
        "cpp": Support((torch.float32,), ("cpu",), frozenset(OPTIONS["rms_norm"])),
        "torch": Support(FLOATS, None, frozenset(OPTIONS["rms_norm"])),
    },
    "add_rms_norm": {
        "cpp": Support((torch.float32,), ("cpu",), frozenset(OPTIONS["add_rms_norm"])),
        "torch": Support(FLOATS, None, frozenset(OPTIONS["add_rms_norm"])),
    },
    "silu_mul": {
        "cpp": Support((torch.float32,), ("cpu",)),
        "torch": Support(FLOATS, None),
    },
    # float64 logits: the cpp and triton backends hand them to the reference (their kernels read
    # 16/32-bit floats), so every backend takes them.
    "token_stats": {
        "triton": Support(FLOATS, ("cuda",), interpreted=("cpu",)),
        "cpp": Support(FLOATS, ("cpu",)),
        "torch": Support(FLOATS, None),
    },
    "linear_token_stats": {
        "triton": Support(FLOAT16_32, ("cuda",), _LINEAR, interpreted=("cpu",)),
        "cpp": Support(FLOAT16_32, ("cpu",), _LINEAR, chunked=True),
        "torch": Support(FLOAT16_32, None, _LINEAR, chunked=True),
    },
    # The Triton kernel takes key padding and plain causality (GQA included). The cpp backend
    # (two calls of the C++ flash kernel) takes every variant but the soft cap, which makes a
    # score non-linear in its key; the torch backend runs everything.
    "attention_entropy": {
        "triton": Support(FLOAT16_32, ("cuda",), interpreted=("cpu",)),
        "cpp": Support(FLOAT16_32, ("cpu",), _ATTENTION_VARIANTS - {"softcap"}),
        "torch": Support(FLOAT16_32, None, _ATTENTION_VARIANTS),
    },
    # The C++ kernel (csrc/attention.cpp) and the Triton one (kernels/attention_entropy.py,
    # constexpr variants) take every variant the cascade passes them (sinks are added at the
    # cascade's merge, not in the kernel).
    # Only the C++ kernel hands out and continues its running softmax state (the cascade's
    # batch-invariant path on the CPU), and reads rows' shared keys in place (key_batch; the
    # reference gathers them).
    "attention_lse": {
        "triton": Support(FLOAT16_32, ("cuda",),
                          _LSE_VARIANTS - {"state", "key_batch", "bf16_out"},
                          interpreted=("cpu",)),
        "cpp": Support(FLOAT16_32, ("cpu",), _LSE_VARIANTS),
        "torch": Support(FLOAT16_32, None, _LSE_VARIANTS - {"state"}),
    },
}


def requested(**options: object) -> frozenset[str]:
    """The option names of a call whose value is set (not None / False), e.g.
    ``requested(window=None, softcap=30.0)`` -> ``{"softcap"}``."""
    return frozenset(k for k, v in options.items() if v is not None and v is not False)


def entry(op: str, backend: str) -> Support | None:
    """The table's entry for ``backend`` running ``op`` (None: it does not implement it)."""
    if op not in TABLE:
        raise ValueError(f"unknown operation {op!r}; one of {sorted(TABLE)}")
    return TABLE[op].get(backend)


def implementing(op: str, option: str | None = None) -> list[str]:
    """The backends that implement ``op`` (with ``option``, when given), in preference order."""
    return [b for b in PREFERENCE if (s := entry(op, b)) is not None
            and (option is None or option in s.options)]


def _device_type(device: torch.device | str | None) -> str | None:
    return None if device is None else torch.device(device).type


def refusal(op: str, backend: str, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None, options: Iterable[str] = (), *,
            auto: bool = False) -> tuple[type[Exception], str] | None:
    """Why ``backend`` cannot run this ``op`` call, as ``(exception class, message)``, or None
    when it can (availability aside: see :func:`icqs_fast.backends.availability`).

    ``device`` / ``dtype`` None: not checked. ``auto``: the question ``"auto"`` asks (devices it
    reaches only through the interpreter do not count)."""
    s = entry(op, backend)
    if s is None:
        return ValueError, (f"{op}: backend {backend!r} does not implement it; use one of "
                            f"{implementing(op)} or 'auto'")
    dev = _device_type(device)
    if dev is not None and s.devices is not None and dev not in s.devices:
        if auto or dev not in s.interpreted or not triton_interpreting():
            where = " or ".join(s.devices)
            extra = (f" (or TRITON_INTERPRET=1 for {', '.join(s.interpreted)} tensors)"
                     if s.interpreted else "")
            return ValueError, f"{op}: backend {backend!r} needs {where} tensors{extra}, got {dev}"
    if dtype is not None and dtype not in s.dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in s.dtypes)
        return TypeError, (f"{op}: backend {backend!r} takes {names} inputs, got "
                           f"{str(dtype).removeprefix('torch.')}")
    for opt in sorted(set(options)):
        if opt not in OPTIONS[op]:
            raise ValueError(f"{op}: unknown option {opt!r}; one of {sorted(OPTIONS[op])}")
        if opt not in s.options:
            return ValueError, (f"{op}: backend {backend!r} does not support {OPTIONS[op][opt]} "
                                f"({opt}); backends that do: {implementing(op, opt)}")
    return None
