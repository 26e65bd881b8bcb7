"""``icqs-fast info``: versions, device and which backends are available (and why not)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from icqs_fast import backends
from icqs_fast.version import __version__


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    """Everything ``info`` prints, as a dict."""
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name(0)})"
    else:
        cpu = platform.processor() or platform.machine()
        device = f"cpu ({cpu}, {torch.get_num_threads()} threads)"
    return {
        "icqs_fast": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "bitsandbytes": _version("bitsandbytes"),
        "device": device,
        "triton_interpreter": backends.triton_interpreting(),
        "backends": {k: {"available": ok, "reason": why}
                     for k, (ok, why) in backends.availability().items()},
        "auto_backend_cpu": backends.resolve("auto", torch.device("cpu")),
    }
