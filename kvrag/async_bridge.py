"""Running a blocking kvrag request from asyncio (the framework adapters' async bridge; re-exported by
:mod:`kvrag.adapters`).

:func:`to_thread` runs a blocking request and :func:`aiter_in_thread` drives a blocking token stream, each in a
worker thread of its own, so that concurrent async callers (``aquery``, ``achat``, ``abatch``, ``astream``,
``asyncio.gather``) are all in flight at once and decode in the engine's shared batch (:mod:`kvrag.engine.runner`)
instead of queueing for the default executor's few workers. Each call runs under its own
:class:`~kvrag.engine.runner.CancelToken`: cancelling the awaiting task (``task.cancel()``, a timeout) or closing the
async iterator cancels the engine request too, which frees its batch slot and KV.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from kvrag.engine.cancel import CancelToken, current_token, use_token

T = TypeVar("T")

MAX_WORKER_THREADS = 256
"""Most worker threads of :func:`to_thread` (each waits on one request; the engine bounds the work itself)."""
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(MAX_WORKER_THREADS, thread_name_prefix="kvrag-request")
        return _POOL


async def to_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` on kvrag's own thread pool (in a copy of the caller's context, request chunks
    included).

    asyncio's default executor has ``min(32, cpu_count + 4)`` workers (cpu_count + 4 on small machines), so an 8-way
    ``asyncio.gather`` of blocking requests would run at most 6 at once; the engine batches whatever is in flight,
    and the requests wait in the engine's scheduler (batch size and KV memory bounds), not in a thread pool.
    """
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    token = ctx.run(_fresh_token)
    try:
        return await loop.run_in_executor(_pool(), functools.partial(ctx.run, fn, *args, **kwargs))
    except asyncio.CancelledError:
        token.cancel()  # the engine drops the request: out of line, before its next step, or right after its prepare
        raise


def _fresh_token() -> CancelToken:
    """A :class:`~kvrag.engine.runner.CancelToken` for one async call, set in the current context (a copy made for
    the call's worker thread); cancelling it also cancels the caller's own token, if any."""
    outer = current_token()
    token = CancelToken()
    if outer is not None:
        outer.on_cancel(token.cancel)
    use_token(token)
    return token


async def aiter_in_thread(factory: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Iterate a blocking generator in ONE worker thread and yield its items asynchronously.

    One thread drives the whole generator (no executor hop per item) and runs in a copy of the caller's context
    (request chunks included).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[T] | BaseException | None] = asyncio.Queue()  # an item, what failed, or the end
    stop = threading.Event()
    ctx = contextvars.copy_context()
    token = ctx.run(_fresh_token)

    def put(item: tuple[T] | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the consumer left and its loop closed: nobody to tell
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def work() -> None:
        try:
            it = factory()
            try:
                for item in it:
                    put((item,))
                    if stop.is_set():
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
        except BaseException as e:  # noqa: BLE001  (re-raised in the consumer)
            put(e)
            return
        put(None)

    thread = threading.Thread(target=ctx.run, args=(work,), name="kvrag-stream", daemon=True)
    thread.start()
    try:
        while True:
            got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            if got is None:
                break
            yield got[0]
    finally:
        stop.set()
        token.cancel()  # closed or cancelled early: the thread's request leaves the batch (no-op once it ended)


__all__ = ["MAX_WORKER_THREADS", "aiter_in_thread", "to_thread"]
