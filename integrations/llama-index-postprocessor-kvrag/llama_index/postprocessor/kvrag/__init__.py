"""LlamaIndex node postprocessor integration for kvrag: per-chunk KV caches for retrieved nodes."""

from llama_index.postprocessor.kvrag.base import (
    KVCachePostprocessor,
    KVCacheTransform,
    ensure_node_caches,
    render_node,
)
from llama_index.postprocessor.kvrag.persist import (
    KV_SUBDIR,
    build_index,
    kv_store_url,
    load_index,
    open_engine,
    persist_index,
)
from llama_index.postprocessor.kvrag.query_engine import KVQueryEngine

__all__ = [
    "KV_SUBDIR",
    "KVCachePostprocessor",
    "KVCacheTransform",
    "KVQueryEngine",
    "build_index",
    "ensure_node_caches",
    "kv_store_url",
    "load_index",
    "open_engine",
    "persist_index",
    "render_node",
]
