"""kvrag.registry: request-scoped chunk registration, the recent-chunk table, helpers for the adapters."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvrag import registry
from kvrag.errors import ConfigError
from kvrag.registry import RecentChunks, RegisteredChunk


@pytest.fixture(autouse=True)
def _clean():
    registry.clear_chunks()
    registry.recent.clear()
    yield
    registry.clear_chunks()
    registry.recent.clear()


def test_register_replaces_and_extends():
    registry.register_chunks(["a text", ("b text", "k" * 64), RegisteredChunk("c text")])
    assert [c.text for c in registry.current_chunks()] == ["a text", "b text", "c text"]
    assert registry.current_chunks()[1].key == "k" * 64
    registry.register_chunks(["d text", "a text"], replace=False)
    assert [c.text for c in registry.current_chunks()] == ["a text", "b text", "c text", "d text"]
    registry.register_chunks(["x"])
    assert [c.text for c in registry.current_chunks()] == ["x"]
    registry.register_chunks(["", "  \n"])  # whitespace-only texts are dropped
    assert registry.current_chunks() == ()
    with pytest.raises(ConfigError, match="a chunk must be"):
        registry.register_chunks([42])


def test_scope_restores():
    registry.register_chunks(["outer"])
    with registry.chunk_scope(["inner"]):
        assert [c.text for c in registry.current_chunks()] == ["inner"]
    assert [c.text for c in registry.current_chunks()] == ["outer"]


def test_threads_do_not_share_request_chunks():
    registry.register_chunks(["main thread"])
    seen: dict[int, list[str]] = {}
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        assert registry.current_chunks() == ()  # a new thread starts with an empty context
        registry.register_chunks([f"thread {i}"])
        barrier.wait()
        seen[i] = [c.text for c in registry.current_chunks()]

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {0: ["thread 0"], 1: ["thread 1"]}
    assert [c.text for c in registry.current_chunks()] == ["main thread"]


def test_asyncio_tasks_do_not_share_request_chunks():
    async def task(i: int) -> list[str]:
        registry.register_chunks([f"task {i}"])
        await asyncio.sleep(0.01)
        return [c.text for c in registry.current_chunks()]

    async def main():
        return await asyncio.gather(task(0), task(1))

    assert asyncio.run(main()) == [["task 0"], ["task 1"]]


def test_recent_table_and_resolve():
    registry.register_chunks(["alpha chunk", "beta chunk"])
    registry.clear_chunks()
    prompt = "intro alpha chunk outro"
    assert [c.text for c in registry.recent.found_in(prompt)] == ["alpha chunk"]
    assert registry.resolve_chunks(prompt) == ()
    assert [c.text for c in registry.resolve_chunks(prompt, use_recent=True)] == ["alpha chunk"]
    assert [c.text for c in registry.resolve_chunks(prompt, ["explicit"], use_recent=True)] == ["explicit"]
    registry.register_chunks(["gamma chunk", "alpha chunk"])
    got = registry.resolve_chunks(prompt, use_recent=True)
    assert [c.text for c in got] == ["gamma chunk", "alpha chunk"]
    assert [c.text for c in registry.resolve_chunks(prompt, use_recent=True, only_found=True)] == ["alpha chunk"]


def test_recent_is_bounded():
    r = RecentChunks(max_entries=2, max_chars=100)
    r.add(["one", "two", "three"])
    assert len(r) == 2 and [c.text for c in r.found_in("one two three")] == ["three", "two"]
    r.add(["x" * 60, "y" * 60])
    assert len(r) == 1
    with pytest.raises(ConfigError):
        RecentChunks(max_entries=0)


def test_aiter_in_thread_runs_the_generator_in_one_thread():
    lock = threading.RLock()  # like the engine's decode loop: held across yields

    def gen():
        with lock:
            for i in range(5):
                yield i, threading.get_ident()

    async def main():
        with registry.chunk_scope(["ctx"]):
            items = [x async for x in registry.aiter_in_thread(gen)]
            texts = [x async for x in registry.aiter_in_thread(lambda: iter([c.text for c in registry.current_chunks()]))]
        return items, texts

    items, texts = asyncio.run(main())
    assert [i for i, _ in items] == list(range(5))
    assert len({t for _, t in items}) == 1
    assert texts == ["ctx"]

    def boom():
        yield 1
        raise ValueError("bad")

    async def fail():
        return [x async for x in registry.aiter_in_thread(boom)]

    with pytest.raises(ValueError, match="bad"):
        asyncio.run(fail())


def test_ensure_chunks_computes_once():
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore
    from kvrag.testing.tiny import tiny_model

    eng = KVRAGEngine(tiny_model("llama"), MemoryStore())
    first = registry.ensure_chunks(eng, ["Paris is in France.", "  ", "Berlin is in Germany."])
    assert first[1] == (None, False)
    assert [c for _, c in (first[0], first[2])] == [False, False]
    again = registry.ensure_chunks(eng, ["Paris is in France.", "Berlin is in Germany."])
    assert [k for k, _ in again] == [first[0][0], first[2][0]] and all(c for _, c in again)
    assert eng.store.stats()["entries"] == 2
