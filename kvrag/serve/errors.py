"""OpenAI's error object on every error path of the app: validation, unknown routes and methods, limits, keys and
unexpected failures alike (``{"error": {"message", "type", "param", "code"}}``, what the ``openai`` SDK raises from).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvrag.errors import StoreError
from kvrag.serve.protocol import openai_error, validation_error_body

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error"}


class HTTPProblem(Exception):
    """An error answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        kind = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.body = openai_error(message, param=param, code=code, type_=kind)
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


STORE_UNAVAILABLE = ("the KV store is unavailable: retry later (the server's log has the details; a server started "
                     "with --on-store-error recompute answers without its store)")
"""The message of a request failed by the store (503 ``store_unavailable``): it names no host, the log does."""

INTERNAL_ERROR = "internal error: the request failed unexpectedly; the server's log has the details"
"""The message of a 500 (the exception's text, which may name hosts and paths, goes to the log only)."""


def unexpected(exc: BaseException, where: str, svc: object = None) -> HTTPProblem:
    """The answer to an exception no handler expected, logged with its traceback: 503 ``store_unavailable`` for a
    :class:`~kvrag.errors.StoreError` (a store that fails with ``on_store_error="raise"``; the app's service ``svc``
    is told, so that ``/health`` says the store is degraded), else a 500. The answer names neither the exception
    nor its text (hosts, paths): the log has them. ``where``: the request (``"POST /v1/chat/completions"``)."""
    if isinstance(exc, StoreError):
        failed = getattr(svc, "store_failed", None)
        if failed is not None:
            failed()
        log.error("the KV store failed answering %s", where, exc_info=exc)
        return HTTPProblem(503, STORE_UNAVAILABLE, code="store_unavailable")
    log.error("unexpected failure answering %s", where, exc_info=exc)
    return HTTPProblem(500, INTERNAL_ERROR, code="internal_error")


class ClientGone(Exception):
    """The client closed its connection before its answer (counted as status 499)."""


class ShuttingDown(HTTPProblem):
    """The server is shutting down and its drain timeout has passed: the request was cancelled."""

    def __init__(self, drain_timeout_s: float) -> None:
        super().__init__(503, f"the server is shutting down: requests still in flight after its drain timeout "
                              f"({drain_timeout_s:g} s, --drain-timeout) are cancelled; retry on another replica",
                         code="server_shutting_down")


def _problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPProblem)
    return exc.response()


def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        path = request.url.path
        bare = {**request.scope, "path": path.rstrip("/")}
        known = path.endswith("/") and any(r.matches(bare)[0] != Match.NONE for r in request.app.router.routes)
        meant = f"; without the trailing slash: {bare['path']}" if known else " (see docs/serve.md for the endpoints)"
        message = f"no such endpoint: {request.method} {path}{meant}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(status)
    if status == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's own, e.g. bad UTF-8
        message, code = ("the request body could not be parsed as JSON (invalid UTF-8, nested too deeply, or an "
                         "integer of over 4,300 digits): send a JSON object"), "invalid_json"
    return HTTPProblem(status, message, code=code, headers=dict(exc.headers or {})).response()


def _gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """The last resort (:class:`~kvrag.serve.middleware.Guard` answers what passes it before a response started)."""
    svc = getattr(request.app.state, "kvrag", None)
    return unexpected(exc, f"{request.method} {request.url.path}", svc).response()


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` with OpenAI's error object."""
    app.add_exception_handler(HTTPProblem, _problem)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(ClientGone, _gone)
    app.add_exception_handler(Exception, _unexpected)


__all__ = ["INTERNAL_ERROR", "STORE_UNAVAILABLE", "ClientGone", "HTTPProblem", "ShuttingDown", "install", "unexpected"]
