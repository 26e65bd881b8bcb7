"""A small on-disk cache of JSON documents keyed by a hash, for results worth minutes of model
time that a later run with the same inputs can reuse (the self-check's cross-fitted scores).

Where: ``$ICQS_FAST_CACHE_DIR/<kind>/<key>.json``; without that variable
``$XDG_CACHE_HOME/icqs-fast/<kind>`` (default ``~/.cache/icqs-fast/<kind>``).
``ICQS_FAST_CACHE_DIR=off`` turns every cache off. Deleting the folder is always safe.

An entry is written whole (a temporary file renamed over it), so a crash leaves either the old
entry or none; an entry that cannot be read (cut off, edited, another version's) counts as
absent and is computed again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from icqs_fast.io.files import write_whole

__all__ = ["ENV", "JsonCache", "cache_root", "digest"]

ENV = "ICQS_FAST_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache's root folder (see the module docstring); None when turned off."""
    env = os.environ.get(ENV)
    if env is not None and env.strip().lower() in ("off", "0", "none", ""):
        return None
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "icqs-fast"


def digest(doc: Any) -> str:
    """sha256 (hex) of ``doc``'s canonical JSON (sorted keys, no spaces): equal documents give
    equal keys whatever their key order."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class JsonCache:
    """One kind of cached document (a subfolder of :func:`cache_root`).

    Args:
        kind: the subfolder, e.g. ``"selfcheck"``.
        root: the root folder; None: :func:`cache_root` (which may say the cache is off).
    """

    def __init__(self, kind: str, root: str | Path | None = None) -> None:
        base = Path(root) if root is not None else cache_root()
        self.dir = None if base is None else base / kind

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def path(self, key: str) -> Path | None:
        return None if self.dir is None else self.dir / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The document stored under ``key``, or None (absent, unreadable or turned off)."""
        p = self.path(key)
        if p is None:
            return None
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def put(self, key: str, doc: dict) -> Path | None:
        """Store ``doc`` (JSON-able) under ``key``; the path, or None when turned off or the
        folder cannot be written (a cache that cannot be written never fails a run)."""
        p = self.path(key)
        if p is None:
            return None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            write_whole(p, json.dumps(doc))
        except OSError:
            return None
        return p
