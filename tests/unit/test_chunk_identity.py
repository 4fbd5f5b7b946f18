"""Chunk identity travels: (text, key, token ids[, cache]) from ensure into the planner and the fetch.

- the planner splices a registered chunk's stored ids (the text is not tokenized again) and the fetch uses its key;
- one store round trip per chunk: ``ensure`` asks once for all chunks; with ``fetch`` the request then reads
  nothing more; without it the request reads each cache once;
- a chunk derived by an engine with another key space (another model) is derived again, never trusted;
- answers are the same whether chunks come as texts or as registered chunks;
- a text two threads ensure at once is computed once: the second waits for the first's cache.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvrag import adapters
from kvrag.config import GenerationConfig
from kvrag.engine.chunks import RegisteredChunk
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv.chunk import ChunkKV
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_model

PASSAGES = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("Madrid is the capital of Spain. It lies on a plateau.", "Madrid"),
]
GEN = GenerationConfig(max_new_tokens=6)


class CountingStore(MemoryStore):
    """A MemoryStore that counts backend calls (each call is one round trip for a networked store)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.read: list[str] = []  # keys read, in order

    def _get(self, key: str) -> ChunkKV | None:
        self.calls["get"] += 1
        self.read.append(key)
        return super()._get(key)

    def _get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        self.calls["get_many"] += 1
        self.read.extend(keys)
        return [super(CountingStore, self)._get(k) for k in keys]

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        self.calls["get_many"] += 1
        self.read.extend(keys)
        return super()._get_many_shared(keys)

    def _contains(self, key: str) -> bool:
        self.calls["contains"] += 1
        return super()._contains(key)

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        self.calls["contains_many"] += 1
        return [super(CountingStore, self)._contains(k) for k in keys]


@pytest.fixture(scope="module")
def lm() -> Any:
    return tiny_model("llama")


def prompt_of(eng: KVRAGEngine, passages: Sequence[str] = PASSAGES) -> str:
    return RagTemplate().render(eng.tokenizer, list(passages), "Capital?")


def test_planner_uses_stored_ids_and_keys(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = KVRAGEngine(lm, MemoryStore())
    refs = [r for r, _ in eng.ensure(PASSAGES)]
    assert all(r is not None and r.token_ids == tuple(eng.tokenize(r.text)) for r in refs)
    prompt = prompt_of(eng)
    tokenized: list[str] = []
    real = eng.tokenize
    monkeypatch.setattr(eng, "tokenize", lambda t: tokenized.append(t) or real(t))
    plan = eng.plan(prompt, refs)
    assert not set(PASSAGES) & set(tokenized)  # the chunk texts were not tokenized again
    chunks = [s for s in plan.context if s.kind == "chunk"]
    assert [s.key for s in chunks] == [r.key for r in refs]  # type: ignore[union-attr]
    monkeypatch.undo()
    assert plan.context == eng.plan(prompt, PASSAGES).context  # same layout (keys do not take part in ==)
    assert [s.key for s in eng.plan(prompt, PASSAGES).context] == [None] * len(plan.context)


def test_one_store_round_trip_per_chunk(lm: Any) -> None:
    store = CountingStore()
    eng = KVRAGEngine(lm, store)
    eng.ingest(PASSAGES)
    assert store.calls["contains_many"] == 1 and store.calls["contains"] == 0  # one ask for all chunks
    prompt = prompt_of(eng)
    keys = [str(k) for k in eng.ingest(PASSAGES)]

    store.calls.clear()
    held = [r for r, _ in eng.ensure(PASSAGES, fetch=True)]
    assert dict(store.calls) == {"get_many": 1} and store.read == keys  # read once, in one round trip
    assert all(r is not None and r.kv is not None for r in held)
    r = eng.answer_plan(eng.plan(prompt, held), "stale", GEN)
    # the request read no chunk again; one round trip for the prompt's other cached text (template, separators)
    assert store.calls["get_many"] == 2 and store.calls["get"] == 0 and store.read[3:] and not set(store.read[3:]) & set(keys)
    assert r.stats["chunk_hits"] == 3 and r.stats["hit_rate"] == 1.0

    store.calls.clear()
    store.read.clear()
    ids_only = [r for r, _ in eng.ensure(PASSAGES)]
    assert dict(store.calls) == {"contains_many": 1}
    again = eng.answer_plan(eng.plan(prompt, ids_only), "stale", GEN)
    assert store.calls["get_many"] == 1 and store.calls["get"] == 0  # every cache read once, one round trip
    assert sorted(k for k in store.read if k in keys) == sorted(keys)
    assert again.text == r.text == eng.answer(prompt, PASSAGES, "stale", GEN).text


def test_held_cache_of_another_engine_is_not_used(lm: Any) -> None:
    a = KVRAGEngine(lm, MemoryStore())
    b = KVRAGEngine(tiny_model("qwen2"), MemoryStore())
    assert a.key_space() != b.key_space()
    held = [r for r, _ in a.ensure(PASSAGES, fetch=True)]
    prompt = prompt_of(b)
    plan = b.plan(prompt, held)
    assert plan.held == {} and all(s.key is None for s in plan.context)  # derived again by b, nothing trusted
    got = b.identify(held)
    assert all(g is not None and g.space == b.key_space() and g.kv is None for g in got)
    assert [g.key for g in got] != [h.key for h in held]  # type: ignore[union-attr]
    assert b.answer_plan(plan, "stale", GEN).text == b.answer(prompt, PASSAGES, "stale", GEN).text


def test_recent_chunks_keep_identity_not_caches(lm: Any) -> None:
    eng = KVRAGEngine(lm, MemoryStore())
    held = [r for r, _ in eng.ensure(PASSAGES[:1], fetch=True)]
    table = adapters.RecentChunks()
    table.add(held)
    (found,) = table.found_in(prompt_of(eng, PASSAGES[:1]))
    assert found == held[0] and found.kv is None and found.token_ids is not None


def test_ensure_fetch_of_missing_chunks_holds_the_computed_cache(lm: Any) -> None:
    store = CountingStore()
    eng = KVRAGEngine(lm, store)
    out = eng.ensure([PASSAGES[0], PASSAGES[0], "  "], fetch=True, batch_size=1)
    (a, ca), (b, cb), (none, cn) = out
    assert (ca, cb, none, cn) == (False, True, None, False)
    assert a is not None and b is not None and a.kv is b.kv is not None
    stored = eng.store.get(str(a.key))
    assert stored is not None and all(
        (x == y).all() for x, y in ((stored.keys, a.kv.keys), (stored.values, a.kv.values)))
    assert isinstance(a, RegisteredChunk) and eng.counters["chunks_computed"] == 1


def test_a_chunk_at_the_prompts_start_is_computed_as_its_prefix(lm: Any) -> None:
    """A registered text that starts the prompt -- the chat template's own header, which starts every chat -- was
    spliced at position 0 (a cache with no attention sink there) and changed every answer; it is the prompt's
    prefix now, in the searched plan and in explicit parts."""
    eng = KVRAGEngine(lm, MemoryStore())
    prompt = prompt_of(eng)
    head = prompt[: prompt.index(PASSAGES[0])]
    assert head and prompt.startswith(head)
    alone = eng.answer(prompt, PASSAGES, "stale", GEN)
    with_head = eng.answer(prompt, [head, *PASSAGES], "stale", GEN)
    assert with_head.token_ids == alone.token_ids and with_head.stats.chunks_found == 3
    parts = eng.plan_parts("", PASSAGES, "Capital?")
    assert parts.context[0].kind == "prefix" and [s.kind for s in parts.context[1:]].count("chunk") == 2


class GatedStore(MemoryStore):
    """A MemoryStore whose puts wait for ``go`` (after setting ``entered``): a computed cache stays unstored while
    another thread asks for the same text; ``reads`` counts lookups."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()
        self.reads = 0

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self.entered.set()
        assert self.go.wait(60)
        super()._put(key, chunk)

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        self.reads += 1
        return super()._get_many_shared(keys)

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        self.reads += 1
        return [super(GatedStore, self)._contains(k) for k in keys]


@pytest.mark.parametrize("fetch", [False, True])
def test_concurrent_ensure_of_one_text_computes_it_once(lm: Any, fetch: bool) -> None:
    store = GatedStore()
    eng = KVRAGEngine(lm, store)
    out: dict[str, Any] = {}

    def ask(name: str) -> None:
        out[name] = eng.ensure([PASSAGES[0]], fetch=fetch, batch_size=1)

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert store.entered.wait(60) and store.reads == 1  # computed, held before the store
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    for _ in range(600):  # the second caller found nothing stored ...
        if store.reads == 2:
            break
        time.sleep(0.01)
    time.sleep(0.3)  # ... and now waits for the first one's cache (it used to compute its own)
    store.go.set()
    first.join(60)
    second.join(60)
    (a, ca), (b, cb) = out["first"][0], out["second"][0]
    assert eng.counters["chunks_computed"] == 1
    assert (ca, cb) == (False, True) and a is not None and b is not None and a.key == b.key
    if fetch:
        assert a.kv is not None and b.kv is not None
        assert torch.equal(a.kv.keys, b.kv.keys) and torch.equal(a.kv.values, b.kv.values)


def test_concurrent_ensure_computes_what_the_first_caller_left(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first caller whose computation fails (a cancelled registration) wakes the waiter, which computes it."""
    eng = KVRAGEngine(lm, MemoryStore())
    (key,) = [str(r.key) for r in eng.identify([PASSAGES[1]]) if r is not None]
    mine, theirs = eng._computing.claim([key])  # another caller holds the text ...
    assert mine == [key] and not theirs
    threading.Timer(0.2, eng._computing.release, args=(mine,)).start()  # ... and gives up without storing it
    ((r, cached),) = eng.ensure([PASSAGES[1]], fetch=True)
    assert r is not None and r.kv is not None and not cached and eng.counters["chunks_computed"] == 1
    assert eng.store.get(key) is not None


@pytest.mark.parametrize("method", ["stale", "full", "relaxkv:r=0.5", "cacheblend:r=0.5", "epic:k=4", "prophetkv:r=0.5"])
def test_shared_reads_leave_the_stored_caches_untouched(lm: Any, method: str) -> None:
    """The query path reads memory-store entries without copying them; no method may modify them."""
    eng = KVRAGEngine(lm, MemoryStore())
    keys = eng.ingest(PASSAGES)
    before = {k: eng.store.get(k) for k in keys}  # copies
    prompt = prompt_of(eng)
    held = [r for r, _ in eng.ensure(PASSAGES, fetch=True)]
    first = eng.answer_plan(eng.plan(prompt, held), method, GEN)
    again = eng.answer(prompt, PASSAGES, method, GEN)
    for k, ch in before.items():
        now = eng.store.get(k)
        assert now is not None and ch is not None
        assert torch.equal(now.keys, ch.keys) and torch.equal(now.values, ch.values), (method, k)
    assert first.token_ids == again.token_ids


def test_non_text_chunk_is_a_clear_error(lm: Any) -> None:
    from kvrag.errors import ConfigError

    eng = KVRAGEngine(lm, MemoryStore())
    with pytest.raises(ConfigError, match="expected text as str"):
        eng.ensure([b"bytes"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="a chunk must be a str or a RegisteredChunk"):
        eng.plan("Question? Answer:", [3])  # type: ignore[list-item]
