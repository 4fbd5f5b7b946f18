"""DiskStore: one file per key under a two-level fan-out, written atomically, verified on read.

Layout: ``root/ab/cdef....kv`` where ``abcdef...`` is the 64-hex key. A write goes to a temp file
``root/ab/.cdef....<host>.<pid>.<rand>.tmp`` in the same directory, is flushed and fsynced, then renamed over the
final name with ``os.replace`` (atomic on POSIX and Windows). Readers therefore see either the old entry, the new
entry or none, never a partial one; concurrent writers of one key all produce complete files and the last rename
wins. Temp files left by a crashed writer are removed when a store is opened on the directory.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from kvrag.errors import ConfigError, StoreError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.keys import is_valid_digest
from kvrag.kv.spec import KVSpec
from kvrag.store import serde
from kvrag.store.base import KVStore, check_key

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_HEX = frozenset("0123456789abcdef")
# Identifies this machine in temp names so a store on a shared filesystem only judges its own host's pids.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists but belongs to someone else, or we cannot tell: keep the file
    return True


class DiskStore(KVStore):
    """Chunk caches as files under ``root``.

    Args:
        root: directory (created if missing).
        codec: see :func:`kvrag.store.serde.encode`.
        expected_spec: only entries with this KVSpec are served (see :class:`KVStore`).
        fsync: fsync each file and its directory before/after the rename (durability across power loss).
        stale_tmp_s: temp files older than this are removed on open even when their writer's pid looks alive.

    Raises:
        ConfigError: unknown codec.
        StoreError: the directory cannot be created or read.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        codec: str = "native",
        *,
        expected_spec: KVSpec | None = None,
        fsync: bool = True,
        stale_tmp_s: float = 3600.0,
    ) -> None:
        super().__init__(expected_spec=expected_spec)
        if codec not in serde.CODECS:
            msg = f"unknown KV codec {codec!r}; expected one of {list(serde.CODECS)}"
            raise ConfigError(msg)
        self.root = Path(root).expanduser().absolute()
        self.codec = codec
        self.fsync = fsync
        self.stale_tmp_s = stale_tmp_s
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            msg = f"cannot create KV store directory {self.root}: {e}; pick a writable path"
            raise StoreError(msg) from e
        self.cleanup_temp_files()

    # ---- paths ----------------------------------------------------------------------------------------
    def path_for(self, key: str) -> Path:
        """The file that holds ``key`` (whether or not it exists)."""
        return self.root / key[:2] / f"{key[2:]}{SUFFIX}"

    def _fanout_dirs(self) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(self.root) as it:
                entries = list(it)
        except FileNotFoundError:
            return
        for e in entries:
            if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False):
                yield e

    def _files(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Yield (key, entry) for every well-named entry file."""
        for d in self._fanout_dirs():
            try:
                with os.scandir(d.path) as it:
                    files = list(it)
            except FileNotFoundError:
                continue
            for f in files:
                if f.name.endswith(SUFFIX) and not f.name.startswith("."):
                    key = d.name + f.name[: -len(SUFFIX)]
                    if len(key) == 64 and is_valid_digest(key):
                        yield key, f

    # ---- crash recovery --------------------------------------------------------------------------------
    def cleanup_temp_files(self) -> int:
        """Remove temp files whose writer is gone (dead pid on this host) or that are older than stale_tmp_s.

        Returns:
            The number of files removed.
        """
        removed = 0
        now = time.time()
        for d in self._fanout_dirs():
            try:
                with os.scandir(d.path) as it:
                    temps = [f for f in it if f.name.startswith(".") and f.name.endswith(TMP_SUFFIX)]
            except FileNotFoundError:
                continue
            for f in temps:
                parts = f.name[1 : -len(TMP_SUFFIX)].split(".")
                try:
                    age = now - f.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue  # its writer just renamed it into place
                ours = len(parts) == 4 and parts[1] == _HOST and parts[2].isdigit()
                dead = ours and not _pid_alive(int(parts[2]))
                if dead or age > self.stale_tmp_s:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                        removed += 1
        if removed:
            logger.info("DiskStore: removed %d temp files left by interrupted writes under %s", removed, self.root)
        return removed

    # ---- primitives ------------------------------------------------------------------------------------
    def _get_bytes(self, key: str) -> bytes | None:
        path = self.path_for(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            msg = f"cannot read KV entry {path}: {e}; check permissions of {self.root}"
            raise StoreError(msg) from e

    def _get(self, key: str) -> ChunkKV | None:
        data = self._get_bytes(key)
        return None if data is None else self._decode_or_drop(key, data)

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self.write_bytes(key, serde.encode(chunk, self.codec))

    def _put_bytes(self, key: str, data: bytes) -> None:
        self.write_bytes(key, data)

    def write_bytes(self, key: str, data: bytes) -> None:
        """Atomically store already-encoded entry bytes (temp file + fsync + os.replace).

        Raises:
            StoreError: disk full (the temp file is removed) or any other OS failure.
        """
        final = self.path_for(check_key(key))
        tmp = final.parent / f".{final.stem}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            final.parent.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
            try:
                _write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if e.errno in _DISK_FULL:
                msg = (
                    f"disk full while writing KV entry {key} ({len(data)} bytes) under {self.root}: {e.strerror}; "
                    "free space there, or point the store at another volume (e.g. file:///other/path)"
                )
            else:
                msg = f"cannot write KV entry {final}: {e}; check that {self.root} is writable"
            raise StoreError(msg) from e
        if self.fsync:
            self._fsync_dir(final.parent)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        # Makes the rename itself durable; not supported on every platform/filesystem, hence best effort.
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _contains(self, key: str) -> bool:
        return self.path_for(key).is_file()

    def _delete(self, key: str) -> bool:
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            msg = f"cannot delete KV entry {self.path_for(key)}: {e}; check permissions of {self.root}"
            raise StoreError(msg) from e
        return True

    def _iter_keys(self) -> Iterator[str]:
        for key, _ in self._files():
            yield key

    def _usage(self) -> tuple[int, int]:
        entries = nbytes = 0
        for _, f in self._files():
            try:
                nbytes += f.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            entries += 1
        return entries, nbytes

    def __repr__(self) -> str:
        return f"DiskStore({str(self.root)!r}, codec={self.codec!r})"
