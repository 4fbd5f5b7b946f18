"""The ``kvrag serve`` FastAPI app: OpenAI-compatible completions that reuse registered chunks' KV caches.

A request's path:

1. **Guard** (:mod:`kvrag.serve.middleware`): its API key (401) and body size (413), before the app reads it;
   outside it the CORS layer (with ``--allowed-origins``) and the count of every response.
2. **Checks** (:meth:`KVRAGService.check`): the body's fields (pydantic, :mod:`kvrag.serve.protocol`), the limits
   (:mod:`kvrag.serve.config`), the method and its parameters (none may name a file), the sampling fields. Nothing
   is reserved for a request that fails one.
3. **Admission**: the server holds at most ``ServeConfig.max_queue`` requests (decoding or waiting, and chunk
   registrations); one more is answered ``429`` at once, with ``Retry-After`` (the median duration of recent
   requests, at least one second).
4. **Prompt**: chat messages are rendered with the model's chat template (:func:`kvrag.prompting.render_chat`), a
   completion's prompt is taken as it is.
5. **Chunks**: the chunks offered to the planner are the registered ones (``POST /v1/kvrag/chunks`` and the
   ``--persist`` index) that occur verbatim in the prompt (:class:`kvrag.adapters.RecentChunks`), or the request's
   explicit ``kvrag.chunks``. No kvrag code is needed on the client.
6. **Prepare** (fetch, assemble, repair, suffix prefill) in a worker thread; errors become HTTP 400 responses before any byte is
   sent (prompt over the context window: ``code="context_length_exceeded"``), also for ``stream=true``. A store that
   is down is answered by recomputing and flagged with a ``Warning: 199 kvrag "..."`` header.
7. **Decode** in the engine's shared batch. The response streams by SSE or is collected.

Everything from admission on is owned by the request's :class:`~kvrag.serve.outcome.Outcome`, which gives the KV
lease and the queue place back, sets the status and counts it, however the request ends (a client that goes away
cancels its request: 499). Every error is OpenAI's error object (:mod:`kvrag.serve.errors`).

``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens whose KV came from chunk caches (the engine's
``reused_tokens``; 0 for ``full``). Each response also carries ``kvrag`` (method, TTFT, hit rate, chunk counts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvrag.extras import require
from kvrag.serve.config import ServeConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvrag.engine.engine import KVRAGEngine

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 1.0
"""On shutdown, the most seconds to wait for the engine's runner after the requests were cancelled (a forward in
flight cannot be interrupted; the runner thread is a daemon and does not hold the process)."""


async def _close(engine: KVRAGEngine) -> None:
    """``engine.close(cancel=True)`` in a daemon thread, waited for at most :data:`CLOSE_WAIT_S` seconds."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def close() -> None:
        try:
            engine.close(cancel=True)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(done.set)

    threading.Thread(target=close, name="kvrag-close", daemon=True).start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), CLOSE_WAIT_S)


def create_app(engine: KVRAGEngine, config: ServeConfig | None = None, *, persist: str | None = None,
               close_engine: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: a :class:`~kvrag.engine.engine.KVRAGEngine`.
        config: server settings (:class:`ServeConfig`: limits, keys, docs pages, drain timeout).
        persist: a ``kvrag ingest`` index directory whose chunks are registered at start.
        close_engine: close the engine (its requests cancelled, its runner joined) when the app shuts down; for an
            app that owns its engine (``kvrag serve``), not for one serving an engine its caller keeps using.
    """
    fastapi = require("fastapi", "serve", "kvrag serve")
    from kvrag.serve import errors
    from kvrag.serve.middleware import Counted, Guard, OneBody, cors
    from kvrag.serve.routes import router
    from kvrag.serve.service import KVRAGService

    svc = KVRAGService(engine, config)
    cfg = svc.config
    if persist:
        log.info("registered %d chunks of the index in %s", svc.register_index(persist), persist)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        svc.abort()  # uvicorn has drained what it could: anything left is cancelled
        if close_engine:
            await _close(engine)

    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    # no 307 to the path without its trailing slash: built from the Host header, behind a proxy it names an address
    # the client cannot reach; the 404 says which path was meant (errors._http)
    app = fastapi.FastAPI(title="kvrag serve", version="1", lifespan=lifespan, **docs, redirect_slashes=False,
                          description="OpenAI-compatible completions with reused, repaired chunk KV caches.")
    app.state.kvrag = svc
    errors.install(app)
    app.include_router(router)
    app.add_middleware(Guard, api_keys=cfg.api_keys, max_body_bytes=cfg.max_body_bytes,
                       server_header=f"{socket.gethostname()}:{os.getpid()}" if cfg.server_header else None)
    if cfg.allowed_origins:  # outside the guard: a browser's preflight carries no API key
        app.add_middleware(cors, origins=cfg.allowed_origins)
    app.add_middleware(OneBody)  # HTTP/1.0: no chunked coding
    app.add_middleware(Counted)  # outermost: every response counted, preflights too
    return app


def __getattr__(name: str) -> object:  # the names this module exported before the split
    if name in ("KVRAGService", "HTTPProblem", "STORE_WARNING"):
        from kvrag.serve import errors, routes, service

        return {"KVRAGService": service.KVRAGService, "HTTPProblem": errors.HTTPProblem,
                "STORE_WARNING": routes.STORE_WARNING}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServeConfig", "create_app"]
