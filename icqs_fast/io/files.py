"""Writing a file whole: it appears under its name only once complete."""

from __future__ import annotations

import os
import threading
from pathlib import Path

PathLike = str | os.PathLike


def write_whole(path: PathLike, data: bytes | str, *, fsync: bool = False,
                tmp: PathLike | None = None) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` through a temporary file beside it, renamed
    into place, so that a reader never sees half a file and a crash leaves the old one.

    Args:
        path: the file to write (replaced when it exists).
        data: its content.
        fsync: flush it to disk before the rename (files that must survive a power cut:
            results, run metadata).
        tmp: the temporary file's name (default ``.NAME.PID.THREAD.tmp`` beside ``path``,
            unique per writer; a caller whose clean-up looks for its own pattern names it).
    """
    p = Path(path)
    t = Path(tmp) if tmp is not None else \
        p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(t, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(t, p)
    except BaseException:
        t.unlink(missing_ok=True)
        raise


__all__ = ["write_whole"]
