"""KVCacheRetriever on a tiny random model and fake embeddings: tagging, caching, LCEL reuse, settings validation."""

from __future__ import annotations

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_kvrag import ChatKVCached, KVCacheRetriever, format_docs
from pydantic import ValidationError

from kvrag.adapters import CHUNK_KEY_METADATA

Q = "How much does a day pass cost?"


def test_misspelled_setting_is_an_error(engine, vectorstore) -> None:
    with pytest.raises(ValidationError, match="metdata_key"):
        KVCacheRetriever(retriever=vectorstore.as_retriever(), engine=engine, metdata_key="x")
    with pytest.raises(ValueError, match="engine=KVRAGEngine"):
        KVCacheRetriever(retriever=vectorstore.as_retriever())


def test_documents_are_cached_tagged_and_unchanged(engine, vectorstore) -> None:
    retriever = KVCacheRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), engine=engine, k=2)
    docs = retriever.invoke(Q)
    raw = vectorstore.as_retriever(search_kwargs={"k": 2}).invoke(Q)
    assert [d.page_content for d in docs] == [d.page_content for d in raw] and len(docs) == 2
    for d in docs:
        assert engine.store.contains(d.metadata[CHUNK_KEY_METADATA])
    assert all(CHUNK_KEY_METADATA not in d.metadata for d in raw)


def test_lcel_chain_reuses_every_retrieved_chunk(engine, vectorstore) -> None:
    retriever = KVCacheRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), engine=engine)
    llm = ChatKVCached(engine=engine, max_tokens=4)
    template = ChatPromptTemplate.from_template("Answer using this context:\n\n{context}\n\nQuestion: {question}")
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | template | llm | StrOutputParser()
    assert isinstance(chain.invoke(Q), str)
    kv = llm.history[-1]["response_metadata"]["kvrag"]
    assert kv["chunks_found"] == kv["chunk_hits"] == 2 and kv["hit_rate"] == 1.0
    assert sorted(kv["chunk_keys"]) == sorted(d.metadata[CHUNK_KEY_METADATA] for d in retriever.invoke(Q))


def test_from_vectorstore_passes_the_search_type_on(engine, vectorstore) -> None:
    mmr = KVCacheRetriever.from_vectorstore(vectorstore, engine=engine, k=2, search_type="mmr", fetch_k=4)
    assert mmr.retriever.search_type == "mmr" and mmr.retriever.search_kwargs == {"k": 2, "fetch_k": 4}
    assert len(mmr.invoke(Q)) == 2
    plain = KVCacheRetriever.from_vectorstore(vectorstore, engine=engine, k=3)
    assert plain.retriever.search_type == "similarity" and plain.retriever.search_kwargs == {"k": 3}


def test_copies_share_the_engine_and_pickling_one_says_what_to_do(engine, vectorstore) -> None:
    import copy

    retriever = KVCacheRetriever(retriever=vectorstore.as_retriever(), engine=engine)
    assert copy.deepcopy(retriever).engine is engine
    with pytest.raises(TypeError, match="cannot be pickled"):
        retriever.__reduce_ex__(4)  # what pickle.dumps calls
