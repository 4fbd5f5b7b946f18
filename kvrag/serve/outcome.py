"""The one owner of a request's outcome.

:class:`Outcome` is an async context manager around everything a request does after it is validated: admission
(its place in ``--max-queue``), the engine's work, the answer. Whatever ends the block -- the answer given, an
error, the client gone, the server shutting down, an exception nobody expected -- its exit does all of this, once:

* the request's KV lease is given back (idempotent: a finished answer gave it already) and its engine work is
  cancelled (a prepare at its next piece, a decode before the next step);
* its place in the queue is given back -- once the threads of :meth:`Outcome.run` it started have returned (work
  that cannot stop at once, e.g. tokenizing a huge prompt, keeps the place: a client that leaves does not free room
  for more work than the queue bounds);
* its status is set and counted in ``kvrag_requests_total`` (499 for a client gone, ``kvrag_cancelled_requests``
  too), and the duration of an answered request observed.

An exception that is not an :class:`~kvrag.serve.errors.HTTPProblem` leaves the block as one (OpenAI's error object,
500 or 503), so no path answers a bare error: kvrag's own errors keep their messages (a 400 names the field), an
unexpected one is logged with its traceback and answered without its text (:func:`kvrag.serve.errors.unexpected`;
a store that fails with ``--on-store-error raise``: 503 ``store_unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvrag.engine.cancel import CancelToken, cancel_scope
from kvrag.errors import ConfigError, ContextLengthError, EngineBusyError, EngineClosedError, RequestCancelledError
from kvrag.serve.errors import ClientGone, HTTPProblem, ShuttingDown, unexpected

if TYPE_CHECKING:
    import collections

    from starlette.requests import Request

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.serve.bodies import Job
    from kvrag.serve.config import ServeConfig
    from kvrag.serve.metrics import Metrics

T = TypeVar("T")

POLL_S = 0.1
"""How often a request waiting on the engine checks that its client is still connected."""
SIBLING_FAILED = "kvrag: a sibling failed with "
"""The message a prompt of a ``/v1/completions`` list is cancelled with when another prompt of the list failed,
followed by the list's status: it ends with that status, not as a client that left (499)."""


class Host(Protocol):
    """What an :class:`Outcome` reads and counts on its service (:class:`kvrag.serve.service.KVRAGService`)."""

    engine: KVRAGEngine
    config: ServeConfig
    metrics: Metrics
    held: int
    outcomes: set[Outcome]
    durations: collections.deque[float]
    draining: bool
    aborted: asyncio.Event

    def retry_after(self) -> int: ...

    def store_failed(self) -> None: ...

    def store_worked(self, since: float) -> None: ...


def queue_full(svc: Host, prompts: int = 1) -> HTTPProblem:
    """The 429 for ``prompts`` requests that the queue (``--max-queue``) has no room for now, with ``Retry-After``."""
    cap = svc.config.max_queue
    what = (f"the server holds {svc.held} requests, its limit (--max-queue {cap})" if prompts == 1 else
            f"the server holds {svc.held} requests and these {prompts} prompts would pass its limit (--max-queue {cap})")
    return HTTPProblem(429, f"{what}; retry later", code="queue_full", headers={"Retry-After": str(svc.retry_after())})


class Outcome:
    """A request's outcome (``async with service.outcome(endpoint, request) as out``).

    Attributes:
        status: the HTTP status once the request ended (None before).
        result: the status a block that ends without an exception gets (a stream that sent an error event sets it).
        job: the prepared request, once there is one (its lease is released at the end).
        token: cancelled at the end, and by a shutdown past its drain timeout; the engine work registers on it.
    """

    def __init__(self, svc: Host, endpoint: str, request: Request | None = None) -> None:
        self.svc, self.endpoint, self.request = svc, endpoint, request
        self.arrived = time.perf_counter()
        self.status: int | None = None
        self.result = 200
        self.job: Job | None = None
        self.token = CancelToken()
        self._admitted = False
        self._workers = 0  # threads of run() still working (a request's queue place is held until they end)
        self._place_pending = False

    # ------------------------------------------------------------------------------------------- lifetime
    async def __aenter__(self) -> Outcome:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if exc is None:
            self.finish(self.result)
            return
        if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
            why = exc.args[0] if isinstance(exc, asyncio.CancelledError) and exc.args else ""
            sibling = isinstance(why, str) and why.startswith(SIBLING_FAILED)
            self.finish(int(why.removeprefix(SIBLING_FAILED)) if sibling else 499)
            return
        problem = self.problem(exc)
        self.finish(problem.status)
        if problem is not exc:
            raise problem from exc

    def finish(self, status: int) -> None:
        """End the request with ``status`` (idempotent; see the module docstring)."""
        if self.status is not None:
            return
        self.status = status
        svc = self.svc
        try:
            self.token.cancel()
            if self.job is not None and self.job.prep.kv_lease is not None:
                self.job.prep.kv_lease.release()
        finally:
            svc.outcomes.discard(self)
            if self._admitted:  # its place in the queue: now, or when the work its client left behind stops
                self._place_pending = True
                self._give_place_back()
            svc.metrics.requests.labels(endpoint=self.endpoint, status=str(status)).inc()
            if status == 499:
                svc.metrics.cancelled.inc()
            elif status == 200 and self._admitted:
                svc.store_worked(self.arrived)
                d = time.perf_counter() - self.arrived
                svc.durations.append(d)
                svc.metrics.duration.observe(d)

    def _give_place_back(self) -> None:
        if self._place_pending and self._workers == 0:
            self._place_pending = False
            self.svc.held -= 1
            self.svc.metrics.in_flight.set(self.svc.held)

    def _worker_done(self) -> None:
        self._workers -= 1
        self._give_place_back()

    def admit(self) -> None:
        """Take a place in the server's queue (429 with ``Retry-After`` when it is full)."""
        svc = self.svc
        if svc.draining:
            raise ShuttingDown(svc.config.drain_timeout_s)
        if svc.held >= svc.config.max_queue:
            raise queue_full(svc)
        svc.held += 1
        self._admitted = True
        svc.outcomes.add(self)
        svc.metrics.in_flight.set(svc.held)

    def hold(self, job: Job) -> None:
        """The request was prepared: its lease is this outcome's to give back; cancelling stops its decoding."""
        self.job = job
        lease = job.prep.kv_lease
        rid = getattr(lease, "rid", None)
        if rid is not None:
            runner = self.svc.engine.runner
            self.token.on_cancel(lambda: runner.cancel(rid))

    # ------------------------------------------------------------------------------------------- waiting
    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` unless the client leaves (:class:`ClientGone`) or the server's drain timeout passes
        (:class:`ShuttingDown`) first; then ``work`` is cancelled (the engine drops its request)."""
        task = asyncio.ensure_future(work)
        abort = asyncio.ensure_future(self.svc.aborted.wait())
        try:
            while True:
                done, _ = await asyncio.wait({task, abort}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if abort in done:
                    raise ShuttingDown(self.svc.config.drain_timeout_s)
                if self.request is not None and await self.request.is_disconnected():
                    raise ClientGone
        finally:
            abort.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # its to_thread cancels the engine request's token on the way out

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread of its own, guarded (:meth:`guard`); leaving early cancels the engine request it
        made (its :class:`~kvrag.engine.cancel.CancelToken`).

        The thread is a daemon, so a prepare that is one long forward neither holds up the process's exit at
        shutdown (an executor's workers are joined at exit) nor anyone else's turn: the engine bounds the work."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        token = CancelToken()
        remove = self.token.on_cancel(token.cancel)

        def deliver(outcome: tuple[T] | BaseException) -> None:
            """Settle ``fut`` with ``fn``'s result (the one-tuple) or the exception it raised."""
            def settle() -> None:
                if fut.done():
                    return
                if isinstance(outcome, BaseException):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome[0])

            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(settle)

        def work() -> None:
            try:
                with cancel_scope(token):
                    out = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised in the awaiting task
                deliver(e)
            else:
                deliver((out,))
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to give back
                    loop.call_soon_threadsafe(self._worker_done)

        self._workers += 1
        threading.Thread(target=contextvars.copy_context().run, args=(work,), name="kvrag-serve-request",
                         daemon=True).start()
        try:
            return await self.guard(fut)
        finally:
            remove()
            token.cancel()  # no-op for a request that ended; one still waiting or preparing is dropped

    # ------------------------------------------------------------------------------------------- errors
    def problem(self, exc: BaseException) -> HTTPProblem:
        """The OpenAI error answering ``exc``."""
        if isinstance(exc, HTTPProblem):
            return exc
        if self.svc.aborted.is_set() and isinstance(exc, RequestCancelledError | EngineClosedError):
            return ShuttingDown(self.svc.config.drain_timeout_s)
        if isinstance(exc, ContextLengthError):
            return HTTPProblem(400, str(exc), code="context_length_exceeded")
        if isinstance(exc, ConfigError):
            return HTTPProblem(400, str(exc))
        if isinstance(exc, EngineBusyError):
            return HTTPProblem(503, str(exc), code="engine_busy",
                               headers={"Retry-After": str(self.svc.retry_after())})
        if isinstance(exc, EngineClosedError):
            return HTTPProblem(503, str(exc), code="engine_closed")
        if isinstance(exc, RequestCancelledError):  # by the engine's owner (engine.close(cancel=True)), not a client
            return HTTPProblem(503, str(exc), code="request_cancelled")
        where = self.endpoint if self.request is None else f"{self.request.method} {self.request.url.path}"
        return unexpected(exc, where, self.svc)  # logged with its traceback; the answer names no host or path


__all__ = ["POLL_S", "SIBLING_FAILED", "Outcome", "queue_full"]
