"""The server's resident memory under a varied load: the allocator trimmed.

**Kernel caches** were the main cause of the growth at bf16-mixed (serve's default on the CPU):
oneDNN's and ideep's per-shape caches, an entry per token count of a forward. They are capped
when a model loads (:func:`icqs_fast.models.bound_kernel_caches`, for every job, not only the
server), with the measurement there.

**The allocator**, a second, smaller part: every step allocates activations of a new shape, and
glibc keeps freed heap memory resident (fragmented between live blocks; its mmap threshold rises
to the largest block freed, up to 32 MiB). :class:`Trimmer` gives it back with
``malloc_trim(0)`` (which also releases free pages inside the heaps) from the worker between
steps: when the queue goes idle, and every ``every_s`` seconds under a sustained load (the 90 s
soak: 45 trims, 0.6 s in all). Its own share was not isolated from the caches' (90 s soaks with
the trim and unbounded caches: 1150 -> 1691 MB and 1125 -> 1373 MB; without either: 1160 -> 1606
MB, 1147 -> 1764 MB). Without glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

# Seconds between trims while the worker has work (at most; when it goes idle: at once).
TRIM_EVERY_S = 2.0

_LIBC: list[Any] = []  # [the glibc handle or None], looked up once


def glibc() -> Any:
    """The process's glibc (a ctypes handle), None when it has none (macOS, musl)."""
    if not _LIBC:
        lib = None
        if sys.platform.startswith("linux"):
            try:
                cand = ctypes.CDLL(None)
                if hasattr(cand, "gnu_get_libc_version") and hasattr(cand, "malloc_trim"):
                    lib = cand
            except OSError:
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def malloc_trim() -> bool:
    """Return the allocator's free memory to the system (glibc's ``malloc_trim(0)``); False
    where there is no glibc."""
    lib = glibc()
    if lib is None:
        return False
    lib.malloc_trim(ctypes.c_size_t(0))
    return True


class Trimmer:
    """:func:`malloc_trim` from the worker between steps (the queue's ``between_steps``): at
    once when the queue is idle, else at most every ``every_s`` seconds; a no-op without glibc.

    Attributes:
        trims: how many times it trimmed; ``seconds``: the time the trims took.
    """

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = float(every_s)
        self.enabled = glibc() is not None
        self.trims = 0
        self.seconds = 0.0
        self._last = time.monotonic()

    def __call__(self, idle: bool) -> None:
        """After a worker step (``idle``: the queue has no work left)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if idle or now - self._last >= self.every_s:
            malloc_trim()
            done = time.monotonic()
            self.trims += 1
            self.seconds += done - now
            self._last = done


__all__ = ["TRIM_EVERY_S", "Trimmer", "glibc", "malloc_trim"]
