"""The output folder of a ``--ray`` run (``OUT/part-KKKKKK.<fmt>`` block files and
``OUT/run.meta.json``) on the filesystem the driver and every worker reach: a local or mounted
folder, or a pyarrow filesystem URI (``file://``, ``s3://``, ``gs://``, ``abfs://``). Plain I/O:
each block file is written whole or not at all, by the writer of :mod:`icqs_fast.io.results`
(:class:`~icqs_fast.io.results.BlockWriter`: the local writers' lines / table). As a
:class:`~icqs_fast.io.runs.RunTarget` it is decided, locked, resumed and given its metadata
by :mod:`icqs_fast.io.runs`, as a local results file is.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from icqs_fast.io.files import write_whole
from icqs_fast.io.results import BlockWriter, ResumeState
from icqs_fast.io.runs import OutputLock

__all__ = ["META_FILE", "META_NAME", "OBJECT_STORES", "BlockOutput", "block_name", "block_path",
           "is_uri"]

META_NAME = "run"  # OUT/run.meta.json (io.runs.write_meta adds .meta.json)
META_FILE = f"{META_NAME}.meta.json"


def block_path(out_dir: str | os.PathLike, block: int, out_format: str) -> str:
    """The file of block ``block``: ``OUT/part-KKKKKK.<format>``."""
    return os.path.join(os.fspath(out_dir), block_name(block, out_format))


def block_name(block: int, out_format: str) -> str:
    """The name of block ``block``'s file inside the output: ``part-KKKKKK.<format>``."""
    return f"part-{block:06d}.{out_format}"


# pyarrow filesystem types whose files appear only once their upload completes (and which have
# no atomic rename): blocks are written there under their final name.
OBJECT_STORES = ("s3", "gcs", "abfs")


def is_uri(output: str) -> bool:
    """Whether ``output`` names a pyarrow filesystem URI (``scheme://...``) rather than a path."""
    head, sep, _ = output.partition("://")
    return bool(sep) and head.replace("+", "").replace("-", "").isalnum() and "/" not in head


class BlockOutput:
    """The output folder of a ``--ray`` run, on the filesystem the driver and every worker reach.

    ``output`` is a local path (a folder every node mounts at the same path) or a URI of a
    pyarrow filesystem (``pyarrow.fs.FileSystem.from_uri``: ``file:///shared/out``,
    ``s3://bucket/prefix?endpoint_override=host:port&scheme=http``, ...). Each process builds
    its own from the same string, so credentials come from that process's environment.

    Files are written whole or not at all (:meth:`write_bytes`): on a local or mounted
    filesystem to ``NAME.tmp.PID`` (fsynced, so a machine crash cannot leave a complete-looking
    empty block on a shared mount), then renamed; on an object store (:data:`OBJECT_STORES`)
    under the final name, which its readers see only once the upload completes.

    Args:
        output: the path or URI.
        by_rename: how :meth:`write_bytes` makes a write atomic (default: by the filesystem's
            type, see above); False writes in place (what an object store does) on any
            filesystem, which the tests use to run the object-store path on a local one.
    """

    def __init__(self, output: str, *, by_rename: bool | None = None) -> None:
        import pyarrow.fs as pafs

        self.output = output
        if is_uri(output):
            self.fs, root = pafs.FileSystem.from_uri(output)
        else:
            self.fs, root = pafs.LocalFileSystem(), os.path.abspath(output)
        self.root = root.rstrip("/") or "/"
        self.local = self.fs.type_name == "local"
        self.by_rename = (self.fs.type_name not in OBJECT_STORES) if by_rename is None \
            else by_rename

    def path(self, name: str) -> str:
        """The filesystem path of ``name`` inside the output."""
        return f"{self.root}/{name}"

    def kind(self) -> str:
        """``"missing"``, ``"dir"`` or ``"file"`` (a prefix with objects is a folder)."""
        import pyarrow.fs as pafs

        t = self.fs.get_file_info(self.root).type
        if t == pafs.FileType.Directory:
            return "dir"
        if t == pafs.FileType.File:
            return "file"
        return "dir" if self.names() else "missing"

    def names(self) -> list[str]:
        """The names of the files directly inside the output (none when it is missing)."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def exists(self, name: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path(name)).type == pafs.FileType.File

    def read_text(self, name: str) -> str:
        with self.fs.open_input_stream(self.path(name)) as f:
            return f.read().decode("utf-8")

    def remove(self, name: str) -> None:
        self.fs.delete_file(self.path(name))

    def make(self) -> None:
        """Create the output folder (on an object store: nothing to create)."""
        self.fs.create_dir(self.root, recursive=True)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write file ``name`` whole: it exists only once complete (see the class docstring)."""
        final = self.path(name)
        if not self.by_rename:
            with self.fs.open_output_stream(final) as f:
                f.write(data)
            return
        tmp = f"{final}.tmp.{os.getpid()}"
        if self.local:  # os calls: fsync before the rename (pyarrow's stream does not sync)
            write_whole(final, data, fsync=True, tmp=tmp)
            return
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, final)

    def open_block(self, block: int, fmt: str, *, schema: Any = None) -> BlockWriter:
        """The writer of block ``block`` (:class:`~icqs_fast.io.results.BlockWriter`; its file
        ``part-KKKKKK.<fmt>`` is written whole when the writer closes)."""
        name = block_name(block, fmt)
        return BlockWriter(lambda data: self.write_bytes(name, data), fmt, schema=schema)

    # ------------------------------------------------------------ io.runs.RunTarget

    held = "holds block files"
    runtime_later = True  # the driver writes run.meta.json before any worker has loaded

    @property
    def name(self) -> str:
        return self.output

    def parts(self) -> list[str]:
        """The names of the block files and unfinished block files in the output."""
        return [p for p in self.names() if p.startswith("part-")]

    def holds_results(self) -> bool:
        return self._kind() == "dir" and bool(self.parts())

    def present(self) -> bool:
        return self._kind() == "dir" and (bool(self.parts()) or self.exists(META_FILE))

    def _kind(self) -> str:
        kind = self.kind()
        if kind == "file":
            raise ValueError(f"{self.output} exists and is not a folder; a --ray output is a "
                             "folder of block files")
        return kind

    def resume_state(self) -> ResumeState:
        """The complete block files (``ResumeState.blocks``); block files without a
        ``run.meta.json`` cannot be resumed (ValueError)."""
        done = tuple(p for p in self.parts() if ".tmp." not in p)
        if done and not self.exists(META_FILE):
            raise ValueError(f"cannot --resume {self.output}: it has block files but no "
                             f"{META_FILE}; use --overwrite")
        return ResumeState(last=None, count=len(done), end=0, format="blocks", blocks=done)

    def read_meta(self) -> dict | None:
        return json.loads(self.read_text(META_FILE)) if self.exists(META_FILE) else None

    def write_meta(self, settings: dict) -> None:
        """``run.meta.json``, formatted as :func:`~icqs_fast.io.runs.write_meta` writes it."""
        self.write_bytes(META_FILE, (json.dumps(settings, indent=1) + "\n").encode("utf-8"))

    def clear(self) -> None:
        """Create the folder and remove the blocks of an earlier run (``--overwrite``)."""
        self.make()
        for p in self.parts():
            self.remove(p)

    def reopen(self, policy: Any, log: Any) -> None:
        """Remove the files being written when a driver or worker died (``*.tmp.PID``: blocks,
        and the metadata file a killed driver was replacing)."""
        for stale in (p for p in self.names() if ".tmp." in p):
            self.remove(stale)

    def lock(self):
        """``OUT.lock`` (:class:`~icqs_fast.io.runs.OutputLock`) on a local or mounted
        filesystem; on an object store nothing (no exclusive create there)."""
        return OutputLock(Path(self.root)) if self.local else contextlib.nullcontext()
