"""``icqs-fast bench attention --json`` on a tiny random Llama and 64 tokens: every field the issue
lists is present and sane (our entropies agree with eager ``output_attentions``), the peak memory
measured in fresh subprocesses included."""

import argparse
import contextlib
import io
import json
import math

import pytest
import torch

from icqs_fast.benchmarks import attention as bench_attention

FIELDS = ("model", "device", "seq_len", "time_ms", "eager_ms", "speedup", "peak_mem_mb",
          "eager_peak_mem_mb", "mem_ratio", "max_abs_err")
ARGS = ["bench", "attention", "--json", "--random-weights", "--config", "tiny", "--seq-len", "64",
        "--repeat", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def record():
    from icqs_fast.cli import main

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core machine is much faster with one thread
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = main(ARGS)
    except FileNotFoundError as exc:  # the embedded model's tokenizer is needed
        pytest.skip(f"embedded model unavailable: {exc}")
    finally:
        torch.set_num_threads(n)
    assert rc == 0
    return json.loads(buf.getvalue())


def test_record_fields_are_sane(record):
    for key in FIELDS:
        assert key in record, key
    assert record["model"] == "random-tiny"
    assert record["device"] == "cpu" and record["seq_len"] == 64
    assert record["instruction_tokens"] == 32 and record["response_tokens"] == 32
    assert record["layers"] == 2 and record["repeat"] == 1
    for key in ("time_ms", "eager_ms", "speedup"):
        assert isinstance(record[key], float) and record[key] > 0, key
    assert record["speedup"] == pytest.approx(record["eager_ms"] / record["time_ms"], rel=0.02)
    for key in ("peak_mem_mb", "eager_peak_mem_mb", "mem_ratio"):
        v = record[key]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, key
    assert record["peak_mem_mb"] < 500 and record["eager_peak_mem_mb"] < 500
    assert record["mem_ratio"] == pytest.approx(
        record["eager_peak_mem_mb"] / max(record["peak_mem_mb"], 1e-3), rel=0.05, abs=0.01)
    assert 0 <= record["max_abs_err"] < 1e-4
    assert record["commit"] and record["date"]  # environment fields


def test_arguments_and_bad_settings():
    p = argparse.ArgumentParser()
    bench_attention.add_arguments(p)
    a = p.parse_args(ARGS[2:] + ["--no-memory"])
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
