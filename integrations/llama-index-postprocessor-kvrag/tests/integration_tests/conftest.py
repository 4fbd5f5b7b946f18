"""Fixtures: the real default model and embedder (loaded once per session, no network) and a small index."""

from __future__ import annotations

import pytest
from pp_testutil import read_docs, splitter


@pytest.fixture(scope="session")
def engine():
    """One engine per process (shared by every test directory of a run): default model + memory store."""
    from kvrag.adapters import shared_engine

    return shared_engine(None, "memory://")


@pytest.fixture(scope="session")
def loaded(engine):
    return engine.loaded



@pytest.fixture(scope="session")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from kvrag.default_model import default_embedder_path

    return HuggingFaceEmbedding(model_name=str(default_embedder_path()))


@pytest.fixture(scope="session")
def docs():
    return read_docs()


@pytest.fixture(scope="session")
def index(engine, embed_model, docs):
    from llama_index.postprocessor.kvrag import build_index

    return build_index(docs, engine=engine, embed_model=embed_model, transformations=[splitter()])
