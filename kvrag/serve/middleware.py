"""The app's outer layer (plain ASGI, so streamed responses and disconnects pass through untouched): API keys, the
request body limit, the optional ``X-Kvrag-Server`` header, the answer to a failure no handler answered, CORS, and
the count of every response."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from kvrag.serve.errors import HTTPProblem, unexpected

Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health", "/health/ready"})
"""Paths answered without an API key (load balancers' health checks)."""


class _TooLarge(HTTPException):
    """The body passed the limit while it was read (inside the app: answered by its 413 handler)."""

    def __init__(self, limit: int, seen: int) -> None:
        super().__init__(413, _too_large(limit, seen).body["error"]["message"])  # type: ignore[index]


class Guard:
    """Refuses, before the app sees the request: a missing or wrong key (401, when the server has keys), a body
    in a ``Content-Encoding`` (415: gzip, br ... are not decoded) and a body over ``max_body_bytes`` (413, by its
    ``Content-Length`` at once, else as soon as the bytes read pass it).

    Args:
        app: the ASGI app.
        api_keys: accepted ``Authorization: Bearer`` keys (empty: none needed).
        max_body_bytes: the most bytes of a request body.
        server_header: value of an ``X-Kvrag-Server`` header added to every response (None: no header).
    """

    def __init__(self, app: ASGIApp, *, api_keys: tuple[str, ...], max_body_bytes: int,
                 server_header: str | None = None) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes
        self.header = None if server_header is None else (b"x-kvrag-server", server_header.encode())

    def authorized(self, scope: Scope) -> bool:
        if not self.keys or scope.get("path") in OPEN_PATHS:
            return True
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, key = got.partition(b" ")
        key = key.strip()
        ok = False
        for k in self.keys:  # every key compared, in constant time
            ok |= hmac.compare_digest(key, k)
        return scheme.lower() == b"bearer" and ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        svc = getattr(getattr(scope.get("app"), "state", None), "kvrag", None)
        if self.header is not None:
            inner_send, header = send, self.header

            async def send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), header]
                await inner_send(message)

        if not self.authorized(scope):
            await _answer(HTTPProblem(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY' "
                                           "(the openai SDK's api_key)", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"}), scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        coding = headers.get(b"content-encoding", b"identity").strip().lower()
        if coding not in (b"", b"identity"):  # the body would be read as JSON as it is: say so instead
            await _answer(HTTPProblem(415, f"Content-Encoding {coding.decode('latin-1')!r} is not supported: send the "
                                           "JSON body uncompressed", code="unsupported_content_encoding"),
                          scope, receive, send)
            return
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _answer(_too_large(limit, int(length)), scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit, seen)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _answer(_too_large(limit, seen), scope, receive, send)
        except Exception as e:
            if started:
                raise
            # what no handler of the app answered: OpenAI's error object, logged here; answered without re-raising,
            # so that the server keeps the client's connection (the app's last-resort handler would drop it)
            await _answer(unexpected(e, f"{scope.get('method')} {scope.get('path')}", svc), scope, receive, send)


class Counted:
    """The outermost layer: every response counted by status (``kvrag_http_responses_total``), also those answered
    before the app (a refused key or body, a CORS preflight)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        svc = getattr(getattr(scope.get("app"), "state", None), "kvrag", None)
        if scope["type"] != "http" or svc is None:
            await self.app(scope, receive, send)
            return
        responses = svc.metrics.responses

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                responses.labels(status=str(message.get("status", 0))).inc()
            await send(message)

        await self.app(scope, receive, counted)


class OneBody:
    """An HTTP/1.0 client gets every response with a ``Content-Length``: a stream (server-sent events) is sent
    whole when it ends. HTTP/1.0 has no chunked transfer coding, which uvicorn's httptools protocol writes anyway;
    1.1 clients (and proxies speaking 1.1 upstream) stream as before."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("http_version") != "1.0":
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def whole(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = b"".join(parts)
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, whole)


def cors(app: ASGIApp, origins: tuple[str, ...]) -> ASGIApp:
    """Starlette's CORS layer for ``origins``, whose refused preflight (an origin, method or header not allowed) is
    an OpenAI error naming the setting instead of a plain-text 400."""
    from starlette.datastructures import Headers
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    class _CORS(CORSMiddleware):
        def preflight_response(self, request_headers: Headers) -> Response:
            refused = super().preflight_response(request_headers)
            if refused.status_code != 400:
                return refused
            why = bytes(refused.body).decode(errors="replace")
            return HTTPProblem(400, f"CORS preflight refused ({why}); the server allows the origins given with "
                                    "--allowed-origins, the methods GET, POST and HEAD, and any header",
                               code="cors_preflight_refused").response()

    return _CORS(app, allow_origins=list(origins), allow_methods=["GET", "POST", "HEAD"], allow_headers=["*"],
                 expose_headers=["Retry-After", "Warning"])


def _too_large(limit: int, got: int) -> HTTPProblem:
    return HTTPProblem(413, f"the request body has {got} bytes or more; the limit is {limit} (--max-body-bytes)",
                       code="body_too_large")


async def _answer(problem: HTTPProblem, scope: Scope, receive: Receive, send: Send) -> None:
    await problem.response()(scope, receive, send)


__all__ = ["OPEN_PATHS", "Counted", "Guard", "OneBody", "cors"]
