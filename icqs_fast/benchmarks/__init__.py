"""Benchmarks behind ``icqs-fast bench``: ``kernels``, ``icqs`` and ``attention``."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import torch


def _commit() -> str | None:
    # The package may run from a git checkout (editable install) or from a wheel (no commit).
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device | str | None = None) -> dict:
    """Where and when a benchmark ran: ``commit`` (git HEAD of the source tree, or None),
    ``date`` (UTC, ISO 8601), ``device_name`` (GPU name on CUDA, else the CPU model),
    ``cpu_count``, ``torch`` version and ``threads`` (torch CPU threads)."""
    import os

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = _cpu_name()
    return {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
