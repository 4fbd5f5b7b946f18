"""Concurrent LlamaIndex calls (``achat``, ``acomplete``, ``astream_chat``) share the engine's decode batch and
answer as sequential calls do."""

from __future__ import annotations

import asyncio

from llama_index.core.base.llms.types import ChatMessage
from llama_index.llms.kvrag import KVCachedLLM

QUESTIONS = ["How often does T3 run?", "How much is a day pass?", "When does the ferry leave?",
             "Answer in one sentence.", "What runs on weekdays?", "What costs 9 marks?", "Name a time.", "Why?"]


def test_concurrent_async_calls_share_steps_and_equal_sequential(engine, passages) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=16)

    def messages(q: str) -> list[ChatMessage]:
        return [ChatMessage(role="user", content="Context:" + "".join(passages) + "\n\nQuestion: " + q)]

    sequential = [llm.chat(messages(q), chunks=passages).message.content for q in QUESTIONS]
    assert len(set(sequential)) > 1

    async def run() -> tuple[list[str], list[str], list[str]]:
        chats = await asyncio.gather(*(llm.achat(messages(q), chunks=passages) for q in QUESTIONS))
        prompts = [llm.messages_to_prompt(messages(q)) for q in QUESTIONS]
        completions = await asyncio.gather(*(llm.acomplete(p, formatted=True, chunks=passages) for p in prompts))

        async def stream(q: str) -> str:
            text = ""
            async for r in await llm.astream_chat(messages(q), chunks=passages):
                text = r.message.content
            return text

        streamed = await asyncio.gather(*(stream(q) for q in QUESTIONS))
        return [c.message.content for c in chats], [c.text for c in completions], list(streamed)

    before = engine.batcher.stats()
    chats, completions, streamed = asyncio.run(run())
    after = engine.batcher.stats()
    assert chats == completions == streamed == sequential
    assert after["max_rows"] > 1  # eight concurrent callers decoded in shared steps
    assert after["rows_stepped"] - before["rows_stepped"] > after["steps"] - before["steps"]
