"""KVCachedLLM against the real default model: LlamaIndex LLM API, chat templates, chunk reuse, equivalences."""

from __future__ import annotations

import asyncio
import threading

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.llms import CustomLLM
from llama_index.llms.kvrag import KVCachedLLM

from kvrag import adapters
from kvrag.errors import ConfigError
from kvrag.fusion import available_methods

N = 8


@pytest.fixture(scope="module")
def llm(engine):
    return KVCachedLLM(engine=engine, method="stale", max_new_tokens=N)


def context_prompt(llm: KVCachedLLM, passages: list[str], question: str) -> str:
    # rendered passages carry their blank line first, so they follow text directly (see kvrag.prompting.render_passage)
    return llm.messages_to_prompt([ChatMessage(role="user", content="Context:" + "".join(passages) + "\n\nQuestion: " + question)])


def test_metadata_and_type(llm, engine):
    assert isinstance(llm, CustomLLM)
    md = llm.metadata
    assert md.context_window == engine.max_context
    assert md.num_output == N
    assert md.is_chat_model is True
    assert md.model_name == engine.loaded.name
    assert KVCachedLLM.class_name() == "KVCachedLLM"


def test_chat_template_from_tokenizer(llm, engine):
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi")]
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert llm.messages_to_prompt(msgs) == expected
    assert llm.completion_to_prompt("Hi") == engine.chat_prompt("Hi")


def test_without_chunks_matches_huggingface_llm(llm, loaded):
    """No registered chunks: the same greedy tokens as llama-index's HuggingFaceLLM on the same model."""
    from llama_index.llms.huggingface import HuggingFaceLLM

    hf = HuggingFaceLLM(model=loaded.model, tokenizer=loaded.tokenizer, max_new_tokens=N, is_chat_model=True,
                        generate_kwargs={"do_sample": False}, tokenizer_outputs_to_remove=["token_type_ids"])
    prompt = llm.completion_to_prompt("Name three colours.")
    with adapters.chunk_scope([]):
        ours = llm.complete(prompt, formatted=True)
    assert ours.additional_kwargs["chunks_registered"] == 0
    assert ours.text == hf.complete(prompt, formatted=True).text


def test_full_matches_engine_full(engine, passages):
    llm = KVCachedLLM(engine=engine, method="full", max_new_tokens=N)
    prompt = context_prompt(llm, passages, "How often does T3 run on weekdays?")
    r = llm.complete(prompt, formatted=True, chunks=passages)
    ref = engine.answer(prompt, passages, "full", max_new_tokens=N)
    assert r.raw["token_ids"] == ref.token_ids
    assert r.text == ref.text
    # every chunk is located in the prompt, but full prefill reads no cache, so nothing counts as a hit
    assert r.additional_kwargs["chunks_found"] == 3 and r.additional_kwargs["hit_rate"] == 0.0


def test_registered_chunks_are_reused(llm, passages):
    prompt = context_prompt(llm, passages, "How much is a day pass?")
    with adapters.chunk_scope(passages):
        r = llm.complete(prompt, formatted=True)
    kw = r.additional_kwargs
    assert kw["chunks_registered"] == kw["chunks_found"] == kw["chunk_hits"] == 3
    assert kw["hit_rate"] == 1.0
    assert kw["ttft_s"] > 0 and kw["method"] == "stale"
    assert kw["reused_tokens"] > 0
    assert len(r.raw["chunk_keys"]) == 3
    assert llm.last_info["prompt"] == prompt
    # outside the scope (nothing left registered in this thread) without the content lookup it is a plain prefill
    adapters.clear_chunks()
    r2 = llm.complete(prompt, formatted=True, use_recent_chunks=False)
    assert r2.additional_kwargs["chunks_registered"] == 0


def test_unfound_chunk_lowers_hit_rate(llm, passages):
    prompt = context_prompt(llm, passages[:2], "How much is a day pass?")
    r = llm.complete(prompt, formatted=True, chunks=passages)
    assert r.additional_kwargs["chunks_registered"] == 3
    assert r.additional_kwargs["chunks_found"] == 2
    assert r.additional_kwargs["hit_rate"] == pytest.approx(2 / 3)


def test_stream_complete_equals_complete(llm, passages):
    prompt = context_prompt(llm, passages, "When does the ferry leave?")
    full = llm.complete(prompt, formatted=True, chunks=passages)
    parts = list(llm.stream_complete(prompt, formatted=True, chunks=passages))
    assert "".join(p.delta or "" for p in parts) == full.text
    assert parts[-1].text == full.text
    assert parts[-1].additional_kwargs["hit_rate"] == 1.0
    assert parts[-1].raw["token_ids"] == full.raw["token_ids"]


def test_chat_and_stream_chat(llm):
    msgs = [ChatMessage(role="user", content="Say hello.")]
    r = llm.chat(msgs)
    assert r.message.role.value == "assistant" and r.message.content
    assert "ttft_s" in r.message.additional_kwargs
    deltas = [x.delta for x in llm.stream_chat(msgs)]
    assert "".join(d or "" for d in deltas) == r.message.content


def test_async_forms(llm, passages):
    prompt = context_prompt(llm, passages, "How much is a day pass?")
    ref = llm.complete(prompt, formatted=True, chunks=passages).text

    async def run():
        with adapters.chunk_scope(passages):  # the task's context is inherited by the worker thread
            a = await llm.acomplete(prompt, formatted=True)
            s = [r async for r in await llm.astream_complete(prompt, formatted=True)]
        c = await llm.achat([ChatMessage(role="user", content="Say hello.")])
        sc = [r async for r in await llm.astream_chat([ChatMessage(role="user", content="Say hello.")])]
        return a, s, c, sc

    a, s, c, sc = asyncio.run(run())
    assert a.text == ref and a.additional_kwargs["hit_rate"] == 1.0
    assert "".join(r.delta or "" for r in s) == ref
    assert sc[-1].message.content == c.message.content


def test_threads_keep_their_own_chunks(llm, passages):
    results: dict[int, dict] = {}

    def worker(i: int) -> None:
        mine = [passages[i]]
        with adapters.chunk_scope(mine):
            prompt = context_prompt(llm, passages, f"Question {i}?")
            llm.complete(prompt, formatted=True)
            results[i] = llm.last_info

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert results[i]["chunks"] == [passages[i]]
        assert results[i]["additional_kwargs"]["chunks_registered"] == 1


def test_method_params_and_errors(engine, passages):
    with pytest.raises(ConfigError, match="valid methods"):
        KVCachedLLM(engine=engine, method="nope")
    if "relaxkv" in available_methods():
        llm = KVCachedLLM(engine=engine, method="relaxkv", max_new_tokens=4)
        r = llm.complete(context_prompt(llm, passages, "Day pass?"), formatted=True, chunks=passages)
        assert r.additional_kwargs["method"].startswith("relaxkv")
        assert r.additional_kwargs["hit_rate"] == 1.0


def test_lazy_engine_is_shared(engine):
    """Without an engine, the LLM loads (once per process) the engine for its model_name and store."""
    lazy = KVCachedLLM(max_new_tokens=2)
    assert lazy.engine is adapters.shared_engine(None, "memory://") is engine
