"""The KV memory bound and the one lease lifecycle of a request.

Every request's KV lives in its own :class:`~kvrag.kv.hf_cache.KVBuffer`. Its size is fixed **once, at
admission**, from ``prompt tokens + max_new_tokens`` (the prepare's ``reserve``) times
:attr:`KVBudget.bytes_per_token`, and never grows: the buffer is allocated for the whole answer up front, and a
stream that asks for more new tokens than its request was prepared for is refused with a clear error instead of
growing past the bound.

A :class:`Lease` is taken by the scheduler (:mod:`kvrag.engine.scheduler`) when it admits a request, in arrival
order, only when it fits (vLLM's admit-only-when-the-blocks-fit rule); a request larger than the whole bound is
admitted when nothing else holds memory (alone). It is given back exactly once, whichever comes first: the answer
ends, the request is cancelled, it fails, or its :class:`~kvrag.engine.results.Prepared` is garbage-collected
without being streamed.

:class:`KVBudget` is plain accounting with no lock and no waiting: the scheduler is its only writer and the runner
(:mod:`kvrag.engine.runner`) calls the scheduler under its own lock. The one other holder of bytes is the
conversation cache (:mod:`kvrag.engine.conversation`): its KV is counted in :attr:`KVBudget.cached`, taken only when
it fits beside the leases (:meth:`KVBudget.hold`), and given back on demand (:attr:`KVBudget.reclaimer`) when a
request would not fit or an admission took the bound past its limit -- requests come first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Lease:
    """Bytes of the bound held by one request; :meth:`release` is idempotent.

    Attributes:
        nbytes: the bytes held (fixed at admission).
        released: whether they were given back.
    """

    def __init__(self, budget: KVBudget, nbytes: int, on_release: Callable[[Lease], None] | None = None) -> None:
        self.budget = budget
        self.rid: int | None = None  # the scheduler's request id
        self.nbytes = int(nbytes)
        self.released = False
        self.on_release = on_release

    def release(self) -> None:
        """Give the bytes back (idempotent). The owner (the runner) queues the release for its scheduler, which
        returns the bytes to the budget and lets waiting requests in; safe from any thread and from a garbage
        collector's finalizer."""
        if self.released or self.on_release is None:
            return
        self.on_release(self)


class KVBudget:
    """Bounded KV bytes shared by one engine's requests (accounting only; see the module docstring).

    Args:
        limit: the bound in bytes.
        bytes_per_token: KV bytes of one position of a request buffer (all layers, keys and values).
    """

    def __init__(self, limit: int, bytes_per_token: int) -> None:
        self.limit = int(limit)
        self.bytes_per_token = int(bytes_per_token)
        self.used = 0
        self.waiting = 0  # requests in line for admission (kept by the scheduler)
        self.leases: set[Lease] = set()
        self.cached = 0  # bytes held by the conversation cache (hold / unhold)
        self.reclaimer: Callable[[int], None] | None = None  # frees at least the given bytes of ``cached``
        self._lock = threading.Lock()  # the arithmetic of used / cached (the cache writes from other threads)

    def bytes_for(self, tokens: int) -> int:
        return max(1, int(tokens)) * self.bytes_per_token

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be held now: under the bound, or alone when larger than it (the conversation
        cache gives back what it must first)."""
        self._reclaim(nbytes)
        return not self.leases or self.used + self.cached + nbytes <= self.limit

    def take(self, nbytes: int, on_release: Callable[[Lease], None] | None = None) -> Lease:
        lease = Lease(self, nbytes, on_release)
        with self._lock:
            self.leases.add(lease)
            self.used += lease.nbytes
        self._reclaim(0)  # a conversation entry held meanwhile gives way
        return lease

    def _reclaim(self, nbytes: int) -> None:
        over = self.used + self.cached + nbytes - self.limit
        if over > 0 and self.cached and self.reclaimer is not None:
            self.reclaimer(over)

    def hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` of conversation KV if they fit beside the leases now; returns whether they were."""
        with self._lock:
            if self.used + self.cached + nbytes > self.limit:
                return False
            self.cached += int(nbytes)
            return True

    def unhold(self, nbytes: int) -> None:
        with self._lock:
            self.cached -= int(nbytes)

    def give(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        with self._lock:
            self.leases.discard(lease)
            self.used -= lease.nbytes

    def snapshot(self) -> dict[str, Any]:
        """Bytes in use, the bound, leases held, requests waiting for admission, conversation KV held."""
        return {"used": self.used, "limit": self.limit, "leases": len(self.leases), "waiting": self.waiting,
                "cached": self.cached}

    def describe(self) -> str:
        """The bound's state in words (for busy errors)."""
        return (f"{self.used / 2**20:.1f} MiB of the {self.limit / 2**20:.1f} MiB KV bound "
                f"(EngineConfig.kv_memory_bytes={self.limit}) held by {len(self.leases)} requests"
                + (f" and {self.cached / 2**20:.1f} MiB by kept conversations" if self.cached else ""))


__all__ = ["KVBudget", "Lease"]
