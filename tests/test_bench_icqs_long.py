"""``icqs-fast bench icqs --inputs long``: the SummEval workload (read in place from
``../shared/data/summeval``), the switch of the cascade's attention path, the FLOP count of the
fused attention calls, and the record on a tiny random Llama (fields, the two paths' scores
compared, the command's exit status). No test asserts on a timing."""

import argparse
import json

import pytest
import torch

from icqs_fast import ops
from icqs_fast.benchmarks import icqs as bench_icqs
from icqs_fast.benchmarks import icqs_long, roofline
from icqs_fast.cli import bench_icqs as cli_bench_icqs
from icqs_fast.engine.cascade import ATTENTION_ENV
from icqs_fast.io.datasets import shared_data_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SUMMEVAL = shared_data_dir() / "summeval" / "summeval.jsonl"
needs_summeval = pytest.mark.skipif(not SUMMEVAL.exists(),
                                    reason=f"SummEval not found at {SUMMEVAL}")


@pytest.mark.slow  # reads the 4 MB file twice: seconds on the shared machine
@needs_summeval
def test_workload_uses_distinct_long_articles():
    good, bad, resp = icqs_long.summeval_workload(4)
    assert len(good) == len(bad) == icqs_long.POOL_SIZE and len(resp) == 4
    articles = [x for x, _ in (*good, *bad, *resp)]
    assert len(set(articles)) == len(articles)  # each demonstration / query its own article
    assert min(len(a) for a in articles) > 2000  # the longest articles (characters)
    assert all(y.strip() for _, y in (*good, *bad, *resp))
    assert icqs_long.summeval_workload(4) == (good, bad, resp)  # fixed order
    with pytest.raises(ValueError, match="--responses must be >= 1"):
        icqs_long.summeval_workload(0)


def test_cascade_attention_switch_restores_the_environment(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "cpp")
    with icqs_long.cascade_attention("torch"):
        import os

        assert os.environ[ATTENTION_ENV] == "torch"
    assert os.environ[ATTENTION_ENV] == "cpp"
    monkeypatch.delenv(ATTENTION_ENV)
    with icqs_long.cascade_attention("auto"):
        assert os.environ[ATTENTION_ENV] == "auto"
    assert ATTENTION_ENV not in os.environ


@pytest.mark.slow  # the dispatch mode's first use: seconds on the shared machine
def test_flop_count_sees_fused_attention_once():
    """``attention_lse`` is counted whole (``2 B Hq Tq Tk (D + Dv)``) on any backend, and the
    products its torch backend dispatches are not counted again."""
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 2, 7, 8)
    v = torch.randn(2, 2, 7, 6)
    for backend in ("torch", "cpp"):
        count, _ = roofline.count_flops(lambda b=backend: ops.attention_lse(q, k, v, backend=b))
        assert count.attention == 2 * 2 * 4 * 5 * 7 * (8 + 6), backend
        assert count.linear == count.head == 0
    assert ops.attention_lse.__name__ == "attention_lse"  # the wrapper is gone afterwards


@pytest.mark.slow
@needs_summeval
def test_record_on_a_tiny_model(monkeypatch, tmp_path, capsys):
    """The record on a tiny random Llama (1 demonstration per set so prompts fit its 2,048
    positions): both paths score the same responses, agree at fp32, and the FLOP fields are
    filled; the command prints and writes it and exits 0; a failing check exits 1."""
    loaded = bench_icqs.load(torch.device("cpu"), True, "tiny")
    rec = icqs_long.bench_long(1, "cpu", settings=dict(demos_per_set=1),
                               model_tok_name=loaded)
    assert rec["inputs"] == "long" and rec["dtype"] == "float32" and rec["contexts"] == 2
    assert 700 < rec["prompt_tokens_min"] <= rec["prompt_tokens_max"] < 2048
    assert rec["score_agreement"] == 1.0
    assert rec["max_abs_loglik_diff_per_token"] <= bench_icqs.LOGLIK_TOL
    assert rec["cascade"] is True
    for key in ("torch_attention_s", "fast_s", "attention_speedup", "achieved_gflops",
                "limit_gflops", "fraction_of_limit", "torch_attention_fraction_of_limit"):
        assert isinstance(rec[key], float) and rec[key] > 0, key
    assert rec["attention_gflop"] > 0 and rec["linear_gflop"] > 0
    json.dumps(rec)

    monkeypatch.setattr(icqs_long, "bench_long", lambda *a, **k: dict(rec))
    p = argparse.ArgumentParser()
    cli_bench_icqs.add_arguments(p)
    out = tmp_path / "long.json"
    args = p.parse_args(["--inputs", "long", "--json", "--threads", "1", "--out", str(out)])
    assert cli_bench_icqs.run(args) == 0
    assert json.loads(out.read_text())["inputs"] == "long"
    rec["score_agreement"] = 0.5
    assert cli_bench_icqs.run(args) == 1
    assert "score_agreement = 0.5 (want == 1.0)" in capsys.readouterr().err


def test_long_refuses_the_short_only_flags():
    p = argparse.ArgumentParser()
    cli_bench_icqs.add_arguments(p)
    with pytest.raises(ValueError, match="--inputs long runs the embedded model"):
        cli_bench_icqs.run(p.parse_args(["--inputs", "long", "--random-weights"]))
