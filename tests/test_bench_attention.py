"""``icqs-fast bench attention`` on a tiny random Llama: the record's fields and types, our
entropies against the float64 entropies of eager ``output_attentions``, the record's arithmetic
(times, speedup, memory fields) on known inputs, and the peak-memory measurement against known
allocations.

No test compares a field with a ratio of the record's own rounded fields, and none asserts on
wall-clock time: timings are only checked for type, and the arithmetic is checked with the
timer and the memory subprocesses replaced by known values.
"""

import argparse
import contextlib
import io
import json

import pytest
import torch

from icqs_fast import backends
from icqs_fast.benchmarks import attention as bench_attention
from icqs_fast.benchmarks import peak_growth_mb
from icqs_fast.cli import bench_attention as cli_bench_attention

FIELDS = ("model", "device", "seq_len", "time_ms", "eager_ms", "speedup", "peak_mem_mb",
          "eager_peak_mem_mb", "mem_ratio", "max_abs_err")
ARGS = ["bench", "attention", "--json", "--random-weights", "--config", "tiny", "--seq-len", "64",
        "--repeat", "1", "--device", "cpu", "--no-memory"]
MiB = 2**20


@pytest.fixture
def one_thread():
    # The shared 2-core machine is much faster with one torch thread.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def record():
    from icqs_fast.cli import main

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(ARGS)
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    return json.loads(buf.getvalue())


def test_record_fields_and_accuracy(record):
    """The CLI record: every field with its type, the settings echoed, and our entropies within
    1e-4 of the float64 entropies of eager's attention matrices (an independent computation)."""
    for key in FIELDS:
        assert key in record, key
    assert record["model"] == "random-tiny"
    assert record["device"] == "cpu" and record["seq_len"] == 64 and record["dtype"] == "float32"
    assert record["instruction_tokens"] == 32 and record["response_tokens"] == 32
    assert record["layers"] == 2 and record["heads"] == 4 and record["repeat"] == 1
    for key in ("time_ms", "eager_ms", "speedup"):
        assert isinstance(record[key], float), key
    # --no-memory: the memory fields are absent values, not zeros that look like measurements.
    assert record["peak_mem_mb"] is None and record["eager_peak_mem_mb"] is None
    assert record["mem_ratio"] is None
    # A float64 reference of the same model: a wrong renormalisation, key range, head or layer
    # order gives errors of order 0.1-1 nats.
    assert isinstance(record["max_abs_err"], float) and record["max_abs_err"] < 1e-4
    # Ours ran on "auto"'s backend; off the torch backend it is compared with it, side by side.
    assert record["backend"] == ("cpp" if backends.available("cpp")[0] else "torch")
    if record["backend"] == "torch":
        assert record["torch_backend_ms"] is None and record["backend_max_diff"] is None
    else:
        assert isinstance(record["torch_backend_ms"], float)
        assert isinstance(record["backend_speedup"], float)
        assert record["backend_max_diff"] < 1e-4
    assert isinstance(record["commit"], str) and len(record["commit"]) == 40
    assert record["date"].endswith("+00:00") and record["cpu_count"] >= 1


def test_record_arithmetic_on_known_inputs(monkeypatch, one_thread):
    """With the timer and the memory subprocesses replaced by known values, the record reports
    them in the right fields with the right ratios (eager / ours, both for time and memory)."""
    calls = []

    def fake_times(fns, repeat, device):
        for f in fns:  # every side still runs
            f()
        return [2.0, 5.0, 8.0][:len(fns)]

    def fake_peak(side, seq_len, device, random_weights=False, config="tiny"):
        calls.append((side, seq_len, device, random_weights, config))
        return {"ours": 3.04, "eager": 12.16}[side]

    monkeypatch.setattr(bench_attention, "alternated", fake_times)
    monkeypatch.setattr(bench_attention, "peak_in_fresh_process", fake_peak)
    rec = bench_attention.bench(8, 1, torch.device("cpu"), measure_memory=True,
                                random_weights=True, config="tiny")
    assert (rec["time_ms"], rec["eager_ms"], rec["speedup"]) == (2.0, 5.0, 2.5)
    if rec["backend"] != "torch":  # the third side: ours on the torch backend
        assert (rec["torch_backend_ms"], rec["backend_speedup"]) == (8.0, 4.0)
    assert (rec["peak_mem_mb"], rec["eager_peak_mem_mb"], rec["mem_ratio"]) == (3.0, 12.2, 4.0)
    assert sorted(calls) == [("eager", 8, "cpu", True, "tiny"), ("ours", 8, "cpu", True, "tiny")]
    assert rec["max_abs_err"] < 1e-4


@pytest.mark.subprocess
def test_peak_growth_measures_known_allocations():
    """The memory reading used by every benchmark, against allocations of known size. The
    sizes are above glibc's largest mmap threshold (32 MiB), so each is fresh pages: the reading
    is the allocation plus a few MiB, whatever else the machine is doing. Also: the peak is
    reset before each call (a larger earlier peak does not leak in), and it is the peak, not the
    final RSS (the tensors are freed before the function returns)."""
    def alloc(mib):
        return lambda: float(torch.ones(mib * MiB // 4).sum())

    import ctypes

    # Free heap memory earlier tests left resident (glibc keeps it; malloc can serve even a
    # 48 MiB block from it with no new page) goes back to the kernel first, so every byte of
    # the allocation is a fresh page: in a full run this test read 0.0 MiB for 48 MiB without.
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    big = torch.ones(256 * MiB // 4)  # an earlier, larger peak of this process
    del big
    for mib in (48, 144):
        trim(0)
        got, val = peak_growth_mb(alloc(mib), "cpu")
        assert val == mib * MiB // 4
        assert mib - 1 <= got <= mib + 8, (mib, got)
    got, _ = peak_growth_mb(lambda: None, "cpu")
    assert got < 4


@pytest.mark.subprocess
def test_eager_peak_holds_its_attention_matrices(monkeypatch):
    """The benchmark's per-side memory measurement on a case with a known lower bound: eager with
    ``output_attentions`` returns 2 layers x [1, 4 heads, T, T] fp32 matrices (72 MiB at
    T = 1536); ours never builds them and needs a small fraction. Each side runs in a fresh
    interpreter, as in the benchmark: in this process, pages earlier tests left to glibc could
    hold the matrices unseen (a full CI run read 12.9 MiB)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the 2-core machine is faster with one thread
    t = 1536
    eager = bench_attention.peak_in_fresh_process("eager", t, "cpu", True, "tiny")
    ours = bench_attention.peak_in_fresh_process("ours", t, "cpu", True, "tiny")
    matrices = 2 * 4 * t * t * 4 / MiB
    assert eager >= matrices, (eager, matrices)
    assert ours < eager / 4, (ours, eager)


def test_arguments_and_bad_settings():
    p = argparse.ArgumentParser()
    cli_bench_attention.add_arguments(p)
    a = p.parse_args(ARGS[2:])
    assert (a.json, a.random_weights, a.config, a.seq_len, a.repeat, a.no_memory) == \
        (True, True, "tiny", 64, 1, True)
    d = p.parse_args([])
    assert (d.seq_len, d.random_weights, d.no_memory) == (1024, False, False)
    with pytest.raises(ValueError, match="seq_len"):
        bench_attention.bench(1, 1, torch.device("cpu"), measure_memory=False,
                              random_weights=True)
    with pytest.raises(ValueError, match="repeat"):
        bench_attention.bench(8, 0, torch.device("cpu"), measure_memory=False,
                              random_weights=True)


def test_lse_section(one_thread):
    """``--lse``: the cpp attention_lse against the cascade's torch path, per key count, dtype and
    thread count, with the two sides' differences checked; a failing difference is reported, a
    bad list is an error naming its flag."""
    from icqs_fast.backends import cpp_backend

    if not cpp_backend.available()[0]:
        pytest.skip("cpp backend unavailable")
    sec = bench_attention.lse_section([70], [1], 1)
    assert [(c["dtype"], c["keys"], c["threads"]) for c in sec["cases"]] == \
        [("float32", 70, 1), ("bfloat16", 70, 1)]
    for c in sec["cases"]:
        assert c["shape"] == [2, 4, 512, 70, 64]
        assert c["cpp_ms"] > 0 and c["torch_ms"] > 0
        # The ratio of the unrounded times: the rounded ms fields reproduce it to their rounding.
        assert c["speedup"] == pytest.approx(c["torch_ms"] / c["cpp_ms"], rel=0.01, abs=2e-3)
        assert c["max_out_diff"] <= bench_attention.LSE_TOL[c["dtype"]]
    assert bench_attention.lse_failures(sec) == []
    bad = {"cases": [dict(sec["cases"][0], max_out_diff=0.5)]}
    assert bench_attention.lse_failures(bad) == \
        ["attention_lse.cases[0].max_out_diff = 0.5 (want <= 0.0001)"]
    with pytest.raises(ValueError, match="--lse-keys must be a comma-separated list"):
        bench_attention._int_list("12,x", "--lse-keys")


def test_entropy_op_section(one_thread, monkeypatch):
    """``--entropy-op``: ops.attention_entropy's cpp backend against its torch backend per token
    count and thread count, the two sides' differences checked; a failing one is reported; the
    CLI adds the section and its list flag is checked."""
    from icqs_fast.backends import cpp_backend

    if not cpp_backend.available()[0]:
        pytest.skip("cpp backend unavailable")
    sec = bench_attention.entropy_op_section([37, 64], [1], 1)
    assert [(c["tokens"], c["threads"]) for c in sec["cases"]] == [(37, 1), (64, 1)]
    for c in sec["cases"]:
        assert c["shape"] == [1, 9, 3, c["tokens"], 64]
        assert c["cpp_ms"] > 0 and c["torch_ms"] > 0
        assert c["speedup"] == pytest.approx(c["torch_ms"] / c["cpp_ms"], rel=0.01, abs=2e-3)
        assert c["max_entropy_diff"] <= 1e-5 and c["max_out_diff"] <= 1e-5
    assert bench_attention.entropy_op_failures(sec) == []
    bad = {"cases": [dict(sec["cases"][1], max_entropy_diff=0.5)]}
    assert bench_attention.entropy_op_failures(bad) == \
        ["attention_entropy_op.cases[0].max_entropy_diff = 0.5 (want <= 0.0001)"]
    from icqs_fast.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(ARGS + ["--entropy-op", "--entropy-op-tokens", "40", "--lse-threads", "1"]) == 0
    rec = json.loads(buf.getvalue())
    assert [c["tokens"] for c in rec["attention_entropy_op"]["cases"]] == [40]
    # A bad list is refused before anything is measured.
    monkeypatch.setattr(bench_attention, "bench", lambda *a, **k: pytest.fail("measured"))
    err = io.StringIO()
    for flag in ("--entropy-op-tokens", "--lse-keys", "--lse-threads"):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert main(ARGS + ["--entropy-op", "--lse", flag, "0"]) == 2
        assert f"{flag} must be a comma-separated list" in err.getvalue()
