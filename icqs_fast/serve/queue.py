"""A bounded work queue with one worker thread that owns the model.

Requests are admitted as long as the prompts outstanding (queued or running) stay within
``max_pending``; past that :meth:`WorkQueue.submit_logprobs` / :meth:`WorkQueue.submit_call`
raise :class:`QueueFull` at once (the server answers 429). Log-prob jobs that arrive within
``batch_wait_s`` of the oldest queued one run together, up to ``max_batch_tokens`` prompt
tokens, through one :func:`icqs_fast.serve.logprobs.prompt_logprobs` call, so concurrent
requests that share a prefix (a few-shot context, a judge template) compute it once. Other
work (``/v1/score``) runs one job at a time on the same thread: the model is never used by two
threads at once.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


class QueueFull(RuntimeError):
    """The queue holds ``max_pending`` prompts already."""


@dataclass
class _Job:
    kind: str  # "logprobs" or "call"
    size: int  # prompts, the admission unit
    tokens: int
    payload: Any
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class WorkQueue:
    """See the module docstring.

    Args:
        run_logprobs: ``(prompts, top_n) -> list`` of per-prompt results, in order.
        max_pending: most prompts admitted and not yet answered.
        batch_wait_s: how long the oldest queued log-prob job waits for company.
        max_batch_tokens: most prompt tokens per batch (a longer single job runs alone).
    """

    def __init__(self, run_logprobs: Callable[[list[list[int]], int], list], *,
                 max_pending: int = 256, batch_wait_s: float = 0.005,
                 max_batch_tokens: int = 16384) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.run_logprobs = run_logprobs
        self.max_pending = int(max_pending)
        self.batch_wait_s = float(batch_wait_s)
        self.max_batch_tokens = int(max_batch_tokens)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        # Counters (read by /health and the load test).
        self.batches = 0
        self.batched_prompts = 0
        self.largest_batch = 0
        self.rejected = 0

    # -- admission ------------------------------------------------------------------------

    def _admit(self, job: _Job) -> Future:
        with self._cond:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if self._pending + job.size > self.max_pending:
                self.rejected += 1
                raise QueueFull(f"the queue is full ({self._pending} prompts pending, at most "
                                f"{self.max_pending}); retry later")
            self._pending += job.size
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def submit_logprobs(self, prompts: Sequence[Sequence[int]], top_n: int) -> Future:
        """Queue echo log-probs of ``prompts``; the future's result is their list of results."""
        return self._admit(_Job("logprobs", len(prompts), sum(len(p) for p in prompts),
                                ([list(p) for p in prompts], int(top_n))))

    def submit_call(self, fn: Callable[[], Any], size: int = 1) -> Future:
        """Queue ``fn()`` to run alone on the worker thread (``size`` prompts' worth)."""
        return self._admit(_Job("call", max(1, int(size)), 0, fn))

    @property
    def pending(self) -> int:
        return self._pending

    # -- the worker -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="icqs-serve-worker",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the running batch, fail the queued jobs, end the thread."""
        with self._cond:
            self._stop = True
            left = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in left:
            job.future.set_exception(QueueFull("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _take(self) -> list[_Job] | None:
        with self._cond:
            while not self._jobs and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
            first = self._jobs[0]
            if first.kind != "logprobs":
                return [self._jobs.popleft()]
            while not self._stop:
                queued = 0
                for j in self._jobs:
                    if j.kind != "logprobs":
                        break
                    queued += j.tokens
                left = first.arrived + self.batch_wait_s - time.monotonic()
                if left <= 0 or queued >= self.max_batch_tokens:
                    break
                self._cond.wait(timeout=left)
            batch = [self._jobs.popleft()]
            tokens = batch[0].tokens
            while (self._jobs and self._jobs[0].kind == "logprobs"
                   and tokens + self._jobs[0].tokens <= self.max_batch_tokens):
                tokens += self._jobs[0].tokens
                batch.append(self._jobs.popleft())
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                if batch[0].kind == "call":
                    self._finish(batch[0], batch[0].payload)
                else:
                    self._run_logprobs(batch)
            finally:
                with self._cond:
                    self._pending -= sum(j.size for j in batch)

    @staticmethod
    def _finish(job: _Job, fn: Callable[[], Any]) -> None:
        try:
            job.future.set_result(fn())
        except BaseException as exc:  # handed to the request, never kills the worker
            job.future.set_exception(exc)

    def _run_logprobs(self, batch: list[_Job]) -> None:
        prompts = [p for j in batch for p in j.payload[0]]
        top_n = max(j.payload[1] for j in batch)
        try:
            res = self.run_logprobs(prompts, top_n)
        except BaseException as exc:
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
                return
            # Run each job alone, so that one bad job fails only its own request.
            for j in batch:
                self._finish(j, lambda j=j: self.run_logprobs(*j.payload))
            return
        self.batches += 1
        self.batched_prompts += len(prompts)
        self.largest_batch = max(self.largest_batch, len(batch))
        start = 0
        for j in batch:
            n = len(j.payload[0])
            part = res[start: start + n]
            start += n
            j.future.set_result(part)


__all__ = ["QueueFull", "WorkQueue"]
