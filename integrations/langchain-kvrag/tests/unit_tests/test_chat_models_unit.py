"""ChatKVCached on a tiny random model: settings validation and the request path, in seconds."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_kvrag import ChatKVCached
from pydantic import ValidationError

from kvrag.adapters import chunk_scope

CHUNKS = ["\n\nA day pass costs 9 marks.", "\n\nTram T2 runs every 6 minutes."]


def prompt(chunks: list[str], question: str) -> list[HumanMessage]:
    return [HumanMessage("Context:" + "".join(chunks) + "\n\nQuestion: " + question)]


def test_misspelled_setting_is_an_error(engine) -> None:
    with pytest.raises(ValidationError, match="max_tokns"):
        ChatKVCached(engine=engine, max_tokns=4)
    with pytest.raises(ValidationError, match="temprature"):
        ChatKVCached(model="smollm2-135m-instruct", temprature=0.5)
    # the documented aliases and field names are still accepted
    llm = ChatKVCached(engine=engine, max_new_tokens=3, stop_sequences=["\n"], method="full")
    assert (llm.max_tokens, llm.stop, llm.method) == (3, ["\n"], "full")
    assert ChatKVCached(engine=engine, max_tokens=5, stop=["x"]).max_tokens == 5


def test_unknown_method_lists_the_valid_ones(engine) -> None:
    from kvrag.errors import ConfigError

    with pytest.raises(ConfigError, match="valid methods"):
        ChatKVCached(engine=engine, method="nope")


def test_cached_chunks_are_reused_and_full_matches_the_engine(engine) -> None:
    engine.ingest(CHUNKS)
    msgs = prompt(CHUNKS, "How much is a day pass?")
    stale = ChatKVCached(engine=engine, max_tokens=4).invoke(msgs, chunks=CHUNKS)
    kv = stale.response_metadata["kvrag"]
    assert kv["chunks_registered"] == kv["chunks_found"] == kv["chunk_hits"] == 2 and kv["hit_rate"] == 1.0
    assert stale.usage_metadata["input_tokens"] > 0 and 0 < stale.usage_metadata["output_tokens"] <= 4
    llm = ChatKVCached(engine=engine, method="full", max_tokens=4)
    full = llm.invoke(msgs, chunks=CHUNKS)
    ref = engine.answer(llm.history[-1]["prompt"], CHUNKS, "full", max_new_tokens=4)
    assert full.response_metadata["kvrag"]["token_ids"] == ref.token_ids and full.content == ref.text


def test_stream_equals_invoke_and_chunk_scope_registers(engine) -> None:
    engine.ingest(CHUNKS)
    llm = ChatKVCached(engine=engine, max_tokens=5, use_recent_chunks=False)
    msgs = prompt(CHUNKS, "How often does T2 run?")
    with chunk_scope(CHUNKS):
        whole = llm.invoke(msgs)
        parts = list(llm.stream(msgs))
    assert all(isinstance(p, AIMessageChunk) for p in parts)
    assert "".join(str(p.content) for p in parts) == whole.content
    assert whole.response_metadata["kvrag"]["hit_rate"] == 1.0
    with chunk_scope([]):  # nothing registered and no recent lookup: a plain prefill
        plain = llm.invoke(msgs)
    assert plain.response_metadata["kvrag"]["chunks_registered"] == 0


def test_reuse_history_offers_the_earlier_messages_as_segments(engine) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_kvrag import ChatKVCached

    from kvrag.prompting import render_passage

    passages = [render_passage("Tram line T3 runs every 7 minutes on weekdays.", "Trams")]

    model = ChatKVCached(engine=engine, max_new_tokens=4, reuse_history=True)
    msgs = [SystemMessage("Answer." + passages[0]), HumanMessage("How often does T3 run?"),
            AIMessage("Every 7 minutes on weekdays."), HumanMessage("And on Sundays?")]
    kv = model.invoke(msgs, chunks=[passages[0]]).response_metadata["kvrag"]
    assert kv["chunks_registered"] == 3 and kv["chunks_found"] == 3
    kv = model.invoke(msgs, chunks=[passages[0]], reuse_history=False).response_metadata["kvrag"]
    assert kv["chunks_registered"] == 1
