"""A bounded, fair work queue with one worker thread that owns the model.

A request becomes a :class:`Ticket`: a list of *units* of work, each bounded in cost (prompt
tokens for log-prob units; estimated token-passes for other work), run in order. The route cuts
a large request into units of at most ``chunk_tokens`` (a unit that is one prompt or record may
be larger, up to the per-prompt limit).

Continuous batching: every step of the worker runs one token of every *live* generation (a
``steps`` unit that has started: work that runs a piece at a time and keeps its state, its KV
cache, between steps) and then one slice of the other work, served round-robin: the first
ticket in turn order that is not a live generation gives the slice: its ``call`` unit, alone, or
the first step of its ``steps`` unit (a generation's prompt forward), or log-prob prompts of
several tickets packed together up to ``prefill_tokens`` tokens while a generation is live, up
to ``chunk_tokens`` while none is (a unit's prompts run over several steps when they hold more)
through one :func:`icqs_fast.serve.logprobs.prompt_logprobs` call, so concurrent requests that
share a prefix compute it once. A prompt longer than that budget is prefilled in chunks (given a
``start_prefill``): its ticket's slice is the budget's next tokens of it, run against the KV
cache of those before, which the unit keeps between its turns (chunked prefill: a 300-token echo
prompt no longer makes one step 2-3 times as long as the others). A generation whose prompt and
new tokens fit in ``prefill_tokens`` starts beside the slice (one per step) instead of in a
slice's turn. A generation therefore waits for its first token one step and between two of its
tokens one slice and the other generations' tokens, never another request's whole chunk or
whole long prompt, and a request that arrives while a maximum-size one runs waits for at most
the step that is running.
The oldest ticket's first log-prob unit waits up to ``batch_wait_s`` for company (only while no
generation is live). At most ``max_live_steps`` ``steps`` units hold their state at once: a
ticket whose next such unit would start one more waits, the others are served past it.

Admission: tickets are admitted while the prompts outstanding (queued or running) stay within
``max_pending``; past that :meth:`WorkQueue.submit` raises :class:`QueueFull` at once (the
server answers 429). A ticket past its deadline, or cancelled (its client went away), is dropped
before its next unit runs: its remaining work never runs and its prompts leave the queue.

Stopping the running work itself: the worker's code calls :meth:`WorkQueue.check` between
pieces of work (the server hooks it to every forward of the model, and generation calls it
between tokens); it raises :class:`Interrupted` once every ticket of the running piece (one
generation's token, the slice) has ended (deadline, cancelled) or the queue is stopping, so the
worker is free for the next request after one forward, not after the whole unit.
:meth:`WorkQueue.drain` refuses new tickets (:class:`ShuttingDown`) and lets the admitted ones
finish; :meth:`WorkQueue.abort` ends them all.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol


class QueueFull(RuntimeError):
    """The queue holds ``max_pending`` prompts already."""


class ShuttingDown(RuntimeError):
    """The server is stopping: no new tickets; the admitted ones are answered or ended."""


class DeadlineExceeded(RuntimeError):
    """The ticket's deadline passed before its work was done."""


class Cancelled(RuntimeError):
    """The ticket was cancelled (its client disconnected)."""


class Interrupted(BaseException):  # noqa: N818 (a signal to unwind, like KeyboardInterrupt)
    """Raised inside the worker's running unit by :meth:`WorkQueue.check` when no one waits for
    its result any more. A BaseException, so that the engine's ``except Exception`` fallbacks
    (probes, retries) cannot mistake it for a failure of their own and carry on."""


@dataclass(frozen=True)
class StepRecord:
    """What one worker step carried and how long it took (the queue's :attr:`WorkQueue.step_log`).

    Attributes:
        seconds: wall time of the step (``run_step``).
        decode: tokens of live generations (one forward each).
        starts: generations started (their prompt's forward).
        prefill_tokens: log-prob prompt tokens (echo prompts, the slice).
        calls: ``call`` units (``/v1/score`` work); ``call_cost``: their estimated cost in
            token-passes.
    """

    seconds: float
    decode: int
    starts: int
    prefill_tokens: int
    calls: int
    call_cost: int

    @property
    def carried(self) -> str:
        """The step's kind: ``decode`` (generation tokens only), else its slice's kind beside
        them (``echo``, ``start``, ``call``; joined with ``+`` when several)."""
        parts = [name for name, n in (("start", self.starts), ("echo", self.prefill_tokens),
                                      ("call", self.calls)) if n]
        return "+".join(parts) if parts else "decode"


# Steps the queue remembers (a bounded ring: about 20 minutes of a busy server's steps).
STEP_LOG_LEN = 4096


class Stepper(Protocol):
    """The state of a running ``steps`` unit."""

    def step(self) -> bool:
        """Run one bounded piece of the work; True when the work is done."""

    def result(self) -> Any:
        """The unit's result (after :meth:`step` returned True)."""

    def close(self) -> None:
        """Release the state (memory) early; the unit will not be stepped again."""


@dataclass
class Unit:
    """One bounded piece of a request's work.

    Attributes:
        kind: ``"logprobs"`` (payload ``(prompts, top_n)``, result: per-prompt results),
            ``"call"`` (payload ``fn``, result ``fn()``) or ``"steps"`` (payload a factory
            ``() -> Stepper``, called when the unit first runs; one :meth:`Stepper.step` per
            turn of its ticket; result :meth:`Stepper.result`).
        cost: prompt tokens (log-probs) or estimated token-passes (calls); the batch bound.
        payload: see ``kind``.
        prompts: how many prompts the unit holds (the batch-size counter).
        state: the live :class:`Stepper` of a started ``steps`` unit (None otherwise).
        done_prompts, partial: a ``logprobs`` unit run over several steps: the prompts run so
            far and their results.
        take: prompts of a ``logprobs`` unit in the running step (set by the worker).
        prefill: a ``logprobs`` unit's prompt over the step budget, running a chunk per step
            (the queue's ``start_prefill`` object, holding its KV cache; None otherwise).
        piece: tokens of that prompt in the running step (set by the worker).
    """

    kind: str
    cost: int
    payload: Any
    prompts: int = 1
    state: Any = None
    done_prompts: int = 0
    partial: list = field(default_factory=list)
    take: int = 0
    prefill: Any = None
    piece: int = 0

    @property
    def live(self) -> bool:
        """A started ``steps`` unit (a generation holding its KV cache)."""
        return self.kind == "steps" and self.state is not None

    def tokens_left(self) -> int:
        """Prompt tokens of a ``logprobs`` unit not run yet."""
        return sum(len(p) for p in self.payload[0][self.done_prompts:])


@dataclass(eq=False)
class Ticket:
    """A request's units, run in order; ``future`` gets ``combine(unit results)``."""

    units: list[Unit]
    size: int  # prompts, the admission unit
    combine: Callable[[list], Any] = list
    deadline: float | None = None
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    results: list = field(default_factory=list)
    running: bool = False
    done: bool = False
    finished: float | None = None  # when it was answered or dropped (monotonic)

    @property
    def next_unit(self) -> Unit:
        return self.units[len(self.results)]


def chunk_prompts(prompts: Sequence[Sequence[int]], chunk_tokens: int) -> list[list[list[int]]]:
    """Consecutive groups of ``prompts`` of at most ``chunk_tokens`` tokens each (a longer prompt
    is a group of its own)."""
    out: list[list[list[int]]] = []
    cur: list[list[int]] = []
    tokens = 0
    for p in prompts:
        if cur and tokens + len(p) > chunk_tokens:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(list(p))
        tokens += len(p)
    if cur:
        out.append(cur)
    return out


class WorkQueue:
    """See the module docstring.

    Args:
        run_logprobs: ``(prompts, top_n) -> list`` of per-prompt results, in order.
        max_pending: most prompts admitted and not yet answered.
        batch_wait_s: how long the oldest queued log-prob unit waits for company.
        chunk_tokens: the size :meth:`submit_logprobs` cuts a request into.
        max_live_steps: most ``steps`` units holding their state at once.
        prefill_tokens: most log-prob prompt tokens per step beside the live generations' tokens
            (with no live generation, a step packs up to ``chunk_tokens``); None:
            ``chunk_tokens``.
        start_prefill: ``(prompt, top_n) -> prefill``, the log-probs of one prompt a chunk at a
            time (:class:`icqs_fast.serve.logprobs.PromptPrefill`: ``step(tokens) -> done``,
            ``pos`` and ``done``, ``result()``, ``close()``): a prompt longer than a step's
            budget runs over several steps, a budget's worth each. None: such a prompt runs
            whole, in a step of its own.
        between_steps: called on the worker thread after each step, outside the queue's lock,
            with whether the queue is idle (the server's allocator trim,
            :class:`icqs_fast.serve.memory.Trimmer`); its exceptions are ignored.
    """

    def __init__(self, run_logprobs: Callable[[list[list[int]], int], list], *,
                 max_pending: int = 256, batch_wait_s: float = 0.005,
                 chunk_tokens: int = 2048, max_live_steps: int = 8,
                 prefill_tokens: int | None = None,
                 start_prefill: Callable[[list[int], int], Any] | None = None,
                 between_steps: Callable[[bool], None] | None = None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        if max_live_steps < 1:
            raise ValueError(f"max_live_steps must be >= 1, got {max_live_steps}")
        self.run_logprobs = run_logprobs
        self.start_prefill = start_prefill
        self.between_steps = between_steps
        self.max_pending = int(max_pending)
        self.batch_wait_s = float(batch_wait_s)
        self.chunk_tokens = int(chunk_tokens)
        self.max_live_steps = int(max_live_steps)
        self.prefill_tokens = int(chunk_tokens if prefill_tokens is None else prefill_tokens)
        # Tickets with work left, in service order: the head is served next, a served ticket
        # goes to the back (round robin).
        self._active: collections.deque[Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._live = 0  # steps units holding their state
        self._stop = False
        self._draining = False
        self._aborted = False
        self._thread: threading.Thread | None = None
        self._worker_id: int | None = None
        self._current: list[Ticket] = []  # the tickets of the running piece of the step
        # Counters (read by /health, /metrics and the load test).
        self.batches = 0  # log-prob engine calls
        self.batched_prompts = 0
        self.largest_batch = 0  # tickets in one log-prob batch
        self.chunks = 0  # units (or steps of a unit) run, of any kind
        self.rejected = 0
        self.timed_out = 0
        self.cancelled = 0
        self.interrupted = 0  # running units stopped part-way (their tickets had ended)
        self.steps = 0  # worker steps
        self.decode_tokens = 0  # tokens of generations that had started (one per step each)
        self.step_seconds = 0.0  # wall time of all steps
        # Tokens that entered the model's forwards (every kind of work, padding included),
        # counted by the server's forward hook (:meth:`count_forward`).
        self.forward_tokens = 0
        # Token-passes of the ``call`` units run (``/v1/score`` work: the units' cost).
        self.call_tokens = 0
        # The latest steps (bench serve --soak reads their time by what they carried).
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=STEP_LOG_LEN)

    # -- admission ------------------------------------------------------------------------

    def submit(self, units: Sequence[Unit], size: int, *, combine: Callable[[list], Any] = list,
               timeout_s: float | None = None) -> Ticket:
        """Admit a ticket of ``units`` (``size`` prompts' worth); QueueFull past the limit,
        ShuttingDown once the queue drains or stops."""
        if not units:
            raise ValueError("a ticket needs at least one unit of work")
        now = time.monotonic()
        t = Ticket(list(units), max(1, int(size)), combine,
                   None if timeout_s is None else now + float(timeout_s), arrived=now)
        with self._cond:
            if self._stop or self._draining:
                raise ShuttingDown("the server is shutting down")
            if self._pending + t.size > self.max_pending:
                self.rejected += 1
                raise QueueFull(f"the queue is full ({self._pending} prompts pending, at most "
                                f"{self.max_pending}); retry later")
            self._pending += t.size
            self._active.append(t)
            self._cond.notify()
        return t

    def submit_logprobs(self, prompts: Sequence[Sequence[int]], top_n: int, *,
                        timeout_s: float | None = None) -> Future:
        """Echo log-probs of ``prompts``, cut into chunks; the future's result is their list of
        results, in order."""
        units = [Unit("logprobs", sum(len(p) for p in ch), (ch, int(top_n)), len(ch))
                 for ch in chunk_prompts(prompts, self.chunk_tokens)]
        return self.submit(units, len(prompts), combine=_concat, timeout_s=timeout_s).future

    def submit_call(self, fn: Callable[[], Any], size: int = 1, *,
                    timeout_s: float | None = None) -> Future:
        """``fn()`` as one unit on the worker thread (``size`` prompts' worth)."""
        return self.submit([Unit("call", 0, fn)], size, combine=_first,
                           timeout_s=timeout_s).future

    def cancel(self, ticket: Ticket, exc: BaseException) -> None:
        """Fail ``ticket`` with ``exc`` and drop its remaining units (a running unit stops at
        its next :meth:`check`; its result is dropped)."""
        with self._cond:
            if ticket.done:
                return
            if isinstance(exc, DeadlineExceeded):
                self.timed_out += 1
            else:
                self.cancelled += 1
            self._fail(ticket, exc)
            self._cond.notify_all()  # a generation's KV cache may have been freed

    @property
    def pending(self) -> int:
        """Prompts admitted and not yet answered."""
        return self._pending

    @property
    def queued_tickets(self) -> int:
        """Requests admitted and not yet answered."""
        return len(self._active)

    @property
    def live_steps(self) -> int:
        """``steps`` units holding their state (generations with a KV cache)."""
        return self._live

    # -- stopping the running work --------------------------------------------------------

    def should_interrupt(self) -> bool:
        """True on the worker thread when no one waits for the running step's result: every
        ticket of it ended (deadline passed, cancelled) or the queue is aborting / stopping.
        False on any other thread (the same model may be used outside the server)."""
        if threading.get_ident() != self._worker_id:
            return False
        if self._stop or self._aborted:
            return True
        cur = self._current
        if not cur:
            return False
        now = time.monotonic()
        return all(t.done or (t.deadline is not None and now >= t.deadline) for t in cur)

    def count_forward(self, tokens: int) -> None:
        """Count a forward of ``tokens`` tokens (the server's hook on the model's input
        embeddings; only the worker thread runs forwards, so no lock)."""
        self.forward_tokens += int(tokens)

    def check(self) -> None:
        """Raise :class:`Interrupted` when :meth:`should_interrupt`; the worker's code calls it
        between pieces of work (every forward of the model, every generated token)."""
        if self.should_interrupt():
            raise Interrupted("the request this work was for has ended")

    # -- bookkeeping (under the lock) -----------------------------------------------------

    def _release(self, t: Ticket) -> None:
        """Drop the state of ``t``'s started ``steps`` unit or chunked prompt, if any."""
        for u in t.units:
            if u.prefill is not None:
                with contextlib.suppress(Exception):
                    u.prefill.close()
                u.prefill = None
            if u.state is not None:
                with contextlib.suppress(Exception):
                    u.state.close()
                u.state = None
                self._live -= 1

    def _fail(self, t: Ticket, exc: BaseException) -> None:
        t.done = True
        t.finished = t.finished or time.monotonic()
        if t in self._active:
            self._active.remove(t)
            self._pending -= t.size
        if not t.running:  # a running unit's state is the worker's until its step ends
            self._release(t)
        if not t.future.done():
            t.future.set_exception(exc)

    def _complete(self, t: Ticket, result: Any) -> None:
        t.running = False
        if t.done:  # cancelled while its unit ran: the result goes nowhere
            return
        if result is _MORE:  # a steps unit with steps left: the ticket keeps its turn order
            return
        t.results.append(result)
        if len(t.results) < len(t.units):
            return
        t.done = True
        t.finished = time.monotonic()
        self._active.remove(t)
        self._pending -= t.size
        try:
            out = t.combine(t.results)
        except BaseException as exc:
            t.future.set_exception(exc)
            return
        t.future.set_result(out)

    def _expire(self, now: float) -> float | None:
        """Fail the tickets past their deadline; the earliest deadline left (None: none)."""
        soonest = None
        for t in list(self._active):
            if t.deadline is None or t.running:
                continue
            if t.deadline <= now:
                self.timed_out += 1
                self._fail(t, DeadlineExceeded("the request's deadline passed before its work "
                                               "was done"))
            elif soonest is None or t.deadline < soonest:
                soonest = t.deadline
        return soonest

    def _why_interrupted(self, t: Ticket) -> BaseException:
        """What a ticket whose unit was interrupted (and that no one had failed yet) gets."""
        if self._stop or self._aborted:
            return ShuttingDown("the server is shutting down")
        self.timed_out += 1
        return DeadlineExceeded("the request's deadline passed before its work was done")

    # -- the worker -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="icqs-serve-worker",
                                            daemon=True)
            self._thread.start()

    def drain(self) -> None:
        """Refuse new tickets (:class:`ShuttingDown`); the admitted ones run on."""
        with self._cond:
            self._draining = True

    def abort(self) -> None:
        """End every admitted ticket with :class:`ShuttingDown` now; the running unit stops at
        its next :meth:`check`. New tickets are refused."""
        with self._cond:
            self._draining = self._aborted = True
            for t in list(self._active):
                self._fail(t, ShuttingDown("the server is shutting down; the request was not "
                                           "finished in time"))
            self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """End the admitted tickets (:class:`ShuttingDown`), interrupt the running unit, end
        the thread (waiting at most ``timeout`` seconds for it: it is a daemon)."""
        with self._cond:
            self._stop = True
            for t in list(self._active):
                self._fail(t, ShuttingDown("the server is shutting down"))
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _runnable(self, t: Ticket, starting: int = 0) -> bool:
        """``t``'s next unit may run now (``starting``: generations this step starts already)."""
        u = t.next_unit
        return not (u.kind == "steps" and u.state is None
                    and self._live + starting >= self.max_live_steps)

    def _pack(self, u: Unit, room: int, first: bool) -> int:
        """Set ``u.take``: the prompts of log-prob unit ``u`` that fit in ``room`` tokens (at
        least one when ``first``), or ``u.piece``: the next ``room`` tokens of its prompt when
        that is longer than ``room`` (``first`` only; chunked prefill, with a
        ``start_prefill``); their tokens."""
        prompts = u.payload[0]
        u.take = u.piece = 0
        if u.prefill is not None or (self.start_prefill is not None
                                     and len(prompts[u.done_prompts]) > room):
            if first:  # a chunk of a long prompt, continued by its own ticket's turns
                ran = 0 if u.prefill is None else u.prefill.pos
                u.piece = min(room, len(prompts[u.done_prompts]) - ran)
            return u.piece
        k, tokens = u.done_prompts, 0
        while k < len(prompts) and (tokens + len(prompts[k]) <= room
                                    or (first and k == u.done_prompts)):
            tokens += len(prompts[k])
            k += 1
        u.take = k - u.done_prompts
        return tokens

    def _take(self) -> list[Ticket] | None:
        """The tickets of the next step: every live generation, then the slice (see the module
        docstring)."""
        with self._cond:
            while True:
                if self._stop:
                    for t in list(self._active):  # the rest of a ticket that was running
                        self._fail(t, ShuttingDown("the server is shutting down"))
                    return None
                now = time.monotonic()
                soonest = self._expire(now)
                decode = [t for t in self._active if t.next_unit.live]
                # A generation whose whole cost fits in the prefill budget starts beside the
                # slice, not in a slice's turn: its first token comes after one step, not after
                # every other request's slice.
                start = next((t for t in self._active if t.next_unit.kind == "steps"
                              and not t.next_unit.live
                              and t.next_unit.cost <= self.prefill_tokens
                              and self._runnable(t)), None)
                if start is not None:
                    decode.append(start)
                # The budget bounds the time between a live generation's tokens; with none
                # live, bigger batches cost no one anything.
                budget = self.prefill_tokens if decode else self.chunk_tokens
                head = next((t for t in self._active if t is not start
                             and not t.next_unit.live
                             and self._runnable(t, int(start is not None))), None)
                if head is None and not decode:
                    self._cond.wait(timeout=None if soonest is None else soonest - now)
                    continue
                work: list[Ticket] = []
                if head is not None:
                    unit = head.next_unit
                    if unit.kind == "logprobs" and not head.results and not decode and \
                            unit.done_prompts == 0:
                        # A new request: wait a little for others to share the batch with.
                        left = head.arrived + self.batch_wait_s - now
                        queued = sum(t.next_unit.tokens_left() for t in self._active
                                     if t.next_unit.kind == "logprobs")
                        if left > 0 and queued < self.chunk_tokens:
                            self._cond.wait(timeout=left if soonest is None
                                            else min(left, max(0.0, soonest - now)))
                            continue
                    work = [head]
                    if unit.kind == "logprobs":
                        tokens = self._pack(unit, budget, True)
                        for t in self._active:
                            u = t.next_unit
                            if t is head or u.kind != "logprobs":
                                continue
                            n = self._pack(u, budget - tokens, False)
                            if u.take:
                                work.append(t)
                                tokens += n
                step = decode + work
                for t in step:
                    t.running = True
                return step

    def _loop(self) -> None:
        self._worker_id = threading.get_ident()
        while True:
            step = self._take()
            if step is None:
                return
            what = _carried(step)
            t0 = time.perf_counter()
            results = self.run_step(step)
            seconds = time.perf_counter() - t0
            with self._cond:
                self._current = []
                self.steps += 1
                self.step_seconds += seconds
                rec = StepRecord(seconds, *what)
                self.step_log.append(rec)
                self.call_tokens += rec.call_cost
                self.chunks += len(step)
                if any(not ok and isinstance(v, Interrupted) for ok, v in results):
                    self.interrupted += 1
                for t, (ok, value) in zip(step, results, strict=True):
                    if ok:
                        self._complete(t, value)
                    else:
                        t.running = False
                        if isinstance(value, Interrupted) and not t.done:
                            value = self._why_interrupted(t)
                        self._fail(t, value)
                    if t.done:
                        self._release(t)
                    elif t in self._active:
                        # Round robin: the served go behind every other ticket, those that
                        # arrived while they ran included.
                        self._active.remove(t)
                        self._active.append(t)
                self._cond.notify_all()
                idle = not self._active
            if self.between_steps is not None:
                with contextlib.suppress(Exception):
                    self.between_steps(idle)

    def run_step(self, step: list[Ticket]) -> list[tuple[bool, Any]]:
        """Run one step on the worker thread: each ticket's next unit (a token of a live
        generation, a generation's first step, a ``call``), the log-prob pieces together in one
        engine call; ``(ok, result or exception)`` per ticket, in order (``_MORE`` for work
        with steps left). The queue's own loop calls it and answers the tickets after."""
        out: list[tuple[bool, Any]] = [(False, None)] * len(step)
        batch = [i for i, t in enumerate(step) if t.next_unit.kind == "logprobs"]
        for i, t in enumerate(step):
            unit = t.next_unit
            if unit.kind == "logprobs":
                continue
            if t.done or self._stop or self._aborted:  # ended while the step ran
                out[i] = (False, Interrupted("the request this work was for has ended"))
                continue
            self._current = [t]
            if unit.kind == "call":
                out[i] = _outcome(unit.payload)
            else:
                if unit.live:
                    self.decode_tokens += 1
                out[i] = self._run_step(unit)
        if batch:
            self._current = [step[i] for i in batch]
            for i, r in zip(batch, self._run_logprobs(self._current), strict=True):
                out[i] = r
        self._current = []
        return out

    def _run_step(self, unit: Unit) -> tuple[bool, Any]:
        """One step of a ``steps`` unit (its state made on the first); ``(True, _MORE)`` while
        steps are left."""
        if unit.state is None:
            ok, state = _outcome(unit.payload)
            if not ok:
                return False, state
            with self._cond:
                unit.state = state
                self._live += 1
        ok, done = _outcome(unit.state.step)
        if ok and not done:
            return True, _MORE
        ok, value = (ok, done) if not ok else _outcome(unit.state.result)
        with self._cond:
            if unit.state is not None:
                with contextlib.suppress(Exception):
                    unit.state.close()
                unit.state = None
                self._live -= 1
        return ok, value

    def _run_logprobs(self, step: list[Ticket]) -> list[tuple[bool, Any]]:
        """The log-prob pieces of ``step``'s tickets: a chunk of a long prompt (``unit.piece``
        tokens), or ``unit.take`` prompts from ``unit.done_prompts``, those of all tickets in one
        engine call; a unit's result once all its prompts ran, ``_MORE`` before."""
        units = [t.next_unit for t in step]
        out: list[tuple[bool, Any]] = [(False, None)] * len(units)
        for i, u in enumerate(units):
            if u.piece:
                out[i] = self._run_piece(u)
        packed = [i for i, u in enumerate(units) if not u.piece]
        if packed:
            for i, r in zip(packed, self._run_packed([units[i] for i in packed]), strict=True):
                out[i] = r
        return out

    def _run_piece(self, u: Unit) -> tuple[bool, Any]:
        """The next ``u.piece`` tokens of the long prompt of log-prob unit ``u``."""
        piece, u.piece = u.piece, 0
        try:
            if u.prefill is None:
                u.prefill = self.start_prefill(list(u.payload[0][u.done_prompts]), u.payload[1])
            if not u.prefill.step(piece):
                return True, _MORE
            res = u.prefill.result()
        except BaseException as exc:
            return False, exc  # the ticket fails; its prefill is released with it
        finally:
            if u.prefill is not None and u.prefill.done:
                u.prefill.close()
                u.prefill = None
        self.batches += 1
        self.batched_prompts += 1
        u.partial.append(res)
        u.done_prompts += 1
        return True, (u.partial if u.done_prompts == len(u.payload[0]) else _MORE)

    def _run_packed(self, units: list[Unit]) -> list[tuple[bool, Any]]:
        """Whole prompts of ``units`` (``unit.take`` each) in one engine call."""
        pieces = [list(u.payload[0][u.done_prompts: u.done_prompts + u.take]) for u in units]
        prompts = [p for piece in pieces for p in piece]
        top_n = max(u.payload[1] for u in units)
        ok, res = _outcome(lambda: self.run_logprobs(prompts, top_n))
        if not ok:
            if len(units) == 1 or isinstance(res, Interrupted):
                return [(False, res)] * len(units)
            # Run each piece alone, so that one bad request fails only itself.
            each = [_outcome(lambda u=u, p=p: self.run_logprobs(p, u.payload[1]))
                    for u, p in zip(units, pieces, strict=True)]
        else:
            self.batches += 1
            self.batched_prompts += len(prompts)
            self.largest_batch = max(self.largest_batch, len(units))
            each, start = [], 0
            for p in pieces:
                each.append((True, res[start: start + len(p)]))
                start += len(p)
        out: list[tuple[bool, Any]] = []
        for u, (ok, value) in zip(units, each, strict=True):
            if not ok:
                out.append((False, value))
                continue
            u.partial.extend(value)
            u.done_prompts += u.take
            u.take = 0
            out.append((True, u.partial if u.done_prompts == len(u.payload[0]) else _MORE))
        return out


def _carried(step: list[Ticket]) -> tuple[int, int, int, int, int]:
    """``(decode, starts, prefill_tokens, calls, call_cost)`` of a step about to run (the
    fields of :class:`StepRecord` after ``seconds``)."""
    decode = starts = tokens = calls = cost = 0
    for t in step:
        u = t.next_unit
        if u.kind == "steps":
            decode, starts = (decode + 1, starts) if u.live else (decode, starts + 1)
        elif u.kind == "logprobs":
            tokens += u.piece + sum(len(p) for p in
                                    u.payload[0][u.done_prompts: u.done_prompts + u.take])
        else:
            calls, cost = calls + 1, cost + u.cost
    return decode, starts, tokens, calls, cost


# A steps unit's result while it has steps left (never a unit's real result).
_MORE = object()


def _outcome(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())`` or ``(False, the exception)``: a failure is handed to its request and
    never ends the worker."""
    try:
        return True, fn()
    except BaseException as exc:
        return False, exc


def _concat(results: list[list]) -> list:
    return [r for part in results for r in part]


def _first(results: list) -> Any:
    return results[0]


__all__ = ["STEP_LOG_LEN", "Cancelled", "DeadlineExceeded", "Interrupted", "QueueFull",
           "ShuttingDown", "StepRecord", "Stepper", "Ticket", "Unit", "WorkQueue", "chunk_prompts"]
