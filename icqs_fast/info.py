"""``icqs-fast info``: versions, device and which backends are available (and why not)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform

import torch

from . import __version__, backends


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k == "backends":
            print("backends:")
            for name, b in v.items():
                mark = "yes" if b["available"] else "no "
                print(f"  {name:7s} {mark}  {b['reason']}")
        else:
            print(f"{k}: {v}")
    return 0
