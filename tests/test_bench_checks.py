"""The correctness checks every ``bench`` command applies to its own record
(:func:`icqs_fast.benchmarks.check_fields`): each command's fields, and the exit status and
stderr message when one fails."""

import argparse
import json
import math

import pytest

from icqs_fast.benchmarks import at_most, check_fields, equals, report_failures
from icqs_fast.benchmarks import attention as bench_attention
from icqs_fast.benchmarks import kernels as bench_kernels
from icqs_fast.benchmarks import lm_eval as bench_lm_eval
from icqs_fast.benchmarks import scaleout as bench_scaleout
from icqs_fast.cli import bench_attention as cli_bench_attention
from icqs_fast.cli import bench_kernels as cli_bench_kernels


def test_check_fields():
    checks = {"diff": 1e-4, "agree": equals(1.0), "same": equals(True),
              "pos": lambda v: v > 0}
    assert check_fields({"diff": -5e-5, "agree": 1.0, "same": True, "pos": 2}, checks) == []
    bad = check_fields({"diff": math.nan, "agree": True, "same": 1, "pos": None}, checks,
                       prefix="run[0].")
    assert bad == ["run[0].diff = nan (want <= 0.0001)", "run[0].agree = True (want == 1.0)",
                   "run[0].same = 1 (want is True)", "run[0].pos = None (want <lambda>)"]
    assert check_fields({}, {"diff": at_most(1.0)}) == ["diff missing (want <= 1)"]
    assert check_fields({"diff": None}, {"diff": 1.0}) == ["diff = None (want <= 1)"]
    assert check_fields({"diff": math.inf}, {"diff": 1.0}) == ["diff = inf (want <= 1)"]


def test_report_failures(capsys):
    assert report_failures("icqs", []) == 0
    assert capsys.readouterr().err == ""
    assert report_failures("icqs", ["a = 1 (want <= 0)"]) == 1
    assert capsys.readouterr().err == "bench icqs: correctness check failed: a = 1 (want <= 0)\n"


def test_each_command_names_its_fields():
    assert set(bench_kernels.checks("token_stats")) == {"max_abs_err", "int_fields_exact"}
    assert set(bench_kernels.checks("linear_token_stats")) == {"max_abs_err"}
    assert set(bench_attention.checks("float32")) == {"max_abs_err"}
    assert set(bench_attention.checks("float32", backends_compared=True)) == {
        "max_abs_err", "backend_max_diff"}
    assert check_fields({"max_abs_err": 1e-2}, bench_attention.checks("bfloat16")) == []
    assert check_fields({"max_abs_err": 1e-2}, bench_attention.checks("float32")) != []
    assert set(bench_lm_eval.checks()) == {"max_abs_diff", "is_greedy_agreement",
                                           "same_predictions"}
    assert set(bench_scaleout.checks()) == {"max_abs_loglik_diff", "ids_and_scores_equal"}


# The options of kernels / attention live in their thin cli modules (no torch for --help).
OPTIONS = {bench_kernels: cli_bench_kernels, bench_attention: cli_bench_attention}


def _parse(mod, argv):
    p = argparse.ArgumentParser()
    OPTIONS.get(mod, mod).add_arguments(p)
    return p.parse_args(argv)


def test_kernels_exits_nonzero_naming_the_field(monkeypatch, tmp_path, capsys):
    """One quick CPU record against an impossible tolerance: written, then exit 1 naming
    ``max_abs_err`` with the record's op; with the default tolerance it passes."""
    monkeypatch.setattr(bench_kernels, "benchmark_cases",
                        lambda quick, cuda, cpu=True: [("token_stats", "torch", "cpu", "fp32",
                                                         (8, 64))])
    out = tmp_path / "k.json"
    argv = ["--quick", "--no-cuda", "--repeat", "1", "--json", "--out", str(out)]
    assert bench_kernels.run(_parse(bench_kernels, [*argv, "--tolerance", "-1"])) == 1
    err = capsys.readouterr().err
    assert "bench kernels: correctness check failed: token_stats torch cpu fp32 [8, 64]: " \
        "max_abs_err = " in err and "(want <= -1)" in err
    assert len(json.loads(out.read_text())) == 1
    assert bench_kernels.run(_parse(bench_kernels, argv)) == 0


def test_attention_lm_eval_scaleout_exit_nonzero_naming_the_field(monkeypatch, capsys):
    """Each command's ``run`` on a stubbed measurement whose correctness field fails."""
    monkeypatch.setattr(bench_attention, "bench",
                        lambda *a, **k: {"dtype": "float32", "max_abs_err": 0.5})
    assert bench_attention.run(_parse(bench_attention, ["--device", "cpu", "--json"])) == 1
    assert "bench attention: correctness check failed: max_abs_err = 0.5 (want <= 0.001)" in \
        capsys.readouterr().err

    monkeypatch.setattr(bench_lm_eval, "bench", lambda *a, **k: {
        "max_abs_diff": 1e-5, "is_greedy_agreement": 0.9, "same_predictions": True})
    assert bench_lm_eval.run(_parse(bench_lm_eval, ["--json"])) == 1
    err = capsys.readouterr().err
    assert "is_greedy_agreement = 0.9 (want == 1.0)" in err and "max_abs_diff" not in err

    monkeypatch.setattr(bench_scaleout, "bench", lambda *a, **k: {"ray": [
        {"workers": 1, "max_abs_loglik_diff": 0.0, "ids_and_scores_equal": True},
        {"workers": 2, "max_abs_loglik_diff": 0.0, "ids_and_scores_equal": False}]})
    assert bench_scaleout.run(_parse(bench_scaleout, ["--json", "--workers", "1,2"])) == 1
    assert "bench scaleout: correctness check failed: ray[1].ids_and_scores_equal = False " \
        "(want is True)" in capsys.readouterr().err


@pytest.mark.parametrize("mod", [bench_attention, bench_lm_eval, bench_scaleout])
def test_tolerance_flag(mod):
    assert _parse(mod, ["--tolerance", "0.5"]).tolerance == 0.5
