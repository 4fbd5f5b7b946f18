"""A persisted RAG index: chunk texts + FAISS vectors + chunk caches in one directory.

Layout of a persist dir::

    DIR/index.json      manifest: model name and fingerprint, embedder, chunk_tokens, format version
    DIR/chunks.jsonl    one line per chunk: {"id", "source", "text", "num_tokens"}
    DIR/vectors.faiss   FAISS inner-product index over normalized chunk embeddings (row i = chunk i)
    DIR/kv/             the default file KV store (unless another --store URL is used)
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from kvrag.errors import ConfigError
from kvrag.extras import require

if TYPE_CHECKING:
    from types import ModuleType

    import faiss
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)
INDEX_FORMAT = 1
DOC_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Chunk:
    id: str
    source: str
    text: str
    num_tokens: int


def _split_word(word: str, count_tokens: Callable[[str], int], chunk_tokens: int) -> list[str]:
    """``word`` cut into the longest character runs of at most ``chunk_tokens`` tokens each (binary search)."""
    out = []
    while word:
        lo, hi = 1, min(len(word), chunk_tokens * 32)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count_tokens(word[:mid]) <= chunk_tokens:
                lo = mid
            else:
                hi = mid - 1
        out.append(word[:lo])
        word = word[lo:]
    return out


def split_text(text: str, count_tokens: Callable[[str], int], chunk_tokens: int) -> list[str]:
    """Greedy paragraph/sentence packing into chunks of at most ``chunk_tokens`` tokens.

    Paragraphs (blank-line separated) are packed together while they fit; an oversized paragraph is split at
    sentence ends, and an oversized sentence at word boundaries. Every chunk ends with a blank line so that chunks
    concatenate into a readable context. Whitespace-only input yields no chunk.
    """
    if chunk_tokens < 8:
        raise ConfigError(f"chunk_tokens must be >= 8, got {chunk_tokens}")
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    units: list[str] = []
    for p in paras:
        if count_tokens(p) <= chunk_tokens:
            units.append(p)
            continue
        sentences = re.split(r"(?<=[.!?])\s+", p)
        for s in sentences:
            if count_tokens(s) <= chunk_tokens:
                units.append(s)
                continue
            words, cur = s.split(), []  # type: list[str], list[str]
            for w in words:
                if cur and count_tokens(" ".join([*cur, w])) > chunk_tokens:
                    units.append(" ".join(cur))
                    cur = []
                if not cur and count_tokens(w) > chunk_tokens:  # one "word" over the limit (a URL, base64, a
                    units.extend(_split_word(w, count_tokens, chunk_tokens))  # table row without spaces)
                    continue
                cur.append(w)
            if cur:
                units.append(" ".join(cur))
    chunks: list[str] = []
    cur_txt = ""
    for u in units:
        cand = f"{cur_txt}\n\n{u}" if cur_txt else u
        if cur_txt and count_tokens(cand) > chunk_tokens:
            chunks.append(cur_txt)
            cur_txt = u
        else:
            cur_txt = cand
    if cur_txt:
        chunks.append(cur_txt)
    return [c + "\n\n" for c in chunks]


def read_documents(docs_dir: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(relative path, text) of every .txt/.md file below ``docs_dir``, sorted; non-UTF-8 bytes are replaced."""
    root = Path(docs_dir)
    if not root.is_dir():
        raise ConfigError(f"documents directory {str(root)!r} does not exist or is not a directory")
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix.lower() in DOC_SUFFIXES:
            raw = p.read_bytes()
            text = raw.decode("utf-8", errors="replace")
            if "\ufffd" in text:
                log.warning("%s is not valid UTF-8; undecodable bytes were replaced", p)
            text = "".join(ch for ch in text if ch in "\n\t" or ch.isprintable() or ch == "\r")
            out.append((str(p.relative_to(root)), text))
    if not out:
        raise ConfigError(f"no {'/'.join(DOC_SUFFIXES)} files found under {str(root)!r}")
    return out


def import_faiss() -> ModuleType:
    """The ``faiss`` module.

    Raises:
        ImportError: FAISS is not installed; the message names the extra (``kvrag[faiss]``).
    """
    return require("faiss", "faiss", "kvrag's chunk index (kvrag ingest / kvrag ask)")


class IndexManifest(TypedDict, total=False):
    """``index.json``: what the index was built with (``kvrag ingest``) and its format."""

    model: str
    model_fingerprint: str
    chunk_prefix: str
    chunk_tokens: int
    embedder: str
    store: str | None
    dtype: str
    quantize: str
    format: int
    dim: int


class ChunkIndex:
    """FAISS vectors + chunk texts, persisted in one directory."""

    def __init__(self, chunks: list[Chunk], vectors: faiss.Index, manifest: IndexManifest) -> None:
        self.chunks = chunks
        self.vectors = vectors  # faiss.Index
        self.manifest = manifest

    @staticmethod
    def embed(embedder: SentenceTransformer, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        vecs = embedder.encode(list(texts), batch_size=32, show_progress_bar=progress, normalize_embeddings=True)
        return np.asarray(vecs, dtype="float32")

    @classmethod
    def build(cls, chunks: list[Chunk], embedder: SentenceTransformer, manifest: IndexManifest, progress: bool = False) -> ChunkIndex:
        faiss = import_faiss()

        vecs = cls.embed(embedder, [c.text for c in chunks], progress)
        index = faiss.IndexFlatIP(vecs.shape[1])
        index.add(vecs)
        return cls(chunks, index, {**manifest, "format": INDEX_FORMAT, "dim": int(vecs.shape[1])})

    def save(self, persist: str | os.PathLike[str]) -> None:
        faiss = import_faiss()

        d = Path(persist)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "chunks.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for c in self.chunks:
                f.write(json.dumps(c.__dict__, ensure_ascii=False) + "\n")
        os.replace(tmp, d / "chunks.jsonl")
        faiss.write_index(self.vectors, str(d / "vectors.faiss.tmp"))
        os.replace(d / "vectors.faiss.tmp", d / "vectors.faiss")
        (d / "index.json.tmp").write_text(json.dumps(self.manifest, indent=2, sort_keys=True))
        os.replace(d / "index.json.tmp", d / "index.json")

    @classmethod
    def load(cls, persist: str | os.PathLike[str]) -> ChunkIndex:
        faiss = import_faiss()

        d = Path(persist)
        if not (d / "index.json").exists():
            msg = f"{str(d)!r} is not a kvrag index (no index.json); create it with `kvrag ingest DOCS --persist {d}`"
            if (d / "docstore.json").exists():  # llama-index-postprocessor-kvrag's build_index wrote it
                msg += (f"; it is a LlamaIndex index (load it with llama_index.postprocessor.kvrag.load_index), whose "
                        f"chunk caches the store commands read with --store file://{(d / 'kvcache').resolve()}")
            raise ConfigError(msg)
        manifest = json.loads((d / "index.json").read_text())
        if manifest.get("format") != INDEX_FORMAT:
            raise ConfigError(f"index format {manifest.get('format')} in {d} is not supported (expected {INDEX_FORMAT}); re-ingest")
        with open(d / "chunks.jsonl", encoding="utf-8") as f:
            chunks = [Chunk(**json.loads(line)) for line in f if line.strip()]
        vectors = faiss.read_index(str(d / "vectors.faiss"))
        if vectors.ntotal != len(chunks):
            raise ConfigError(f"index in {d} is inconsistent: {vectors.ntotal} vectors for {len(chunks)} chunks; re-ingest")
        return cls(chunks, vectors, manifest)

    def search(self, embedder: SentenceTransformer, query: str, top_k: int) -> list[tuple[Chunk, float]]:
        if top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {top_k}")
        q = self.embed(embedder, [query])
        scores, idx = self.vectors.search(q, min(top_k, len(self.chunks)))
        return [(self.chunks[i], float(s)) for s, i in zip(scores[0], idx[0], strict=True) if i >= 0]


def make_chunks(docs: Iterable[tuple[str, str]], count_tokens: Callable[[str], int], chunk_tokens: int) -> list[Chunk]:
    out = []
    for source, text in docs:
        for i, c in enumerate(split_text(text, count_tokens, chunk_tokens)):
            out.append(Chunk(id=f"{source}#{i}", source=source, text=c, num_tokens=count_tokens(c)))
    return out
