"""The thread policy (icqs_fast/threads.py) on mocked /proc/stat readings, affinities and
environments: the default is the cores other processes leave free, an explicit count or
OMP_NUM_THREADS is kept, and the OpenMP wait settings never override the user's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from icqs_fast import threads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _stat(tmp_path, busy: int, idle: int, name: str = "stat") -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice
    p = tmp_path / name
    p.write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 50 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return str(p)


def test_cpu_times_reads_the_all_cores_line(tmp_path):
    assert threads._cpu_times(_stat(tmp_path, 300, 700)) == (300.0, 1000.0)  # guest not added
    assert threads._cpu_times(str(tmp_path / "missing")) is None
    bad = tmp_path / "bad"
    bad.write_text("intr 1 2 3\n")
    assert threads._cpu_times(str(bad)) is None


def _sampler(readings, own=(0.0, 0.0)):
    it, cpu = iter(readings), iter(own)
    return dict(read=lambda: next(it), own_cpu=lambda: next(cpu), sleep=lambda s: None)


def test_busy_cores_of_others_leave_out_our_own_time(monkeypatch):
    monkeypatch.setattr(threads, "_clock_ticks", lambda: 100.0)
    # 2 cores, 1 s sample = 200 jiffies; 100 busy: one core's worth, none of it ours.
    got = threads.busy_cpus_of_others(ncpu=2, **_sampler([(0, 0), (100, 200)]))
    assert got == pytest.approx(1.0)
    # The same, but this process used 0.6 s of CPU itself: 0.4 cores were others'.
    got = threads.busy_cpus_of_others(ncpu=2, **_sampler([(0, 0), (100, 200)], (1.0, 1.6)))
    assert got == pytest.approx(0.4)
    # Unreadable /proc/stat, or a clock that did not move: unknown.
    assert threads.busy_cpus_of_others(ncpu=2, **_sampler([None, None])) is None
    assert threads.busy_cpus_of_others(ncpu=2, **_sampler([(5, 9), (5, 9)])) is None


@pytest.mark.parametrize(("allowed", "busy", "want"), [
    (2, 0.0, 2),    # alone: every core, torch's old default
    (2, 0.3, 2),    # a little background work does not cost a core
    (2, 0.9, 1),    # another job on one core
    (2, 2.0, 1),    # machine full: still one thread
    (16, 3.4, 13),
    (1, 0.0, 1),
])
def test_free_cpus(allowed, busy, want):
    assert threads.free_cpus(allowed, busy) == want


def test_free_cpus_samples_when_not_told(monkeypatch):
    monkeypatch.setattr(threads, "allowed_cpus", lambda: 4)
    monkeypatch.setattr(threads, "busy_cpus_of_others", lambda: 2.2)
    assert threads.free_cpus() == 2
    monkeypatch.setattr(threads, "busy_cpus_of_others", lambda: None)  # unknown: no load
    assert threads.free_cpus() == 4


def test_apply_threads(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "free_cpus", lambda: 1)
    assert threads.apply_threads(None) == 1 and torch.get_num_threads() == 1
    assert threads.apply_threads(2) == 2 and torch.get_num_threads() == 2  # explicit: kept
    # OMP_NUM_THREADS set: torch already follows it; the policy leaves it alone.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "free_cpus", lambda: pytest.fail("sampled"))
    assert threads.apply_threads(None) == 2
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            threads.apply_threads(bad)


_FAULTS = """
import ctypes, ctypes.util, resource, sys
from icqs_fast import threads
print(threads.prepare_malloc({}) if sys.argv[1] == "set" else None)
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.free(libc.malloc(6 << 20))  # glibc's adaptive thresholds: mmap above 6 MiB, trim above 12
faults = []
for _ in range(12):  # a forward's activations: 4 blocks of 4 MiB, written, then freed
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(4 << 20) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(min(faults[2:]), max(faults[2:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_prepare_malloc_stops_the_page_faults_of_each_forward():
    """glibc alone hands a forward's 16 MiB of freed activations back to the kernel (its
    adaptive trim threshold is twice the largest block it mapped) and faults all 4,096 pages
    in again at the next forward; after prepare_malloc the heap keeps them. The allocator is
    driven directly, without torch: torch's own allocations before the loop change glibc's
    adaptive thresholds from one process to the next. A policy of the user's stands."""
    runs = {}
    for mode in ("default", "set"):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        runs[mode] = out.stdout.split()
    assert runs["set"][0] == "True"
    assert int(runs["set"][2]) < 50 < int(runs["default"][1]), runs
    for name in threads.MALLOC_ENV:
        assert threads.prepare_malloc({name: "x"}) is False


def test_prepare_openmp_keeps_the_users_settings():
    env: dict[str, str] = {}
    assert threads.prepare_openmp(env) == {"GOMP_SPINCOUNT": threads.SPIN_COUNT,
                                           "KMP_BLOCKTIME": threads.KMP_BLOCKTIME}
    assert env == {"GOMP_SPINCOUNT": threads.SPIN_COUNT, "KMP_BLOCKTIME": threads.KMP_BLOCKTIME}
    env = {"GOMP_SPINCOUNT": "5"}
    threads.prepare_openmp(env)
    assert env == {"GOMP_SPINCOUNT": "5", "KMP_BLOCKTIME": threads.KMP_BLOCKTIME}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.prepare_openmp(env) == {} and env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_allowed_cpus_follows_the_affinity(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert threads.allowed_cpus() == 3

    def no_affinity(pid):
        raise OSError("not here")

    monkeypatch.setattr(threads.os, "sched_getaffinity", no_affinity)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 6)
    assert threads.allowed_cpus() == 6


def test_governor_follows_the_free_cores_between_forwards(restore_threads):
    """The sampler's readings set ``desired``; the forward pre-hook applies it on the
    forward's thread, and stops for good once someone else has set the count."""
    torch.set_num_threads(2)
    gov = threads.ThreadGovernor(allowed=2, current=2)
    gov.update(1.0)  # another job took a core
    assert gov.desired == 1 and torch.get_num_threads() == 2  # nothing until a forward
    gov.before_forward(None, ())
    assert torch.get_num_threads() == 1 and gov.last_set == 1
    gov.update(None)  # an unreadable sample changes nothing
    gov.update(0.1)  # the other job ended
    gov.before_forward(None, ())
    assert torch.get_num_threads() == 2
    # A caller sets its own count: the governor leaves it and stops.
    torch.set_num_threads(1)
    gov.update(1.0)
    gov.before_forward(None, ())
    assert gov.stopped.is_set()
    gov.update(0.0)  # even when cores free up later
    gov.before_forward(None, ())
    assert torch.get_num_threads() == 1


def test_governor_runs_as_a_hook_and_a_thread(restore_threads):
    """Started for real (a sampler that reports a busy machine at once): the next module
    forward drops the count; stop() removes the hook and ends the thread."""
    torch.set_num_threads(2)
    seen = []

    def sample(seconds):
        seen.append(seconds)
        gov.stopped.wait(0.01)
        return 1.6

    gov = threads.ThreadGovernor(allowed=2, current=2, interval=0.01, sample=sample)
    gov.start()
    try:
        for _ in range(500):
            if gov.desired == 1:
                break
            gov.stopped.wait(0.01)
        torch.nn.Identity()(torch.zeros(1))
        assert torch.get_num_threads() == 1
    finally:
        gov.stop()
    assert gov._hook is None and seen[0] == 0.01


def test_only_the_entry_point_governs(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "free_cpus", lambda: 1)
    monkeypatch.setitem(threads._GOVERN, "enabled", False)
    monkeypatch.setitem(threads._GOVERN, "governor", None)
    threads.apply_threads(None)
    assert threads._GOVERN["governor"] is None  # a library call: no governor
    started = []
    monkeypatch.setattr(threads.ThreadGovernor, "start", lambda self: started.append(self))
    threads.enable_governor()
    threads.apply_threads(None)
    threads.apply_threads(None)
    assert len(started) == 1 and threads._GOVERN["governor"] is started[0]
    threads.apply_threads(1)  # an explicit count never starts one
    assert len(started) == 1


class _PolicyCalled(Exception):
    """Raised by the patched policy: the entry point reached it (and stops there, cheaply)."""


def _record_policy(monkeypatch, name="apply_threads"):
    """Patch ``threads.<name>`` to record its arguments and stop the caller."""
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        raise _PolicyCalled

    monkeypatch.setattr(threads, name, fake)
    return calls


def test_job_threads_govern_outside_the_cli(monkeypatch, restore_threads):
    """apply_job_threads (the lm-eval backend's entry): the free-core default and a governor,
    though icqs-fast's CLI did not enable it; an explicit count is kept and starts none."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "free_cpus", lambda: 1)
    monkeypatch.setitem(threads._GOVERN, "enabled", False)
    monkeypatch.setitem(threads._GOVERN, "governor", None)
    started = []
    monkeypatch.setattr(threads.ThreadGovernor, "start", lambda self: started.append(self))
    assert threads.apply_job_threads(2) == 2 and not started
    assert threads.apply_job_threads(None) == 1 and torch.get_num_threads() == 1
    assert len(started) == 1 and threads._GOVERN["enabled"] is False


@pytest.mark.parametrize("argv", [["bench", "kernels", "--quick", "--no-cuda"],
                                  ["bench", "icqs", "--no-memory"],
                                  ["bench", "icqs", "--inputs", "long", "--no-memory"]])
def test_bench_entry_points_take_the_policy(argv, monkeypatch):
    """bench kernels / icqs / icqs --inputs long: a default run asks the policy (None: the free
    cores), before any timing."""
    from icqs_fast import cli

    calls = _record_policy(monkeypatch)
    with pytest.raises(_PolicyCalled):
        cli.main(argv)
    assert calls and calls[0][0][0] is None


def test_lm_eval_backend_takes_the_policy(monkeypatch):
    """The lm-eval backend that loads its own model (lm-eval's CLI) takes the job policy with
    its ``threads`` model argument; with a given model and no ``threads`` it leaves the
    caller's count alone."""
    pytest.importorskip("lm_eval")
    from icqs_fast.compat.lm_eval import ICQSFastLM

    calls = _record_policy(monkeypatch, "apply_job_threads")
    with pytest.raises(_PolicyCalled):
        ICQSFastLM("embedded")
    with pytest.raises(_PolicyCalled):
        ICQSFastLM("embedded", threads=3)
    assert [c[0][0] for c in calls] == [None, 3]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(Exception) as err:  # past the policy (no tokenizer to speak of)
        ICQSFastLM(model=model, tokenizer=object())
    assert not isinstance(err.value, _PolicyCalled) and len(calls) == 2


def _threads_declarations(root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(hand-written ``add_argument("--threads", ...)`` calls, ``option(...)`` declarations of a
    ``threads`` field or of the flag) across ``root``'s icqs_fast/ and bench/."""
    import ast

    by_hand, declared = [], []
    for p in [*sorted((root / "icqs_fast").rglob("*.py")), *sorted((root / "bench").rglob("*.py"))]:
        where = str(p.relative_to(root))
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "add_argument" and any(
                        isinstance(a, ast.Constant) and a.value == "--threads" for a in node.args):
                by_hand.append(f"{where}:{node.lineno}")
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "option" \
                            and "threads" in node.name:
                        declared.append(f"{where}:{call.lineno}")
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "threads" \
                    and isinstance(node.value, ast.Call) \
                    and getattr(node.value.func, "id", None) == "option":
                declared.append(f"{where}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "option" and any(
                    k.arg == "flag" and isinstance(k.value, ast.Constant)
                    and k.value.value == "--threads" for k in node.keywords):
                declared.append(f"{where}:{node.lineno}")
    return by_hand, sorted(set(declared))


def test_threads_is_declared_once():
    """One declaration of --threads (threads.threads_option) for the jobs, every other command
    and the bench scripts: no add_argument("--threads") written by hand anywhere."""
    by_hand, declared = _threads_declarations()
    assert by_hand == [], by_hand
    assert len(declared) == 1 and declared[0].startswith("icqs_fast/threads.py:"), declared
    # The jobs' field is that declaration.
    from icqs_fast.jobs.config import JobConfig
    from icqs_fast.options import declaration

    assert declaration(JobConfig, "threads").option == declaration(
        threads.ThreadOptions, "threads").option


def test_the_check_finds_a_hand_written_threads_flag(tmp_path):
    """The scan itself can fail: a bench script declaring --threads by hand is named."""
    (tmp_path / "icqs_fast").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text(
        'import argparse\np = argparse.ArgumentParser()\np.add_argument("--threads", type=int)\n')
    by_hand, declared = _threads_declarations(tmp_path)
    assert by_hand == ["bench/x.py:3"] and declared == []


@pytest.mark.parametrize("argv", [
    ["audit", "--task", "summeval", "--debias", "--data", "{data}", "--threads", "1"],
    ["eval", "sst2", "--data", "{data}", "--threads", "1"]])
def test_a_commands_threads_reach_torch(argv, tmp_path, capsys, monkeypatch, restore_threads):
    """audit and eval (which once called torch.set_num_threads themselves) apply --threads
    through the one policy: the count is in force before their input is read (an empty data
    file: exit 2 after it); without the flag, the policy's default (the free cores)."""
    from icqs_fast import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    data = tmp_path / "data.jsonl"
    data.write_text("")
    argv = [a.format(data=data) for a in argv]
    torch.set_num_threads(2)
    assert cli.main(argv) == 2
    assert torch.get_num_threads() == 1
    assert "error" in capsys.readouterr().err
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "free_cpus", lambda: 1)
    assert cli.main(argv[:-2]) == 2 and torch.get_num_threads() == 1
