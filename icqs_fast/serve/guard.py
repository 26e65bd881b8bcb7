"""The server's pure ASGI middleware (:class:`Guard`: bearer token, body-size limit, request
metrics) and :func:`client_gone` (when a client disconnects while its request waits)."""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from starlette.requests import Request

from icqs_fast.serve.admission import limit_flag
from icqs_fast.serve.errors import CLIENT_CLOSED, APIError, error_body
from icqs_fast.serve.metrics import ServeMetrics


class _TooLarge(APIError):
    """A chunked body grew past the limit while it was read (the app answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes "
                         f"({limit_flag('max_body_bytes')})", "body_too_large")


class Guard:
    """Pure ASGI middleware: the bearer token on every HTTP route, the body-size limit (by
    ``Content-Length`` before reading, and by counting a chunked body while it arrives), and
    the request metrics (route, status, latency) of every answer, refusals included."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int,
                 metrics: ServeMetrics | None = None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = int(max_body_bytes)
        self.metrics = metrics

    async def _send_error(self, send: Any, status: int, message: str, code: str,
                          extra: list | None = None) -> None:
        if self.metrics is not None:
            self.metrics.reject(code)
        body = json.dumps(error_body(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = CLIENT_CLOSED  # unless a response starts

        async def tracking_send(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        try:
            await self._guarded(scope, receive, tracking_send)
        finally:
            if self.metrics is not None:
                self.metrics.observe(scope.get("path", ""), status, time.perf_counter() - t0)

    async def _guarded(self, scope: dict, receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        if self.key is not None:
            got = headers.get(b"authorization", b"")
            if not hmac.compare_digest(got, b"Bearer " + self.key):
                await self._send_error(send, 401, "missing or invalid API key: send "
                                       "'Authorization: Bearer <key>'", "invalid_api_key",
                                       [(b"www-authenticate", b"Bearer")])
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                await self._send_error(send, 400, "bad Content-Length", "bad_request")
                return
            if too_big:
                await self._send_error(send, 413, f"request body of {int(length)} bytes is over "
                                       f"the limit of {self.max_body} "
                                       f"({limit_flag('max_body_bytes')})",
                                       "body_too_large")
                return
        seen = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise _TooLarge(self.max_body)
            return msg

        async def started_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, started_send)
        except _TooLarge as exc:
            if not started:
                await self._send_error(send, 413, exc.message, exc.code or "body_too_large")


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is
    the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


__all__ = ["Guard", "client_gone"]
