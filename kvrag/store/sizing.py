"""Storage size: bytes per token per codec, what a collection costs per store, and the size of a stored collection.

Entry bytes come from :func:`kvrag.store.serde.encode` itself (header + safetensors payload of token ids, K, V and,
for int8, the fp32 scales), so the figures are what a store holds, not an estimate of the tensors alone. Per store:

* ``memory://`` (codec native) keeps the tensors: K + V + token ids; with another codec it keeps the entry bytes.
* ``file://`` keeps one file per entry: entry bytes, rounded up to the filesystem block (4 KiB assumed).
* ``redis://`` keeps one string per entry: entry bytes + the key (``kvrag:`` + 64 hex) + Redis' per-key overhead
  and allocator rounding (:data:`REDIS_OVERHEAD`, measured on redis-server 7.0 with jemalloc;
  see docs/architecture.md#storage-size).
  Redis Cluster spreads the same total over its masters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from kvrag.kv.chunk import ChunkKV
from kvrag.kv.spec import KVSpec
from kvrag.store import serde

if TYPE_CHECKING:
    from kvrag.store.base import KVStore

CODECS = ("float32", "float16", "bfloat16", "int8")
FILE_BLOCK = 4096
REDIS_OVERHEAD = {"float32": 1.12, "float16": 1.12, "bfloat16": 1.12, "int8": 1.05}
"""Redis ``used_memory`` growth per entry / entry bytes, measured for 256-token entries of the default model's layout
(redis-server 7.0.15, jemalloc: large strings round up to size classes 4 per power of two; 72-token entries: 1.16
and 1.09)."""


def entry_bytes(spec: KVSpec, tokens: int, codec: str) -> int:
    """Exact stored bytes of one entry of ``tokens`` tokens with ``codec``."""
    shape = (spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim)  # [L, H_kv, T, D]
    z = torch.zeros(shape, dtype=spec.torch_dtype)
    chunk = ChunkKV(token_ids=torch.zeros(tokens, dtype=torch.long), keys=z, values=z.clone(), spec=spec)
    return len(serde.encode(chunk, codec))


class CodecRow(TypedDict):
    """One codec's row of :func:`codec_table`."""

    codec: str
    raw_bytes_per_token: int
    bytes_per_token: float
    entry_bytes: int
    memory_bytes: int
    file_bytes: int
    redis_bytes: int


class CollectionSize(TypedDict, total=False):
    """:func:`collection_size`: a store's size, its sampled entry's layout and, with an index, its projection."""

    backend: str | None
    entries: int
    bytes: int
    bytes_per_entry: float | None
    codec: str
    spec: dict[str, int | str]
    sampled_entry_tokens: int
    bytes_per_token: float | None
    chunks: int
    tokens: int
    store_bytes_per_index_token: float | None
    projected_100k_chunks_bytes: int


def codec_table(spec: KVSpec, tokens_per_chunk: int, chunks: int = 100_000,
                codecs: Sequence[str] = CODECS) -> list[CodecRow]:
    """Bytes per token and the cost of ``chunks`` chunks of ``tokens_per_chunk`` tokens, per codec and store.

    Returns:
        One row per codec: ``codec``, ``raw_bytes_per_token`` (K + V elements x element size), ``bytes_per_token``
        (stored, header and scales included), ``entry_bytes``, and ``memory_bytes`` / ``file_bytes`` /
        ``redis_bytes`` for the whole collection.
    """
    rows: list[CodecRow] = []
    for c in codecs:
        concrete = serde.resolve_codec(c, spec)
        e = entry_bytes(spec, tokens_per_chunk, c)
        elt = 1 if concrete == "int8" else torch.empty((), dtype=serde.DTYPES[concrete]).element_size()
        raw = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elt
        mem = raw * tokens_per_chunk + 8 * tokens_per_chunk if concrete == spec.dtype else e
        rows.append({
            "codec": concrete,
            "raw_bytes_per_token": raw,
            "bytes_per_token": e / tokens_per_chunk,
            "entry_bytes": e,
            "memory_bytes": mem * chunks,
            "file_bytes": math.ceil(e / FILE_BLOCK) * FILE_BLOCK * chunks,
            "redis_bytes": int(e * REDIS_OVERHEAD.get(concrete, 1.12)) * chunks,
        })
    return rows


def human(n: float) -> str:
    """Bytes as B / KB / MB / GB / TB (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def collection_size(store: KVStore, index_tokens: Sequence[int] | None = None, sample: int = 1) -> CollectionSize:
    """Size of what ``store`` holds (for ``kvrag store stats``).

    Args:
        store: a KVStore.
        index_tokens: token counts of a persisted index's chunks (their caches are expected in ``store``).
        sample: entries whose headers are read for the spec, codec and tokens per entry.

    Returns:
        ``entries``, ``bytes``, ``bytes_per_entry``, the sampled ``spec`` / ``codec`` / ``bytes_per_token`` and,
        with ``index_tokens``, the index's ``chunks``, ``tokens`` and ``projected_100k_chunks_bytes`` at its mean
        chunk length (this codec, this store's per-entry overhead).
    """
    st = store.stats()
    entries, nbytes = st.get("entries") or 0, st.get("bytes") or 0
    out: CollectionSize = {"backend": st.get("backend"), "entries": entries, "bytes": nbytes,
                           "bytes_per_entry": nbytes / entries if entries else None}
    headers = []
    for k in store.iter_keys():
        data = store.get_bytes(k)
        if data is not None:
            headers.append(serde.decode_header(data)[0])
        if len(headers) >= sample:
            break
    if headers:
        h = headers[0]
        spec = KVSpec.from_dict(h["spec"])
        e = entry_bytes(spec, int(h["num_tokens"]), h["codec"]) if int(h["num_tokens"]) else None
        out.update({"codec": h["codec"],
                    "spec": {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
                             "head_dim": spec.head_dim, "dtype": spec.dtype},
                    "sampled_entry_tokens": int(h["num_tokens"]),
                    "bytes_per_token": (e / int(h["num_tokens"])) if e else None})
    if index_tokens:
        tokens = int(sum(index_tokens))
        out.update({"chunks": len(index_tokens), "tokens": tokens,
                    "store_bytes_per_index_token": nbytes / tokens if tokens else None})
        if entries and tokens:
            out["projected_100k_chunks_bytes"] = int(nbytes / entries * 100_000)
    return out


__all__ = ["CODECS", "codec_table", "collection_size", "entry_bytes", "human"]
