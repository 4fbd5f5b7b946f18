"""The runner's side of one request (:class:`Handle`): what its caller waits on and what the runner steps.

Its state is the scheduler's (:class:`kvrag.engine.scheduler.RequestState`); a handle holds only what executing
needs: the prepare job (or its pieces in progress), the result or error the caller gets, the stream's item queue,
the decoding state and the request's row of the batched step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from kvrag.engine.generate import DecodeState
from kvrag.engine.lease import Lease
from kvrag.engine.results import SpecStats
from kvrag.engine.speculate import PromptLookup
from kvrag.errors import EngineClosedError, RequestCancelledError
from kvrag.kv import batched
from kvrag.kv.pieces import SuffixPrefill

if TYPE_CHECKING:
    from kvrag.engine.results import Prepared

END = object()
"""The last item of a request's queue."""


class Handle:
    """The runner's side of one request (its state lives in the scheduler, not here).

    Attributes:
        items: ``(token, delta)`` items for the stream's consumer, then an exception or :data:`END`.
    """

    def __init__(self, job: Callable[[Lease], Any] | None) -> None:
        self.rid = 0
        self.job = job
        self.lease: Lease | None = None
        self.result: Any = None
        self.pieces: Generator[Any, Any, Any] | None = None  # a prepare in progress, between two pieces
        self.suffix: SuffixPrefill | None = None  # a parked prepare's suffix, waiting for the runner to prefill it
        self.error: BaseException | None = None
        self.prepared_done = threading.Event()
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.state: DecodeState | None = None
        self.row: batched.Row | None = None
        self.prepared: Prepared | None = None
        self.closed = False
        self.drafter: PromptLookup | None = None  # speculative decoding's drafts (greedy requests only)
        self.spec = SpecStats()

    def __iter__(self) -> Iterator[tuple[int, str]]:
        """The stream's items as they come; raises what failed or cancelled it."""
        while True:
            item = self.items.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def reason_error(reason: str) -> BaseException:
    if reason == "closed":
        return EngineClosedError("the engine was closed (engine.close(cancel=True)) while this request was in flight")
    return RequestCancelledError(f"the request was cancelled ({reason})")


__all__ = ["END", "Handle", "reason_error"]
