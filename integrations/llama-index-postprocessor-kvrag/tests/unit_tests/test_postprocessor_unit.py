"""KVCachePostprocessor, KVCacheTransform, build_index / open_engine and KVQueryEngine on a tiny random model with
mock embeddings: the stock query engine's request path, in seconds."""

from __future__ import annotations

import pytest
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



def _bag_of_words_embedding():
    """A normalized hashed bag of words: texts that share words are similar (cosine), the same text scores 1."""
    import hashlib
    import math

    from llama_index.core.embeddings import BaseEmbedding

    def embed(text: str) -> list[float]:
        v = [0.0] * 64
        for w in text.lower().split():
            v[int(hashlib.sha256(w.encode()).hexdigest(), 16) % 64] += 1.0
        n = math.sqrt(sum(x * x for x in v)) or 1.0
        return [x / n for x in v]

    class BagOfWords(BaseEmbedding):
        def _get_text_embedding(self, text: str) -> list[float]:
            return embed(text)

        def _get_query_embedding(self, query: str) -> list[float]:
            return embed(query)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return embed(query)

    return BagOfWords()


def test_node_scores_are_similarities_so_cutoffs_keep_the_closest(engine, docs, splitter) -> None:
    from llama_index.core.postprocessor import SimilarityPostprocessor
    from llama_index.core.schema import QueryBundle

    index = build_index(docs, engine=engine, embed_model=_bag_of_words_embedding(), transformations=[splitter])
    target = next(iter(index.docstore.docs.values())).get_content()
    got = index.as_retriever(similarity_top_k=3).retrieve(target)
    scores = [n.score for n in got]
    assert got[0].node.get_content() == target and scores[0] > 0.99  # itself (+ metadata): cosine ~1 (L2 gave ~0)
    assert scores == sorted(scores, reverse=True)
    kept = SimilarityPostprocessor(similarity_cutoff=0.99).postprocess_nodes(got, QueryBundle(target))
    assert [n.node.node_id for n in kept] == [got[0].node.node_id]


def test_another_vector_store_supports_deletes_and_reloads(tmp_path, engine, docs, splitter) -> None:
    from llama_index.core.vector_stores import SimpleVectorStore

    emb = _bag_of_words_embedding()
    eng = open_engine(tmp_path, loaded=engine.loaded)
    index = build_index(docs, engine=eng, embed_model=emb, transformations=[splitter], persist_dir=tmp_path,
                        vector_store=SimpleVectorStore())
    index.delete_ref_doc(docs[0].doc_id, delete_from_docstore=True)  # FAISS raises NotImplementedError here
    index.storage_context.persist(persist_dir=str(tmp_path))
    again = load_index(tmp_path, embed_model=emb)
    assert {n.ref_doc_id for n in again.docstore.docs.values()} == {d.doc_id for d in docs[1:]}
    assert again.as_retriever(similarity_top_k=1).retrieve(Q)


def test_an_ingestion_cache_does_not_take_another_store_for_done(engine, docs, splitter) -> None:
    from llama_index.core.ingestion import IngestionCache, IngestionPipeline
    from llama_index.postprocessor.kvrag import KVCacheTransform

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore

    cache = IngestionCache()
    engines = [KVRAGEngine(engine.loaded, MemoryStore(), engine.config) for _ in range(2)]
    for eng in engines:
        IngestionPipeline(transformations=[splitter, KVCacheTransform(engine=eng)], cache=cache).run(documents=docs[:1])
    assert engines[0].store.stats()["entries"] == engines[1].store.stats()["entries"] > 0


def test_kv_query_engine_aquery_runs_off_the_event_loop(index, engine) -> None:
    import asyncio
    import threading

    llm = KVCachedLLM(engine=engine, max_new_tokens=2)
    qe = KVQueryEngine.from_index(index, llm, similarity_top_k=2)
    threads: list[int] = []
    sync = qe.custom_query

    def spy(query: str):
        threads.append(threading.get_ident())
        return sync(query)

    object.__setattr__(qe, "custom_query", spy)

    async def main():
        r = await qe.aquery(Q)
        return r, threading.get_ident()

    r, loop_thread = asyncio.run(main())
    assert r.metadata["kvrag"]["hit_rate"] == 1.0 and threads and threads[0] != loop_thread


@pytest.mark.parametrize("is_chat_model", [True, False])
def test_kv_query_engine_builds_the_stock_prompt_for_either_kind_of_llm(index, engine, is_chat_model: bool) -> None:
    """A completion LLM (is_chat_model=False): the stock engine wraps the QA prompt in the LLM's
    completion_to_prompt (the chat template); KVQueryEngine sent the bare template."""
    a, b = (KVCachedLLM(engine=engine, max_new_tokens=2, is_chat_model=is_chat_model) for _ in range(2))
    stock = index.as_query_engine(llm=a, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=2)
    stock.query(Q)
    KVQueryEngine.from_index(index, b, similarity_top_k=2).query(Q)
    assert a.last_info["prompt"] == b.last_info["prompt"]


def test_copies_share_the_engine_and_an_unpickled_postprocessor_says_why_it_cannot_run(engine) -> None:
    import copy

    from llama_index.postprocessor.kvrag import KVCacheTransform

    pp, t = KVCachePostprocessor(engine=engine), KVCacheTransform(engine=engine)
    assert copy.deepcopy(pp).engine is engine and copy.deepcopy(t).engine is engine
    moved = KVCachePostprocessor.__new__(KVCachePostprocessor)
    moved.__setstate__(pp.__getstate__())  # what unpickling in another process does
    with pytest.raises(ValueError, match="without its engine"):
        _ = moved.engine
