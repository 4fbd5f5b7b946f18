"""The runner thread and the request paths around it: each hole a server cannot live with, forced open and shown
closed -- the thread's exit window, a close that fails, a Prepared streamed twice, generation past the context
window, arrival-order admission with a wait limit, cancellation from threads and from asyncio, fork, close()."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from kvrag import adapters
from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.cancel import CancelToken, cancel_scope
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError, ContextLengthError, EngineBusyError, EngineClosedError, RequestCancelledError
from kvrag.kv import hf_cache
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
]
QUESTIONS = [([0, 1], "What is the capital of France?"), ([2], "Who jumps over the dog?"), ([1, 2], "And Germany?")]
GEN = GenerationConfig(max_new_tokens=8)
LONG = GenerationConfig(max_new_tokens=300)


def _engine(**config: Any) -> KVRAGEngine:
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(**config))
    eng.ingest(DOCS)
    return eng


def _plan(eng: KVRAGEngine, i: int) -> Any:
    idx, q = QUESTIONS[i % len(QUESTIONS)]
    passages = [DOCS[j] for j in idx]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, q), passages)


def _answer(eng: KVRAGEngine, i: int, gen: GenerationConfig = GEN) -> list[int]:
    return eng.answer_plan(_plan(eng, i), "stale", gen).token_ids


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t, out


def _quiet(eng: KVRAGEngine) -> bool:
    """Nothing held, nothing in flight, no runner thread, nobody waiting."""
    s = eng.runner.stats()
    return (s["kv"]["used"] == 0 and s["kv"]["leases"] == 0 and s["kv"]["waiting"] == 0 and s["threads"] == 0
            and s["consumers_waiting"] == 0 and not s["states"])


def _bound_for_one(eng: KVRAGEngine, gen: GenerationConfig) -> int:
    """A KV bound that holds the largest of the test requests, never two."""
    return eng.runner.budget.bytes_per_token * (max(_plan(eng, i).total_len for i in range(3)) + gen.max_new_tokens)


# ---- the runner thread's exit window ------------------------------------------------------------------------------
def test_a_request_submitted_while_the_thread_exits_is_never_stepped_by_two_threads() -> None:
    """The thread decides to exit; a hook holds it right there while a new request arrives and starts decoding
    (in a new thread). No two steps overlap, no step holds a request twice, and the answers are the sequential ones."""
    eng = _engine()
    seq = [_answer(eng, i) for i in range(3)]
    runner = eng.runner
    step = runner._step
    inside, overlaps, dupes = [0], [], []
    guard = threading.Lock()

    def checked_step(rows: list[Any]) -> None:
        with guard:
            inside[0] += 1
            if inside[0] > 1:
                overlaps.append(len(rows))
        if len({id(h) for h in rows}) != len(rows):
            dupes.append(len(rows))
        try:
            time.sleep(0.002)  # widen any overlap
            step(rows)
        finally:
            with guard:
                inside[0] -= 1

    got: list[Any] = []
    threads: list[threading.Thread] = []

    def hold_in_exit_window() -> None:
        if len(threads) >= 3:
            return
        i = len(threads)
        steps = runner.stats()["steps"]
        t, out = _in_thread(lambda: _answer(eng, i))
        threads.append(t)
        got.append(out)
        assert _wait_for(lambda: runner.stats()["steps"] > steps, 30)  # stepped while this old thread is alive

    runner._step = checked_step  # type: ignore[method-assign]
    runner._exit_hook = hold_in_exit_window  # type: ignore[method-assign]
    started = runner._threads_started
    assert _answer(eng, 0) == seq[0]
    assert _wait_for(lambda: len(threads) == 3 and not any(t.is_alive() for t in threads), 60)
    assert [o.get("value") for o in got] == seq
    assert runner._threads_started - started >= 4  # the window was crossed every time
    assert overlaps == [] and dupes == []
    assert _wait_for(lambda: _quiet(eng))


# ---- a close that fails --------------------------------------------------------------------------------------------
class _FailingCache(hf_cache.KVBuffer):
    def as_cache(self, length: int) -> Any:
        raise RuntimeError("as_cache failed")


def test_a_close_that_raises_still_ends_every_stream_and_frees_its_lease() -> None:
    eng = _engine()
    seq = [_answer(eng, i) for i in range(3)]

    def answer_with_failing_close(i: int) -> list[int]:
        prep = eng.prepare(_plan(eng, i), "stale", reserve=GEN.max_new_tokens)
        buf, _ = hf_cache.buffer_of(prep.cache)
        buf.__class__ = _FailingCache  # handing the decoded cache back now raises in the runner's close
        "".join(eng.stream(prep, GEN))
        return prep.token_ids

    runs = [_in_thread(lambda i=i: answer_with_failing_close(i)) for i in range(3)]
    for t, _ in runs:
        t.join(60)
    assert [out.get("value") for _, out in runs] == seq  # nobody left blocked on its queue
    assert _wait_for(lambda: _quiet(eng))


# ---- one answer per Prepared; generation within the window --------------------------------------------------------
def test_a_prepared_request_is_streamed_once() -> None:
    eng = _engine()
    seq = _answer(eng, 0, LONG)
    prep = eng.prepare(_plan(eng, 0), "stale", reserve=LONG.max_new_tokens)
    first = eng.stream(prep, LONG)
    next(first)
    with pytest.raises(ConfigError, match="already streaming.*prepare\\(\\) again"):
        next(eng.stream(prep, LONG))
    rest = list(first)
    assert rest and prep.token_ids == seq
    with pytest.raises(ConfigError, match="already streamed"):
        next(eng.stream(prep, LONG))
    other = _engine()
    with pytest.raises(ConfigError, match="not prepared by this engine"):
        next(other.stream(eng.prepare(_plan(eng, 1), "stale"), GEN))
    assert prep.token_ids == seq  # the refused streams wrote nothing
    gc.collect()
    assert _wait_for(lambda: _quiet(eng))


def test_prompt_plus_new_tokens_past_the_window_is_refused_before_any_work() -> None:
    eng = _engine()
    assert _wait_for(lambda: _quiet(eng))  # the ingest's turns (chunk caches are computed in the runner's turn) ended
    plan = _plan(eng, 0)
    room = eng.max_positions - plan.total_len
    before = eng.runner.stats()
    with pytest.raises(ContextLengthError, match=f"ask for at most {room} new tokens"):
        eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=room + 1))
    after = eng.runner.stats()
    assert after.get("prepares", 0) == before.get("prepares", 0) and _quiet(eng)
    assert len(eng.prepare(plan, "stale", reserve=room).cache.layers[0].buf.keys.shape) == 4  # exactly full: fine


# ---- admission: arrival order, wait limit --------------------------------------------------------------------------
def test_admission_in_arrival_order_with_a_clear_busy_error_after_the_wait_limit() -> None:
    probe = _engine()
    eng = _engine(kv_memory_bytes=_bound_for_one(probe, GEN), admission_timeout_s=None)
    seq = [_answer(eng, i) for i in range(3)]
    held = eng.prepare(_plan(eng, 0), "stale", reserve=GEN.max_new_tokens)  # the bound is spent
    order: list[int] = []

    def answer(i: int) -> list[int]:
        prep = eng.prepare(_plan(eng, i), "stale", reserve=GEN.max_new_tokens)
        order.append(i)
        "".join(eng.stream(prep, GEN))
        return prep.token_ids

    runs = []
    for i in (1, 2):  # 1 is in line before 2
        runs.append(_in_thread(lambda i=i: answer(i)))
        assert _wait_for(lambda i=i: eng.runner.stats()["kv"]["waiting"] == i)
    time.sleep(0.1)
    assert order == []
    del held  # the bound frees: the first in line goes first
    gc.collect()
    for t, _ in runs:
        t.join(60)
    assert order == [1, 2] and [out["value"] for _, out in runs] == seq[1:]

    busy = _engine(kv_memory_bytes=_bound_for_one(probe, GEN), admission_timeout_s=0.2)
    kept = busy.prepare(_plan(busy, 0), "stale", reserve=GEN.max_new_tokens)
    refused = _in_thread(lambda: busy.prepare(_plan(busy, 1), "stale", reserve=GEN.max_new_tokens))
    refused[0].join(60)  # a deadlock guard, not a timing claim: a wait limit that never fired would hang here
    assert not refused[0].is_alive() and isinstance(refused[1].get("error"), EngineBusyError), refused[1]
    assert re.search(r"waited \d+\.\d s .*behind 0 earlier requests.*kv_memory_bytes=", str(refused[1]["error"]))
    assert busy.runner.stats()["kv"]["waiting"] == 0 and busy.runner.stats()["kv"]["leases"] == 1
    assert "".join(busy.stream(kept, GEN)) is not None and kept.token_ids == seq[0]


# ---- cancellation ---------------------------------------------------------------------------------------------------
def test_cancelling_from_another_thread_frees_the_slot_and_memory_within_a_step() -> None:
    eng = _engine()
    token = CancelToken()
    cancelled = threading.Event()
    after: list[int] = []
    step = eng.runner._step

    def counting_step(rows: list[Any]) -> None:
        if cancelled.is_set():
            after.append(len(rows))
        step(rows)

    eng.runner._step = counting_step  # type: ignore[method-assign]

    def long_answer() -> list[int]:
        with cancel_scope(token):
            return _answer(eng, 0, LONG)

    t, out = _in_thread(long_answer)
    assert _wait_for(lambda: eng.runner.stats()["decoding"] == 1 and eng.runner.stats()["steps"] > 3)
    token.cancel()
    cancelled.set()
    t.join(30)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert len(after) <= 1  # at most the step already planned
    assert _wait_for(lambda: _quiet(eng))

    # waiting in line: it leaves at once
    eng1 = _engine(kv_memory_bytes=_bound_for_one(eng, GEN))
    held = eng1.prepare(_plan(eng1, 0), "stale", reserve=GEN.max_new_tokens)
    token = CancelToken()

    def waits() -> Any:
        with cancel_scope(token):
            return eng1.prepare(_plan(eng1, 1), "stale", reserve=GEN.max_new_tokens)

    t, out = _in_thread(waits)
    assert _wait_for(lambda: eng1.runner.stats()["kv"]["waiting"] == 1)
    token.cancel()
    t.join(10)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert eng1.runner.stats()["kv"]["waiting"] == 0 and eng1.runner.stats()["kv"]["leases"] == 1
    del held
    gc.collect()
    assert _wait_for(lambda: _quiet(eng1))

    # while preparing: dropped right after its prepare
    gate, entered = threading.Event(), threading.Event()
    prepare = eng1._prepare

    def slow_prepare(*args: Any) -> Any:
        entered.set()
        gate.wait(10)
        return prepare(*args)

    eng1._prepare = slow_prepare  # type: ignore[method-assign]
    token = CancelToken()

    def prepares() -> Any:
        with cancel_scope(token):
            return eng1.prepare(_plan(eng1, 1), "stale", reserve=GEN.max_new_tokens)

    t, out = _in_thread(prepares)
    assert entered.wait(10)
    token.cancel()
    gate.set()
    t.join(10)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert _wait_for(lambda: _quiet(eng1))


def test_a_cancel_that_lands_between_the_prepare_and_its_return_gives_no_prepared() -> None:
    """The token is cancelled after the runner finished the prepare but before ``prepare`` returned (a window the
    soak test hit once in ~29,000 requests): the caller gets RequestCancelledError, never a Prepared that was
    already dropped."""
    eng = _engine()
    token = CancelToken()
    wait = eng.runner._wait_prepared

    def cancel_in_the_window(h: Any, nbytes: int) -> None:
        wait(h, nbytes)
        token.cancel()

    eng.runner._wait_prepared = cancel_in_the_window  # type: ignore[method-assign]
    with cancel_scope(token), pytest.raises(RequestCancelledError):
        eng.prepare(_plan(eng, 0), "stale", reserve=GEN.max_new_tokens)
    gc.collect()
    assert _wait_for(lambda: _quiet(eng))


def test_cancelling_an_asyncio_caller_reaches_the_engine() -> None:
    eng = _engine()

    async def main() -> None:
        task = asyncio.ensure_future(adapters.to_thread(eng.answer_plan, _plan(eng, 0), "stale", LONG))
        while eng.runner.stats()["steps"] < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(_wait_for, lambda: _quiet(eng), 10)

        def stream() -> Any:
            return eng.stream(eng.prepare(_plan(eng, 1), "stale", reserve=LONG.max_new_tokens), LONG)

        agen = adapters.aiter_in_thread(stream)
        await agen.__anext__()
        await agen.aclose()  # type: ignore[attr-defined]
        assert await asyncio.to_thread(_wait_for, lambda: _quiet(eng), 10)

    asyncio.run(main())


# ---- fork and close -------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_fresh_runner() -> None:
    eng = _engine()
    seq = [_answer(eng, i) for i in range(2)]
    streaming = eng.stream(eng.prepare(_plan(eng, 1), "stale", reserve=LONG.max_new_tokens), LONG)
    next(streaming)  # the parent's runner thread is stepping it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pid = os.fork()
    if pid == 0:  # the child: its own runner, none of the parent's requests
        code = 3
        try:
            signal.alarm(60)
            fresh = eng.runner.stats()
            code = 0 if (_answer(eng, 0) == seq[0] and fresh["states"] == {} and fresh["kv"]["used"] == 0) else 2
        finally:
            os._exit(code)
    list(streaming)  # the parent's request goes on
    end = time.monotonic() + 90
    status = None
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _answer(eng, 1) == seq[1]


def test_close_drains_or_cancels_and_joins_the_thread() -> None:
    eng = _engine()
    seq = _answer(eng, 0, LONG)
    t, out = _in_thread(lambda: _answer(eng, 0, LONG))
    assert _wait_for(lambda: eng.runner.stats()["decoding"] == 1)
    eng.close()  # drain: the answer in flight ends
    assert not t.is_alive() or (t.join(10) is None and not t.is_alive())
    assert out["value"] == seq
    assert _quiet(eng) and not any(th.name == "kvrag-runner" and th.is_alive() for th in threading.enumerate())
    with pytest.raises(EngineClosedError, match="closed"):
        eng.prepare(_plan(eng, 0), "stale")

    eng2 = _engine()
    t, out = _in_thread(lambda: _answer(eng2, 0, LONG))
    assert _wait_for(lambda: eng2.runner.stats()["decoding"] == 1)
    with eng2:
        eng2.close(cancel=True)
    t.join(10)
    assert isinstance(out.get("error"), EngineClosedError)
    assert _quiet(eng2)


# ---- store I/O outside the model's turn ----------------------------------------------------------------------------
class _GatedStore(MemoryStore):
    """A store whose fetch, while ``hold`` is set, first calls it (in the caller's thread) and notes its answer."""

    hold: Callable[[], bool] | None = None
    held: bool | None = None

    def get_many(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        if self.hold is not None:
            self.held = self.hold()
        return super().get_many(keys, *args, **kwargs)


def _counting_steps(eng: KVRAGEngine) -> tuple[list[int], threading.Condition]:
    """Count the runner's decode steps: ([steps], a condition notified after each)."""
    steps, cond = [0], threading.Condition()
    step = eng.runner._step

    def counted(rows: list[Any]) -> None:
        step(rows)
        time.sleep(0.002)  # >= 2 ms a step: a running request's 2000 tokens outlast the test on any machine
        with cond:
            steps[0] += 1
            cond.notify_all()

    eng.runner._step = counted  # type: ignore[method-assign]
    return steps, cond


def test_a_slow_store_fetch_does_not_stall_decoding_requests() -> None:
    """A prepare's store round trip happens before its turn: requests already decoding keep being stepped. The
    fetch waits until five decode steps ran after it began, which only a fetch outside the model's turn sees
    (a fetch inside it holds the model, so no step can run: the wait gives up and the test fails)."""
    store = _GatedStore()
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), store, EngineConfig())
    eng.ingest(DOCS)
    seq = _answer(eng, 1)
    steps, cond = _counting_steps(eng)
    running = eng.stream(eng.prepare(_plan(eng, 0), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)

    def five_steps_meanwhile() -> bool:
        with cond:
            start = steps[0]
            return cond.wait_for(lambda: steps[0] >= start + 5, timeout=30)  # bounded: a deadlock guard

    store.hold = five_steps_meanwhile
    prep = eng.prepare(_plan(eng, 1), "stale", reserve=GEN.max_new_tokens)
    store.hold = None
    "".join(eng.stream(prep, GEN))
    running.close()
    assert store.held is True and prep.token_ids == seq  # at 088a252 the fetch held the model: no step ran


# ---- a prepare in pieces -------------------------------------------------------------------------------------------
def _cold_plan(eng: KVRAGEngine, tag: str) -> Any:
    """A prompt over four passages the store has never seen: its prepare computes four chunk caches."""
    passages = [render_passage(f"Passage {tag}{i}: the {tag} harbour opens at {i + 6} o'clock.", f"{tag}{i}")
                for i in range(4)]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, "When does it open?"), passages)


def test_chunks_a_prepare_computes_interleave_with_decode_steps_and_a_cancel_stops_between_them() -> None:
    """Decode steps are counted at each chunk compute of a cold prepare: at least one ran between any two (one chunk
    a turn, not all four in one). Each compute sleeps past a piece's budget (half a decode step) so that it ends a
    piece; the sleep only sets the piece boundaries, nothing is asserted on the clock."""
    eng = _engine()
    compute, calls = eng.compute, []
    gate: list[threading.Event] = []
    steps, _ = _counting_steps(eng)

    def slow_compute(*args: Any, **kwargs: Any) -> Any:
        calls.append(steps[0])
        time.sleep(0.05)
        if gate:
            gate[0].wait(20)  # bounded: a deadlock guard
        return compute(*args, **kwargs)

    running = eng.stream(eng.prepare(_plan(eng, 0), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)
    eng.compute = slow_compute  # type: ignore[method-assign]
    prep = eng.prepare(_cold_plan(eng, "a"), "stale", reserve=GEN.max_new_tokens)
    assert len(calls) >= 4 and all(b > a for a, b in zip(calls, calls[1:], strict=False)), calls
    assert eng.runner.stats()["prepare_pieces"] > eng.runner.stats()["prepares"]
    "".join(eng.stream(prep, GEN))
    eng.compute = compute  # type: ignore[method-assign]
    assert prep.token_ids == eng.answer_plan(_cold_plan(eng, "a"), "stale", GEN).token_ids

    calls.clear()
    eng.compute = slow_compute  # type: ignore[method-assign]
    token = CancelToken()

    def cold() -> Any:
        with cancel_scope(token):
            return eng.prepare(_cold_plan(eng, "b"), "stale", reserve=GEN.max_new_tokens)

    gate.append(threading.Event())  # the first compute returns only once the request is cancelled
    t, out = _in_thread(cold)
    assert _wait_for(lambda: len(calls) >= 1)
    token.cancel()
    gate[0].set()
    t.join(20)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert len(calls) == 1  # it stopped at the next piece boundary, not after all four
    running.close()
    assert _wait_for(lambda: _quiet(eng))


# ---- the runner's own torch threads ---------------------------------------------------------------------------
def test_runner_threads_apply_to_the_runner_thread_only() -> None:
    import torch

    eng = _engine(runner_threads=2)
    seen: list[tuple[str, int]] = []
    hook = eng.model.register_forward_pre_hook(
        lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))
    try:
        assert torch.get_num_threads() == 1  # the module's fixture
        tokens = _answer(eng, 0)
    finally:
        hook.remove()
    assert tokens == _answer(_engine(), 0)  # the tiny model's answer does not depend on the runner's threads
    assert seen and all(name == "kvrag-runner" and n == 2 for name, n in seen)  # every forward ran on the runner
    assert torch.get_num_threads() == 1  # the caller's own count is left alone
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [1]  # and so is torch's default for threads that start afterwards
    with pytest.raises(ConfigError, match="runner_threads must be an integer >= 1"):
        EngineConfig(runner_threads=0)
