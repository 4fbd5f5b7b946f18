"""RedisStore: chunk caches as Redis string values (standalone, TLS or cluster).

redis-py is an optional dependency (``pip install 'kvrag[redis]'``); it is imported when a RedisStore is created,
and this module itself is imported only on demand (by :func:`kvrag.store.store_from_url` or ``kvrag.store``'s lazy
attribute), so ``import kvrag`` never imports redis.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from kvrag.errors import ConfigError, StoreError
from kvrag.extras import require
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.spec import KVSpec
from kvrag.store import serde
from kvrag.store.base import KVStore, redact_url

if TYPE_CHECKING:
    from types import ModuleType

    import redis

logger = logging.getLogger(__name__)

MAX_TTL_S = 1e15
"""The longest ``ttl_s`` (~31.7 million years): Redis adds a PX expiry in milliseconds to its clock as a signed 64-bit
integer (~9.2e15 s), so ``inf`` or ``1e20`` only failed at the first write, after the caches were computed."""
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_PLAIN_SCHEMES = ("redis", "rediss", "unix")


def _import_redis() -> ModuleType:
    redis = require("redis", "redis", "RedisStore")
    require("redis.cluster", "redis", "RedisStore")  # Redis Cluster support (redis-py >= 4.1)
    return redis


def _glob_escape(s: str) -> str:
    for ch in "\\*?[]":
        s = s.replace(ch, "\\" + ch)
    return s


class RedisStore(KVStore):
    """One Redis string per key: ``<prefix><64-hex key>`` -> entry bytes (header + safetensors payload).

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS), ``unix:///path.sock``,
            ``redis+cluster://host:port`` or ``rediss+cluster://``.
        ttl_s: expire entries this many seconds after they are written (None: never).
        prefix: namespace for keys, so several users/models can share a server.
        codec: see :func:`kvrag.store.serde.encode`.
        expected_spec: only entries with this KVSpec are served (see :class:`KVStore`).
        socket_timeout: seconds before a connect/command fails.
        client: an existing redis-py client to use instead of connecting to ``url``.
        check_connection: PING the server now and raise when it cannot be reached. With False the store is
            created without a server (redis-py connects on the first command, and again after the server comes
            back); :class:`~kvrag.engine.engine.KVRAGEngine` uses this to start while Redis is down.

    Credentials and TLS go in the URL: ``redis://user:password@host:6379/0`` (ACL user, or ``:password@`` for
    ``requirepass``), ``rediss://host:6380/0`` for TLS, with redis-py's ``ssl_*`` query parameters, e.g.
    ``rediss://host:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ssl/ca.pem`` (and ``ssl_certfile`` /
    ``ssl_keyfile`` for client certificates). Passwords never appear in logs or error messages.

    Raises:
        ImportError: redis-py is not installed.
        ConfigError: bad URL, codec or ttl.
        StoreError: the server cannot be reached (the message names the URL without its password).
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        ttl_s: float | None = None,
        prefix: str = "kvrag:",
        codec: str = "native",
        *,
        expected_spec: KVSpec | None = None,
        socket_timeout: float = 5.0,
        client: redis.Redis | redis.RedisCluster | None = None,
        check_connection: bool = True,
    ) -> None:
        super().__init__(expected_spec=expected_spec)
        if codec not in serde.CODECS:
            msg = f"unknown KV codec {codec!r}; expected one of {list(serde.CODECS)}"
            raise ConfigError(msg)
        if ttl_s is not None and not 0 < ttl_s <= MAX_TTL_S:  # NaN fails too; inf would fail at the first write
            msg = (f"RedisStore ttl_s must be a positive number of seconds up to {MAX_TTL_S:.0e} (Redis keeps expiry "
                   f"times in milliseconds as 64-bit integers) or None for no expiry, got {ttl_s!r}")
            raise ConfigError(msg)
        self.url = redact_url(url)
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.codec = codec
        self._redis = _import_redis()
        self._client: Any = client if client is not None else self._connect(url, socket_timeout)
        if check_connection:
            with self._errors("PING"):
                self._client.ping()
            self._check_not_a_cluster_node(url)

    def _connect(self, url: str, socket_timeout: float) -> Any:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in _CLUSTER_SCHEMES and scheme not in _PLAIN_SCHEMES:
            valid = sorted([*_PLAIN_SCHEMES, *_CLUSTER_SCHEMES])
            msg = f"RedisStore URL {self.url!r} has scheme {scheme!r}; expected one of {valid}"
            raise ConfigError(msg)
        kw = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
        db = urlsplit(url).path.strip("/")
        if scheme in _PLAIN_SCHEMES and scheme != "unix" and db and not db.isdigit():
            # redis-py takes a path that is not a number for database 0 without a word
            msg = f"Redis database {db!r} in {self.url!r} is not a number; expected e.g. redis://localhost:6379/0"
            raise ConfigError(msg)
        try:
            with self._errors("connect"):
                if scheme in _CLUSTER_SCHEMES:
                    plain = _CLUSTER_SCHEMES[scheme] + url[len(scheme) :]
                    return self._redis.cluster.RedisCluster.from_url(plain, **kw)
                return self._redis.Redis.from_url(url, **kw)
        except (ValueError, TypeError) as e:
            msg = f"bad Redis URL {self.url!r}: {e}; expected e.g. redis://localhost:6379/0"
            raise ConfigError(msg) from e

    def _check_not_a_cluster_node(self, url: str) -> None:
        """A plain URL on a Redis Cluster node reaches one node: reads of keys on the others fail (MOVED) and the
        store looks empty or broken. Refuse it, naming the cluster scheme (a server that hides INFO passes)."""
        if isinstance(self._client, self._redis.cluster.RedisCluster):
            return
        try:
            enabled = int(self._client.info("cluster").get("cluster_enabled", 0))
        except (self._redis.exceptions.RedisError, ValueError, TypeError):
            return
        if enabled:
            scheme = url.split("://", 1)[0].lower()
            msg = (f"Redis at {self.url} is a Redis Cluster node: use {scheme}+cluster://HOST:PORT (any node) so that "
                   "every key goes to the node that holds it")
            raise ConfigError(msg)

    @contextlib.contextmanager
    def _errors(self, op: str) -> Iterator[None]:
        """Turn redis-py failures into StoreError naming the (redacted) URL and the fix."""
        redis = self._redis
        try:
            yield
        # AuthenticationError subclasses ConnectionError, so it goes first.
        except redis.exceptions.AuthenticationError as e:  # pragma: no cover - needs a password-protected server
            msg = f"Redis at {self.url} rejected the credentials ({op}): {e}; fix user/password in the URL"
            raise StoreError(msg) from e
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            msg = (
                f"cannot reach Redis at {self.url} ({op}): {e}; start the server (e.g. `redis-server`), "
                "or fix the store URL (host, port, TLS via rediss://, cluster via redis+cluster://)"
            )
            raise StoreError(msg) from e
        except (
            redis.exceptions.RedisError,
            getattr(redis.exceptions, "RedisClusterException", redis.exceptions.RedisError),
        ) as e:
            msg = f"Redis at {self.url} failed ({op}): {e}"
            raise StoreError(msg) from e

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _set_kwargs(self) -> dict[str, int]:
        return {} if self.ttl_s is None else {"px": max(1, int(self.ttl_s * 1000))}

    # ---- primitives ------------------------------------------------------------------------------------
    def _get(self, key: str) -> ChunkKV | None:
        with self._errors("GET"):
            data = self._client.get(self._k(key))
        return None if data is None else self._decode_or_drop(key, data)

    def _get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        with self._errors("pipelined GET"):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self._k(k))
            raw = pipe.execute()
        return [None if d is None else self._decode_or_drop(k, d) for k, d in zip(keys, raw, strict=True)]

    def _get_bytes(self, key: str) -> bytes | None:
        with self._errors("GET"):
            data = self._client.get(self._k(key))
        return None if data is None else bytes(data)

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self._put_bytes(key, serde.encode(chunk, self.codec))

    def _put_bytes(self, key: str, data: bytes) -> None:
        with self._errors("SET"):
            self._client.set(self._k(key), data, **self._set_kwargs())

    def _put_many(self, items: Sequence[tuple[str, ChunkKV]]) -> None:
        encoded = [(k, serde.encode(c, self.codec)) for k, c in items]
        with self._errors("pipelined SET"):
            pipe = self._client.pipeline(transaction=False)
            for k, data in encoded:
                pipe.set(self._k(k), data, **self._set_kwargs())
            pipe.execute()

    def _contains(self, key: str) -> bool:
        with self._errors("EXISTS"):
            return bool(self._client.exists(self._k(key)))

    def _contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._errors("pipelined EXISTS"):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(n) for n in pipe.execute()]

    def _delete(self, key: str) -> bool:
        with self._errors("DEL"):
            return bool(self._client.delete(self._k(key)))

    def _iter_keys(self) -> Iterator[str]:
        n = len(self.prefix)
        with self._errors("SCAN"):
            raw = list(self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000))
        for r in raw:
            k = r.decode() if isinstance(r, bytes) else str(r)
            key = k[n:]
            if len(key) == 64 and all(c in "0123456789abcdef" for c in key):
                yield key

    def _usage(self) -> tuple[int, int]:
        keys = list(self._iter_keys())
        if not keys:
            return 0, 0
        with self._errors("pipelined STRLEN"):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(self._k(k))
            sizes = pipe.execute()
        return len(keys), int(sum(sizes))

    def close(self) -> None:
        """Close the client's connections."""
        with contextlib.suppress(Exception):
            self._client.close()

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r}, codec={self.codec!r}, ttl_s={self.ttl_s!r})"
