"""A stock LlamaIndex query engine answering concurrent ``aquery`` calls: the engine decodes them in shared steps
with no change to the query engine, and each answer equals the sequential one."""

from __future__ import annotations

import asyncio

from llama_index.llms.kvrag import KVCachedLLM
from llama_index.postprocessor.kvrag import KVCachePostprocessor

QUESTIONS = ["How much does a day pass cost?", "How often does tram line T2 run?", "When does the ferry leave?",
             "Which tram line is the oldest?", "Answer in one sentence.", "What is a single ticket?"]


def test_concurrent_aquery_shares_steps_and_equals_sequential(engine, index) -> None:
    llm = KVCachedLLM(engine=engine, method="stale", max_new_tokens=16)  # batching under test, not the method
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    sequential = [str(qe.query(q)) for q in QUESTIONS]
    assert len(set(sequential)) > 1
    assert all(h["additional_kwargs"]["chunk_hits"] == 2 for h in llm.history[-len(QUESTIONS):])

    async def run() -> list[str]:
        return [str(r) for r in await asyncio.gather(*(qe.aquery(q) for q in QUESTIONS))]

    before = engine.batcher.stats()
    got = asyncio.run(run())
    after = engine.batcher.stats()
    assert got == sequential
    assert after["max_rows"] > 1
    assert after["rows_stepped"] - before["rows_stepped"] > after["steps"] - before["steps"]
