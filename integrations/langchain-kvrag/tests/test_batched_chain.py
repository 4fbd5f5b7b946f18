"""Concurrent LCEL calls (``batch``, ``abatch``, ``astream``) share the engine's decode batch with no change to the
chain, and answer as sequential calls do (a tiny random model: no download, runs in seconds)."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_kvrag import ChatKVCached

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
             "Answer in one sentence.", "Which city has museums?", "What is large?"]
PROMPT = ChatPromptTemplate.from_template("Answer using this context:{context}\n\nQuestion: {question}")


@pytest.fixture(scope="module")
def engine() -> KVRAGEngine:
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    return eng


@pytest.fixture(scope="module")
def chain(engine: KVRAGEngine):
    llm = ChatKVCached(engine=engine, max_tokens=16).bind(chunks=DOCS)
    return {"context": lambda _: "".join(DOCS), "question": lambda q: q} | PROMPT | llm | StrOutputParser()


def _shared(engine: KVRAGEngine, run):
    """Run ``run()``; whether some decode step served more than one request meanwhile, and its result."""
    before = engine.batcher.stats()
    out = run()
    after = engine.batcher.stats()
    return after["rows_stepped"] - before["rows_stepped"] > after["steps"] - before["steps"], out


def test_batch_abatch_and_astream_share_steps_and_equal_sequential(engine, chain) -> None:
    sequential = [chain.invoke(q) for q in QUESTIONS]
    assert len(set(sequential)) > 1

    shared, got = _shared(engine, lambda: chain.batch(QUESTIONS, config={"max_concurrency": len(QUESTIONS)}))
    assert got == sequential and shared

    shared, got = _shared(engine, lambda: asyncio.run(chain.abatch(QUESTIONS)))
    assert got == sequential and shared

    async def streams() -> list[str]:
        async def one(q: str) -> str:
            return "".join([part async for part in chain.astream(q)])

        return list(await asyncio.gather(*(one(q) for q in QUESTIONS)))

    shared, got = _shared(engine, lambda: asyncio.run(streams()))
    assert got == sequential and shared
    assert engine.batcher.stats()["kv"]["leases"] == 0
