"""Exception hierarchy. Every error raised at a boundary says what was expected, what was got and the fix."""

from __future__ import annotations

from typing import Any


class KVRAGError(Exception):
    """Base class of every error kvrag raises on purpose."""


class ConfigError(KVRAGError, ValueError):
    """A configuration value or argument is invalid."""


class UnsupportedModelError(KVRAGError):
    """The model cannot be served with position-independent KV reuse (e.g. no RoPE, dynamic NTK)."""


class CacheCorruptError(KVRAGError):
    """A stored cache entry failed its integrity checks; it is dropped and recomputed, never served."""


class CacheMismatchError(KVRAGError):
    """A stored entry belongs to another model, tokenizer, dtype or format version."""


class StoreError(KVRAGError):
    """A storage backend failed (unreachable, disk full, permission).

    Attributes:
        partial: for a read of several keys, what was found before the failure (one entry per key, None where
            nothing was), when the store could tell -- a tiered store's front tier; None otherwise.
    """

    partial: list[Any] | None = None


class ContextLengthError(KVRAGError, ValueError):
    """A prompt or chunk does not fit the model's context window."""


class EngineBusyError(KVRAGError):
    """A request was not admitted within ``EngineConfig.admission_timeout_s``: the KV memory bound stayed spent."""


class EngineClosedError(KVRAGError):
    """The engine was closed (``engine.close()``) before or while the request ran."""


class RequestCancelledError(KVRAGError):
    """The request was cancelled (its :class:`kvrag.engine.runner.CancelToken`, or its stream closed)."""


class CheckpointMismatchError(KVRAGError):
    """A repairer checkpoint was trained for another model."""


class LeaseExceededError(KVRAGError, RuntimeError):
    """A request's KV buffer, sized once when its lease was taken (prompt + ``reserve`` new tokens), was asked to
    hold more positions: a leased buffer never grows (:mod:`kvrag.engine.lease`)."""
