"""Every request bounded before it runs, and cut when its time is up: ``icqs-fast serve`` on
127.0.0.1 with the tiny model, tried as a hostile client would.

* Every option that scales work, at its largest legal value (served) and one past it (400 / 413
  naming its flag, refused before anything is queued), the request's price included.
* The issue's stall: 10,000 one-character ``stop`` strings are refused under the default flags,
  and served in as many worker steps as tokens when the flag allows them.
* A small request beside the largest legal request of each kind waits for at most one step of
  the worker (counted on the server: the steps that end between its admission and its answer).
* A deadline or a disconnect stops the running work at the next forward (counted: forwards run
  after the request ended), and the next request is served right after.
* SIGTERM / SIGINT while a maximum-size request runs: 503 for it, exit status 0, bounded.

The worker's forwards are slowed by a hook (a fixed sleep per forward, on the worker thread
only) so that large requests span many steps; every assertion is on counts, never on clocks.
"""

import asyncio
import json
import math
import os
import random
import signal
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
from icqs_fast.serve.generation import StopStrings
from icqs_fast.serve.runner import ServerThread

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

GOOD = [("Review: fine", "positive"), ("Review: awful", "negative")] * 2
BAD = [("Review: fine", "negative"), ("Review: awful", "positive")] * 2
SMALL_ICQS = {"num_ratios": 2, "demos_per_set": 1, "sets_per_ratio": 2, "seed": 0}
# The limits of the small server: every one reachable by a request that runs in well under a
# second on the tiny model.
LIMITS = dict(model_name="tiny", max_prompt_tokens=32, max_prompts=4, max_gen_tokens=6,
              max_logprobs=3, max_stop=3, max_stop_chars=5, max_logit_bias=4, max_num_ratios=3,
              max_sets_per_ratio=2, max_demos_per_set=2, max_request_tokens=100_000,
              max_batch_tokens=32, batch_wait_ms=1, max_body_bytes=400_000)
SLOW_FORWARD_S = 0.15  # the hook's sleep per worker forward
SMALL = {"prompt": [7, 8], "max_tokens": 0, "echo": True, "logprobs": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = save_tiny_llama(tmp_path_factory.mktemp("tiny_bounds"), layers=2, max_positions=1024)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return str(d), model, AutoTokenizer.from_pretrained(d)


def _server(tiny, **cfg):
    _, model, tok = tiny
    return Server(model, tok, ServeConfig(**{**LIMITS, **cfg}), good=GOOD, bad=BAD,
                  icqs_options=SMALL_ICQS)


def _post(base_url, path, body, timeout=120.0):
    return httpx.post(base_url + path, content=json.dumps(body).encode(), timeout=timeout,
                      headers={"content-type": "application/json"})


class Recorder:
    """The server's tickets (in admission order) and its worker's steps and forwards, each
    stamped with ``time.monotonic()`` (only their order is used). Slows every worker forward
    by ``slow`` seconds."""

    def __init__(self, srv: Server, slow: float = 0.0) -> None:
        self.srv, self.slow = srv, slow
        self.tickets: list = []
        self.admitted: dict[int, float] = {}  # id(ticket) -> when it was in the queue
        self.steps: list[tuple[float, list, int]] = []  # (end, tickets, live generations)
        self.forwards: list[float] = []  # start of each worker forward
        submit = srv.queue.submit

        def kept_submit(*a, **kw):
            t = submit(*a, **kw)
            # Stamped once the ticket is in the queue: from then on, a step that ends puts
            # the ticket it served behind this one.
            self.admitted[id(t)] = time.monotonic()
            self.tickets.append(t)
            return t

        srv.queue.submit = kept_submit
        run_step = srv.queue.run_step

        def kept_step(step):
            out = run_step(step)
            # Stamped before the loop answers the step's tickets.
            self.steps.append((time.monotonic(), list(step), srv.queue.live_steps))
            return out

        srv.queue.run_step = kept_step

        def forward_hook(_module, _args):
            if threading.current_thread().name == "icqs-serve-worker":
                self.forwards.append(time.monotonic())
                if self.slow:
                    time.sleep(self.slow)

        self.hook = srv.model.get_input_embeddings().register_forward_pre_hook(forward_hook)

    def close(self) -> None:
        self.hook.remove()

    def waited(self, t) -> int:
        """Steps of other work that ended between ``t``'s admission and its answer."""
        return sum(1 for end, step, _ in self.steps
                   if self.admitted[id(t)] < end <= t.finished and t not in step)

    def served(self, t) -> int:
        """Steps that served ``t``."""
        return sum(1 for _, step, _ in self.steps if t in step)

    def wait_running(self, t, seconds: float = 60.0) -> None:
        """Until ``t`` has been served at least once (bounded)."""
        t0 = time.monotonic()
        while not self.served(t) and time.monotonic() - t0 < seconds:
            time.sleep(0.005)
        assert self.served(t), "the large request never started"

    def wait_idle(self, seconds: float = 60.0) -> None:
        t0 = time.monotonic()
        q = self.srv.queue
        while (q.pending or q.live_steps) and time.monotonic() - t0 < seconds:
            time.sleep(0.01)
        time.sleep(4 * SLOW_FORWARD_S)  # a forward that was running when the ticket ended


# --------------------------------------------------------------------------- limits


def _ids(n: int, start: int = 5) -> list[int]:
    return [start + (k % 50) for k in range(n)]


def _score_body(n_records: int = 1, tokens_y: str = "positive", **icqs) -> dict:
    return {"records": [{"x": "Review: nice", "y": tokens_y}] * n_records, "features": True,
            "icqs_options": {**SMALL_ICQS, **icqs}}


# (name, route, largest legal body, one past it, status, the flag the message names)
LIMIT_CASES = [
    ("prompts", "/v1/completions", {"prompt": [[5, 6]] * 4, "max_tokens": 0, "echo": True},
     {"prompt": [[5, 6]] * 5, "max_tokens": 0, "echo": True}, 400, "--max-prompts"),
    ("prompt tokens", "/v1/completions", {"prompt": _ids(32), "max_tokens": 0, "echo": True},
     {"prompt": _ids(33), "max_tokens": 0, "echo": True}, 400, "--max-prompt-tokens"),
    ("max_tokens", "/v1/completions", {"prompt": [5], "max_tokens": 6},
     {"prompt": [5], "max_tokens": 7}, 400, "--max-gen-tokens"),
    ("logprobs", "/v1/completions", {"prompt": [5, 6], "max_tokens": 0, "echo": True,
                                     "logprobs": 3},
     {"prompt": [5, 6], "max_tokens": 0, "echo": True, "logprobs": 4}, 400, "--max-logprobs"),
    ("stop count", "/v1/completions", {"prompt": [5], "max_tokens": 3, "stop": ["a", "b", "c"]},
     {"prompt": [5], "max_tokens": 3, "stop": ["a", "b", "c", "d"]}, 400, "--max-stop"),
    ("stop length", "/v1/completions", {"prompt": [5], "max_tokens": 3, "stop": ["zqzqz"]},
     {"prompt": [5], "max_tokens": 3, "stop": ["zqzqzq"]}, 400, "--max-stop-chars"),
    ("logit_bias", "/v1/completions",
     {"prompt": [5], "max_tokens": 2, "logit_bias": {str(k): 1 for k in range(10, 14)}},
     {"prompt": [5], "max_tokens": 2, "logit_bias": {str(k): 1 for k in range(10, 15)}}, 400,
     "--max-logit-bias"),
    ("records", "/v1/score", _score_body(4), _score_body(5), 400, "--max-prompts"),
    ("record tokens", "/v1/score", _score_body(1, "word " * 25), _score_body(1, "word " * 40),
     400, "--max-prompt-tokens"),
    ("num_ratios", "/v1/score", _score_body(num_ratios=3), _score_body(num_ratios=4), 400,
     "--max-num-ratios"),
    ("sets_per_ratio", "/v1/score", _score_body(sets_per_ratio=2),
     _score_body(sets_per_ratio=3), 400, "--max-sets-per-ratio"),
    ("demos_per_set", "/v1/score", _score_body(demos_per_set=2), _score_body(demos_per_set=3),
     400, "--max-demos-per-set"),
]


@pytest.fixture(scope="module")
def limited(tiny):
    srv = _server(tiny)
    with ServerThread(srv) as st:
        yield st, srv


@pytest.mark.parametrize("case", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_every_work_option_at_its_limit_and_one_past(limited, tiny, case):
    _, route, ok_body, over_body, status, flag = case
    st, srv = limited
    if case[0] == "record tokens":  # the record's tokens: at the limit, and past it
        tok = tiny[2]
        assert len(tok.encode("Review: nice")) + len(tok.encode("word " * 25)) <= 32
        assert len(tok.encode("Review: nice")) + len(tok.encode("word " * 40)) > 32
    r = _post(st.base_url, route, ok_body)
    assert r.status_code == 200, (case[0], r.text[:300])
    chunks = srv.queue.chunks
    r = _post(st.base_url, route, over_body)
    assert r.status_code == status, (case[0], r.status_code, r.text[:300])
    assert flag in r.json()["error"]["message"], r.text[:300]
    assert srv.queue.chunks == chunks  # refused before anything was queued


def _price_server(tiny, price: int) -> Server:
    return _server(tiny, max_request_tokens=price)


@pytest.mark.parametrize("kind", ["echo", "generation", "echo+generation", "score"])
def test_the_price_at_the_limit_and_one_past(tiny, kind):
    """The request's price (tokens x forward passes, as the README states it) equal to
    --max-request-tokens is served; one token-pass less of budget is a 413 naming the flag."""
    _, _, tok = tiny
    if kind == "score":
        rec = len(tok.encode("Review: nice")) + len(tok.encode("positive"))
        mean = max(sum(len(tok.encode(x)) + len(tok.encode(y)) for x, y in pool) / len(pool)
                   for pool in (GOOD, BAD))
        contexts = 3 * 2  # num_ratios x sets_per_ratio
        body = _score_body(2, num_ratios=3)
        # each record read once per context and once for the features; each context's prefix
        # (demos_per_set demonstrations of the longer pool's mean length) once
        price = 2 * rec * (contexts + 1) + contexts * math.ceil(1 * mean)
    else:
        prompts = [_ids(20), _ids(12)]
        echo, gen = kind != "generation", kind != "echo"
        body = {"prompt": prompts, "max_tokens": 6 if gen else 0, "echo": echo}
        # each prompt once for its log-probs, once more and one per new token to generate
        price = sum(len(p) * (echo + gen) + (6 if gen else 0) for p in prompts)
    for limit, status in ((price, 200), (price - 1, 413)):
        srv = _price_server(tiny, limit)
        with ServerThread(srv) as st:
            r = _post(st.base_url, "/v1/score" if kind == "score" else "/v1/completions", body)
        assert r.status_code == status, (kind, limit, r.text[:300])
        if status == 413:
            assert "--max-request-tokens" in r.json()["error"]["message"]


def test_stop_strings_10000_refused_by_default_served_when_allowed(tiny):
    """The issue's request: 10,000 one-character stop strings, max_tokens 2. Under the default
    flags: 400 naming --max-stop, nothing queued. With --max-stop 10000: served in two worker
    steps (one per token; no table over the vocabulary), and the server goes on."""
    _, model, tok = tiny
    stops = [chr(0x4E00 + i) for i in range(10_000)]
    body = {"prompt": "Once upon a time", "max_tokens": 2, "stop": stops}
    srv = Server(model, tok, ServeConfig(model_name="tiny"))
    with ServerThread(srv) as st:
        r = _post(st.base_url, "/v1/completions", body)
        assert r.status_code == 400 and "--max-stop" in r.json()["error"]["message"], r.text
        assert srv.queue.chunks == 0
        assert _post(st.base_url, "/v1/completions", SMALL).status_code == 200
    srv = Server(model, tok, ServeConfig(model_name="tiny", max_stop=10_000))
    rec = Recorder(srv)
    try:
        with ServerThread(srv) as st:
            r = _post(st.base_url, "/v1/completions", body)
            assert r.status_code == 200, r.text[:300]
            assert rec.served(rec.tickets[0]) == 2  # one step per generated token
            assert _post(st.base_url, "/v1/completions", SMALL).status_code == 200
    finally:
        rec.close()


def test_stop_strings_found_incrementally_as_in_the_whole_text():
    """StopStrings.first on the text grown piece by piece (searching only the new tail) finds
    the same earliest stop as a search of the whole text, at the first piece where one
    occurs."""
    rnd = random.Random(0)
    for _ in range(300):
        stops = StopStrings(["".join(rnd.choice("abc") for _ in range(rnd.randint(1, 4)))
                             for _ in range(rnd.randint(1, 5))] + [""])
        text, found = "", None
        while found is None and len(text) < 40:
            before = len(text)
            text += "".join(rnd.choice("abcd") for _ in range(rnd.randint(1, 3)))
            found = stops.first(text, before)
            whole = [text.find(s) for s in stops.stops if s in text]
            assert found == (min(whole) if whole else None), (stops.stops, text)


# --------------------------------------------------------------------------- fairness


def _largest(kind: str) -> tuple[str, dict]:
    """The largest legal request of each kind under LIMITS."""
    prompts = [_ids(32, 5 + k) for k in range(4)]
    if kind == "echo":
        return "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True,
                                   "logprobs": 3}
    if kind == "generation":
        return "/v1/completions", {"prompt": prompts, "max_tokens": 6, "echo": True,
                                   "logprobs": 3, "logit_bias": {str(k): 0.5 for k in range(4)}}
    if kind == "stop strings":
        return "/v1/completions", {"prompt": prompts, "max_tokens": 6, "logprobs": 3,
                                   "stop": ["\x01zqzq", "\x02zqzq", "\x03zqzq"]}
    return "/v1/score", {"records": [{"x": "Review: " + "good " * 10, "y": "fine " * 12}] * 4,
                         "features": True,
                         "icqs_options": {"num_ratios": 3, "sets_per_ratio": 2,
                                          "demos_per_set": 2, "calibration": "content_free"}}


@pytest.mark.parametrize("kind", ["echo", "generation", "stop strings", "score"])
def test_small_request_waits_at_most_one_step_beside_the_largest(tiny, kind):
    """While the largest legal request of a kind runs, a small echo request is admitted and
    answered after at most one step of other work (the one running when it arrived), and
    before the large one ends."""
    srv = _server(tiny, max_queue=64)
    rec = Recorder(srv, SLOW_FORWARD_S)
    route, big = _largest(kind)
    try:
        with ServerThread(srv) as st:
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(r=_post(st.base_url, route, big)))
            th.start()
            t0 = time.monotonic()
            while not rec.tickets and time.monotonic() - t0 < 60:
                time.sleep(0.005)
            big_t = rec.tickets[0]
            rec.wait_running(big_t)
            small = _post(st.base_url, "/v1/completions", SMALL)
            th.join(timeout=120)
    finally:
        rec.close()
    assert out["r"].status_code == 200, out["r"].text[:300]
    assert small.status_code == 200, small.text
    small_t = rec.tickets[1]
    assert rec.admitted[id(small_t)] < big_t.finished, "the large request ended first"
    assert small_t.finished < big_t.finished
    assert rec.waited(small_t) <= 1, (rec.waited(small_t), rec.served(big_t))
    assert rec.served(big_t) >= 3  # the large request did span several steps


def test_live_generations_are_bounded_and_echo_goes_past_them(tiny):
    """--max-live-generations 1: two generations at once never hold two KV caches; both are
    served, and a small echo request still waits for at most one step."""
    srv = _server(tiny, max_live_generations=1, max_queue=64)
    rec = Recorder(srv, SLOW_FORWARD_S)
    gen = {"prompt": [_ids(16), _ids(16, 9)], "max_tokens": 6}
    try:
        with ServerThread(srv) as st:
            async def run():
                async with httpx.AsyncClient(base_url=st.base_url, timeout=120) as c:
                    a = asyncio.ensure_future(c.post("/v1/completions", json=gen))
                    b = asyncio.ensure_future(c.post("/v1/completions", json=gen))
                    t0 = time.monotonic()
                    while len(rec.steps) < 3 and time.monotonic() - t0 < 60:
                        await asyncio.sleep(0.005)
                    small = await c.post("/v1/completions", json=SMALL)
                    return await a, await b, small

            a, b, small = asyncio.run(run())
    finally:
        rec.close()
    assert a.status_code == b.status_code == small.status_code == 200
    assert a.json()["choices"] == b.json()["choices"]
    assert max(live for _, _, live in rec.steps) == 1
    small_t = next(t for t in rec.tickets if t.units[0].kind == "logprobs")
    assert rec.waited(small_t) <= 1


# --------------------------------------------------------------------------- ending work


@pytest.mark.parametrize("end", ["deadline", "disconnect"])
@pytest.mark.parametrize("kind", ["generation", "score"])
def test_ended_request_stops_its_running_work(tiny, kind, end):
    """A request that ends (its deadline passes / its client disconnects) while its work runs:
    at most one forward runs after it ended (the one already running), a score record cut
    part-way counts as interrupted, no KV cache is kept, and the next request is served at
    once (no step of other work before it)."""
    # token_budget 16: a score record's rows take several forwards (a unit cut part-way).
    # Slowed forwards (0.25 s; the largest request takes 23 / 52 forwards) make the work far
    # longer than the 2 s deadline, and the deadline far longer than a loaded machine takes
    # to start the work, so the request ends while its work runs.
    cfg = {"request_timeout": 2.0} if end == "deadline" else {}
    srv = _server(tiny, token_budget=16, max_queue=64, **cfg)
    rec = Recorder(srv, 0.25)
    route, big = _largest(kind)
    try:
        with ServerThread(srv) as st:
            if end == "deadline":
                r = _post(st.base_url, route, big)
                assert r.status_code == 504, r.text[:300]
                assert "--request-timeout" in r.json()["error"]["message"]
            else:
                async def disconnect_once_running():
                    # The client gives up (closes its connection) once the worker has served
                    # the request, not after a fixed time a loaded machine may not start it in.
                    async with httpx.AsyncClient(base_url=st.base_url, timeout=120) as c:
                        task = asyncio.ensure_future(c.post(route, json=big))
                        t0 = time.monotonic()
                        while not (rec.tickets and rec.served(rec.tickets[0])) \
                                and not task.done() and time.monotonic() - t0 < 60:
                            await asyncio.sleep(0.005)
                        assert not task.done(), "the large request ended before it was cut"
                        task.cancel()
                        with pytest.raises(asyncio.CancelledError):
                            await task

                asyncio.run(disconnect_once_running())
            big_t = rec.tickets[0]
            rec.wait_idle()
            small = _post(st.base_url, "/v1/completions", SMALL)
    finally:
        rec.close()
    assert small.status_code == 200
    q = srv.queue
    assert big_t.done and q.pending == 0 and q.live_steps == 0
    assert (q.timed_out if end == "deadline" else q.cancelled) == 1
    after = sum(1 for f in rec.forwards if f > big_t.finished and f < rec.tickets[1].arrived)
    assert after <= 1, after
    if kind == "score":
        assert q.interrupted >= 1  # the record's unit stopped between two of its forwards
    assert rec.waited(rec.tickets[1]) == 0


# --------------------------------------------------------------------------- shutdown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_shutdown_while_busy(tiny, sig):
    """A real ``icqs-fast serve`` (tiny model, default limits, --shutdown-timeout 1) busy with
    a maximum-size generation (64 prompts, max_tokens 256: thousands of steps): the signal
    answers it with 503 and the process exits with status 0, well within the bound this test
    waits (60 s; the old server never exited while its worker was busy)."""
    d, _, _ = tiny
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "icqs_fast.cli", "serve", "--model", d,
                             "--port", str(port), "--threads", "1", "--quiet",
                             "--shutdown-timeout", "1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        big = {"prompt": [_ids(64, 5 + k) for k in range(64)], "max_tokens": 256}
        out: dict = {}
        th = threading.Thread(target=lambda: out.update(r=_post(base, "/v1/completions", big)))
        th.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:  # until the worker has served it a while
            if httpx.get(base + "/health", timeout=10).json()["chunks"] >= 20:
                break
            time.sleep(0.05)
        proc.send_signal(sig)
        t_sig = time.monotonic()
        rc = proc.wait(timeout=60)
        print(f"\n{sig.name}: exit status {rc}, {time.monotonic() - t_sig:.1f} s after the "
              "signal (--shutdown-timeout 1; the rest is the interpreter's own exit)")
        th.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert rc == 0, err[-2000:]
    assert out["r"].status_code == 503, out["r"].text[:300]
    assert out["r"].json()["error"]["code"] == "shutting_down"



def test_scores_stay_exact_when_a_request_sharing_the_scorer_is_cut(tiny):
    """Two requests' chunks share the server's kept ICQS scorer (calibrated, same answer, so
    the calibration rows are shared too). The first chunk is cut at its third forward, before
    its baseline rows ran (what the deadline / disconnect check does); the second is still
    scored exactly as in-process: no chunk reuses a scorer whose caches hold work that never
    ran."""
    import copy

    from icqs_fast.engine.scorer import ICQSScorer
    from icqs_fast.serve.queue import Interrupted
    from icqs_fast.serve.scoring import RequestScorer

    _, model, tok = tiny
    opts = {**SMALL_ICQS, "calibration": "content_free"}
    # token_budget 16: one row per forward, so the record's rows take many forwards.
    srv = Server(model, tok, ServeConfig(**{**LIMITS, "token_budget": 16}), good=GOOD,
                 bad=BAD, icqs_options=opts)
    y = "fine " * 12
    first = [{"x": "Review: a", "y": y, "reference": None}]
    second = [{"x": f"Review: b{i}", "y": y, "reference": None} for i in range(2)]
    held = RequestScorer(lambda: srv.scoring.new_scorer(None, None, {}))
    held.build()
    other = copy.copy(held)  # the second request holds the same scorer
    calls = {"n": 0}

    def cut_at_third(_module, _args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupted("the request ended")

    hook = model.get_input_embeddings().register_forward_pre_hook(cut_at_third)
    try:
        with pytest.raises(Interrupted):
            srv.scoring.score_chunk(first, 0, held, None)
    finally:
        hook.remove()
    got = srv.scoring.score_chunk(second, 0, other, None)
    ref = list(ICQSScorer(model, tok, GOOD, BAD, **opts, token_budget=16).score(
        [(r["x"], r["y"]) for r in second]))
    for item, want in zip(got, ref, strict=True):
        assert torch.allclose(torch.tensor(item.icqs.loglik), want.loglik, atol=1e-4)
        assert torch.allclose(torch.tensor(item.icqs.loglik_baseline), want.loglik_baseline,
                              atol=1e-4)
