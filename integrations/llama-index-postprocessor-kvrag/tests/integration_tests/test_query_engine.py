"""Stock LlamaIndex query/chat engines with KVCachedLLM + KVCachePostprocessor (real model, real index)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from llama_index.core import Settings
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import MetadataMode
from llama_index.llms.kvrag import KVCachedLLM
from llama_index.postprocessor.kvrag import (
    KVCachePostprocessor,
    KVCacheTransform,
    KVQueryEngine,
    build_index,
    load_index,
    open_engine,
    render_node,
)
from pp_testutil import read_docs, splitter

from kvrag import adapters
from kvrag.adapters import CHUNK_KEY_METADATA

N = 8
Q1 = "How much does a day pass cost?"
Q2 = "How often does tram line T2 run at peak times?"


@pytest.fixture()
def llm(engine):
    return KVCachedLLM(engine=engine, max_new_tokens=N)


def rag_records(llm):
    """History records of LLM calls whose prompt contained registered chunks."""
    return [h for h in llm.history if h["additional_kwargs"]["chunks_found"]]


def test_ingestion_tags_nodes_without_changing_text(index, engine):
    nodes = list(index.docstore.docs.values())
    assert len(nodes) >= 6
    for n in nodes:
        key = n.metadata[CHUNK_KEY_METADATA]
        assert CHUNK_KEY_METADATA in n.excluded_llm_metadata_keys
        assert CHUNK_KEY_METADATA in n.excluded_embed_metadata_keys
        assert key not in n.get_content(metadata_mode=MetadataMode.LLM)
        assert key not in n.get_content(metadata_mode=MetadataMode.EMBED)
        assert engine.store.contains(key)
        assert "source: " in render_node(n)  # metadata is part of the cached text, as the synthesizer renders it


@pytest.mark.parametrize("top_k", [2, 4])
def test_stock_query_engine_reuses_every_chunk(index, engine, llm, top_k):
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=top_k)
    qe.query(Q1)
    r = qe.query(Q2)
    info = llm.last_info
    kw = info["additional_kwargs"]
    assert len(r.source_nodes) == top_k
    assert kw["chunks_registered"] == kw["chunks_found"] == kw["chunk_hits"] == top_k
    assert kw["hit_rate"] == 1.0
    assert kw["ttft_s"] > 0
    keys = [n.node.metadata[CHUNK_KEY_METADATA] for n in r.source_nodes]
    assert sorted(keys) == sorted(info["raw"]["chunk_keys"])
    for n in r.source_nodes:
        assert render_node(n.node) in info["prompt"]


def test_streaming_query_engine(index, engine, llm):
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                               similarity_top_k=2, streaming=True)
    r = qe.query(Q1)
    text = "".join(r.response_gen)
    info = llm.last_info
    assert text == info["text"]
    assert info["additional_kwargs"]["hit_rate"] == 1.0


def test_full_generates_the_core_engines_tokens(index, engine):
    llm = KVCachedLLM(engine=engine, method="full", max_new_tokens=N)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    r = qe.query(Q1)
    info = llm.last_info
    ref = engine.answer(info["prompt"], info["chunks"], "full", max_new_tokens=N)
    assert info["raw"]["token_ids"] == ref.token_ids
    assert str(r) == ref.text.strip() or str(r) == ref.text


def test_threads_get_their_own_chunks(index, engine, llm):
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    out: dict[str, tuple] = {}
    errors = []

    def ask(q: str) -> None:
        try:
            r = qe.query(q)
            out[q] = (r, llm.last_info)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(q,)) for q in (Q1, "When does the last boat leave Tamsin Isle?")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    seen = []
    for _q, (r, info) in out.items():
        mine = sorted(render_node(n.node) for n in r.source_nodes)
        assert sorted(info["chunks"]) == mine
        assert info["additional_kwargs"]["hit_rate"] == 1.0
        seen.append(mine)
    assert seen[0] != seen[1]


def test_compact_repacking_is_reported_and_kv_query_engine_is_exact(index, engine):
    """A small context window makes the compact synthesizer repack the chunks across two LLM calls."""
    small = KVCachedLLM(engine=engine, max_new_tokens=N, context_window=900)
    qe = index.as_query_engine(llm=small, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=4)
    qe.query(Q1)
    calls = small.history
    print([(c["additional_kwargs"]["chunks_registered"], c["additional_kwargs"]["chunks_found"], c["additional_kwargs"]["prompt_tokens"]) for c in calls])
    assert len(calls) >= 2  # compact + refine
    assert any(c["additional_kwargs"]["chunks_found"] < c["additional_kwargs"]["chunks_registered"] for c in calls)
    assert any(c["additional_kwargs"]["hit_rate"] < 1.0 for c in calls)
    # the explicit path hands whole chunks to the LLM: every chunk hits
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    r = KVQueryEngine.from_index(index, llm, similarity_top_k=4).query(Q1)
    assert r.metadata["kvrag"]["hit_rate"] == 1.0
    assert r.metadata["kvrag"]["chunks_found"] == 4


def test_kv_query_engine_builds_the_stock_prompt(index, engine):
    a, b = KVCachedLLM(engine=engine, max_new_tokens=N), KVCachedLLM(engine=engine, max_new_tokens=N)
    stock = index.as_query_engine(llm=a, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    ours = KVQueryEngine.from_index(index, b, similarity_top_k=2)
    r_stock, r_ours = stock.query(Q2), ours.query(Q2)
    assert a.last_info["prompt"] == b.last_info["prompt"]
    assert str(r_stock).strip() == str(r_ours).strip()
    streamed = KVQueryEngine.from_index(index, b, similarity_top_k=2, streaming=True).query(Q2)
    assert "".join(streamed.response_gen).strip() == str(r_ours).strip()
    assert streamed.metadata["kvrag"]["hit_rate"] == 1.0


def test_async_query(index, engine, llm):
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)

    async def run():
        adapters.clear_chunks()
        return await qe.aquery(Q1)

    r = asyncio.run(run())
    rec = llm.history[-1]
    assert rec["additional_kwargs"]["hit_rate"] == 1.0
    assert sorted(rec["chunks"]) == sorted(render_node(n.node) for n in r.source_nodes)


def test_chat_engine_multi_turn(index, engine, llm):
    ce = index.as_chat_engine(chat_mode="condense_plus_context", llm=llm,
                              node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    r1 = ce.chat(Q1)
    r2 = ce.chat("And how much is the weekly pass?")
    s3 = ce.stream_chat("Which ferry carries cars?")
    text3 = "".join(s3.response_gen)
    assert str(r1) and str(r2) and text3
    assert len(ce.chat_history) == 6
    rag = rag_records(llm)
    assert len(rag) >= 3
    assert all(h["additional_kwargs"]["hit_rate"] == 1.0 for h in rag[-3:])


def test_ingestion_pipeline_and_persisted_index_reuse_caches(tmp_path, loaded, embed_model):
    docs = read_docs(["04_ferries.md"])
    eng = open_engine(tmp_path, loaded=loaded)
    pipeline = IngestionPipeline(transformations=[splitter(), KVCacheTransform(eng), embed_model])
    nodes = pipeline.run(documents=docs, show_progress=False)
    assert all(eng.store.contains(n.metadata[CHUNK_KEY_METADATA]) for n in nodes)
    index = build_index(nodes=nodes, engine=eng, embed_model=embed_model, persist_dir=tmp_path)
    entries = eng.store.stats()["entries"]
    assert entries == len(nodes)
    assert (tmp_path / "kvcache").is_dir() and (tmp_path / "docstore.json").is_file()

    # a new process would do exactly this: fresh engine on the same dir, reload the index
    eng2 = open_engine(tmp_path, loaded=loaded)
    index2 = load_index(tmp_path, embed_model=embed_model)
    reloaded = list(index2.docstore.docs.values())
    assert len(reloaded) == len(nodes)
    assert all(cached for _key, cached in adapters.ensure_chunks(eng2, [render_node(n) for n in reloaded]))
    assert eng2.store.stats()["entries"] == entries  # nothing recomputed
    llm = KVCachedLLM(engine=eng2, max_new_tokens=N)
    qe = index2.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=eng2)], similarity_top_k=2)
    qe.query("Which ferry carries cars?")
    kw = llm.last_info["additional_kwargs"]
    assert kw["chunk_hits"] == 2 and kw["chunk_misses"] == 0 and kw["hit_rate"] == 1.0
    stats = eng2.store.stats()
    assert stats["hits"] >= 2
    assert stats["corrupt_dropped"] == 0
    assert index is not None and Settings is not None
