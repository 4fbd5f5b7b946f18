"""The tables of chunk texts adapters and ``kvrag serve`` look prompts up in (:class:`RecentChunks`), and the
forms a chunk may be given in (:data:`ChunkLike`, :func:`normalize`). :mod:`kvrag.adapters` holds the process-wide
table and the request scope."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from kvrag.engine.chunks import RegisteredChunk
from kvrag.errors import ConfigError

ChunkLike = str | RegisteredChunk | tuple[str, str | None]


def as_chunk(c: object) -> RegisteredChunk:
    """One chunk as a :class:`RegisteredChunk`: a text, a (text, key) pair, a RegisteredChunk or a look-alike."""
    if isinstance(c, RegisteredChunk):
        return c
    if isinstance(c, str):
        return RegisteredChunk(c)
    if isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str):
        return RegisteredChunk(c[0], c[1])
    text = getattr(c, "text", None)
    if isinstance(text, str):  # a look-alike (e.g. a pickled older RegisteredChunk): keep what it says of itself
        return RegisteredChunk(text, getattr(c, "key", None))
    msg = f"a chunk must be a str, a (text, key) tuple or a RegisteredChunk, got {type(c).__name__}"
    raise ConfigError(msg)


def normalize(chunks: Iterable[ChunkLike]) -> tuple[RegisteredChunk, ...]:
    """``chunks`` (or one chunk) as RegisteredChunks, in order, without whitespace-only texts and repeats."""
    if isinstance(chunks, (str, RegisteredChunk)):  # one chunk, not its characters
        chunks = (chunks,)
    seen: set[str] = set()
    out = []
    for c in chunks:
        rc = as_chunk(c)
        if rc.text.strip() and rc.text not in seen:
            seen.add(rc.text)
            out.append(rc)
    return tuple(out)


class RecentChunks:
    """Thread-safe, bounded LRU of recently registered chunk texts (process-wide).

    :meth:`found_in` looks every remembered text up in a prompt. A table of many texts (``kvrag serve`` keeps up to
    100K) is indexed by each text's first :data:`PREFIX` characters, so a lookup reads the prompt once (a dict probe
    per position) instead of searching the prompt once per text.

    Args:
        max_entries: most texts kept.
        max_chars: most characters kept in total.
    """

    PREFIX = 16
    """Characters of a text's start that index it (shorter texts are searched for one by one)."""
    SCAN_BELOW = 64
    """Tables of fewer texts are searched text by text (no faster with the index)."""

    def __init__(self, max_entries: int = 2048, max_chars: int = 8_000_000) -> None:
        if max_entries < 1 or max_chars < 1:
            msg = f"RecentChunks needs max_entries >= 1 and max_chars >= 1, got {max_entries}, {max_chars}"
            raise ConfigError(msg)
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._items: OrderedDict[str, RegisteredChunk] = OrderedDict()  # text -> identity (never a held cache)
        self._chars = 0
        self._stamp: dict[str, int] = {}  # text -> when it was last added (recency order of found_in)
        self._clock = 0
        self._by_prefix: dict[str, set[str]] = {}  # a text's first PREFIX characters -> the texts starting so
        self._short: set[str] = set()  # texts shorter than PREFIX

    def _index(self, text: str) -> None:
        if len(text) < self.PREFIX:
            self._short.add(text)
        else:
            self._by_prefix.setdefault(text[: self.PREFIX], set()).add(text)

    def _unindex(self, text: str) -> None:
        self._stamp.pop(text, None)
        if len(text) < self.PREFIX:
            self._short.discard(text)
            return
        group = self._by_prefix.get(text[: self.PREFIX])
        if group is not None:
            group.discard(text)
            if not group:
                del self._by_prefix[text[: self.PREFIX]]

    def add(self, chunks: Iterable[ChunkLike]) -> None:
        with self._lock:
            for c in normalize(chunks):
                c = c.identity()
                self._clock += 1
                self._stamp[c.text] = self._clock
                if c.text in self._items:
                    self._items.move_to_end(c.text)
                    if c.key is not None:
                        self._items[c.text] = c
                    continue
                self._items[c.text] = c
                self._chars += len(c.text)
                self._index(c.text)
            while self._items and (len(self._items) > self.max_entries or self._chars > self.max_chars):
                old, _ = self._items.popitem(last=False)
                self._chars -= len(old)
                self._unindex(old)

    def found_in(self, prompt: str) -> tuple[RegisteredChunk, ...]:
        """The remembered chunks whose exact text occurs in ``prompt`` (most recent first)."""
        with self._lock:
            if len(self._items) < self.SCAN_BELOW:
                items = list(self._items.items())
                return tuple(c for t, c in reversed(items) if t in prompt)
            found = {t for t in self._short if t in prompt}
            k, groups = self.PREFIX, self._by_prefix
            for i in range(len(prompt) - k + 1):
                group = groups.get(prompt[i : i + k])
                if group:
                    found.update(t for t in group if t not in found and prompt.startswith(t, i))
            ordered = sorted(found, key=self._stamp.__getitem__, reverse=True)
            return tuple(self._items[t] for t in ordered)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._chars = 0
            self._stamp.clear()
            self._by_prefix.clear()
            self._short.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


__all__ = ["ChunkLike", "RecentChunks", "as_chunk", "normalize"]
