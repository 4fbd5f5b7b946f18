"""KVCachedLLM on a tiny random model: the LlamaIndex LLM API, chunk reuse and the engine's tokens, in seconds."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.llms import CustomLLM
from llama_index.llms.kvrag import KVCachedLLM

from kvrag import adapters
from kvrag.errors import ConfigError

N = 4


def context_prompt(llm: KVCachedLLM, passages: list[str], question: str) -> str:
    return llm.messages_to_prompt([ChatMessage(role="user", content="Context:" + "".join(passages)
                                               + "\n\nQuestion: " + question)])


def test_metadata_and_chat_template(engine) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    assert isinstance(llm, CustomLLM) and KVCachedLLM.class_name() == "KVCachedLLM"
    md = llm.metadata
    assert (md.context_window, md.num_output, md.model_name, md.is_chat_model) == (
        engine.max_context, N, engine.loaded.name, True)
    expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert llm.messages_to_prompt([ChatMessage(role="user", content="Hi")]) == expected


def test_a_max_new_tokens_past_the_window_leaves_room_to_pack_prompts(engine) -> None:
    """num_output was max_new_tokens as given: 100000 made LlamaIndex's prompt packing fail in every query engine
    ("Calculated available context size -91911 was not non-negative")."""
    from llama_index.core.indices.prompt_helper import PromptHelper

    llm = KVCachedLLM(engine=engine, max_new_tokens=100_000)
    md = llm.metadata
    assert md.num_output == engine.max_context // 2
    helper = PromptHelper.from_llm_metadata(md)
    assert helper.context_window - helper.num_output > 0


def test_registered_chunks_are_reused_and_full_matches_the_engine(engine, passages) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    prompt = context_prompt(llm, passages, "How much is a day pass?")
    with adapters.chunk_scope(passages):
        r = llm.complete(prompt, formatted=True)
    kw = r.additional_kwargs
    assert kw["chunks_registered"] == kw["chunks_found"] == kw["chunk_hits"] == 3 and kw["hit_rate"] == 1.0
    full = KVCachedLLM(engine=engine, method="full", max_new_tokens=N).complete(prompt, formatted=True,
                                                                               chunks=passages)
    ref = engine.answer(prompt, passages, "full", max_new_tokens=N)
    assert full.raw["token_ids"] == ref.token_ids and full.text == ref.text
    adapters.clear_chunks()
    assert llm.complete(prompt, formatted=True, use_recent_chunks=False).additional_kwargs["chunks_registered"] == 0
    # nothing registered in this context: the passages registered before are found in the prompt by content
    again = llm.complete(prompt, formatted=True).additional_kwargs
    assert again["chunks_registered"] == again["chunk_hits"] == 3


def test_stream_and_async_equal_complete(engine, passages) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    prompt = context_prompt(llm, passages, "When does the ferry leave?")
    ref = llm.complete(prompt, formatted=True, chunks=passages)
    parts = list(llm.stream_complete(prompt, formatted=True, chunks=passages))
    assert "".join(p.delta or "" for p in parts) == ref.text and parts[-1].raw["token_ids"] == ref.raw["token_ids"]

    async def run():
        return await llm.acomplete(prompt, formatted=True, chunks=passages)

    assert asyncio.run(run()).text == ref.text
    chat = llm.chat([ChatMessage(role="user", content="Say hello.")])
    assert chat.message.role.value == "assistant" and "ttft_s" in chat.message.additional_kwargs


def test_unknown_method_lists_the_valid_ones(engine) -> None:
    with pytest.raises(ConfigError, match="valid methods"):
        KVCachedLLM(engine=engine, method="nope")


def test_reuse_history_offers_the_earlier_messages_as_segments(engine, passages) -> None:
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.llms.kvrag import KVCachedLLM

    llm = KVCachedLLM(engine=engine, max_new_tokens=4, reuse_history=True)
    msgs = [ChatMessage(role="system", content="Answer." + passages[0]),
            ChatMessage(role="user", content="How often does T3 run?"),
            ChatMessage(role="assistant", content="Every 7 minutes on weekdays."),
            ChatMessage(role="user", content="And on Sundays?")]
    llm.chat(msgs, chunks=[passages[0]])
    kw = llm.last_info["additional_kwargs"]
    assert kw["chunks_registered"] == 3 and kw["chunks_found"] == 3
    llm.chat(msgs, chunks=[passages[0]], reuse_history=False)
    assert llm.last_info["additional_kwargs"]["chunks_registered"] == 1


def test_repr_pickle_and_copy_of_the_llm(engine) -> None:
    """Showing the LLM (a notebook cell, a log line, a pydantic error) printed it through its own default prompt
    functions, bound to it: endless recursion; pickling it (LlamaIndex's __getstate__, what pickle calls) deleted
    fields of the live object; a model_copy kept formatting with the original's system prompt."""
    llm = KVCachedLLM(engine=engine, max_new_tokens=N, system_prompt="Be brief.")
    for show in (repr, str):
        assert "KVCachedLLM" in show(llm) or "max_new_tokens" in show(llm)
    msgs = [ChatMessage(role="user", content="Hi")]
    before = llm.messages_to_prompt(msgs)
    state = llm.__getstate__()
    assert llm.messages_to_prompt(msgs) == before and llm.completion_to_prompt("Hi")  # the live object is intact
    other = llm.model_copy(update={"system_prompt": "Answer in French."})
    assert "Answer in French." in other.completion_to_prompt("Hi") and "Be brief." in llm.completion_to_prompt("Hi")
    again = KVCachedLLM.__new__(KVCachedLLM)
    again.__setstate__(state)  # unpickled: bound to itself; the engine it was given stays behind
    assert again.system_prompt == "Be brief." and again.completion_to_prompt.owner() is again
    with pytest.raises(TypeError, match="engine= again"):  # not a second model over an empty store, unasked
        again.complete("Hi")
    import copy

    assert copy.deepcopy(llm).engine is engine  # a copy shares the loaded model and store


def test_max_tokens_is_max_new_tokens_and_unknown_arguments_are_refused(engine, passages) -> None:
    """``max_tokens`` is what most LlamaIndex LLMs call it; a misspelled argument was dropped without a word."""
    llm = KVCachedLLM(engine=engine, max_tokens=3)
    assert llm.max_new_tokens == 3 and llm.metadata.num_output == 3
    long = KVCachedLLM(engine=engine, max_new_tokens=12)
    assert len(long.complete("Hello", max_tokens=2).raw["token_ids"]) <= 2
    with pytest.raises(TypeError, match=r"'max_new_tokns' \(did you mean 'max_new_tokens'\?\)"):
        KVCachedLLM(engine=engine, max_new_tokns=3)


def test_one_stop_string_is_one_stop_string(engine) -> None:
    """``stop="ab"`` (OpenAI's API takes a string too) stops at "ab", not at every "a" or "b"."""
    llm = KVCachedLLM(engine=engine, max_new_tokens=12)
    text = llm.complete("Hello").text
    # a pair first seen at i, one of whose characters occurs before i: cut at its characters, the answer ends sooner
    cut = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() and text[i:i + 2] not in
                text[:i + 1] and (text[i] in text[:i] or text[i + 1] in text[:i])), None)
    assert cut is not None, text
    assert llm.complete("Hello", stop=cut).text == text.split(cut)[0]
    assert llm.complete("Hello", stop=[cut]).text == text.split(cut)[0]


def test_last_info_is_the_instances_own(engine) -> None:
    """``last_info`` of an LLM never called is None, not another instance's record made in the same thread."""
    used = KVCachedLLM(engine=engine, max_new_tokens=2)
    used.complete("Hello")
    assert used.last_info is not None and KVCachedLLM(engine=engine, max_new_tokens=2).last_info is None



def test_a_request_takes_the_caches_it_uses_from_the_callers_context(engine, passages) -> None:
    """The postprocessor registers the retrieved chunks with their caches (one store round trip); the request made
    of them takes the caches of the chunks in its prompt, so a finished query leaves none held by its thread, and a
    chunk not in this prompt keeps its cache for a later call of the same query (refine)."""
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    held = [c for c, _ in engine.ensure(passages, fetch=True)]
    assert all(c.kv is not None for c in held)
    prompt = context_prompt(llm, passages[:2], "How much is a day pass?")
    with adapters.chunk_scope(held):
        r = llm.complete(prompt, formatted=True)
        left = {c.text: c.kv for c in adapters.current_chunks()}
    assert r.additional_kwargs["chunk_hits"] == 2
    assert left[passages[0]] is None and left[passages[1]] is None and left[passages[2]] is not None
    again = llm.complete(prompt, formatted=True, chunks=passages[:2])
    assert again.raw["token_ids"] == r.raw["token_ids"]  # the same answer from the stored caches


def test_a_registration_ends_at_a_call_that_holds_none_of_its_chunks(engine, passages) -> None:
    """A query's registration outlives it in the thread: a later call that holds none of its chunks (an unrelated
    chat, a workflow after a ``retrieve()`` shown as sources) ends it, so it is neither counted against chunks it
    never asked for nor does it keep that call from finding registered texts by content."""
    llm = KVCachedLLM(engine=engine, max_new_tokens=2)
    token = adapters.register_chunks(passages)  # as a query's postprocessor does, in this thread's context
    try:
        # a refine-like query: one call per chunk; the query's other chunks still count as registered
        first = llm.complete(context_prompt(llm, passages[:1], "Q?"), formatted=True).additional_kwargs
        assert (first["chunks_registered"], first["chunks_found"]) == (len(passages), 1)
        again = llm.complete(context_prompt(llm, passages, "Q?"), formatted=True).additional_kwargs
        assert again["chunks_registered"] == again["chunk_hits"] == len(passages)
        later = llm.complete("Say hello.").additional_kwargs  # holds none: the query is over
        assert later["chunks_registered"] == later["hit_rate"] == 0 and not adapters.current_chunks()
        prompt = context_prompt(llm, passages[:1], "Q?")
        assert llm.complete(prompt, formatted=True, use_recent_chunks=False).additional_kwargs["chunks_registered"] == 0
        found = llm.complete(prompt, formatted=True).additional_kwargs  # by content, as any unregistered prompt
        assert found["chunks_registered"] == found["chunk_hits"] == 1
        # a registration whose chunks no call held (a retrieve() shown as sources) ends the same way
        adapters.register_chunks(passages[1:])
        other = llm.complete(prompt, formatted=True).additional_kwargs
        assert other["chunks_registered"] == other["chunk_hits"] == 1 and not adapters.current_chunks()
    finally:
        adapters.reset_chunks(token)


def test_an_image_block_is_refused_not_dropped(engine) -> None:
    from llama_index.core.base.llms.types import ImageBlock, TextBlock

    llm = KVCachedLLM(engine=engine, max_new_tokens=2)
    msg = ChatMessage(role="user", blocks=[TextBlock(text="What is in this picture?"),
                                           ImageBlock(url="https://example.com/a.png")])
    with pytest.raises(ValueError, match="ImageBlock"):
        llm.chat([msg])


def test_last_info_after_an_awaited_call_is_that_call(engine) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=2)
    llm.chat([ChatMessage(role="user", content="Say hi")])

    async def run() -> list[str]:
        seen = []
        await llm.achat([ChatMessage(role="user", content="What is two plus two?")])
        seen.append(llm.last_info["prompt"])
        await llm.acomplete("Name a colour.")
        seen.append(llm.last_info["prompt"])
        async for _ in await llm.astream_chat([ChatMessage(role="user", content="Count to three.")]):
            pass
        seen.append(llm.last_info["prompt"])
        return seen

    got = asyncio.run(run())
    assert ["two plus two" in got[0], "colour" in got[1], "three" in got[2]] == [True, True, True], got


def test_the_engines_method_is_the_default_and_a_calls_none_keeps_the_setting(passages) -> None:
    from kvrag_testing.tiny import tiny_engine

    eng = tiny_engine("qwen2", method="stale")  # EngineConfig.method: what the LLM runs unless told
    llm = KVCachedLLM(engine=eng, max_new_tokens=N)
    prompt = context_prompt(llm, passages, "How much is a day pass?")
    r = llm.complete(prompt, formatted=True, max_new_tokens=None, max_tokens=None, temperature=None, seed=None)
    assert r.additional_kwargs["method"] == "stale"
    assert 0 < r.additional_kwargs["completion_tokens"] <= N


def test_max_new_tokens_past_the_window_is_cut_to_what_is_left(engine, passages) -> None:
    llm = KVCachedLLM(engine=engine, method="stale", max_new_tokens=10**6)
    r = llm.complete(context_prompt(llm, passages, "Fare?"), formatted=True)
    kw = r.additional_kwargs
    assert 0 < kw["completion_tokens"] <= engine.max_positions - kw["prompt_tokens"]


def test_a_prompt_past_the_window_is_an_error_llamaindex_does_not_swallow(engine) -> None:
    """LlamaIndex's synthesizers catch ValueError (ContextLengthError is one) and answered "Empty Response" or
    dropped chunks without a word when they packed past the window by tiktoken's count."""
    from llama_index.llms.kvrag import PromptTooLongError

    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    with pytest.raises(PromptTooLongError, match="Settings.tokenizer") as err:
        llm.complete("word " * (engine.max_context + 10))
    assert not isinstance(err.value, ValueError)


def test_chat_statistics_are_on_the_response_and_the_message_in_every_path(engine) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    msgs = [ChatMessage(role="user", content="Say hello.")]

    async def both():
        last = None
        async for r in await llm.astream_chat(msgs):
            last = r
        return await llm.achat(msgs), last

    responses = [llm.chat(msgs), list(llm.stream_chat(msgs))[-1], *asyncio.run(both())]
    for r in responses:
        assert r.additional_kwargs["hit_rate"] == r.message.additional_kwargs["hit_rate"]
        assert r.raw["usage"]["completion_tokens"] == r.additional_kwargs["completion_tokens"] > 0
    assert len({r.message.content for r in responses}) == 1


def test_chunks_registered_in_another_step_are_found_by_content(engine, passages) -> None:
    """A workflow's next step, or a stream read in another thread, does not see the registration of the step that
    retrieved: the chunks its prompt holds are found by content."""
    import threading

    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    prompt = context_prompt(llm, passages, "How much is a day pass?")
    with adapters.chunk_scope(passages):
        pass  # registered (and remembered) in this context, which the worker below does not share
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(list(llm.stream_complete(prompt, formatted=True))[-1]
                                                   .additional_kwargs))
    t.start()
    t.join()
    assert out["chunks_registered"] == out["chunk_hits"] == len(passages), out
