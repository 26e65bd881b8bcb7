"""Fault injection for the tests that stop runs at chosen points. The library has no test hooks:
these patch its writers and its Ray actors from outside, in the process that should fail.

Writer crashes (tests/test_resume_crash.py, tests/test_io.py): :func:`install_crash` patches
:class:`~icqs_fast.io.results.JsonlWriter` and :class:`~icqs_fast.io.results.ParquetResultWriter`
so that the process SIGKILLs itself at the N-th record a writer writes (0-based, counted per
writer by its ``count``). ``MODE:N``:

* ``before``: before record N is written (JSONL) or buffered (Parquet);
* ``mid``: JSONL: after the first half of record N's line is written (and fsynced); Parquet:
  while the part holding record N is being committed, its temporary file written without a
  footer;
* ``hold``: after record N's line is written (JSONL) or the part holding it is committed
  (Parquet), sleep until killed from outside (at most ``HOLD_KILL_S``).

Run a command line that way in a fresh interpreter::

    python tests/_faults.py crash MODE:N -- score IN -o OUT ...    # icqs_fast.cli.main(argv)

Ray holds (tests/test_distributed.py, tests/test_ray_cluster.py): Ray actors are processes of
their own, so the patch travels as the job's ``runtime_env`` (:func:`hold_runtime_env`): Ray runs
:func:`hold_blocks` in every worker of the job as it starts (``worker_process_setup_hook``,
imported from ``tests/``: the nodes must be started with :func:`worker_path_env` in their
environment), and it wraps ``icqs_fast.jobs.ray_executor.items_of_block``, which an actor calls
once it knows the block it scores, right before scoring it. With ``$ICQS_FAST_TEST_RAY_HOLD=DIR``
(set by the runtime env):

* ``DIR/arm-K`` present: the first actor to take block K writes ``PID NODE`` to ``DIR/held-K``
  and waits (to be killed from outside, its node removed, or let go by ``DIR/release-K``); a
  later attempt at block K goes on.
* ``DIR/arm-node-NODE`` present: every block an actor on Ray node NODE takes creates
  ``DIR/held-node-NODE`` and waits until ``DIR/release-node-NODE`` exists (so a test knows that
  this node's actor has work, or keeps the node busy while it changes the cluster).

A driver in its own process joins the job's holds with::

    python tests/_faults.py ray-hold DIR -- score IN -o OUT --ray --address ADDR ...
    # tests/_ray_cli.py's main(argv), after ray.init with the hold runtime env

Imports stay light (no torch here): every Ray worker of a held job imports this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

CRASH_MODES = ("before", "mid", "hold")
HOLD_ENV = "ICQS_FAST_TEST_RAY_HOLD"
HOLD_HOOK = "_faults.hold_blocks"  # worker_process_setup_hook: "module.function" on PYTHONPATH
ENTRY = os.path.abspath(__file__)  # ``python ENTRY crash|ray-hold ...``
TESTS_DIR = os.path.dirname(ENTRY)
HOLD_KILL_S = 600  # a crash "hold" never outlives a test that forgot to kill it
HOLD_RELEASE_S = 120  # a Ray hold never outlives a test that forgot to let it go
_PATCHED = "icqs_fast.jobs.ray_executor"


# --------------------------------------------------------------------------- writer crashes


def parse_crash(spec: str) -> tuple[str, int]:
    """``"MODE:N"`` -> ``(MODE, N)``; ValueError naming the spec when it is not one."""
    mode, _, n = spec.partition(":")
    if mode not in CRASH_MODES or not n.isdigit():
        raise ValueError(f"crash spec must be before|mid|hold:N, got {spec!r}")
    return mode, int(n)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hold_then_die() -> None:
    deadline = time.monotonic() + HOLD_KILL_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    _die()


def install_crash(spec: str) -> None:
    """Patch the result writers of this process to SIGKILL it as ``spec`` (``MODE:N``, see
    the module docstring) says. For a process that is meant to die: nothing is undone."""
    mode, n = parse_crash(spec)
    from icqs_fast.io.results import JsonlWriter, ParquetResultWriter, json_line

    jsonl_write = JsonlWriter.write

    def write_jsonl(self: JsonlWriter, record: dict) -> None:
        if mode != "hold" and self.count == n:
            if mode == "mid":
                # The writer's descriptor appends too: the half line lands where it would have.
                data = json_line(record)
                with open(self.path, "ab") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
            _die()
        jsonl_write(self, record)
        if mode == "hold" and self.count - 1 == n:
            _fsync(self.path)
            _hold_then_die()

    parquet_write = ParquetResultWriter.write
    parquet_commit = ParquetResultWriter.commit
    parquet_part = ParquetResultWriter.write_part

    def holds_n(w: ParquetResultWriter) -> bool:
        # The records not yet committed are the last `pending` of the `count` written.
        return w.count - w.pending <= n < w.count

    def write_parquet(self: ParquetResultWriter, record: dict) -> None:
        if mode == "before" and self.count == n:
            _die()
        parquet_write(self, record)

    def write_part(self: ParquetResultWriter, path, table) -> None:
        if mode == "mid" and holds_n(self):
            import pyarrow.parquet as pq

            pq.ParquetWriter(path, table.schema).write_table(table)
            _die()  # the writer is never closed: the temporary part has no footer
        parquet_part(self, path, table)

    def commit(self: ParquetResultWriter) -> None:
        held = mode == "hold" and holds_n(self)
        parquet_commit(self)
        if held:
            _hold_then_die()

    JsonlWriter.write = write_jsonl
    ParquetResultWriter.write = write_parquet
    ParquetResultWriter.write_part = write_part
    ParquetResultWriter.commit = commit


# --------------------------------------------------------------------------- Ray holds


def worker_path_env() -> dict[str, str]:
    """``PYTHONPATH`` with ``tests/`` first: set it before Ray starts its nodes (their workers
    inherit it), so that they can import :data:`HOLD_HOOK`."""
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": TESTS_DIR + (os.pathsep + old if old else "")}


def hold_runtime_env(hold_dir: str) -> dict:
    """The job ``runtime_env`` (``ray.init(runtime_env=...)``) whose actors hold blocks as
    the files in ``hold_dir`` say (module docstring)."""
    return {"worker_process_setup_hook": HOLD_HOOK, "env_vars": {HOLD_ENV: hold_dir}}


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + HOLD_RELEASE_S
    while time.monotonic() < deadline and not os.path.exists(path):
        time.sleep(0.05)


def hold_block(block: int, node: str, hold_dir: str) -> None:
    """Hold block ``block`` on Ray node ``node`` as the files in ``hold_dir`` say."""
    d = hold_dir
    if node and os.path.exists(os.path.join(d, f"arm-node-{node}")):
        open(os.path.join(d, f"held-node-{node}"), "a").close()
        _wait_for_file(os.path.join(d, f"release-node-{node}"))
    if not os.path.exists(os.path.join(d, f"arm-{block}")):
        return
    try:  # only the first attempt at the block holds; a retry goes on
        fd = os.open(os.path.join(d, f"held-{block}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o644)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()} {node}\n".encode())
    os.close(fd)
    _wait_for_file(os.path.join(d, f"release-{block}"))


def _wrap_items_of_block(module) -> None:
    items_of_block = module.items_of_block  # AttributeError if renamed: the worker fails loudly

    def held_items(cols, path_name):
        import ray

        hold_dir = os.environ.get(HOLD_ENV)
        if hold_dir:
            hold_block(int(cols["block"][0]), ray.get_runtime_context().get_node_id(),
                       hold_dir)
        return items_of_block(cols, path_name)

    module.items_of_block = held_items


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps ``items_of_block`` when ``ray_executor`` is imported (by an actor unpickling its
    class), so that the job's other workers (Ray Data's own actors) do not import torch."""

    def find_spec(self, name, path, target=None):
        if name != _PATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _wrap_items_of_block(module)

        spec.loader.exec_module = exec_module
        return spec


def hold_blocks() -> None:
    """Ray's ``worker_process_setup_hook`` of :func:`hold_runtime_env` (runs once in every
    worker of the job as it starts)."""
    if _PATCHED in sys.modules:
        _wrap_items_of_block(sys.modules[_PATCHED])
    else:
        sys.meta_path.insert(0, _WrapOnImport())


# --------------------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    """``crash MODE:N -- ARGV`` or ``ray-hold DIR -- ARGV`` (module docstring)."""
    if len(argv) < 3 or argv[0] not in ("crash", "ray-hold") or argv[2] != "--":
        print("usage: python tests/_faults.py crash MODE:N|ray-hold DIR -- ARGV...",
              file=sys.stderr)
        return 2
    what, arg, rest = argv[0], argv[1], argv[3:]
    if what == "crash":
        install_crash(arg)
        from icqs_fast.cli import main as cli_main

        return cli_main(rest)
    import ray
    from _ray_cli import main as ray_main

    # The job's runtime env is fixed when the driver connects: connect here, with the holds;
    # run_ray then uses this connection.
    address = rest[rest.index("--address") + 1] if "--address" in rest else None
    ray.init(address=address, include_dashboard=False, log_to_driver=False,
             runtime_env=hold_runtime_env(arg))
    return ray_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
