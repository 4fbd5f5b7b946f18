"""CacheRepair training documents: passage groups rendered into chunk texts and tokenized under a budget.

Corpus: one JSON object a line, ``{"id": ..., "titles": [...], "passages": [...]}`` (``id`` optional). Each group
becomes one ordered multi-chunk document: chunk ``i`` is ``renderer(titles[i], passages[i])`` (by default
``"\\n\\nTitle: {title}\\n{passage}"``, as the benchmark renders context passages), tokenized alone like the engine
tokenizes a chunk, taken in order under a token budget (2-20 chunks). Chunk caches are conditioned on the engine's
prefix (:func:`template_prefix_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvrag.errors import ConfigError
from kvrag.prompting import chat_preamble

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_CHUNK_FORMAT = "\n\nTitle: {title}\n{passage}"
"""How the benchmark renders one retrieved passage into the prompt."""

PER_LEAD = "per-lead"
"""``chunk_format`` value: render each document the way the prompt family of its drawn lead does
(:func:`kvrag.repair.leads.chunk_style`: the bench's "Title:" passages, LlamaIndex's ``title: ...`` nodes joined by a
blank line, LangChain's bare ``page_content`` joined by a blank line)."""


class ChunkRenderer:
    """Render (title, passage) to chunk text with a ``str.format`` template using ``{title}`` and ``{passage}``."""

    def __init__(self, fmt: str = DEFAULT_CHUNK_FORMAT) -> None:
        if "{passage}" not in fmt:
            msg = f"chunk format must contain '{{passage}}' (and may contain '{{title}}'), got {fmt!r}"
            raise ConfigError(msg)
        self.fmt = fmt

    def __call__(self, title: str, passage: str) -> str:
        return self.fmt.format(title=title.strip(), passage=passage.strip())

    @property
    def identity(self) -> str:
        return f"format:{self.fmt}"


Renderer = Callable[[str, str], str]


def renderer_identity(renderer: Renderer) -> str:
    """A string identifying a renderer (part of the pair-cache manifest)."""
    ident = getattr(renderer, "identity", None)
    if isinstance(ident, str):
        return ident
    return f"callable:{getattr(renderer, '__module__', '?')}.{getattr(renderer, '__qualname__', repr(renderer))}"


def template_prefix_ids(tokenizer: PreTrainedTokenizerBase, mode: str = "template") -> tuple[int, ...]:
    """The chunk-conditioning prefix the engine uses (``KVRAGEngine.chunk_prefix_ids``).

    Args:
        mode: 'template' (the chat template's fixed text before a user message; the BOS token without a template)
            or 'none'.
    """
    if mode == "none":
        return ()
    if mode != "template":
        msg = f"chunk prefix mode must be 'template' or 'none', got {mode!r}"
        raise ConfigError(msg)
    pre = chat_preamble(tokenizer)
    return tuple(tokenizer(pre, add_special_tokens=False)["input_ids"]) if pre else ()


def build_document(
    titles: Sequence[str],
    passages: Sequence[str],
    tokenize: Callable[[str], list[int]],
    *,
    renderer: Renderer | None = None,
    max_tokens: int = 1024,
    max_chunks: int = 20,
    min_chunks: int = 2,
    min_chunk_tokens: int = 8,
    separator: str = "",
) -> list[list[int]] | None:
    """Token ids of the ordered chunks of one group under a budget.

    Chunks are taken in order while they fit in ``max_tokens``; to reach ``min_chunks`` the chunk that does not
    fit is cut to the remaining budget (the first chunk is cut so that a second one can follow).

    Args:
        separator: text between two chunks (e.g. LlamaIndex's and LangChain's blank line). It becomes a span of
            its own between the chunks, as the engine plans text between chunks; it counts towards ``max_tokens``
            but not towards the chunk counts.

    Returns:
        ``min_chunks``..``max_chunks`` chunks (plus the separator spans between them) as id lists, or None when the
        group cannot make such a document.
    """
    renderer = renderer or ChunkRenderer()
    sep = list(tokenize(separator)) if separator else []
    chunks: list[list[int]] = []
    n = total = 0  # chunks taken (separators excluded), tokens taken
    for title, passage in zip(titles, passages, strict=False):
        if not passage or not passage.strip():
            continue
        ids = list(tokenize(renderer(title, passage)))
        if not ids:
            continue
        between = sep if n else []  # the separator span before every chunk but the first
        room = max_tokens - total - len(between)
        if n < min_chunks:
            room -= (min_chunk_tokens + len(sep)) * (min_chunks - 1 - n)  # keep room for the required chunks
        if len(ids) > room:
            if n >= min_chunks or room < min_chunk_tokens:
                break
            ids = ids[:room]
        if between:
            chunks.append(list(between))
        chunks.append(ids)
        n += 1
        total += len(between) + len(ids)
        if n >= max_chunks or total >= max_tokens:
            break
    return chunks if n >= min_chunks else None


__all__ = ["DEFAULT_CHUNK_FORMAT", "PER_LEAD", "ChunkRenderer", "Renderer", "build_document", "renderer_identity",
           "template_prefix_ids"]
