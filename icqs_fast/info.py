"""``icqs-fast info``: versions, device, which backends are available (and why not), and the dtype
``--dtype auto`` picks here (and why)."""

from __future__ import annotations

import importlib.metadata
import os
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
        **_auto_dtypes(),
    }


def _auto_dtypes() -> dict:
    """What ``--dtype auto`` loads a model in here (CPU, and CUDA when present), and why."""
    from icqs_fast.models import CPU_DTYPE_ENV, choose_dtype, cpu_bf16_support

    cpu = choose_dtype("auto", "cpu")
    out = {"auto_dtype_cpu": cpu.name, "auto_dtype_cpu_reason": cpu.reason,
           "cpu_native_bf16": cpu_bf16_support()[0],
           "dtype_override": f"${CPU_DTYPE_ENV}={os.environ.get(CPU_DTYPE_ENV) or '(unset)'}"}
    if torch.cuda.is_available():
        cuda = choose_dtype("auto", "cuda")
        out.update(auto_dtype_cuda=cuda.name, auto_dtype_cuda_reason=cuda.reason)
    return out
