"""Store backends: the shared KVStoreTests suite per backend plus backend-specific failure modes."""

from __future__ import annotations

import errno
import importlib
import importlib.abc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvrag.store.disk as disk_mod
from kvrag.errors import ConfigError, StoreError
from kvrag.store import DiskStore, KVStore, MemoryStore, TieredStore, store_from_url
from kvrag.store.factory import local_directory
from kvrag_testing.store_suite import (
    KVStoreTests,
    assert_chunks_equal,
    chunk_key,
    make_spec,
    random_chunk,
)

# Forked children inherit the parent's imports (no 2 s torch import per process); they only touch tiny tensors.
FORK: Any = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
needs_fork = pytest.mark.skipif(FORK is None, reason="needs the 'fork' start method (POSIX)")


def _temp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/.*.tmp"))


def _entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kv"))


# ---- the standard suite, once per backend --------------------------------------------------------------------
class TestMemoryStore(KVStoreTests):
    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        return MemoryStore(max_bytes=1 << 20, **opts)


class TestDiskStore(KVStoreTests):
    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        return DiskStore(tmp_path / "kv", **opts)


class TestTieredStore(KVStoreTests):
    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        return TieredStore(MemoryStore(max_bytes=1 << 20, **opts), DiskStore(tmp_path / "kv", **opts))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A throw-away redis-server on a free port (skips when the binary is missing)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server binary not found; install it (e.g. apt-get install redis-server) to run Redis tests")
    redis = pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvrag[redis]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


class TestRedisStore(KVStoreTests):
    @pytest.fixture(autouse=True)
    def _server(self, redis_url: str) -> None:
        self.redis_url = redis_url

    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        from kvrag.store.redis import RedisStore

        # A fresh prefix per store keeps tests independent on the shared server.
        return RedisStore(self.redis_url, prefix=f"kvrag-test-{uuid.uuid4().hex}:", **opts)


# ---- disk: integrity and crash safety ------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [2, 9, 30, -3], ids=["magic", "length", "header", "payload"])
def test_disk_corrupted_file_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture, offset: int) -> None:
    store = DiskStore(tmp_path)
    chunk = random_chunk(make_spec(), T=8, seed=1)
    key = chunk_key(chunk)
    store.put(key, chunk)
    path = store.path_for(key)
    assert path == tmp_path / key[:2] / f"{key[2:]}.kv"
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert store.get(key) is None
    assert any("corrupt" in r.getMessage() and key in r.getMessage() for r in caplog.records)
    assert not path.exists() and not store.contains(key)
    assert store.stats()["corrupt_dropped"] == 1
    store.put(key, chunk)  # recomputed entries are stored again
    assert_chunks_equal(store.get(key), chunk)


@pytest.mark.parametrize("keep", [0, 5, 20, "half", -1])
def test_disk_truncated_file_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture, keep: Any) -> None:
    store = DiskStore(tmp_path)
    chunk = random_chunk(make_spec("bfloat16"), T=8, seed=2)
    key = chunk_key(chunk)
    store.put(key, chunk)
    path = store.path_for(key)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        assert store.get(key) is None
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    assert not path.exists()
    assert store.stats()["corrupt_dropped"] == 1


def test_disk_foreign_file_is_dropped(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    key = chunk_key(random_chunk(make_spec(), T=2, seed=3))
    path = store.path_for(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x80\x04pickle? no thanks")
    assert store.get(key) is None and not path.exists()


@needs_fork
def test_disk_ignores_and_cleans_leftover_temp_files(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    chunk = random_chunk(make_spec(), T=4, seed=4)
    key = chunk_key(chunk)
    d = tmp_path / key[:2]
    d.mkdir()
    dead = FORK.Process(target=int)
    dead.start()
    dead.join()  # a reaped child: its pid is (almost surely) free
    host = disk_mod._HOST
    crashed = d / f".{key[2:]}.{host}.{dead.pid}.deadbeef.tmp"
    live_fresh = d / f".{key[2:]}.{host}.{os.getpid()}.cafecafe.tmp"
    live_old = d / f".{key[2:]}.{host}.{os.getpid()}.0badf00d.tmp"
    other_host = d / f".{key[2:]}.ffffffff.{dead.pid}.12345678.tmp"
    for p in (crashed, live_fresh, live_old, other_host):
        p.write_bytes(b"KVRAG\x00partial")
    os.utime(live_old, (time.time() - 7200, time.time() - 7200))
    assert list(store.iter_keys()) == [] and store.get(key) is None and not store.contains(key)
    assert store.stats()["corrupt_dropped"] == 0
    DiskStore(tmp_path)  # opening cleans what is provably abandoned
    assert _temp_files(tmp_path) == sorted([live_fresh, other_host])


def _write_then_hang(root: str, chunk: Any, key: str, ready: Any) -> None:
    def half_then_hang(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        ready.set()
        time.sleep(60)

    disk_mod._write_all = half_then_hang
    DiskStore(root).put(key, chunk)


@needs_fork
def test_disk_sigkill_mid_write_leaves_no_entry(tmp_path: Path) -> None:
    chunk = random_chunk(make_spec(), T=16, seed=5)
    key = chunk_key(chunk)
    ready = FORK.Event()
    proc = FORK.Process(target=_write_then_hang, args=(str(tmp_path), chunk, key, ready))
    proc.start()
    try:
        assert ready.wait(20), "writer never started"
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    assert len(_temp_files(tmp_path)) == 1
    store = DiskStore(tmp_path)  # the dead writer's temp file is removed on open
    assert _temp_files(tmp_path) == [] and _entry_files(tmp_path) == []
    assert store.get(key) is None and list(store.iter_keys()) == []


def _hammer(root: str, key: str, chunk: Any, go: Any, n: int) -> None:
    store = DiskStore(root)
    go.wait(20)
    for _ in range(n):
        store.put(key, chunk)


@needs_fork
def test_disk_concurrent_writers_end_with_one_valid_entry(tmp_path: Path) -> None:
    # Same key, different contents per writer, so a torn or mixed file would be visible.
    chunks = [random_chunk(make_spec("float16"), T=16, seed=100 + i) for i in range(4)]
    key = chunk_key(chunks[0])
    go = FORK.Event()
    procs = [FORK.Process(target=_hammer, args=(str(tmp_path), key, c, go, 25)) for c in chunks]
    for p in procs:
        p.start()
    reader = DiskStore(tmp_path)
    go.set()
    seen = 0
    while any(p.is_alive() for p in procs):
        got = reader.get(key)  # concurrent reads see a whole entry or none, never a partial one
        if got is not None:
            seen += 1
            assert any(got.keys.equal(c.keys) and got.values.equal(c.values) for c in chunks)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert reader.stats()["corrupt_dropped"] == 0
    assert _entry_files(tmp_path) == [reader.path_for(key)] and _temp_files(tmp_path) == []
    final = reader.get(key)
    assert final is not None
    assert sum(final.keys.equal(c.keys) and final.values.equal(c.values) for c in chunks) == 1


def test_disk_full_raises_store_error_and_removes_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskStore(tmp_path)
    chunk = random_chunk(make_spec(), T=4, seed=6)
    key = chunk_key(chunk)

    def full(fd: int, data: bytes) -> None:
        os.write(fd, data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "_write_all", full)
    with pytest.raises(StoreError, match="disk full") as ei:
        store.put(key, chunk)
    assert str(tmp_path) in str(ei.value) and "free space" in str(ei.value)
    assert _temp_files(tmp_path) == [] and not store.contains(key)


# ---- memory: LRU byte budget ---------------------------------------------------------------------------------
def test_memory_lru_evicts_least_recently_used(caplog: pytest.LogCaptureFixture) -> None:
    chunks = [random_chunk(make_spec(), T=4, seed=i) for i in range(4)]
    keys = [chunk_key(c) for c in chunks]
    size = chunks[0].nbytes + 4 * 8  # K and V tensors + int64 token ids
    store = MemoryStore(max_bytes=3 * size)
    for k, c in zip(keys[:3], chunks[:3], strict=True):
        store.put(k, c)
    assert store.stats()["bytes"] == 3 * size
    assert store.get(keys[0]) is not None  # 0 is now most recently used; 1 is the LRU
    store.put(keys[3], chunks[3])
    assert not store.contains(keys[1])
    assert [store.contains(k) for k in keys] == [True, False, True, True]
    store.put(keys[1], chunks[1])  # evicts 2, the LRU now
    assert [store.contains(k) for k in keys] == [True, True, False, True]
    s = store.stats()
    assert s["evictions"] == 2 and s["bytes"] <= s["max_bytes"]


def test_memory_entry_larger_than_budget_is_not_cached(caplog: pytest.LogCaptureFixture) -> None:
    chunk, other = random_chunk(make_spec(), T=16, seed=7), random_chunk(make_spec(), T=16, seed=8)
    store = MemoryStore(max_bytes=100)
    with caplog.at_level(logging.WARNING, logger="kvrag.store.memory"):
        store.put(chunk_key(chunk), chunk)
        store.put(chunk_key(other), other)
    assert store.stats()["entries"] == 0 and store.get(chunk_key(chunk)) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "exceeds max_bytes=100" in warned[0] and "raise max_bytes" in warned[0]  # once


def test_memory_int8_codec_uses_less_memory() -> None:
    chunk = random_chunk(make_spec(head_dim=64), T=16, seed=8)  # large enough that the header is noise
    native, int8 = MemoryStore(), MemoryStore(codec="int8")
    native.put(chunk_key(chunk), chunk)
    int8.put(chunk_key(chunk), chunk)
    assert int8.stats()["bytes"] < native.stats()["bytes"] / 2


def test_memory_is_thread_safe() -> None:
    store = MemoryStore(max_bytes=20_000)
    chunks = [random_chunk(make_spec(), T=8, seed=i) for i in range(12)]
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(60):
                c = chunks[(i + offset) % len(chunks)]
                store.put(chunk_key(c), c)
                got = store.get(chunk_key(chunks[(i * 7 + offset) % len(chunks)]))
                assert got is None or got.num_tokens == 8
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = store.stats()
    assert s["bytes"] <= 20_000 and s["bytes"] == sum(
        c.nbytes + 8 * c.num_tokens for c in chunks if store.contains(chunk_key(c))
    )


def test_memory_rejects_bad_options() -> None:
    with pytest.raises(ConfigError):
        MemoryStore(max_bytes=-1)
    with pytest.raises(ConfigError, match="int8"):
        MemoryStore(codec="zstd")


# ---- tiered ----------------------------------------------------------------------------------------------------
def test_tiered_populates_front_and_counts_per_tier(tmp_path: Path) -> None:
    front, back = MemoryStore(), DiskStore(tmp_path)
    store = TieredStore(front, back)
    chunk = random_chunk(make_spec(), T=4, seed=9)
    key = chunk_key(chunk)
    back.put(key, chunk)  # e.g. written by another process
    assert not front.contains(key)
    assert_chunks_equal(store.get(key), chunk)  # back hit
    assert front.contains(key)
    assert_chunks_equal(store.get(key), chunk)  # front hit
    s = store.stats()
    assert (s["hits"], s["misses"]) == (2, 0)
    assert (s["front_hits"], s["front_misses"], s["back_hits"], s["back_misses"]) == (1, 1, 1, 0)
    assert s["tiers"]["back"]["entries"] == 1
    other = random_chunk(make_spec(), T=5, seed=10)
    store.put(chunk_key(other), other)  # write-through
    assert front.contains(chunk_key(other)) and back.contains(chunk_key(other))
    store.delete(key)
    assert not front.contains(key) and not back.contains(key)
    assert store.get_many([chunk_key(other), key])[1] is None


# ---- factory -----------------------------------------------------------------------------------------------------
def test_factory_memory_and_file_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = store_from_url("memory://")
    assert isinstance(m, MemoryStore) and m.max_bytes is None
    m = store_from_url("memory://?max_bytes=1e6&codec=int8")
    assert isinstance(m, MemoryStore) and (m.max_bytes, m.codec) == (1_000_000, "int8")
    assert store_from_url("memory://?max_bytes=5", max_bytes=7).max_bytes == 7  # type: ignore[attr-defined]
    d = store_from_url(f"file://{tmp_path}/a%20b?codec=float16")
    assert isinstance(d, DiskStore) and d.root == tmp_path / "a b" and d.codec == "float16"
    assert store_from_url(str(tmp_path / "plain")).root == tmp_path / "plain"  # type: ignore[attr-defined]
    monkeypatch.chdir(tmp_path)
    assert store_from_url("rel/dir").root == tmp_path / "rel" / "dir"  # type: ignore[attr-defined]
    p = store_from_url(f"{tmp_path}/opts?codec=int8")  # a plain path takes options as file:// does
    assert isinstance(p, DiskStore) and p.root == tmp_path / "opts" and p.codec == "int8"
    assert local_directory(f"{tmp_path}/opts?codec=int8") == f"{tmp_path}/opts"
    assert store_from_url("./memory").root == tmp_path / "memory"  # type: ignore[attr-defined]
    spec = make_spec()
    assert store_from_url("memory://", expected_spec=spec).expected_spec == spec


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("s3://bucket/kv", "valid schemes.*file.*memory.*redis"),
        ("file://otherhost/kv", "three slashes"),
        ("memory://host", "no host"),
        ("memory://?max_bytes=lots", "not a number"),
        ("memory://?codec=zip", "unknown KV codec"),
        ("", "non-empty"),
        # a scheme without // used to be a directory of that name in the working directory, without a word
        ("memory:", "missing '//'.*write memory://"),
        ("memory", "missing '//'.*write memory://.*./memory"),
        ("memory:?max_bytes=1000", "write memory://\\?max_bytes=1000"),
        ("redis:localhost:6379/0", "write redis://localhost:6379/0"),
        ("{tmp}/kv?max_bytes=10", "disk store.*codec"),
        ("{tmp}/kv?kodec=int8", "'kodec'.*codec"),
        ("memory://?maxbytes=5", "unknown option 'maxbytes'.*max_bytes"),  # was an unbounded store, silently
        ("file://{tmp}/kv?maxbytes=5", "unknown option 'maxbytes'.*max_bytes"),
        ("memory://?max_bytes=100000&max_bytes=5", "gives 'max_bytes' twice"),  # the last one won
        ("{tmp}/kv?codec=int8&codec=native", "gives an option twice"),
    ],
)
def test_factory_rejects_bad_urls(url: str, match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        store_from_url(url.replace("{tmp}", str(tmp_path)))
    assert not any(tmp_path.iterdir())  # nothing created


def test_factory_redis_urls(redis_url: str) -> None:
    from kvrag.store.redis import RedisStore

    s = store_from_url(redis_url + "?ttl_s=60&prefix=kvrag-factory:&codec=int8")
    assert isinstance(s, RedisStore) and (s.ttl_s, s.prefix, s.codec) == (60.0, "kvrag-factory:", "int8")
    chunk = random_chunk(make_spec(), T=3, seed=11)
    s.put(chunk_key(chunk), chunk)
    assert 0 < s._client.pttl("kvrag-factory:" + chunk_key(chunk)) <= 60_000
    s.delete(chunk_key(chunk))
    s.close()
    with pytest.raises(StoreError, match="cluster|Cluster"):
        store_from_url(redis_url.replace("redis://", "redis+cluster://"))
    # redis-py reads a database that is not a number as database 0, without a word
    with pytest.raises(ConfigError, match="database 'O' .* is not a number"):
        store_from_url(redis_url[: -len("0")] + "O")


@pytest.mark.parametrize("ttl", ["inf", "1e20", "nan", "-1", "0"])
def test_redis_ttl_beyond_what_redis_keeps_is_refused_before_any_write(ttl: str) -> None:
    pytest.importorskip("redis")  # checked before connecting: no server needed
    with pytest.raises(ConfigError, match=r"ttl_s must be a positive number of seconds up to 1e\+15"):
        store_from_url(f"redis://127.0.0.1:9/0?ttl_s={ttl}")


def test_redis_unreachable_names_url_without_password() -> None:
    pytest.importorskip("redis")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    for url in (f"redis://user:s3cret@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0?password=s3cret"):
        with pytest.raises(StoreError) as ei:  # redis-py takes the password from user-info or ?password=
            store_from_url(url, socket_timeout=1.0)
        msg = str(ei.value)
        assert f"127.0.0.1:{port}" in msg and "s3cret" not in msg and "redis-server" in msg


def test_redact_url_hides_every_password() -> None:
    from kvrag.store.base import has_secret, redact_url

    assert redact_url("redis://u:pw@h:1/0?password=x&db=2") == "redis://u:***@h:1/0?password=***&db=2"
    assert redact_url("rediss+cluster://h:1?Password=a%20b&prefix=p") == "rediss+cluster://h:1?Password=***&prefix=p"
    for plain in ("redis://h/0?socket_timeout=2", "file:///tmp/x?codec=int8", "/tmp/plain", "memory://"):
        assert redact_url(plain) == plain and not has_secret(plain)
    assert has_secret("redis://:pw@h/0") and has_secret("redis://h/0?password=pw")


def test_redis_corrupt_value_is_dropped(redis_url: str) -> None:
    from kvrag.store.redis import RedisStore

    store = RedisStore(redis_url, prefix=f"kvrag-test-{uuid.uuid4().hex}:")
    chunk = random_chunk(make_spec(), T=4, seed=12)
    key = chunk_key(chunk)
    store.put(key, chunk)
    raw = store._client.get(store.prefix + key)
    store._client.set(store.prefix + key, raw[:-1] + bytes([raw[-1] ^ 1]))
    assert store.get_many([key]) == [None]
    assert not store.contains(key) and store.stats()["corrupt_dropped"] == 1
    store.close()


class _BlockRedis(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "redis" or name.startswith("redis."):
            raise AssertionError(f"importing kvrag.store imported {name!r}; redis must load lazily")


def test_importing_kvrag_store_does_not_import_redis() -> None:
    # In-process (a subprocess would spend seconds importing torch): re-import kvrag.store with redis blocked,
    # then put every module back so the rest of the session keeps its class identities.
    import kvrag

    before, old_store, blocker = dict(sys.modules), kvrag.store, _BlockRedis()
    try:
        for name in [n for n in sys.modules if n.split(".")[0] == "redis" or n.startswith("kvrag.store")]:
            del sys.modules[name]
        sys.meta_path.insert(0, blocker)
        fresh = importlib.import_module("kvrag.store")
        assert fresh is not old_store and "redis" not in sys.modules and "kvrag.store.redis" not in sys.modules
    finally:
        sys.meta_path.remove(blocker)
        for name in set(sys.modules) - set(before):
            del sys.modules[name]
        sys.modules.update(before)
        kvrag.store = old_store
