"""The CacheRepair training corpus, streamed: a byte-offset index of a passage-group JSONL and a dataset of pairs.

The corpus is streamed: an index keeps byte offsets only, and each example is built (by a
:class:`~kvrag.repair.pairs.PairBuilder`) or read from the optional on-disk pair cache (one safetensors file per
document, written atomically, pinned by a manifest of the builder's identity) when it is asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from kvrag.errors import ConfigError
from kvrag.repair.pairs import PAIR_FORMAT_VERSION, PairBuilder, PairedExample
from kvrag.repair.records import DocumentGroup, PairManifest

log = logging.getLogger(__name__)


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def group_split(group_id: str, eval_modulus: int = 50) -> str:
    """'eval' for about 1/eval_modulus of the groups (by a hash of the id), else 'train'. Deterministic."""
    return "eval" if _hash64("split|" + group_id) % eval_modulus == 0 else "train"


def _check_group(g: object, where: str) -> None:
    """ConfigError naming ``where`` unless ``g`` is a corpus group: an object whose ``passages`` is a list of strings
    and whose ``titles``, when given, is a list of as many."""
    form = 'expected {"titles": [...], "passages": [...]}'
    if not isinstance(g, dict):
        raise ConfigError(f"{where} is a JSON {type(g).__name__}, not an object; {form}")
    passages, titles = g.get("passages"), g.get("titles")
    if not isinstance(passages, list) or not all(isinstance(p, str) or p is None for p in passages):
        raise ConfigError(f"{where}: 'passages' must be a list of strings, got {type(passages).__name__}; {form}")
    if titles is not None and (not isinstance(titles, list) or len(titles) != len(passages)):
        n = len(titles) if isinstance(titles, list) else type(titles).__name__
        raise ConfigError(f"{where}: 'titles' must be a list with one title per passage ({len(passages)}), got {n}")


class CorpusIndex:
    """Byte offsets of the usable groups of one split of a JSONL corpus, in a fixed hash order.

    Only offsets and ids are kept in memory; groups are read from disk on demand.

    Args:
        path: JSONL file.
        split: 'train', 'eval' or 'all'.
        eval_modulus: about 1/eval_modulus of the groups are held aside for 'eval' (see :func:`group_split`).
        max_groups: keep the first ``max_groups`` of the split in hash order (a fixed pseudo-random subset).
        min_passages: skip groups with fewer passages.
        sources: keep only groups whose ``source`` is in this set (None: all).
    """

    def __init__(self, path: str | os.PathLike[str], split: str = "train", *, eval_modulus: int = 50,
                 max_groups: int | None = None, min_passages: int = 2, sources: Iterable[str] | None = None) -> None:
        if split not in ("train", "eval", "all"):
            msg = f"split must be 'train', 'eval' or 'all', got {split!r}"
            raise ConfigError(msg)
        self.path = Path(path)
        if not self.path.is_file():
            msg = f"corpus {self.path} not found; expected a JSONL file of {{\"titles\": [...], \"passages\": [...]}}"
            raise ConfigError(msg)
        keep = set(sources) if sources is not None else None
        entries: list[tuple[int, int, str]] = []
        with self.path.open("rb") as f:
            lineno = 0
            while True:
                off = f.tell()
                line = f.readline()
                if not line:
                    break
                lineno += 1
                if not line.strip():
                    continue
                try:
                    g = json.loads(line)
                except ValueError as e:
                    msg = f"{self.path}:{lineno} is not valid JSON: {e}"
                    raise ConfigError(msg) from e
                _check_group(g, f"{self.path}:{lineno}")
                gid = str(g.get("id", f"line-{lineno}"))
                if keep is not None and g.get("source") not in keep:
                    continue
                if len([p for p in g.get("passages") or [] if p and p.strip()]) < min_passages:
                    continue
                if split != "all" and group_split(gid, eval_modulus) != split:
                    continue
                entries.append((_hash64("order|" + gid), off, gid))
        entries.sort()
        if max_groups is not None:
            entries = entries[:max_groups]
        self.offsets = [e[1] for e in entries]
        self.ids = [e[2] for e in entries]
        self.split = split

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> DocumentGroup:
        with self.path.open("rb") as f:
            f.seek(self.offsets[i])
            g = json.loads(f.readline())
        g.setdefault("id", self.ids[i])
        return g


class PairDataset:
    """Paired examples of a :class:`CorpusIndex`, built on demand, optionally memoized on disk.

    Args:
        index: the groups.
        builder: how a group becomes an example.
        cache_dir: directory for the pair cache (one safetensors file per document, written atomically; a
            ``manifest.json`` pins the builder identity). None: rebuild on every access.
        cache_dtype: storage dtype of cached stale/delta ('float16' halves disk use; 'float32' is exact).
    """

    def __init__(self, index: CorpusIndex, builder: PairBuilder, cache_dir: str | os.PathLike[str] | None = None,
                 cache_dtype: str = "float16") -> None:
        self.index = index
        self.builder = builder
        dtypes = {"float16": torch.float16, "float32": torch.float32}
        if cache_dtype not in dtypes:
            msg = f"cache_dtype must be 'float16' or 'float32', got {cache_dtype!r}"
            raise ConfigError(msg)
        self.cache_dtype = dtypes[cache_dtype]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self._check_manifest({**builder.identity(), "cache_dtype": cache_dtype})

    def _check_manifest(self, ident: PairManifest) -> None:
        assert self.cache_dir is not None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / "manifest.json"
        if path.is_file():
            have = json.loads(path.read_text())
            if have != ident:
                diff = sorted(k for k in set(have) | set(ident) if have.get(k) != ident.get(k))
                msg = (f"the pair cache {self.cache_dir} was built with different settings ({', '.join(diff)}); "
                       "use another --pairs directory or delete this one")
                raise ConfigError(msg)
        else:
            _atomic_write_text(path, json.dumps(ident, indent=2, sort_keys=True))

    def __len__(self) -> int:
        return len(self.index)

    def _cache_path(self, i: int) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(self.index.ids[i].encode()).hexdigest()[:20]
        return self.cache_dir / self.index.split / f"{key}.safetensors"

    def is_cached(self, i: int) -> bool:
        p = self._cache_path(i)
        return p is not None and p.is_file()

    def __getitem__(self, i: int) -> PairedExample:
        if not 0 <= i < len(self):
            raise IndexError(i)
        path = self._cache_path(i)
        if path is not None and path.is_file():
            try:
                return _load_pair(path)
            except Exception as e:  # a corrupt entry is reported, dropped and recomputed
                log.warning("dropping unreadable cached pair %s: %s", path, e)
                path.unlink(missing_ok=True)
        ex = self.builder.build(self.index.read(i))
        if ex is None:
            msg = f"group {self.index.ids[i]!r} does not make a document of >= {self.builder.min_chunks} chunks"
            raise ConfigError(msg)
        if path is not None:
            dtype = _save_pair(path, ex, self.cache_dtype)
            # return what a later read returns, so that training does not depend on whether the pair was cached
            ex = dataclasses.replace(ex, stale=ex.stale.to(dtype).float(), delta=ex.delta.to(dtype).float())
        return ex


def _save_pair(path: Path, ex: PairedExample, dtype: torch.dtype) -> torch.dtype:
    """Write one pair atomically; returns the dtype used (float32 when float16 would overflow)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    if dtype == torch.float16 and max(ex.stale.abs().max().item(), ex.delta.abs().max().item()) > 6e4:
        dtype = torch.float32  # out of float16 range: keep this document exact
    tensors = {
        "token_ids": ex.token_ids.contiguous(),
        "chunk_index": ex.chunk_index.contiguous(),
        "stale": ex.stale.to(dtype).contiguous(),
        "delta": ex.delta.to(dtype).contiguous(),
    }
    tmp = str(_tmp_sibling(path))
    try:
        save_file(tensors, tmp, metadata={"group_id": ex.group_id, "format_version": str(PAIR_FORMAT_VERSION),
                                          "num_exact": str(ex.num_exact), "lead_kind": ex.lead_kind})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dtype


def _load_pair(path: Path) -> PairedExample:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in ("token_ids", "chunk_index", "stale", "delta")}
    return PairedExample(t["token_ids"], t["chunk_index"], t["stale"].float(), t["delta"].float(),
                         meta.get("group_id", ""), num_exact=int(meta.get("num_exact", 0)),
                         lead_kind=meta.get("lead_kind", ""))


def _tmp_sibling(path: Path) -> Path:
    """A unique temp path next to ``path`` (created later with the umask's permissions, unlike mkstemp's 0600)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _tmp_sibling(path)
    tmp.write_text(text)
    os.replace(tmp, path)


__all__ = ["CorpusIndex", "PairDataset", "group_split"]
