"""Fixtures: a tiny random model wrapped into an engine, mock embeddings and a small FAISS index over three sample
documents (no real model, no download: the whole LlamaIndex request path in seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[4] / "examples" / "data"
DOC_FILES = ["02_fares.md", "03_trams.md", "04_ferries.md"]


@pytest.fixture(scope="module")
def docs():
    from llama_index.core import SimpleDirectoryReader

    files = [str(DATA / n) for n in DOC_FILES]
    return SimpleDirectoryReader(input_files=files, file_metadata=lambda p: {"source": Path(p).name}).load_data()


@pytest.fixture(scope="module")
def splitter():
    from llama_index.core.node_parser import SentenceSplitter

    return SentenceSplitter(chunk_size=128, chunk_overlap=0)


@pytest.fixture(scope="module")
def engine():
    from kvrag_testing.tiny import tiny_engine

    return tiny_engine("qwen2")


@pytest.fixture(scope="module")
def embed_model():
    from llama_index.core.embeddings import MockEmbedding

    return MockEmbedding(embed_dim=16)


@pytest.fixture(scope="module")
def index(engine, embed_model, docs, splitter):
    from llama_index.postprocessor.kvrag import build_index

    return build_index(docs, engine=engine, embed_model=embed_model, transformations=[splitter])
