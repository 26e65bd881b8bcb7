"""Backend registry: which implementations exist here, and which one ``backend="auto"`` picks.

Backends:
    torch  - reference implementation; always available.
    cpp    - the pybind11/OpenMP extension ``icqs_fast._C`` for CPU tensors.
    triton - Triton kernels for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("triton", "cpp", "torch")
_MODULES = {
    "torch": "icqs_fast.backends.torch_ref",
    "cpp": "icqs_fast.backends.cpp_backend",
    "triton": "icqs_fast.backends.triton_backend",
}


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def availability() -> dict[str, tuple[bool, str]]:
    """Map each backend to (available, reason); the reason says why one is not."""
    out: dict[str, tuple[bool, str]] = {}
    for name in BACKENDS:
        try:
            mod = module(name)
        except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
            out[name] = (False, f"import failed: {exc}")
            continue
        check = getattr(mod, "available", None)
        out[name] = check() if check is not None else (True, "ok")
    return out


def module(name: str) -> ModuleType:
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS} or 'auto'")
    return importlib.import_module(_MODULES[name])


def resolve(backend: str, device: torch.device) -> str:
    """Pick the backend for tensors on ``device``: triton on CUDA, cpp on CPU, else torch."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")
        ok, why = availability()[backend]
        if not ok:
            raise RuntimeError(f"backend {backend!r} is not available: {why}")
        if backend == "cpp" and device.type != "cpu":
            raise ValueError(f"backend 'cpp' needs CPU tensors, got {device.type}")
        if backend == "triton" and device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                "backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
            )
        return backend
    avail = availability()
    if device.type == "cuda" and avail["triton"][0]:
        return "triton"
    if device.type == "cpu" and avail["cpp"][0]:
        return "cpp"
    return "torch"
