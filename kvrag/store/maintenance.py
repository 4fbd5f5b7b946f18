"""Store maintenance: ``verify`` every entry, ``gc`` entries nobody can use, ``migrate`` entries between backends.

These work on any :class:`~kvrag.store.base.KVStore` through its raw-bytes access (``get_bytes``/``put_bytes``), so
they see what serving code never returns: entries of other models, of other format versions and damaged ones.
The ``kvrag store verify|gc|migrate`` commands are thin wrappers over these functions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TypedDict

import torch

from kvrag.errors import CacheCorruptError, CacheMismatchError, StoreError
from kvrag.kv.chunk import ChunkKV
from kvrag.store import serde
from kvrag.store.base import KVStore

logger = logging.getLogger(__name__)

#: Why an entry is unusable, as counted in reports.
CORRUPT = "corrupt"
FORMAT_VERSION = "format_version"
OTHER_MODEL = "other_model"
REASONS = (CORRUPT, FORMAT_VERSION, OTHER_MODEL)


@dataclasses.dataclass(frozen=True)
class EntryStatus:
    """What :func:`inspect_entry` found: ``reason`` is None for a usable entry, else one of :data:`REASONS`."""

    reason: str | None
    detail: str
    model_fingerprint: str | None = None
    chunk: ChunkKV | None = None


def inspect_entry(data: bytes, keep_fingerprints: Iterable[str] | None = None) -> EntryStatus:
    """Classify raw entry bytes: corrupt, another format version, another model, or usable.

    Args:
        data: the bytes a store holds for one key.
        keep_fingerprints: model fingerprints whose entries are wanted; None keeps every model.

    Returns:
        An :class:`EntryStatus`; for a usable entry ``chunk`` holds the decoded (verified) chunk.
    """
    try:
        header, _ = serde.decode_header(data)
    except CacheMismatchError as e:
        return EntryStatus(FORMAT_VERSION, str(e))
    except CacheCorruptError as e:
        return EntryStatus(CORRUPT, str(e))
    spec = header.get("spec")
    fp = spec.get("model_fingerprint") if isinstance(spec, dict) else None
    try:
        chunk = serde.decode(data)
    except (CacheCorruptError, CacheMismatchError) as e:
        return EntryStatus(CORRUPT, str(e), fp)
    keep = None if keep_fingerprints is None else set(keep_fingerprints)
    if keep is not None and fp not in keep:
        return EntryStatus(OTHER_MODEL, f"model fingerprint {fp!r} is not one of {sorted(keep)}", fp, chunk)
    return EntryStatus(None, "ok", fp, chunk)


def _keys(store: KVStore) -> list[str]:
    return sorted(store.iter_keys())


def _progress(items: list[str], desc: str, progress: bool) -> Iterable[str]:
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="entry")


class VerifyRecord(TypedDict):
    """:meth:`VerifyReport.to_dict`."""

    scanned: int
    ok: int
    clean: bool
    bad: dict[str, int]
    bad_keys: dict[str, list[str]]
    models: dict[str, int]


class GCRecord(TypedDict):
    """:meth:`GCReport.to_dict`."""

    dry_run: bool
    scanned: int
    kept: int
    removed: dict[str, int]
    bytes_freed: int
    temp_files_removed: int
    removed_keys: list[str]
    total_removed: int


class MigrateRecord(TypedDict):
    """:meth:`MigrateReport.to_dict`."""

    dry_run: bool
    scanned: int
    copied: int
    bytes_copied: int
    skipped_existing: int
    skipped: dict[str, int]
    failed_keys: list[str]
    ok: bool


@dataclasses.dataclass
class VerifyReport:
    """Result of :func:`verify_store`: entries scanned, usable ones and the unusable ones by reason."""

    scanned: int = 0
    ok: int = 0
    bad: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    models: Counter[str] = dataclasses.field(default_factory=Counter)

    @property
    def clean(self) -> bool:
        return not any(self.bad.values())

    def to_dict(self) -> VerifyRecord:
        return {"scanned": self.scanned, "ok": self.ok, "clean": self.clean,
                "bad": {k: len(v) for k, v in self.bad.items()}, "bad_keys": self.bad, "models": dict(self.models)}


def _scan(
    store: KVStore, keep_fingerprints: Iterable[str] | None, desc: str, progress: bool
) -> Iterator[tuple[str, bytes, EntryStatus]]:
    """(key, raw bytes, status) of every entry still present (entries deleted meanwhile are skipped)."""
    keep = None if keep_fingerprints is None else list(keep_fingerprints)
    for key in _progress(_keys(store), desc, progress):
        data = store.get_bytes(key)
        if data is not None:
            yield key, data, inspect_entry(data, keep)


def verify_store(
    store: KVStore, keep_fingerprints: Iterable[str] | None = None, *, progress: bool = False
) -> VerifyReport:
    """Read and fully check every entry (magic, header, checksums, shapes); nothing is modified.

    Args:
        keep_fingerprints: when given, entries of other models count as bad (``other_model``).
    """
    rep = VerifyReport()
    for key, _data, st in _scan(store, keep_fingerprints, "verifying", progress):
        rep.scanned += 1
        if st.model_fingerprint:
            rep.models[st.model_fingerprint] += 1
        if st.reason is None:
            rep.ok += 1
        else:
            rep.bad.setdefault(st.reason, []).append(key)
            logger.info("verify: %s is unusable (%s): %s", key, st.reason, st.detail)
    return rep


@dataclasses.dataclass
class GCReport:
    """Result of :func:`gc_store`. ``removed`` counts entries by reason (would-be removals with ``dry_run``)."""

    dry_run: bool
    scanned: int = 0
    kept: int = 0
    removed: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    bytes_freed: int = 0
    temp_files_removed: int = 0
    removed_keys: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_removed(self) -> int:
        return sum(self.removed.values())

    def to_dict(self) -> GCRecord:
        return {"dry_run": self.dry_run, "scanned": self.scanned, "kept": self.kept, "removed": dict(self.removed),
                "bytes_freed": self.bytes_freed, "temp_files_removed": self.temp_files_removed,
                "removed_keys": list(self.removed_keys), "total_removed": self.total_removed}


def gc_store(
    store: KVStore,
    keep_fingerprints: Iterable[str] | None = None,
    *,
    dry_run: bool = False,
    progress: bool = False,
) -> GCReport:
    """Delete entries no current model can use: damaged ones, other format versions and (optionally) other models.

    Args:
        store: any store (a TieredStore is collected through both tiers).
        keep_fingerprints: model fingerprints to keep (e.g. ``[engine.loaded.fingerprint]``); entries of every
            other model are removed. None keeps every model's entries (only damage and old formats go).
        dry_run: count what would be removed, delete nothing.
        progress: show a progress bar.

    Returns:
        A :class:`GCReport`; a DiskStore also gets its abandoned temp files removed (``temp_files_removed``).
    """
    rep = GCReport(dry_run=dry_run)
    for key, data, st in _scan(store, keep_fingerprints, "collecting", progress):
        rep.scanned += 1
        if st.reason is None:
            rep.kept += 1
            continue
        rep.removed[st.reason] += 1
        rep.bytes_freed += len(data)
        rep.removed_keys.append(key)
        if dry_run:
            logger.info("gc (dry run): would remove %s (%s): %s", key, st.reason, st.detail)
        else:
            store.delete(key)
            logger.info("gc: removed %s (%s): %s", key, st.reason, st.detail)
    cleanup: Callable[[], int] | None = getattr(store, "cleanup_temp_files", None)
    if cleanup is not None and not dry_run:
        rep.temp_files_removed = cleanup()
    return rep


@dataclasses.dataclass
class MigrateReport:
    """Result of :func:`migrate_store`. Entries that failed their check after the copy are in ``failed_keys``."""

    dry_run: bool
    scanned: int = 0
    copied: int = 0
    bytes_copied: int = 0
    skipped_existing: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    failed_keys: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed_keys

    def to_dict(self) -> MigrateRecord:
        return {"dry_run": self.dry_run, "scanned": self.scanned, "copied": self.copied,
                "bytes_copied": self.bytes_copied, "skipped_existing": self.skipped_existing,
                "skipped": dict(self.skipped), "failed_keys": list(self.failed_keys), "ok": self.ok}


def _same(a: ChunkKV, b: ChunkKV) -> bool:
    return (
        a.spec == b.spec
        and torch.equal(a.token_ids, b.token_ids)
        and a.keys.dtype == b.keys.dtype
        and torch.equal(a.keys, b.keys)
        and torch.equal(a.values, b.values)
    )


def migrate_store(
    src: KVStore,
    dst: KVStore,
    *,
    keep_fingerprints: Iterable[str] | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = False,
) -> MigrateReport:
    """Copy every usable entry of ``src`` into ``dst``, verifying each copy.

    Entries are copied as stored (same codec, same bytes where the backend keeps bytes). Each copy is read back
    from ``dst`` and decoded; it must equal the source entry tensor for tensor, else it is deleted from ``dst`` and
    listed in ``failed_keys``. Damaged entries, other format versions and (with ``keep_fingerprints``) other models
    are not copied. ``src`` is never modified.

    Args:
        overwrite: replace entries ``dst`` already holds (default: keep them and count ``skipped_existing``).
        dry_run: check the source and count what would be copied; write nothing.

    Raises:
        StoreError: a backend failed (the entries copied so far stay valid in ``dst``).
    """
    rep = MigrateReport(dry_run=dry_run)
    for key, data, st in _scan(src, keep_fingerprints, "migrating", progress):
        rep.scanned += 1
        if st.reason is not None:
            rep.skipped[st.reason] += 1
            logger.info("migrate: not copying %s (%s): %s", key, st.reason, st.detail)
            continue
        if not overwrite and dst.contains(key):
            rep.skipped_existing += 1
            continue
        if dry_run:
            rep.copied += 1
            rep.bytes_copied += len(data)
            continue
        dst.put_bytes(key, data)
        back = dst.get_bytes(key)
        good = False
        if back is not None:
            try:
                good = st.chunk is not None and _same(serde.decode(back), st.chunk)
            except (CacheCorruptError, CacheMismatchError):
                good = False
        if not good:
            logger.warning("migrate: the copy of %s in %r does not read back intact; removed it", key, dst)
            try:
                dst.delete(key)
            except StoreError:
                logger.exception("migrate: could not remove the bad copy of %s", key)
            rep.failed_keys.append(key)
            continue
        rep.copied += 1
        rep.bytes_copied += len(data)
    return rep


__all__ = [
    "CORRUPT",
    "FORMAT_VERSION",
    "OTHER_MODEL",
    "REASONS",
    "EntryStatus",
    "GCReport",
    "MigrateReport",
    "VerifyReport",
    "gc_store",
    "inspect_entry",
    "migrate_store",
    "verify_store",
]
