"""The KV memory bound and the one lease lifecycle of a request: the lease owns the request's buffer.

**One number, one way.** ``engine.prepare(plan, reserve=N)`` -- N the most new tokens the request will be streamed
for -- sizes the request once: ``positions = prompt tokens + N`` (vLLM's ``allocate_slots`` sizes a request's
blocks from its prompt and lookahead the same way, once, at admission). That number travels down and is never
recomputed:

1. **Admission** (:mod:`kvrag.engine.scheduler`): the request waits in arrival order until
   ``positions x KVBudget.bytes_per_token`` fits the bound (vLLM's admit-only-when-the-blocks-fit rule; a request
   larger than the whole bound is admitted alone), then takes a :class:`Lease` of ``positions`` positions.
2. **Prepare** (the runner thread, in the request's turn): the prompt's K/V are computed in
   :meth:`Lease.prompt_buffer`. Where decode reads the model's dtype that is the lease's own buffer, allocated here
   with room for every position, so assembly, repair, the suffix prefill and decode write into one allocation;
   where decode reads a narrower dtype (``EngineConfig.kv_dtype``) it is a scratch buffer of exactly the prompt,
   which lives until the stream starts and is not counted in the bound (the lease counts the decode buffer).
3. **Submit** (:meth:`kvrag.engine.runner.Runner.submit`) only compares: ``prompt + max_new_tokens <= positions``
   (:meth:`Lease.check_answer`; otherwise a ConfigError naming the ``reserve`` to pass). :meth:`Lease.decode_row`
   then gives the row the request decodes in: the lease's buffer, allocated now in the decode dtype when the prompt
   was computed in scratch (the prompt's positions copied in, rounded), or the prompt's own buffer.
4. **Decode** writes into that buffer and never past it: every leased buffer is ``fixed``
   (:class:`~kvrag.kv.hf_cache.KVBuffer`), so a write past ``positions`` raises
   :class:`~kvrag.errors.LeaseExceededError` instead of growing (speculative drafts are cut to the room left).

The lease is given back exactly once, whichever comes first: the answer ends, the request is cancelled, it fails,
or its :class:`~kvrag.engine.results.Prepared` is garbage-collected without being streamed; it then drops its
buffer (the caller's Prepared may still hold the answered cache, e.g. for the conversation cache).

:class:`KVBudget` is plain accounting with no lock and no waiting: the scheduler is its only writer and the runner
(:mod:`kvrag.engine.runner`) calls the scheduler under its own lock. The one other holder of bytes is the
conversation cache (:mod:`kvrag.engine.conversation`): its KV is counted in :attr:`KVBudget.cached`, taken only when
it fits beside the leases (:meth:`KVBudget.hold`), and given back on demand (:attr:`KVBudget.reclaimer`) when a
request would not fit or an admission took the bound past its limit -- requests come first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvrag.errors import ConfigError
from kvrag.kv.batched import Row
from kvrag.kv.hf_cache import KVBuffer

if TYPE_CHECKING:
    import torch

    from kvrag.kv.spec import KVSpec


class Lease:
    """One request's share of the bound and the buffer it decodes in (see the module docstring);
    :meth:`release` is idempotent.

    Attributes:
        positions: the KV positions leased (prompt + the answer's ``reserve``), fixed at admission.
        nbytes: the bytes held (``positions`` x the budget's bytes per token).
        buffer: the request's own buffer once allocated (fixed at ``positions``; never grows), None after release.
        released: whether the bytes were given back.
    """

    def __init__(self, budget: KVBudget, positions: int, on_release: Callable[[Lease], None] | None = None) -> None:
        self.budget = budget
        self.rid: int | None = None  # the scheduler's request id
        self.positions = max(1, int(positions))
        self.nbytes = budget.bytes_for(self.positions)
        self.buffer: KVBuffer | None = None
        self.released = False
        self.on_release = on_release

    def prompt_buffer(self, spec: KVSpec, prompt: int, dtype: torch.dtype, device: torch.device | str) -> KVBuffer:
        """The buffer a prepare computes the prompt's ``prompt`` positions of K/V in (``dtype``: the model's): the
        lease's own (``positions``, allocated on the first call) when decode reads ``dtype``, else a scratch buffer of
        exactly ``prompt`` positions (decode's is made by :meth:`decode_row`). Both are fixed."""
        if prompt > self.positions:
            msg = f"a prompt of {prompt} positions does not fit its lease of {self.positions}"
            raise ValueError(msg)
        if self.budget.dtype not in (None, dtype):
            return KVBuffer(spec.num_layers, spec.num_kv_heads, spec.head_dim, prompt, dtype, device, fixed=True)
        if self.buffer is None:
            self.buffer = KVBuffer(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.positions, dtype, device,
                                   fixed=True)
        return self.buffer

    def check_answer(self, length: int, max_new_tokens: int) -> None:
        """Refuse a stream of ``max_new_tokens`` after a prompt of ``length`` positions that the lease has no room
        for (a comparison: nothing is sized here).

        Raises:
            ConfigError: naming the ``reserve`` to prepare the request with."""
        if length + max_new_tokens > self.positions:
            msg = (f"the stream asks for max_new_tokens={max_new_tokens} but the request was prepared for "
                   f"{self.positions - length} new tokens (its KV was leased for {self.positions} positions); pass "
                   f"reserve={max_new_tokens} to engine.prepare()")
            raise ConfigError(msg)

    def decode_row(self, buf: KVBuffer, length: int) -> Row:
        """The row the request decodes in: the lease's buffer in the decode dtype (:attr:`KVBudget.dtype`; None:
        ``buf``'s) holding the first ``length`` positions of ``buf`` -- ``buf`` itself when it is that buffer,
        else copied into it (allocated now, once, where the prompt was computed in scratch)."""
        dtype = self.budget.dtype or buf.keys.dtype
        own = self.buffer
        if own is None or own.keys.dtype != dtype:
            layers, heads = buf.keys.shape[:2]
            own = self.buffer = KVBuffer(layers, heads, buf.head_dim, self.positions, dtype, buf.keys.device,
                                         fixed=True)
        own.put(buf, length)
        return Row(own, length)

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
        dtype: the dtype of the K/V requests decode over (:func:`kvrag.kv.batched.decode_kv_dtype`; None: the
            dtype their prompt was computed in).
    """

    def __init__(self, limit: int, bytes_per_token: int, dtype: torch.dtype | None = None) -> None:
        self.limit = int(limit)
        self.bytes_per_token = int(bytes_per_token)
        self.dtype = dtype
        self.used = 0
        self.waiting = 0  # requests in line for admission (kept by the scheduler)
        self.leases: set[Lease] = set()
        self.cached = 0  # bytes held by the conversation cache (hold / unhold)
        self.reclaimer: Callable[[int], None] | None = None  # frees at least the given bytes of ``cached``
        self._lock = threading.Lock()  # the arithmetic of used / cached (the cache writes from other threads)

    def bytes_for(self, tokens: int) -> int:
        """The bytes of a lease of ``tokens`` positions."""
        return max(1, int(tokens)) * self.bytes_per_token

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more may be held now: under the bound, or alone when larger than it (the conversation
        cache gives back what it must first)."""
        self._reclaim(nbytes)
        return not self.leases or self.used + self.cached + nbytes <= self.limit

    def take(self, positions: int, on_release: Callable[[Lease], None] | None = None) -> Lease:
        """A lease of ``positions`` KV positions (the caller checked :meth:`fits`)."""
        lease = Lease(self, positions, on_release)
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
        lease.released, lease.buffer = True, None
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
