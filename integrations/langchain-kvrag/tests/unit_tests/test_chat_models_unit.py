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


def test_model_name_with_an_engine_counts_tokens_and_names_what_it_does_not_do(engine) -> None:
    """``model_name`` is the documented field; token counting uses the model's tokenizer (LangChain's fallback,
    GPT-2's, counts 0 offline, so ``trim_messages(token_counter=llm)`` trimmed nothing); tools get a clear error."""
    from langchain_core.messages import AIMessage, SystemMessage, trim_messages

    llm = ChatKVCached(engine=engine, model_name="my-label", max_tokens=4)
    assert llm.model_name == "my-label" and llm.engine is engine
    text = "How much is a day pass?"
    assert llm.get_num_tokens(text) == len(engine.tokenizer.encode(text, add_special_tokens=False)) > 0
    msgs = [SystemMessage("Be brief."), HumanMessage("word " * 30), AIMessage("ok " * 30), HumanMessage(text)]
    assert llm.get_num_tokens_from_messages(msgs) == len(engine.tokenizer.encode(llm.render(msgs),
                                                                                 add_special_tokens=False))
    kept = trim_messages(msgs, max_tokens=llm.get_num_tokens_from_messages(msgs[-1:]) + 20, token_counter=llm,
                         strategy="last", include_system=False)
    assert kept == msgs[-1:]
    with pytest.raises(NotImplementedError, match="does not support tool calling"):
        llm.bind_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_per_call_max_completion_tokens_and_unknown_options(engine) -> None:
    llm = ChatKVCached(engine=engine, max_tokens=12)
    msgs = prompt(CHUNKS, "How much is a day pass?")
    assert llm.invoke(msgs, max_completion_tokens=2).usage_metadata["output_tokens"] <= 2
    with pytest.warns(UserWarning, match=r"ignores unknown call options \['bogus_kw'\]"):
        llm.invoke(msgs, bogus_kw=1, max_tokens=1)


def test_one_stop_string_is_one_stop_string(engine) -> None:
    llm = ChatKVCached(engine=engine, max_tokens=12)
    msgs = prompt(CHUNKS, "How often does T2 run?")
    text = str(llm.invoke(msgs).content)
    # a pair first seen at i, one of whose characters occurs before i: cut at its characters, the answer ends sooner
    cut = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() and text[i:i + 2] not in
                text[:i + 1] and (text[i] in text[:i] or text[i + 1] in text[:i])), None)
    assert cut is not None, text
    assert llm.invoke(msgs, stop=cut).content == text.split(cut)[0]  # not cut at its first character
    assert llm.bind(stop=[cut]).invoke(msgs).content == text.split(cut)[0]


def test_configurable_fields_keep_the_engine(engine) -> None:
    """LangChain rebuilds a configurable model from its fields: the engine passed in must come along, not a second
    model loaded by name over an empty in-memory store."""
    from langchain_core.runnables import ConfigurableField

    from kvrag import adapters

    loaded = dict(adapters._ENGINES)
    llm = ChatKVCached(engine=engine, max_tokens=3).configurable_fields(
        max_tokens=ConfigurableField(id="n", name="max tokens"))
    out = llm.with_config(configurable={"n": 2}).invoke(prompt(CHUNKS, "Fare?"))
    assert out.usage_metadata["output_tokens"] <= 2
    assert adapters._ENGINES == loaded


def test_a_recent_chunk_inside_a_question_is_never_spliced_with_its_own_ids(engine) -> None:
    from kvrag import adapters

    short = "last ferry"  # a retrieved text that also occurs in a later question, across the tokenizer's merges
    question = "When does the last ferry leave?"
    doc = "\n\nThe ferry to Tamsin Isle leaves at 9:00 in summer."
    engine.ingest([short, doc])
    llm = ChatKVCached(engine=engine, max_tokens=3)
    try:
        adapters.recent.add([short, doc])
        got = llm.invoke([HumanMessage(question)])
        kv = got.response_metadata["kvrag"]
        assert kv["chunks_registered"] == kv["chunks_found"] == kv["chunk_hits"] == 0
        prompt = llm.history[-1]["prompt"]
        assert kv["token_ids"] == engine.answer(prompt, [], "stale", max_new_tokens=3).token_ids
        # the same text passed explicitly is the caller's choice: spliced with its own ids, reported inexact
        plan = engine.plan(prompt, [short])
        assert (plan.found, plan.inexact_chunks) == (1, 1)
        # a chunk found by content whose ids occur in the prompt's tokenization is reused as before
        hit = llm.invoke([HumanMessage("Context:" + doc + "\n\nQuestion: " + question)])
        kv = hit.response_metadata["kvrag"]
        assert kv["chunks_registered"] == kv["chunk_hits"] == 1 and kv["hit_rate"] == 1.0
    finally:
        adapters.recent.clear()


def test_the_llm_cache_key_names_every_setting_that_changes_the_answer(engine) -> None:
    base = ChatKVCached(engine=engine, temperature=1.0, seed=1)
    for other in ({"seed": 2}, {"stop": ["\n"]}, {"use_recent_chunks": False}, {"reuse_history": True}):
        changed = ChatKVCached(engine=engine, temperature=1.0, **{"seed": 1, **other})
        assert changed._get_llm_string() != base._get_llm_string(), other
