"""The scheduler: decides, never runs. Given the requests and the KV budget, :meth:`Scheduler.schedule` returns the
next :class:`StepPlan`; the runner thread (:mod:`kvrag.engine.runner`) executes it and reports back.

This is the split vLLM v1 makes between its ``Scheduler`` (``schedule()`` returns a ``SchedulerOutput``;
``update_from_output()`` takes the model runner's results; a ``RequestStatus`` per request) and the engine core's
busy loop that executes. Here the scheduler has no threads, no locks, no clock and no tensors, so every policy is a
plain function of events and is tested without threads (tests/unit/test_scheduler.py, with property tests over
random arrival / cancel / finish sequences).

One state per request (:class:`RequestState`)::

    WAITING --admit--> PREPARING --prepared--> READY --stream--> QUEUED --join--> RUNNING --stepped--> FINISHED
       |                   |                     |                 |                 |
       +--cancel/busy------+--(failed/cancel)----+--cancel/GC------+--cancel---------+--cancel (next plan)--> FINISHED

The policy, written once in :meth:`Scheduler.schedule`:

* **Arrival-order admission.** Only the oldest WAITING request may be admitted, when its KV (sized once at
  arrival: prompt + ``reserve`` positions, :mod:`kvrag.engine.lease`) fits the budget; a request larger than the
  whole budget is admitted when nothing else holds memory. Later arrivals never pass it, so a large request is not
  starved by a stream of small ones. A wait limit is the caller's: it cancels a request that is still WAITING with
  the reason ``"busy"``.
* **One prepare piece between two decode steps.** A plan holds at most one piece of one prepare and at most one
  decode step, so a decoding request waits at most one piece per token. A prepare may come in pieces (while
  requests decode: about half a step each, :mod:`kvrag.kv.pieces`): the one in progress gets the next plan's piece
  until it is done, then the next request in line is admitted.
* **Arrivals' question suffixes in one forward** (``pack_suffixes``; the engine turns it on,
  ``EngineConfig.pack_suffixes``). A prepare whose last part is a plain suffix prefill (``stale``, ``cacherepair``,
  ...) *parks* there (:meth:`Scheduler.park`); without packing it goes right after its piece, alone. With it, while
  nobody decodes, the next request in line is admitted meanwhile, and when none would be admitted next (nobody waits,
  the head does not fit, a long prepare is in progress, or ``max_batch_size`` requests are parked),
  :meth:`Scheduler.flush` hands every parked request to one suffix forward (:func:`kvrag.kv.batched.prefill_rows`): a
  burst's arrivals share the forward's overhead and weight reads and get their first tokens together. While requests
  decode, a parked request goes right after its piece (holding it across decode steps for later arrivals would cost it
  a step per arrival, and a large packed forward would stall the running streams). A parked request holds its lease
  and stays PREPARING; a cancelled one leaves at the next plan.
* **Continuous batching.** QUEUED requests join RUNNING at a plan boundary, up to ``max_batch_size``, in the order
  their streams started; every RUNNING request is in every step (each exactly once).
* **Cancellation between steps.** A RUNNING or PREPARING request that is cancelled leaves at the next plan (its
  step or prepare piece is never cut in half); any other state leaves at once. Leaving gives its lease back.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools

from kvrag.engine.lease import KVBudget, Lease


class RequestState(enum.Enum):
    """Where a request is (see the module docstring's diagram)."""

    WAITING = "waiting"
    """In line for admission; holds no KV."""
    PREPARING = "preparing"
    """Admitted (its lease is held); its prepare is in this plan."""
    READY = "ready"
    """Prepared; holds its lease until it is streamed, dropped or garbage-collected."""
    QUEUED = "queued"
    """Its stream started; waiting for a place in the decode batch."""
    RUNNING = "running"
    """In the decode batch: stepped once per plan."""
    FINISHED = "finished"
    """Done, cancelled, failed, dropped or refused; its lease was given back."""


HOLDING = (RequestState.PREPARING, RequestState.READY, RequestState.QUEUED, RequestState.RUNNING)
"""The states that hold a lease."""


@dataclasses.dataclass(eq=False)
class Request:
    """The scheduler's view of one request."""

    rid: int
    positions: int
    """KV positions asked for (prompt + the answer's reserve): what its lease holds once admitted."""
    kv_bytes: int
    arrival: int
    state: RequestState = RequestState.WAITING
    lease: Lease | None = None
    cancel_requested: str | None = None
    reason: str | None = None
    """Why it finished: ``done``, ``cancelled``, ``failed``, ``busy``, ``dropped`` or ``closed``."""


@dataclasses.dataclass
class StepPlan:
    """What the runner does next, in this order.

    Attributes:
        finish: ``(rid, reason)`` of requests that finished since the last plan (the runner tells their callers);
            their leases are already given back.
        prepare: the request whose prepare runs its next piece now (just admitted, or in progress), or None.
        suffixes: parked requests whose question suffixes are prefilled together now (see :meth:`Scheduler.flush`;
            with a ``prepare``, the runner asks :meth:`Scheduler.flush` again after its piece).
        decode: the requests to step once each, in batch order.
    """

    finish: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    prepare: int | None = None
    decode: list[int] = dataclasses.field(default_factory=list)
    suffixes: list[int] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.finish or self.prepare is not None or self.decode or self.suffixes)


class SchedulerError(RuntimeError):
    """An event that the request's state does not allow (e.g. streaming a request twice)."""

    def __init__(self, rid: int, state: RequestState, event: str) -> None:
        super().__init__(f"request {rid} is {state.value}: cannot {event}")
        self.state = state


class Scheduler:
    """Request states, the admission line and the decode batch of one engine (see the module docstring).

    Args:
        budget: the engine's KV memory bound (this scheduler takes and gives its leases).
        max_batch_size: most requests in one decode step (and parked for one suffix forward).
        pack_suffixes: let parked requests wait for the next arrivals' suffixes (False: each goes alone, right
            after its piece).
    """

    def __init__(self, budget: KVBudget, max_batch_size: int, pack_suffixes: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.budget = budget
        self.max_batch_size = int(max_batch_size)
        self.max_parked = self.max_batch_size if pack_suffixes else 1
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[int] = collections.deque()
        self.queued: collections.deque[int] = collections.deque()
        self.running: list[int] = []
        self.preparing: int | None = None
        """The prepare in progress (it gets every plan's prepare piece until it is done)."""
        self.parked: list[int] = []
        """PREPARING requests waiting at their suffix prefill, in arrival order (see :meth:`flush`)."""
        self.closed = False
        self._outbox: list[tuple[int, str]] = []
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------------------------------- events
    def add(self, positions: int) -> int:
        """A new request of ``positions`` KV positions in line for admission; returns its id."""
        if self.closed:
            raise SchedulerError(0, RequestState.FINISHED, "add a request to a closed engine")
        rid = next(self._ids)
        self.requests[rid] = Request(rid, int(positions), self.budget.bytes_for(positions), rid)
        self.waiting.append(rid)
        self.budget.waiting = len(self.waiting)
        return rid

    def state(self, rid: int) -> RequestState:
        req = self.requests.get(rid)
        return RequestState.FINISHED if req is None else req.state

    def ahead(self, rid: int) -> int:
        """How many requests are in line before a WAITING one."""
        try:
            return self.waiting.index(rid)
        except ValueError:
            return 0

    def cancel(self, rid: int, reason: str = "cancelled") -> RequestState:
        """Cancel a request; returns the state it was in. WAITING, READY and QUEUED ones finish at once,
        PREPARING and RUNNING ones at the next plan (after the prepare or step in flight)."""
        req = self.requests.get(rid)
        if req is None:
            return RequestState.FINISHED
        before = req.state
        if before in (RequestState.PREPARING, RequestState.RUNNING):
            req.cancel_requested = req.cancel_requested or reason
        else:
            self._finish(req, reason)
        return before

    def admit(self, rid: int) -> None:
        """Admit a WAITING request now, out of line and whatever the budget says: only for a prepare nested in
        another request's forward (its caller already holds the model)."""
        req = self._get(rid, RequestState.WAITING, "be admitted")
        self.waiting.remove(rid)
        self.budget.waiting = len(self.waiting)
        self._admit(req)

    def release(self, rid: int) -> None:
        """The request's lease was let go (its Prepared dropped or collected): it leaves like a cancellation."""
        self.cancel(rid, "dropped")

    def prepared(self, rid: int, ok: bool) -> RequestState:
        """The prepare of a PREPARING request ended (``ok``: it produced a request to stream); returns the new state."""
        req = self._get(rid, RequestState.PREPARING, "finish a prepare")
        if self.preparing == rid:
            self.preparing = None
        if not ok:
            self._finish(req, "failed")
        elif req.cancel_requested:
            self._finish(req, req.cancel_requested)
        else:
            req.state = RequestState.READY
        return req.state

    def park(self, rid: int) -> None:
        """The prepare of a PREPARING request reached its suffix prefill: it waits there for :meth:`flush` (and the
        next request in line may be admitted meanwhile)."""
        self._get(rid, RequestState.PREPARING, "park at its suffix prefill")
        if self.preparing == rid:
            self.preparing = None
        if rid not in self.parked:
            self.parked.append(rid)

    def flush(self) -> list[int]:
        """The parked requests whose suffixes are prefilled now, together (they stay PREPARING until
        :meth:`prepared`): all of them, unless nobody decodes and the next plan would admit the next request in
        line -- then they wait for its suffix too."""
        if not self.parked or (self._admits_next() and not self.decoding()):
            return []
        out, self.parked = self.parked, []
        return out

    def stream(self, rid: int) -> None:
        """A READY request's stream started: it queues for a place in the batch."""
        req = self._get(rid, RequestState.READY, "start streaming")
        req.state = RequestState.QUEUED
        self.queued.append(rid)

    def stepped(self, finished: list[int] | set[int]) -> None:
        """A decode step ran; ``finished`` requests (EOS, stop, ``max_new_tokens``, failure) leave the batch."""
        for rid in finished:
            req = self.requests.get(rid)
            if req is not None and req.state is RequestState.RUNNING:
                self._finish(req, req.cancel_requested or "done")

    def close(self, cancel: bool) -> None:
        """No new requests; with ``cancel``, every request in flight is cancelled too."""
        self.closed = True
        if cancel:
            for rid in list(self.requests):
                self.cancel(rid, "closed")

    # ------------------------------------------------------------------------------------------- the decision
    def schedule(self) -> StepPlan:
        """The next plan (see the module docstring for the policy)."""
        for rid in [r for r in (*self.running, *self.parked) if self.requests[r].cancel_requested]:
            req = self.requests[rid]
            self._finish(req, req.cancel_requested or "cancelled")
        while self.queued and len(self.running) < self.max_batch_size:
            rid = self.queued.popleft()
            self.requests[rid].state = RequestState.RUNNING
            self.running.append(rid)
        prepare = None
        if self.preparing is not None:
            req = self.requests[self.preparing]
            if req.cancel_requested:  # stops at this piece boundary
                self._finish(req, req.cancel_requested)
            else:
                prepare = req.rid
        if self._admits_next():
            head = self.requests[self.waiting.popleft()]
            self._admit(head)
            self.preparing = prepare = head.rid
        self.budget.waiting = len(self.waiting)
        plan = StepPlan(self._outbox, prepare, list(self.running), [] if prepare is not None else self.flush())
        self._outbox = []
        return plan

    def _admits_next(self) -> bool:
        """The next plan admits the head of the line: no prepare in progress, fewer than ``max_parked`` parked and
        the head's KV fits."""
        return (self.preparing is None and bool(self.waiting) and len(self.parked) < self.max_parked
                and self.budget.fits(self.requests[self.waiting[0]].kv_bytes))

    def preparing_cancelled(self) -> bool:
        """Whether the prepare in progress was cancelled (its caller left): its pace ends the piece at the next
        checkpoint (:class:`kvrag.kv.pieces.Pace`) and :meth:`schedule` drops it there, also when nobody decodes.
        Asked from the forward's thread at every checkpoint, so it reads without the runner's lock (an attribute
        and a dict read)."""
        req = self.requests.get(self.preparing) if self.preparing is not None else None
        return req is not None and req.cancel_requested is not None

    def decoding(self) -> bool:
        """Some request decodes or waits to join the batch (then a long prepare runs in pieces)."""
        return bool(self.running or self.queued)

    def idle(self) -> bool:
        """Nothing is in flight (READY requests wait for their caller, not for the scheduler)."""
        return not (self.waiting or self.queued or self.running or self._outbox or self.parked
                    or self.preparing is not None)

    def live(self) -> dict[RequestState, int]:
        """Requests per state (FINISHED ones are forgotten)."""
        return collections.Counter(r.state for r in self.requests.values())

    # ------------------------------------------------------------------------------------------- helpers
    def _get(self, rid: int, state: RequestState, event: str) -> Request:
        req = self.requests.get(rid)
        if req is None or req.state is not state:
            raise SchedulerError(rid, RequestState.FINISHED if req is None else req.state, event)
        return req

    def _admit(self, req: Request) -> None:
        req.state = RequestState.PREPARING
        req.lease = self.budget.take(req.positions)
        req.lease.rid = req.rid

    def _finish(self, req: Request, reason: str) -> None:
        if req.state is RequestState.FINISHED:
            return
        if req.state is RequestState.WAITING:
            self.waiting.remove(req.rid)
            self.budget.waiting = len(self.waiting)
        elif req.state is RequestState.QUEUED:
            self.queued.remove(req.rid)
        elif req.state is RequestState.RUNNING:
            self.running.remove(req.rid)
        if self.preparing == req.rid:
            self.preparing = None
        if req.rid in self.parked:
            self.parked.remove(req.rid)
        if req.lease is not None:
            self.budget.give(req.lease)
        req.state = RequestState.FINISHED
        req.reason = reason
        del self.requests[req.rid]
        self._outbox.append((req.rid, reason))


__all__ = ["HOLDING", "Request", "RequestState", "Scheduler", "SchedulerError", "StepPlan"]
