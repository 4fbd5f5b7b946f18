"""The runner: one thread per engine that executes the scheduler's plans (prepares and batched decode steps).

Decide apart from run (vLLM v1's engine core loop around its ``Scheduler``): every iteration takes the runner's
lock only to record what happened and ask :meth:`kvrag.engine.scheduler.Scheduler.schedule` for the next
:class:`~kvrag.engine.scheduler.StepPlan`, then releases it and executes the plan -- tell finished requests'
callers, run at most one prepare piece, prefill the parked prepares' suffixes together, run one batched decode
step (the forwards: :mod:`kvrag.engine.forwards`) -- holding the model's lock for each forward. Callers never run
model work themselves:

* :meth:`Runner.prepare` puts a request in line (KV: prompt + ``reserve`` positions, leased at admission:
  :mod:`kvrag.engine.lease`) and waits until the runner
  prepared it in its turn (in pieces when the job is a generator, one per plan, between decode steps); at most
  ``EngineConfig.admission_timeout_s`` for admission, then :class:`~kvrag.errors.EngineBusyError` names the bound.
* :meth:`Runner.submit` starts a prepared request's stream: its first token is chosen from the prepare's logits,
  then it joins the batch at a plan boundary; the consumer reads ``(token, delta)`` items from the request's own
  queue (transformers' per-request output queues), so a slow consumer never holds the model.
* **Cancellation** reaches the scheduler from any thread: closing or collecting a stream, dropping a
  :class:`~kvrag.engine.results.Prepared` (its lease), or cancelling a :class:`CancelToken` -- the token in effect
  (:func:`cancel_scope`) when a request was made; kvrag's asyncio bridges (:func:`kvrag.adapters.to_thread`,
  :func:`kvrag.adapters.aiter_in_thread`) cancel theirs when the awaiting task is cancelled or the async iterator
  is closed. A waiting request leaves at once, a decoding one before the next step, a preparing one at its next
  piece boundary -- a long forward's next checkpoint (:meth:`Scheduler.preparing_cancelled`); each gives its slot
  and its KV lease back.
* **Lifetime**: the thread starts when there is work and exits when a plan is empty -- both decided under the
  lock, and nothing runs after the exit decision, so there is never a second loop over the same requests.
  :meth:`Runner.close` drains (or cancels) and joins it; after ``os.fork`` the child gets a fresh, empty runner
  (the parent's locks are taken around the fork so the child never inherits one held mid-step).

Models that cannot run a batched step (:func:`kvrag.kv.batched.batchable`) are stepped one request at a time by
the same plans, so every other property holds for them too.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvrag.config import GenerationConfig
from kvrag.engine import forking
from kvrag.engine.cancel import CancelToken, cancel_scope, current_token
from kvrag.engine.forwards import Forwards
from kvrag.engine.generate import DecodeState
from kvrag.engine.handle import END, Handle, reason_error
from kvrag.engine.lease import KVBudget, Lease
from kvrag.engine.scheduler import RequestState, Scheduler, SchedulerError, StepPlan
from kvrag.engine.speculate import PromptLookup, SpeculationConfig
from kvrag.errors import ConfigError, EngineBusyError, EngineClosedError
from kvrag.kv import batched, hf_cache, pieces
from kvrag.kv.attention import IMPL
from kvrag.kv.pieces import SuffixPrefill
from kvrag.threads import set_own_threads

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvrag.engine.results import Prepared

log = logging.getLogger(__name__)

class Runner:
    """Executes one engine's plans in one thread (see the module docstring).

    Args:
        model: the engine's model (its lock is held for every forward).
        tokenizer: for the requests' incremental text.
        budget: the engine's KV memory bound.
        max_batch_size: most requests in one step.
        admission_timeout_s: longest wait for admission (None: no limit).
        speculation: prompt-lookup drafting for greedy requests (:mod:`kvrag.engine.speculate`; None: off).
        pack_suffixes: arrivals' question suffixes in one forward (``EngineConfig.pack_suffixes``).
        threads: torch intra-op threads of the runner thread (``EngineConfig.runner_threads``; None: the process's)."""

    _exit_hook: Callable[[], None] | None = None  # called right after the thread decided to exit (tests hold it)

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, budget: KVBudget, *,
                 max_batch_size: int, admission_timeout_s: float | None = None, speculation: SpeculationConfig | None = None,
                 pack_suffixes: bool = False, threads: int | None = None) -> None:
        self.model, self.tokenizer, self.pack_suffixes, self.threads = model, tokenizer, bool(pack_suffixes), threads
        self.speculation = speculation or SpeculationConfig(max_draft=0)
        self.max_batch_size = int(max_batch_size)
        self.admission_timeout_s, self.lock = admission_timeout_s, hf_cache.model_lock(model)
        self.unbatchable = batched.batchable(model, IMPL)
        if self.unbatchable:
            log.info("decoding one request per step: %s", self.unbatchable)
        self.forwards = Forwards(model, self.lock, self.unbatchable, self.speculation)
        self._fresh(budget)
        forking.track(self)

    def _fresh(self, budget: KVBudget) -> None:
        self._cv = threading.Condition(threading.RLock())
        self.scheduler = Scheduler(budget, self.max_batch_size, self.pack_suffixes)
        self._handles: dict[int, Handle] = {}
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last_thread: threading.Thread | None = None
        self._threads_started, self._consumers_waiting = 0, 0
        self._stats: collections.Counter[str] = collections.Counter()
        self._step_s = 0.05  # recent decode steps' seconds (moving average): what prepare pieces are sized by

    @property
    def budget(self) -> KVBudget:
        return self.scheduler.budget

    @property
    def kv_dtype(self) -> torch.dtype | None:  # the dtype requests decode over (KVBudget.dtype)
        return self.budget.dtype

    # ------------------------------------------------------------------------------------------- prepares
    def prepare(self, positions: int, job: Callable[[Lease], Any]) -> Any:
        """Put a request of ``positions`` KV positions (prompt + reserve) in line and return what ``job(lease)``
        returns once the runner ran it in the request's turn (under the model lock, in inference mode); ``job``
        computes the prompt in ``lease.prompt_buffer(...)``.

        Raises:
            EngineBusyError: not admitted within ``admission_timeout_s``.
            EngineClosedError: the engine is closed.
            RequestCancelledError: the request's :class:`CancelToken` was cancelled."""
        h = Handle(job)
        if threading.current_thread() is self._thread or hf_cache.held_here(self.lock):
            return self._prepare_nested(h, positions)
        token = current_token()
        if token is not None and token.cancelled:
            raise reason_error("cancelled")
        with self._cv:
            try:
                h.rid = self.scheduler.add(positions)
            except SchedulerError:
                raise EngineClosedError("the engine is closed (engine.close()); open a new one") from None
            self._handles[h.rid] = h
            self._kick()
        armed = [True]

        def cancel() -> None:
            with self._cv:
                if armed[0]:  # a late callback (after this call returned) must not drop the caller's Prepared
                    self.cancel(h.rid)

        remove = token.on_cancel(cancel) if token is not None else (lambda: None)
        try:
            self._wait_prepared(h, self.budget.bytes_for(positions))
        except BaseException:  # e.g. KeyboardInterrupt while waiting: the request leaves
            self.cancel(h.rid)
            raise
        finally:
            remove()
        with self._cv:  # cancelled after its prepare, before this call returned: the caller gets no Prepared
            armed[0] = False
            if h.error is None and self.scheduler.state(h.rid) is not RequestState.READY:
                h.result, h.error = None, reason_error("cancelled")
        if h.error is not None:
            raise h.error
        out, h.result = h.result, None  # the runner keeps no reference: dropping the Prepared frees its lease
        return out

    def _wait_prepared(self, h: Handle, nbytes: int) -> None:
        limit = self.admission_timeout_s
        start = time.monotonic()
        with self._counting():
            while not h.prepared_done.wait(None if limit is None else max(0.0, start + limit - time.monotonic())):
                with self._cv:
                    if self.scheduler.state(h.rid) is not RequestState.WAITING:
                        limit = None  # admitted: its prepare is in flight
                        continue
                    msg = (f"the engine is busy: a request needing {nbytes / 2**20:.2f} MiB of KV waited "
                           f"{time.monotonic() - start:.1f} s (EngineConfig.admission_timeout_s) behind "
                           f"{self.scheduler.ahead(h.rid)} earlier requests; {self.budget.describe()}. Retry later, "
                           "send fewer requests at once, or raise kv_memory_bytes or admission_timeout_s")
                    h.error = EngineBusyError(msg)
                    self.scheduler.cancel(h.rid, "busy")
                    self._kick()
                return

    def _prepare_nested(self, h: Handle, positions: int) -> Any:
        """A prepare called inside a forward of this thread (or the runner's own): run it here, now."""
        with self._cv:
            h.rid = self.scheduler.add(positions)
            self.scheduler.admit(h.rid)
            self._handles[h.rid] = h
        while not h.prepared_done.is_set():
            self._run_prepare(h, nested=True)
            if h.suffix is not None:  # no other arrival joins a nested prepare: its suffix runs alone, now
                self._prefill_suffixes([h])
        if h.error is not None:
            raise h.error
        out, h.result = h.result, None
        return out

    def _run_prepare(self, h: Handle, *, nested: bool = False, send: Any = None,
                     throw: BaseException | None = None) -> None:
        """One piece of a request's prepare: all of it, or up to a generator job's next ``yield`` (then a step). A
        job that yields a :class:`~kvrag.kv.pieces.SuffixPrefill` parks there (:meth:`Scheduler.park`) until
        :meth:`_prefill_suffixes` resumes it with ``send`` (its logits) or ``throw`` (the forward's failure)."""
        with self._cv:
            lease = self.scheduler.requests[h.rid].lease
        assert lease is not None
        lease.on_release = self._lease_released
        h.lease = lease
        ok, done = True, True
        try:
            with torch.inference_mode(), self.lock:
                if h.pieces is None:
                    assert h.job is not None
                    out = h.job(lease)
                    h.job = None
                    if inspect.isgenerator(out):
                        h.pieces = out
                    else:
                        h.result = out
                if h.pieces is not None:
                    try:
                        got = (h.pieces.throw(throw) if throw is not None else
                               h.pieces.send(send) if send is not None else next(h.pieces))
                        done = False
                        if isinstance(got, SuffixPrefill):
                            h.suffix = got
                    except StopIteration as stop:
                        h.pieces, h.result = None, stop.value
        except BaseException as e:  # noqa: BLE001 - the caller gets it
            ok, h.error, h.pieces, h.job = False, e, None, None
        with self._cv:
            self._stats["prepare_pieces"] += 1
            if h.suffix is not None and not nested:
                self.scheduler.park(h.rid)
            if done:
                self._stats["prepares"] += 1
                state = self.scheduler.prepared(h.rid, ok)
                if state is not RequestState.READY:  # failed, or cancelled while preparing: dropped right after
                    if h.error is None:
                        h.result, h.error = None, reason_error("cancelled")
                    self._handles.pop(h.rid, None)
                    h.closed = True
        if done:
            h.prepared_done.set()

    def _prefill_suffixes(self, hs: list[Handle]) -> None:
        """The parked requests' question suffixes in one forward, then each prepare resumed with its logits (or the
        forward's failure) to its end."""
        suffixes = [h.suffix for h in hs if h.suffix is not None]
        logits, failed, seconds = self.forwards.prefill_suffixes(suffixes)
        with self._cv:
            self._stats.update(suffix_prefills=1, suffix_rows=len(hs))  # a Counter: adds
        tokens = sum(len(s.ids) for s in suffixes)
        for i, (h, s) in enumerate(zip(hs, suffixes, strict=True)):
            h.suffix, share = None, seconds * len(s.ids) / tokens
            if logits is not None:
                self._run_prepare(h, send=(logits[i], share))
            else:
                self._run_prepare(h, throw=failed)

    @property
    def parks_at_suffix(self) -> bool:
        """Whether prepares leave their suffix prefill to the runner (:meth:`_prefill_suffixes`): batchable models."""
        return self.unbatchable is None

    def piece_budget_s(self) -> float | None:  # a prepare piece's seconds now (kvrag.kv.pieces); None: none decodes
        return pieces.PIECE_OF_STEP * self._step_s if self.scheduler.decoding() else None

    def _lease_released(self, lease: Lease) -> None:
        """A lease let go outside the scheduler (a Prepared dropped): from any thread or a finalizer, so just a note."""
        if lease.rid is not None:
            self._released.put(lease.rid)
            self._kick()

    # ------------------------------------------------------------------------------------------- streams
    def submit(self, prepared: Prepared, gen: GenerationConfig, eos_ids: Sequence[int],
               on_first_token: Callable[[], None] | None = None, prompt_ids: Sequence[int] | None = None) -> Handle:
        """Start decoding a prepared request: its first token is chosen now (from the prepare's logits), then it
        joins the running batch at the next plan. Iterate the returned handle for its items and call
        :meth:`cancel` when the consumer stops. ``prompt_ids``: the prompt's token ids, which greedy requests draft
        from when speculation is on.

        Raises:
            ConfigError: the request was not prepared by this engine, is already streaming or streamed, or asks for
                more new tokens than it was prepared (and its KV leased) for."""
        rid = getattr(lease := getattr(prepared, "kv_lease", None), "rid", None)
        spec = self.speculation
        drafter = (PromptLookup(prompt_ids, spec.max_ngram, spec.min_ngram) if spec.enabled and prompt_ids is not None
                   and not gen.do_sample and self.unbatchable is None else None)  # indexing the prompt: outside the lock
        with self._cv:
            h, state = (self._handles.get(rid), self.scheduler.state(rid)) if rid is not None else (None, None)
            if h is None or state is not RequestState.READY:
                what = {RequestState.QUEUED: "is already streaming", RequestState.RUNNING: "is already streaming",
                        }.get(state, "was already streamed or dropped")  # type: ignore[arg-type]
                if rid is None or lease.budget is not self.budget:  # type: ignore[union-attr]
                    what = "was not prepared by this engine"
                msg = (f"this Prepared request {what}: a Prepared is streamed once (its KV buffer holds one answer); "
                       "call engine.prepare() again for another answer")
                raise ConfigError(msg)
            assert rid is not None and lease is not None
            buf, length = hf_cache.buffer_of(prepared.cache)
            lease.check_answer(length, gen.max_new_tokens)  # sized at admission: only compared here
            h.prepared = prepared
            try:
                h.state = DecodeState(self.tokenizer, gen, eos_ids)
                items = h.state.advance(prepared.last_logits)
            except BaseException:  # e.g. a seed the generator cannot take: the request ends and its lease goes back
                self.cancel(rid)
                raise
            finally:
                if on_first_token is not None:
                    on_first_token()
            for item in items:
                h.items.put(item)
            if drafter is not None and not h.state.finished:
                h.drafter = drafter
                drafter.push(int(h.state.last))  # type: ignore[arg-type]
            h.row = lease.decode_row(buf, length)  # the lease's buffer: it never grows
            prepared.cache = prepared.cache if h.row.buffer is buf else None  # let a prompt buffer of another dtype go
            self.scheduler.stream(rid)
            if h.state.finished:
                self.scheduler.cancel(rid, "done")
            self._kick()
        return h

    def cancel(self, h: Handle | int) -> None:
        """Cancel a request (idempotent; any thread): it leaves at the next plan boundary, freeing its slot and KV."""
        rid = h if isinstance(h, int) else h.rid
        with self._cv:
            self.scheduler.cancel(rid)
            self._kick()

    def iterate(self, h: Handle) -> Iterator[tuple[int, str]]:
        """:meth:`Handle.__iter__`, counted as a waiting consumer while it blocks."""
        with self._counting():
            yield from h

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        with self._cv:
            self._consumers_waiting += 1
        try:
            yield
        finally:
            with self._cv:
                self._consumers_waiting -= 1

    # ------------------------------------------------------------------------------------------- the loop
    def _kick(self) -> None:
        with self._cv:
            if self._thread is None and not (self.scheduler.idle() and self._released.empty()):
                self._thread = threading.Thread(target=self._loop, name="kvrag-runner", daemon=True)
                self._threads_started += 1
                self._thread.start()
            self._cv.notify_all()

    def _loop(self) -> None:
        me = threading.current_thread()
        if self.threads is not None:  # this thread's own count; every other thread keeps its own
            set_own_threads(self.threads)
        try:
            while True:
                with self._cv:
                    while not self._released.empty():
                        self.scheduler.release(self._released.get())
                    plan = self.scheduler.schedule()
                    if not plan:
                        if self._thread is me:
                            self._thread = None
                            self._last_thread = me
                        self._cv.notify_all()
                        break
                    closing = [(self._handles.pop(rid, None), reason) for rid, reason in plan.finish]
                    prep = self._handles.get(plan.prepare) if plan.prepare is not None else None
                    parked = [self._handles[rid] for rid in plan.suffixes]
                    rows = [self._handles[rid] for rid in plan.decode]
                self._execute(plan, closing, prep, parked, rows)
            if (hook := self._exit_hook) is not None:
                hook()
        except BaseException as e:  # noqa: BLE001 - never leave a caller waiting on a dead loop
            log.exception("the runner failed")
            with self._cv:
                left = list(self._handles.values())
                self._handles.clear()
                for rid in list(self.scheduler.requests):
                    self.scheduler.cancel(rid, "failed")
                    self.scheduler.stepped([rid])
                self.scheduler.schedule()
                if self._thread is me:
                    self._thread = None
                    self._last_thread = me
                self._cv.notify_all()
            for h in left:
                h.error = h.error or e
                h.items.put(e)
                self._close(h, "failed")

    def _execute(self, plan: StepPlan, closing: list[tuple[Handle | None, str]], prep: Handle | None,
                 parked: list[Handle], rows: list[Handle]) -> None:
        for h, reason in closing:
            if h is not None:
                self._close(h, reason)
        if prep is not None:
            self._run_prepare(prep)
            with self._cv:  # it may have parked: prefill the parked suffixes now unless another arrival joins them
                parked = [self._handles[rid] for rid in self.scheduler.flush()]
        if parked:
            self._prefill_suffixes(parked)
        if rows:
            t = time.perf_counter()
            self._step(rows)
            self._step_s += 0.25 * (time.perf_counter() - t - self._step_s)
            finished = [h for h in rows if h.state is None or h.state.finished]
            with self._cv:
                self.scheduler.stepped([h.rid for h in finished])
                for h in finished:
                    self._handles.pop(h.rid, None)
            for h in finished:
                self._close(h, "done")

    def _close(self, h: Handle, reason: str) -> None:
        """Tell a request's caller it ended; never raises, and always ends its stream and its wait."""
        if h.closed:
            return
        h.closed = True
        h.suffix = None
        try:
            if h.pieces is not None:  # a prepare stopped between two pieces
                pieces, h.pieces = h.pieces, None
                pieces.close()
            if h.row is not None and h.prepared is not None:  # the cache now covers what was decoded
                h.prepared.cache = h.row.cache(self.model.dtype)
        except BaseException:  # noqa: BLE001 - the consumer still gets its end below
            log.exception("could not hand a request's decoded cache back")
        finally:
            if not h.prepared_done.is_set():
                h.error = h.error or reason_error(reason)
                h.prepared_done.set()
            if reason not in ("done", "failed"):
                h.items.put(reason_error(reason))
            h.items.put(END)
            h.prepared = None

    def _step(self, rows: list[Handle]) -> None:
        self.forwards.step(rows, self._stats)

    # ------------------------------------------------------------------------------------------- lifetime
    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; let those in flight finish (or, with ``cancel``, cancel them); join the thread.

        With ``timeout``, requests still in flight after that many seconds are cancelled. Prepared requests that
        were never streamed keep their lease until they are dropped."""
        with self._cv:
            self.scheduler.close(cancel=cancel)
            self._kick()
            end = None if timeout is None else time.monotonic() + timeout
            while not (self.scheduler.idle() and self._thread is None):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    self.scheduler.close(cancel=True)
                    self._kick()
                    end = None
                    continue
                self._cv.wait(left if left is not None else 0.5)
                self._kick()
            thread = self._last_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _before_fork(self) -> None:
        self.lock.acquire()
        self._cv.acquire()

    def _after_fork_parent(self) -> None:
        self._cv.release()
        self.lock.release()

    def _after_fork_child(self) -> None:
        self._after_fork_parent()
        self._fresh(KVBudget(self.budget.limit, self.budget.bytes_per_token, self.budget.dtype))

    # ------------------------------------------------------------------------------------------- introspection
    def stats(self) -> dict[str, Any]:
        """Counters since creation: ``steps``, ``rows_stepped`` (sum of batch sizes), ``max_rows`` (largest batch),
        ``prepares``, ``prepare_pieces``, ``suffix_prefills`` / ``suffix_rows`` (suffix forwards / requests in
        them), ``verify_steps`` (steps that checked drafts), ``drafted`` / ``accepted`` (draft tokens proposed /
        confirmed); and now: ``decoding`` and ``joining`` requests, requests per state, ``threads`` (0 or 1),
        ``consumers_waiting`` (callers blocked on a prepare or a stream), the KV bound's use."""
        with self._cv:
            out: dict[str, Any] = dict.fromkeys(("steps", "rows_stepped", "max_rows", "prepares", "prepare_pieces",
                                                 "suffix_prefills", "suffix_rows", "verify_steps", "drafted",
                                                 "accepted"), 0)
            out.update(self._stats)
            out.update(decoding=len(self.scheduler.running), joining=len(self.scheduler.queued),
                       states={s.value: n for s, n in self.scheduler.live().items()},
                       threads=int(self._thread is not None), consumers_waiting=self._consumers_waiting)
            out["kv"] = self.budget.snapshot()
        return out


__all__ = ["END", "CancelToken", "Handle", "Runner", "cancel_scope", "current_token"]  # tokens: kvrag.engine.cancel
