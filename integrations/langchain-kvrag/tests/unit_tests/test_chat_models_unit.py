"""ChatKVCached on a tiny random model: settings validation and the request path, in seconds."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_kvrag import ChatKVCached
from pydantic import ValidationError

from kvrag import adapters
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


def test_streamed_answers_in_the_history_are_the_messages_they_stand_for(engine) -> None:
    """RunnableWithMessageHistory over .stream() keeps an AIMessageChunk (the sum of the streamed pieces) as the
    assistant's turn: it is that turn, as ChatOpenAI and ChatHuggingFace take it."""
    from langchain_core.messages import AIMessage, HumanMessageChunk, SystemMessageChunk
    from langchain_kvrag.chat_models import messages_to_dicts

    llm = ChatKVCached(engine=engine, max_tokens=3)
    streamed = sum(llm.stream([HumanMessage("Hi")]), AIMessageChunk(content=""))
    turns = [SystemMessageChunk(content="Be brief."), HumanMessageChunk(content="Hi"), streamed, HumanMessage("And?")]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": str(streamed.content)}, {"role": "user", "content": "And?"}]
    assert messages_to_dicts(turns) == plain
    assert isinstance(llm.invoke(turns), AIMessage)


def test_counting_no_messages_is_zero_so_trim_messages_works(engine) -> None:
    from langchain_core.messages import trim_messages

    llm = ChatKVCached(engine=engine, max_tokens=3)
    assert llm.get_num_tokens_from_messages([]) == 0
    msgs = [HumanMessage("first question " * 20), AIMessageChunk(content="an answer"), HumanMessage("second?")]
    kept = trim_messages(msgs, token_counter=llm, max_tokens=40, strategy="last", allow_partial=True)
    assert kept and kept[-1].content == "second?"


def test_one_text_or_the_retrievers_documents_as_chunks(engine) -> None:
    from langchain_core.documents import Document

    engine.ingest(CHUNKS)
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=3, use_recent_chunks=False)
    msgs = prompt(CHUNKS, "How much is a day pass?")
    one = llm.invoke(msgs, chunks=CHUNKS[0]).response_metadata["kvrag"]  # one chunk, not its characters
    assert one["chunks_registered"] == one["chunk_hits"] == 1, one
    docs = [Document(page_content=c) for c in CHUNKS]  # their stripped text is what the prompt holds
    kv = llm.invoke(msgs, chunks=docs).response_metadata["kvrag"]
    assert kv["chunks_registered"] == kv["chunks_found"] == 2, kv


def test_a_calls_none_keeps_the_models_setting(engine) -> None:
    llm = ChatKVCached(engine=engine, max_tokens=3, temperature=0.0)
    out = llm.invoke(prompt(CHUNKS, "Fare?"), max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None)
    assert 0 < out.usage_metadata["output_tokens"] <= 3


def test_the_engines_method_is_the_default_and_reuse_is_in_usage() -> None:
    from kvrag_testing.tiny import tiny_engine

    eng = tiny_engine("qwen2", method="stale")  # EngineConfig.method: what the chat model runs unless told
    llm = ChatKVCached(engine=eng, max_tokens=3)
    eng.ingest(CHUNKS)
    out = llm.invoke(prompt(CHUNKS, "Fare?"), chunks=CHUNKS)
    kv = out.response_metadata["kvrag"]
    assert kv["method"] == "stale", kv["method"]
    assert out.usage_metadata["input_token_details"]["cache_read"] == kv["reused_tokens"] > 0


def test_max_tokens_past_the_window_is_cut_to_what_is_left(engine) -> None:
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=10**6)
    out = llm.invoke(prompt(CHUNKS, "Fare?"))
    left = engine.max_positions - out.usage_metadata["input_tokens"]
    assert 0 < out.usage_metadata["output_tokens"] <= left


def test_short_recent_texts_are_not_spliced_into_other_prompts(engine) -> None:
    """The process-wide table of retrieved texts found "Hello" or a template line in unrelated chats and spliced
    its stale cache there; a text found by content alone is reused only when passage-sized."""
    from kvrag import adapters

    engine.ingest(["Hello", "Question:"])
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=3)
    try:
        adapters.recent.add(["Hello", "Question:"])
        kv = llm.invoke([HumanMessage("Hello there. Question: what is on today?")]).response_metadata["kvrag"]
        assert kv["chunks_registered"] == kv["chunk_hits"] == 0, kv
    finally:
        adapters.recent.clear()


def test_copies_share_the_engine_and_pickling_says_what_to_do(engine) -> None:
    import copy

    llm = ChatKVCached(engine=engine, max_tokens=3)
    assert copy.deepcopy(llm).engine is engine
    with pytest.raises(TypeError, match="cannot be pickled"):
        llm.__reduce_ex__(4)  # what pickle.dumps calls


def test_a_retriever_called_on_its_own_splices_no_short_text_into_later_chats(engine) -> None:
    """retriever.invoke(...) (to look at what it returns) registers in the caller's thread, which delimits no
    request: its short texts were then spliced into the thread's later chats, changing their answers."""
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=3)
    engine.ingest(["Hello"])
    token = adapters.register_chunks(["Hello"])  # what KVCacheRetriever.invoke leaves in this thread
    try:
        kv = llm.invoke([HumanMessage("Hello")]).response_metadata["kvrag"]
        assert kv["chunks_registered"] == kv["chunk_hits"] == 0, kv
    finally:
        adapters.reset_chunks(token)
