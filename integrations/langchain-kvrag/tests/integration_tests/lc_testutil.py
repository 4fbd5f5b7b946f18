"""Shared objects for the langchain-kvrag tests: the real default model and embedder, loaded once (no network)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[4] / "examples" / "data"
DOC_FILES = ["02_fares.md", "03_trams.md", "04_ferries.md"]


@functools.cache
def get_engine():
    """One engine per process (model + memory store) for fixtures and the standard-suite properties alike."""
    from kvrag.adapters import shared_engine

    return shared_engine(None, "memory://")


@functools.cache
def get_embeddings():
    from langchain_huggingface import HuggingFaceEmbeddings

    from kvrag.default_model import default_embedder_path

    return HuggingFaceEmbeddings(model_name=str(default_embedder_path()))


@functools.cache
def get_vectorstore():
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    docs = [Document(page_content=(DATA / n).read_text(), metadata={"source": n}) for n in DOC_FILES]
    splits = RecursiveCharacterTextSplitter(chunk_size=800, chunk_overlap=0).split_documents(docs)
    return FAISS.from_documents(splits, get_embeddings())


