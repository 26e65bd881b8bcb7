"""Continuous batching in the server's worker (:mod:`icqs_fast.serve.queue`): every step runs one
token of every live generation and one round-robin slice of the other work, the log-prob prompts
of several requests packed up to ``prefill_tokens``; the results equal serving alone.

The queue tests use fake engines (counts and orders only, no clocks); the server tests use the
tiny random Llama at float32 on 127.0.0.1.
"""

import threading
import time

import httpx
import pytest
import torch
from _helpers import save_tiny_llama

from icqs_fast.serve.app import ServeConfig, Server
from icqs_fast.serve.logprobs import prompt_logprobs
from icqs_fast.serve.queue import Unit, WorkQueue
from icqs_fast.serve.runner import ServerThread

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

# The bound on the echo log-probs of a passage served alone vs in a mixed batch, at
# float32 (nats per token).
FP32_TOL = 1e-3


class Counter:
    """A fake generation (a queue Stepper): ``n`` steps; records each step in ``log``."""

    def __init__(self, name: str, n: int, log: list) -> None:
        self.name, self.n, self.log, self.k = name, n, log, 0

    def step(self) -> bool:
        self.k += 1
        self.log.append(self.name)
        return self.k >= self.n

    def result(self):
        return f"{self.name}:{self.k}"

    def close(self) -> None:
        pass


def _recorded(q: WorkQueue) -> list:
    """``(ticket, kind of the unit it runs, whether that is a live generation)`` of each step
    the queue runs, in order (wraps ``run_step``)."""
    steps: list = []
    run_step = q.run_step

    def kept(step):
        steps.append([(t, t.next_unit.kind, t.next_unit.live) for t in step])
        return run_step(step)

    q.run_step = kept
    return steps


def test_every_step_carries_each_live_generation_and_one_budgeted_slice():
    """Two live generations and log-prob work of 3 requests (one of 5 prompts): every step
    after the generations started runs one token of each, and log-prob prompts of at most
    prefill_tokens tokens (one longer prompt alone); the 5-prompt unit spreads over steps and
    its results come back whole, in order."""
    engine: list[list[int]] = []
    log: list[str] = []

    def run(prompts, top_n):
        engine.append([len(p) for p in prompts])
        return [sum(p) for p in prompts]

    q = WorkQueue(run, batch_wait_s=0.0, prefill_tokens=8, max_live_steps=4)
    steps = _recorded(q)
    gens = [q.submit([Unit("steps", 10, lambda n=n: Counter(n, 12, log))], 1)
            for n in ("a", "b")]
    many = [[1] * 3, [2] * 3, [3] * 3, [4] * 3, [5] * 3]  # 15 tokens: over two slices
    lp = [q.submit_logprobs(many, 0), q.submit_logprobs([[7] * 12], 0),  # longer: alone
          q.submit_logprobs([[9, 9]], 0)]
    q.start()
    try:
        assert [g.future.result(timeout=10) for g in gens] == [["a:12"], ["b:12"]]
        assert lp[0].result(timeout=10) == [3, 6, 9, 12, 15]
        assert lp[1].result(timeout=10) == [84] and lp[2].result(timeout=10) == [18]
    finally:
        q.stop()
    assert all(sum(b) <= 8 or len(b) == 1 for b in engine), engine
    assert sorted(n for b in engine for n in b) == [2] + [3] * 5 + [12]
    assert len(engine) >= 3  # the 5-prompt unit took more than one slice
    both_live = [s for s in steps if sum(1 for _, _, live in s if live) == 2]
    assert q.decode_tokens == 22  # 2 x 12 tokens, the first of each in its own slice
    for s in steps:
        # The live generations first, then the slice: one generation's start, or log-prob
        # pieces only.
        lives = [live for _, _, live in s]
        assert lives == sorted(lives, reverse=True)
        piece = [k for _, k, live in s if not live]
        assert len(piece) <= 1 or set(piece) == {"logprobs"}, s
    assert len(both_live) >= 10
    assert log.count("a") == log.count("b") == 12


def test_a_slice_goes_round_robin_past_live_generations():
    """While a generation is live, call units of two requests alternate in the slices (round
    robin), each beside one token of the generation; the generation starts beside the first."""
    order: list[str] = []
    log: list[str] = []
    q = WorkQueue(lambda p, n: [0] * len(p), batch_wait_s=0.0)
    steps = _recorded(q)
    gen = q.submit([Unit("steps", 1, lambda: Counter("g", 7, log))], 1)
    a = q.submit([Unit("call", 1, lambda k=k: order.append(f"A{k}")) for k in range(3)], 1)
    b = q.submit([Unit("call", 1, lambda k=k: order.append(f"B{k}")) for k in range(3)], 1)
    q.start()
    try:
        for t in (gen, a, b):
            t.future.result(timeout=10)
    finally:
        q.stop()
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2"], order
    # Step 1 starts the generation beside A's first call (a short generation does not wait
    # for a slice's turn); steps 2-6 each carry its next token and one call.
    assert [len(s) for s in steps[:6]] == [2] * 6
    assert steps[0][0][:2] == (gen, "steps") and not steps[0][0][2]
    assert all(s[0][0] is gen and s[0][2] for s in steps[1:6])


class FakePrefill:
    """A fake chunked prompt (the queue's ``start_prefill``): records each chunk's tokens."""

    def __init__(self, prompt, top_n, chunks: list, closed: list) -> None:
        self.prompt, self.chunks, self.closed, self.pos = prompt, chunks, closed, 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.prompt)

    def step(self, tokens: int) -> bool:
        self.chunks.append(min(tokens, len(self.prompt) - self.pos))
        self.pos += self.chunks[-1]
        return self.done

    def result(self):
        return sum(self.prompt)

    def close(self) -> None:
        self.closed.append(len(self.prompt))


def test_a_prompt_over_the_budget_is_prefilled_in_chunks():
    """With a live generation and prefill_tokens 8, a 20-token prompt runs as chunks of 8, 8
    and 4 tokens in three steps, each beside the generation's token, and no step carries more
    than 8 prompt tokens; the results (and the short prompts' beside it) are those of serving
    alone; the chunked prompt's cache is released once it is done."""
    engine: list[list[int]] = []
    chunks: list[int] = []
    closed: list[int] = []
    log: list[str] = []

    def run(prompts, top_n):
        engine.append([len(p) for p in prompts])
        return [sum(p) for p in prompts]

    q = WorkQueue(run, batch_wait_s=0.0, prefill_tokens=8,
                  start_prefill=lambda p, n: FakePrefill(p, n, chunks, closed))
    gen = q.submit([Unit("steps", 4, lambda: Counter("g", 30, log))], 1)
    long = q.submit_logprobs([[2] * 3, [1] * 20, [3] * 2], 0)
    short = q.submit_logprobs([[5] * 6], 0)
    q.start()
    try:
        assert long.result(timeout=10) == [6, 20, 6] and short.result(timeout=10) == [30]
        gen.future.result(timeout=10)
    finally:
        q.stop()
    assert chunks == [8, 8, 4] and closed == [20]
    assert all(sum(b) <= 8 for b in engine), engine
    assert all(r.prefill_tokens <= 8 for r in q.step_log), list(q.step_log)
    assert sum(1 for r in q.step_log if r.decode and r.prefill_tokens) >= 3


def test_a_cancelled_chunked_prompt_releases_its_cache():
    """A request cancelled while its long prompt is part-way prefilled: the prefill is closed,
    and the queue serves the next request."""
    chunks: list[int] = []
    closed: list[int] = []
    gate = threading.Event()

    class Slow(FakePrefill):
        def step(self, tokens):
            gate.wait(5)
            return super().step(tokens)

    q = WorkQueue(lambda p, n: [sum(x) for x in p], batch_wait_s=0.0, chunk_tokens=4,
                  start_prefill=lambda p, n: Slow(p, n, chunks, closed))
    q.start()
    try:
        t = q.submit([Unit("logprobs", 12, ([[1] * 12], 0), 1)], 1)
        t0 = time.monotonic()
        while not t.running and time.monotonic() - t0 < 10:
            time.sleep(0.001)
        q.cancel(t, RuntimeError("gone"))
        gate.set()
        assert q.submit_logprobs([[4, 4]], 0).result(timeout=10) == [8]
    finally:
        q.stop()
    assert closed == [12] and sum(chunks) < 12


def test_the_step_log_says_what_each_step_carried_and_the_soak_sums_it_up():
    """Each step's record holds its live tokens, starts, prompt tokens and calls; the soak's
    summary groups the times by kind and lists the longest step first."""
    from icqs_fast.benchmarks.serve_soak import step_summary

    log: list[str] = []
    q = WorkQueue(lambda p, n: [0] * len(p), batch_wait_s=0.0, prefill_tokens=8)
    gen = q.submit([Unit("steps", 4, lambda: Counter("g", 3, log))], 1)
    lp = q.submit_logprobs([[1] * 5], 0)
    call = q.submit([Unit("call", 7, lambda: time.sleep(0.2))], 1)
    q.start()
    try:
        for f in (gen.future, lp, call.future):
            f.result(timeout=10)
    finally:
        q.stop()
    recs = list(q.step_log)
    assert len(recs) == q.steps == 3
    assert (recs[0].starts, recs[0].prefill_tokens, recs[0].carried) == (1, 5, "start+echo")
    assert (recs[1].decode, recs[1].calls, recs[1].call_cost, recs[1].carried) == (1, 1, 7,
                                                                                 "call")
    assert (recs[2].decode, recs[2].carried) == (1, "decode")
    assert abs(q.step_seconds - sum(r.seconds for r in recs)) < 1e-9
    summary = step_summary(recs)
    assert summary["all"]["n"] == 3 and summary["beside_decode"]["n"] == 2
    assert set(summary["by_kind"]) == {"start+echo", "call", "decode"}
    assert summary["longest"][0][:3] == [1, round(recs[1].seconds, 4), "call"]


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = save_tiny_llama(tmp_path_factory.mktemp("tiny_cb"), layers=2, max_positions=1024)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d)


def _ids(n: int, start: int) -> list[int]:
    return [start + (7 * k) % 90 for k in range(n)]


@pytest.mark.server
def test_mixed_batches_give_what_serving_alone_gives(tiny):
    """Echo requests sent while a generation streams (prefill budget 24 tokens: the prompts
    are packed together and a 40-token prompt is prefilled in chunks of 24 and 16) get the
    log-probs of each prompt scored alone (within 1e-3 nats / token at float32), and the
    generation the tokens it gets alone."""
    model, tok = tiny
    cfg = ServeConfig(model_name="tiny", prefill_budget=24, batch_wait_ms=1,
                      max_prompt_tokens=64, max_gen_tokens=64)
    prompts = [_ids(5, 3), _ids(11, 8), _ids(40, 2), _ids(7, 3), _ids(16, 30), _ids(9, 5)]
    gen_body = {"prompt": _ids(6, 11), "max_tokens": 48, "logprobs": 1}
    srv = Server(model, tok, cfg)
    steps = _recorded(srv.queue)
    prefilled: list[int] = []
    start_prefill = srv.queue.start_prefill
    assert start_prefill is not None  # the tiny Llama's prompts can be prefilled in chunks

    def counted(prompt, top_n):
        prefilled.append(len(prompt))
        return start_prefill(prompt, top_n)

    srv.queue.start_prefill = counted

    def slow(_module, _args):  # the generation stays live while the echoes run
        if threading.current_thread().name == "icqs-serve-worker":
            time.sleep(0.01)

    hook = model.get_input_embeddings().register_forward_pre_hook(slow)
    try:
        with ServerThread(srv) as st:
            alone_gen = httpx.post(st.base_url + "/v1/completions", json=gen_body,
                                   timeout=120).json()
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(gen=httpx.post(
                st.base_url + "/v1/completions", json=gen_body, timeout=120).json()))
            th.start()
            t0 = time.monotonic()
            while not srv.queue.live_steps and time.monotonic() - t0 < 60:
                time.sleep(0.002)
            results: list = [None] * len(prompts)

            def echo(i):
                results[i] = httpx.post(st.base_url + "/v1/completions", timeout=120, json={
                    "prompt": prompts[i], "max_tokens": 0, "echo": True, "logprobs": 1}).json()

            ths = [threading.Thread(target=echo, args=(i,)) for i in range(len(prompts))]
            for t in ths:
                t.start()
            for t in ths + [th]:
                t.join(timeout=120)
            health = httpx.get(st.base_url + "/health", timeout=30).json()
            metrics = httpx.get(st.base_url + "/metrics", timeout=30).text
    finally:
        hook.remove()
    # The worker's step counters reach /health and /metrics.
    assert health["steps"] == srv.queue.steps >= len(steps) > 0
    assert health["decode_tokens"] == srv.queue.decode_tokens > 0
    assert f"_steps_total {float(srv.queue.steps)}" in metrics
    assert f"_decode_tokens_total {float(srv.queue.decode_tokens)}" in metrics
    # Every token forwarded counts: the echo prompts (the generation's twice: once alone),
    # each generated token, the generation's prompt.
    assert f"_forward_tokens_total {float(srv.queue.forward_tokens)}" in metrics
    assert srv.queue.forward_tokens >= sum(map(len, prompts)) + srv.queue.decode_tokens
    assert "icqs_serve_step_seconds_total " in metrics and srv.queue.step_seconds > 0
    assert out["gen"]["choices"][0]["text"] == alone_gen["choices"][0]["text"]
    assert out["gen"]["choices"][0]["logprobs"]["token_logprobs"] == \
        alone_gen["choices"][0]["logprobs"]["token_logprobs"]
    mixed = [s for s in steps if any(k == "logprobs" for _, k, _ in s)
             and any(live for _, _, live in s)]
    assert mixed, "no step carried a generation's token beside echo work"
    assert srv.queue.largest_batch >= 2  # prompts of several requests shared a forward
    # The 40-token prompt ran in chunks of at most the budget beside the generation's tokens.
    assert prefilled == [40]
    assert all(r.prefill_tokens <= 24 for r in srv.queue.step_log if r.decode)
    for p, r in zip(prompts, results, strict=True):
        want = prompt_logprobs(model, [p], top_n=1)[0].token_logprobs
        got = r["choices"][0]["logprobs"]["token_logprobs"][1:]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= FP32_TOL


def test_a_generation_prefills_a_long_prompt_in_chunks(tiny):
    """A 40-token prompt with prefill_chunk 16: two steps of 16 prompt tokens and no token,
    then the last 8 with the first token; the tokens are those of the prompt run whole and
    their log-probs within float32 rounding (1e-4)."""
    from icqs_fast.serve.generation import GenerationOptions, GreedyGeneration

    model, tok = tiny
    seen: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(int(args[0].shape[1])))
    try:
        whole = GreedyGeneration(model, tok, _ids(40, 4), GenerationOptions(6, top_n=1))
        while not whole.step():
            pass
        seen.clear()
        chunked = GreedyGeneration(model, tok, _ids(40, 4),
                                  GenerationOptions(6, top_n=1, prefill_chunk=16))
        done = [chunked.step() for _ in range(8)]
    finally:
        hook.remove()
    assert done == [False] * 7 + [True]
    assert seen == [16, 16, 8, 1, 1, 1, 1, 1]
    assert [t for t, _, _ in chunked.result()] == [t for t, _, _ in whole.result()]
    assert max(abs(a[1] - b[1]) for a, b in zip(chunked.result(), whole.result(),
                                                 strict=True)) <= 1e-4
