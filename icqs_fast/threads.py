"""The CPU thread policy of every command that runs a model (``score``, ``features``, ``check``,
``serve``, ``demo``, ``bench``): how many torch threads, and how OpenMP's idle threads wait.

Why: two processes that each run two OpenMP threads on two cores fight. A parallel region ends
when its slowest thread ends; a thread the other process's threads push off its core holds up
its whole region, while its siblings spin on a barrier, taking the cores the other process
needs. On the shared 2-core machine ``score`` at torch's default (all cores) beside another
job ran about 3x slower than with ``--threads 1``.

The policy (:func:`apply_threads`):

* ``--threads N`` is kept as given; so is ``OMP_NUM_THREADS`` when set (torch follows it; Ray
  sets it per worker).
* Otherwise the default is the cores actually free when the job starts
  (:func:`free_cpus`): the cores this process may run on (``os.sched_getaffinity``), less the
  CPU time other processes used over a short sample of ``/proc/stat`` (this process's own
  time excluded), rounded to the nearest core and at least one. Alone on the machine: every
  core, as before. Beside a job that keeps one core busy: one thread.
* Every entry point that runs a model takes this policy, with ``--threads`` declared once
  (:func:`threads_option`; :func:`add_threads_argument`): ``score``, ``features``, ``check``,
  ``demo``, ``serve``, ``audit``, ``eval``, the ``bench`` commands, the bench scripts (their
  default 1), and the lm-eval backend when it loads its own model (:func:`apply_job_threads`;
  lm-eval's CLI is the process entry point there).
* While a job runs, :class:`ThreadGovernor` re-fits the count to the free cores (a sampler
  thread measures the other processes' CPU time every :data:`GOVERN_SECONDS`; the change is
  made between two module forwards, on the thread that runs them, because OpenMP's thread
  count is that thread's setting). Two jobs started together both see the other idle at
  their start (both are in the sample's sleep); within a second or two each sees the other
  busy and drops to the cores left, and takes them back when the other ends. Only the
  process entry point (``icqs-fast ...``) starts it: a library caller's or a test's
  ``torch.set_num_threads`` is never overridden, and the governor stops the moment anyone
  else changes the count.
* Idle OpenMP threads wait passively (:func:`prepare_openmp`, which must run before torch's
  OpenMP runtime loads, i.e. before ``import torch``: GNU libgomp, the runtime of torch's Linux
  wheels and of MKL's GNU threading layer, reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once
  when it loads; Intel's ``KMP_BLOCKTIME`` likewise for libiomp). A short spin
  (:data:`SPIN_COUNT` iterations, a few microseconds) still catches the next parallel region
  of a busy forward, so a job alone keeps its speed; past it a waiting thread sleeps and gives
  its core away instead of spinning ~300,000 iterations (libgomp's default) against the other
  job. Values the user set in the environment are kept.
* glibc malloc keeps blocks of up to a few tens of MB on its heap (:func:`prepare_malloc`):
  otherwise a forward's activations can be fresh pages, faulted in again at every call.

Layer 3 (no torch at import: :func:`prepare_openmp` runs before torch is imported).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from icqs_fast.options import add_declared, option

# libgomp's spin iterations before a waiting thread sleeps (its default with OMP_WAIT_POLICY
# unset is 300,000: ~0.1-1 ms of a core per wait, which starve the other job's threads).
SPIN_COUNT = "10000"
# Intel OpenMP's equivalent, in milliseconds (its default is 200).
KMP_BLOCKTIME = "0"
# Seconds of /proc/stat sampling behind the default thread count.
SAMPLE_SECONDS = 0.1
# Seconds between the governor's samples while a job runs.
GOVERN_SECONDS = 1.0
# Set by the command-line entry point (:func:`enable_governor`): only then does
# :func:`apply_threads` start a :class:`ThreadGovernor`.
_GOVERN = {"enabled": False, "governor": None}


def threads_option() -> Any:
    """The one declaration of ``--threads`` (a dataclass field): :class:`ThreadOptions`' and
    the jobs' (``JobConfig.threads``)."""
    return option(None, kind="int", ge=1, result=False, help="torch CPU threads (none: the "
                  "cores other processes leave free, re-fitted while the job runs; "
                  "OMP_NUM_THREADS when set)")


@dataclasses.dataclass(frozen=True)
class ThreadOptions:
    """``--threads`` for a command or script that is not a job (:func:`add_threads_argument`)."""

    threads: int | None = threads_option()


def add_threads_argument(p: Any, default: int | None = None) -> None:
    """Add ``--threads`` (:func:`threads_option`) to the parser or group ``p``; ``default``:
    this command's own (a bench script's 1). Apply the parsed value with
    :func:`apply_threads`."""
    add_declared(p, ThreadOptions, defaults={"threads": default})


def prepare_openmp(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the OpenMP wait policy in ``environ`` (``os.environ`` if None) unless the user set
    one: ``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT` (libgomp) and ``KMP_BLOCKTIME`` =
    :data:`KMP_BLOCKTIME` (libiomp). Call before ``import torch`` (the runtime reads them
    once, at load; later calls change nothing there). Returns what was set."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:  # the user's choice covers both runtimes
        return {}
    out = {}
    for name, value in (("GOMP_SPINCOUNT", SPIN_COUNT), ("KMP_BLOCKTIME", KMP_BLOCKTIME)):
        if name not in env:
            env[name] = out[name] = value
    return out


# glibc malloc's thresholds for the model commands (prepare_malloc): blocks up to 32 MiB (the
# most glibc's adaptive threshold reaches) come from the heap, which keeps up to 128 MiB free.
# By default a block of a few MB (activations, a softmax state) could be a fresh mmap faulted
# in at every call: an fp32 RMSNorm over [950, 576] took 1.3-1.5 ms (~1,000 faults), 0.26 ms
# with these; the prefix bank's build swung 1.28-1.80 s, now 1.18-1.31 s (bench icqs, auto).
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 128 << 20
# The user's own allocator policy (a threshold, tunables, a preloaded jemalloc) stands.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def prepare_malloc(environ: dict[str, str] | None = None) -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process unless ``environ``
    (``os.environ`` if None) names a policy (:data:`MALLOC_ENV`) or the C library is not glibc.
    Returns whether they were set."""
    import ctypes
    import ctypes.util

    if any((os.environ if environ is None else environ).get(n) for n in MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    # <malloc.h>: M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1.
    return bool(mallopt(-3, MMAP_THRESHOLD)) and bool(mallopt(-1, TRIM_THRESHOLD))


def allowed_cpus() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has no affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _cpu_times(path: str = "/proc/stat") -> tuple[float, float] | None:
    """``(busy, total)`` jiffies of all cores from the first line of ``/proc/stat``; None when
    it cannot be read (not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    vals = [float(v) for v in fields[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
    # guest / guest_nice (fields 9-10) are already counted in user / nice.
    total = sum(vals[:8])
    return total - idle, total


def _clock_ticks() -> float:
    """Jiffies per second (``/proc/stat``'s unit)."""
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def busy_cpus_of_others(seconds: float = SAMPLE_SECONDS,
                        read: Callable[[], tuple[float, float] | None] = _cpu_times,
                        own_cpu: Callable[[], float] = time.process_time,
                        sleep: Callable[[float], None] = time.sleep,
                        ncpu: int | None = None) -> float | None:
    """Cores' worth of CPU time other processes used over a ``seconds`` sample (``/proc/stat``
    busy time across all cores, less this process's own CPU time); None where ``/proc/stat``
    cannot be read."""
    n = ncpu or os.cpu_count() or 1
    a, c0 = read(), own_cpu()
    if a is None:
        return None
    sleep(seconds)
    b, c1 = read(), own_cpu()
    if b is None or b[1] <= a[1]:
        return None
    per_core = (b[1] - a[1]) / n  # jiffies each core had over the sample
    own = (c1 - c0) * _clock_ticks()  # this process's CPU time, in jiffies
    return max(0.0, (b[0] - a[0] - own) / per_core)


def free_cpus(allowed: int | None = None, busy: float | None = None) -> int:
    """The default thread count: ``allowed`` cores (:func:`allowed_cpus` if None) less the
    ``busy`` cores of other processes (:func:`busy_cpus_of_others` if None; unknown counts as
    none), rounded to the nearest, at least 1."""
    allowed = allowed_cpus() if allowed is None else allowed
    if busy is None:
        busy = busy_cpus_of_others() or 0.0
    return max(1, min(allowed, int(allowed - busy + 0.5)))


def apply_threads(threads: int | None, govern: bool | None = None) -> int:
    """Set torch's intra-op threads: ``threads`` when given (``--threads``; >= 1), else
    torch's own count where ``OMP_NUM_THREADS`` is set, else :func:`free_cpus`, with a
    :class:`ThreadGovernor` when ``govern`` (None: when :func:`enable_governor` was called, i.e.
    in the ``icqs-fast`` process). Returns the count in force. Call before the model loads."""
    if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
        raise ValueError(f"--threads must be >= 1, got {threads!r}")
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS", "").strip():
        # The user's (or Ray's, per worker) OMP_NUM_THREADS: torch already follows it.
        return torch.get_num_threads()
    n = int(threads) if threads is not None else free_cpus()
    torch.set_num_threads(n)
    if govern is None:
        govern = _GOVERN["enabled"]
    if threads is None and govern and _GOVERN["governor"] is None:
        gov = ThreadGovernor(allowed_cpus(), n)
        gov.start()
        _GOVERN["governor"] = gov
    return n


def apply_job_threads(threads: int | None) -> int:
    """:func:`apply_threads` for a job whose process entry point is not ``icqs-fast``'s (the
    lm-eval backend run by lm-eval's CLI): the same default count and governor. The OpenMP
    wait policy cannot follow there (torch is loaded before the backend is built): set
    ``OMP_WAIT_POLICY=passive`` or ``GOMP_SPINCOUNT`` in that process's environment."""
    return apply_threads(threads, govern=True)


def enable_governor() -> None:
    """Let :func:`apply_threads` start a :class:`ThreadGovernor` for a default thread count:
    for the ``icqs-fast`` process entry point only (see the module docstring)."""
    _GOVERN["enabled"] = True


class ThreadGovernor:
    """Re-fits torch's thread count to the cores other processes leave free while a job runs.

    A daemon thread samples :func:`busy_cpus_of_others` every ``interval`` seconds into
    ``desired`` (:func:`free_cpus`); :meth:`before_forward`, a global module forward pre-hook,
    applies it on the forward's own thread (OpenMP's count is per thread). It stops for good
    when the count is no longer the one it set (someone else chose one)."""

    def __init__(self, allowed: int, current: int, interval: float = GOVERN_SECONDS,
                 sample: Callable[[float], float | None] | None = None) -> None:
        self.allowed, self.interval = allowed, interval
        self.desired = self.last_set = current
        self.stopped = threading.Event()
        self._sample = sample or (lambda s: busy_cpus_of_others(s, sleep=self.stopped.wait))
        self._hook: Any = None

    def start(self) -> None:
        """Register the forward pre-hook and start the sampler thread."""
        from torch.nn.modules import module as nn_module

        self._hook = nn_module.register_module_forward_pre_hook(self.before_forward)
        threading.Thread(target=self._run, name="icqs-thread-governor", daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.update(self._sample(self.interval))

    def update(self, busy: float | None) -> None:
        """One sample: the other processes' ``busy`` cores (None: unknown, nothing changes)."""
        if busy is not None and not self.stopped.is_set():  # a sample that ends after stop()
            self.desired = free_cpus(self.allowed, busy)

    def before_forward(self, module: Any, args: Any) -> None:
        """Apply ``desired`` (cheap when nothing changed: one comparison)."""
        want = self.desired
        if want == self.last_set or self.stopped.is_set():
            return
        import torch

        if torch.get_num_threads() != self.last_set:  # someone else set it: theirs stands
            self.stop()
            return
        torch.set_num_threads(want)
        self.last_set = want

    def stop(self) -> None:
        """Stop sampling and remove the hook."""
        self.stopped.set()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
