"""The endpoints of ``kvrag serve``, at module level; each gets the app's :class:`~kvrag.serve.service.KVRAGService`
through the :func:`service` dependency."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvrag import adapters
from kvrag.serve import bodies
from kvrag.serve.bodies import JSONObject, Kind
from kvrag.serve.errors import HTTPProblem
from kvrag.serve.outcome import SIBLING_FAILED, queue_full
from kvrag.serve.protocol import ChatCompletionRequest, ChunksRequest, CompletionRequest
from kvrag.serve.service import KVRAGService

STORE_WARNING = '199 kvrag "the KV store is unavailable: chunk caches were recomputed for this request"'
"""The ``Warning`` header of a response answered while the store was down."""

router = APIRouter()


def service(request: Request) -> KVRAGService:
    """The app's service (``app.state.kvrag``)."""
    svc = request.app.state.kvrag
    assert isinstance(svc, KVRAGService)
    return svc


Service = Annotated[KVRAGService, Depends(service)]


class EventStream(StreamingResponse):
    """A stream whose body iterator is closed however the response ends (the client gone included), so that the
    request's :class:`~kvrag.serve.outcome.Outcome` ends with it."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]


def _headers(svc: KVRAGService) -> dict[str, str]:
    if svc.store_recomputing():
        svc.metrics.store_degraded.inc()
        return {"Warning": STORE_WARNING}
    return {}


async def _streamed(svc: KVRAGService, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt: str, kind: Kind) -> AsyncIterator[bytes]:
    """A streamed completion, whole: its first item (``b""``) comes once it is prepared, so that an error before
    then is answered as a plain error response."""
    async with svc.outcome("chat" if kind == "chat" else "completions", request) as out:
        job = await svc.start(out, body, prompt, kind)
        yield b""
        async with contextlib.aclosing(svc.events(out, job)) as events:  # closed with this one: the decode stops
            async for event in events:
                yield event


async def _answered(svc: KVRAGService, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt: str, kind: Kind) -> tuple[bodies.Job, str]:
    async with svc.outcome("chat" if kind == "chat" else "completions", request) as out:
        job = await svc.start(out, body, prompt, kind)
        return job, await svc.collect(out, job)


async def _complete(svc: KVRAGService, request: Request, body: ChatCompletionRequest | CompletionRequest,
                    prompt: str, kind: Kind) -> Response:
    if body.stream:
        events = _streamed(svc, request, body, prompt, kind)
        await anext(events)  # admitted and prepared, or the error is raised here
        return EventStream(events, _headers(svc))
    job, text = await _answered(svc, request, body, prompt, kind)
    return JSONResponse(bodies.full_body(job, text), headers=_headers(svc))


async def _complete_batch(svc: KVRAGService, request: Request, body: CompletionRequest) -> Response:
    """A list of prompts (LangChain's ``OpenAI`` LLM sends up to 20): each a request of its own, decoded together;
    the first failure cancels the others and is the answer. The list takes its places in the queue together: one
    longer than ``--max-queue`` is a 400 (retrying could never pass), one that does not fit now a 429."""
    prompts, cap = body.prompts(), svc.config.max_queue
    if len(prompts) > cap:
        raise HTTPProblem(400, f"prompt holds {len(prompts)} prompts, and this server holds at most {cap} requests "
                               f"at once (--max-queue {cap}): send at most {cap} prompts a request", param="prompt",
                          code="too_many_prompts")
    if svc.held + len(prompts) > cap and not svc.draining:
        raise queue_full(svc, len(prompts))
    tasks = [asyncio.ensure_future(_answered(svc, request, body, p, "text")) for p in prompts]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException as e:
        status = getattr(e, "status", 499)  # what the list is answered with: its siblings end with it too
        for t in tasks:
            t.cancel(f"{SIBLING_FAILED}{status}")
        await asyncio.gather(*tasks, return_exceptions=True)  # their queue places and leases given back
        failed = next((i for i, t in enumerate(tasks) if not t.cancelled() and t.exception() is e), None)
        if isinstance(e, HTTPProblem) and failed is not None and e.body["error"].get("param") in (None, "prompt"):
            e.body["error"]["param"] = f"prompt.{failed}"  # which prompt of the list
        raise
    return JSONResponse(bodies.batch_body(done), headers=_headers(svc))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, svc: Service) -> Response:
    """OpenAI chat completions; the messages are rendered with the model's chat template."""
    svc.check(body)
    msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
    svc.check_messages(msgs)
    prompt = adapters.render_chat(svc.engine.tokenizer, msgs)
    return await _complete(svc, request, body, prompt, "chat")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, svc: Service) -> Response:
    """OpenAI (legacy) completions: the prompt is used as it is, no chat template; a list of prompts gets one
    choice per prompt."""
    if len(body.prompts()) > 1:
        return await _complete_batch(svc, request, body)
    return await _complete(svc, request, body, body.text(), "text")


def _model_card(svc: KVRAGService) -> JSONObject:
    return {"id": svc.model_id, "object": "model", "created": 0, "owned_by": "kvrag",
            "max_model_len": int(svc.engine.max_context)}


@router.get("/v1/models")
@router.head("/v1/models", include_in_schema=False)  # load balancers and probes use HEAD
async def models(svc: Service) -> JSONObject:
    return {"object": "list", "data": [_model_card(svc)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, svc: Service) -> JSONObject:
    """OpenAI's ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``): the served model, else 404."""
    if not model_id:  # /v1/models/ -- the list's path with a trailing slash, not a model named ""
        raise HTTPProblem(404, "no such endpoint: GET /v1/models/; without the trailing slash: /v1/models",
                          code="not_found")
    if model_id != svc.model_id:
        raise HTTPProblem(404, f"model {model_id!r} is not served here; this server serves {svc.model_id!r}",
                          param="model", code="model_not_found")
    return _model_card(svc)


@router.post("/v1/kvrag/chunks")
async def register_chunks(body: ChunksRequest, request: Request, svc: Service) -> JSONResponse:
    """Register passages and cache the missing ones; one ``{"key", "cached", "tokens"}`` per text, in order. The
    registration holds a place in the queue and stops when its client leaves. With the store down the caches are
    computed but not kept: the response carries the ``Warning`` header of :data:`STORE_WARNING`."""
    reserved = svc.check_texts(body.texts)
    try:
        async with svc.outcome("chunks", request) as out:
            out.admit()
            data = await out.run(svc.register, body.texts)
            if svc.sync is not None:
                pushed = [t for t, d in zip(body.texts, data, strict=True) if d["key"] is not None]
                await out.guard(svc.sync.push(pushed))
            return JSONResponse({"object": "list", "data": data, "registered": svc.registered},
                                headers=_headers(svc))
    finally:
        svc.unreserve(reserved)


@router.get("/health")
@router.head("/health", include_in_schema=False)  # load balancers and probes use HEAD
async def health(svc: Service) -> JSONResponse:
    """200 while the engine makes progress; 503 when it is stalled or wedged (``problems`` says which)."""
    problems, body = svc.health()
    return JSONResponse(body, status_code=503 if problems else 200)


@router.get("/health/ready")
@router.head("/health/ready", include_in_schema=False)  # load balancers and probes use HEAD
async def ready(svc: Service) -> JSONResponse:
    """For load balancers: 200 when a request sent now would be taken (healthy, not draining, queue not full)."""
    problems, body = svc.health()
    if svc.held >= svc.config.max_queue:
        problems = [*problems, "the queue is full"]
    if svc.draining:
        problems = [*problems, "the server is shutting down"]
    body["ready"] = not problems
    if problems:
        body["problems"] = problems
    return JSONResponse(body, status_code=503 if problems else 200)


@router.get("/metrics")
async def metrics(svc: Service) -> Response:
    data, content_type = svc.metrics.render()
    return Response(content=data, media_type=content_type)


__all__ = ["STORE_WARNING", "EventStream", "Service", "router", "service"]

