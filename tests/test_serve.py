"""``icqs-fast serve`` end to end on the tiny model: the real server (uvicorn, 127.0.0.1, a free
port, in a thread) answered by the ``openai`` client and by lm-eval's ``local-completions``
model, equal to the in-process computation; the queue's 429, the API key's 401, the body
limit's 413, bad requests' 4xx; the non-local bind refusal; /v1/score; ``bench serve``."""

import json
import threading
import time

import httpx
import pytest
import torch
from _helpers import save_tiny_llama

from icqs_fast.serve.app import ServeConfig, Server
from icqs_fast.serve.logprobs import prompt_cuts, prompt_logprobs
from icqs_fast.serve.runner import ServerThread, is_loopback

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = save_tiny_llama(tmp_path_factory.mktemp("tiny_serve"), layers=2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return str(d), model, AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def server(tiny):
    d, model, tok = tiny
    srv = Server(model, tok, ServeConfig(model_name=d, max_body_bytes=20000))
    with ServerThread(srv) as st:
        yield st, srv


def _full_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def test_prompt_logprobs_equal_plain_forward(tiny):
    """Shared prefixes, a prompt that is another's prefix, duplicates, a one-token prompt:
    every position's log-prob and top-3 as a plain forward of the prompt alone."""
    _, model, tok = tiny
    texts = ["Review: great film\nSentiment: positive", "Review: great film\nSentiment: negative",
             "Review: great", "Hello there, a prompt of its own", "Review: great film\nSentiment:"
             " positive", "x"]
    prompts = [tok.encode(t) for t in texts]
    cuts = prompt_cuts(prompts)
    assert cuts[0] == cuts[4] and cuts[0][-1] == len(prompts[0]) and len(cuts[0]) > 2
    for small in (False, True):  # also tiny forwards: several batches
        res = prompt_logprobs(model, prompts, top_n=3, token_budget=8 if small else 16384)
        for ids, r in zip(prompts, res, strict=True):
            lp = _full_logprobs(model, ids)
            assert len(r.token_logprobs) == len(r.top) == len(ids) - 1
            for i in range(1, len(ids)):
                assert abs(r.token_logprobs[i - 1] - float(lp[i - 1, ids[i]])) <= TOL
                assert [t for t, _ in r.top[i - 1]] == lp[i - 1].topk(3).indices.tolist()
            assert r.next_token == int(lp[-1].argmax())
            assert abs(r.next_logprob - float(lp[-1].max())) <= TOL


def test_openai_client_echo_logprobs(server, tiny):
    """The real openai client parses echo + logprobs answers; numbers equal the in-process
    computation (a plain forward and the continuations engine)."""
    import openai

    from icqs_fast.engine.continuations import score_continuations

    st, _ = server
    d, model, tok = tiny
    client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [d]
    prompts = ["Question: which planet is the largest?\nAnswer: Jupiter",
               "Question: which planet is the largest?\nAnswer: Saturn",
               "Something else entirely."]
    resp = client.completions.create(model=d, prompt=prompts, echo=True, max_tokens=0,
                                     logprobs=3)
    assert len(resp.choices) == 3
    for ch, text in zip(sorted(resp.choices, key=lambda c: c.index), prompts, strict=True):
        ids = tok.encode(text)
        lp = ch.logprobs
        assert ch.text == text and len(lp.tokens) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
        full = _full_logprobs(model, ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - float(full[i - 1, ids[i]])) <= TOL
            top = full[i - 1].topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(lp.top_logprobs[i][tok.decode([t])] - v) <= TOL
        # The continuation engine's sum over the answer tokens (context: the first 2 tokens).
        ref = score_continuations(model, [(ids[:2], ids[2:])])[0].loglik
        assert abs(sum(lp.token_logprobs[2:]) - ref) <= TOL
    # max_tokens=1 (what lm-eval sends): the greedy next token is appended.
    one = client.completions.create(model=d, prompt=[tok.encode(prompts[0])], echo=True,
                                    max_tokens=1, logprobs=1, temperature=0)
    ids = tok.encode(prompts[0])
    full = _full_logprobs(model, ids)
    lp = one.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.tokens[-1] == tok.decode([int(full[-1].argmax())])
    assert abs(lp.token_logprobs[-1] - float(full[-1].max())) <= TOL
    # No echo, no generation: an empty choice.
    none = client.completions.create(model=d, prompt="hello", max_tokens=0)
    assert none.choices[0].text == "" and none.choices[0].logprobs is None


def test_greedy_generation(server, tiny):
    """max_tokens > 1: greedy tokens as transformers' generate, each token's log-prob as a plain
    forward of prompt + generated tokens; a stop string cuts the text."""
    import openai

    st, _ = server
    d, model, tok = tiny
    client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="unused", max_retries=0)
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    out = client.completions.create(model=d, prompt=prompt, max_tokens=5, temperature=0,
                                    logprobs=2)
    ch = out.choices[0]
    assert ch.text == tok.decode(ref) and out.usage.completion_tokens == 5
    assert ch.finish_reason == "length" and len(ch.logprobs.token_logprobs) == 5
    full = _full_logprobs(model, ids + ref)
    for k, t in enumerate(ref):
        assert abs(ch.logprobs.token_logprobs[k] - float(full[len(ids) + k - 1, t])) <= TOL
    stop = tok.decode(ref[2:4])
    if stop and stop not in tok.decode(ref[:2]):
        cut = client.completions.create(model=d, prompt=prompt, max_tokens=5, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == tok.decode(ref)[: tok.decode(ref).find(stop)]
    # echo + generation: the prompt's log-probs, then the generated tokens'.
    both = client.completions.create(model=d, prompt=prompt, max_tokens=3, temperature=0,
                                     echo=True, logprobs=1)
    lp = both.choices[0].logprobs
    assert both.choices[0].text == prompt + tok.decode(ref[:3])
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None


def test_lm_eval_local_completions_equals_icqs_fast(server, tiny, tmp_path):
    """lm-eval's local-completions model against the server gives the icqs-fast lm-eval
    model's (in-process) log-likelihoods and is_greedy on a small local task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from icqs_fast.benchmarks.lm_eval import write_sst2_task
    from icqs_fast.compat.lm_eval import ICQSFastLM

    st, srv = server
    d, model, tok = tiny
    sents = ["a charming film", "dull and tedious", "a delight from start to end",
             "i walked out", "clever, funny and warm", "a mess", "the best of the year",
             "boring", "wonderful acting", "not worth it"]
    rows = [{"sentence": s, "label": i % 2} for i, s in enumerate(sents)]
    task = write_sst2_task(tmp_path, rows, shots=2, pool=4)
    before = srv.queue.batched_prompts
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    remote = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={st.base_url}/v1/completions,model={d},tokenizer={d},"
                   "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,max_length=512",
        tasks=[task], limit=6, bootstrap_iters=0, log_samples=True, task_manager=tm)
    local = lm_eval.simple_evaluate(
        model=ICQSFastLM(model=model, tokenizer=tok), tasks=[task], limit=6, bootstrap_iters=0,
        log_samples=True, task_manager=tm)
    assert srv.queue.batched_prompts - before == 12  # 6 documents x 2 choices, all served
    a, b = (sorted(o["samples"][task], key=lambda s: s["doc_id"]) for o in (remote, local))
    assert len(a) == len(b) == 6
    for sa, sb in zip(a, b, strict=True):
        assert sa["arguments"] == sb["arguments"]
        for (ra,), (rb,) in zip(sa["resps"], sb["resps"], strict=True):
            assert abs(ra[0] - rb[0]) <= TOL, (ra, rb)
            assert ra[1] == rb[1]
    assert remote["results"][task]["acc,none"] == local["results"][task]["acc,none"]


def test_bad_requests_get_4xx(server):
    st, _ = server
    c = httpx.Client(base_url=st.base_url, timeout=30)
    cases = [
        (b"not json", 400), (b"[1, 2]", 400),
        (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400),  # over the limit
        (json.dumps({"prompt": "x", "max_tokens": 1, "temperature": 0.7}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 99}).encode(), 400),
        (json.dumps({"prompt": "", "max_tokens": 0, "echo": True}).encode(), 400),
        (json.dumps({"prompt": [[1, 10**9]], "max_tokens": 0, "echo": True}).encode(), 400),
        (json.dumps({"prompt": {"a": 1}, "max_tokens": 0}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0, "stream_options": {}}).encode(), 400),
        (json.dumps({"prompt": "x", "max_tokens": 0, "model": "nope"}).encode(), 404),
        (json.dumps({"prompt": "word " * 600, "max_tokens": 0, "echo": True}).encode(), 400),
        (json.dumps({"records": [{"x": "a"}]}).encode(), 400),
    ]
    for body, status in cases:
        url = "/v1/score" if b"records" in body else "/v1/completions"
        r = c.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:60], r.status_code, r.text)
        assert r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "x" * 30000})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for _ in range(30):
            yield b"x" * 1000

    r = c.post("/v1/completions", content=chunks())
    assert r.status_code == 413
    assert c.get("/v1/nothing").status_code == 404
    assert c.get("/health").json()["status"] == "ok"  # still serving


def test_queue_full_gives_429(tiny):
    d, model, tok = tiny
    srv = Server(model, tok, ServeConfig(model_name=d, max_queue=1, max_prompts=1,
                                         batch_wait_ms=1500))
    body = {"prompt": "hold the queue", "echo": True, "max_tokens": 0, "logprobs": 1}
    with ServerThread(srv) as st:
        first = {}
        th = threading.Thread(target=lambda: first.update(
            r=httpx.post(st.base_url + "/v1/completions", json=body, timeout=60)))
        th.start()
        t0 = time.monotonic()
        while srv.queue.pending == 0 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        r = httpx.post(st.base_url + "/v1/completions", json=body, timeout=60)
        th.join()
    assert r.status_code == 429 and r.headers.get("retry-after") == "1"
    assert "queue is full" in r.json()["error"]["message"]
    assert first["r"].status_code == 200
    assert srv.queue.rejected == 1


def test_api_key(tiny):
    import openai

    d, model, tok = tiny
    srv = Server(model, tok, ServeConfig(model_name=d, api_key="sekret"))
    with ServerThread(srv) as st:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, url in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                ("POST", "/v1/score"), ("GET", "/health")):
                r = httpx.request(method, st.base_url + url, headers=headers, timeout=30)
                assert r.status_code == 401, (headers, url)
                assert "API key" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="sekret", max_retries=0)
        out = client.completions.create(model=d, prompt="ok", echo=True, max_tokens=0,
                                        logprobs=0)
        assert out.choices[0].text == "ok"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=st.base_url + "/v1", api_key="bad",
                          max_retries=0).models.list()


def test_non_local_bind_needs_api_key(monkeypatch, capsys):
    from icqs_fast.cli import main

    monkeypatch.delenv("ICQS_FAST_API_KEY", raising=False)
    for host in ("0.0.0.0", "192.168.1.5", "::"):
        assert main(["serve", "--host", host]) == 2
        assert "without an API key" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_score_endpoint_equals_in_process(server, tiny):
    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.features.extract import glassbox

    st, srv = server
    _, model, tok = tiny
    good = [["Review: fine", "positive"], ["Review: awful", "negative"]] * 3
    bad = [["Review: fine", "negative"], ["Review: awful", "positive"]] * 3
    opts = {"num_ratios": 3, "demos_per_set": 2, "sets_per_ratio": 2, "seed": 1}
    recs = [{"x": "Review: lovely", "y": "positive"}, {"x": "Review: grim", "y": "positive"}]
    r = httpx.post(st.base_url + "/v1/score", timeout=60, json={
        "records": recs, "good": good, "bad": bad, "icqs_options": opts,
        "features": ["sent_logprob", "softmax_ent"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    scorer = ICQSScorer(model, tok, [tuple(g) for g in good], [tuple(b) for b in bad], **opts)
    ref = list(scorer.score([(x["x"], x["y"]) for x in recs]))
    feats = glassbox(model, tok, [{"instruction": x["x"], "response": x["y"]} for x in recs],
                     features=["sent_logprob", "softmax_ent"])
    for got, want, f in zip(data, ref, feats, strict=True):
        assert got["icqs"]["score"] == pytest.approx(want.score, abs=1e-5)  # posterior mean
        assert torch.allclose(torch.tensor(got["icqs"]["loglik"]), want.loglik, atol=TOL)
        assert abs(got["features"]["sent_logprob"] - f["sent_logprob"]) <= TOL
    # Calibrated, continuous scores: the engine's, with the raw loglik kept beside
    # the baseline; a bad option value is a 400 naming it before anything is queued.
    cal = {**opts, "calibration": "content_free", "score": "mean"}
    before = srv.queue.forward_tokens
    r = httpx.post(st.base_url + "/v1/score", timeout=60, json={
        "records": recs, "good": good, "bad": bad, "icqs_options": cal})
    assert r.status_code == 200, r.text
    # The ICQS forwards count in icqs_serve_forward_tokens_total: the demonstration prefixes
    # and at least one token per record under each of the 3 x 2 contexts.
    assert srv.queue.forward_tokens - before >= len(recs) * 6 + 2 * 4
    ref = list(ICQSScorer(model, tok, [tuple(g) for g in good], [tuple(b) for b in bad],
                          **cal).score([(x["x"], x["y"]) for x in recs]))
    for got, want in zip(r.json()["data"], ref, strict=True):
        assert abs(got["icqs"]["score"] - want.score) <= 1e-6
        assert torch.allclose(torch.tensor(got["icqs"]["loglik"]), want.loglik, atol=TOL)
        assert torch.allclose(torch.tensor(got["icqs"]["loglik_baseline"]),
                              want.loglik_baseline, atol=TOL)
    for bad_opts, word in (({"calibration": "zhao"}, "calibration"), ({"score": 1}, "argmax")):
        r = httpx.post(st.base_url + "/v1/score", timeout=60, json={
            "records": recs, "good": good, "bad": bad, "icqs_options": bad_opts})
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    # An empty response: NaN features go out as null (JSON has no NaN).
    r = httpx.post(st.base_url + "/v1/score", timeout=60, json={
        "records": [{"instruction": "Say nothing", "response": ""}], "features": ["softmax_ent"]})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["features"]["softmax_ent"] is None
    # No demonstrations at server start and none in the request: a clear 400.
    r = httpx.post(st.base_url + "/v1/score", json={"records": recs, "icqs": True}, timeout=60)
    assert r.status_code == 400 and "demonstrations" in r.json()["error"]["message"]


def test_bench_serve(tiny, capsys):
    from icqs_fast.cli import main

    d, _, _ = tiny
    assert main(["bench", "serve", "--json", "--model", d, "--requests", "24", "--clients", "6",
                 "--max-seconds", "60"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["passed"] and rec["ok"] == rec["sent"] == 24
    assert rec["lost"] == rec["mismatched"] == 0 and rec["max_abs_diff"] <= TOL
    assert rec["latency_ms_p50"] <= rec["latency_ms_p90"] <= rec["latency_ms_p99"]
    assert rec["requests_per_s"] > 0 and rec["batches"] >= 1
    assert rec["mean_batch_prompts"] > 1  # concurrent requests shared engine calls
    # The mixed workload: large requests beside the small ones, p50/p99 per class, and the
    # same load unchunked for the chunk's throughput cost.
    assert main(["bench", "serve", "--json", "--model", d, "--requests", "12", "--clients", "4",
                 "--large", "1", "--large-prompts", "4", "--large-tokens", "200",
                 "--max-batch-tokens", "256", "--compare-unchunked", "--max-seconds", "60"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["passed"] and rec["large_ok"] == 1 and rec["small"]["n"] == 12
    assert rec["large_class"]["latency_ms_p50"] <= rec["large_class"]["latency_ms_p99"]
    assert rec["unchunked"]["prompt_tokens_per_s"] > 0 and "chunk_throughput_cost_pct" in rec


def test_work_queue_batches_requests_that_arrive_together():
    """Jobs within batch_wait of the first run as one engine call, each job getting its own
    slice back; a failing batch is retried job by job so one bad job fails only itself; the
    queue refuses past max_pending."""
    from icqs_fast.serve.queue import QueueFull, WorkQueue

    calls = []

    def run(prompts, top_n):
        calls.append([list(p) for p in prompts])
        if any(p == [666] for p in prompts):
            raise ValueError("bad prompt")
        return [sum(p) + top_n for p in prompts]

    q = WorkQueue(run, max_pending=4, batch_wait_s=0.3)
    q.start()
    try:
        futs = [q.submit_logprobs([[1, 2]], 0), q.submit_logprobs([[3], [4, 5]], 1)]
        with pytest.raises(QueueFull, match="queue is full"):
            q.submit_logprobs([[7], [8]], 0)  # 3 pending + 2 > 4
        assert [f.result(timeout=10) for f in futs] == [[4], [4, 10]]  # top_n: the batch's max
        assert calls == [[[1, 2], [3], [4, 5]]] and q.batches == 1 and q.largest_batch == 2
        good, bad = q.submit_logprobs([[1]], 0), q.submit_logprobs([[666]], 0)
        assert good.result(timeout=10) == [1]
        with pytest.raises(ValueError, match="bad prompt"):
            bad.result(timeout=10)
        assert q.submit_call(lambda: "called").result(timeout=10) == "called"
        assert q.pending == 0
    finally:
        q.stop()
