"""The standard LCEL RAG chain, unchanged, with ChatKVCached + KVCacheRetriever (real model, real FAISS)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_kvrag import ChatKVCached, KVCacheRetriever, format_docs

from kvrag import adapters
from kvrag.adapters import CHUNK_KEY_METADATA, chunk_scope
from kvrag.fusion import available_methods

N = 10
Q1 = "How much does a day pass cost?"
Q2 = "How often does tram line T2 run at peak times?"
PROMPT = ChatPromptTemplate.from_template(
    "Answer the question using only this context:\n\n{context}\n\nQuestion: {question}"
)


def make_chain(retriever, llm, parse=True):
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    return chain | StrOutputParser() if parse else chain


@pytest.fixture()
def retriever(vectorstore, engine):
    return KVCacheRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": 2}), engine=engine)


@pytest.fixture()
def llm(engine):
    return ChatKVCached(engine=engine, max_tokens=N)


def test_retriever_tags_documents_and_keeps_text(retriever, vectorstore, engine):
    docs = retriever.invoke(Q1)
    raw = vectorstore.as_retriever(search_kwargs={"k": 2}).invoke(Q1)
    assert [d.page_content for d in docs] == [d.page_content for d in raw]
    for d in docs:
        assert engine.store.contains(d.metadata[CHUNK_KEY_METADATA])
        assert CHUNK_KEY_METADATA not in d.page_content
    assert all(CHUNK_KEY_METADATA not in d.metadata for d in raw)  # the wrapped store's documents are untouched
    text = format_docs(docs)
    assert all(d.page_content in text for d in docs)


def test_lcel_chain_reuses_every_chunk(retriever, llm):
    chain = make_chain(retriever, llm)
    first = chain.invoke(Q1)
    second = chain.invoke(Q2)
    assert isinstance(first, str) and isinstance(second, str) and second
    rec = llm.history[-1]
    kv = rec["response_metadata"]["kvrag"]
    assert kv["chunks_registered"] == kv["chunks_found"] == kv["chunk_hits"] == 2
    assert kv["hit_rate"] == 1.0
    assert kv["ttft_s"] > 0
    # the default auto:agree reuses the chunks' KV unless it escalated to full, which reuses none
    assert (kv["reused_tokens"] > 0) != (kv["method_stats"].get("auto_choice") == "full"), kv
    docs = retriever.invoke(Q2)
    assert sorted(kv["chunk_keys"]) == sorted(d.metadata[CHUNK_KEY_METADATA] for d in docs)


def test_stream_and_batch(retriever, llm):
    chain = make_chain(retriever, llm)
    ref = [chain.invoke(Q1), chain.invoke(Q2)]
    parts = list(chain.stream(Q1))
    assert len(parts) > 1 and "".join(parts) == ref[0]
    assert llm.history[-1]["response_metadata"]["kvrag"]["hit_rate"] == 1.0
    n = len(llm.history)
    assert chain.batch([Q1, Q2]) == ref
    recs = llm.history[n:]
    assert len(recs) == 2 and all(r["response_metadata"]["kvrag"]["hit_rate"] == 1.0 for r in recs)


def test_threads_get_their_own_chunks(retriever, llm):
    chain = make_chain(retriever, llm, parse=False)
    questions = [Q1, "Which ferry carries cars?"]
    out: dict[str, object] = {}

    def ask(q):
        out[q] = chain.invoke(q)

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = []
    for q in questions:
        kv = out[q].response_metadata["kvrag"]
        expected = sorted(d.metadata[CHUNK_KEY_METADATA] for d in retriever.invoke(q))
        assert sorted(kv["chunk_keys"]) == expected
        assert kv["hit_rate"] == 1.0
        keys.append(expected)
    assert keys[0] != keys[1]


def test_full_generates_the_core_engines_tokens(retriever, engine):
    llm = ChatKVCached(engine=engine, method="full", max_tokens=N)
    msg = make_chain(retriever, llm, parse=False).invoke(Q1)
    rec = llm.history[-1]
    ref = engine.answer(rec["prompt"], rec["chunks"], "full", max_new_tokens=N)
    assert msg.response_metadata["kvrag"]["token_ids"] == ref.token_ids
    assert msg.content == ref.text


def test_async_chain(retriever, llm):
    chain = make_chain(retriever, llm)
    ref = chain.invoke(Q1)

    async def run():
        a = await chain.ainvoke(Q1)
        s = [p async for p in chain.astream(Q1)]
        return a, s

    a, s = asyncio.run(run())
    assert a == ref and "".join(s) == ref
    assert llm.history[-1]["response_metadata"]["kvrag"]["hit_rate"] == 1.0


def test_explicit_chunks_and_methods(retriever, engine):
    docs = retriever.invoke(Q1)
    chunks = [d.page_content for d in docs]
    content = "Context:\n\n" + format_docs(docs) + "\n\nQuestion: " + Q1
    for method in ["stale", "full"] + (["relaxkv"] if "relaxkv" in available_methods() else []):
        llm = ChatKVCached(engine=engine, method=method, max_tokens=4, use_recent_chunks=False)
        msg = llm.invoke([HumanMessage(content)], chunks=chunks)
        kv = msg.response_metadata["kvrag"]
        # full prefill reads no cache: no hits, by definition
        assert kv["method"].startswith(method) and kv["hit_rate"] == (0.0 if method == "full" else 1.0)
        assert msg.usage_metadata["input_tokens"] > 0
    # the direct retriever.invoke above registered its documents in this thread's context
    ctx = ChatKVCached(engine=engine, max_tokens=4, use_recent_chunks=False).invoke([HumanMessage(content)])
    assert ctx.response_metadata["kvrag"]["hit_rate"] == 1.0
    with chunk_scope([]):  # nothing registered, no recent lookup: a plain local chat model
        plain = ChatKVCached(engine=engine, max_tokens=4, use_recent_chunks=False).invoke([HumanMessage(content)])
    assert plain.response_metadata["kvrag"]["chunks_registered"] == 0


def test_rejects_images_and_tools(engine):
    llm = ChatKVCached(engine=engine, max_tokens=2)
    with pytest.raises(ValueError, match="text content only"):
        llm.invoke([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])])


def test_the_readme_chain_over_whole_files_reuses_them(engine):
    """The README's snippet: whole files as Documents (read_text keeps each file's final newline). Kept, that newline
    ran into format_docs' separator, the prompt's ids never held the document's, and the chain reused nothing."""
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore
    from lc_testutil import DATA, DOC_FILES, get_embeddings

    docs = [Document(page_content=(DATA / n).read_text()) for n in DOC_FILES]
    assert all(d.page_content.endswith("\n") for d in docs)
    vectors = InMemoryVectorStore.from_documents(docs, get_embeddings())
    retriever = KVCacheRetriever(retriever=vectors.as_retriever(search_kwargs={"k": 2}), engine=engine)
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=3)
    adapters.recent.clear()  # other tests' retrieved splits of the same files would be found in this prompt too
    adapters.clear_chunks()
    make_chain(retriever, llm).invoke("When does the last ferry leave?")
    kv = llm.history[-1]["response_metadata"]["kvrag"]
    assert kv["chunks_registered"] == kv["chunk_hits"] == 2 and kv["hit_rate"] == 1.0, kv
    assert kv["reused_tokens"] > 500, kv


def test_documents_written_after_labels_are_still_reused(retriever, engine):
    """A chain that writes each document after a label ("[04_ferries.md] Ferries ...") joins the label's space and
    the document's first word into other tokens than the document's own: the passage is still reused."""
    llm = ChatKVCached(engine=engine, method="stale", max_tokens=3)

    def labelled(docs):
        return "\n".join(f"[{d.metadata['source']}] {d.page_content}" for d in docs)

    chain = {"context": retriever | labelled, "question": RunnablePassthrough()} | PROMPT | llm
    chain.invoke(Q1)
    kv = llm.history[-1]["response_metadata"]["kvrag"]
    assert kv["chunk_hits"] == 2 and kv["reused_tokens"] > 100, kv
