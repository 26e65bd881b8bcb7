"""Benchmarks behind ``icqs-fast bench`` and their shared helpers: the environment of a run,
peak memory, writing a record, and the correctness checks every command applies to its own record
(:func:`check_fields`, :func:`report_failures`)."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from icqs_fast.io.files import write_whole

if TYPE_CHECKING:
    import torch


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_growth_mb(fn, device: torch.device | str = "cpu") -> tuple[float, object]:
    """Run ``fn()`` and return ``(peak memory growth in MiB over the call, fn's result)``.

    CUDA: growth of ``torch.cuda.max_memory_allocated`` over the allocated bytes before the call.
    CPU: growth of the process's peak RSS (``VmHWM``, reset to the current RSS through
    ``/proc/self/clear_refs``) over the RSS before the call. The CPU figure counts pages touched,
    so memory the allocator already holds from earlier work is invisible: call it in a fresh
    process (after a warm-up) for a figure that means "what this call needs".
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        return (torch.cuda.max_memory_allocated(dev) - base) / 2**20, out
    base = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    out = fn()
    return (_rss_kb("VmHWM") - base) / 1024, out


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


ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
"""Environment variables that cap the vector ISA of oneDNN, ATen and MKL (our C++ kernels':
:data:`icqs_fast.backends.cpp_backend.ISA_ENV`)."""


def environment(device: torch.device | str | None = None) -> dict:
    """Where and when a benchmark ran: ``commit`` (git HEAD of the source tree, or None),
    ``date`` (UTC, ISO 8601), ``device_name`` (GPU name on CUDA, else the CPU model),
    ``cpu_count``, ``torch`` version, ``threads`` (torch CPU threads), ``cpu_capability``
    (ATen's vector ISA, e.g. ``AVX512``) and ``isa_caps``: the variables that cap a library's ISA
    (:data:`ISA_CAP_VARIABLES`) that are set, so a run emulating an AVX2-only CPU says so."""
    import os

    import torch

    from icqs_fast.backends.cpp_backend import ISA_ENV

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
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {k: os.environ[k] for k in (*ISA_CAP_VARIABLES, ISA_ENV) if os.environ.get(k)},
    }


def emit_record(rec: dict, *, out: str | None, as_json: bool) -> None:
    """Write a bench record to ``out`` (indented JSON) when given, and print it: one JSON line
    with ``as_json``, else one aligned ``key: value`` line per field."""
    import json

    if out:
        write_whole(out, json.dumps(rec, indent=2) + "\n")
    if as_json:
        print(json.dumps(rec))
    else:
        for key, val in rec.items():
            print(f"{key:>22}: {val}")


# --------------------------------------------------------------------------- correctness checks


class Want:
    """A predicate on one record field, with the words that say what it wants (``<= 0.0001``,
    ``== 1.0``, ``is True``) for the failure message."""

    def __init__(self, text: str, ok) -> None:
        self.text, self.ok = text, ok

    def __call__(self, value) -> bool:
        try:
            return bool(self.ok(value))
        except (TypeError, ValueError):
            return False

    def __repr__(self) -> str:
        return self.text


def at_most(tol: float) -> Want:
    """A finite number with ``abs(value) <= tol`` (NaN, None and inf fail)."""
    import math

    return Want(f"<= {tol:g}", lambda v: not isinstance(v, bool) and math.isfinite(v)
                and abs(v) <= tol)


def equals(expected) -> Want:
    """``value == expected`` (and, for True/False, ``is``)."""
    if isinstance(expected, bool):
        return Want(f"is {expected}", lambda v: v is expected)
    return Want(f"== {expected!r}", lambda v: not isinstance(v, bool) and v == expected)


def check_fields(record: dict, checks: dict, *, prefix: str = "") -> list[str]:
    """The failed correctness fields of ``record``, one message each (``[]``: all pass).

    Args:
        record: a bench record.
        checks: ``{field: want}``; ``want`` is a :class:`Want` (:func:`at_most`,
            :func:`equals`), a float (shorthand for ``at_most(float)``), or any predicate
            ``value -> bool``. A missing field fails.
        prefix: put before each field name in the messages (e.g. ``"ray[1]."``).

    Returns:
        messages such as ``"score_agreement = 0.0 (want == 1.0)"``.
    """
    failed = []
    for name, want in checks.items():
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            want = at_most(float(want))
        text = repr(want) if isinstance(want, Want) else getattr(want, "__name__", "check")
        if name not in record:
            failed.append(f"{prefix}{name} missing (want {text})")
            continue
        value = record[name]
        ok = want(value) if isinstance(want, Want) else _safe(want, value)
        if not ok:
            failed.append(f"{prefix}{name} = {value!r} (want {text})")
    return failed


def _safe(pred, value) -> bool:
    try:
        return bool(pred(value))
    except (TypeError, ValueError):
        return False


def report_failures(command: str, failed: list[str]) -> int:
    """Print each failed field to stderr (``bench icqs: correctness check failed: ...``) and
    return the exit status: 1 when any failed, else 0. Call it after the record is written and
    printed, so nothing measured is lost."""
    import sys

    for msg in failed:
        print(f"bench {command}: correctness check failed: {msg}", file=sys.stderr)
    return 1 if failed else 0
