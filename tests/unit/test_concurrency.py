"""Concurrency: many processes writing one key to Redis; one engine under many threads and asyncio tasks.

(The disk store's concurrent-writers test lives in test_store.py.)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvrag import adapters
from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_testing.store_suite import chunk_key, make_spec, random_chunk
from kvrag_testing.tiny import tiny_model

FORK: Any = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
    render_passage("Rotary position embeddings rotate queries and keys by position.", "RoPE"),
    render_passage("Numbers such as 10, 100 and 1000 appear in tables and lists.", "Numbers"),
]
# different chunk sets, orders and questions, so cross-talk would change the answers
REQUESTS = [
    ([0, 1, 2], "What is the capital of France?"),
    ([2, 1], "Who jumps over the dog?"),
    ([3, 4, 0], "What rotates the keys?"),
    ([4], "Which numbers appear?"),
    ([1, 3], "What is the capital of Germany?"),
    ([0, 4, 2, 3], "Answer in one sentence."),
]
GEN = GenerationConfig(max_new_tokens=8)


def _redis_hammer(url: str, prefix: str, key: str, chunk: Any, go: Any, n: int) -> None:
    from kvrag.store.redis import RedisStore

    store = RedisStore(url, prefix=prefix)
    go.wait(20)
    for _ in range(n):
        store.put(key, chunk)
    store.close()


@pytest.mark.skipif(FORK is None, reason="needs the 'fork' start method (POSIX)")
def test_redis_concurrent_writers_end_with_one_valid_entry(redis_srv: Any) -> None:
    from kvrag.store.redis import RedisStore

    prefix = f"kvrag-conc-{uuid.uuid4().hex}:"
    chunks = [random_chunk(make_spec("float16"), T=16, seed=200 + i) for i in range(4)]
    key = chunk_key(chunks[0])
    go = FORK.Event()
    procs = [FORK.Process(target=_redis_hammer, args=(redis_srv.url, prefix, key, c, go, 25)) for c in chunks]
    for p in procs:
        p.start()
    reader = RedisStore(redis_srv.url, prefix=prefix)
    go.set()
    while any(p.is_alive() for p in procs):
        got = reader.get(key)  # a whole entry or none, never a mix
        assert got is None or any(got.keys.equal(c.keys) and got.values.equal(c.values) for c in chunks)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert list(reader.iter_keys()) == [key] and reader.stats()["corrupt_dropped"] == 0
    final = reader.get(key)
    assert final is not None
    assert sum(final.keys.equal(c.keys) and final.values.equal(c.values) for c in chunks) == 1
    reader.close()


# ---- the engine under concurrent callers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eng() -> KVRAGEngine:
    e = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig())
    e.ingest(DOCS)
    return e


def _plan(eng: KVRAGEngine, i: int) -> Any:
    idx, q = REQUESTS[i % len(REQUESTS)]
    passages = [DOCS[j] for j in idx]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, q), passages)


def _stream_text(eng: KVRAGEngine, i: int) -> str:
    return "".join(eng.stream(eng.prepare(_plan(eng, i), "stale"), GEN))


@pytest.fixture(scope="module")
def sequential(eng: KVRAGEngine) -> list[list[int]]:
    return [eng.answer_plan(_plan(eng, i), "stale", GEN).token_ids for i in range(len(REQUESTS))]


def test_concurrent_threads_equal_sequential(eng: KVRAGEngine, sequential: list[list[int]]) -> None:
    assert len({tuple(t) for t in sequential}) > 1, "requests should not all answer alike"
    n = 4 * len(REQUESTS)
    with ThreadPoolExecutor(max_workers=8) as ex:
        answers = list(ex.map(lambda i: eng.answer_plan(_plan(eng, i), "stale", GEN).token_ids, range(n)))
        streamed = list(ex.map(lambda i: _stream_text(eng, i), range(n)))
    assert answers == [sequential[i % len(REQUESTS)] for i in range(n)]
    texts = [eng.tokenizer.decode(sequential[i % len(REQUESTS)], skip_special_tokens=True) for i in range(n)]
    assert streamed == texts


def test_concurrent_asyncio_callers_equal_sequential(eng: KVRAGEngine, sequential: list[list[int]]) -> None:
    async def one(i: int) -> list[int]:
        return (await asyncio.to_thread(eng.answer_plan, _plan(eng, i), "stale", GEN)).token_ids

    async def one_stream(i: int) -> str:
        parts = []
        async for d in adapters.aiter_in_thread(lambda: eng.stream(eng.prepare(_plan(eng, i), "stale"), GEN)):
            parts.append(d)
        return "".join(parts)

    async def main() -> tuple[list[list[int]], list[str]]:
        n = 2 * len(REQUESTS)
        a = await asyncio.gather(*(one(i) for i in range(n)))
        s = await asyncio.gather(*(one_stream(i) for i in range(n)))
        return list(a), list(s)

    answers, streamed = asyncio.run(main())
    assert answers == [sequential[i % len(REQUESTS)] for i in range(len(answers))]
    assert streamed == [eng.tokenizer.decode(sequential[i % len(REQUESTS)], skip_special_tokens=True)
                        for i in range(len(streamed))]


def test_paused_stream_does_not_block_other_requests(eng: KVRAGEngine, sequential: list[list[int]]) -> None:
    got_first, release = threading.Event(), threading.Event()
    out: dict[str, Any] = {}

    def slow_consumer() -> None:
        parts = []
        for d in eng.stream(eng.prepare(_plan(eng, 0), "stale"), GEN):
            parts.append(d)
            if not got_first.is_set():
                got_first.set()
                release.wait(30)  # the consumer is busy; the engine must not be held meanwhile
        out["slow"] = "".join(parts)

    t = threading.Thread(target=slow_consumer)
    t.start()
    try:
        assert got_first.wait(30)
        other = threading.Thread(target=lambda: out.setdefault("other", eng.answer_plan(_plan(eng, 1), "stale", GEN)))
        other.start()
        other.join(20)
        assert not other.is_alive(), "a paused stream blocked another request (engine lock held across yield)"
        assert out["other"].token_ids == sequential[1]
        # an abandoned, never-finished stream does not block either
        abandoned = eng.stream(eng.prepare(_plan(eng, 2), "stale"), GEN)
        next(abandoned, None)
        assert eng.answer_plan(_plan(eng, 3), "stale", GEN).token_ids == sequential[3]
        abandoned.close()
    finally:
        release.set()
        t.join(30)
    assert out["slow"] == eng.tokenizer.decode(sequential[0], skip_special_tokens=True)


def test_stream_steps_may_run_in_different_threads(eng: KVRAGEngine, sequential: list[list[int]]) -> None:
    gen = eng.stream(eng.prepare(_plan(eng, 4), "stale"), GEN)
    parts: list[Any] = []
    errors: list[BaseException] = []

    def step() -> None:
        try:
            parts.append(next(gen, None))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            parts.append(None)

    while parts[-1:] != [None]:
        t = threading.Thread(target=step)  # a fresh thread for every step
        t.start()
        t.join(30)
    assert errors == []
    assert "".join(parts[:-1]) == eng.tokenizer.decode(sequential[4], skip_special_tokens=True)


# ---- batched steps: one forward serves many requests, each keeps its own KV, timings and stats ------------------------
MIXED = ("stale", "full", "relaxkv:r=0.3", "cacheblend:r=0.3")


def test_batched_steps_have_no_cross_talk() -> None:
    """Many callers decode in shared batched steps (the steps' batch size is observed > 1) with different chunk sets,
    questions and methods; each answer, its stats and its token counts equal the request's when answered alone."""
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(max_batch_size=6))
    eng.ingest(DOCS)
    jobs = [(i % len(REQUESTS), MIXED[i % len(MIXED)]) for i in range(3 * len(REQUESTS))]
    for j in set(jobs):  # warm: every segment's cache stored, so hits and reused tokens are the same below
        eng.answer_plan(_plan(eng, j[0]), j[1], GEN)
    alone = {j: eng.answer_plan(_plan(eng, j[0]), j[1], GEN) for j in set(jobs)}
    before = eng.batcher.stats()
    with ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        got = list(ex.map(lambda j: eng.answer_plan(_plan(eng, j[0]), j[1], GEN), jobs))
    after = eng.batcher.stats()
    assert after["max_rows"] > 1
    assert after["rows_stepped"] - before["rows_stepped"] > after["steps"] - before["steps"]  # steps were shared
    for j, r in zip(jobs, got, strict=True):
        ref = alone[j]
        assert (r.token_ids, r.text) == (ref.token_ids, ref.text)
        assert r.stats.generated_tokens == len(r.token_ids)
        assert (r.stats.context_tokens, r.stats.suffix_tokens, r.stats.chunks_found, r.stats.reused_tokens) == (
            ref.stats.context_tokens, ref.stats.suffix_tokens, ref.stats.chunks_found, ref.stats.reused_tokens)
        mine, theirs = r.stats.method_stats, ref.stats.method_stats
        assert (mine.recomputed_fraction, mine.selected, mine.anchors_per_layer) == (
            theirs.recomputed_fraction, theirs.selected, theirs.anchors_per_layer)
        assert r.timings.ttft_s is not None and 0 < r.timings.ttft_s <= r.timings.total_s


def test_a_prepare_never_waits_more_than_one_step_and_never_two_prepares_between_steps() -> None:
    """The interleaving policy: while requests decode, prepares and decode steps alternate (at most one prepare
    piece between two steps, its suffix prefill right after it), so neither a new request nor a decoding one
    starves."""
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    running = eng.stream(eng.prepare(_plan(eng, 0), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)  # decoding while the others arrive
    events: list[str] = []
    step, prepare = eng.runner._step, eng.runner._run_prepare

    def logged_step(rows: Any) -> None:
        events.append(f"step{len(rows)}")
        step(rows)

    def logged_prepare(h: Any, **kw: Any) -> None:
        events.append("suffix" if "send" in kw or "throw" in kw else "prepare")  # a parked prepare resumed: its end
        prepare(h, **kw)

    eng.runner._step = logged_step  # type: ignore[method-assign]
    eng.runner._run_prepare = logged_prepare  # type: ignore[method-assign]
    gen = GenerationConfig(max_new_tokens=24)
    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(lambda i: eng.answer_plan(_plan(eng, i), "stale", gen), range(8)))
    first_step = events.index(next(e for e in events if e.startswith("step")))
    decoding_part = events[first_step:]
    running.close()
    assert "prepare" in decoding_part  # requests arrived while others decoded
    between = "".join("s" if e.startswith("step") else e[0] for e in decoding_part).split("s")
    assert all(part.count("p") <= 1 for part in between), events  # at most one prepare piece between two steps
    assert eng.runner.stats()["suffix_rows"] == 9  # every prepare's suffix went through the runner's prefill


# ---- several engines, one model (issue 13) ------------------------------------------------------------------------
# The attention probe of relaxkv/prophetkv switches the model's (shared) config to a probe implementation while it
# scores; every engine on that model must therefore serialize on the model's lock, not on its own.
PROBING = ("relaxkv:r=0.3", "prophetkv:r=0.3")
GEN_SHORT = GenerationConfig(max_new_tokens=4)


def _rounds_in_threads(engines: list[KVRAGEngine], rounds: int = 4) -> tuple[list[str], list[tuple[int, int, list[int]]]]:
    """Thread i answers request i with engine i and method PROBING[i] for ``rounds`` rounds, all threads at once."""
    errors: list[str] = []
    got: list[tuple[int, int, list[int]]] = []
    go = threading.Barrier(len(engines))

    def work(i: int) -> None:
        go.wait(30)
        for r in range(rounds):
            try:
                got.append((i, r, engines[i].answer_plan(_plan(engines[i], i), PROBING[i % 2], GEN_SHORT).token_ids))
            except Exception as e:  # noqa: BLE001 - counted and shown below
                errors.append(f"thread {i} round {r}: {e!r}"[:300])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors, got


@pytest.mark.parametrize("shared", [True, False], ids=["one-model", "two-models"])
def test_engines_probing_at_once_equal_running_alone(shared: bool) -> None:
    lm = tiny_model("qwen2", init_std=0.1)
    models = [lm, lm] if shared else [lm, tiny_model("llama", init_std=0.1, seed=3)]
    engines = [KVRAGEngine(m, MemoryStore(), EngineConfig()) for m in models]
    impl = lm.model.config._attn_implementation
    alone = [engines[i].answer_plan(_plan(engines[i], i), PROBING[i % 2], GEN_SHORT).token_ids for i in range(2)]
    errors, got = _rounds_in_threads(engines)
    assert errors == []
    assert len(got) == 8
    differing = [(i, r) for i, r, toks in got if toks != alone[i]]
    assert differing == [], f"answers differing from running alone (thread, round): {differing}"
    assert lm.model.config._attn_implementation == impl  # the probe left the shared config as it was
