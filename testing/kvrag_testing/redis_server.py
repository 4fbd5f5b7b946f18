"""A throw-away ``redis-server`` process on a loopback port, for tests that need a real server to start, kill and
restart (no mocks). Needs the ``redis-server`` binary (e.g. ``apt-get install redis-server``)::

    with RedisServer() as srv:          # started on a free port, no persistence
        store = RedisStore(srv.url)
        srv.kill()                      # SIGKILL: the server goes away mid-run
        srv.start()                     # back on the same port (empty: nothing was persisted)

    with RedisCluster(masters=3) as cl:  # 3 masters on loopback, 0 replicas, all 16384 slots assigned
        store = RedisStore(cl.url)       # redis+cluster://127.0.0.1:PORT
        cl.kill_node(1)                  # one master goes away mid-run
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(tries: int = 200) -> int:
    """A free port P on 127.0.0.1 whose cluster bus port P + 10000 is free (and valid) as well.

    Raises:
        RuntimeError: none found in ``tries`` attempts.
    """
    for _ in range(tries):
        p = free_port()
        if p + 10000 <= 65535 and _port_free(p + 10000):
            return p
    msg = f"no free port pair (P, P + 10000) on 127.0.0.1 after {tries} tries"
    raise RuntimeError(msg)


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
        args: extra redis-server arguments (e.g. ``("--cluster-enabled", "yes")``).
        cwd: working directory of the process (where a cluster node writes its nodes.conf).

    Raises:
        FileNotFoundError: no redis-server binary.
    """

    def __init__(self, port: int | None = None, exe: str | None = None, args: Sequence[str] = (),
                 cwd: str | None = None) -> None:
        found = exe or shutil.which("redis-server")
        if found is None:
            msg = "redis-server binary not found; install it (e.g. apt-get install redis-server)"
            raise FileNotFoundError(msg)
        self.exe = found
        self.port = port or free_port()
        self.args = tuple(args)
        self.cwd = cwd
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
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.args],
            cwd=self.cwd,
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


class RedisCluster:
    """A Redis Cluster of ``masters`` redis-server processes on 127.0.0.1 (no replicas, no persistence).

    Started with ``--cluster-enabled yes`` per node and ``redis-cli --cluster create ... --cluster-replicas 0
    --cluster-yes``; :meth:`start` returns once every node reports ``cluster_state:ok``. The nodes' ``nodes.conf``
    files live in a temporary directory removed by :meth:`stop`.

    Args:
        masters: number of master nodes (>= 3, redis-cli's minimum).
        node_timeout_ms: ``cluster-node-timeout``; after this long a killed master marks the cluster as failing.
        exe: the redis-server binary; ``cli``: the redis-cli binary (default: found on PATH).

    Raises:
        FileNotFoundError: no redis-server or redis-cli binary.
        ValueError: fewer than 3 masters.
    """

    def __init__(self, masters: int = 3, node_timeout_ms: int = 2000, exe: str | None = None,
                 cli: str | None = None) -> None:
        if masters < 3:
            msg = f"a Redis Cluster needs at least 3 masters, got {masters}"
            raise ValueError(msg)
        cli_found = cli or shutil.which("redis-cli")
        if cli_found is None:
            msg = "redis-cli binary not found; install it (e.g. apt-get install redis-server, which brings redis-cli)"
            raise FileNotFoundError(msg)
        self.cli = cli_found
        self.node_timeout_ms = node_timeout_ms
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.nodes: list[RedisServer] = []
        self._masters = masters
        self._exe = exe
        RedisServer(exe=exe)  # fail early (FileNotFoundError) without a redis-server binary

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL of the first node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def _cli(self, *args: str, port: int | None = None, timeout: float = 30.0) -> str:
        cmd = [self.cli, *(["-h", "127.0.0.1", "-p", str(port)] if port else []), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0:
            msg = f"{' '.join(cmd)} failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}"
            raise RuntimeError(msg)
        return out.stdout

    def cluster_ok(self, port: int) -> bool:
        try:
            return "cluster_state:ok" in self._cli("cluster", "info", port=port, timeout=5)
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def start(self, timeout: float = 30.0) -> RedisCluster:
        """Start the nodes, create the cluster and wait until every node says ``cluster_state:ok``.

        Raises:
            RuntimeError: a node did not start, or the cluster was not ok within ``timeout`` seconds.
        """
        if self.nodes:
            return self
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrag-redis-cluster-")
        try:
            for _ in range(self._masters):
                port = free_cluster_port()  # the cluster bus listens on port + 10000
                args = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(self.node_timeout_ms))
                node = RedisServer(port, exe=self._exe, args=args, cwd=self._tmp.name)
                self.nodes.append(node)
                node.start()
            self._cli("--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-replicas", "0",
                      "--cluster-yes", timeout=timeout)
            deadline = time.monotonic() + timeout
            while not all(self.cluster_ok(p) for p in self.ports):
                if time.monotonic() > deadline:
                    msg = f"Redis Cluster on ports {self.ports} did not reach cluster_state:ok in {timeout} s"
                    raise RuntimeError(msg)
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def keys_per_node(self) -> list[int]:
        """DBSIZE of every node (0 for a node that is down)."""
        out = []
        for n in self.nodes:
            try:
                out.append(int(self._cli("dbsize", port=n.port, timeout=5).strip()) if n.running else 0)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired):
                out.append(0)
        return out

    def kill_node(self, i: int) -> None:
        """SIGKILL master ``i`` (its slots become unreachable; after node_timeout_ms the cluster state is fail)."""
        self.nodes[i].kill()

    def stop(self) -> None:
        """Stop every node and remove the nodes.conf directory (idempotent)."""
        for n in self.nodes:
            n.stop()
        self.nodes = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


__all__ = ["RedisCluster", "RedisServer", "free_cluster_port", "free_port"]
