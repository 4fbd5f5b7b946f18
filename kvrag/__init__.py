"""kvrag: fast RAG with reusable per-chunk KV caches for local Hugging Face models.

Public API (heavy modules load lazily, and ``import kvrag`` imports neither redis, llama_index nor langchain)::

    from kvrag import KVRAGEngine, GenerationConfig
    eng = KVRAGEngine.from_pretrained()            # embedded SmolLM2-135M-Instruct, in-memory store
    eng.ingest(["chunk one ...", "chunk two ..."])
    resp = eng.answer(prompt, chunks=[...], method="relaxkv:r=0.15")
"""

from __future__ import annotations

import importlib
from typing import Any

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.errors import (
    CacheCorruptError,
    CacheMismatchError,
    CheckpointMismatchError,
    ConfigError,
    ContextLengthError,
    EngineBusyError,
    EngineClosedError,
    KVRAGError,
    RequestCancelledError,
    StoreError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

_LAZY = {
    "CancelToken": "kvrag.engine.cancel",
    "cancel_scope": "kvrag.engine.cancel",
    "KVRAGEngine": "kvrag.engine.engine",
    "Response": "kvrag.engine.engine",
    "load_model": "kvrag.models",
    "load_embedder": "kvrag.models",
    "LoadedModel": "kvrag.models",
    "store_from_url": "kvrag.store.factory",
    "KVStore": "kvrag.store.base",
    "MemoryStore": "kvrag.store.memory",
    "DiskStore": "kvrag.store.disk",
    "TieredStore": "kvrag.store.tiered",
    "get_method": "kvrag.fusion",
    "available_methods": "kvrag.fusion",
    "MethodStats": "kvrag.fusion.stats",
    "RagTemplate": "kvrag.prompting",
    "render_passage": "kvrag.prompting",
    "ChunkKV": "kvrag.kv.chunk",
    "KVSpec": "kvrag.kv.spec",
}

__all__ = [
    "CacheCorruptError",
    "CacheMismatchError",
    "CheckpointMismatchError",
    "ConfigError",
    "ContextLengthError",
    "EngineBusyError",
    "EngineClosedError",
    "EngineConfig",
    "GenerationConfig",
    "KVRAGError",
    "RequestCancelledError",
    "StoreError",
    "UnsupportedModelError",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvrag' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
