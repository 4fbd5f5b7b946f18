"""A stock LlamaIndex query engine answering concurrent ``aquery`` calls: the engine decodes them in shared steps
with no change to the query engine, and each answer equals the sequential one (a tiny random model and a mock
embedding: no download, runs in seconds)."""

from __future__ import annotations

import asyncio

from llama_index.core import VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from llama_index.llms.kvrag import KVCachedLLM
from llama_index.postprocessor.kvrag import KVCachePostprocessor

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.store import MemoryStore
from kvrag.testing.tiny import tiny_model

TEXTS = ["Paris is the capital of France. The city has many museums.",
         "Berlin is the capital of Germany. It is a large city.",
         "The quick brown fox jumps over the lazy dog.",
         "Rotary position embeddings rotate queries and keys by position."]
QUESTIONS = ["What is the capital of France?", "Who jumps over the dog?", "What rotates the keys?",
             "What is the capital of Germany?", "Answer in one sentence.", "Which city is large?"]


def test_concurrent_aquery_shares_steps_and_equals_sequential() -> None:
    engine = KVRAGEngine(tiny_model("qwen3", init_std=0.1), MemoryStore(), EngineConfig())
    llm = KVCachedLLM(engine=engine, max_new_tokens=16)
    index = VectorStoreIndex([TextNode(text=t) for t in TEXTS], embed_model=MockEmbedding(embed_dim=8))
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
