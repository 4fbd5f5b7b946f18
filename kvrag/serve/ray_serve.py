"""``kvrag serve --ray --replicas N``: the same app in N Ray Serve replicas sharing one store and one chunk table.

Each replica builds its own engine (``engine_factory``, called in the replica) and the app of
:func:`kvrag.serve.create_app`; Ray Serve's proxy spreads requests over them. What the replicas share:

* **the KV store**: pass a Redis or Redis Cluster URL, so a cache computed by one replica is read by every other
  (a ``memory://`` or file store per replica would recompute per replica);
* **the registered chunks**: a ``POST /v1/kvrag/chunks`` reaches one replica, so registrations go to one named Ray
  actor (:class:`ChunkTable`); every replica pulls what was registered elsewhere before it plans a request (one
  actor call; only the new texts travel).

Serve's own settings pass through: ``max_ongoing_requests`` (per replica) and ``autoscaling_config`` (instead of a
fixed ``num_replicas``); a replica that is stopped has ``ServeConfig.drain_timeout_s`` (``--drain-timeout``) plus
:data:`SHUTDOWN_MARGIN_S` to finish its requests (``graceful_shutdown_timeout_s``). :func:`run` refuses to replace an
application of the same name that Serve already runs, and returns the address of Serve's proxy (a Serve started
before keeps its own host and port). ``/metrics`` and ``/health`` describe the replica that answered
(``X-Kvrag-Server``, with ``ServeConfig(server_header=True)`` / ``kvrag serve --server-header``).
Needs ``pip install 'kvrag[ray-serve]'``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvrag.errors import ConfigError
from kvrag.extras import require

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.actor import ActorHandle

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.serve.config import ServeConfig

TABLE_NAME = "kvrag-serve-chunks"

SHUTDOWN_MARGIN_S = 2.0
"""Seconds a stopped replica gets past the drain timeout (``graceful_shutdown_timeout_s``) before Ray kills it."""


class ChunkTable:
    """The registered chunk texts of one deployment, in registration order (a Ray actor)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.seen: set[str] = set()

    def add(self, texts: list[str]) -> int:
        for t in texts:
            if t not in self.seen:
                self.seen.add(t)
                self.texts.append(t)
        return len(self.texts)

    def since(self, n: int) -> list[str]:
        """Texts registered after the first ``n``."""
        return self.texts[n:]


class RayChunkSync:
    """A replica's view of the shared :class:`ChunkTable` (the app's ``KVRAGService.sync``)."""

    def __init__(self, table: ActorHandle) -> None:
        self.table = table
        self.pulled = 0

    async def push(self, texts: list[str]) -> None:
        if texts:
            await self.table.add.remote(texts)

    async def pull(self) -> list[str]:
        new: list[str] = await self.table.since.remote(self.pulled)
        self.pulled += len(new)
        return new


def application(engine_factory: Callable[[], KVRAGEngine], config: ServeConfig | None = None, *,
                persist: str | None = None, replicas: int = 2, max_ongoing_requests: int | None = None,
                autoscaling_config: Mapping[str, object] | None = None,
                ray_actor_options: Mapping[str, object] | None = None,
                name: str = "kvrag") -> Any:
    """The Ray Serve application (``serve.run`` it). Call with Ray initialized (the chunk table is created then).

    Args:
        engine_factory: builds a :class:`~kvrag.engine.engine.KVRAGEngine` in a replica (picklable, e.g.
            ``functools.partial(KVRAGEngine.from_pretrained, None, "redis://host:6379/0")``).
        config: :class:`~kvrag.serve.ServeConfig` of each replica.
        persist: a ``kvrag ingest`` index every replica registers at start (a path each replica can read).
        replicas: fixed number of replicas (ignored with ``autoscaling_config``).
        max_ongoing_requests / autoscaling_config / ray_actor_options: Ray Serve's deployment settings.
    """
    ray = require("ray", "ray-serve", "kvrag serve --ray")
    serve = require("ray.serve", "ray-serve", "kvrag serve --ray")
    table = ray.remote(num_cpus=0)(ChunkTable).options(name=f"{TABLE_NAME}-{name}", get_if_exists=True,
                                                       lifetime="detached").remote()

    def build() -> FastAPI:
        from kvrag.serve.app import create_app

        app = create_app(engine_factory(), config, persist=persist, close_engine=True)
        app.state.kvrag.sync = RayChunkSync(table)
        return app

    opts: dict[str, object] = {"name": name}
    if config is not None:  # a replica being stopped gets the app's drain timeout, not Ray's default
        opts["graceful_shutdown_timeout_s"] = float(config.drain_timeout_s) + SHUTDOWN_MARGIN_S
    if autoscaling_config:
        opts["autoscaling_config"] = autoscaling_config
    else:
        opts["num_replicas"] = int(replicas)
    if max_ongoing_requests:
        opts["max_ongoing_requests"] = int(max_ongoing_requests)
    if ray_actor_options is not None:
        opts["ray_actor_options"] = ray_actor_options
    return serve.deployment(serve.ingress(build)(), **opts).bind()


def run(engine_factory: Callable[[], KVRAGEngine], config: ServeConfig | None = None, *, host: str = "127.0.0.1",
        port: int = 8000, address: str | None = None, name: str = "kvrag", **kw: Any) -> str:
    """Start (or join, ``address``) Ray, start Serve's HTTP proxy on ``host:port`` and deploy; returns the base URL.
    Keyword arguments are :func:`application`'s."""
    ray = require("ray", "ray-serve", "kvrag serve --ray")
    serve = require("ray.serve", "ray-serve", "kvrag serve --ray")
    if not ray.is_initialized():
        ray.init(address=address, namespace="kvrag", log_to_driver=False)
    running = serve.status().applications
    if name in running:
        state = getattr(running[name], "status", "")
        msg = (f"Ray Serve on this cluster already runs an application named {name!r} ({state}); deploying would "
               "replace it: stop the `kvrag serve --ray` that deployed it (Ctrl-C), or run `serve shutdown` "
               "against the cluster, then start again")
        raise ConfigError(msg)
    serve.start(http_options={"host": host, "port": int(port)})
    serve.run(application(engine_factory, config, name=name, **kw), name=name, route_prefix="/")
    return proxy_url(serve, host, int(port))


def proxy_url(serve: ModuleType, host: str, port: int) -> str:
    """The base URL of Serve's HTTP proxy (``serve``: the ``ray.serve`` module): its own host and port (a cluster
    whose Serve was started before keeps its proxy and ignores the ones asked for), else ``host:port``."""
    try:
        cfg = serve.context._get_global_client().http_config
        host, port = str(cfg.host), int(cfg.port)
    except Exception:  # noqa: BLE001 - Ray's client is not public API: fall back to what was asked for
        pass
    return f"http://{host}:{port}"


def shutdown(name: str = "kvrag") -> None:
    """Remove the deployment and its chunk table (Ray itself keeps running)."""
    ray = require("ray", "ray-serve", "kvrag serve --ray")
    serve = require("ray.serve", "ray-serve", "kvrag serve --ray")
    serve.delete(name)
    try:
        ray.kill(ray.get_actor(f"{TABLE_NAME}-{name}"))
    except ValueError:
        pass


__all__ = ["SHUTDOWN_MARGIN_S", "TABLE_NAME", "ChunkTable", "RayChunkSync", "application", "proxy_url", "run",
           "shutdown"]
