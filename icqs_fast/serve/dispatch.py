"""From an admitted request to its answer: :class:`Dispatcher` puts a request's units of work
on the :class:`icqs_fast.serve.queue.WorkQueue` and waits for them on the event loop, turning
the queue's outcomes into the request's answer or its error (429 queue full, 503 shutting down,
504 past the deadline, a dropped ticket when the client disconnects, 400 / 500 from the
engine)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request

from icqs_fast.serve.errors import CLIENT_CLOSED, APIError
from icqs_fast.serve.guard import client_gone
from icqs_fast.serve.queue import (
    Cancelled,
    DeadlineExceeded,
    QueueFull,
    ShuttingDown,
    Ticket,
    Unit,
    WorkQueue,
)


class Dispatcher:
    """Submits and awaits tickets of one server's queue.

    Args:
        queue: the server's work queue.
        request_timeout: seconds from admission to answer (0: no deadline).
    """

    def __init__(self, queue: WorkQueue, request_timeout: float) -> None:
        self.queue = queue
        self.request_timeout = float(request_timeout)

    def submit(self, units: list[Unit], size: int) -> Ticket:
        """Admit ``units`` (``size`` prompts' worth): 429 when the queue is full, 503 when the
        server is shutting down."""
        try:
            return self.queue.submit(units, size, timeout_s=self.request_timeout or None)
        except QueueFull as exc:
            raise APIError(429, str(exc), "queue_full", {"Retry-After": "1"}) from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), "shutting_down") from None

    async def run(self, units: list[Unit], size: int, request: Request | None) -> list:
        """The units' results, in order (see :meth:`wait`)."""
        return await self.wait(self.submit(units, size), request)

    async def wait(self, ticket: Ticket, request: Request | None) -> Any:
        """The ticket's result; 504 at its deadline and a dropped ticket when the client goes
        away (its remaining work never runs, its running unit stops at its next check)."""
        fut = asyncio.wrap_future(ticket.future)
        # A ticket failed by cancel() after we stopped waiting: its exception is expected.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        waits: set[asyncio.Future] = {fut}
        gone = asyncio.ensure_future(client_gone(request)) if request is not None else None
        if gone is not None:
            waits.add(gone)
        timeout = None if ticket.deadline is None else max(0.0, ticket.deadline
                                                           - time.monotonic())
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone.cancel()
        if fut not in done:
            if gone is not None and gone in done:
                self.queue.cancel(ticket, Cancelled("the client disconnected"))
                raise APIError(CLIENT_CLOSED, "the client disconnected", "client_disconnected")
            self.queue.cancel(ticket, DeadlineExceeded("deadline"))
        try:
            return fut.result() if fut.done() else await fut
        except DeadlineExceeded:
            raise APIError(504, f"the request was not answered within --request-timeout "
                           f"{self.request_timeout:g} s; its work was stopped",
                           "deadline_exceeded") from None
        except Cancelled:
            raise APIError(CLIENT_CLOSED, "the client disconnected",
                           "client_disconnected") from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), "shutting_down") from None
        except APIError:
            raise
        except (ValueError, TypeError, KeyError) as exc:
            raise APIError(400, str(exc), "invalid_request") from None
        except Exception as exc:  # an engine failure: this request's 500, not the server's end
            raise APIError(500, f"{type(exc).__name__}: {exc}", "internal_error") from None


__all__ = ["Dispatcher"]
