"""TieredStore: a fast front tier (usually memory) over a durable back tier (disk or Redis)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvrag.errors import StoreError
from kvrag.kv.chunk import ChunkKV
from kvrag.store.base import KVStore, StoreStats


class TieredStore(KVStore):
    """Read-through, write-through pair of stores.

    ``get`` reads ``front``; on a miss it reads ``back`` and populates ``front``. ``put`` writes ``back`` first
    (so a failed durable write is never masked by a cached copy) and then ``front``. Integrity checks, corrupt
    drops and ``expected_spec`` filtering happen inside each tier; bind both tiers to the same spec.

    Args:
        front: the fast tier (e.g. MemoryStore).
        back: the durable tier (e.g. DiskStore, RedisStore).
    """

    def __init__(self, front: KVStore, back: KVStore) -> None:
        super().__init__(expected_spec=None)
        self.front = front
        self.back = back

    def _get(self, key: str) -> ChunkKV | None:
        chunk = self.front.get(key)
        if chunk is not None:
            return chunk
        chunk = self.back.get(key)
        if chunk is not None:
            # The front tier stores its own copy, so the chunk returned here stays the caller's alone.
            self.front.put(key, chunk)
        return chunk

    def _get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return self._read_many(keys, shared=False)

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return self._read_many(keys, shared=True)

    def _read_many(self, keys: Sequence[str], *, shared: bool) -> list[ChunkKV | None]:
        out = self.front.get_many(keys, shared=shared)
        missing = [i for i, c in enumerate(out) if c is None]
        if missing:
            try:
                found = self.back.get_many([keys[i] for i in missing])
            except StoreError as e:  # the front tier's hits still stand (FallbackStore answers with them)
                e.partial = list(out)
                raise
            fill: list[tuple[str, ChunkKV]] = []
            for i, c in zip(missing, found, strict=True):
                if c is not None:
                    out[i] = c
                    fill.append((keys[i], c))
            if fill:
                self.front.put_many(fill)
        return out

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self.back.put(key, chunk)
        self.front.put(key, chunk)

    def _put_many(self, items: Sequence[tuple[str, ChunkKV]]) -> None:
        self.back.put_many(items)
        self.front.put_many(items)

    def _get_bytes(self, key: str) -> bytes | None:
        # The back tier is the source of truth; the front only holds copies.
        data = self.back.get_bytes(key)
        return data if data is not None else self.front.get_bytes(key)

    def _put_bytes(self, key: str, data: bytes) -> None:
        self.back.put_bytes(key, data)
        self.front.delete(key)  # an older front copy must not shadow the new entry

    def _contains(self, key: str) -> bool:
        return self.front.contains(key) or self.back.contains(key)

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        out = self.front.contains_many(keys)
        rest = [i for i, ok in enumerate(out) if not ok]
        for i, ok in zip(rest, self.back.contains_many([keys[i] for i in rest]), strict=True):
            out[i] = ok
        return out

    def _delete(self, key: str) -> bool:
        in_front = self.front.delete(key)
        in_back = self.back.delete(key)
        return in_front or in_back

    def _iter_keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for tier in (self.back, self.front):
            for k in tier.iter_keys():
                if k not in seen:
                    seen.add(k)
                    yield k

    def _usage(self) -> tuple[int, int]:
        b = self.back.stats()
        return b.get("entries") or 0, b.get("bytes") or 0

    def stats(self) -> StoreStats:
        """Overall counters plus ``front_*``/``back_*`` hits and misses and each tier's full stats."""
        front, back = self.front.stats(), self.back.stats()
        # The back tier is the source of truth for size; the front holds copies of a subset.
        out: StoreStats = {"backend": type(self).__name__, "entries": back.get("entries"), "bytes": back.get("bytes"),
                           **self._counters()}
        out["corrupt_dropped"] += front["corrupt_dropped"] + back["corrupt_dropped"]
        out["foreign_skipped"] += front["foreign_skipped"] + back["foreign_skipped"]
        out.update({"front_hits": front["hits"], "front_misses": front["misses"], "back_hits": back["hits"],
                    "back_misses": back["misses"], "tiers": {"front": front, "back": back}})
        return out

    def codecs(self) -> frozenset[str]:
        return self.front.codecs() | self.back.codecs()

    def close(self) -> None:
        """Close both tiers."""
        try:
            self.front.close()
        finally:
            self.back.close()

    def __repr__(self) -> str:
        return f"TieredStore(front={self.front!r}, back={self.back!r})"
