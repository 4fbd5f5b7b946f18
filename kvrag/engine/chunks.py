"""A chunk's identity as it travels from a retriever to the engine: text, cache key, token ids (and its cache).

Framework retrievers and postprocessors find a request's chunks; the engine tokenizes and keys them once
(:meth:`kvrag.engine.engine.KVRAGEngine.identify` / :meth:`~kvrag.engine.engine.KVRAGEngine.ensure`) and hands
back :class:`RegisteredChunk` objects. Passed on to :meth:`~kvrag.engine.engine.KVRAGEngine.plan`, their stored
ids are spliced in without re-tokenizing, the cache is fetched by key without re-hashing, and a cache the chunk
already holds (``ensure(..., fetch=True)``) is used without asking the store again.

A key and ids are only trusted by an engine whose ``key_space`` (model, tokenizer, codec, conditioning prefix)
matches the one that computed them, so a chunk registered through one engine never makes another reuse a cache
that is not its own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from kvrag.kv.chunk import ChunkKV


@dataclasses.dataclass(frozen=True)
class RegisteredChunk:
    """A chunk text as it appears in the prompt, with what an engine derived from it.

    Attributes:
        text: the exact text the prompt contains.
        key: its cache key (None: not derived yet).
        token_ids: its token ids as cached (None: not derived yet).
        space: the ``key_space`` of the engine that derived ``key`` and ``token_ids``.
        kv: the chunk's canonical cache when the caller already holds it (not part of equality; never kept in
            process-wide tables, only in a request's scope).
    """

    text: str
    key: str | None = None
    token_ids: tuple[int, ...] | None = None
    space: str | None = None
    kv: ChunkKV | None = dataclasses.field(default=None, compare=False, repr=False)

    def identity(self) -> RegisteredChunk:
        """This chunk without the held cache (what long-lived tables may keep)."""
        return self if self.kv is None else dataclasses.replace(self, kv=None)

    def derived_by(self, space: str) -> bool:
        """True when ``key`` and ``token_ids`` were derived in ``space`` (so they can be used as they are)."""
        return self.space == space and self.key is not None and self.token_ids is not None


def texts_not_one_str(texts: object, what: str) -> None:
    """A str is a sequence of its characters: refuse one where a list of texts is expected, instead of taking
    every character for a chunk."""
    if isinstance(texts, str):
        msg = f"{what} must be a list of texts, got one str ({texts[:40]!r}): wrap it in a list, [text]"
        raise ConfigError(msg)


__all__ = ["RegisteredChunk", "texts_not_one_str"]
