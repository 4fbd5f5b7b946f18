"""Running the app with uvicorn: in the foreground (``kvrag serve``) or in a background thread (:class:`LiveServer`,
what tests and notebooks use).

Shutdown drains: on SIGINT/SIGTERM (or :meth:`LiveServer.stop`) uvicorn stops accepting connections, lets the
requests in flight finish for up to ``ServeConfig.drain_timeout_s`` seconds, then closes what is left (their
streams are closed, which cancels them in the engine) and runs the app's shutdown (``engine.close()`` when the
engine has one).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

from kvrag.extras import require


def _config(app: Any, drain_timeout_s: float, log_level: str = "warning") -> Any:
    uvicorn = require("uvicorn", "serve", "kvrag serve")
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=max(0.0, float(drain_timeout_s)) or None,
                          lifespan="on", access_log=False)


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, *, drain_timeout_s: float = 30.0,
          log_level: str = "info") -> None:
    """Serve ``app`` until SIGINT/SIGTERM (blocking); returns normally once the requests in flight are drained."""
    uvicorn = require("uvicorn", "serve", "kvrag serve")
    cfg = _config(app, drain_timeout_s, log_level)
    cfg.host, cfg.port = host, int(port)
    # uvicorn handles the signal itself, drains, then raises it again for the handler it found: with the default
    # ones the process would die of it (SIGTERM) or print a KeyboardInterrupt (SIGINT) after a clean shutdown
    saved = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(cfg).run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


class LiveServer:
    """``app`` served by uvicorn in a background thread on ``host`` at an ephemeral port (``with`` block or
    :meth:`start` / :meth:`stop`).

    Attributes:
        url: ``http://host:port`` once started.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, drain_timeout_s: float = 30.0) -> None:
        uvicorn = require("uvicorn", "serve", "kvrag serve")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(_config(app, drain_timeout_s))
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
