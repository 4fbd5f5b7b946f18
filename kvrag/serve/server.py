"""Running the app with uvicorn: in the foreground (``kvrag serve``) or in a background thread (:class:`LiveServer`,
what tests and notebooks use).

Shutdown drains: on SIGINT/SIGTERM (or :meth:`LiveServer.stop`) uvicorn stops accepting connections and lets the
requests in flight finish for up to ``drain_timeout_s`` seconds. Then the app's service cancels what is left (a
prepare at its next piece, a decode before its next step) and answers each client ``503`` or, mid-stream, an error
event; uvicorn closes what is still open a second later and runs the app's shutdown (``engine.close()`` when the
app owns the engine).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from kvrag.extras import require

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

ABORT_GRACE_S = 1.0
"""Seconds between the service cancelling the requests left at the drain timeout and uvicorn closing their
connections (time for their 503 responses and error events to go out)."""


def _config(app: ASGIApp, drain_timeout_s: float, log_level: str = "warning") -> uvicorn.Config:
    uvicorn = require("uvicorn", "serve", "kvrag serve")
    # every request's line (method, path, status) at debug level (`kvrag serve -v`), as uvicorn writes it
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=max(0.0, float(drain_timeout_s)) +
                          ABORT_GRACE_S, lifespan="on", access_log=log_level == "debug", server_header=False)


def _server(app: ASGIApp, cfg: uvicorn.Config, drain_timeout_s: float) -> uvicorn.Server:
    """A uvicorn server that tells the app's service (``app.state.kvrag``) when shutdown starts and when its drain
    timeout has passed."""
    uvicorn = require("uvicorn", "serve", "kvrag serve")
    state = getattr(app, "state", None)
    svc = getattr(state, "kvrag", None) if state is not None else None

    class DrainingServer(uvicorn.Server):  # type: ignore[misc,name-defined]
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            timer = None
            if svc is not None:
                svc.drain()
                timer = asyncio.get_running_loop().call_later(max(0.0, float(drain_timeout_s)), svc.abort)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return DrainingServer(cfg)


def serve(app: ASGIApp, host: str = "127.0.0.1", port: int = 8000, *, drain_timeout_s: float = 30.0,
          log_level: str = "info") -> None:
    """Serve ``app`` until SIGINT/SIGTERM (blocking); returns normally once the requests in flight are drained."""
    cfg = _config(app, drain_timeout_s, log_level)
    cfg.host, cfg.port = host, int(port)
    # uvicorn handles the signal itself, drains, then raises it again for the handler it found: with the default
    # ones the process would die of it (SIGTERM) or print a KeyboardInterrupt (SIGINT) after a clean shutdown
    saved = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _server(app, cfg, drain_timeout_s).run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


class LiveServer:
    """``app`` served by uvicorn in a background thread on ``host`` at an ephemeral port (``with`` block or
    :meth:`start` / :meth:`stop`).

    Attributes:
        url: ``http://host:port`` once started.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, drain_timeout_s: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = _server(app, _config(app, drain_timeout_s), drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvrag-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                msg = f"the server at {self.url} did not start within {timeout} s"
                raise RuntimeError(msg)
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown (requests in flight finish, up to the drain timeout); waits for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LiveServer", "serve"]
