"""store_from_url: build a KVStore from a URL (the form configs and the CLI use).

=============================================  ==============================================
``memory://``  ``memory://?max_bytes=1e9``     :class:`~kvrag.store.memory.MemoryStore`
``file:///abs/path`` or a plain path           :class:`~kvrag.store.disk.DiskStore` (``/data/kv?codec=int8``)
``redis://host:port/db``, ``rediss://``        :class:`~kvrag.store.redis.RedisStore`
``redis+cluster://host:port``                  RedisStore over ``redis.cluster.RedisCluster``
=============================================  ==============================================

Query parameters ``codec``, ``max_bytes`` (memory), ``ttl_s`` and ``prefix`` (redis) are read from the URL;
keyword options passed to :func:`store_from_url` win over them. New backends register with
:func:`register_store_scheme`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from kvrag.errors import ConfigError
from kvrag.store.base import KVStore, redact_url

StoreFactory = Callable[[str, dict[str, Any]], KVStore]
_REGISTRY: dict[str, StoreFactory] = {}
_INT_OPTS = ("max_bytes",)
_FLOAT_OPTS = ("ttl_s",)
# kvrag's own query parameters; everything else in a redis URL is passed on to redis-py.
_KVRAG_OPTS = ("codec", "max_bytes", "ttl_s", "prefix")


def register_store_scheme(scheme: str, factory: StoreFactory) -> None:
    """Register ``factory(url, opts) -> KVStore`` for URLs starting with ``scheme://``."""
    _REGISTRY[scheme.lower()] = factory


def valid_schemes() -> list[str]:
    """Every URL scheme :func:`store_from_url` accepts."""
    return sorted(_REGISTRY)


def _parse_number(name: str, value: object) -> Any:
    if not isinstance(value, str):
        return value
    try:
        if name in _INT_OPTS:
            try:
                return int(value)
            except ValueError:
                f = float(value)  # allow 1e9
                if not f.is_integer():
                    raise
                return int(f)
        if name in _FLOAT_OPTS:
            return float(value)
    except ValueError as e:
        msg = f"store option {name}={value!r} is not a number"
        raise ConfigError(msg) from e
    return value


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
"""A store URL's scheme; a string without one is a plain filesystem path (a DiskStore's directory)."""


def _split_opts(url: str, opts: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Move kvrag's query parameters from ``url`` into the options (explicit ``opts`` take precedence)."""
    parts = urlsplit(url)
    kept, merged = [], {}
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in _KVRAG_OPTS:
            if k in merged:
                msg = f"store URL {url!r} gives {k!r} twice; give it once"
                raise ConfigError(msg)
            merged[k] = v
        else:
            kept.append((k, v))
    merged.update(opts)
    merged = {k: _parse_number(k, v) for k, v in merged.items()}
    return urlunsplit(parts._replace(query=urlencode(kept))), merged


def _no_other_opts(rest: str, url: str) -> None:
    """ConfigError for query parameters left in ``rest`` (a memory:// or file:// URL: only Redis takes its own)."""
    other = [k for k, _ in parse_qsl(urlsplit(rest).query, keep_blank_values=True)]
    if other:
        msg = (f"store URL {url!r}: unknown option {', '.join(map(repr, other))}; kvrag's store options are "
               f"{', '.join(_KVRAG_OPTS)}, as each store takes them (e.g. memory://?max_bytes=2000000000)")
        raise ConfigError(msg)


def _memory(url: str, opts: dict[str, Any]) -> KVStore:
    from kvrag.store.memory import MemoryStore

    rest, opts = _split_opts(url, opts)
    _no_other_opts(rest, url)
    if urlsplit(rest).netloc or urlsplit(rest).path not in ("", "/"):
        msg = f"memory store URL {url!r} takes no host or path; expected memory:// or memory://?max_bytes=N"
        raise ConfigError(msg)
    return MemoryStore(**opts)


def _file_path(rest: str, url: str) -> str:
    """The absolute directory of a ``file://`` URL (``rest``: ``url`` without kvrag's options)."""
    parts = urlsplit(rest)
    if parts.netloc not in ("", "localhost"):
        msg = f"file store URL {url!r} names host {parts.netloc!r}; expected file:///absolute/path (three slashes)"
        raise ConfigError(msg)
    path = unquote(parts.path)
    if not path.startswith("/"):
        msg = f"file store URL {url!r} needs an absolute path; expected file:///absolute/path"
        raise ConfigError(msg)
    return path


def _file(url: str, opts: dict[str, Any]) -> KVStore:
    from kvrag.store.disk import DiskStore

    rest, opts = _split_opts(url, opts)
    _no_other_opts(rest, url)
    return DiskStore(_file_path(rest, url), **opts)


_NO_SLASHES = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)(.*)$", re.DOTALL)
_OPTS_TAIL = re.compile(r"^(.*)\?((?:[A-Za-z_]+=[^&=?/]*)(?:&[A-Za-z_]+=[^&=?/]*)*)$", re.DOTALL)


def _plain_path(url: str) -> tuple[str, dict[str, Any]]:
    """A plain path's directory and its ``?options`` (``/data/kv?codec=int8``). A known scheme without ``//``
    (``memory:``, ``redis:host``) or a bare scheme name (``memory``) is an error: it would silently have been a
    directory of that name."""
    m = _NO_SLASHES.match(url)
    bare = url.strip().lower().rstrip(":")
    scheme = m.group(1).lower() if m is not None else bare
    if scheme in _REGISTRY and (m is not None or bare == url.strip().lower()):
        tail = m.group(2).lstrip("/") if m is not None else ""
        msg = (f"store URL {url!r} is missing '//' after {scheme!r}: write {scheme}://{tail} (a directory of that name: "
               f"./{url})")
        raise ConfigError(msg)
    t = _OPTS_TAIL.match(url)
    if t is None:
        return url, {}
    path, query = t.group(1), t.group(2)
    pairs = parse_qsl(query, keep_blank_values=True)
    opts = dict(pairs)
    if len(opts) < len(pairs):
        msg = f"store path {url!r} gives an option twice; give each once"
        raise ConfigError(msg)
    unknown = sorted(set(opts) - set(_KVRAG_OPTS))
    if unknown:
        msg = (f"store path {url!r} has options {unknown} a disk store does not take; it takes codec "
               f"(e.g. {path}?codec=int8)")
        raise ConfigError(msg)
    return path, {k: _parse_number(k, v) for k, v in opts.items()}


def local_directory(url: str) -> str | None:
    """The directory a file store URL names (``file:///abs/path[?options]`` or a plain path), as
    :func:`store_from_url` opens it; None for a store that is not a local directory (memory, Redis ...).

    Raises:
        ConfigError: a malformed ``file://`` URL (the message says what is expected)."""
    m = _SCHEME.match(url)
    if m is None:
        return _plain_path(url)[0]
    return _file_path(_split_opts(url, {})[0], url) if m.group(1).lower() == "file" else None


def missing_folders(url: str) -> list[Path]:
    """The folders a local store at ``url`` would create when opened, innermost first (none for other stores)."""
    path, made = local_directory(url), []
    p = None if path is None else Path(path).expanduser().resolve()
    while p is not None and not p.exists():
        made.append(p)
        p = p.parent
    return made


def _redis(url: str, opts: dict[str, Any]) -> KVStore:
    from kvrag.store.redis import RedisStore  # imported here so `import kvrag` never imports redis

    rest, opts = _split_opts(url, opts)
    return RedisStore(rest, **opts)


for _scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix"):
    register_store_scheme(_scheme, _redis)
register_store_scheme("memory", _memory)
register_store_scheme("file", _file)


def store_from_url(url: str, **opts: Any) -> KVStore:
    """Build a store from a URL.

    Args:
        url: ``memory://[?max_bytes=N]``, ``file:///abs/path``, a plain filesystem path, ``redis://host:port/db``,
            ``rediss://...``, ``redis+cluster://host:port`` (see the module docstring).
        **opts: backend keyword arguments (``codec``, ``expected_spec``, ``max_bytes``, ``ttl_s``, ``prefix`` ...).

    Raises:
        ConfigError: unknown scheme (the message lists the valid ones) or a malformed URL/option.
        StoreError: the backend cannot be opened (unwritable directory, unreachable server).
    """
    if not isinstance(url, str) or not url:
        msg = f"store URL must be a non-empty string, got {url!r}; expected e.g. memory://, file:///path, redis://..."
        raise ConfigError(msg)
    m = _SCHEME.match(url)
    if m is None:
        # A plain path (relative or absolute) is a directory for a DiskStore.
        from kvrag.store.disk import DiskStore

        path, given = _plain_path(url)
        try:
            return DiskStore(path, **{**given, **opts})
        except TypeError as e:
            msg = f"bad options for a disk store {url!r} (it takes codec, e.g. {path}?codec=int8): {e}"
            raise ConfigError(msg) from e
    scheme = m.group(1).lower()
    factory = _REGISTRY.get(scheme)
    if factory is None:
        msg = f"unknown store URL scheme {scheme!r} in {redact_url(url)!r}; valid schemes: {valid_schemes()} (or a plain path)"
        raise ConfigError(msg)
    try:
        return factory(url, dict(opts))
    except TypeError as e:
        msg = f"bad options for a {scheme}:// store: {e}"
        raise ConfigError(msg) from e
