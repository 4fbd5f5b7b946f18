"""MemoryStore: an in-process LRU with a byte budget (the hot tier in front of disk or Redis)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from kvrag.errors import ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.spec import KVSpec
from kvrag.store import serde
from kvrag.store.base import KVStore, StoreStats

logger = logging.getLogger(__name__)


def _clone(chunk: ChunkKV) -> ChunkKV:
    """A CPU copy that shares no storage with ``chunk``."""
    return ChunkKV(
        token_ids=chunk.token_ids.detach().to("cpu", torch.int64, copy=True),
        keys=chunk.keys.detach().to("cpu", copy=True).contiguous(),
        values=chunk.values.detach().to("cpu", copy=True).contiguous(),
        spec=chunk.spec,
        codec=chunk.codec,
    )


def _entry_nbytes(entry: ChunkKV | bytes) -> int:
    if isinstance(entry, bytes):
        return len(entry)
    return entry.nbytes + entry.token_ids.numel() * entry.token_ids.element_size()


class MemoryStore(KVStore):
    """Thread-safe LRU of chunk caches bounded by ``max_bytes``.

    With ``codec="native"`` entries are kept as CPU tensors (a hit costs one copy, no decode). Any other codec
    keeps the encoded bytes (e.g. ``"int8"`` roughly halves memory against fp16; a hit costs a decode).
    Either way ``get`` returns fresh tensors that callers may mutate freely.

    Args:
        max_bytes: budget for stored tensors/bytes; None means unbounded. An entry larger than the whole
            budget is not stored.
        codec: see :func:`kvrag.store.serde.encode`.
        expected_spec: only entries with this KVSpec are served (see :class:`KVStore`).
    """

    def __init__(
        self, max_bytes: int | None = None, *, codec: str = "native", expected_spec: KVSpec | None = None
    ) -> None:
        super().__init__(expected_spec=expected_spec)
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            msg = f"MemoryStore max_bytes must be a non-negative int or None, got {max_bytes!r}"
            raise ConfigError(msg)
        if codec not in serde.CODECS:
            msg = f"unknown KV codec {codec!r}; expected one of {list(serde.CODECS)}"
            raise ConfigError(msg)
        self.max_bytes = max_bytes
        self.codec = codec
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, ChunkKV | bytes] = OrderedDict()
        self._bytes = 0
        self._evictions = 0
        self._warned_small = False

    def _get(self, key: str) -> ChunkKV | None:
        return self._read(key, shared=False)

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return [self._read(k, shared=True) for k in keys]

    def _read(self, key: str, *, shared: bool) -> ChunkKV | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if not isinstance(entry, bytes):
                # Copy under the lock so a concurrent put/evict cannot race the read. A shared read hands out the
                # stored tensors themselves: entries are never modified in place (put replaces, evict drops).
                out = entry if shared else _clone(entry)
        if isinstance(entry, bytes):
            return self._decode_or_drop(key, entry)
        return self._check_spec(key, out)

    def _put(self, key: str, chunk: ChunkKV) -> None:
        chunk.validate()
        entry: ChunkKV | bytes = _clone(chunk) if self.codec == "native" else serde.encode(chunk, self.codec)
        self._insert(key, entry)

    def _insert(self, key: str, entry: ChunkKV | bytes) -> None:
        size = _entry_nbytes(entry)
        with self._lock:
            self._pop(key)
            if self.max_bytes is not None and size > self.max_bytes:
                if not self._warned_small:  # once: every later entry of this size is dropped as well
                    self._warned_small = True
                    logger.warning("MemoryStore: an entry of %d bytes exceeds max_bytes=%d, so it is not kept (nor any "
                                   "other that large): raise max_bytes to hold at least one chunk's cache", size,
                                   self.max_bytes)
                logger.debug("MemoryStore: entry %s (%d bytes) exceeds max_bytes=%d; not cached", key, size,
                             self.max_bytes)
                return
            self._entries[key] = entry
            self._bytes += size
            self._evict()

    def _get_bytes(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or isinstance(entry, bytes):
                return entry
            out = _clone(entry)
        return serde.encode(out)

    def _put_bytes(self, key: str, data: bytes) -> None:
        if self.codec == "native":
            self._put(key, serde.decode(data))  # native entries are held as tensors
            return
        self._insert(key, data)

    def _evict(self) -> None:
        """Drop least-recently-used entries until the budget holds (caller holds the lock)."""
        if self.max_bytes is None:
            return
        while self._bytes > self.max_bytes and self._entries:
            old_key, old = self._entries.popitem(last=False)
            self._bytes -= _entry_nbytes(old)
            self._evictions += 1
            logger.debug("MemoryStore: evicted %s", old_key)

    def _pop(self, key: str) -> bool:
        old = self._entries.pop(key, None)
        if old is None:
            return False
        self._bytes -= _entry_nbytes(old)
        return True

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def _delete(self, key: str) -> bool:
        with self._lock:
            return self._pop(key)

    def _iter_keys(self) -> Iterator[str]:
        with self._lock:
            keys = list(self._entries)
        return iter(keys)

    def _usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._entries), self._bytes

    def stats(self) -> StoreStats:
        """Base counters plus max_bytes and evictions."""
        out = super().stats()
        with self._lock:
            out.update({"max_bytes": self.max_bytes, "evictions": self._evictions})
        return out

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes!r}, codec={self.codec!r})"
