"""``GET /metrics``: the server's Prometheus metrics (prometheus-client, one registry per
:class:`icqs_fast.serve.app.Server`, so several servers in one process never share counters).

Request metrics are labelled by route; any path that is not a route of the server counts as
``other``, so a client (or a fuzzer) sending random paths cannot grow the label set. Queue
metrics are read from the :class:`icqs_fast.serve.queue.WorkQueue` at scrape time. The process's
memory is prometheus-client's process collector (``process_resident_memory_bytes``, CPU seconds,
open files; Linux) and ``icqs_serve_resident_memory_peak_bytes``, the high-water mark of the
resident set since the process started (the kernel's ``VmHWM``), so that a scrape every few
seconds still sees a peak between scrapes.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

PREFIX = "icqs_serve"
# Request latency buckets (seconds): a cached /health answer to a long /v1/score request.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark in bytes (``VmHWM`` of /proc/self/status;
    elsewhere ``ru_maxrss``, which Linux gives in KiB and macOS in bytes)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


class _MemoryCollector:
    """The resident-set high-water mark, read when scraped."""

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(f"{PREFIX}_resident_memory_peak_bytes",
                                "the most resident memory the process has held (bytes)",
                                peak_rss_bytes())

    def describe(self) -> Iterable[Any]:
        return []


class _QueueCollector:
    """Queue depth and the worker's counters, read when scraped."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def collect(self) -> Iterator[Any]:
        q = self.queue
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth_prompts",
                                "prompts (or records) admitted and not yet answered", q.pending)
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth_requests",
                                "requests admitted and not yet answered", q.queued_tickets)
        for name, doc, value in (
                ("batches", "log-prob engine calls (batches of prompts)", q.batches),
                ("batched_prompts", "prompts run in log-prob batches", q.batched_prompts),
                ("chunks", "units of work run (a large request is cut into several)", q.chunks),
                ("deadline_exceeded", "requests dropped at their deadline", q.timed_out),
                ("cancelled", "requests dropped because their client went away", q.cancelled),
                ("interrupted", "running chunks stopped part-way because their request had "
                 "ended", q.interrupted),
                ("steps", "worker steps (one token of every live generation and one slice of "
                 "other work each)", q.steps),
                ("decode_tokens", "tokens of started generations, run beside the slices",
                 q.decode_tokens),
                ("forward_tokens", "tokens that entered the model's forwards: every kind of "
                 "work (echo, prompts, generated tokens, /v1/score), padding included",
                 q.forward_tokens),
                ("call_tokens", "token-passes of the /v1/score work run (each record read once "
                 "per ICQS row and for its features, each demonstration prefix once)",
                 q.call_tokens),
                ("step_seconds", "wall time of the worker's steps (over steps_total: the mean "
                 "step, a generation's time between tokens)", q.step_seconds)):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value)

    def describe(self) -> Iterable[Any]:
        return []


class ServeMetrics:
    """The metrics of one server.

    Args:
        queue: its work queue.
        routes: the paths that get their own ``route`` label.
    """

    def __init__(self, queue: Any, routes: Iterable[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.routes = frozenset(routes)
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by route and "
                                "status", ["route", "status"], registry=self.registry)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds", "request latency, "
                                 "received to answered", ["route"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt (or record) tokens "
                                     "admitted, by route", ["route"], registry=self.registry)
        self.rejected = Counter(f"{PREFIX}_rejected_requests", "requests refused or dropped, "
                                "by reason (the error code)", ["reason"], registry=self.registry)
        self.registry.register(_QueueCollector(queue))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, ...
        self.registry.register(_MemoryCollector())

    def engine_plan(self, plan: dict) -> None:
        """``icqs_serve_engine_path{path, backend, fastest} 1``: the engine's plan for the
        served model (:meth:`icqs_fast.engine.capability.ModelPlan.as_meta`), so a scrape shows
        a server that runs a slower path than cascade attention, and on which backend."""
        g = Gauge(f"{PREFIX}_engine_path", "the engine's path for the served model (cascade, "
                  "kv-copy, plain), its kernel backend and whether it is the fastest path",
                  ["path", "backend", "fastest"], registry=self.registry)
        g.labels(plan["path"], plan["backend"], str(bool(plan["fastest"])).lower()).set(1)

    def route(self, path: str) -> str:
        """The ``route`` label of ``path``."""
        return path if path in self.routes else "other"

    def observe(self, path: str, status: int, seconds: float) -> None:
        """One answered request."""
        route = self.route(path)
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def reject(self, reason: str | None) -> None:
        """One refused request (``reason``: the error code; a fixed set in the server)."""
        self.rejected.labels(reason or "error").inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS", "ServeMetrics", "peak_rss_bytes"]
