"""Backend registry: which implementations exist here, and which one ``backend="auto"`` picks.

Backends:
    torch  - reference implementation; always available.
    cpp    - the pybind11/OpenMP extension ``icqs_fast._C`` for CPU tensors.
    triton - Triton kernels for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).

What each one supports per operation (dtypes, devices, options) is the table of
:mod:`icqs_fast.backends.support`; :func:`choose` applies it to a call (``"auto"``, or the
error of a backend named for something it lacks), :func:`fallback` and :func:`kernel_backend`
answer the callers that pick a path themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType

import torch

from icqs_fast.backends.support import PREFERENCE, REFERENCE, refusal

# Re-exported: the one "is Triton interpreting" check lives with the kernels (the lowest layer
# that needs it).
from icqs_fast.kernels.launch import triton_interpreting  # noqa: F401
from icqs_fast.registry import Registry

BACKENDS = PREFERENCE
log = logging.getLogger("icqs_fast")
# Each backend's module, imported on first use (Triton's only where it is asked about).
MODULES: Registry[ModuleType] = Registry("backend")


@MODULES.add("torch")
def _torch_ref() -> ModuleType:
    from icqs_fast.backends import torch_ref
    return torch_ref


@MODULES.add("cpp")
def _cpp_backend() -> ModuleType:
    from icqs_fast.backends import cpp_backend
    return cpp_backend


@MODULES.add("triton")
def _triton_backend() -> ModuleType:
    from icqs_fast.backends import triton_backend
    return triton_backend


def available(name: str) -> tuple[bool, str]:
    """``(available, reason)`` of one backend; the reason says why it is not."""
    if name not in MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS} or 'auto'")
    try:
        mod = MODULES.get(name)
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return False, f"import failed: {exc}"
    check = getattr(mod, "available", None)
    return check() if check is not None else (True, "ok")


def availability() -> dict[str, tuple[bool, str]]:
    """Map each backend to (available, reason); the reason says why one is not."""
    return {name: available(name) for name in BACKENDS}


def module(name: str) -> ModuleType:
    if name not in MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS} or 'auto'")
    return MODULES.get(name)


def resolve(backend: str, device: torch.device, op: str = "linear_token_stats") -> str:
    """The backend that runs ``op`` on ``device`` for the name ``backend`` (``"auto"``: triton on
    CUDA, cpp on CPU when built, else torch): :func:`choose` without a dtype or options.

    Raises:
        ValueError: an unknown name, or a backend named for a device it does not run on.
        RuntimeError: a backend named that is not available here.
    """
    return choose(op, backend, device)


def choose(op: str, backend: str, device: torch.device | str,
           dtype: torch.dtype | None = None, options: Iterable[str] = ()) -> str:
    """The backend that runs this ``op`` call: ``backend`` itself when it can (else the
    :func:`refusal`'s error, or RuntimeError when it is not available here), or for ``"auto"``
    the first of :data:`PREFERENCE` that can and is available.

    Raises:
        ValueError: an unknown backend name, or one that lacks the device / an option.
        TypeError: a backend named for a dtype it does not take.
        RuntimeError: a backend named that is not available here (not built, no CUDA).
    """
    options = frozenset(options)
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")
        why = refusal(op, backend, None, dtype, options)
        if why is None:
            ok, reason = available(backend)
            if not ok:
                raise RuntimeError(f"backend {backend!r} is not available: {reason}")
            why = refusal(op, backend, device, dtype, options)
        if why is not None:
            raise why[0](why[1])
        return backend
    unavailable = []
    for name in PREFERENCE:
        # The table first (no import), then whether the backend runs here at all.
        if refusal(op, name, device, dtype, options, auto=True) is None:
            ok, reason = available(name)
            if ok:
                _say_skipped(op, name, unavailable)
                return name
            if name == "triton":  # the GPU path; a CPU without the extension is expected
                unavailable.append((name, reason))
    # Not reached for what ops accept: the reference runs every declared option and dtype.
    raise ValueError(f"{op}: no backend runs {torch.device(device).type} {dtype} inputs with "
                     f"{sorted(options)}")


_SAID: set[tuple[str, str, str]] = set()


def _say_skipped(op: str, chosen: str, unavailable: list[tuple[str, str]]) -> None:
    """Warn once per (op, backend, reason) when ``"auto"`` steps past a backend the table
    prefers for the call because it does not run here (e.g. the Triton kernels failing to
    import on another Triton version: a CUDA run on the torch reference, many times slower)."""
    for name, reason in unavailable:
        if (op, name, reason) not in _SAID:
            _SAID.add((op, name, reason))
            log.warning("%s: backend %r would run this call but is not available (%s); "
                        "'auto' uses %r", op, name, reason, chosen)


def fallback(op: str, backend: str, options: Iterable[str] = ()) -> str:
    """``backend`` when it implements ``op`` with ``options``, else ``"auto"`` (for callers that
    take one backend name for several operations, e.g. ``glassbox``'s token statistics and
    attention entropies: a backend without the attention entropy, or without a layer's variant,
    leaves that layer to ``"auto"``)."""
    if backend == "auto":
        return backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")
    return backend if refusal(op, backend, options=options) is None else "auto"


def kernel_backend(op: str, device: torch.device | str, dtype: torch.dtype,
                   options: Iterable[str] = ()) -> str | None:
    """The backend ``"auto"`` picks for this call when it is not the reference, else None (for a
    caller with a torch path of its own, e.g. cascade attention's masked attention on the CPU)."""
    name = choose(op, "auto", device, dtype, options)
    return None if name == REFERENCE else name
