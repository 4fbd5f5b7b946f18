"""Concurrent LCEL calls (``batch``, ``abatch``, ``astream``) through the stock RAG chain share the engine's decode
batch with no change to the chain, and answer as sequential calls do."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_kvrag import ChatKVCached, KVCacheRetriever, format_docs

QUESTIONS = ["How much is a day pass?", "How often does T2 run?", "When does the ferry leave?",
             "Where does N2 go?", "What is valid until 4:00?", "What runs every 30 minutes?"]
PROMPT = ChatPromptTemplate.from_template("Answer the question using only this context:\n\n{context}\n\n"
                                          "Question: {question}")


@pytest.fixture(scope="module")
def chain(engine, vectorstore):
    retriever = KVCacheRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), engine=engine)
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=16)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm | StrOutputParser()


def _shared(engine, run):
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
