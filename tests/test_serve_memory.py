"""The server's allocator trim (:mod:`icqs_fast.serve.memory`): when it trims, and that the
worker calls it between steps with whether the queue went idle."""

import os
import sys

import pytest

from icqs_fast.serve.memory import Trimmer, glibc, malloc_trim
from icqs_fast.serve.queue import WorkQueue

on_glibc = pytest.mark.skipif(glibc() is None, reason="glibc only (malloc_trim)")


def test_glibc_is_found_on_linux_and_nowhere_else():
    if not sys.platform.startswith("linux"):
        assert glibc() is None and malloc_trim() is False
    elif glibc() is not None:
        assert malloc_trim() is True


@on_glibc
def test_trimmer_trims_when_idle_and_at_most_every_period_when_busy(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr("icqs_fast.serve.memory.malloc_trim", lambda: calls.append(1) or True)
    busy = Trimmer(every_s=3600.0)
    for _ in range(5):
        busy(False)  # a busy worker within the period: no trim
    assert calls == [] and busy.trims == 0
    busy(True)  # the queue went idle: at once
    assert calls == [1] and busy.trims == 1
    always = Trimmer(every_s=0.0)
    for _ in range(3):
        always(False)
    assert always.trims == 3 and len(calls) == 4


def test_trimmer_does_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr("icqs_fast.serve.memory._LIBC", [None])
    t = Trimmer(every_s=0.0)
    t(True)
    assert not t.enabled and t.trims == 0


def test_the_worker_calls_between_steps_with_idle_after_the_last():
    seen: list[bool] = []
    q = WorkQueue(lambda p, n: [sum(x) for x in p], batch_wait_s=0.0, chunk_tokens=2,
                  between_steps=seen.append)
    fut = q.submit_logprobs([[1, 1], [2, 2], [3, 3]], 0)  # three chunks: three steps
    q.start()
    try:
        assert fut.result(timeout=10) == [2, 4, 6]
        q.submit_call(lambda: 0).result(timeout=10)
    finally:
        q.stop()
    assert len(seen) == q.steps == 4
    assert seen[:2] == [False, False] and seen[2] is True and seen[3] is True


def test_a_failing_hook_never_stops_the_worker():
    def boom(idle: bool) -> None:
        raise RuntimeError("hook")

    q = WorkQueue(lambda p, n: [0] * len(p), batch_wait_s=0.0, between_steps=boom)
    q.start()
    try:
        assert q.submit_logprobs([[1]], 0).result(timeout=10) == [0]
        assert q.submit_logprobs([[2]], 0).result(timeout=10) == [0]
    finally:
        q.stop()


def test_kernel_caches_are_bounded_unless_the_user_chose(monkeypatch):
    from icqs_fast.models import KERNEL_CACHE_VARIABLES, bound_kernel_caches

    first, second = KERNEL_CACHE_VARIABLES
    monkeypatch.delenv(first, raising=False)
    monkeypatch.setenv(second, "64")  # the user's value stays
    got = bound_kernel_caches(16)
    assert got == {first: "16", second: "64"}
    assert os.environ[first] == "16" and os.environ[second] == "64"


def test_load_model_caps_the_kernel_caches_first(monkeypatch, tmp_path):
    """Every job loads its model through load_model, so every job gets the caps (the varied
    shapes of a score job grow the caches as the server's did)."""
    from _helpers import save_tiny_llama

    from icqs_fast.models import KERNEL_CACHE_ENTRIES, KERNEL_CACHE_VARIABLES, load_model

    for name in KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    load_model(save_tiny_llama(tmp_path), dtype="float32", device="cpu")
    assert all(os.environ[n] == str(KERNEL_CACHE_ENTRIES) for n in KERNEL_CACHE_VARIABLES)
