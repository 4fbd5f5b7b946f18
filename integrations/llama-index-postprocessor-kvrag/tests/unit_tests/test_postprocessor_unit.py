"""KVCachePostprocessor, KVCacheTransform, build_index / open_engine and KVQueryEngine on a tiny random model with
mock embeddings: the stock query engine's request path, in seconds."""

from __future__ import annotations

from llama_index.core.schema import MetadataMode
from llama_index.llms.kvrag import KVCachedLLM
from llama_index.postprocessor.kvrag import (
    KVCachePostprocessor,
    KVQueryEngine,
    build_index,
    load_index,
    open_engine,
    render_node,
)

from kvrag import adapters
from kvrag.adapters import CHUNK_KEY_METADATA

Q = "How much does a day pass cost?"
N = 4


def test_indexing_caches_and_tags_every_node_without_changing_its_text(index, engine) -> None:
    nodes = list(index.docstore.docs.values())
    assert len(nodes) >= 3
    for n in nodes:
        key = n.metadata[CHUNK_KEY_METADATA]
        assert engine.store.contains(key)
        assert key not in n.get_content(metadata_mode=MetadataMode.LLM)
        assert key not in n.get_content(metadata_mode=MetadataMode.EMBED)


def test_stock_query_engine_reuses_every_retrieved_chunk(index, engine) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    r = qe.query(Q)
    info = llm.last_info
    kw = info["additional_kwargs"]
    assert len(r.source_nodes) == 2
    assert kw["chunks_registered"] == kw["chunks_found"] == kw["chunk_hits"] == 2 and kw["hit_rate"] == 1.0
    assert sorted(info["raw"]["chunk_keys"]) == sorted(n.node.metadata[CHUNK_KEY_METADATA] for n in r.source_nodes)
    assert all(render_node(n.node) in info["prompt"] for n in r.source_nodes)


def test_kv_query_engine_hands_whole_chunks_to_the_llm(index, engine) -> None:
    llm = KVCachedLLM(engine=engine, max_new_tokens=N)
    r = KVQueryEngine.from_index(index, llm, similarity_top_k=3).query(Q)
    assert r.metadata["kvrag"]["hit_rate"] == 1.0 and r.metadata["kvrag"]["chunks_found"] == 3


def test_persisted_index_and_caches_reload_without_recomputing(tmp_path, engine, embed_model, docs, splitter) -> None:
    eng = open_engine(tmp_path, loaded=engine.loaded)
    built = build_index(docs[:1], engine=eng, embed_model=embed_model, transformations=[splitter],
                        persist_dir=tmp_path)
    entries = eng.store.stats()["entries"]
    assert entries == len(built.docstore.docs) > 0 and (tmp_path / "kvcache").is_dir()
    eng2 = open_engine(tmp_path, loaded=engine.loaded)  # a new process would do exactly this
    index2 = load_index(tmp_path, embed_model=embed_model)
    reloaded = list(index2.docstore.docs.values())
    assert all(cached for _key, cached in adapters.ensure_chunks(eng2, [render_node(n) for n in reloaded]))
    assert eng2.store.stats()["entries"] == entries  # nothing recomputed
    llm = KVCachedLLM(engine=eng2, max_new_tokens=N)
    index2.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=eng2)],
                           similarity_top_k=1).query(Q)
    kw = llm.last_info["additional_kwargs"]
    assert kw["chunk_hits"] == 1 and kw["chunk_misses"] == 0 and kw["hit_rate"] == 1.0


def test_a_transform_copied_into_a_worker_process_says_why_it_cannot_run(engine, docs, splitter) -> None:
    """IngestionPipeline(num_workers > 1) pickles its transformations into worker processes; the engine does not
    travel (LlamaIndex's __getstate__ drops it), and the copy failed with an AttributeError on a private field."""
    import pytest
    from llama_index.postprocessor.kvrag import KVCacheTransform

    from kvrag.errors import ConfigError

    t = KVCacheTransform(engine=engine)
    copy = KVCacheTransform.__new__(KVCacheTransform)
    copy.__setstate__(t.__getstate__())  # what unpickling in the worker does
    with pytest.raises(ConfigError, match="num_workers=1"):
        copy(splitter.get_nodes_from_documents(docs[:1]))
    assert t(splitter.get_nodes_from_documents(docs[:1]))  # the original still runs

