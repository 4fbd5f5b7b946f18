"""Continuous batching of one engine's requests: one forward per decode step for every decoding request.

How it is built, and what it takes from the field:

* **A scheduler thread per engine, started on demand** (transformers' ``ContinuousBatchingManager`` runs its
  generation loop in a background thread, vLLM's engine core one busy loop). It exits when no request decodes, so an
  idle engine holds no thread. Callers never run decode steps themselves: :meth:`DecodeBatcher.submit` hands a
  prepared request over and its consumer reads ``(token, delta)`` items from the request's own queue (transformers'
  per-request output queues), so a slow or paused consumer never holds the model.
* **Requests join and leave at step boundaries** (continuous / iteration-level batching, vLLM's ``schedule()`` /
  ``update_from_output()``): before every step the scheduler drops requests whose consumer stopped (generator closed
  or garbage-collected), admits waiting ones up to ``EngineConfig.max_batch_size`` (vLLM's ``max_num_seqs``,
  transformers' ``max_requests_per_batch``), then runs one batched step (:func:`kvrag.kv.batched.decode_step`) and
  hands each request its token. A request that ends (EOS, stop string, ``max_new_tokens``) leaves after its step.
* **Unlike transformers' manager, requests enter with their KV already built**: its ``add_request`` takes token ids
  and prefills them into paged blocks, while a kvrag request arrives with a fetched, assembled and repaired cache in
  its own :class:`~kvrag.kv.hf_cache.KVBuffer`. So there is no shared paged pool: each row of a step reads its own
  buffer (per-request attention), and the memory bound is one lease per request (:mod:`kvrag.engine.admission`,
  vLLM's admit-only-when-the-blocks-fit rule).
* **Prepare and decode alternate** (the interleaving policy). vLLM bounds the prefill work per step by a token
  budget (chunked prefill) because a cold prompt's prefill is long. A kvrag request's prepare (fetch, assemble,
  repair, suffix prefill) is short by design -- it reuses the chunks' KV -- and a fusion method's repair is one
  computation that cannot be split without making every method resumable. So the unit of prefill work is one
  request's whole prepare: while requests decode, **at most one prepare runs between two decode steps** (waiting
  prepares take turns in arrival order); while nothing decodes, prepares run back to back. A decoding request thus
  waits at most one prepare per token, and a new request waits at most one decode step per request ahead of it.
* **gpt-fast's static decode**: a preallocated cache written in place at the step's positions and one captured
  graph per step. Here every buffer is reserved for the request's whole answer when it joins (no allocation while
  decoding), the step computes the last position's logits only, and ``EngineConfig.compile_decode`` captures the
  dense part of the step with ``torch.compile`` (see :mod:`kvrag.kv.batched`).

Models that cannot run a batched step (:func:`kvrag.kv.batched.batchable`) are stepped one request at a time by
the same scheduler, so every other property (joining, leaving, turns, memory bound) holds for them too.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvrag.config import GenerationConfig
from kvrag.engine.admission import KVBudget, Lease
from kvrag.engine.generate import DecodeState
from kvrag.kv import batched, hf_cache
from kvrag.kv.attention import IMPL

log = logging.getLogger(__name__)

END = object()
"""The last item of a request's queue."""


class BatchedRequest:
    """One request from :meth:`DecodeBatcher.submit` to its last item.

    Attributes:
        items: ``(token, delta)`` items for the consumer, then an exception or :data:`END`.
        state: its :class:`~kvrag.engine.generate.DecodeState`.
    """

    def __init__(self, prepared: Any, state: DecodeState, lease: Lease | None) -> None:
        self.prepared = prepared
        self.state = state
        self.lease = lease
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.row: batched.Row | None = None
        self.admitted = False
        self.cancelled = False
        self.done = False
        self.closed = False

    def __iter__(self) -> Iterator[tuple[int, str]]:
        """The request's items as they come; raises what failed its steps."""
        while True:
            item = self.items.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class DecodeBatcher:
    """The per-engine scheduler: turns for prepares, one batched forward per decode step.

    Args:
        model: the engine's model (its lock, :func:`kvrag.kv.hf_cache.model_lock`, is held for every forward).
        tokenizer: for the requests' incremental text.
        budget: the engine's KV memory bound.
        max_batch_size: most requests in one step.
        compile_decode: capture the step with ``torch.compile`` (see :mod:`kvrag.kv.batched`).
    """

    def __init__(self, model: Any, tokenizer: Any, budget: KVBudget, *, max_batch_size: int,
                 compile_decode: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.budget = budget
        self.max_batch_size = int(max_batch_size)
        self.compile_decode = bool(compile_decode)
        self.lock = hf_cache.model_lock(model)
        self.unbatchable = batched.batchable(model, IMPL)
        if self.unbatchable:
            log.info("decoding one request per step: %s", self.unbatchable)
        self.windows = batched.windows(model)
        self._cv = threading.Condition()
        self._rows: list[BatchedRequest] = []
        self._joining: collections.deque[BatchedRequest] = collections.deque()
        self._turns: collections.deque[object] = collections.deque()
        self._in_turn = False
        self._stepping = False
        self._steps_since_turn = 0
        self._thread: threading.Thread | None = None
        self._stats: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------------------------------- prepare turns
    @contextlib.contextmanager
    def turn(self, kv_tokens: int) -> Iterator[Lease]:
        """Hold the model for one request's prepare, after leasing ``kv_tokens`` positions of the KV bound.

        Waits (in this order) until the lease fits under the bound, until earlier prepares had their turn, and --
        while requests decode -- until at least one decode step ran since the last prepare. Yields the lease (the
        prepared request keeps it; it is released here if the prepare raises).
        """
        lease = self.budget.acquire(kv_tokens)
        try:
            if self.lock._is_owned():  # type: ignore[attr-defined]  # nested in a forward of this thread: no waiting
                with self.lock:
                    yield lease
                return
            ticket = object()
            with self._cv:
                self._turns.append(ticket)
                try:
                    while not self._may_prepare(ticket):
                        self._cv.wait()
                finally:
                    self._turns.remove(ticket)
                    self._cv.notify_all()
                self._in_turn = True
            try:
                with self.lock:
                    yield lease
            finally:
                with self._cv:
                    self._in_turn = False
                    self._steps_since_turn = 0
                    self._stats["prepares"] += 1
                    self._cv.notify_all()
        except BaseException:
            lease.release()
            raise

    def _may_prepare(self, ticket: object) -> bool:
        decoding = bool(self._rows or self._joining)
        return (self._turns[0] is ticket and not self._in_turn and not self._stepping
                and (not decoding or self._steps_since_turn >= 1))

    # ------------------------------------------------------------------------------------------- requests
    def submit(self, prepared: Any, gen: GenerationConfig, eos_ids: Sequence[int],
               on_first_token: Callable[[], None] | None = None) -> BatchedRequest:
        """Start decoding a prepared request: its first token is chosen now (from the prepare's logits), then it
        joins the running batch at the next step boundary. Iterate the returned request for its items and call
        :meth:`cancel` when the consumer stops."""
        lease = getattr(prepared, "kv_lease", None)
        if lease is not None:
            lease.detach()
        req = BatchedRequest(prepared, DecodeState(self.tokenizer, gen, eos_ids), lease)
        try:
            items = req.state.advance(prepared.last_logits)
        finally:
            if on_first_token is not None:
                on_first_token()
        for item in items:
            req.items.put(item)
        if req.state.finished:
            self._close(req)
            return req
        buf, length = hf_cache.buffer_of(prepared.cache)
        buf.reserve(length + gen.max_new_tokens)  # every step's K/V fits: no allocation while decoding
        if lease is not None:
            lease.resize(buf.capacity * self.budget.bytes_per_token)
        req.row = batched.Row(buf, length)
        with self._cv:
            self._joining.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvrag-decode", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return req

    def cancel(self, req: BatchedRequest) -> None:
        """The consumer stopped: the request leaves the batch at the next step boundary (idempotent)."""
        with self._cv:
            req.cancelled = True
            close_now = not req.admitted or req.done
            if req in self._joining:
                self._joining.remove(req)
            self._cv.notify_all()
        if close_now:
            self._close(req)

    def _close(self, req: BatchedRequest) -> None:
        with self._cv:
            if req.closed:
                return
            req.closed = True
        if req.row is not None:  # the request's cache now covers what was decoded into its buffer
            req.prepared.cache = req.row.buffer.as_cache(req.row.length)
        if req.lease is not None:
            req.lease.release()
        req.items.put(END)

    # ------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - never leave a consumer waiting on a dead loop
            log.exception("the decode loop failed")
            with self._cv:
                left = [*self._rows, *self._joining]
                self._rows.clear()
                self._joining.clear()
                self._stepping = False
                self._thread = None
                self._cv.notify_all()
            for r in left:
                r.items.put(e)
                self._close(r)

    def _run(self) -> None:
        rows = self._rows
        while True:
            with self._cv:
                gone = [r for r in rows if r.cancelled]
                rows[:] = [r for r in rows if not r.cancelled]
                while self._joining and len(rows) < self.max_batch_size:
                    r = self._joining.popleft()
                    r.admitted = True
                    rows.append(r)
                if not rows:
                    self._thread = None
                    self._cv.notify_all()
                    wait = False
                else:
                    wait = self._in_turn or bool(self._turns and self._steps_since_turn >= 1)
                    if wait and not gone:
                        self._cv.wait()
                    elif not wait:
                        self._stepping = True
            for r in gone:
                self._close(r)
            if not rows:
                return
            if wait:
                continue
            try:
                self._step(rows)
            finally:
                with self._cv:
                    self._stepping = False
                    self._steps_since_turn += 1
                    finished = [r for r in rows if r.done]
                    rows[:] = [r for r in rows if not r.done]
                    self._cv.notify_all()
                for r in finished:
                    self._close(r)

    def _step(self, rows: list[BatchedRequest]) -> None:
        """One forward for every row, then each row's token choice and text."""
        try:
            with self.lock:
                if self.unbatchable is None:
                    logits = batched.decode_step(self.model, [r.row for r in rows],  # type: ignore[misc]
                                                 [int(r.state.last) for r in rows],  # type: ignore[arg-type]
                                                 self.windows, compiled=self.compile_decode)
                else:
                    logits = torch.stack([self._single(r) for r in rows])
        except BaseException as e:  # noqa: BLE001 - each consumer gets the failure
            for r in rows:
                r.done = True
                r.items.put(e)
            return
        self._stats["steps"] += 1
        self._stats["rows_stepped"] += len(rows)
        self._stats["max_rows"] = max(self._stats["max_rows"], len(rows))
        for i, r in enumerate(rows):
            assert r.row is not None
            r.row.length += 1
            try:
                for item in r.state.advance(logits[i]):
                    r.items.put(item)
            except Exception as e:  # noqa: BLE001 - this request's consumer gets it
                r.items.put(e)
                r.done = True
                continue
            r.done = r.state.finished

    def _single(self, r: BatchedRequest) -> torch.Tensor:
        assert r.row is not None and r.state.last is not None
        cache = r.row.buffer.as_cache(r.row.length)
        out, _ = hf_cache.forward(self.model, torch.tensor([r.state.last]), cache)
        return out[-1]

    # ------------------------------------------------------------------------------------------- introspection
    def stats(self) -> dict[str, Any]:
        """Counters since creation: ``steps``, ``rows_stepped`` (sum of batch sizes), ``max_rows`` (largest batch),
        ``prepares``; and now: ``decoding`` and ``joining`` requests, the KV bound's use."""
        with self._cv:
            out: dict[str, Any] = dict(self._stats)
            out.update(decoding=len(self._rows), joining=len(self._joining))
        out["kv"] = self.budget.snapshot()
        return out


__all__ = ["END", "BatchedRequest", "DecodeBatcher"]
