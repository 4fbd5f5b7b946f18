"""A throw-away ``redis-server`` process on a loopback port, for tests that need a real server to start, kill and
restart (no mocks). Needs the ``redis-server`` binary (e.g. ``apt-get install redis-server``)::

    with RedisServer() as srv:          # started on a free port, no persistence
        store = RedisStore(srv.url)
        srv.kill()                      # SIGKILL: the server goes away mid-run
        srv.start()                     # back on the same port (empty: nothing was persisted)
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from types import TracebackType


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process (``--save "" --appendonly no``) bound to 127.0.0.1.

    Args:
        port: the port (default: a free one, kept across restarts).
        exe: the redis-server binary (default: found on PATH).

    Raises:
        FileNotFoundError: no redis-server binary.
    """

    def __init__(self, port: int | None = None, exe: str | None = None) -> None:
        found = exe or shutil.which("redis-server")
        if found is None:
            msg = "redis-server binary not found; install it (e.g. apt-get install redis-server)"
            raise FileNotFoundError(msg)
        self.exe = found
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        if self.running:
            return self
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not _pong(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                msg = f"redis-server did not start on port {self.port}"
                raise RuntimeError(msg)
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: clients see their connections reset) and reap it."""
        self.stop(sig=signal.SIGKILL)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (idempotent)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["RedisServer", "free_port"]
