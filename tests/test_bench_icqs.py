"""``icqs-fast bench icqs`` on a tiny random Llama with small ICQS settings: the record's fields
and types, the engine against the naive method, the comparison itself (a known difference in
the naive results shows up in the record), the memory fields on known values, and the naive
side's measured peak against the logits it must materialise.

No test compares a field with a ratio of the record's own rounded fields, and none asserts on
wall-clock time (timings are checked for type only)."""

import argparse
import dataclasses
import json

import pytest
import torch

from icqs_fast.benchmarks import icqs as bench_icqs
from icqs_fast.cli import bench_icqs as cli_bench_icqs
from icqs_fast.engine import batching

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIELDS = ("model", "device", "dtype", "responses", "contexts", "demo_tokens_mean",
          "response_tokens_mean", "naive_s", "fast_s", "speedup", "cold_single_speedup",
          "peak_mem_naive_mb", "peak_mem_fast_mb", "max_abs_loglik_diff",
          "max_abs_loglik_diff_per_token", "score_agreement")
SMALL = dict(num_ratios=2, demos_per_set=2, sets_per_ratio=2)
MiB = 2**20


@pytest.fixture(scope="module")
def record():
    # Every shared prefix run kept (a forward costs no tokens): the 4 contexts' shared BOS +
    # system text saves fewer tokens than the CPU's cost of another forward, so by default the
    # bank would recompute it, and the record could not show what the bank shares.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batching, "FORWARD_COST_TOKENS", (0, 0))
        return bench_icqs.bench(3, "cpu", random_weights=True, config="tiny",
                                measure_memory=False, settings=SMALL)


@pytest.mark.slow
def test_record_fields_and_agreement(record):
    """Every field with its type and the settings echoed; the engine's log-likelihoods within
    1e-3 of the naive method's (full logits + log_softmax per context) and every score equal."""
    for key in FIELDS:
        assert key in record, key
    assert record["model"] == "random-tiny"
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["responses"] == 3 and record["contexts"] == 4
    assert record["settings"] == dict(bench_icqs.SETTINGS, **SMALL)
    for key in ("naive_s", "fast_s", "speedup", "cold_single_speedup", "prefix_s",
                "demo_tokens_mean", "response_tokens_mean", "query_tokens_mean"):
        assert isinstance(record[key], float), key
    # Two demonstrations of >= 10 tokens each, one-word answers of >= 1 token.
    assert record["demo_tokens_mean"] > 20 and record["response_tokens_mean"] >= 1
    assert record["score_agreement"] == 1.0
    assert isinstance(record["max_abs_loglik_diff"], float)
    assert record["max_abs_loglik_diff"] < 1e-3
    assert record["cascade"] is True
    # Memory skipped: absent values, not zeros that look like measurements.
    assert record["peak_mem_naive_mb"] is None and record["peak_mem_fast_mb"] is None
    assert record["mem_ratio"] is None
    assert len(record["cold_single_fast_all_s"]) == len(record["cold_single_naive_all_s"]) == 3
    # Every prefix starts with the same BOS + system text: the bank computes it once.
    assert 0 < record["prefix_forward_tokens"] < record["prefix_tokens_total"]
    assert isinstance(record["prefix_bank_mb"], float)
    # Distance to the limit: counted FLOPs (the decoder's linears, attention, the fused head),
    # the achieved rate and the probed matmul rate of the same shapes and dtype.
    assert record["model_gflop"] > 0 and record["linear_gflop"] > 0
    assert record["attention_gflop"] > 0 and record["head_gflop"] > 0
    for key in ("achieved_gflops", "limit_gflops", "fraction_of_limit", "achieved_gflops_cpu",
                "limit_gflops_cpu", "fraction_of_limit_cpu", "fast_cpu_s"):
        assert isinstance(record[key], float) and record[key] > 0, key
    assert len(record["limit_probes_gflops"]) == 2 and record["probe_rows"] >= 1
    json.dumps(record)


@pytest.mark.slow
def test_comparison_sees_a_known_difference(monkeypatch):
    """The naive results of the second response are shifted by +0.01 in one context and given
    another score: the record must report that difference (0.01) and 1 of 2 responses
    disagreeing, so the comparison really pairs engine and naive results. With the memory
    subprocesses replaced by known readings, the memory fields are those readings and
    ``mem_ratio = naive / fast``."""
    second = bench_icqs.responses(2)[1]
    real = bench_icqs._naive
    calls = []

    def shifted_naive(model, tok, good, bad, resp, settings=None):
        out = real(model, tok, good, bad, resp, settings)
        if list(resp) == [second]:
            r = out[0]
            ll = r.loglik.clone()
            ll[0, 0] += 0.01
            out[0] = dataclasses.replace(r, loglik=ll, score=r.score + 1.0)
        return out

    def fake_peak(side, n, device, random_weights, config, dtype=None, model_name=None):
        calls.append((side, n))
        return {"fast": 10.0, "naive": 25.0}[side]

    monkeypatch.setattr(bench_icqs, "_naive", shifted_naive)
    monkeypatch.setattr(bench_icqs, "_peak_in_subprocess", fake_peak)
    rec = bench_icqs.bench(2, "cpu", random_weights=True, config="tiny", measure_memory=True,
                           mem_responses=5, settings=SMALL, cold_repeats=1)
    assert rec["max_abs_loglik_diff"] == pytest.approx(0.01, abs=1e-3)
    assert rec["score_agreement"] == 0.5
    assert (rec["peak_mem_fast_mb"], rec["peak_mem_naive_mb"], rec["mem_ratio"]) == \
        (10.0, 25.0, 2.5)
    assert rec["mem_responses"] == {"fast": 2, "naive": 2}
    assert sorted(calls) == [("fast", 2), ("naive", 2)]


def _peak_child(side: str, settings: dict) -> float:
    import json
    import subprocess
    import sys

    code = ("import json, sys; from icqs_fast.benchmarks import icqs as b; print(json.dumps("
            "b.measure_peak_child(sys.argv[1], 1, 'cpu', True, 'tiny', json.loads(sys.argv[2]))))")
    res = subprocess.run([sys.executable, "-c", code, side, json.dumps(settings)],
                         capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_mb"])


@pytest.mark.subprocess
def test_naive_peak_holds_its_logits():
    """The benchmark's per-side memory measurement on a case with a known lower bound: the naive
    method materialises fp32 logits and their log_softmax, [T, V] each, for every prompt
    (T >= the 8-demonstration prefix: ~215 tokens, V = 49152, so > 32 MiB each and fresh pages);
    the engine never builds [T, V] and needs a small fraction of that."""
    settings = dict(num_ratios=2, demos_per_set=8, sets_per_ratio=1)
    model, tok, _ = bench_icqs.load(torch.device("cpu"), True, "tiny")
    scorer = bench_icqs._scorer(model, tok, *bench_icqs.demos(), settings)
    t_min = min(scorer.prefix_bank.lengths[:scorer.n_contexts])
    bound = 2 * t_min * len(tok) * 4 / MiB
    assert bound > 64  # each array above glibc's largest mmap threshold (32 MiB)
    # Each side in a fresh interpreter, as the benchmark measures them: inside the long test
    # process freed, still-resident memory from earlier tests can hide the fresh pages.
    naive, fast = (_peak_child(side, settings) for side in ("naive", "fast"))
    assert naive >= bound, (naive, bound)
    assert fast < bound / 4, (fast, bound)


def test_responses_and_arguments():
    r = bench_icqs.responses(70)
    assert len(r) == 70 and r[0] != r[1]
    assert len(set(r[:64])) == 64  # 32 headlines x 2 answers
    assert r[64] == r[0]  # cycled
    p = argparse.ArgumentParser()
    cli_bench_icqs.add_arguments(p)
    a = p.parse_args(["--random-weights", "--config", "llama-1b", "--responses", "4", "--json",
                      "--device", "cpu", "--out", "x.json"])
    assert (a.random_weights, a.config, a.responses, a.json, a.device, a.out) == \
        (True, "llama-1b", 4, True, "cpu", "x.json")
    assert a.cold_repeats is None and a.inputs == "short"  # 3 (short) or 1 (long) when run
    with pytest.raises(ValueError, match="responses"):
        bench_icqs.bench(0, "cpu", random_weights=True, config="tiny", measure_memory=False)
    with pytest.raises(ValueError, match="cold-repeats"):
        bench_icqs.bench(1, "cpu", random_weights=True, config="tiny", measure_memory=False,
                         cold_repeats=0)


def _args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli_bench_icqs.add_arguments(p)
    return p.parse_args(["--random-weights", "--config", "tiny", "--device", "cpu",
                         "--no-memory", "--cold-repeats", "1", "--json", *extra])


@pytest.mark.slow
def test_default_settings_agree_and_the_command_passes(tmp_path, capsys):
    """``bench icqs`` as run, with the DEFAULT settings (M+1 = 5, L = 4, N = 8, stratify="auto",
    which stratifies the demo files' label answers): the engine and the naive reference use the
    same demonstration sets, so every score agrees and every log-likelihood is within
    ``LOGLIK_TOL``; the command exits 0. (Before the reference took the settings it ignored
    ``stratify``: agreement 0.0 and the command still exited 0.)"""
    out = tmp_path / "rec.json"
    rc = bench_icqs.run(_args("--responses", "1", "--out", str(out)))
    rec = json.loads(out.read_text())
    assert rec["settings"] == bench_icqs.SETTINGS and rec["contexts"] == 20
    assert rec["scoring_settings"]["stratify"] == "auto"
    assert rec["score_agreement"] == 1.0
    assert rec["max_abs_loglik_diff_per_token"] <= bench_icqs.LOGLIK_TOL == 1e-4
    assert rec["max_abs_loglik_diff_per_token"] == pytest.approx(
        rec["max_abs_loglik_diff"] / rec["response_tokens_mean"])  # one response
    assert rc == 0
    assert "correctness check failed" not in capsys.readouterr().err


def test_failing_correctness_field_exits_nonzero_naming_it(monkeypatch, tmp_path, capsys):
    """A record whose correctness fields fail: the record is still written and printed, then
    the command exits 1 and names each failing field and value on stderr."""
    rec = {"score_agreement": 0.5, "max_abs_loglik_diff_per_token": 3.37, "device": "cpu"}
    monkeypatch.setattr(bench_icqs, "bench", lambda *a, **k: dict(rec))
    out = tmp_path / "rec.json"
    rc = bench_icqs.run(_args("--out", str(out)))
    cap = capsys.readouterr()
    assert rc == 1
    assert json.loads(out.read_text())["score_agreement"] == 0.5
    assert json.loads(cap.out)["max_abs_loglik_diff_per_token"] == 3.37
    assert "score_agreement = 0.5 (want == 1.0)" in cap.err
    assert "max_abs_loglik_diff_per_token = 3.37 (want <= 0.0001)" in cap.err
    # Agreement, but a diff over an impossible tolerance: only that field is named.
    rec.update(score_agreement=1.0, max_abs_loglik_diff_per_token=1e-6)
    assert bench_icqs.run(_args("--tolerance", "1e-9")) == 1
    err = capsys.readouterr().err
    assert "max_abs_loglik_diff_per_token = 1e-06 (want <= 1e-09)" in err
    assert "score_agreement" not in err
    assert bench_icqs.run(_args()) == 0


def test_a_16bit_record_is_checked_at_its_own_precision(monkeypatch, capsys):
    """A bf16 record (bf16 on CUDA, --dtype auto on a bf16 CPU) passes with the 16-bit
    tolerances; the same differences fail a float32 record."""
    rec = {"score_agreement": 1.0, "max_abs_loglik_diff_per_token": 0.05, "device": "cpu",
           "dtype": "bfloat16"}
    monkeypatch.setattr(bench_icqs, "bench", lambda *a, **k: dict(rec))
    assert bench_icqs.run(_args()) == 0
    rec["dtype"] = "float32"
    assert bench_icqs.run(_args()) == 1
    assert "max_abs_loglik_diff_per_token = 0.05 (want <= 0.0001)" in capsys.readouterr().err


def test_scores_agree_tolerance():
    from types import SimpleNamespace

    a = SimpleNamespace(score=0.50, score_per_set=[0.4, 0.6], score_kind="mean")
    b = SimpleNamespace(score=0.505, score_per_set=[0.405, 0.6], score_kind="mean")
    assert not bench_icqs.scores_agree(a, b)
    assert bench_icqs.scores_agree(a, b, bench_icqs.SCORE_TOL_16BIT)
    b.score_per_set = [0.43, 0.6]  # a per-set score 0.03 away: only the Epistemic one counts
    assert not bench_icqs.scores_agree(a, b, bench_icqs.SCORE_TOL_16BIT)
    assert bench_icqs.scores_agree(a, b, bench_icqs.SCORE_TOL_16BIT, per_set=False)
    # The discrete kinds must be equal whatever the tolerance.
    a.score_kind = "argmax"
    assert not bench_icqs.scores_agree(a, b, bench_icqs.SCORE_TOL_16BIT)


@pytest.mark.subprocess
@pytest.mark.slow
def test_default_run_measures_memory_in_child_processes():
    """``bench icqs`` with its memory step (no ``--no-memory``): both memory children start, load
    the model and report a reading, and the record carries them. (Before, the child's code was
    built with ``dtype={dtype!r}`` from a ``torch.float32`` and died with ``NameError: name
    'torch' is not defined`` after the whole timed run.)"""
    rec = bench_icqs.bench(1, "cpu", random_weights=True, config="tiny", measure_memory=True,
                           mem_responses=1, settings=SMALL, cold_repeats=1)
    assert rec["mem_responses"] == {"fast": 1, "naive": 1}
    for key in ("peak_mem_fast_mb", "peak_mem_naive_mb"):
        assert isinstance(rec[key], float) and rec[key] >= 0, key
    # The naive side builds [T, V] fp32 logits (T ~ 200 prompt tokens, V = 49152: ~38 MiB)
    # that the engine never builds.
    assert rec["peak_mem_naive_mb"] > 32


def test_memory_child_gets_its_parameters_as_json(monkeypatch):
    """The child's parameters travel as one JSON argument, a torch dtype by its name, and come
    back into :func:`measure_peak_child` unchanged (no code built from a repr)."""
    seen = {}

    def fake_run(cmd, **kw):
        code, arg = cmd[2], cmd[3]
        assert "torch" not in code.replace("icqs_fast", "")
        seen.update(json.loads(arg))
        return argparse.Namespace(returncode=0, stdout='{"peak_mb": 12.5}\n', stderr="")

    monkeypatch.setattr(bench_icqs.subprocess, "run", fake_run)
    got = bench_icqs._peak_in_subprocess("fast", 3, "cpu", True, "tiny", torch.bfloat16)
    assert got == 12.5
    assert seen == {"side": "fast", "n": 3, "device": "cpu", "random_weights": True,
                    "config": "tiny", "dtype": "bfloat16", "model_name": None}
    # --model reaches the child by name (the same model is loaded there).
    bench_icqs._peak_in_subprocess("naive", 2, "cpu", False, "tiny", None, "gemma3-270m")
    assert seen["model_name"] == "gemma3-270m" and seen["dtype"] is None
    assert bench_icqs._dtype_name(None) is None and bench_icqs._dtype_name("auto") == "auto"
