"""Fixtures: a tiny random model wrapped into an engine, and an in-memory vector store with deterministic fake
embeddings (no real model, no download: the whole LangChain request path in seconds)."""

from __future__ import annotations

import pytest

DOCS = [
    "A day pass costs 9 marks and is valid until 4:00 the next morning.",
    "Tram line T2 runs every 6 minutes at peak times and every 10 minutes otherwise.",
    "The ferry to Tamsin Isle leaves at 9:00, 11:30, 14:00 and 16:30 in summer.",
    "Night bus N2 runs from the harbour to Brannock every 30 minutes after midnight.",
]


@pytest.fixture(scope="module")
def engine():
    from kvrag_testing.tiny import tiny_engine

    return tiny_engine("qwen2")


@pytest.fixture(scope="module")
def vectorstore():
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=32))
    store.add_documents([Document(page_content=t, metadata={"source": f"doc{i}"}) for i, t in enumerate(DOCS)])
    return store
