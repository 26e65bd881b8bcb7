"""Crash-safe resume, proven: ``icqs-fast score`` (and ``icqs-fast features``, at the end) runs
in a separate process that is SIGKILLed at seeded points (between records, in the middle of
writing a line, during a resumed run, and from outside while it holds the output lock), is
resumed with ``--resume``, and must end with the records of an uninterrupted run: same
records in the same order, none lost, none duplicated. ``features`` resumes at the start of the
cut chunk, so its records are batched as before: exactly the uninterrupted run's bytes. ``score``
packs the records after the resume point into other forwards than before, which moves fp32 sums
by a few ulps: the same fields and values, floats within rounding.

Kill points are chosen by records written, through the crash patch of tests/_faults.py (the
process kills itself at the chosen write of its result writer), never by wall time, so every run
is killed where the seed says on however busy a machine. The lock test's first writer is the
command line in a new interpreter (``python tests/_faults.py crash hold:1 -- score ...``), killed
from outside; the other killed runs are ``icqs_fast.cli.main(argv)`` in processes forked from a
multiprocessing fork server that imported torch and transformers once (a fresh interpreter spends
~10 s of CPU importing them on this machine, a forked run ~1.7 s in all); the resumes run in this
process.
"""

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import pytest

# What a killed run imports, imported here so the fork server (which imports this module) holds it.
import transformers.models.llama.modeling_llama  # noqa: F401
from _faults import ENTRY, install_crash
from _helpers import assert_same_lines

from icqs_fast.cli import main

pytestmark = pytest.mark.subprocess

GOOD = [{"x": f"profit rose {i}%", "y": "positive"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "negative"} for i in range(3)]
BAD = [{"x": f"profit rose {i}%", "y": "negative"} for i in range(3)] + [
    {"x": f"loss widened by {i} million", "y": "positive"} for i in range(3)]
N = 8
RESPONSES = [{"id": f"r{i}", "x": f"sales up {i}%", "y": ["positive", "negative"][i % 2]}
             for i in range(N)]
# Small forwards (a few responses each), so a run writes its records one forward at a time and
# a kill lands while later records are still being computed.
KW = ["--num-ratios", "3", "--demos-per-set", "2", "--sets-per-ratio", "2", "--seed", "1",
      "--token-budget", "200", "--dtype", "float32", "--device", "cpu", "--quiet"]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("crash")
    model_dir = tiny_llama_dir()
    good = _jsonl(d / "good.jsonl", GOOD)
    bad = _jsonl(d / "bad.jsonl", BAD)
    return d, model_dir, good, bad


def _args(setup, inp, out, *extra):
    _, model_dir, good, bad = setup
    return ["score", str(inp), "-o", str(out), "--good", str(good), "--bad", str(bad),
            "--model", str(model_dir), *KW, *extra]


_SERVER = None


def _server():
    """A fork server with icqs-fast, torch and transformers' Llama imported (started once)."""
    global _SERVER
    if _SERVER is None:
        _SERVER = multiprocessing.get_context("forkserver")
        _SERVER.set_forkserver_preload(["test_resume_crash"])
    return _SERVER


def _child(argv, crash, err_path):
    # Fresh process forked from the server: its own stderr file, the crash patch, the CLI.
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    if crash is not None:
        install_crash(crash)
    os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main(argv))


class _Run:
    """One ``icqs-fast score`` in its own process; ``wait()`` gives (exit code, stderr).
    ``fresh``: a new interpreter (``python -m icqs_fast.cli``, or ``python tests/_faults.py
    crash ...`` with a crash) instead of a fork-server child."""

    def __init__(self, setup, inp, out, crash, *extra, fresh=False, argv_of=None):
        self.err = f"{out}.{time.monotonic_ns()}.stderr"
        argv = (argv_of or _args)(setup, inp, out, *extra)
        if fresh:
            env = dict(os.environ, TRITON_INTERPRET="1")
            cmd = ["-m", "icqs_fast.cli"] if crash is None else [ENTRY, "crash", crash, "--"]
            with open(self.err, "w") as err:
                self.proc = subprocess.Popen([sys.executable, *cmd, *argv],
                                             env=env, stdout=subprocess.DEVNULL, stderr=err)
        else:
            self.proc = _server().Process(target=_child, args=(argv, crash, self.err))
            self.proc.start()
        self.pid = self.proc.pid

    def wait(self, timeout=300):
        if isinstance(self.proc, subprocess.Popen):
            code = self.proc.wait(timeout)
        else:
            self.proc.join(timeout)
            code = self.proc.exitcode
        assert code is not None, "the run did not end"
        with open(self.err, encoding="utf-8") as f:
            return code, f.read()

    def running(self):
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll() is None
        return self.proc.is_alive()

    def kill(self):
        if self.running():
            os.kill(self.pid, signal.SIGKILL)


def _spawn(setup, inp, out, crash, *extra, fresh=False, argv_of=None):
    return _Run(setup, inp, out, crash, *extra, fresh=fresh, argv_of=argv_of)


def _killed_at(setup, inp, out, crash, *extra, argv_of=None):
    """Run until the crash patch kills the process; check that it died by SIGKILL."""
    code, err = _spawn(setup, inp, out, crash, *extra, argv_of=argv_of).wait()
    assert code == -signal.SIGKILL, (crash, code, err[-2000:])


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


@pytest.fixture(scope="module")
def reference(setup):
    """Uninterrupted runs (in this process), stop and skip mode."""
    d = setup[0]
    inp = _jsonl(d / "in.jsonl", RESPONSES)
    out = d / "ref.jsonl"
    assert main(_args(setup, inp, out)) == 0
    rows = [json.dumps(r) for r in RESPONSES]
    rows[3] = '{"id": "r3", "x": "cut off'  # truncated JSON
    rows[6] = json.dumps({"id": "r6", "x": "a"})  # no y
    skip_inp = _jsonl(d / "in_skip.jsonl", rows)
    skip_out = d / "ref_skip.jsonl"
    assert main(_args(setup, skip_inp, skip_out, "--on-error", "skip")) == 0
    return inp, out.read_bytes(), skip_inp, skip_out.read_bytes()


def _check_same(out, ref: bytes, exact: bool = False):
    got = out.read_bytes()
    idx = [json.loads(line)["index"] for line in got.splitlines()]
    assert idx == list(range(N)), idx  # nothing lost, nothing duplicated, in order
    if exact:  # the same batches as the uninterrupted run: the same bytes
        assert got == ref
    else:
        assert got.endswith(b"\n")
        assert_same_lines(map(json.loads, got.splitlines()), map(json.loads, ref.splitlines()))


def _resume_adds_nothing(out, argv):
    """Resuming a finished output leaves it byte for byte as it is."""
    done = out.read_bytes()
    assert main(argv) == 0
    assert out.read_bytes() == done


def _kill_points(seed):
    r = random.Random(seed)
    return r.choice(["before", "mid"]), r.randrange(1, N - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_score_killed_then_resumed_equals_uninterrupted(setup, reference, tmp_path, seed):
    inp, ref, _, _ = reference
    out = tmp_path / "out.jsonl"
    mode, n = _kill_points(seed)
    if seed == 0:
        mode = "mid"  # at least one kill in the middle of a write, whatever the draw
    _killed_at(setup, inp, out, f"{mode}:{n}")
    lines = _lines(out)
    complete = [ln for ln in lines if ln.endswith(b"\n")]
    assert len(complete) == n  # every record before the kill point is on disk
    assert [json.loads(ln)["index"] for ln in complete] == list(range(n))
    if mode == "mid":
        assert not lines[-1].endswith(b"\n") and len(lines) == n + 1  # half a line
    else:
        assert len(lines) == n
    if seed == 2:
        # Killed again while resuming (mid-write of its 2nd record), then resumed once more.
        _killed_at(setup, inp, out, "mid:1", "--resume")
        assert not _lines(out)[-1].endswith(b"\n")
    assert main(_args(setup, inp, out, "--resume")) == 0
    _check_same(out, ref)
    _resume_adds_nothing(out, _args(setup, inp, out, "--resume"))


def test_skip_mode_killed_then_resumed(setup, reference, tmp_path):
    """With --on-error skip a bad record's line keeps its place: killed while writing it
    (write 3 is the line of the skipped record 3), the resumed output has each record once
    and the skipped ones are neither redone nor lost."""
    _, _, inp, ref = reference
    out = tmp_path / "out.jsonl"
    _killed_at(setup, inp, out, "mid:3", "--on-error", "skip")
    assert [json.loads(ln)["index"] for ln in _lines(out)[:3]] == [0, 1, 2]
    assert main(_args(setup, inp, out, "--resume", "--on-error", "skip")) == 0
    _check_same(out, ref)
    rows = [json.loads(line) for line in ref.splitlines()]
    assert [r["index"] for r in rows if "error" in r] == [3, 6]
    assert rows[6]["error"] == {"field": "y", "reason": "missing (this record's keys: id, x)"}


def test_second_writer_refused_and_lock_released_on_crash(setup, reference, tmp_path):
    """Two processes on one output: the second refuses at once, naming the first one's pid;
    the first, SIGKILLed from outside while it holds the lock, leaves no lock behind."""
    inp, ref, _, _ = reference
    out = tmp_path / "out.jsonl"
    # The first writer is the real command line in a new interpreter; it writes 2 records, then
    # waits to be killed.
    first = _spawn(setup, inp, out, "hold:1", fresh=True)
    try:
        deadline = time.monotonic() + 300
        while len(_lines(out) if out.exists() else []) < 2:
            assert first.running(), first.wait()[1][-2000:]
            assert time.monotonic() < deadline, "the first writer never wrote 2 records"
            time.sleep(0.1)
        code, err = _spawn(setup, inp, out, None, "--resume").wait()
        assert code == 2, err
        assert (f"icqs-fast: error: {out} is being written by another icqs-fast process "
                f"(pid {first.pid}; lock {out}.lock)") in err
        assert len(_lines(out)) == 2  # the refused process touched nothing
    finally:
        first.kill()
        code, _ = first.wait(60)
    assert code == -signal.SIGKILL
    assert main(_args(setup, inp, out, "--resume")) == 0
    _check_same(out, ref)


# --------------------------------------------------------------------------- icqs-fast features
# The same kills, resumes and lock for the glass-box command. Chunks of 3 records (one glassbox
# call each, in batches of 2), so kills land inside a chunk and the resume recomputes it.
FKW = ["--features", "sent_logprob,softmax_ent,softmax_combo,attn_ent_avg", "--batch-size", "2",
       "--chunk-size", "3", "--dtype", "float32", "--device", "cpu", "--quiet"]


def _fargs(setup, inp, out, *extra):
    return ["features", str(inp), "-o", str(out), "--model", str(setup[1]), *FKW, *extra]


@pytest.fixture(scope="module")
def freference(setup, reference):
    """Uninterrupted ``features`` runs (in this process) on the same inputs, stop and skip."""
    inp, _, skip_inp, _ = reference
    d = setup[0]
    out, skip_out = d / "fref.jsonl", d / "fref_skip.jsonl"
    assert main(_fargs(setup, inp, out)) == 0
    assert main(_fargs(setup, skip_inp, skip_out, "--on-error", "skip")) == 0
    return inp, out.read_bytes(), skip_inp, skip_out.read_bytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_features_killed_then_resumed_equals_uninterrupted(setup, freference, tmp_path, seed):
    inp, ref, _, _ = freference
    out = tmp_path / "out.jsonl"
    mode, n = _kill_points(seed + 10)
    if seed == 0:
        mode = "mid"
    _killed_at(setup, inp, out, f"{mode}:{n}", argv_of=_fargs)
    lines = _lines(out)
    complete = [ln for ln in lines if ln.endswith(b"\n")]
    assert [json.loads(ln)["index"] for ln in complete] == list(range(n))
    assert len(lines) == n + (mode == "mid")
    if seed == 2:
        _killed_at(setup, inp, out, "before:1", "--resume", argv_of=_fargs)
        assert len(_lines(out)) == n + 1  # the resume wrote one more record, then died
    assert main(_fargs(setup, inp, out, "--resume")) == 0
    _check_same(out, ref, exact=True)
    _resume_adds_nothing(out, _fargs(setup, inp, out, "--resume"))


def test_features_skip_mode_killed_then_resumed(setup, freference, tmp_path):
    _, _, inp, ref = freference
    out = tmp_path / "out.jsonl"
    _killed_at(setup, inp, out, "mid:3", "--on-error", "skip", argv_of=_fargs)
    assert [json.loads(ln)["index"] for ln in _lines(out)[:3]] == [0, 1, 2]
    assert main(_fargs(setup, inp, out, "--resume", "--on-error", "skip")) == 0
    _check_same(out, ref, exact=True)
    rows = [json.loads(line) for line in ref.splitlines()]
    assert [r["index"] for r in rows if "error" in r] == [3, 6]
    assert all("sent_logprob" in r for r in rows if "error" not in r)
    # A resume in stop mode passes the skipped lines already there (they are not redone).
    out.write_bytes(b"".join(ref.splitlines(keepends=True)[:5]))
    assert main(_fargs(setup, inp, out, "--resume")) == 2  # record 6 is bad: stops there
    assert out.read_bytes() == b"".join(ref.splitlines(keepends=True)[:6])


def test_features_second_writer_refused_and_lock_released_on_crash(setup, freference, tmp_path):
    inp, ref, _, _ = freference
    out = tmp_path / "out.jsonl"
    first = _spawn(setup, inp, out, "hold:1", argv_of=_fargs)
    try:
        deadline = time.monotonic() + 300
        while len(_lines(out) if out.exists() else []) < 2:
            assert first.running(), first.wait()[1][-2000:]
            assert time.monotonic() < deadline, "the first writer never wrote 2 records"
            time.sleep(0.1)
        code, err = _spawn(setup, inp, out, None, "--resume", argv_of=_fargs).wait()
        assert code == 2, err
        assert (f"icqs-fast: error: {out} is being written by another icqs-fast process "
                f"(pid {first.pid}; lock {out}.lock)") in err
        assert len(_lines(out)) == 2
    finally:
        first.kill()
        code, _ = first.wait(60)
    assert code == -signal.SIGKILL
    assert main(_fargs(setup, inp, out, "--resume")) == 0
    _check_same(out, ref, exact=True)
