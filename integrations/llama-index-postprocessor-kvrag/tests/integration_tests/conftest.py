"""Fixtures: the real default model and embedder (loaded once per session, no network) and a small index."""

from __future__ import annotations

import pytest
from pp_testutil import read_docs, splitter

from kvrag_testing import integrations

engine = integrations.engine  # the default model's engine and its loaded model, once per session
loaded = integrations.loaded


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
