"""``icqs-fast bench serve``: a load test of ``icqs-fast serve`` on 127.0.0.1.

Starts the server in this process (a background thread, 127.0.0.1 and a free port: the load
never leaves the machine), then ``--clients`` concurrent clients (asyncio + httpx) send
``--requests`` ``/v1/completions`` requests (``echo=True, max_tokens=0, logprobs=--logprobs``),
each with a prompt of its own: a shared few-shot prefix (``--shots`` demonstrations, so
requests that arrive together share it in one batch) and a question naming the request's
number. The run stops by itself after ``--requests`` requests or ``--max-seconds``, whichever
comes first (requests not sent by then are counted as ``not_sent``, not lost).

Every answer is checked against its own prompt: the echoed text must be the prompt sent and
the token log-probs must equal the in-process computation of that prompt alone (within
``TOL``); a response answered with another request's numbers, a missing or failed one counts
in ``mismatched`` / ``lost``, and the command exits 1 unless both are 0.

Fields: ``ok`` (200 answers), ``rejected_429`` (queue full; the client waits 50 ms and
retries, so these are not lost), ``lost``, ``mismatched``, ``max_abs_diff``, ``wall_s``,
``requests_per_s``, ``prompt_tokens_per_s``, ``latency_ms_p50/p90/p99`` (send to answer, per
request, retries included), ``batches`` and ``mean_batch_prompts`` (how many prompts the server
ran per engine call: > 1 means concurrent requests shared batches); ``sequential_s`` /
``sequential_requests_per_s``: the same prompts computed one at a time in-process right after
the load (the check's reference), the baseline on the same machine under the same load.

Mixed workload (``--large N``): ``N`` more clients each send one large request at the start
(``--large-prompts`` prompts of about ``--large-tokens`` tokens each, echo log-probs: the largest
request the server admits by default is 16 such prompts of 4096 tokens) while the small requests
run; ``small`` and ``large`` report ``latency_ms_p50`` / ``p99`` per class (the fairness the
server's chunking buys: small requests no longer wait for whole large ones), and
``prompt_tokens_per_s`` counts both classes. ``--compare-unchunked`` runs the same load again
with chunking off (``--max-batch-tokens`` 10^9: a request is one unit) and reports it under
``unchunked`` with ``chunk_throughput_cost_pct``, the throughput the chunk size costs.

``--soak SECONDS``: a mixed soak instead (echo, streamed generation and ``/v1/score`` clients;
:mod:`icqs_fast.benchmarks.serve_soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from icqs_fast.benchmarks import emit_record, environment, serve_soak
from icqs_fast.options import add_json_argument
from icqs_fast.threads import add_threads_argument, apply_threads

TOL = 1e-4
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?",
             "Which planet is the largest?", "What colour is the sky on a clear day?",
             "Who wrote Hamlet?", "What is two plus two?")


def make_prompts(n: int, shots: int) -> list[str]:
    """``n`` distinct prompts sharing a few-shot prefix of ``shots`` demonstrations."""
    demos = "".join(f"Q: {QUESTIONS[k % len(QUESTIONS)]} (example {k})\nA: answer {k}\n\n"
                    for k in range(shots))
    return [f"{demos}Q: request {i}: {QUESTIONS[i % len(QUESTIONS)]}\nA:" for i in range(n)]


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def make_large(n: int, prompts: int, tokens: int) -> list[list[str]]:
    """``n`` large requests of ``prompts`` distinct prompts of about ``tokens`` tokens."""
    words = max(1, tokens - 8)
    return [[f"Document {r}.{k}: " + " ".join(f"w{(r * 7919 + k * 104729 + j) % 997}"
                                               for j in range(words // 3))
             for k in range(prompts)] for r in range(n)]


async def _load(base_url: str, model: str, prompts: list[str], clients: int, max_seconds: float,
                logprobs: int, api_key: str | None,
                large: list[list[str]] | None = None) -> dict[str, Any]:
    import httpx

    nxt = 0
    out: dict[int, dict] = {}
    lat: list[float] = []
    large_lat: list[float] = []
    large_ok = [0]
    counts = {"rejected_429": 0, "errors": 0}
    deadline = time.monotonic() + max_seconds
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def large_client(c: httpx.AsyncClient, texts: list[str]) -> None:
        body = {"model": model, "prompt": texts, "echo": True, "max_tokens": 0,
                "logprobs": logprobs}
        t0 = time.perf_counter()
        while True:
            r = await c.post("/v1/completions", json=body, headers=headers)
            if r.status_code == 429 and time.monotonic() < deadline:
                counts["rejected_429"] += 1
                await asyncio.sleep(0.05)
                continue
            break
        large_lat.append((time.perf_counter() - t0) * 1000)
        if r.status_code == 200 and [ch["text"] for ch in sorted(
                r.json()["choices"], key=lambda ch: ch["index"])] == texts:
            large_ok[0] += 1

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal nxt
        while nxt < len(prompts) and time.monotonic() < deadline:
            i = nxt
            nxt += 1
            body = {"model": model, "prompt": prompts[i], "echo": True, "max_tokens": 0,
                    "logprobs": logprobs}
            t0 = time.perf_counter()
            while True:
                try:
                    r = await c.post("/v1/completions", json=body, headers=headers)
                except httpx.HTTPError as exc:
                    counts["errors"] += 1
                    out[i] = {"error": repr(exc)}
                    break
                if r.status_code == 429 and time.monotonic() < deadline:
                    counts["rejected_429"] += 1
                    await asyncio.sleep(0.05)
                    continue
                out[i] = r.json() if r.status_code == 200 else {"error": r.text,
                                                                 "status": r.status_code}
                break
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=max_seconds + 600) as c:
        await asyncio.gather(*(large_client(c, texts) for texts in large or ()),
                             *(client(c) for _ in range(clients)))
    return {"answers": out, "latencies_ms": lat, "wall_s": time.perf_counter() - t0,
            "large_latencies_ms": large_lat, "large_ok": large_ok[0], **counts}


def bench(model_name: str | None, *, clients: int = 16, requests: int = 200,
          max_seconds: float = 120.0, shots: int = 4, logprobs: int = 1,
          batch_wait_ms: float = 5.0, device: str = "cpu", large: int = 0,
          large_prompts: int = 16, large_tokens: int = 1024,
          max_batch_tokens: int | None = None, compare_unchunked: bool = False,
          threads: int | None = None) -> dict[str, Any]:
    from icqs_fast.models import load_model
    from icqs_fast.serve.app import ServeConfig, Server
    from icqs_fast.serve.logprobs import prompt_logprobs
    from icqs_fast.serve.runner import ServerThread

    if clients < 1 or requests < 1 or max_seconds <= 0:
        raise ValueError("--clients and --requests must be >= 1 and --max-seconds > 0")
    model, tok = load_model(None if model_name in (None, "embedded") else model_name,
                            dtype="float32", device=device)
    chunk = max_batch_tokens or ServeConfig().max_batch_tokens
    big = make_large(large, large_prompts, large_tokens)

    def served(chunk_tokens: int) -> tuple[Server, dict]:
        cfg = ServeConfig(model_name="bench", batch_wait_ms=batch_wait_ms,
                          max_queue=max(256, clients + large * large_prompts),
                          max_prompts=max(64, large_prompts),
                          max_request_tokens=max(65536, 2 * large_prompts * large_tokens),
                          max_batch_tokens=chunk_tokens)
        srv = Server(model, tok, cfg)
        with ServerThread(srv) as st:
            res = asyncio.run(_load(st.base_url, "bench", prompts, clients, max_seconds,
                                    logprobs, None, big))
        return srv, res

    prompts = make_prompts(requests, shots)
    unchunked = None
    if compare_unchunked:  # first, so the chunked run is not the one that warms the caches
        unchunked = served(10**9)[1]
    server, res = served(chunk)
    health = server.health()
    answers = res["answers"]
    # Each answer against its own prompt, computed alone in-process.
    lost = mismatched = 0
    max_diff = 0.0
    n_tokens = 0
    t_ref = time.perf_counter()
    for i, ans in sorted(answers.items()):
        if "choices" not in ans:
            lost += 1
            continue
        ids = list(tok(prompts[i])["input_ids"])
        n_tokens += len(ids)
        ref = prompt_logprobs(model, [ids], top_n=0, pad_id=server.pad_id)[0].token_logprobs
        ch = ans["choices"]
        got = ch[0]["logprobs"]["token_logprobs"][1:] if len(ch) == 1 else None
        if ch[0]["text"] != prompts[i] or got is None or len(got) != len(ref):
            mismatched += 1
            continue
        d = max((abs(a - b) for a, b in zip(got, ref, strict=True)), default=0.0)
        max_diff = max(max_diff, d)
        if d > TOL:
            mismatched += 1
    ref_s = time.perf_counter() - t_ref
    sent = len(answers)
    lat = res["latencies_ms"]
    wall = res["wall_s"]
    ok = sent - lost
    large_tokens_sent = sum(len(tok(t)["input_ids"]) for texts in big for t in texts)
    mixed: dict[str, Any] = {}
    if large:
        mixed = {"large": large, "large_prompts": large_prompts, "large_tokens": large_tokens,
                 "max_batch_tokens": chunk, "large_ok": res["large_ok"],
                 "small": _classes(lat), "large_class": _classes(res["large_latencies_ms"]),
                 "mixed_prompt_tokens_per_s": round((n_tokens + large_tokens_sent) / wall, 1)}
        if unchunked is not None:
            u_wall = unchunked["wall_s"]
            u_tps = (n_tokens + large_tokens_sent) / u_wall
            mixed["unchunked"] = {"wall_s": round(u_wall, 3),
                                  "prompt_tokens_per_s": round(u_tps, 1),
                                  "small": _classes(unchunked["latencies_ms"]),
                                  "large_class": _classes(unchunked["large_latencies_ms"])}
            mixed["chunk_throughput_cost_pct"] = round(
                100 * (1 - mixed["mixed_prompt_tokens_per_s"] / u_tps), 1)
    return {
        "model": model_name or "embedded", "clients": clients, "requests": requests,
        "max_seconds": max_seconds, "shots": shots, "logprobs": logprobs,
        "batch_wait_ms": batch_wait_ms, "sent": sent, "not_sent": requests - sent, "ok": ok,
        "rejected_429": res["rejected_429"], "lost": lost, "mismatched": mismatched,
        "max_abs_diff": max_diff, "wall_s": round(wall, 3),
        "requests_per_s": round(ok / wall, 2) if wall > 0 else None,
        "prompt_tokens_per_s": round(n_tokens / wall, 1) if wall > 0 else None,
        "latency_ms_p50": _round(_percentile(lat, 50)),
        "latency_ms_p90": _round(_percentile(lat, 90)),
        "latency_ms_p99": _round(_percentile(lat, 99)),
        "sequential_s": round(ref_s, 3),
        "sequential_requests_per_s": round(ok / ref_s, 2) if ref_s > 0 and ok else None,
        "batches": health["batches"],
        "mean_batch_prompts": round(health["batched_prompts"] / max(1, health["batches"]), 2),
        "largest_batch_requests": health["largest_batch"],
        "passed": lost == 0 and mismatched == 0 and res["large_ok"] == large,
        **mixed, "threads": threads,
    }


def _classes(lat: list[float]) -> dict[str, float | int | None]:
    return {"n": len(lat), "latency_ms_p50": _round(_percentile(lat, 50)),
            "latency_ms_p99": _round(_percentile(lat, 99))}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0].replace("``", "")
    add_json_argument(p, "print the record as one JSON object")
    p.add_argument("--model", default="embedded",
                   help="'embedded' (default) or a local Hugging Face model folder")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--requests", type=int, default=200, help="requests in all (default 200)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="stop sending after this many seconds (default 120)")
    p.add_argument("--shots", type=int, default=4, help="shared few-shot demonstrations")
    p.add_argument("--logprobs", type=int, default=1, help="top-N alternatives per token")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="the server's --batch-wait-ms (default 5)")
    p.add_argument("--device", default="cpu", help="the server's model device (default cpu)")
    p.add_argument("--large", type=int, default=0,
                   help="mixed workload: this many large requests beside the small ones")
    p.add_argument("--large-prompts", type=int, default=16, help="prompts per large request")
    p.add_argument("--large-tokens", type=int, default=1024,
                   help="tokens per prompt of a large request (about)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the server's chunk (default: serve's)")
    p.add_argument("--compare-unchunked", action="store_true",
                   help="run the load again without chunking: the chunk's throughput cost")
    add_threads_argument(p)
    p.add_argument("--out", default=None, help="also write the JSON record to this file")
    serve_soak.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    if args.soak is not None:
        try:
            rec = serve_soak.run_soak(args)
        except ValueError as exc:
            print(f"icqs-fast bench serve: {exc}", file=sys.stderr)
            return 2
        rec.update(environment(args.device))
        if args.out and args.soak_as:  # beside the file's other records
            serve_soak.write_record(rec, args.out, args.soak_as)
        emit_record(rec, out=None if args.soak_as else args.out, as_json=args.json)
        if not rec["passed"]:
            print(f"icqs-fast bench serve --soak: FAILED: {rec['checks']}", file=sys.stderr)
            return 1
        return 0
    rec = bench(args.model, clients=args.clients, requests=args.requests,
                max_seconds=args.max_seconds, shots=args.shots, logprobs=args.logprobs,
                batch_wait_ms=args.batch_wait_ms, device=args.device, large=args.large,
                large_prompts=args.large_prompts, large_tokens=args.large_tokens,
                max_batch_tokens=args.max_batch_tokens,
                compare_unchunked=args.compare_unchunked, threads=args.threads)
    rec.update(environment(args.device))
    emit_record(rec, out=args.out, as_json=args.json)
    if not rec["passed"]:
        print(f"icqs-fast bench serve: FAILED: {rec['lost']} lost, {rec['mismatched']} "
              "mismatched responses", file=sys.stderr)
        return 1
    return 0
