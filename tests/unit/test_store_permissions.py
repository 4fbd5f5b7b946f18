"""A disk store's files hold registered texts' token ids: only their owner may read them (files 0600 in folders
0700), whatever the process umask lets through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvrag.store.disk import DiskStore


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_disk_store_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)  # the usual default, which leaves 0644 files readable by everyone
    try:
        store = DiskStore(tmp_path / "kv" / "store")
        store.write_bytes("ab" + "0" * 62, b"token ids of a private passage")  # what put() writes, unchecked
    finally:
        os.umask(old)
    mode = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "kv").rglob("*")}
    files = {k: v for k, v in mode.items() if (tmp_path / k).is_file()}
    folders = {k: v for k, v in mode.items() if (tmp_path / k).is_dir() and k != "kv"}
    assert files and all(v == 0o600 for v in files.values()), files
    assert folders and all(v == 0o700 for v in folders.values()), folders
    assert store.path_for("ab" + "0" * 62).read_bytes() == b"token ids of a private passage"
