"""The ``kvrag serve`` FastAPI app: OpenAI-compatible completions that reuse registered chunks' KV caches.

A request's path:

1. **Admission**: the server holds at most ``ServeConfig.max_queue`` requests (decoding or waiting); one more is
   answered ``429`` at once, with ``Retry-After`` (the median duration of recent requests, at least 1 s).
2. **Prompt**: chat messages are rendered with the model's chat template (:func:`kvrag.prompting.render_chat`, the
   renderer the in-process adapters use), completions take the prompt as it is.
3. **Chunks**: the chunks offered to the planner are the registered ones (``POST /v1/kvrag/chunks`` and the
   ``--persist`` index) that occur verbatim in the prompt (:class:`kvrag.adapters.RecentChunks`), or the request's
   explicit ``kvrag.chunks``. No kvrag code is needed on the client: any client that puts the passages in its
   messages reuses their caches.
4. **Prepare** (fetch, assemble, repair, suffix prefill) in a worker thread; errors become 400s before any byte is
   sent (prompt over the context window: ``code="context_length_exceeded"``), also for ``stream=true``. A store that
   is down is answered by recomputing (``EngineConfig.on_store_error="recompute"``) and flagged with a
   ``Warning: 199 kvrag "..."`` header.
5. **Decode** in the engine's shared batch (:mod:`kvrag.engine.runner`). The response streams by SSE or is
   collected. A client that goes away cancels its request: the stream generator is closed, which takes the request
   out of the batch at the next step and releases its KV memory.

``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens whose KV came from chunk caches (the engine's
``reused_tokens``; 0 for ``full``). Each response also carries ``kvrag`` (method, TTFT, hit rate, chunk counts).
"""

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import statistics
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, cast

from kvrag import adapters
from kvrag.errors import ConfigError, ContextLengthError, KVRAGError
from kvrag.extras import require
from kvrag.serve.metrics import Metrics
from kvrag.serve.protocol import (
    ChatCompletionRequest,
    ChunksRequest,
    CompletionRequest,
    openai_error,
    validation_error_body,
)

log = logging.getLogger(__name__)

STORE_WARNING = '199 kvrag "the KV store is unavailable: chunk caches were recomputed for this request"'
"""The ``Warning`` header of a response answered while the store was down."""


@dataclasses.dataclass
class ServeConfig:
    """Server settings (the engine's own settings are :class:`~kvrag.config.EngineConfig`).

    Attributes:
        model_id: the model name clients send and ``/v1/models`` lists (default: the engine's model name).
        method: default fusion method spec for requests that name none (default: the engine's ``method``).
        max_queue: most requests the server holds at once, decoding or waiting; more get 429 with ``Retry-After``.
        default_max_tokens: ``/v1/chat/completions`` without ``max_tokens`` / ``max_completion_tokens``.
        max_registered_chunks / max_registered_chars: bound of the registered-chunk table (least recently
            registered texts are forgotten first; their caches stay in the store).
        drain_timeout_s: on shutdown, seconds to let requests in flight finish before closing their connections.
    """

    model_id: str | None = None
    method: str | None = None
    max_queue: int = 64
    default_max_tokens: int = 256
    max_registered_chunks: int = 100_000
    max_registered_chars: int = 200_000_000
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ConfigError(f"max_queue must be an integer >= 1, got {self.max_queue!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s!r}")


class HTTPProblem(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = openai_error(message, param=param, code=code, type_=type_)
        self.headers = headers or {}


@dataclasses.dataclass
class _Job:
    """One admitted completion request, from prepare to its last byte."""

    kind: str  # "chat" | "text"
    model: str
    prep: Any
    gen: Any
    arrived: float
    include_usage: bool
    finished: bool = False
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class KVRAGService:
    """What the endpoints call: the engine, the registered chunks, admission and metrics.

    Args:
        engine: a :class:`~kvrag.engine.engine.KVRAGEngine` (one per process; it batches the requests itself).
        config: server settings.
    """

    def __init__(self, engine: Any, config: ServeConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServeConfig()
        self.model_id = self.config.model_id or str(getattr(engine.loaded, "name", "kvrag"))
        self.chunks = adapters.RecentChunks(self.config.max_registered_chunks, self.config.max_registered_chars)
        self.metrics = Metrics(engine)
        self.held = 0
        self.sync: Any = None
        """Optional table shared with other replicas (:class:`kvrag.serve.ray_serve.RayChunkSync`): ``async push(texts)``
        after a registration, ``async pull() -> list[str]`` (texts registered elsewhere since the last pull)."""
        self._durations: collections.deque[float] = collections.deque(maxlen=64)
        self.default_method = engine.method(self.config.method) if self.config.method else None

    # ------------------------------------------------------------------------------------------- chunks
    def register(self, texts: list[str]) -> list[dict[str, Any]]:
        """Cache (when missing) and register passages; one ``{"key", "cached", "tokens"}`` per text (key None for
        whitespace-only texts, which are neither cached nor registered)."""
        got = adapters.ensure_chunks(self.engine, texts)
        self.chunks.add([c for c, _ in got if c is not None])
        return [{"key": None if c is None else c.key, "cached": bool(was),
                 "tokens": 0 if c is None or c.token_ids is None else len(c.token_ids)} for c, was in got]

    def register_index(self, persist: str) -> int:
        """Register the chunks of a ``kvrag ingest`` index as ``kvrag ask`` renders them into prompts
        (:func:`kvrag.prompting.render_passage`); their caches are the ones ingest stored. Returns the count."""
        from kvrag.index import ChunkIndex
        from kvrag.prompting import render_passage

        index = ChunkIndex.load(persist)
        texts = [render_passage(c.text) for c in index.chunks]
        self.chunks.add(texts)
        return len(texts)

    # ------------------------------------------------------------------------------------------- admission
    def retry_after(self) -> int:
        return max(1, math.ceil(statistics.median(self._durations))) if self._durations else 1

    def admit(self) -> None:
        if self.held >= self.config.max_queue:
            raise HTTPProblem(429, f"the server holds {self.held} requests, its limit (--max-queue "
                                   f"{self.config.max_queue}); retry later", type_="rate_limit_error",
                              code="queue_full", headers={"Retry-After": str(self.retry_after())})
        self.held += 1
        self.metrics.in_flight.set(self.held)

    def release(self, arrived: float, answered: bool) -> None:
        self.held -= 1
        self.metrics.in_flight.set(self.held)
        if answered:
            d = time.perf_counter() - arrived
            self._durations.append(d)
            self.metrics.duration.observe(d)

    # ------------------------------------------------------------------------------------------- requests
    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise HTTPProblem(404, f"model {model!r} is not served here; this server serves {self.model_id!r} "
                                   "(GET /v1/models)", param="model", code="model_not_found")

    async def start(self, body: ChatCompletionRequest | CompletionRequest, prompt: str, kind: str,
                    arrived: float) -> _Job:
        """Plan and prepare an admitted request (400 for bad options or a prompt over the context window)."""
        eng = self.engine
        opts = body.kvrag
        try:
            method = self.default_method
            if opts is not None and (opts.method is not None or opts.params):
                method = eng.method(opts.method or self.config.method, **opts.params)
        except (ConfigError, TypeError, ValueError) as e:
            raise HTTPProblem(400, f"kvrag.method: {e}", param="kvrag.method") from e
        explicit = opts.chunks if opts is not None else None
        if self.sync is not None:
            self.chunks.add(await self.sync.pull())
        refs = adapters.resolve_chunks(prompt, explicit, use_context=False) if explicit is not None \
            else self.chunks.found_in(prompt)
        plan = await adapters.to_thread(eng.plan, prompt, refs)
        room = int(eng.max_context) - int(plan.total_len)
        where = "messages" if kind == "chat" else "prompt"
        if room < 1:
            raise HTTPProblem(400, f"the prompt has {plan.total_len} tokens but the model's context window is "
                                   f"{eng.max_context}; send fewer or shorter passages", param=where,
                              code="context_length_exceeded")
        requested = body.requested_tokens()
        if requested is None:
            requested = self.config.default_max_tokens
        temperature = body.temperature if body.temperature is not None else 0.0
        try:
            gen = adapters.generation_config(max_new_tokens=min(int(requested), room), temperature=temperature,
                                             top_p=body.top_p if body.top_p is not None else 1.0, seed=body.seed,
                                             stop=body.stops())
            prep = await adapters.to_thread(eng.prepare, plan, method, reserve=gen.max_new_tokens)
        except ContextLengthError as e:
            raise HTTPProblem(400, str(e), param=where, code="context_length_exceeded") from e
        except ConfigError as e:
            raise HTTPProblem(400, str(e)) from e
        self.metrics.observe_prepared(prep, arrived)
        return _Job(kind, self.model_id, prep, gen, arrived, body.include_usage())

    def store_degraded(self) -> bool:
        return bool(getattr(self.engine.serving_store, "degraded", False))

    async def tokens(self, job: _Job) -> AsyncGenerator[str, None]:
        """The request's text deltas, decoded in the engine's batch (one worker thread drives the stream; closing
        this iterator takes the request out of the batch)."""
        last: float | None = None
        stream = cast(AsyncGenerator[str, None], adapters.aiter_in_thread(lambda: self.engine.stream(job.prep, job.gen)))
        async with contextlib.aclosing(stream) as it:
            async for delta in it:
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                yield delta

    # ------------------------------------------------------------------------------------------- bodies
    def usage(self, job: _Job) -> dict[str, Any]:
        prompt, generated = adapters.token_usage(job.prep)
        generated = generated or 0
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": int(job.prep.stats.reused_tokens)}}

    def finish_reason(self, job: _Job) -> str:
        generated = job.prep.stats.generated_tokens or len(job.prep.token_ids)
        return "length" if generated >= job.gen.max_new_tokens else "stop"

    def summary(self, job: _Job) -> dict[str, Any]:
        return adapters.response_summary(job.prep)

    def full_body(self, job: _Job, text: str) -> dict[str, Any]:
        self.metrics.completion_tokens.inc(len(job.prep.token_ids))
        if job.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason(job)}
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason(job)}
            obj, prefix = "text_completion", "cmpl-"
        return {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
                "choices": [choice], "usage": self.usage(job), "kvrag": self.summary(job)}

    def chunk_body(self, job: _Job, delta: str | None, finish: str | None = None, *, role: bool = False,
                   usage: bool = False) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        if not usage:
            if job.kind == "chat":
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                    ({} if delta is None else {"content": delta})
                choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
            else:
                choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
        obj, prefix = ("chat.completion.chunk", "chatcmpl-") if job.kind == "chat" else ("text_completion", "cmpl-")
        out: dict[str, Any] = {"id": prefix + job.id, "object": obj, "created": job.created, "model": job.model,
                               "choices": choices}
        if usage:
            out["usage"] = self.usage(job)
        if finish is not None:
            out["kvrag"] = self.summary(job)
        return out

    async def events(self, job: _Job) -> AsyncGenerator[bytes, None]:
        """The SSE events of a streamed response (OpenAI's chunk objects, then ``[DONE]``)."""
        if job.kind == "chat":
            yield _sse(self.chunk_body(job, None, role=True))
        async with contextlib.aclosing(self.tokens(job)) as toks:
            async for delta in toks:
                yield _sse(self.chunk_body(job, delta))
        self.metrics.completion_tokens.inc(len(job.prep.token_ids))
        yield _sse(self.chunk_body(job, None, self.finish_reason(job)))
        if job.include_usage:
            yield _sse(self.chunk_body(job, None, usage=True))
        job.finished = True
        yield b"data: [DONE]\n\n"


class _ServerHeader:
    """ASGI middleware: ``X-Kvrag-Server: host:pid`` on every response (which replica answered, behind a balancer).
    Plain ASGI, so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: Any, value: str) -> None:
        self.app = app
        self.header = (b"x-kvrag-server", value.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_app(engine: Any, config: ServeConfig | None = None, *, persist: str | None = None,
               close_engine: bool = False) -> Any:
    """The FastAPI app serving ``engine``.

    Args:
        engine: a :class:`~kvrag.engine.engine.KVRAGEngine`.
        config: server settings.
        persist: a ``kvrag ingest`` index directory whose chunks are registered at start.
        close_engine: close the engine (``engine.close()``: its runner drained and joined) when the app shuts down;
            for an app that owns its engine (``kvrag serve``), not for one serving an engine its caller keeps using.
    """
    fastapi = require("fastapi", "serve", "kvrag serve")
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    svc = KVRAGService(engine, config)
    if persist:
        n = svc.register_index(persist)
        log.info("registered %d chunks of the index in %s", n, persist)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        # uvicorn has already let the requests in flight finish (graceful shutdown); anything left is cancelled
        if close_engine:
            await asyncio.to_thread(engine.close)

    app = fastapi.FastAPI(title="kvrag serve", version="1", lifespan=lifespan,
                          description="OpenAI-compatible completions with reused, repaired chunk KV caches.")
    app.state.kvrag = svc
    app.add_middleware(_ServerHeader, value=f"{socket.gethostname()}:{os.getpid()}")

    class KVStreamingResponse(StreamingResponse):
        """Releases the request's place when the response ends, however it ends (client gone included)."""

        def __init__(self, content: Any, *, on_end: Callable[[], None], **kw: Any) -> None:
            super().__init__(content, **kw)
            self._on_end = on_end
            self._content = content

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            except (ClientDisconnect, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    await self._content.aclose()
                self._on_end()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Any, exc: Any) -> Any:
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(HTTPProblem)
    async def _problem(request: Any, exc: HTTPProblem) -> Any:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    async def complete(request: Any, body: ChatCompletionRequest | CompletionRequest, prompt_fn: Callable[[], str],
                       kind: str) -> Any:
        arrived = time.perf_counter()
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            svc.check_model(body.model)
            svc.admit()
        except HTTPProblem as e:
            svc.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
            raise
        handed_off = False
        try:
            job = await svc.start(body, prompt_fn(), kind, arrived)
            headers = {"Warning": STORE_WARNING} if svc.store_degraded() else {}
            if headers:
                svc.metrics.store_degraded.inc()
            if body.stream:
                def on_end() -> None:
                    svc.release(arrived, job.finished)
                    svc.metrics.requests.labels(endpoint=endpoint, status="200" if job.finished else "499").inc()
                    if not job.finished:
                        svc.metrics.cancelled.inc()

                resp = KVStreamingResponse(svc.events(job), on_end=on_end, media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache", **headers})
                handed_off = True
                return resp
            parts = []
            async with contextlib.aclosing(svc.tokens(job)) as toks:
                async for delta in toks:
                    parts.append(delta)
                    if await request.is_disconnected():
                        svc.metrics.cancelled.inc()
                        svc.metrics.requests.labels(endpoint=endpoint, status="499").inc()
                        return Response(status_code=499)
            out = svc.full_body(job, "".join(parts))
            svc.metrics.requests.labels(endpoint=endpoint, status="200").inc()
            handed_off = True
            svc.release(arrived, True)
            return JSONResponse(out, headers=headers)
        except HTTPProblem as e:
            svc.metrics.requests.labels(endpoint=endpoint, status=str(e.status)).inc()
            raise
        except KVRAGError as e:
            svc.metrics.requests.labels(endpoint=endpoint, status="500").inc()
            raise HTTPProblem(500, f"{type(e).__name__}: {e}", type_="server_error") from e
        finally:
            if not handed_off:
                svc.release(arrived, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI chat completions; the messages are rendered with the model's chat template."""
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        return await complete(request, body, lambda: adapters.render_chat(engine.tokenizer, msgs), "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI (legacy) completions: the prompt is used as it is, no chat template."""
        return await complete(request, body, body.text, "text")

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": svc.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvrag", "max_model_len": int(engine.max_context)}]}

    @app.post("/v1/kvrag/chunks")
    async def register_chunks(body: ChunksRequest) -> Any:
        """Register passages and cache the missing ones; one ``{"key", "cached", "tokens"}`` per text, in order."""
        try:
            data = await adapters.to_thread(svc.register, body.texts)
        except KVRAGError as e:
            raise HTTPProblem(400 if isinstance(e, ConfigError | ContextLengthError) else 500, str(e),
                              param="texts") from e
        if svc.sync is not None:
            await svc.sync.push([t for t, d in zip(body.texts, data, strict=True) if d["key"] is not None])
        return {"object": "list", "data": data, "registered": len(svc.chunks)}

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok", "model": svc.model_id, "in_flight": svc.held, "max_queue": svc.config.max_queue,
                "store": "degraded" if svc.store_degraded() else "ok", "registered_chunks": len(svc.chunks)}

    @app.get("/metrics")
    async def metrics() -> Any:
        data, content_type = svc.metrics.render()
        return Response(content=data, media_type=content_type)

    return app


__all__ = ["STORE_WARNING", "HTTPProblem", "KVRAGService", "ServeConfig", "create_app"]
