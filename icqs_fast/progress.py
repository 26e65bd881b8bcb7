"""Progress reporting for long loops: a tqdm bar on a terminal, a periodic status line elsewhere.

``track(iterable)`` yields the items of ``iterable`` unchanged and reports how far it got on
stderr:

- stderr is a terminal (and not ``quiet``): a tqdm bar with items/s and ETA;
- stderr is not a terminal (logs, CI, ``2> file``): one plain line at most every ``interval``
  seconds (default 10), ``desc: 1200/5000 items (40.0 items/s, ETA 1m35s)``, plus a final
  ``done`` line if at least one status line was printed - a run shorter than ``interval``
  prints nothing, so quick commands keep a clean stderr;
- ``quiet``: nothing at all.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

DEFAULT_INTERVAL = 10.0


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


def track(iterable: Iterable[T], *, total: int | None = None, desc: str = "",
          unit: str = "item", quiet: bool = False, interval: float = DEFAULT_INTERVAL,
          stream: IO[str] | None = None,
          clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """Yield the items of ``iterable`` while reporting progress on ``stream`` (stderr).

    ``total`` defaults to ``len(iterable)`` when it has one (for the ETA). ``stream`` and
    ``clock`` exist for tests: the stream decides the mode through ``isatty()``; the clock
    (monotonic seconds) times the periodic status lines. Stopping early (``break``) is fine:
    the bar is closed when the generator is.
    """
    if quiet:
        yield from iterable
        return
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    out = sys.stderr if stream is None else stream  # resolved per call: redirection works
    if _isatty(out):
        from tqdm.auto import tqdm

        bar = tqdm(iterable, total=total, desc=desc or None, unit=unit, file=out,
                   dynamic_ncols=True, leave=True)
        try:
            yield from bar
        finally:
            bar.close()
        return
    start = last = clock()
    count = 0
    printed = False
    for item in iterable:
        yield item
        count += 1
        now = clock()
        if now - last >= interval:
            out.write(status_line(count, now - start, total=total, desc=desc, unit=unit) + "\n")
            out.flush()
            last = now
            printed = True
    if printed:
        out.write(status_line(count, clock() - start, total=total, desc=desc, unit=unit,
                              done=True) + "\n")
        out.flush()
