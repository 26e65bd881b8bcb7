"""``icqs-fast bench serve --soak SECONDS``: ``icqs-fast serve`` under a steady mixed load.

The server runs in this process (a background thread on 127.0.0.1 and a free port, as in
``bench serve``); three kinds of clients (asyncio + httpx, real HTTP, in a process of their
own as real clients are) send requests back to back for ``SECONDS`` seconds, then stop sending
and wait for their last answers:

* ``--echo-clients`` (default 8): ``echo=true, max_tokens=0, logprobs=1`` of a prompt of 5-300
  random words (seeded);
* ``--gen-clients`` (default 2): ``--gen-tokens`` (default 32) greedy tokens, streamed
  (``stream=true``), so that the time to the first token and between tokens is measured as a
  client sees it;
* ``--score-clients`` (default 2): small ``/v1/score`` requests (one record, ICQS with 2
  ratios x 2 sets of one demonstration each).

The record has, per kind (``echo`` / ``generate`` / ``score``): ``sent``, ``ok``,
``requests_per_s``, ``latency_s_p50`` / ``p99`` and ``errors`` by status (``"timeout"`` and
``"transport"`` for answers that never came); for ``generate`` also ``ttft_s_p50`` / ``p99`` and
``itl_s_p50`` / ``p99`` (inter-token: between consecutive streamed pieces). ``rss_mb``: the
server's ``process_resident_memory_bytes`` scraped from ``/metrics`` every ``--rss-every``
seconds (``[seconds, MiB]``; the server's process: the clients run in another),
``rss_peak_mb`` (``icqs_serve_resident_memory_peak_bytes``) and
``rss_growth_pct_after_1min`` (last sample vs the first one after 60 s, when the run is longer).
``server_tokens_per_s``: prompt tokens of ``/v1/completions`` plus generated tokens, per second
of the run; ``engine_tokens_per_s``: the mean of ``engine_tokens_per_s_before`` / ``_after``,
the log-probs of 32 echo prompts like the clients' computed in-process right before and right
after the load (batches of the server's ``--max-batch-tokens``, nothing else running in this
process), and ``server_vs_engine`` their ratio. That ratio leaves out the ``/v1/score`` work
(its tokens are in no answer's usage): ``server_tokens["score_token_passes"]`` is that work
in token-passes (``icqs_serve_call_tokens_total``: each record read once per ICQS row and
for its features, each demonstration prefix once; what admission prices it at),
``server_work_tokens_per_s`` the answers' tokens plus those per second, and
``server_work_vs_engine`` its ratio to the engine's rate: the server's whole throughput under
the mix, all real tokens on both sides, what the issue's 70 % target reads.
``server_forward_tokens_per_s`` / ``engine_forward_tokens_per_s`` count the token ids that
entered the model's forwards (``icqs_serve_forward_tokens_total``), padding included, and
``server_forward_vs_engine`` their ratio (the engine's batches of prompts of 5-300 words pad
more than the server's budgeted slices).

``steps``: the worker's step times by what each step carried (:func:`step_summary`: per kind,
beside a live generation, the longest steps) and ``malloc_trims`` / ``malloc_trim_s``, the
allocator trims (:mod:`icqs_fast.serve.memory`) and their time.

``rss_growth_pct_min2_to_end`` (:func:`rss_growth`): the median RSS sample of the last minute
against the median of minute 2 (120-180 s; the issue's "minute 2 to minute 10" on a 10-minute
soak; None on a run shorter than 4 minutes). Medians of a minute, not single samples: the RSS
moves by about 10 % between two samples 5 s apart (a sample catches the worker inside a step,
its activations allocated, or between two), so a single sample at either end measures where in a
step it fell. ``rss_growth_pct_min2_to_end_samples``: that single-sample comparison (the last
sample against the first at 120 s or later), kept for comparison with older records;
``rss_trend_mb_per_min``: the least-squares slope of the samples from 120 s on.

``sigterm``: after the load, one more streamed generation is sent and, once its first token
arrived, the server gets what SIGTERM does (uvicorn's signal handler, called in-process: the
server runs in a thread, where no signal handler can be installed): ``stopped_s`` until the
server thread ended, the bound it must keep (``--shutdown-timeout`` plus uvicorn's margin,
plus 10 s for the worker's running forward), the in-flight request's status (200 when it
finished in time, 503 when it was cut; anything else fails). The exit status of a real process
after SIGTERM is covered by ``tests/test_serve_bounds.py``.

Correctness: ``passed`` is true when no answer was a 5xx, every request sent was answered
(no timeout, no transport error, no answer still arriving after 120 s), every echo returned
its prompt, every stream ended with ``data: [DONE]`` and the SIGTERM stop kept its bound; the
command exits 1 otherwise. ``done_when``: the issue's targets, each true / false (None when the
run is too short to tell): ``no_5xx``, ``none_over_120s``, ``gen_p99_le_30s`` (the
generation requests' latency), ``itl_p99_le_1s``, ``rss_growth_min2_le_10pct``,
``throughput_ge_70pct_of_engine`` (``server_work_vs_engine``), ``sigterm_within_bound``;
they do not change the exit status
(a busy machine moves them).

``--soak-as NAME`` with ``--out FILE``: the record is stored as ``FILE[NAME]``, the file's other
keys kept (``before`` / ``after`` records side by side).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there one all we their").split()
SCORE_ICQS = {"num_ratios": 2, "demos_per_set": 1, "sets_per_ratio": 2, "seed": 0}
GOOD = [["Review: fine", "positive"], ["Review: awful", "negative"]]
BAD = [["Review: fine", "negative"], ["Review: awful", "positive"]]
STREAM_ERROR_STATUS = {"deadline_exceeded": 504, "shutting_down": 503}
MAX_REQUESTS = 100_000  # a bound on the requests of one soak, whatever its length
CLIENT_TIMEOUT_S = 120.0  # the client timeout: an answer later than this is lost
# The targets ("Done when").
GEN_P99_S = 30.0
ITL_P99_S = 1.0
RSS_GROWTH_PCT = 10.0
ENGINE_FRACTION = 0.70
# Slack past the shutdown bound for the worker's running forward to end.
SIGTERM_SLACK_S = 10.0


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``xs`` (nearest rank; None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def echo_prompt(rng: random.Random) -> str:
    """A prompt of 5-300 random words."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))


class Kind:
    """What the clients of one request kind saw."""

    def __init__(self) -> None:
        self.sent = 0
        self.ok = 0
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.bad_answers = 0

    def summary(self, wall: float) -> dict[str, Any]:
        return {"sent": self.sent, "ok": self.ok,
                "requests_per_s": _r(self.ok / wall if wall > 0 else None),
                "latency_s_p50": _r(percentile(self.latencies, 50)),
                "latency_s_p99": _r(percentile(self.latencies, 99)),
                "errors": dict(self.errors), "bad_answers": self.bad_answers}


async def _load(base_url: str, seconds: float, clients: dict[str, int], gen_tokens: int,
                max_requests: int, rss_every: float, seed: int) -> dict[str, Any]:
    import httpx

    kinds = {k: Kind() for k in ("echo", "generate", "score")}
    ttft: list[float] = []
    itl: list[float] = []
    tokens = {"prompt": 0, "generated": 0}
    rss: list[list[float]] = []
    peak = [0.0]
    t_start = time.monotonic()
    stop_at = t_start + seconds
    budget = [max_requests]

    def more() -> bool:
        if time.monotonic() >= stop_at or budget[0] <= 0:
            return False
        budget[0] -= 1
        return True

    async def send(c: httpx.AsyncClient, kind: Kind, fn: Any) -> None:
        kind.sent += 1
        t0 = time.perf_counter()
        try:
            status = await fn()
        except httpx.TimeoutException:
            kind.errors["timeout"] += 1
            return
        except httpx.HTTPError as exc:
            kind.errors[f"transport:{type(exc).__name__}"] += 1
            return
        if status == 200:
            kind.ok += 1
            kind.latencies.append(time.perf_counter() - t0)
        else:
            kind.errors[str(status)] += 1

    async def echo_client(c: httpx.AsyncClient, rng: random.Random) -> None:
        while more():
            prompt = echo_prompt(rng)

            async def one(prompt: str = prompt) -> int:
                r = await c.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                          "max_tokens": 0, "logprobs": 1})
                if r.status_code == 200:
                    body = r.json()
                    if body["choices"][0]["text"] != prompt:
                        kinds["echo"].bad_answers += 1
                    tokens["prompt"] += body["usage"]["prompt_tokens"]
                return r.status_code

            await send(c, kinds["echo"], one)

    async def gen_client(c: httpx.AsyncClient, rng: random.Random) -> None:
        while more():
            prompt = "Write a short story about " + " ".join(rng.choice(WORDS) for _ in range(6))

            async def one(prompt: str = prompt) -> int:
                body = {"prompt": prompt, "max_tokens": gen_tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                t0 = time.perf_counter()
                last = None
                done = False
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:  # after the stream started: its status
                            return STREAM_ERROR_STATUS.get(chunk["error"].get("code"), 500)
                        if chunk.get("usage"):
                            tokens["prompt"] += chunk["usage"]["prompt_tokens"]
                            tokens["generated"] += chunk["usage"]["completion_tokens"]
                        if any(ch["text"] for ch in chunk["choices"]):
                            now = time.perf_counter()
                            if last is None:
                                ttft.append(now - t0)
                            else:
                                itl.append(now - last)
                            last = now
                if not done:
                    kinds["generate"].bad_answers += 1
                return 200

            await send(c, kinds["generate"], one)

    async def score_client(c: httpx.AsyncClient, rng: random.Random) -> None:
        while more():
            rec = {"x": "Review: " + " ".join(rng.choice(WORDS) for _ in range(8)),
                   "y": rng.choice(["positive", "negative"])}

            async def one(rec: dict = rec) -> int:
                r = await c.post("/v1/score", json={"records": [rec], "good": GOOD, "bad": BAD,
                                                    "icqs_options": SCORE_ICQS})
                if r.status_code == 200 and len(r.json()["data"]) != 1:
                    kinds["score"].bad_answers += 1
                return r.status_code

            await send(c, kinds["score"], one)

    async def sampler(c: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at or any_alive():
            try:
                text = (await c.get("/metrics")).text
            except httpx.HTTPError:
                text = ""
            for line in text.splitlines():
                if line.startswith("process_resident_memory_bytes "):
                    rss.append([round(time.monotonic() - t_start, 1),
                                round(float(line.split()[1]) / 2**20, 1)])
                elif line.startswith("icqs_serve_resident_memory_peak_bytes "):
                    peak[0] = max(peak[0], float(line.split()[1]) / 2**20)
            await asyncio.sleep(rss_every)

    tasks: list[asyncio.Task] = []

    def any_alive() -> bool:
        return any(not t.done() for t in tasks)

    limits = httpx.Limits(max_connections=sum(clients.values()) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S,
                                 limits=limits) as c:
        for n, (name, fn) in enumerate((("echo", echo_client), ("generate", gen_client),
                                        ("score", score_client))):
            tasks += [asyncio.ensure_future(fn(c, random.Random(seed * 1000 + 100 * n + i)))
                      for i in range(clients[name])]
        samp = asyncio.ensure_future(sampler(c))
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t_start
        await samp
    return {"kinds": kinds, "wall_s": wall, "ttft": ttft, "itl": itl, "tokens": tokens,
            "rss": rss, "rss_peak_mb": peak[0]}


def _load_sync(*args: Any) -> dict[str, Any]:
    return asyncio.run(_load(*args))


def load_in_subprocess(base_url: str, seconds: float, clients: dict[str, int],
                       gen_tokens: int, max_requests: int, rss_every: float,
                       seed: int) -> dict[str, Any]:
    """The clients' load (:func:`_load`) run in a process of its own, as real clients are:
    their HTTP and JSON work does not share this process's interpreter lock with the server's
    worker, and the RSS scraped is the server's alone."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_load_sync, base_url, seconds, clients, gen_tokens, max_requests,
                           rss_every, seed).result()


async def _stream_first_token(base_url: str, gen_tokens: int, started: threading.Event
                              ) -> int:
    """One streamed generation; ``started`` is set at its first streamed piece; the status it
    ended with (a streamed error event: its status; a dropped connection: 0)."""
    import httpx

    body = {"prompt": "Write a short story about the sea", "max_tokens": gen_tokens,
            "stream": True}
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                started.set()
                await r.aread()
                return r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    started.set()
                    return STREAM_ERROR_STATUS.get(chunk["error"].get("code"), 500)
                started.set()
            return 200
    except httpx.HTTPError:
        started.set()
        return 0


def sigterm_stop(st: Any, shutdown_timeout: float, gen_tokens: int) -> dict[str, Any]:
    """What SIGTERM does to the running server ``st`` (a ServerThread) while a generation
    streams: ``stopped_s``, ``bound_s``, ``in_flight_status``, ``ok``."""
    from icqs_fast.serve.runner import SHUTDOWN_MARGIN_S

    started = threading.Event()
    box: dict[str, int] = {}
    th = threading.Thread(target=lambda: box.update(
        status=asyncio.run(_stream_first_token(st.base_url, gen_tokens, started))),
        daemon=True)
    th.start()
    started.wait(CLIENT_TIMEOUT_S)
    t0 = time.monotonic()
    st.uv.handle_exit(signal.SIGTERM, None)
    bound = shutdown_timeout + SHUTDOWN_MARGIN_S + SIGTERM_SLACK_S
    st.thread.join(timeout=bound + 30)
    stopped = time.monotonic() - t0
    th.join(timeout=30)
    status = box.get("status")
    return {"stopped_s": round(stopped, 2), "bound_s": bound, "in_flight_status": status,
            "ok": not st.thread.is_alive() and stopped <= bound and status in (200, 503)}


def engine_rate(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str],
                chunk_tokens: int, pad_id: int,
                min_seconds: float = 5.0) -> tuple[float, float]:
    """The server's log-prob engine on ``prompts`` alone, in batches of about ``chunk_tokens``
    tokens (what the server's worker runs), repeated for at least ``min_seconds``:
    ``(prompt tokens per second, forward tokens per second)``. Forward tokens are counted as
    the server counts them (``icqs_serve_forward_tokens_total``: the input ids entering the
    model's input embeddings, padding included)."""
    from icqs_fast.serve.app import input_ids_count
    from icqs_fast.serve.logprobs import prompt_logprobs
    from icqs_fast.serve.queue import chunk_prompts

    ids = [list(tok(p)["input_ids"]) for p in prompts]
    batches = chunk_prompts(ids, chunk_tokens)
    prompt_logprobs(model, batches[0], top_n=1, pad_id=pad_id)  # warm-up
    counts: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: counts.append(input_ids_count(args)))
    try:
        n = 0
        t0 = time.perf_counter()
        while True:
            for b in batches:
                prompt_logprobs(model, b, top_n=1, pad_id=pad_id)
                n += sum(len(p) for p in b)
            sec = time.perf_counter() - t0
            if sec >= min_seconds:
                return n / sec, sum(counts) / sec
    finally:
        hook.remove()


def step_summary(log: list[Any], longest: int = 8) -> dict[str, Any]:
    """The worker's step times (:class:`icqs_fast.serve.queue.StepRecord` list) by what the
    steps carried: overall and per kind (``decode``, ``echo``, ``call``, ``start``, ...) the
    count, p50 / p99 / max seconds and the most prompt tokens / call cost; ``beside_decode``:
    the steps that carried a live generation's token (what the inter-token latency is made
    of); ``longest``: the longest steps, ``[index in the log, seconds, kind, decode,
    prefill_tokens, call_cost]``."""
    def dist(steps: list[Any]) -> dict[str, Any]:
        secs = [s.seconds for s in steps]
        return {"n": len(steps), "p50_s": _r(percentile(secs, 50), 4),
                "p99_s": _r(percentile(secs, 99), 4), "max_s": _r(max(secs, default=None), 4),
                "prefill_tokens_max": max((s.prefill_tokens for s in steps), default=0),
                "call_cost_max": max((s.call_cost for s in steps), default=0)}

    kinds: dict[str, list[Any]] = {}
    for s in log:
        kinds.setdefault(s.carried, []).append(s)
    top = sorted(range(len(log)), key=lambda i: -log[i].seconds)[:longest]
    return {"all": dist(log), "beside_decode": dist([s for s in log if s.decode]),
            "by_kind": {k: dist(v) for k, v in sorted(kinds.items())},
            "longest": [[i, _r(log[i].seconds, 4), log[i].carried, log[i].decode,
                         log[i].prefill_tokens, log[i].call_cost] for i in top]}


def soak(model_name: str | None, seconds: float, *, echo_clients: int = 8,
         gen_clients: int = 2, score_clients: int = 2, gen_tokens: int = 32,
         max_requests: int = MAX_REQUESTS, rss_every: float = 5.0, device: str = "cpu",
         engine_seconds: float = 5.0, seed: int = 0, dtype: str = "auto",
         prefill_budget: int | None = None) -> dict[str, Any]:
    """The soak record (fields: the module docstring). ``dtype``: as ``serve --dtype``
    (``"auto"``, serve's default, is what the issue's targets are stated at);
    ``prefill_budget``: the server's ``--prefill-budget`` (None: serve's default)."""
    from icqs_fast.models import bound_kernel_caches, dtype_name, load_model
    from icqs_fast.serve.app import ServeConfig, Server
    from icqs_fast.serve.runner import ServerThread

    if seconds <= 0 or min(echo_clients, gen_clients, score_clients) < 0 or gen_tokens < 1:
        raise ValueError("--soak must be > 0 seconds, client counts >= 0, --gen-tokens >= 1")
    caches = bound_kernel_caches()  # as load_model does; the values for the record
    model, tok = load_model(None if model_name in (None, "embedded") else model_name,
                            dtype=dtype, device=device)
    clients = {"echo": echo_clients, "generate": gen_clients, "score": score_clients}
    budget = {} if prefill_budget is None else {"prefill_budget": int(prefill_budget)}
    cfg = ServeConfig(model_name="bench", max_queue=max(256, 4 * sum(clients.values())),
                      **budget)
    srv = Server(model, tok, cfg)
    # The engine's rate on echo prompts like the clients', before and after the load (the
    # shared machine's other work moves it; the record keeps both).
    sample = [echo_prompt(random.Random(seed + 7919 + i)) for i in range(32)]
    eng_before = engine_rate(model, tok, sample, cfg.max_batch_tokens, srv.pad_id,
                             engine_seconds)
    st = ServerThread(srv).start()
    try:
        srv.queue.step_log.clear()
        fwd0, call0 = srv.queue.forward_tokens, srv.queue.call_tokens
        res = load_in_subprocess(st.base_url, seconds, clients, gen_tokens, max_requests,
                                 rss_every, seed)
        fwd = srv.queue.forward_tokens - fwd0
        call_tokens = srv.queue.call_tokens - call0
        steps = step_summary(list(srv.queue.step_log))
        steps["malloc_trims"] = srv.trimmer.trims
        steps["malloc_trim_s"] = round(srv.trimmer.seconds, 3)
        sigterm = sigterm_stop(st, cfg.shutdown_timeout, gen_tokens)
    finally:
        st.stop()
    wall = res["wall_s"]
    kinds: dict[str, Kind] = res["kinds"]
    rec: dict[str, Any] = {"model": model_name or "embedded", "dtype": dtype_name(model),
                           "soak_s": seconds, "kernel_caches": caches,
                           "clients": clients, "gen_tokens": gen_tokens,
                           "prefill_budget": cfg.prefill_budget,
                           "wall_s": round(wall, 1)}
    for name, kind in kinds.items():
        rec[name] = kind.summary(wall)
    # Microseconds: a small model's inter-token gaps are well under a millisecond.
    rec["generate"].update({"ttft_s_p50": _r(percentile(res["ttft"], 50), 6),
                            "ttft_s_p99": _r(percentile(res["ttft"], 99), 6),
                            "itl_s_p50": _r(percentile(res["itl"], 50), 6),
                            "itl_s_p99": _r(percentile(res["itl"], 99), 6),
                            "itl_samples": len(res["itl"])})
    rec["steps"] = steps
    rss = res["rss"]
    rec["rss_mb"] = rss
    rec["rss_peak_mb"] = round(res["rss_peak_mb"], 1)
    after = [mb for t, mb in rss if t >= 60]
    rec["rss_growth_pct_after_1min"] = (round(100 * (after[-1] / after[0] - 1), 1)
                                        if len(after) >= 2 else None)
    rec.update(rss_growth(rss))
    toks = res["tokens"]
    server_tps = (toks["prompt"] + toks["generated"]) / wall if wall > 0 else 0.0
    server_ftps = fwd / wall if wall > 0 else 0.0
    work = toks["prompt"] + toks["generated"] + call_tokens
    server_wtps = work / wall if wall > 0 else 0.0
    rec["server_tokens"] = {**toks, "score_token_passes": call_tokens}
    rec["server_tokens_per_s"] = round(server_tps, 1)
    rec["server_work_tokens_per_s"] = round(server_wtps, 1)
    rec["server_forward_tokens"] = fwd
    rec["server_forward_tokens_per_s"] = round(server_ftps, 1)
    eng_after = engine_rate(model, tok, sample, cfg.max_batch_tokens, srv.pad_id,
                            engine_seconds)
    eng = (eng_before[0] + eng_after[0]) / 2
    eng_f = (eng_before[1] + eng_after[1]) / 2
    rec["engine_tokens_per_s_before"] = round(eng_before[0], 1)
    rec["engine_tokens_per_s_after"] = round(eng_after[0], 1)
    rec["engine_tokens_per_s"] = round(eng, 1)
    rec["engine_forward_tokens_per_s"] = round(eng_f, 1)
    rec["server_vs_engine"] = round(server_tps / eng, 3) if eng > 0 else None
    rec["server_work_vs_engine"] = round(server_wtps / eng, 3) if eng > 0 else None
    rec["server_forward_vs_engine"] = round(server_ftps / eng_f, 3) if eng_f > 0 else None
    five_xx = sum(n for k in kinds.values() for s, n in k.errors.items()
                  if s.isdigit() and int(s) >= 500)
    unanswered = sum(n for k in kinds.values() for s, n in k.errors.items()
                     if not s.isdigit())
    bad = sum(k.bad_answers for k in kinds.values())
    # A streamed answer still arriving after the client's timeout counts as unanswered too
    # (httpx's timeout is between reads, not for the whole answer).
    late = sum(1 for k in kinds.values() for t in k.latencies if t > CLIENT_TIMEOUT_S)
    rec["sigterm"] = sigterm
    rec["checks"] = {"five_xx": five_xx, "unanswered": unanswered, "bad_answers": bad,
                     f"over_{CLIENT_TIMEOUT_S:g}s": late, "sigterm_ok": sigterm["ok"]}
    rec["passed"] = five_xx == 0 and unanswered == 0 and bad == 0 and late == 0 and \
        sigterm["ok"]
    rec["done_when"] = done_when(rec)
    return rec


def rss_growth(rss: list[list[float]], start_s: float = 120.0,
               window_s: float = 60.0) -> dict[str, float | None]:
    """RSS growth from minute 2 to the end of ``rss`` (``[seconds, MiB]`` samples): the
    ``rss_growth_pct_min2_to_end`` (window medians), ``..._samples`` (single samples) and
    ``rss_trend_mb_per_min`` fields of the record (the module docstring)."""
    import statistics

    later = [(t, mb) for t, mb in rss if t >= start_s]
    end = rss[-1][0] if rss else 0.0
    out: dict[str, float | None] = {"rss_growth_pct_min2_to_end": None,
                                    "rss_growth_pct_min2_to_end_samples": None,
                                    "rss_trend_mb_per_min": None}
    if len(later) < 2 or end < start_s + window_s:
        return out
    out["rss_growth_pct_min2_to_end_samples"] = round(100 * (later[-1][1] / later[0][1] - 1), 1)
    out["rss_trend_mb_per_min"] = round(statistics.linear_regression(
        [t / 60 for t, _ in later], [mb for _, mb in later]).slope, 2)
    first = [mb for t, mb in later if t < start_s + window_s]
    last = [mb for t, mb in later if t >= end - window_s]
    if end >= start_s + 2 * window_s and first and last:
        out["rss_growth_pct_min2_to_end"] = round(
            100 * (statistics.median(last) / statistics.median(first) - 1), 1)
    return out


def done_when(rec: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's targets on a soak record (see the module docstring)."""
    def le(x: float | None, bound: float) -> bool | None:
        return None if x is None else x <= bound

    gen = rec["generate"]
    frac = rec["server_work_vs_engine"]
    return {"no_5xx": rec["checks"]["five_xx"] == 0,
            "none_over_120s": rec["checks"]["unanswered"] == 0
            and rec["checks"][f"over_{CLIENT_TIMEOUT_S:g}s"] == 0,
            "gen_p99_le_30s": le(gen["latency_s_p99"], GEN_P99_S),
            "itl_p99_le_1s": le(gen["itl_s_p99"], ITL_P99_S),
            "rss_growth_min2_le_10pct": le(rec["rss_growth_pct_min2_to_end"], RSS_GROWTH_PCT),
            "throughput_ge_70pct_of_engine": None if frac is None else frac >= ENGINE_FRACTION,
            "sigterm_within_bound": rec["sigterm"]["ok"]}


def write_record(rec: dict[str, Any], out: str, key: str) -> None:
    """Store ``rec`` as ``out[key]`` (indented JSON), the file's other keys kept (written
    whole: a crash mid-write never loses the records already there)."""
    from icqs_fast.io.files import write_whole

    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = rec
    write_whole(path, json.dumps(data, indent=2) + "\n")


def add_arguments(p: Any) -> None:
    """The soak's flags (on ``bench serve``)."""
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="mixed soak instead of the load test: echo, streamed generation and "
                   "/v1/score clients for SECONDS, then per-kind latency, TTFT / inter-token "
                   "latency, RSS over time and throughput vs the engine")
    p.add_argument("--soak-dtype", default="auto",
                   help="soak: the server model's dtype, as serve --dtype (default auto, "
                   "serve's default)")
    p.add_argument("--echo-clients", type=int, default=8, help="soak: echo-logprob clients")
    p.add_argument("--gen-clients", type=int, default=2, help="soak: generation clients")
    p.add_argument("--score-clients", type=int, default=2, help="soak: /v1/score clients")
    p.add_argument("--gen-tokens", type=int, default=32,
                   help="soak: tokens per generation (default 32)")
    p.add_argument("--rss-every", type=float, default=5.0,
                   help="soak: seconds between RSS samples (default 5)")
    p.add_argument("--prefill-budget", type=int, default=None, metavar="N",
                   help="soak: the server's --prefill-budget (default: serve's)")
    p.add_argument("--soak-as", default=None, metavar="NAME",
                   help="soak: with --out, store the record as the file's NAME key (e.g. "
                   "before / after), its other keys kept")


def run_soak(args: Any) -> dict[str, Any]:
    """The soak record of ``bench serve --soak`` (``args``: its parsed flags)."""
    return soak(args.model, args.soak, echo_clients=args.echo_clients,
                gen_clients=args.gen_clients, score_clients=args.score_clients,
                gen_tokens=args.gen_tokens,
                rss_every=args.rss_every, device=args.device, dtype=args.soak_dtype,
                prefill_budget=args.prefill_budget)


__all__ = ["add_arguments", "done_when", "echo_prompt", "engine_rate", "load_in_subprocess",
           "percentile", "rss_growth", "run_soak", "sigterm_stop", "soak", "step_summary",
           "write_record"]
