"""FallbackStore: keep serving when the store fails (Redis down, disk full) by computing caches on demand.

Wraps another store. While the inner store works it is a transparent pass-through. When an operation raises
:class:`~kvrag.errors.StoreError`, the failure is logged once (a WARNING naming the store and the error), reads
answer "miss", writes are dropped and ``contains`` is False, so callers compute what they need and answer without
the store. For ``retry_s`` seconds after a failure the inner store is not touched at all (no connect timeouts per
request); then the next operation tries it again, and the first success logs that the store is back. A store that
only refuses writes (full, read-only) keeps serving reads meanwhile: only its writes are skipped.

:class:`~kvrag.engine.engine.KVRAGEngine` puts one in front of its store unless ``on_store_error="raise"``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from kvrag.config import ON_STORE_ERROR  # "recompute" | "raise"
from kvrag.errors import ConfigError, StoreError
from kvrag.kv.chunk import ChunkKV
from kvrag.store.base import KVStore, StoreStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

WRITES = frozenset({"put", "delete"})
"""Operations that change the store: a store that refuses them (full: Redis ``maxmemory`` with ``noeviction``, a
read-only replica, a full disk) may still answer reads."""


class FallbackStore(KVStore):
    """A store that degrades to "always miss, drop writes" while ``inner`` fails, and recovers by itself.

    Args:
        inner: the real store.
        retry_s: after a failure, seconds during which ``inner`` is skipped before it is tried again.

    Attributes not defined here (``root``, ``url``, ``codec`` ...) are read from ``inner``.

    A store that fails only in part (one Redis Cluster master down: keys on the other masters still work)
    alternates between failing and working; such outages are announced with a WARNING at most once per
    :attr:`WARN_EVERY_S` seconds (the ones in between, and their recoveries, log at INFO; ``stats()["outages"]``
    counts them all).
    """

    WARN_EVERY_S = 60.0

    def __init__(self, inner: KVStore, *, retry_s: float = 2.0) -> None:
        super().__init__(expected_spec=None)
        if not retry_s >= 0:
            msg = f"FallbackStore retry_s must be >= 0 seconds, got {retry_s!r}"
            raise ConfigError(msg)
        self.inner = inner
        self.retry_s = float(retry_s)
        self._state = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._errors = 0
        self._outages = 0
        self._skipped = 0
        self._last_error = ""
        self._warned_at: float | None = None
        self._outage_warned = False
        self._writes_only = False  # the outage so far is writes refused: reads still go to the store

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        """True while the inner store is considered down."""
        with self._state:
            return self._down_since is not None

    def mark_down(self, op: str, error: BaseException) -> None:
        """Record a failure of ``op`` (logs the warning once per outage)."""
        now = time.monotonic()
        with self._state:
            self._errors += 1
            self._retry_at = now + self.retry_s
            self._last_error = f"{op}: {error}"
            first = self._down_since is None
            self._writes_only = op in WRITES and (first or self._writes_only)
            loud = False
            if first:
                self._down_since = now
                self._outages += 1
                loud = self._warned_at is None or now - self._warned_at >= self.WARN_EVERY_S
                self._outage_warned = loud
                if loud:
                    self._warned_at = now
        if first and not loud:
            logger.info("KV store %r failing again (%s): %s -- outage %d within %.0f s of the last warning (a partial "
                        "outage, e.g. one Redis Cluster node down?); computing caches on demand", self.inner, op,
                        error, self._outages, self.WARN_EVERY_S)
        elif first:
            logger.warning(
                "KV store %r failed (%s): %s -- continuing WITHOUT the store: caches are computed on demand "
                "and not saved until it works again (retrying every %.3g s; set on_store_error='raise' to fail "
                "instead)", self.inner, op, error, self.retry_s,
            )
        else:
            logger.debug("KV store %r still failing (%s): %s", self.inner, op, error)

    def _mark_up(self) -> None:
        with self._state:
            since = self._down_since
            self._down_since = None
        if since is not None:
            level = logging.WARNING if self._outage_warned else logging.INFO
            logger.log(level, "KV store %r works again after %.1f s; using it again", self.inner,
                       time.monotonic() - since)

    def _call(self, op: str, fn: Callable[[], T], default: T, skipped: Callable[[], T] | None = None) -> T:
        """``fn()`` on the inner store; ``default`` when it fails, or ``skipped()`` (else ``default``) while it is
        skipped."""
        write = op in WRITES
        with self._state:
            reads_go = self._writes_only and not write  # a store that refuses writes still serves what it holds
            skip = self._down_since is not None and time.monotonic() < self._retry_at and not reads_go
            if skip:
                self._skipped += 1
        if skip:
            return default if skipped is None else skipped()
        try:
            out = fn()
        except StoreError as e:
            self.mark_down(op, e)
            partial = e.partial  # what a tiered store's front tier found before its back failed
            if op == "get" and partial is not None and isinstance(default, list) and len(partial) == len(default):
                return cast("T", partial)
            return default
        if not reads_go:  # a read that works says nothing about the writes that failed
            self._mark_up()
        return out

    # ---- primitives --------------------------------------------------------------------------------------------
    def _front(self, keys: Sequence[str], shared: bool) -> list[ChunkKV | None]:
        """While the store is skipped: what a tiered store's front tier (memory) holds, else nothing."""
        from kvrag.store.tiered import TieredStore

        if isinstance(self.inner, TieredStore):
            return self.inner.front.get_many(keys, shared=shared)
        return [None] * len(keys)

    def _get(self, key: str) -> ChunkKV | None:
        return self._call("get", lambda: self.inner.get(key), None, lambda: self._front([key], False)[0])

    def _get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return self._call("get", lambda: self.inner.get_many(keys), [None] * len(keys),
                          lambda: self._front(keys, False))

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return self._call("get", lambda: self.inner.get_many(keys, shared=True), [None] * len(keys),
                          lambda: self._front(keys, True))

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self._call("put", lambda: self.inner.put(key, chunk), None)

    def _put_many(self, items: Sequence[tuple[str, ChunkKV]]) -> None:
        self._call("put", lambda: self.inner.put_many(items), None)

    def _get_bytes(self, key: str) -> bytes | None:
        return self._call("get", lambda: self.inner.get_bytes(key), None)

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._call("put", lambda: self.inner.put_bytes(key, data), None)

    def _contains(self, key: str) -> bool:
        return self._call("contains", lambda: self.inner.contains(key), False)

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._call("contains", lambda: self.inner.contains_many(keys), [False] * len(keys))

    def _delete(self, key: str) -> bool:
        return self._call("delete", lambda: self.inner.delete(key), False)

    def _iter_keys(self) -> Iterator[str]:
        none: list[str] = []
        return iter(self._call("iter_keys", lambda: list(self.inner.iter_keys()), none))

    def _usage(self) -> tuple[int, int]:
        s = self._call("stats", self.inner.stats, StoreStats(entries=0, bytes=0))
        return int(s.get("entries") or 0), int(s.get("bytes") or 0)

    def stats(self) -> StoreStats:
        """The inner store's stats (when reachable) plus ``degraded``, ``store_errors``, ``outages``, ``skipped``."""
        inner = self._call("stats", self.inner.stats, None)
        out: StoreStats = inner.copy() if inner is not None else StoreStats(
            backend=type(self.inner).__name__, entries=None, bytes=None)
        with self._state:
            out.update({
                "fallback_hits": self._hits, "fallback_misses": self._misses, "degraded": self._down_since is not None,
                "store_errors": self._errors, "outages": self._outages, "skipped": self._skipped,
                "last_store_error": self._last_error,
            })
        return out

    def codecs(self) -> frozenset[str]:
        return self.inner.codecs()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class lacks; "inner" itself must exist (not during unpickling/init).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FallbackStore({self.inner!r}, retry_s={self.retry_s})"


def with_fallback(store: KVStore, on_error: str = "recompute", *, retry_s: float = 2.0) -> KVStore:
    """``store`` behind a :class:`FallbackStore` for ``on_error="recompute"``; unchanged for ``"raise"``.

    Raises:
        ConfigError: ``store`` is not a :class:`KVStore` (a URL or path: the message names how to open it).
    """
    if not isinstance(store, KVStore):
        msg = (f"expected a KVStore, got {type(store).__name__} {store!r:.80}; open a URL or path with "
               "KVRAGEngine.from_pretrained(loaded, store=URL) or kvrag.store.store_from_url(URL)")
        raise ConfigError(msg)
    if on_error not in ON_STORE_ERROR:
        msg = f"on_store_error must be one of {list(ON_STORE_ERROR)}, got {on_error!r}"
        raise ConfigError(msg)
    if on_error == "raise" or isinstance(store, FallbackStore):
        return store
    return FallbackStore(store, retry_s=retry_s)


def open_store(url: str, on_error: str = "recompute", **opts: Any) -> tuple[KVStore, StoreError | None]:
    """Open the store at ``url``; with ``on_error="recompute"`` a Redis server that is down does not stop us.

    Returns:
        (store, the start-up error or None). When Redis cannot be reached at start and ``on_error`` is
        ``"recompute"``, the store is created without a connection check (it connects once the server is up)
        and the error is returned so the caller can mark its :class:`FallbackStore` down.

    Raises:
        StoreError: with ``on_error="raise"``, or for backends that cannot start without their medium.
    """
    from kvrag.store.factory import store_from_url

    if on_error not in ON_STORE_ERROR:
        msg = f"on_store_error must be one of {list(ON_STORE_ERROR)}, got {on_error!r}"
        raise ConfigError(msg)
    try:
        return store_from_url(url, **opts), None
    except StoreError as e:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if on_error == "raise" or not (scheme.startswith("redis") or scheme == "unix"):
            raise
        return store_from_url(url, check_connection=False, **opts), e


__all__ = ["ON_STORE_ERROR", "FallbackStore", "open_store", "with_fallback"]
