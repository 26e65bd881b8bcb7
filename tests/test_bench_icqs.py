"""``icqs-fast bench icqs`` on a tiny random Llama with small ICQS settings: every field of the
record is present and sane (engine and naive agree)."""

import json

import pytest

from icqs_fast.benchmarks import icqs as bench_icqs

FIELDS = ("model", "device", "dtype", "responses", "contexts", "demo_tokens_mean",
          "response_tokens_mean", "naive_s", "fast_s", "speedup", "cold_single_speedup",
          "peak_mem_naive_mb", "peak_mem_fast_mb", "max_abs_loglik_diff", "score_agreement")
SMALL = dict(num_ratios=2, demos_per_set=2, sets_per_ratio=2)


@pytest.fixture(scope="module")
def record():
    try:
        return bench_icqs.bench(3, "cpu", random_weights=True, config="tiny",
                                measure_memory=False, settings=SMALL)
    except FileNotFoundError as exc:  # the embedded model's tokenizer is needed
        pytest.skip(f"embedded model unavailable: {exc}")


def test_record_fields_are_sane(record):
    for key in FIELDS:
        assert key in record, key
    assert record["model"] == "random-tiny"
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["responses"] == 3 and record["contexts"] == 4
    assert record["demo_tokens_mean"] > 10 and record["response_tokens_mean"] >= 1
    for key in ("naive_s", "fast_s", "speedup", "cold_single_speedup", "prefix_s"):
        assert record[key] > 0, key
    assert record["prefix_s"] <= record["fast_s"]
    assert record["speedup"] == pytest.approx(record["naive_s"] / record["fast_s"], rel=0.02)
    assert record["score_agreement"] == 1.0
    assert 0 <= record["max_abs_loglik_diff"] < 1e-3
    assert record["cascade"] is True
    assert record["peak_mem_naive_mb"] is None  # memory skipped here
    # The cold comparison is the ratio of medians over interleaved repeats.
    assert len(record["cold_single_fast_all_s"]) == len(record["cold_single_naive_all_s"]) == 3
    assert record["cold_single_speedup"] == pytest.approx(
        record["cold_single_naive_s"] / record["cold_single_fast_s"], rel=0.02)
    # Every prefix starts with the same BOS + system text: the bank computes it once.
    assert 0 < record["prefix_forward_tokens"] < record["prefix_tokens_total"]
    assert record["prefix_bank_mb"] > 0
    json.dumps(record)


def test_responses_and_arguments():
    r = bench_icqs.responses(70)
    assert len(r) == 70 and r[0] != r[1]
    assert len(set(r[:64])) == 64  # 32 headlines x 2 answers
    import argparse

    p = argparse.ArgumentParser()
    bench_icqs.add_arguments(p)
    a = p.parse_args(["--random-weights", "--config", "llama-1b", "--responses", "4", "--json",
                      "--device", "cpu", "--out", "x.json"])
    assert (a.random_weights, a.config, a.responses, a.json, a.device, a.out) == \
        (True, "llama-1b", 4, True, "cpu", "x.json")
    assert a.cold_repeats == 3
    with pytest.raises(ValueError, match="responses"):
        bench_icqs.bench(0, "cpu", random_weights=True, config="tiny", measure_memory=False)
    with pytest.raises(ValueError, match="cold-repeats"):
        bench_icqs.bench(1, "cpu", random_weights=True, config="tiny", measure_memory=False,
                         cold_repeats=0)


def test_peak_memory_child_runs():
    try:
        rec = bench_icqs.measure_peak_child("fast", 1, "cpu", True, "tiny")
    except FileNotFoundError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    assert rec["peak_mb"] >= 0
