"""Build, persist and reload a ``VectorStoreIndex`` on FAISS whose chunk caches live in the same directory.

Layout of a persist dir: LlamaIndex's files (``docstore.json``, ``index_store.json``, ``default__vector_store.json``
holding the FAISS index, ...) plus ``kvcache/``, a kvrag :class:`~kvrag.store.disk.DiskStore`. Reloading reuses the
stored caches: nothing is recomputed unless a chunk's text (or the model) changed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.schema import BaseNode, Document, TransformComponent
from llama_index.postprocessor.kvrag.base import KVCacheTransform

log = logging.getLogger(__name__)

KV_SUBDIR = "kvcache"


def kv_store_url(persist_dir: str | os.PathLike[str]) -> str:
    """The ``file://`` URL of the chunk-cache store inside ``persist_dir``."""
    return f"file://{(Path(persist_dir).expanduser().absolute() / KV_SUBDIR).as_posix()}"


def open_engine(persist_dir: str | os.PathLike[str], loaded: Any = None, model: str | None = None, **config: Any) -> Any:
    """A :class:`kvrag.KVRAGEngine` whose store is ``persist_dir/kvcache``.

    Args:
        loaded: an already loaded :class:`kvrag.models.LoadedModel` (e.g. ``other_engine.loaded``) to share.
        model: model to load when ``loaded`` is None (None: the embedded default).
        config: :class:`kvrag.config.EngineConfig` fields.
    """
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.factory import store_from_url

    store = store_from_url(kv_store_url(persist_dir))
    if loaded is None:
        return KVRAGEngine.from_pretrained(model, store=store, **config)
    return KVRAGEngine(loaded, store, EngineConfig(**config))


def _faiss_storage(embed_model: Any) -> StorageContext:
    """A FAISS inner-product index: a node's score is its similarity (higher is closer), as LlamaIndex's
    postprocessors (``SimilarityPostprocessor``, ``LongContextReorder``) read it; with a normalizing embedder (the
    default of ``HuggingFaceEmbedding``) it is the cosine similarity. An L2 index would give distances (lower is
    closer), which those postprocessors invert."""
    import faiss
    import numpy as np
    from llama_index.vector_stores.faiss import FaissVectorStore

    probe = np.asarray(embed_model.get_text_embedding("dimension probe"), dtype=np.float64)
    if abs(float(np.linalg.norm(probe)) - 1.0) > 1e-3:
        log.warning("the embedding model does not normalize its vectors (norm %.3f): node scores are inner products, "
                    "not cosine similarities; normalize them (e.g. HuggingFaceEmbedding(normalize=True)) for "
                    "similarity cutoffs", float(np.linalg.norm(probe)))
    return StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=faiss.IndexFlatIP(len(probe))))


def _check_store(engine: Any, persist_dir: str | os.PathLike[str] | None) -> None:
    if persist_dir is None:
        return
    root = getattr(engine.store, "root", None)
    want = Path(persist_dir).expanduser().absolute() / KV_SUBDIR
    if root is None or Path(root) != want:
        log.warning("the engine's KV store (%r) is not %s: the caches will not be persisted with the index; "
                    "use open_engine(persist_dir, ...) to keep them together", engine.store, want)


def build_index(
    documents: Sequence[Document] | None = None,
    *,
    nodes: Sequence[BaseNode] | None = None,
    engine: Any,
    embed_model: Any,
    transformations: Sequence[TransformComponent] | None = None,
    persist_dir: str | os.PathLike[str] | None = None,
    show_progress: bool = False,
    batch_size: int | None = None,
    vector_store: Any = None,
) -> VectorStoreIndex:
    """Split, cache and embed documents (or ready nodes) into a ``VectorStoreIndex`` (FAISS by default).

    Args:
        documents: documents to split with ``transformations`` (default: LlamaIndex's default node parser).
        nodes: already split nodes (instead of documents).
        engine: the kvrag engine (its store should be ``persist_dir/kvcache``: see :func:`open_engine`).
        embed_model: a LlamaIndex embedding model (e.g. ``HuggingFaceEmbedding`` on a local path).
        transformations: node parser(s); a :class:`KVCacheTransform` is appended.
        persist_dir: when set, the index is persisted there (the caches already are, through the engine's store).
        batch_size: chunks per cache-prefill forward (None: kvrag's default; see ``KVRAGEngine.ingest``).
        vector_store: any LlamaIndex vector store instead of the default FAISS inner-product index (e.g.
            ``SimpleVectorStore()``, which supports metadata filters, ``delete_ref_doc`` and ``refresh_ref_docs``;
            FAISS supports none of them). Reload a persisted one with ``load_index(..., vector_store=...)``.
    """
    if (documents is None) == (nodes is None):
        msg = "build_index needs exactly one of documents=... or nodes=..."
        raise ValueError(msg)
    _check_store(engine, persist_dir)
    storage = _faiss_storage(embed_model) if vector_store is None else StorageContext.from_defaults(
        vector_store=vector_store)
    kv = KVCacheTransform(engine, show_progress=show_progress, batch_size=batch_size)
    if documents is not None:
        from llama_index.core import Settings

        steps = list(transformations) if transformations is not None else list(Settings.transformations)
        index = VectorStoreIndex.from_documents(
            list(documents), storage_context=storage, embed_model=embed_model, transformations=[*steps, kv],
            show_progress=show_progress,
        )
    else:
        ns = list(nodes or [])
        kv(ns, show_progress=show_progress)
        index = VectorStoreIndex(ns, storage_context=storage, embed_model=embed_model, show_progress=show_progress)
    if persist_dir is not None:
        persist_index(index, persist_dir)
    return index


def persist_index(index: VectorStoreIndex, persist_dir: str | os.PathLike[str]) -> None:
    """Write the index (docstore, index store, FAISS vectors) into ``persist_dir``."""
    index.storage_context.persist(persist_dir=str(persist_dir))


def load_index(persist_dir: str | os.PathLike[str], *, embed_model: Any, vector_store: Any = None) -> VectorStoreIndex:
    """Reload an index written by :func:`build_index` / :func:`persist_index` (the caches stay in ``kvcache/``).

    LlamaIndex's own ``load_index_from_storage(StorageContext.from_defaults(persist_dir=...))`` cannot read the
    FAISS index (it takes the binary vector file for JSON); this reads it with ``FaissVectorStore``. An index built
    with another ``vector_store`` is reloaded from a persist dir with ``vector_store=None`` only when that store is
    LlamaIndex's ``SimpleVectorStore``; pass other stores (their own reloaded instance) as ``vector_store``.
    """
    from llama_index.vector_stores.faiss import FaissVectorStore

    d = str(persist_dir)
    if not Path(d, "docstore.json").exists():
        msg = f"{d!r} holds no persisted LlamaIndex index (no docstore.json); build it with build_index(..., persist_dir=...)"
        raise FileNotFoundError(msg)
    if vector_store is None and _is_faiss(Path(d)):
        vector_store = FaissVectorStore.from_persist_dir(d)
    storage = StorageContext.from_defaults(vector_store=vector_store, persist_dir=d)
    return load_index_from_storage(storage, embed_model=embed_model)


def _is_faiss(d: Path) -> bool:
    """Whether the persisted default vector store is a FAISS index (binary) rather than LlamaIndex's JSON one."""
    f = d / "default__vector_store.json"
    if not f.exists():
        return False
    with f.open("rb") as fh:
        return fh.read(1) not in (b"{", b"")
