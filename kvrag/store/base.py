"""KVStore: the abstract chunk-cache store, keyed by a ChunkKey digest (64 lowercase hex chars).

Public methods (``get``/``put``/``contains``/``delete``/``iter_keys`` and their batched forms) live here and do
the work every backend must do identically: validate keys (which also rules out path traversal through a key),
count hits and misses, and drop corrupt entries. Backends implement the underscored primitives.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TypedDict
from urllib.parse import unquote, urlsplit, urlunsplit

from kvrag.errors import CacheCorruptError, CacheMismatchError, ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.keys import is_valid_digest
from kvrag.kv.spec import KVSpec
from kvrag.store import serde

logger = logging.getLogger(__name__)


_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "ssl_password", "access_key",
                            "secret_key", "sas_token"})
"""Query parameters whose values :func:`redact_url` hides (redis-py takes ``?password=`` as well as user-info)."""


def redact_url(url: str) -> str:
    """The URL with any password -- in its user-info or a query parameter such as ``?password=`` -- replaced by
    '***' (safe for logs, error messages and files others read)."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            host = f"[{host}]" if ":" in host else host
            port = f":{parts.port}" if parts.port is not None else ""
            parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}{port}")
        pairs = [p.partition("=") for p in parts.query.split("&")] if parts.query else []
        secret = [bool(eq and v and unquote(k).lower() in _SECRET_PARAMS) for k, eq, v in pairs]
        if any(secret):
            parts = parts._replace(query="&".join("".join((k, eq, "***" if hide else v))
                                                  for (k, eq, v), hide in zip(pairs, secret, strict=True)))
        return url if parts.password is None and not any(secret) else urlunsplit(parts)
    except ValueError:
        return "<unparseable url>"


def has_secret(url: str) -> bool:
    """Whether ``url`` carries a password (what :func:`redact_url` hides)."""
    return redact_url(url) != url


def is_redacted(url: str) -> bool:
    """Whether ``url`` is one :func:`redact_url` hid a password in (it cannot be connected to as it is)."""
    return "***" in url and has_secret(url.replace("***", "x"))


def check_key(key: object) -> str:
    """Return ``key`` when it is a well-formed storage key, else raise ConfigError.

    Raises:
        ConfigError: naming the bad key and what a key looks like.
    """
    if not isinstance(key, str) or len(key) != 64 or not is_valid_digest(key):
        msg = f"invalid store key {key!r}: expected a 64-char lowercase hex digest (use ChunkKey(...).digest)"
        raise ConfigError(msg)
    return key



class StoreCounters(TypedDict):
    """What every store counts: lookups answered and missed, entries dropped as corrupt or skipped as foreign."""

    hits: int
    misses: int
    corrupt_dropped: int
    foreign_skipped: int


class StoreStats(TypedDict, total=False):
    """:meth:`KVStore.stats`: the counters, the store's size and what a backend adds (each key it does not keep is
    absent)."""

    hits: int
    misses: int
    corrupt_dropped: int
    foreign_skipped: int
    backend: str
    entries: int | None  # None: the store is unreachable (a fallback store's inner one)
    bytes: int | None
    max_bytes: int | None  # a memory store's bound and its evictions
    evictions: int
    front_hits: int  # a tiered store's tiers
    front_misses: int
    back_hits: int
    back_misses: int
    tiers: dict[str, StoreStats]
    fallback_hits: int  # a fallback store's own counters and state
    fallback_misses: int
    degraded: bool
    store_errors: int
    outages: int
    skipped: int
    last_store_error: str


class KVStore(abc.ABC):
    """A key -> ChunkKV store. A miss, a corrupt entry and a foreign entry all read as ``None``.

    Corrupt entries (truncated, bad checksum, bad magic) are logged, deleted and counted in
    ``stats()["corrupt_dropped"]``. Entries whose spec differs from ``expected_spec`` belong to another model:
    they are logged and counted in ``stats()["foreign_skipped"]`` but left in place.

    Args:
        expected_spec: when set, only entries with exactly this KVSpec are served.
    """

    def __init__(self, *, expected_spec: KVSpec | None = None) -> None:
        self.expected_spec = expected_spec
        self._stats_lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._corrupt_dropped = 0
        self._foreign_skipped = 0

    # ---- backend primitives -------------------------------------------------------------------------------
    @abc.abstractmethod
    def _get(self, key: str) -> ChunkKV | None:
        """Return the entry (fresh tensors) or None; backends storing bytes use :meth:`_decode_or_drop`."""

    @abc.abstractmethod
    def _put(self, key: str, chunk: ChunkKV) -> None:
        """Store ``chunk`` under ``key``, replacing any previous entry atomically."""

    @abc.abstractmethod
    def _contains(self, key: str) -> bool:
        """True when an entry exists (its integrity is only checked by ``get``)."""

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        """Batched read for callers that never modify the result; in-memory backends skip their copy."""
        return self._get_many(keys)

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Batched existence check; backends with a round trip per call override it (one round trip for all)."""
        return [self._contains(k) for k in keys]

    @abc.abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove the entry; True when one existed."""

    @abc.abstractmethod
    def _iter_keys(self) -> Iterator[str]:
        """Yield stored keys (any order)."""

    @abc.abstractmethod
    def _usage(self) -> tuple[int, int]:
        """Return (entries, bytes) currently held."""

    def _get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return [self._get(k) for k in keys]

    def _put_many(self, items: Sequence[tuple[str, ChunkKV]]) -> None:
        for k, c in items:
            self._put(k, c)

    def _get_bytes(self, key: str) -> bytes | None:
        """Raw entry bytes; the default re-encodes what ``_get`` returns (backends storing bytes override it)."""
        chunk = self._get(key)
        return None if chunk is None else serde.encode(chunk)

    def _put_bytes(self, key: str, data: bytes) -> None:
        """Store encoded entry bytes; the default decodes them and stores the chunk."""
        self._put(key, serde.decode(data))

    # ---- public API -----------------------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        """Fetch a chunk cache; None on a miss or when the entry is corrupt/foreign (never served).

        Raises:
            ConfigError: malformed key.
            StoreError: the backend failed (unreachable, permission).
        """
        out = self._get(check_key(key))
        self._count(hits=int(out is not None), misses=int(out is None))
        return out

    def get_many(self, keys: Iterable[str], *, shared: bool = False) -> list[ChunkKV | None]:
        """Batched :meth:`get`; results are in the order of ``keys``.

        Args:
            shared: the caller only reads the returned chunks, so an in-memory backend may return its stored
                tensors instead of copies (the engine's query path: chunks are rotated into the request's own
                buffer, never modified). Backends that decode on every read ignore it. Never modify a chunk read
                with ``shared=True``.
        """
        ks = [check_key(k) for k in keys]
        out = (self._get_many_shared(ks) if shared else self._get_many(ks)) if ks else []
        found = sum(c is not None for c in out)
        self._count(hits=found, misses=len(out) - found)
        return out

    def put(self, key: str, chunk: ChunkKV) -> None:
        """Store ``chunk`` under ``key`` (overwrites). The store keeps its own copy.

        Raises:
            ConfigError: malformed key or a chunk whose tensors do not match its spec.
            StoreError: the backend failed (disk full, unreachable).
        """
        self._put(check_key(key), chunk)

    def put_many(self, items: Iterable[tuple[str, ChunkKV]]) -> None:
        """Batched :meth:`put`."""
        its = [(check_key(k), c) for k, c in items]
        if its:
            self._put_many(its)

    def get_bytes(self, key: str) -> bytes | None:
        """The stored entry's bytes exactly as held (header + payload, NOT verified), or None on a miss.

        For maintenance (``gc``, ``migrate``, ``verify``) that must see foreign or damaged entries too; serving
        code uses :meth:`get`. Not counted in hits/misses.

        Raises:
            ConfigError: malformed key.
            StoreError: the backend failed.
        """
        return self._get_bytes(check_key(key))

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store already-encoded entry bytes (as produced by :func:`kvrag.store.serde.encode`) under ``key``.

        The bytes are written as they are (their codec is kept); they are verified when read. Used by
        :func:`kvrag.store.maintenance.migrate_store`.

        Raises:
            ConfigError: malformed key, or data that does not start with the kvrag entry magic.
            StoreError: the backend failed.
        """
        raw = bytes(data)
        if not raw.startswith(serde.MAGIC):
            msg = f"put_bytes({key!r}): data is not a kvrag KV entry (missing the {serde.MAGIC!r} magic)"
            raise ConfigError(msg)
        self._put_bytes(check_key(key), raw)

    def contains(self, key: str) -> bool:
        """True when an entry is stored under ``key`` (a later ``get`` may still drop it as corrupt)."""
        return self._contains(check_key(key))

    def contains_many(self, keys: Iterable[str]) -> list[bool]:
        """Batched :meth:`contains`; results are in the order of ``keys``."""
        ks = [check_key(k) for k in keys]
        return self._contains_many(ks) if ks else []

    def __contains__(self, key: object) -> bool:
        return self.contains(key)  # type: ignore[arg-type]

    def delete(self, key: str) -> bool:
        """Remove the entry under ``key``; True when one existed."""
        return self._delete(check_key(key))

    def iter_keys(self) -> Iterator[str]:
        """Yield every stored key once (temp files and foreign names are skipped)."""
        return self._iter_keys()

    def stats(self) -> StoreStats:
        """Counters: entries, bytes, hits, misses, corrupt_dropped, foreign_skipped (plus backend extras)."""
        entries, nbytes = self._usage()
        return {"backend": type(self).__name__, "entries": entries, "bytes": nbytes, **self._counters()}

    def codecs(self) -> frozenset[str]:
        """The codecs this store writes entries in (``"native"``: the tensors as computed). A lossy codec's entries
        are keyed apart (:meth:`kvrag.engine.caching.ChunkCaching.chunk_key`): a reader asking for exact caches never
        gets ``int8``-rounded ones."""
        return frozenset({str(getattr(self, "codec", "native"))})

    def keyed_codecs(self) -> frozenset[str]:
        """The codecs a chunk key names besides the KV dtype: :meth:`codecs` other than ``"native"``."""
        return self.codecs() - {"native"}

    def close(self) -> None:
        """Release connections/handles. Idempotent; the default holds nothing to release."""
        return None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- helpers for backends ---------------------------------------------------------------------------
    def _counters(self) -> StoreCounters:
        with self._stats_lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "corrupt_dropped": self._corrupt_dropped,
                "foreign_skipped": self._foreign_skipped,
            }

    def _count(self, *, hits: int = 0, misses: int = 0, corrupt: int = 0, foreign: int = 0) -> None:
        with self._stats_lock:
            self._hits += hits
            self._misses += misses
            self._corrupt_dropped += corrupt
            self._foreign_skipped += foreign

    def _decode_or_drop(self, key: str, data: bytes | bytearray | memoryview) -> ChunkKV | None:
        """Decode stored bytes; drop (delete) corrupt entries and skip foreign ones, returning None for both."""
        try:
            return serde.decode(data, expected_spec=self.expected_spec)
        except CacheMismatchError as e:
            logger.warning("%s: skipping foreign KV entry %s (not served, kept): %s", type(self).__name__, key, e)
            self._count(foreign=1)
            return None
        except CacheCorruptError as e:
            logger.warning("%s: dropping corrupt KV entry %s (will be recomputed): %s", type(self).__name__, key, e)
            self._count(corrupt=1)
            try:
                self._delete(key)
            except Exception:  # deleting is best effort; the entry is not served either way
                logger.exception("%s: could not delete corrupt KV entry %s", type(self).__name__, key)
            return None

    def _check_spec(self, key: str, chunk: ChunkKV) -> ChunkKV | None:
        """For backends holding decoded chunks: None (and a log line) when the chunk's spec is foreign."""
        if self.expected_spec is not None and chunk.spec != self.expected_spec:
            diff = serde.spec_diff(chunk.spec, self.expected_spec)
            logger.warning(
                "%s: skipping foreign KV entry %s (not served, kept): differs in %s", type(self).__name__, key, diff
            )
            self._count(foreign=1)
            return None
        return chunk
