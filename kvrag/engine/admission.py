"""The KV memory bound: requests lease their KV bytes before their buffer is allocated, and wait when it is spent.

Every request's KV lives in its own :class:`~kvrag.kv.hf_cache.KVBuffer` of ``(prompt + reserved decode tokens)
x bytes_per_token`` bytes, allocated when it is prepared. :meth:`KVBudget.acquire` is called first, with that size,
and blocks while the requests holding leases use too much of the bound (``EngineConfig.kv_memory_bytes``), like
vLLM's scheduler, which admits a waiting request only when its KV blocks can be allocated, so many concurrent
callers queue instead of running the process out of memory. A lease is given back when its request's stream
ends, is closed or abandoned (or the prepared request is garbage-collected without being streamed).

Two rules keep waiting from turning into a deadlock: a request larger than the whole bound is admitted when no
other lease is held (alone), and a thread that already holds a lease it has not started to stream is admitted at
once (it would otherwise wait for itself).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.5
"""Default bound: at most this fraction of the device memory available when the engine starts."""


def available_memory(device: torch.device | str) -> int | None:
    """Bytes of memory free on ``device`` now (CUDA: ``mem_get_info``; CPU: the OS's available pages), or None."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_bytes(bytes_per_token: int, max_context: int, max_batch_size: int,
                     device: torch.device | str) -> int:
    """A full batch of maximal requests (``max_batch_size x max_context`` tokens), capped at
    :data:`DEFAULT_MEMORY_FRACTION` of the memory available on ``device``, and at least one maximal request."""
    want = max_batch_size * max_context * bytes_per_token
    free = available_memory(device)
    if free is not None:
        want = min(want, int(free * DEFAULT_MEMORY_FRACTION))
    return max(want, max_context * bytes_per_token)


class Lease:
    """Bytes of the bound held by one request; :meth:`release` is idempotent."""

    def __init__(self, budget: KVBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        self.owner: int | None = threading.get_ident()  # the preparing thread, until a stream takes it over
        self.released = False

    def resize(self, nbytes: int) -> None:
        """Account for a buffer that grew (never waits: the request is already running)."""
        self.budget._resize(self, nbytes)

    def detach(self) -> None:
        """The request's stream has started: the lease no longer belongs to the preparing thread."""
        self.owner = None

    def release(self) -> None:
        self.budget._release(self)


class KVBudget:
    """Bounded KV bytes shared by one engine's requests.

    Args:
        limit: the bound in bytes.
        bytes_per_token: KV bytes of one position of a request buffer (all layers, keys and values).
    """

    def __init__(self, limit: int, bytes_per_token: int) -> None:
        self.limit = int(limit)
        self.bytes_per_token = int(bytes_per_token)
        self.used = 0
        self.waiting = 0
        self._leases: set[Lease] = set()
        self._cv = threading.Condition()

    def bytes_for(self, tokens: int) -> int:
        return max(1, int(tokens)) * self.bytes_per_token

    def _fits(self, need: int) -> bool:
        if not self._leases or self.used + need <= self.limit:
            return True
        me = threading.get_ident()
        return any(lease.owner == me for lease in self._leases)

    def acquire(self, tokens: int) -> Lease:
        """A lease for ``tokens`` positions; blocks until they fit under the bound (see the module docstring)."""
        need = self.bytes_for(tokens)
        with self._cv:
            if not self._fits(need):
                log.debug("request of %d KV bytes waits: %d of %d in use", need, self.used, self.limit)
                self.waiting += 1
                try:
                    while not self._fits(need):
                        self._cv.wait()
                finally:
                    self.waiting -= 1
            if need > self.limit:
                log.warning("a request needs %d KV bytes, more than the bound of %d (EngineConfig.kv_memory_bytes); "
                            "it runs alone", need, self.limit)
            lease = Lease(self, need)
            self._leases.add(lease)
            self.used += need
            return lease

    def _resize(self, lease: Lease, nbytes: int) -> None:
        with self._cv:
            if lease.released:
                return
            self.used += nbytes - lease.nbytes
            lease.nbytes = nbytes
            self._cv.notify_all()

    def _release(self, lease: Lease) -> None:
        with self._cv:
            if lease.released:
                return
            lease.released = True
            self._leases.discard(lease)
            self.used -= lease.nbytes
            self._cv.notify_all()

    def snapshot(self) -> dict[str, Any]:
        """Bytes in use, the bound, leases held and callers waiting."""
        with self._cv:
            return {"used": self.used, "limit": self.limit, "leases": len(self._leases), "waiting": self.waiting}


__all__ = ["DEFAULT_MEMORY_FRACTION", "KVBudget", "Lease", "available_memory", "default_kv_bytes"]
