"""kvrag.adapters: request-scoped chunk registration, the recent-chunk table, helpers for the adapters."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag import adapters
from kvrag.adapters import RecentChunks, RegisteredChunk
from kvrag.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean():
    adapters.clear_chunks()
    adapters.recent.clear()
    yield
    adapters.clear_chunks()
    adapters.recent.clear()


def test_register_replaces_and_extends():
    adapters.register_chunks(["a text", ("b text", "k" * 64), RegisteredChunk("c text")])
    assert [c.text for c in adapters.current_chunks()] == ["a text", "b text", "c text"]
    assert adapters.current_chunks()[1].key == "k" * 64
    adapters.register_chunks(["d text", "a text"], replace=False)
    assert [c.text for c in adapters.current_chunks()] == ["a text", "b text", "c text", "d text"]
    adapters.register_chunks(["x"])
    assert [c.text for c in adapters.current_chunks()] == ["x"]
    adapters.register_chunks(["", "  \n"])  # whitespace-only texts are dropped
    assert adapters.current_chunks() == ()
    with pytest.raises(ConfigError, match="a chunk must be"):
        adapters.register_chunks([42])


def test_scope_restores():
    adapters.register_chunks(["outer"])
    with adapters.chunk_scope(["inner"]):
        assert [c.text for c in adapters.current_chunks()] == ["inner"]
    assert [c.text for c in adapters.current_chunks()] == ["outer"]


def test_threads_do_not_share_request_chunks():
    adapters.register_chunks(["main thread"])
    seen: dict[int, list[str]] = {}
    barrier = threading.Barrier(2)

    def work(i: int) -> None:
        assert adapters.current_chunks() == ()  # a new thread starts with an empty context
        adapters.register_chunks([f"thread {i}"])
        barrier.wait()
        seen[i] = [c.text for c in adapters.current_chunks()]

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {0: ["thread 0"], 1: ["thread 1"]}
    assert [c.text for c in adapters.current_chunks()] == ["main thread"]


def test_asyncio_tasks_do_not_share_request_chunks():
    async def task(i: int) -> list[str]:
        adapters.register_chunks([f"task {i}"])
        await asyncio.sleep(0.01)
        return [c.text for c in adapters.current_chunks()]

    async def main():
        return await asyncio.gather(task(0), task(1))

    assert asyncio.run(main()) == [["task 0"], ["task 1"]]


def test_recent_table_and_resolve():
    adapters.register_chunks(["alpha chunk", "beta chunk"])
    adapters.clear_chunks()
    prompt = "intro alpha chunk outro"
    assert [c.text for c in adapters.recent.found_in(prompt)] == ["alpha chunk"]
    assert adapters.resolve_chunks(prompt) == ()
    assert [c.text for c in adapters.resolve_chunks(prompt, use_recent=True)] == ["alpha chunk"]
    assert [c.text for c in adapters.resolve_chunks(prompt, ["explicit"], use_recent=True)] == ["explicit"]
    adapters.register_chunks(["gamma chunk", "alpha chunk"])
    got = adapters.resolve_chunks(prompt, use_recent=True)
    assert [c.text for c in got] == ["gamma chunk", "alpha chunk"]
    assert [c.text for c in adapters.resolve_chunks(prompt, use_recent=True, only_found=True)] == ["alpha chunk"]


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=40), min_size=0, max_size=150),
       prompt=st.text(alphabet="ab c\n", max_size=300), cap=st.integers(1, 200), readd=st.integers(0, 20))
def test_a_large_tables_indexed_lookup_finds_what_a_search_per_text_finds(texts: list[str], prompt: str, cap: int,
                                                                           readd: int) -> None:
    """Past SCAN_BELOW texts the table is looked up through its prefix index: the same texts, most recent first,
    as searching the prompt for each text (what a small table does), through additions, re-additions and
    evictions."""
    r = RecentChunks(max_entries=cap, max_chars=10_000)
    r.add(texts)
    r.add(texts[:readd])  # re-registered: most recent again
    prompt = prompt + "".join(texts[::7])  # some texts certainly in it
    got = [c.text for c in r.found_in(prompt)]
    naive = [t for t in reversed(r._items) if t in prompt]
    assert got == naive


def test_a_large_table_is_looked_up_once_per_prompt_position() -> None:
    r = RecentChunks(max_entries=100_000, max_chars=10**9)
    r.add([f"\n\nPassage number {i} about something." for i in range(20_000)])
    prompt = "Context:\n\nPassage number 17 about something.\n\nPassage number 19999 about something.\n\nQ?"
    assert [c.text for c in r.found_in(prompt)] == ["\n\nPassage number 19999 about something.",
                                                    "\n\nPassage number 17 about something."]
    r.clear()
    assert r.found_in(prompt) == () and len(r) == 0


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
        with adapters.chunk_scope(["ctx"]):
            items = [x async for x in adapters.aiter_in_thread(gen)]
            texts = [x async for x in adapters.aiter_in_thread(lambda: iter([c.text for c in adapters.current_chunks()]))]
        return items, texts

    items, texts = asyncio.run(main())
    assert [i for i, _ in items] == list(range(5))
    assert len({t for _, t in items}) == 1
    assert texts == ["ctx"]

    def boom():
        yield 1
        raise ValueError("bad")

    async def fail():
        return [x async for x in adapters.aiter_in_thread(boom)]

    with pytest.raises(ValueError, match="bad"):
        asyncio.run(fail())


def test_ensure_chunks_computes_once():
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore
    from kvrag_testing.tiny import tiny_model

    eng = KVRAGEngine(tiny_model("llama"), MemoryStore())
    first = adapters.ensure_chunks(eng, ["Paris is in France.", "  ", "Berlin is in Germany."])
    assert first[1] == (None, False)
    assert [c for _, c in (first[0], first[2])] == [False, False]
    again = adapters.ensure_chunks(eng, ["Paris is in France.", "Berlin is in Germany."])
    assert [r for r, _ in again] == [first[0][0], first[2][0]] and all(c for _, c in again)
    assert eng.store.stats()["entries"] == 2


def test_generation_config_mapping():
    greedy = adapters.generation_config(max_new_tokens="8", temperature=0, top_p=1.0, top_k=0, seed=None, stop=None)
    assert (greedy.max_new_tokens, greedy.do_sample, greedy.temperature, greedy.stop) == (8, False, 1.0, ())
    sampled = adapters.generation_config(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n"])
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed, sampled.stop) == (
        True, 0.7, 0.9, 5, 3, ("\n",))


def test_one_chat_renderer_and_its_fallback():
    """Engine, adapters, RagTemplate and the preamble render through one function, with one no-template fallback."""
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.prompting import RagTemplate, chat_preamble, render_chat
    from kvrag.store.memory import MemoryStore
    from kvrag_testing.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": "S"}, {"role": "human", "content": "U"}]
    assert render_chat(tok, msgs) == tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False,
        add_generation_prompt=True)
    plain = tiny_tokenizer(chat_template=None)
    assert render_chat(plain, msgs) == "<|endoftext|>system: S\nuser: U\nassistant: "
    assert render_chat(plain, msgs, add_generation_prompt=False) == "<|endoftext|>system: S\nuser: U"
    assert chat_preamble(plain) == "<|endoftext|>user: "
    prefix, _, suffix = RagTemplate().parts(plain, [], "Q?")
    assert prefix.startswith(chat_preamble(plain)) and suffix.endswith("\nassistant: ")
    lm = tiny_model("llama")
    eng = KVRAGEngine(lm, MemoryStore())
    assert eng.chat_prompt("U", system="S") == render_chat(lm.tokenizer, msgs)
    assert eng.template_preamble() == chat_preamble(lm.tokenizer)


def test_response_metadata_from_a_request():
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore
    from kvrag_testing.tiny import tiny_model

    eng = KVRAGEngine(tiny_model("qwen2"), MemoryStore())
    chunk = "\n\nParis is the capital of France."
    prep = eng.prepare(eng.plan(eng.chat_prompt("Context:" + chunk + "\nCapital?"), [chunk]), "stale")
    assert adapters.token_usage(prep) == (prep.plan.total_len, None)  # not streamed yet
    text = "".join(eng.stream(prep, adapters.generation_config(max_new_tokens=3)))
    summary, details = adapters.response_summary(prep), adapters.response_details(prep)
    assert summary["method"] == "stale" and summary["chunks_registered"] == 1 and summary["ttft_s"] > 0
    assert details["chunk_keys"] == prep.chunk_keys and len(details["token_ids"]) == 3 and "token_ids" not in details["stats"]
    assert adapters.token_usage(prep) == (prep.plan.total_len, 3) and isinstance(text, str)
