"""Concurrent LlamaIndex calls (``achat``, ``acomplete``, ``astream_chat``) share the engine's decode batch and
answer as sequential calls do (a tiny random model: no download, runs in seconds)."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.llms.kvrag import KVCachedLLM

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.prompting import render_passage
from kvrag.store import MemoryStore
from kvrag.testing.tiny import tiny_model

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
]
QUESTIONS = ["What is the capital of France?", "Who jumps over the dog?", "What is the capital of Germany?",
             "Answer in one sentence.", "Which city has museums?", "What is large?", "Who is lazy?", "Name a city."]


@pytest.fixture(scope="module")
def llm() -> KVCachedLLM:
    eng = KVRAGEngine(tiny_model("llama", init_std=0.1), MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    return KVCachedLLM(engine=eng, max_new_tokens=16)


def _messages(q: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content="Context:" + "".join(DOCS) + "\n\nQuestion: " + q)]


def test_concurrent_async_calls_share_steps_and_equal_sequential(llm: KVCachedLLM) -> None:
    stats = llm.engine.batcher.stats
    sequential = [llm.chat(_messages(q), chunks=DOCS).message.content for q in QUESTIONS]
    assert len(set(sequential)) > 1

    async def run() -> tuple[list[str], list[str], list[str]]:
        chats = await asyncio.gather(*(llm.achat(_messages(q), chunks=DOCS) for q in QUESTIONS))
        prompts = [llm.messages_to_prompt(_messages(q)) for q in QUESTIONS]
        completions = await asyncio.gather(*(llm.acomplete(p, formatted=True, chunks=DOCS) for p in prompts))

        async def stream(q: str) -> str:
            text = ""
            async for r in await llm.astream_chat(_messages(q), chunks=DOCS):
                text = r.message.content
            return text

        streamed = await asyncio.gather(*(stream(q) for q in QUESTIONS))
        return [c.message.content for c in chats], [c.text for c in completions], list(streamed)

    before = stats()
    chats, completions, streamed = asyncio.run(run())
    after = stats()
    assert chats == completions == streamed == sequential
    assert after["max_rows"] > 1  # eight concurrent callers decoded in shared steps
    assert after["rows_stepped"] - before["rows_stepped"] > after["steps"] - before["steps"]
