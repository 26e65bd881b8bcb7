"""``bench serve --soak``: a short mixed soak (echo, streamed generation, ``/v1/score``) against
the tiny model on 127.0.0.1, through the CLI, and the server's memory gauges in ``/metrics``."""

import json

import httpx
import pytest
import torch
from _helpers import save_tiny_llama

from icqs_fast.cli import main
from icqs_fast.serve.app import ServeConfig, Server
from icqs_fast.serve.metrics import peak_rss_bytes
from icqs_fast.serve.runner import ServerThread

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny_soak"), layers=2))


def test_metrics_report_rss_and_its_peak(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    srv = Server(model, AutoTokenizer.from_pretrained(tiny_dir), ServeConfig(model_name="t"))
    with ServerThread(srv) as st:
        text = httpx.get(st.base_url + "/metrics", timeout=30).text
    vals = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}
    rss = vals["process_resident_memory_bytes"]
    peak = vals["icqs_serve_resident_memory_peak_bytes"]
    assert 10 * 2**20 < rss <= peak <= peak_rss_bytes()


@pytest.mark.slow
def test_short_soak_answers_every_kind(tiny_dir, tmp_path, capsys):
    """A 6-second soak with one client of each kind: every kind answered, no 5xx, streamed
    generation timed, RSS sampled, the engine's rate measured; the record is written."""
    out = tmp_path / "soak.json"
    out.write_text(json.dumps({"before": {"kept": True}}))
    rc = main(["bench", "serve", "--model", tiny_dir, "--soak", "6", "--echo-clients", "2",
               "--gen-clients", "1", "--score-clients", "1", "--gen-tokens", "8",
               "--rss-every", "1", "--threads", "1", "--json", "--out", str(out),
               "--soak-as", "after", "--soak-dtype", "float32", "--prefill-budget", "48"])
    capsys.readouterr()
    both = json.loads(out.read_text())
    assert both["before"] == {"kept": True}  # --soak-as keeps the file's other records
    rec = both["after"]
    assert rc == 0 and rec["passed"], rec["checks"]
    assert rec["dtype"] == "float32"  # --soak-dtype reaches the server's model
    assert rec["prefill_budget"] == 48  # and --prefill-budget its config
    assert rec["steps"]["beside_decode"]["prefill_tokens_max"] <= 48  # beside a generation
    for kind in ("echo", "generate", "score"):
        assert rec[kind]["ok"] >= 1 and rec[kind]["ok"] == rec[kind]["sent"], rec[kind]
        assert rec[kind]["errors"] == {}
        assert rec[kind]["latency_s_p50"] <= rec[kind]["latency_s_p99"]
    gen = rec["generate"]
    # Two streamed pieces can arrive in one read, so a gap may be ~0; that gaps were timed
    # (several pieces per generation) is what shows the generation streamed.
    assert 0 < gen["ttft_s_p50"] and 0 <= gen["itl_s_p50"] <= gen["itl_s_p99"]
    assert gen["itl_samples"] >= 1
    assert rec["server_tokens"]["generated"] == 8 * gen["ok"]
    assert len(rec["rss_mb"]) >= 3 and all(mb > 10 for _, mb in rec["rss_mb"])
    assert rec["rss_peak_mb"] >= max(mb for _, mb in rec["rss_mb"])
    assert rec["engine_tokens_per_s"] > 0 and rec["server_vs_engine"] > 0
    # Every token the worker forwarded: at least the answers' prompt and generated tokens
    # (the /v1/score work and padding come on top).
    toks = rec["server_tokens"]
    assert toks["score_token_passes"] > 0  # the /v1/score work counts in the work tokens
    assert rec["server_work_tokens_per_s"] > rec["server_tokens_per_s"]
    assert rec["server_work_vs_engine"] > rec["server_vs_engine"]
    assert rec["server_forward_tokens"] >= toks["prompt"] + toks["generated"]
    assert rec["engine_forward_tokens_per_s"] >= rec["engine_tokens_per_s"] > 0
    assert rec["server_forward_vs_engine"] > 0
    # SIGTERM with a generation streaming: the server stopped within its bound, the request
    # finished (200) or was cut (503).
    sig = rec["sigterm"]
    assert sig["ok"] and sig["stopped_s"] <= sig["bound_s"] and sig["in_flight_status"] in (
        200, 503), sig
    assert rec["rss_growth_pct_min2_to_end"] is None  # a 6-second run cannot tell
    done = rec["done_when"]
    assert done["no_5xx"] and done["none_over_120s"] and done["sigterm_within_bound"]
    assert done["rss_growth_min2_le_10pct"] is None
    assert set(done) == {"no_5xx", "none_over_120s", "gen_p99_le_30s", "itl_p99_le_1s",
                         "rss_growth_min2_le_10pct", "throughput_ge_70pct_of_engine",
                         "sigterm_within_bound"}


def test_done_when_reads_the_issue_targets():
    """Each target true at its bound and false just past it; None where the run cannot tell."""
    from icqs_fast.benchmarks.serve_soak import done_when

    def rec(**kw):
        r = {"checks": {"five_xx": 0, "unanswered": 0, "over_120s": 0},
             "generate": {"latency_s_p99": 30.0, "itl_s_p99": 1.0},
             "rss_growth_pct_min2_to_end": 10.0, "server_work_vs_engine": 0.7,
             "sigterm": {"ok": True}}
        for k, v in kw.items():
            (r["generate"] if k in ("latency_s_p99", "itl_s_p99") else r)[k] = v
        return done_when(r)

    assert all(rec().values())
    assert rec(latency_s_p99=30.01)["gen_p99_le_30s"] is False
    assert rec(itl_s_p99=1.01)["itl_p99_le_1s"] is False
    assert rec(rss_growth_pct_min2_to_end=10.1)["rss_growth_min2_le_10pct"] is False
    assert rec(rss_growth_pct_min2_to_end=None)["rss_growth_min2_le_10pct"] is None
    assert rec(server_work_vs_engine=0.69)["throughput_ge_70pct_of_engine"] is False
    assert rec(checks={"five_xx": 1, "unanswered": 0, "over_120s": 0})["no_5xx"] is False
    assert rec(checks={"five_xx": 0, "unanswered": 0, "over_120s": 1})["none_over_120s"] is False


def test_rss_growth_reads_minute_medians_not_single_samples():
    """A flat series that swings 20 % between samples has no growth by its minute medians,
    whatever its single end samples say; a series that rises 1 % a minute reads its rise."""
    from icqs_fast.benchmarks.serve_soak import rss_growth

    flat = [[5.0 * i, (1000.0, 1100.0, 1200.0)[i % 3]] for i in range(121)]  # 0-600 s
    flat[-1][1] = 1200.0
    g = rss_growth(flat)
    assert g["rss_growth_pct_min2_to_end_samples"] == 20.0  # first at 120 s: 1000, last 1200
    assert g["rss_growth_pct_min2_to_end"] == 0.0
    assert abs(g["rss_trend_mb_per_min"]) < 5
    rising = [[5.0 * i, 1000.0 * (1 + 0.01 * i * 5 / 60)] for i in range(121)]
    g = rss_growth(rising)
    assert g["rss_growth_pct_min2_to_end"] == 6.9  # medians at 147.5 s and 570 s: 1024.6, 1095
    assert g["rss_trend_mb_per_min"] == pytest.approx(10.0, abs=0.01)
    assert rss_growth(flat[:40])["rss_growth_pct_min2_to_end"] is None  # 195 s: too short


def test_soak_refuses_bad_flags(tiny_dir, capsys):
    assert main(["bench", "serve", "--model", tiny_dir, "--soak", "0"]) == 2
    assert "--soak" in capsys.readouterr().err
