"""Soak: many requests from threads and asyncio tasks at once, mixed methods and lengths, random cancellations
(cancel tokens from other threads, streams closed early, asyncio tasks cancelled or timed out), some requests
larger than the whole KV bound. Every completed answer equals its sequential answer; at the end nothing is
reserved, no runner thread is left and nobody waits.

The short form (one round: 200 requests from 16 threads and asyncio tasks) runs in the normal suite (~15 s), with and
without packing arrivals' question suffixes into one forward.
``KVRAG_SOAK_S=600`` repeats rounds with new seeds for that many seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import random
import threading
import time
from typing import Any

import pytest

from kvrag import adapters
from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.cancel import CancelToken, cancel_scope
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import RequestCancelledError
from kvrag.prompting import RagTemplate
from kvrag.store import MemoryStore
from kvrag_testing.batching import PASSAGES
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = PASSAGES
QUESTIONS = [([0, 1], "What is the capital of France?"), ([2], "Who jumps over the dog?"),
             ([3, 0, 2], "What rotates the keys?"), ([1, 3], "What is the capital of Germany?")]
METHODS = ["stale", "full", "relaxkv:r=0.3", "cacheblend:r=0.3"]
MAX_NEW = 12
SOAK_S = float(os.environ.get("KVRAG_SOAK_S", "0") or 0)


def _plan(eng: KVRAGEngine, q: int) -> Any:
    idx, text = QUESTIONS[q]
    passages = [DOCS[j] for j in idx]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, text), passages)


class Job:
    """One request: what it asks, how it is made (thread / asyncio, answer / stream) and how it may be cancelled."""

    def __init__(self, rng: random.Random, eng: KVRAGEngine, bound_tokens: int) -> None:
        self.q = rng.randrange(len(QUESTIONS))
        self.method = rng.choice(METHODS)
        self.n = rng.randint(1, MAX_NEW)
        self.large = rng.random() < 0.1  # reserves more KV than the whole bound: admitted alone, in its turn
        self.reserve = bound_tokens + 1 if self.large else self.n
        self.via = rng.choice(["thread", "thread", "async"])
        self.cancel = rng.choice([None, None, None, "token", "close", "task"])
        self.cancel_after = rng.random() * 0.05
        self.close_after = rng.randint(0, 3)
        self.tokens: list[int] | None = None
        self.cancelled = False

    def run_blocking(self, eng: KVRAGEngine, token: CancelToken | None = None) -> None:
        with cancel_scope(token) if token is not None else contextlib.nullcontext():  # async: to_thread's token
            prep = eng.prepare(_plan(eng, self.q), self.method, reserve=self.reserve)
            stream = eng.stream(prep, GenerationConfig(max_new_tokens=self.n))
            for k, _ in enumerate(stream):
                if self.cancel == "close" and k >= self.close_after:
                    stream.close()  # type: ignore[attr-defined]
                    self.cancelled = True
                    return
            self.tokens = list(prep.token_ids)


def _thread_worker(eng: KVRAGEngine, jobs: queue.SimpleQueue[Job | None], errors: list[BaseException]) -> None:
    while (job := jobs.get()) is not None:
        token = CancelToken()
        timer = None
        if job.cancel in ("token", "task"):
            timer = threading.Timer(job.cancel_after, token.cancel)
            timer.start()
        try:
            job.run_blocking(eng, token)
        except RequestCancelledError:
            job.cancelled = True
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            if timer is not None:
                timer.cancel()


async def _async_job(eng: KVRAGEngine, job: Job, errors: list[BaseException]) -> None:
    try:
        if job.cancel in ("token", "task"):  # the task is cancelled (a timeout) while its request is in flight
            await asyncio.wait_for(adapters.to_thread(job.run_blocking, eng), job.cancel_after)
        elif job.cancel == "close":  # an async stream closed early
            gen = GenerationConfig(max_new_tokens=job.n)
            agen = adapters.aiter_in_thread(lambda: eng.stream(eng.prepare(_plan(eng, job.q), job.method,
                                                                           reserve=job.reserve), gen))
            async for k, _ in _aenumerate(agen):
                if k >= job.close_after:
                    break
            await agen.aclose()  # type: ignore[attr-defined]
            job.cancelled = True
        else:
            await adapters.to_thread(job.run_blocking, eng)
    except (asyncio.TimeoutError, RequestCancelledError):
        job.cancelled = True
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


async def _aenumerate(agen: Any) -> Any:
    k = 0
    async for item in agen:
        yield k, item
        k += 1


def _round(eng: KVRAGEngine, reference: dict[tuple[int, str], list[int]], n_jobs: int, n_threads: int,
           seed: int, bound_tokens: int) -> tuple[int, int]:
    rng = random.Random(seed)
    jobs = [Job(rng, eng, bound_tokens) for _ in range(n_jobs)]
    errors: list[BaseException] = []
    q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    for j in jobs:
        if j.via == "thread":
            q.put(j)
    threads = [threading.Thread(target=_thread_worker, args=(eng, q, errors)) for _ in range(n_threads)]
    for _ in threads:
        q.put(None)

    async def async_side() -> None:
        await asyncio.gather(*(_async_job(eng, j, errors) for j in jobs if j.via == "async"))

    for t in threads:
        t.start()
    asyncio.run(async_side())
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    done = [j for j in jobs if j.tokens is not None]
    for j in done:
        assert j.tokens == reference[(j.q, j.method)][: j.n], (j.q, j.method, j.n)
    # nothing reserved, no runner thread, nobody waiting (cancelled requests may still be leaving: give it a moment)
    end = time.monotonic() + 20
    while time.monotonic() < end and not _quiet(eng):
        time.sleep(0.01)
    stats = eng.runner.stats()
    assert _quiet(eng), stats
    assert not any(t.name == "kvrag-runner" and t.is_alive() for t in threading.enumerate()) or _runner_leaving()
    return len(done), sum(j.cancelled for j in jobs)


def _runner_leaving() -> bool:
    """A runner thread that already decided to exit may still be returning: wait for it."""
    for t in threading.enumerate():
        if t.name == "kvrag-runner":
            t.join(5)
    return not any(t.name == "kvrag-runner" and t.is_alive() for t in threading.enumerate())


def _quiet(eng: KVRAGEngine) -> bool:
    s = eng.runner.stats()
    return (s["kv"]["used"] == 0 and s["kv"]["leases"] == 0 and s["kv"]["waiting"] == 0 and s["threads"] == 0
            and s["consumers_waiting"] == 0 and not s["states"])


@pytest.mark.parametrize("pack", [False, True], ids=["alone", "packed-suffixes"])
def test_soak(pack: bool) -> None:
    probe = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig())
    longest = max(_plan(probe, q).total_len for q in range(len(QUESTIONS)))
    bound_tokens = 3 * (longest + MAX_NEW)  # three ordinary requests at once; the large ones need more than all
    eng = KVRAGEngine(probe.loaded, MemoryStore(), EngineConfig(
        max_batch_size=4, kv_memory_bytes=bound_tokens * probe.runner.budget.bytes_per_token,
        admission_timeout_s=None, pack_suffixes=pack))
    eng.ingest(DOCS)
    reference = {(q, m): eng.answer_plan(_plan(eng, q), m, GenerationConfig(max_new_tokens=MAX_NEW)).token_ids
                 for q in range(len(QUESTIONS)) for m in METHODS}
    assert len({tuple(v) for v in reference.values()}) > 2
    if SOAK_S <= 0:
        done, cancelled = _round(eng, reference, 200, 16, 0, bound_tokens)
        assert done > 50 and cancelled > 20
        return
    end, seed, total = time.monotonic() + SOAK_S, 0, [0, 0]
    while time.monotonic() < end:
        done, cancelled = _round(eng, reference, 200, 16, seed, bound_tokens)
        total[0] += done
        total[1] += cancelled
        seed += 1
    print(f"soak: {seed} rounds, {total[0]} answers equal to sequential, {total[1]} cancelled")
