"""Chunk-cache stores: memory (LRU), disk (atomic files), Redis, tiered; all speak :class:`KVStore`.

``RedisStore`` is resolved lazily so that importing kvrag never imports redis-py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrag.store import serde
from kvrag.store.base import KVStore, check_key
from kvrag.store.disk import DiskStore
from kvrag.store.factory import register_store_scheme, store_from_url, valid_schemes
from kvrag.store.fallback import FallbackStore, open_store, with_fallback
from kvrag.store.maintenance import gc_store, migrate_store, verify_store
from kvrag.store.memory import MemoryStore
from kvrag.store.serde import CODECS, decode, encode
from kvrag.store.tiered import TieredStore

if TYPE_CHECKING:
    from kvrag.store.redis import RedisStore

__all__ = [
    "CODECS",
    "DiskStore",
    "FallbackStore",
    "KVStore",
    "MemoryStore",
    "RedisStore",
    "TieredStore",
    "check_key",
    "decode",
    "encode",
    "gc_store",
    "migrate_store",
    "open_store",
    "register_store_scheme",
    "serde",
    "store_from_url",
    "valid_schemes",
    "verify_store",
    "with_fallback",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from kvrag.store.redis import RedisStore

        return RedisStore
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)
