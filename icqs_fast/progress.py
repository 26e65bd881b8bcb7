"""Progress reporting for long loops: a tqdm bar on a terminal, a periodic status line elsewhere.

``track(iterable)`` yields the items of ``iterable`` unchanged and reports how far it got on
stderr:

- stderr is a terminal (and not ``quiet``): a tqdm bar with items/s and ETA;
- stderr is not a terminal (logs, CI, ``2> file``): one plain line at most every ``interval``
  seconds (default 10, or ``$ICQS_FAST_PROGRESS_INTERVAL``), ``desc: 1200/5000 items
  (40.0 items/s, ETA 1m35s)``, plus a final ``done`` line if at least one status line was
  printed - a run shorter than ``interval`` prints nothing, so quick commands keep a clean
  stderr;
- ``quiet``: nothing at all.

:class:`Progress` is the same report for work that is not one loop over items (``update(n)``
after each piece).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL = 10.0
INTERVAL_ENV = "ICQS_FAST_PROGRESS_INTERVAL"


def _interval(interval: float | None) -> float:
    if interval is not None:
        return interval
    env = os.environ.get(INTERVAL_ENV)
    if env:
        try:
            return max(0.0, float(env))
        except ValueError:
            raise ValueError(f"${INTERVAL_ENV} must be a number of seconds, got {env!r}") from None
    return DEFAULT_INTERVAL


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"3m05s"``, ``"2h03m"``: a short human duration."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def status_line(count: int, elapsed: float, *, total: int | None = None, desc: str = "",
                unit: str = "item", done: bool = False) -> str:
    """The one-line status printed when stderr is not a terminal (no trailing newline)."""
    units = unit if unit.endswith("s") else unit + "s"
    rate = count / elapsed if elapsed > 0 else 0.0
    head = f"{desc}: " if desc else ""
    progress = f"{count}/{total}" if total is not None else f"{count}"
    tail = f"{rate:.1f} {units}/s"
    if done:
        tail += f", done in {format_duration(elapsed)}"
    elif total is not None and rate > 0 and count <= total:
        tail += f", ETA {format_duration((total - count) / rate)}"
    return f"{head}{progress} {units} ({tail})"


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A progress report updated by hand: ``update(n)`` after each piece of work, ``close()``
    at the end (or use it as a context manager). Same modes as :func:`track`."""

    def __init__(self, *, total: int | None = None, desc: str = "", unit: str = "item",
                 quiet: bool = False, interval: float | None = None,
                 stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit, self.quiet = total, desc, unit, quiet
        self.count = 0
        self._interval = _interval(interval)
        self._out = sys.stderr if stream is None else stream  # per call: redirection works
        self._clock = clock
        self._bar = None
        self._printed = False
        self._closed = False
        if quiet:
            return
        if _isatty(self._out):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc or None, unit=unit, file=self._out,
                             dynamic_ncols=True, leave=True)
        self._start = self._last = clock()

    def update(self, n: int = 1) -> None:
        """``n`` more items done."""
        self.count += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self._clock()
        if now - self._last >= self._interval:
            self._write(status_line(self.count, now - self._start, total=self.total,
                                    desc=self.desc, unit=self.unit))
            self._last = now
            self._printed = True

    def _write(self, line: str) -> None:
        self._out.write(line + "\n")
        self._out.flush()

    def close(self, *, done: bool = True) -> None:
        """Close the bar; print the ``done`` line if a status line was printed (and ``done``:
        not when the work stopped on an error)."""
        if self._closed or self.quiet:
            self._closed = True
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._printed and done:
            self._write(status_line(self.count, self._clock() - self._start, total=self.total,
                                    desc=self.desc, unit=self.unit, done=True))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(done=exc_type is None)


def track(iterable: Iterable[T], *, total: int | None = None, desc: str = "",
          unit: str = "item", quiet: bool = False, interval: float | None = None,
          stream: IO[str] | None = None,
          clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """Yield the items of ``iterable`` while reporting progress on ``stream`` (stderr).

    ``total`` defaults to ``len(iterable)`` when it has one (for the ETA). ``interval``: seconds
    between status lines (None: ``$ICQS_FAST_PROGRESS_INTERVAL`` or 10). ``stream`` and
    ``clock`` exist for tests: the stream decides the mode through ``isatty()``; the clock
    (monotonic seconds) times the periodic status lines. An item counts once the loop body
    that got it is done. Stopping early (``break``) is fine: the bar is closed when the
    generator is.
    """
    if quiet:
        yield from iterable
        return
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(total=total, desc=desc, unit=unit, interval=interval, stream=stream,
                  clock=clock) as p:
        for item in iterable:
            yield item
            p.update(1)


def quiet_transformers() -> None:
    """--quiet: no "Loading weights" progress bar, only errors from transformers' logging."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
