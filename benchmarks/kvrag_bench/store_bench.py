"""``kvrag bench store``: read/write throughput of each KV store backend and the size of each codec.

Chunks are random K/V tensors of the model's KV layout ([L, H_kv, T, D] at its dtype). For every backend and
codec, ``chunks`` entries are written (``put``) and read back (``get``) ``repeats`` times under fresh keys.
Throughput is the *logical* KV bytes moved (the uncompressed tensors at the model dtype) per second, so codecs
are compared on what a request needs; the stored bytes per token and the codec's round-trip relative error are
reported next to it. The file backend reads from a warm page cache (the benchmark cannot drop the OS cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.spec import KVSpec
from kvrag.store import serde
from kvrag_bench import aggregate

log = logging.getLogger(__name__)

BACKENDS = ("memory", "file", "tiered", "redis")


@dataclasses.dataclass
class StoreBenchConfig:
    """Settings of ``kvrag bench store``.

    Attributes:
        backends: subset of :data:`BACKENDS`; ``redis`` and ``tiered`` (memory over redis, or over file without a
            redis URL) use ``redis_url``.
        codecs: :data:`kvrag.store.serde.CODECS` entries.
        dir: directory for file-backend entries (default: a temporary directory, removed afterwards).
        chunks, chunk_tokens: entries per measurement and tokens per entry.
        repeats: measurements per backend and codec (the median is reported).
        spec: the KV layout; None derives it from ``model``.
    """

    backends: Sequence[str] = ("memory", "file")
    codecs: Sequence[str] = ("native", "float16", "bfloat16", "int8")
    redis_url: str | None = None
    dir: str | None = None
    chunks: int = 32
    chunk_tokens: int = 256
    repeats: int = 3
    out: str = "runs/store"
    model: str | None = None
    seed: int = 0
    spec: KVSpec | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad:
            msg = f"unknown store backend(s) {bad}; valid: {', '.join(BACKENDS)}"
            raise ConfigError(msg)
        bad = [c for c in self.codecs if c not in serde.CODECS]
        if bad:
            msg = f"unknown codec(s) {bad}; valid: {', '.join(serde.CODECS)}"
            raise ConfigError(msg)
        if "redis" in self.backends and not self.redis_url:
            raise ConfigError("the redis backend needs --redis-url redis://host:port/db")
        if min(self.chunks, self.chunk_tokens, self.repeats) < 1:
            raise ConfigError("chunks, chunk_tokens and repeats must be >= 1")


def model_spec(model: str | None) -> KVSpec:
    """The KV layout of a model (loads it once; None: the embedded default)."""
    from kvrag.models import load_model

    return load_model(model).kv_spec()


def random_chunks(spec: KVSpec, n: int, tokens: int, seed: int = 0) -> list[ChunkKV]:
    """``n`` chunks of random K/V [L, H_kv, T, D] (std 1) at ``spec.dtype``."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim)
    out = []
    for _ in range(n):
        k = torch.randn(shape, generator=g).to(spec.torch_dtype)
        v = torch.randn(shape, generator=g).to(spec.torch_dtype)
        ids = torch.randint(0, 1000, (tokens,), generator=g)
        out.append(ChunkKV(token_ids=ids, keys=k, values=v, spec=spec))
    return out


def codec_table(spec: KVSpec, chunk: ChunkKV, codecs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Stored bytes per token and round-trip relative error (||decoded - original|| / ||original||) per codec."""
    out = {}
    t = chunk.num_tokens
    ref = torch.cat([chunk.keys.float().flatten(), chunk.values.float().flatten()])
    for c in codecs:
        data = serde.encode(chunk, c)
        back = serde.decode(data)
        got = torch.cat([back.keys.float().flatten(), back.values.float().flatten()])
        out[c] = {
            "codec": serde.resolve_codec(c, spec),
            "bytes_per_token": len(data) / t,
            "raw_bytes_per_token": spec.bytes_per_token,
            "ratio_vs_raw": len(data) / (t * spec.bytes_per_token),
            "rel_error": float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref)),
        }
    return out


def _open(backend: str, codec: str, cfg: StoreBenchConfig, root: Path) -> Any:
    from kvrag.store.disk import DiskStore
    from kvrag.store.memory import MemoryStore

    if backend == "memory":
        return MemoryStore(codec=codec)
    if backend == "file":
        return DiskStore(str(root / f"{codec}-{uuid.uuid4().hex[:8]}"), codec=codec)
    if backend == "redis":
        from kvrag.store.redis import RedisStore

        return RedisStore(cfg.redis_url or "", codec=codec, prefix=f"kvrag-bench-{uuid.uuid4().hex[:8]}:")
    if backend == "tiered":
        from kvrag.store.tiered import TieredStore

        if cfg.redis_url:
            from kvrag.store.redis import RedisStore

            back: Any = RedisStore(cfg.redis_url, codec=codec, prefix=f"kvrag-bench-{uuid.uuid4().hex[:8]}:")
        else:
            back = DiskStore(str(root / f"tiered-{codec}-{uuid.uuid4().hex[:8]}"), codec=codec)
        return TieredStore(MemoryStore(codec=codec), back)
    msg = f"unknown backend {backend!r}"
    raise ConfigError(msg)


def _keys(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def measure(store: Any, chunks: Sequence[ChunkKV], tag: str) -> dict[str, float]:
    """Write then read ``chunks`` under fresh keys; returns seconds and logical MB/s (1 MB = 1e6 bytes)."""
    keys = _keys(len(chunks), tag)
    logical = sum(c.keys.numel() * c.keys.element_size() + c.values.numel() * c.values.element_size() for c in chunks)
    t = time.perf_counter()
    for k, c in zip(keys, chunks, strict=True):
        store.put(k, c)
    w = time.perf_counter() - t
    t = time.perf_counter()
    got = [store.get(k) for k in keys]
    r = time.perf_counter() - t
    if any(g is None for g in got):
        msg = f"{store!r} lost entries during the benchmark"
        raise RuntimeError(msg)
    for k in keys:
        store.delete(k)
    return {"write_s": w, "read_s": r, "write_mb_s": logical / w / 1e6, "read_mb_s": logical / r / 1e6}


def run_store_bench(cfg: StoreBenchConfig) -> dict[str, Any]:
    """Run the store benchmark; writes ``store.json`` and ``store.md`` into ``cfg.out``; returns the result."""
    from tqdm.auto import tqdm

    spec = cfg.spec or model_spec(cfg.model)
    chunks = random_chunks(spec, cfg.chunks, cfg.chunk_tokens, cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=cfg.dir) as tmp:
        root = Path(tmp)
        combos = [(b, c) for b in cfg.backends for c in cfg.codecs]
        for backend, codec in tqdm(combos, desc="store bench", unit="combo", disable=not cfg.progress):
            store = _open(backend, codec, cfg, root)
            try:
                measure(store, chunks[:2], "warmup")
                runs = [measure(store, chunks, f"{backend}-{codec}-{r}") for r in range(cfg.repeats)]
            finally:
                store.close()
            rows.append({
                "backend": backend, "codec": serde.resolve_codec(codec, spec), "codec_arg": codec,
                **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                "runs": runs,
            })
    result = {
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "spec"},
        **aggregate.environment_info(),
        "spec": spec.to_dict(),
        "chunk_bytes_logical": spec.bytes_per_token * cfg.chunk_tokens,
        "codecs": codec_table(spec, chunks[0], cfg.codecs),
        "backends": rows,
    }
    result = aggregate.jsonable(result)
    aggregate.write_result(out, "store", result, store_markdown(result))
    return result


def store_markdown(result: dict[str, Any]) -> str:
    spec = result.get("spec", {})
    cfg = result.get("config", {})
    lines = [
        "# KV store benchmark", "",
        f"{cfg.get('chunks')} chunks × {cfg.get('chunk_tokens')} tokens, layout L={spec.get('num_layers')} "
        f"H_kv={spec.get('num_kv_heads')} D={spec.get('head_dim')} {spec.get('dtype')}; logical MB/s = uncompressed "
        "K/V bytes per second (1 MB = 10^6 B), median of repeats.", "",
        "| backend | codec | write MB/s | read MB/s |", "|---|---|---:|---:|",
    ]
    for r in result.get("backends", []):
        lines.append(f"| {r['backend']} | {r['codec']} | {r['write_mb_s']:.0f} | {r['read_mb_s']:.0f} |")
    lines += ["", "| codec | bytes/token | raw bytes/token | ratio | round-trip rel. error |", "|---|---:|---:|---:|---:|"]
    for c in result.get("codecs", {}).values():
        lines.append(f"| {c['codec']} | {c['bytes_per_token']:.0f} | {c['raw_bytes_per_token']} | "
                     f"{c['ratio_vs_raw']:.3f} | {c['rel_error']:.2e} |")
    return "\n".join(lines) + "\n"
