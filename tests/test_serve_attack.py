"""``icqs-fast serve`` against hostile and careless clients, on 127.0.0.1 with the tiny model:
schemathesis against the live ``/openapi.json`` (positive and negative data: no 5xx, every
answer conforming to the schema); a maximum-size ``/v1/score`` request cannot starve small
completions; lone surrogates and oversized requests are 4xx before anything is queued; unknown
and unsupported fields are refused by name; ``logit_bias``; the deadline and a disconnecting
client drop the remaining work; ``/metrics``; ``serve --quiet`` prints nothing, first run
(GGUF conversion) included. Every loop is bounded in examples and seconds."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from _helpers import save_tiny_llama

from icqs_fast.serve.app import ServeConfig, Server
from icqs_fast.serve.runner import ServerThread

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

GOOD = [("Review: fine", "positive"), ("Review: awful", "negative")] * 2
BAD = [("Review: fine", "negative"), ("Review: awful", "positive")] * 2
SMALL_ICQS = {"num_ratios": 2, "demos_per_set": 1, "sets_per_ratio": 2, "seed": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # 1024 positions: a 512-token record fits with its ICQS demonstrations.
    d = save_tiny_llama(tmp_path_factory.mktemp("tiny_attack"), layers=2, max_positions=1024)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return str(d), model, AutoTokenizer.from_pretrained(d)


def _server(tiny, **cfg):
    d, model, tok = tiny
    base = dict(model_name="tiny", max_prompt_tokens=64, max_request_tokens=200, max_prompts=4,
                max_gen_tokens=4, max_logprobs=5, max_body_bytes=200_000, batch_wait_ms=1)
    return Server(model, tok, ServeConfig(**{**base, **cfg}), good=GOOD, bad=BAD,
                  icqs_options=SMALL_ICQS)


@pytest.fixture(scope="module")
def small_server(tiny):
    srv = _server(tiny)
    with ServerThread(srv) as st:
        yield st, srv


def _post(st, path, body, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(st.base_url + path, content=raw, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


# --------------------------------------------------------------------------- schemathesis


def _fuzz(strategy, examples, base_url, checks, key, ran):
    """``examples`` cases of ``strategy`` sent to the server and validated (derandomized: the
    same cases on every run; no example database; no shrinking phase, a failure shows as
    found)."""
    from hypothesis import HealthCheck, Phase, given, settings

    @given(case=strategy)
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case):
        resp = case.call(base_url=base_url, timeout=60)
        case.validate_response(resp, checks=checks)
        ran[key] = ran.get(key, 0) + 1

    check()


def test_schemathesis_positive_and_negative(small_server):
    """Every operation of the live schema, schema-valid and schema-invalid data: no 5xx, every
    status documented, every body (errors included) conforming to its schema, invalid data
    refused. Bounded: 40 examples per operation and mode, derandomized, no database."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    st, srv = small_server
    schema = schemathesis.openapi.from_url(st.base_url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    ran: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        has_input = op.body or any(True for _ in op.iter_parameters())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and not has_input:
                continue  # nothing to make invalid
            key = f"{op.label} {mode.value}"
            extra = [negative_data_rejection] if mode == GenerationMode.NEGATIVE else []
            _fuzz(op.as_strategy(generation_mode=mode), 40 if op.body else 3, st.base_url,
                  checks + extra, key, ran)
    total = sum(ran.values())
    print(f"\nschemathesis: {total} cases: {json.dumps(ran)}")
    assert any("POST /v1/completions negative" in k for k in ran)
    assert any("POST /v1/score positive" in k for k in ran)
    assert total >= 100
    assert srv.queue.pending == 0
    assert httpx.get(st.base_url + "/health", timeout=10).json()["status"] == "ok"


def test_openapi_names_every_route_and_no_422(small_server):
    st, _ = small_server
    spec = httpx.get(st.base_url + "/openapi.json", timeout=10).json()
    assert {"/v1/models", "/v1/completions", "/v1/score", "/health", "/metrics"} <= \
        set(spec["paths"])
    for path, ops in spec["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path  # validation errors are 400 here
            assert "400" in op["responses"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "echo", "logprobs", "logit_bias", "stop"} <= set(props)


# --------------------------------------------------------------------------- bad input


def test_lone_surrogate_and_undecodable_text_are_400(small_server):
    st, srv = small_server
    chunks = srv.queue.chunks
    bodies = [
        ("/v1/completions", b'{"prompt": "\\u0000\\ud800", "max_tokens": 0, "echo": true}',
         "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 0}', "prompt"),
        ("/v1/completions", b'{"prompt": "ok", "max_tokens": 2, "stop": "\\ud800"}', "stop"),
        ("/v1/score", b'{"records": [{"x": "\\ud800", "y": "a"}], "features": true}',
         "records"),
        ("/v1/completions", b'{"prompt": "caf\xe9"}', None),  # not UTF-8 at all
    ]
    for path, raw, param in bodies:
        r = _post(st, path, raw)
        assert r.status_code == 400, (raw, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert err["param"].startswith(param), err
    assert srv.queue.chunks == chunks  # refused before anything was queued


def test_oversized_requests_name_their_limit(small_server, tiny):
    """Per prompt / record 400 naming --max-prompt-tokens, per request 413 naming
    --max-request-tokens, the issue's 100,000-character record: all before queueing."""
    st, srv = small_server
    chunks = srv.queue.chunks
    long_text = "word " * 20_000  # 100,000 characters, under the body limit
    cases = [
        ("/v1/completions", {"prompt": long_text, "max_tokens": 0, "echo": True}, 400,
         "--max-prompt-tokens"),
        ("/v1/score", {"records": [{"x": "q", "y": long_text}], "features": True}, 400,
         "--max-prompt-tokens"),
        ("/v1/score", {"records": [{"x": "q", "y": "a"}], "good": [["x", long_text]],
                       "bad": [["x", "y"]]}, 400, "--max-prompt-tokens"),
        ("/v1/completions", {"prompt": ["word " * 55] * 4, "max_tokens": 0, "echo": True}, 413,
         "--max-request-tokens"),
        ("/v1/score", {"records": [{"x": "q", "y": "word " * 55}] * 4, "features": True}, 413,
         "--max-request-tokens"),
        ("/v1/completions", {"prompt": ["a"] * 5, "max_tokens": 0}, 400, "--max-prompts"),
        ("/v1/score", {"records": [{"x": "q", "y": "a"}] * 5, "features": True}, 400,
         "--max-prompts"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 5}, 400, "--max-gen-tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0, "logprobs": 6}, 400,
         "--max-logprobs"),
    ]
    for path, body, status, flag in cases:
        r = _post(st, path, body)
        assert r.status_code == status, (path, r.status_code, r.text[:300])
        assert flag in r.json()["error"]["message"], r.text[:300]
    r = _post(st, "/v1/completions", {"prompt": "x" * 300_000})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
    assert srv.queue.chunks == chunks and srv.queue.pending == 0


def test_unknown_and_unsupported_fields_are_refused_by_name(small_server):
    st, _ = small_server
    cases = [
        ({"prompt": "a", "max_tokens": 0, "logit_biass": {}}, "logit_biass", "unsupported_field"),
        ({"prompt": "a", "max_tokens": 0, "stream_options": {"include_usage": True}},
         "stream_options", "unsupported"),
        ({"prompt": "a", "max_tokens": 0, "n": 2}, "n", "unsupported"),
        ({"prompt": "a", "max_tokens": 1, "presence_penalty": 0.5}, "presence_penalty",
         "unsupported"),
        ({"prompt": "a", "max_tokens": 1, "temperature": 0.7}, "temperature",
         "sampling_not_supported"),
        ({"prompt": "a", "max_tokens": "1"}, "max_tokens", "invalid_request"),  # strict types
        ({"prompt": "a", "echo": 1}, "echo", "invalid_request"),
        ({"max_tokens": 0}, "prompt", "invalid_request"),
        ({"prompt": [], "max_tokens": 0}, "prompt", "invalid_request"),
        ({"prompt": "a", "model": "other"}, "model", "model_not_found"),
    ]
    for body, param, code in cases:
        r = _post(st, "/v1/completions", body)
        assert 400 <= r.status_code < 500, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == code, (body, err)
    r = _post(st, "/v1/score", {"records": [{"x": "a", "y": "b", "label": 1}], "features": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "records[0].label"
    r = _post(st, "/v1/completions", b"[1, 2]")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_logit_bias_steers_generation(small_server, tiny):
    """+100 on a token makes greedy decoding pick it; -100 on the argmax moves the choice to
    the runner-up; the log-probs are of the biased distribution; echoed ones are unbiased."""
    st, _ = small_server
    _, model, tok = tiny
    ids = tok.encode("Once upon a time")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    first, second = logits.topk(2).indices.tolist()
    forced = 1234
    for max_tokens in (1, 3):
        r = _post(st, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": 1,
                                          "logit_bias": {str(forced): 100}})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [tok.decode([forced])] * max_tokens
        biased = logits.clone()
        biased[forced] += 100
        assert abs(lp["token_logprobs"][0] - float(biased.log_softmax(-1)[forced])) <= 1e-4
    r = _post(st, "/v1/completions", {"prompt": ids, "max_tokens": 1, "logprobs": 0,
                                      "echo": True, "logit_bias": {str(first): -100}})
    out = r.json()["choices"][0]["logprobs"]
    assert out["tokens"][-1] == tok.decode([second])
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    assert abs(out["token_logprobs"][1] - float(full[0, ids[1]])) <= 1e-4  # echo: unbiased
    for bad in ({"abc": 1}, {"-1": 1}, {str(10**9): 1}, {"5": 101}):
        r = _post(st, "/v1/completions", {"prompt": "a", "max_tokens": 1, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", bad


# --------------------------------------------------------------------------- the scheduler


def test_max_size_score_request_cannot_starve_small_completions(tiny):
    """One maximum-size /v1/score request (16 records of 512 tokens, ICQS and every feature:
    ~4 s alone on an idle 2-core box, cut into 17 chunks of ~0.25 s) and, once it runs, 20 small
    completions at once. The bound: each small request waits for at most one of the large
    request's chunks (counted on the server, no clock: the chunks that end between its
    admission and its answer) and answers within 30 s (~80x the 0.4 s it takes here idle, a
    margin for a loaded box; without the round robin every small one waited for the whole
    large request and finished after it); the large request finishes last and correct."""
    d, model, tok = tiny
    # The price: 16 records x 5 passes (2 x 2 ICQS contexts, the features) + the prefixes.
    srv = _server(tiny, max_prompts=16, max_prompt_tokens=512,
                  max_request_tokens=16 * 512 * 5 + 64, max_batch_tokens=2048, max_queue=64)
    word = tok.encode("lorem ipsum dolor sit amet " * 120)
    x, y = tok.decode(word[:250]), tok.decode(word[:260])
    rec_tokens = len(tok.encode(x)) + len(tok.encode(y))
    assert 500 <= rec_tokens <= 512
    big = {"records": [{"x": x, "y": y}] * 16, "features": True}
    chunk_ends: list[float] = []
    tickets = []
    score, submit = srv.scoring.score_chunk, srv.queue.submit

    def timed_score(*a, **kw):
        out = score(*a, **kw)
        chunk_ends.append(time.monotonic())
        return out

    def kept_submit(*a, **kw):
        t = submit(*a, **kw)
        tickets.append(t)
        return t

    srv.scoring.score_chunk, srv.queue.submit = timed_score, kept_submit
    with ServerThread(srv) as st:
        async def run():
            async with httpx.AsyncClient(base_url=st.base_url, timeout=120) as c:
                big_task = asyncio.ensure_future(c.post("/v1/score", json=big))
                t0 = time.monotonic()
                while not chunk_ends and time.monotonic() - t0 < 60:
                    await asyncio.sleep(0.005)

                async def small(i):
                    t = time.monotonic()
                    r = await c.post("/v1/completions", json={
                        "prompt": f"hello {i}", "max_tokens": 1, "echo": True, "logprobs": 1})
                    return r, time.monotonic() - t, time.monotonic()

                smalls = await asyncio.gather(*(small(i) for i in range(20)))
                return await big_task, smalls, time.monotonic()

        big_r, smalls, big_done = asyncio.run(run())
    assert big_r.status_code == 200, big_r.text[:300]
    data = big_r.json()["data"]
    assert [o["index"] for o in data] == list(range(16))
    assert all(o["features"]["n_tokens"] == data[0]["features"]["n_tokens"] for o in data)
    assert len(chunk_ends) == 16
    lat = sorted(s[1] for s in smalls)
    print(f"\nsmall completions under a max-size /v1/score: p50 {lat[10]:.2f} s, p99 "
          f"{lat[-1]:.2f} s, max {lat[-1]:.2f} s; the large request took "
          f"{big_done - tickets[0].arrived:.2f} s")
    for r, seconds, done in smalls:
        assert r.status_code == 200, r.text
        assert seconds <= 30.0
        assert done <= big_done
    for t in tickets[1:]:  # the small ones, on the server's clock
        waited = sum(1 for e in chunk_ends if t.arrived < e <= t.finished)
        assert waited <= 1, (waited, len(chunk_ends))


def _slow_server(tiny, **cfg):
    """The tiny server whose log-prob engine calls take 0.3 s more each (a slow model)."""
    srv = _server(tiny, **cfg)
    run = srv.run_logprobs

    def slow(prompts, top_n):
        time.sleep(0.3)
        return run(prompts, top_n)

    srv.queue.run_logprobs = slow
    return srv


def test_deadline_gives_504_and_drops_the_rest(tiny):
    """A request of 16 chunks of 0.3 s each and a 1 s deadline: 504, and the chunks after the
    deadline never run."""
    srv = _slow_server(tiny, request_timeout=1.0, max_batch_tokens=8, max_prompts=16,
                       max_request_tokens=1000)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 16  # one 8-token chunk each
    with ServerThread(srv) as st:
        r = _post(st, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True})
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["code"] == "deadline_exceeded" and "--request-timeout" in err["message"]
        t0 = time.monotonic()
        while srv.queue.pending and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert srv.queue.pending == 0 and srv.queue.timed_out == 1
        assert srv.queue.batches < 16  # the remaining chunks were dropped
        ok = _post(st, "/v1/completions", {"prompt": "a", "max_tokens": 0, "echo": True})
        assert ok.status_code == 200  # and the server goes on


def test_disconnected_client_cancels_its_work(tiny):
    srv = _slow_server(tiny, max_batch_tokens=8, max_prompts=16, max_request_tokens=1000)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * 16
    with ServerThread(srv) as st:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the socket
            httpx.post(st.base_url + "/v1/completions", timeout=1.0,
                       json={"prompt": prompts, "max_tokens": 0, "echo": True})
        t0 = time.monotonic()
        while (srv.queue.pending or not srv.queue.cancelled) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert srv.queue.cancelled == 1 and srv.queue.pending == 0
        assert srv.queue.batches < 16
        metrics = httpx.get(st.base_url + "/metrics", timeout=10).text
        assert 'icqs_serve_rejected_requests_total{reason="client_disconnected"} 1.0' in metrics


def test_work_queue_round_robin_interleaves_a_small_ticket():
    """The queue alone: a ticket of 6 units, then a small one while the first unit runs: the
    small one runs right after that unit, not after all six."""
    from icqs_fast.serve.queue import Unit, WorkQueue

    order = []
    started, release = threading.Event(), threading.Event()

    def big_unit(k):
        def fn():
            if k == 0:
                started.set()
                release.wait(10)
            order.append(f"B{k}")
        return fn

    def run_logprobs(prompts, top_n):
        order.append("S")
        return [sum(p) for p in prompts]

    q = WorkQueue(run_logprobs, batch_wait_s=0.0)
    q.start()
    try:
        big = q.submit([Unit("call", 1, big_unit(k)) for k in range(6)], 6)
        assert started.wait(10)
        small = q.submit_logprobs([[1, 2]], 0)
        release.set()
        assert small.result(timeout=10) == [3]
        big.future.result(timeout=10)
        assert order[:2] == ["B0", "S"] and len(order) == 7, order
    finally:
        q.stop()


# --------------------------------------------------------------------------- metrics, quiet


def test_metrics_in_prometheus_format(small_server):
    from prometheus_client.parser import text_string_to_metric_families

    st, _ = small_server
    _post(st, "/v1/completions", {"prompt": "metrics please", "max_tokens": 0, "echo": True})
    _post(st, "/v1/completions", {"prompt": "a", "bogus": 1})
    httpx.get(st.base_url + "/no/such/route", timeout=10)
    r = httpx.get(st.base_url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in fams.values() for s in f.samples}
    assert samples[("icqs_serve_requests_total",
                    (("route", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("icqs_serve_requests_total", (("route", "other"), ("status", "404")))] >= 1
    assert samples[("icqs_serve_rejected_requests_total",
                    (("reason", "unsupported_field"),))] >= 1
    assert ("icqs_serve_request_duration_seconds_count", (("route", "/v1/completions"),)) \
        in samples
    for name in ("icqs_serve_queue_depth_prompts", "icqs_serve_queue_depth_requests",
                 "icqs_serve_prompt_tokens", "icqs_serve_batches", "icqs_serve_chunks",
                 "icqs_serve_deadline_exceeded", "icqs_serve_cancelled"):
        assert name in fams, name
    assert samples[("icqs_serve_prompt_tokens_total", (("route", "/v1/completions"),))] >= 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_quiet_first_run_prints_nothing(tmp_path):
    """``serve --quiet`` with an empty model cache (the GGUF conversion runs, ~25 s): nothing on
    stdout or stderr, start-up, conversion, loading and requests included."""
    env = {**os.environ, "ICQS_FAST_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "icqs_fast.cli", "serve", "--quiet",
                             "--port", str(port), "--threads", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240 and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert (tmp_path / "cache").is_dir()  # the conversion did run
    assert out == b"" and err == b"", err[-2000:]
