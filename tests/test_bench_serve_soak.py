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
    rc = main(["bench", "serve", "--model", tiny_dir, "--soak", "6", "--echo-clients", "2",
               "--gen-clients", "1", "--score-clients", "1", "--gen-tokens", "8",
               "--rss-every", "1", "--threads", "1", "--json", "--out", str(out)])
    capsys.readouterr()
    rec = json.loads(out.read_text())
    assert rc == 0 and rec["passed"], rec["checks"]
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


def test_soak_refuses_bad_flags(tiny_dir, capsys):
    assert main(["bench", "serve", "--model", tiny_dir, "--soak", "0"]) == 2
    assert "--soak" in capsys.readouterr().err
