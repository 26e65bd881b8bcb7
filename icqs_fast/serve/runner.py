"""Starting a :class:`icqs_fast.serve.app.Server` under uvicorn: in the foreground
(``icqs-fast serve``) or in a background thread on a free local port (tests, the load test).

Both run :class:`GracefulServer`: on SIGTERM / SIGINT (or :meth:`ServerThread.stop`) the server
admits nothing new, the requests in flight have ``--shutdown-timeout`` seconds to finish and
then get 503, and the process exits with status 0 (uvicorn itself would re-raise the signal
after its shutdown, and the process would end by it).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

LOCAL_HOST = "127.0.0.1"
# Seconds uvicorn waits past --shutdown-timeout for the 503 answers to be written before it
# cancels what is left.
SHUTDOWN_MARGIN_S = 1.0


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse (ValueError) to bind a non-loopback address without an API key."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"refusing to bind {host!r} without an API key: anyone who can reach "
                         "it could use the model. Pass --api-key (or set ICQS_FAST_API_KEY), "
                         f"or bind {LOCAL_HOST}")


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the icqs-fast shutdown (see the module docstring).

    Args:
        config: uvicorn's settings.
        app_server: the :class:`icqs_fast.serve.app.Server` it serves.
    """

    def __init__(self, config: uvicorn.Config, app_server: Any) -> None:
        super().__init__(config)
        self.app_server = app_server

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # As uvicorn's, without recording the signal for re-raising: a graceful stop exits 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.app_server.begin_shutdown()
        await super().shutdown(sockets)


def _config(server: Any, **kw: Any) -> uvicorn.Config:
    grace = server.config.shutdown_timeout + SHUTDOWN_MARGIN_S
    return uvicorn.Config(server.app(), timeout_graceful_shutdown=grace, **kw)  # type: ignore[arg-type]


def serve(server: Any, host: str = LOCAL_HOST, port: int = 8000, *,
          log_level: str = "info", access_log: bool = True) -> None:
    """Run ``server`` in the foreground until SIGTERM / SIGINT (``access_log=False``: no line
    per request); returns once it has shut down."""
    check_bind(host, server.config.api_key)
    GracefulServer(_config(server, host=host, port=port, log_level=log_level,
                           access_log=access_log), server).run()


class ServerThread:
    """``server`` on ``127.0.0.1`` and a free port, in a daemon thread; a context manager
    (``with ServerThread(srv) as t: t.base_url``) that stops it on exit."""

    def __init__(self, server: Any, *, log_level: str = "warning", port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOCAL_HOST, port))
        self.port = int(self.sock.getsockname()[1])
        self.base_url = f"http://{LOCAL_HOST}:{self.port}"
        self.uv = GracefulServer(_config(server, log_level=log_level), server)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]},
                                       name="icqs-serve-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["LOCAL_HOST", "GracefulServer", "ServerThread", "check_bind", "is_loopback", "serve"]
