"""Cancellation of requests from any thread or asyncio task: a :class:`CancelToken` in the request's context.

A request (``engine.prepare``, ``engine.stream``, ``engine.answer``) made inside :func:`cancel_scope` is cancelled
when its token is: a request waiting for admission leaves the line at once, one being prepared stops at its next
piece boundary (right after the piece in flight), one decoding leaves the batch before the next step; each gives its slot and KV lease back, and
its caller gets :class:`~kvrag.errors.RequestCancelledError`. kvrag's asyncio bridges (:mod:`kvrag.adapters`)
give every async call its own token and cancel it with the awaiting task. Tokens hold no engine state, so this
module is light to import.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator


class CancelToken:
    """Cancels the requests made under it (:func:`cancel_scope`); :meth:`cancel` may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self._callbacks: list[Callable[[], None]] = []

    def cancel(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    def on_cancel(self, cb: Callable[[], None]) -> Callable[[], None]:
        """Call ``cb`` when cancelled (now, if already); returns a function that unregisters it."""
        with self._lock:
            if not self.cancelled:
                self._callbacks.append(cb)

                def remove() -> None:
                    with self._lock, contextlib.suppress(ValueError):
                        self._callbacks.remove(cb)

                return remove
        cb()
        return lambda: None


_TOKEN: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("kvrag_cancel_token", default=None)


@contextlib.contextmanager
def cancel_scope(token: CancelToken | None = None) -> Iterator[CancelToken]:
    """Requests made inside (``prepare``, ``stream``, ``answer``) are cancelled when the token is."""
    token = token or CancelToken()
    reset = _TOKEN.set(token)
    try:
        yield token
    finally:
        _TOKEN.reset(reset)


def current_token() -> CancelToken | None:
    """The :class:`CancelToken` in effect in this context, if any."""
    return _TOKEN.get()



def use_token(token: CancelToken | None) -> None:
    """Make ``token`` the one in effect for the rest of the current context (e.g. a context copied for a worker)."""
    _TOKEN.set(token)


__all__ = ["CancelToken", "cancel_scope", "current_token", "use_token"]
