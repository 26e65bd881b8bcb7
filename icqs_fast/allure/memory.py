"""The example memory: an append-only JSONL file of accepted in-context examples.

Each line is one :class:`MemoryEntry`: ``index`` (0-based line number), ``id`` (``r<round>:<record
id>``), ``round`` (the round whose mistake it came from), ``split`` (always ``"train"``),
``failure_mode`` (``false_positive`` / ``false_negative`` / ``predicted X for Y``), ``record``
(id, fields, truth, line), ``example`` (``user`` / ``assistant`` turns), ``predicted``,
``confidence`` (the evaluator's probability of its wrong label) and ``audit`` (who accepted it).

Lines are only ever appended (one ``write`` each, :class:`icqs_fast.io.results.JsonlWriter`), so a
crash
leaves at most one incomplete last line, which a resume truncates away. Held-out records can
never enter: :meth:`Memory.forbid` registers their ids and :meth:`Memory.append` refuses them (and
anything whose split is not ``train``); :meth:`Memory.load` refuses a file that holds one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from icqs_fast.allure.data import AuditRecord
from icqs_fast.allure.evaluators import Example
from icqs_fast.io.readers import read_json_objects
from icqs_fast.io.records import InputError
from icqs_fast.io.results import JsonlWriter, read_resume_state


class HeldoutLeakError(ValueError):
    """An attempt to put a held-out record (or a non-train split) into the memory."""


@dataclass
class MemoryEntry:
    """One accepted in-context example (see the module docstring for the fields)."""

    id: str
    round: int
    split: str
    failure_mode: str
    record: AuditRecord
    example: Example
    predicted: str = ""
    confidence: float = float("nan")
    audit: str = ""
    index: int = -1

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "round": self.round, "split": self.split,
                "failure_mode": self.failure_mode, "record": asdict(self.record),
                "example": asdict(self.example), "predicted": self.predicted,
                "confidence": self.confidence, "audit": self.audit}

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str = "<memory>", line: int = 0
                  ) -> MemoryEntry:
        try:
            rec = obj["record"]
            ex = obj["example"]
            return cls(id=str(obj["id"]), round=int(obj["round"]), split=str(obj["split"]),
                       failure_mode=str(obj.get("failure_mode", "")),
                       record=AuditRecord(str(rec["id"]), dict(rec["fields"]), str(rec["truth"]),
                                          int(rec.get("line", 0))),
                       example=Example(str(ex["user"]), str(ex["assistant"])),
                       predicted=str(obj.get("predicted", "")),
                       confidence=float(obj.get("confidence", float("nan"))),
                       audit=str(obj.get("audit", "")), index=int(obj.get("index", -1)))
        except (KeyError, TypeError, ValueError) as exc:
            what = exc.args[0] if isinstance(exc, KeyError) else None
            raise InputError(path, line, what, f"not a memory entry ({exc!r})") from None


class Memory:
    """Accepted examples, in the order they were accepted; backed by an append-only JSONL
    file when ``path`` is given (:meth:`load` reads an existing one).

    Args:
        path: the JSONL file, or None to keep the memory in this object only.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: list[MemoryEntry] = []
        self._forbidden: set[str] = set()
        self._writer: JsonlWriter | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[MemoryEntry]:
        return iter(self.entries)

    def ids(self) -> set[str]:
        return {e.id for e in self.entries}

    def before(self, round_: int) -> list[MemoryEntry]:
        """The entries accepted in rounds before ``round_`` (what round ``round_`` evaluates
        with)."""
        return [e for e in self.entries if e.round < round_]

    def forbid(self, record_ids: Iterable[str]) -> None:
        """Refuse these records from now on (the held-out split); existing entries are checked
        too.

        Raises:
            HeldoutLeakError: an entry already holds one of them.
        """
        self._forbidden |= {str(i) for i in record_ids}
        bad = [e.id for e in self.entries if e.record.id in self._forbidden]
        if bad:
            raise HeldoutLeakError(f"{self.path or 'the memory'} holds held-out record(s) "
                                   f"{bad[:3]}; it was written with another split (seed, "
                                   "--limit, held-out fraction)")

    def load(self) -> Memory:
        """Read the entries of ``path`` (none when the file does not exist yet); an incomplete
        last line (a write cut off by a crash) is truncated away first.

        Raises:
            InputError: a line that is not a memory entry, an entry whose split is not
                ``train``, a repeated id (each names the file and line).
        """
        if self.path is None or not self.path.exists():
            return self
        name = os.fspath(self.path)
        end = read_resume_state(self.path).end
        if self.path.stat().st_size != end:
            with open(self.path, "r+b") as f:  # drop an entry cut off mid-write by a crash
                f.truncate(end)
        self.entries = []
        seen: set[str] = set()
        for lineno, obj in read_json_objects(self.path, allow_empty=True):
            e = MemoryEntry.from_json(obj, name, lineno)
            if e.split != "train":
                raise InputError(name, lineno, "split", f"{e.split!r}: only training "
                                 "examples may be in the memory")
            if e.id in seen:
                raise InputError(name, lineno, "id", f"repeated id {e.id!r}")
            seen.add(e.id)
            self.entries.append(e)
        self.forbid(())
        return self

    def append(self, entry: MemoryEntry) -> MemoryEntry:
        """Add ``entry`` at the end (written to the file at once, one line).

        Raises:
            HeldoutLeakError: a held-out record or a split other than ``train``.
            ValueError: an id already in the memory.
        """
        if entry.split != "train" or entry.record.id in self._forbidden:
            raise HeldoutLeakError(f"record {entry.record.id!r} (split {entry.split!r}) cannot "
                                   "enter the memory: only training records may")
        if entry.id in self.ids():
            raise ValueError(f"memory entry {entry.id!r} is already there")
        entry.index = len(self.entries)
        if self.path is not None:
            if self._writer is None:
                self._writer = JsonlWriter(self.path, append=True, fsync_every=0)
            self._writer.write(entry.to_json())
        self.entries.append(entry)
        return entry

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
