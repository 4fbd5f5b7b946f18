"""The ``--max-store-bytes`` quota of ``kvrag serve`` (:class:`StoreQuota`).

The store's size is read at most every :data:`STORE_USAGE_TTL_S` seconds (over Redis a reading scans every key);
between readings the quota counts what this server stored since (requests' computed misses, finished
registrations' new caches) and what running registrations hold. A check and its hold happen under one lock, so
concurrent registrations cannot all pass one reading.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from kvrag.serve.errors import HTTPProblem

if TYPE_CHECKING:
    from kvrag.engine.engine import KVRAGEngine

STORE_USAGE_TTL_S = 10.0
"""Seconds a reading of the store's size serves the quota."""


class StoreQuota:
    """``limit`` bytes of ``engine``'s serving store (None: no quota, every check passes)."""

    def __init__(self, engine: KVRAGEngine, limit: int | None) -> None:
        self.engine = engine
        self.limit = limit
        self._reading: tuple[float, int] | None = None  # (time.monotonic(), bytes) of the last reading
        self._written = 0  # bytes stored since that reading
        self._held = 0  # bytes held by registrations still running
        self._lock = threading.RLock()

    def _bytes(self, tokens: int) -> int:
        return int(tokens) * int(self.engine.runner.budget.bytes_per_token)

    def used(self) -> int:
        """The store's bytes: the last reading, what was stored since and what running registrations hold."""
        with self._lock:
            now = time.monotonic()
            if self._reading is None or now - self._reading[0] >= STORE_USAGE_TTL_S:
                self._reading = (now, int(self.engine.serving_store.stats().get("bytes") or 0))
                self._written = 0
            return self._reading[1] + self._written + self._held

    def reserve(self, tokens: int) -> int:
        """A registration of ``tokens`` tokens: 413 unless the store's bytes and about what these texts' caches take
        (the model's KV bytes per token; texts already cached counted too) fit; those bytes are then held until
        :meth:`settle`. Returns the bytes held."""
        if self.limit is None:
            return 0
        need = self._bytes(tokens)
        with self._lock:
            used = self.used()
            if used + need > self.limit:
                raise HTTPProblem(413, f"the KV store holds {used} bytes and these texts' caches take about {need}; "
                                       f"its quota is {self.limit} (--max-store-bytes): nothing more is registered",
                                  param="texts", code="store_quota_exceeded")
            self._held += need
        return need

    def settle(self, held: int, stored_tokens: int) -> None:
        """A registration's end: the bytes it ``held`` go back and the caches it stored (``stored_tokens``: the
        texts that were new) count as stored until the next reading."""
        if self.limit is None:
            return
        with self._lock:
            self._held -= held
            self._written += self._bytes(stored_tokens)

    def room(self, nbytes: int) -> bool:
        """Whether a request's computed misses (``nbytes``: prefix and between-chunk text, a request's own
        ``kvrag.chunks``) still fit, counted as stored when they do: the engine's
        :attr:`~kvrag.engine.caching.ChunkCaching.store_gate`. Refused, they serve their request and are not
        stored."""
        with self._lock:
            if self.limit is not None and self.used() + nbytes > self.limit:
                return False
            self._written += nbytes
        return True


__all__ = ["STORE_USAGE_TTL_S", "StoreQuota"]
