"""Faults: Redis down at start / going away mid-run / coming back, disk full, and a SIGKILLed ingest.

Real processes only: a redis-server we start and kill, a real tmpfs when we may mount one, a real subprocess.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrag import cli
from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import StoreError
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import DiskStore, FallbackStore, MemoryStore
from kvrag.store.maintenance import verify_store
from kvrag_testing.store_suite import assert_chunks_equal, chunk_key, make_spec, random_chunk
from kvrag_testing.tiny import tiny_model

PASSAGES = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
]
N_NEW = 6
GONE = "continuing WITHOUT the store"
BACK = "works again"


@pytest.fixture(scope="module")
def lm() -> Any:
    return tiny_model("llama")


def ask(eng: KVRAGEngine) -> Any:
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "Which city is the capital of France?")
    return eng.answer(prompt, PASSAGES, "stale", max_new_tokens=N_NEW)


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ---- Redis -------------------------------------------------------------------------------------------------------
def test_engine_survives_redis_going_away_and_uses_it_again(
    lm: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from kvrag.store.redis import RedisStore

    redis_server.start()
    store = RedisStore(redis_server.url, prefix=f"kvrag-fault-{uuid.uuid4().hex}:")
    eng = KVRAGEngine(lm, store, EngineConfig(store_retry_s=0.0))
    keys = eng.ingest(PASSAGES)
    ref = ask(eng)
    assert ref.stats["chunk_hits"] == 3

    redis_server.kill()  # the server goes away mid-run
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        down = [ask(eng) for _ in range(3)]
    assert [r.text for r in down] == [ref.text] * 3  # answers still work, recomputed
    assert all(r.stats["chunk_misses"] == 3 and r.stats["chunk_hits"] == 0 for r in down)
    gone = messages(caplog, GONE)
    assert len(gone) == 1, gone  # one clear warning per outage, not one per request
    assert f"127.0.0.1:{redis_server.port}" in gone[0] and "on_store_error='raise'" in gone[0]
    assert isinstance(eng.serving_store, FallbackStore) and eng.serving_store.degraded
    st = eng.serving_store.stats()
    assert st["degraded"] and st["store_errors"] >= 3 and st["outages"] == 1
    with pytest.raises(StoreError, match="cannot reach Redis"):
        eng.ingest(PASSAGES[:1])  # ingest's job is to store: it fails loudly

    caplog.clear()
    redis_server.start()  # back on the same port, empty (no persistence)
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        refill = ask(eng)
    assert len(messages(caplog, BACK)) == 1 and not eng.serving_store.degraded
    assert refill.text == ref.text and refill.stats["chunk_misses"] == 3  # recomputed once and stored again
    assert set(keys) <= set(store.iter_keys())
    again = ask(eng)
    assert again.text == ref.text and again.stats["chunk_hits"] == 3  # the store is used again
    store.close()


def test_on_store_error_raise_propagates(lm: Any, redis_server: Any) -> None:
    from kvrag.store.redis import RedisStore

    redis_server.start()
    store = RedisStore(redis_server.url, prefix=f"kvrag-fault-{uuid.uuid4().hex}:")
    eng = KVRAGEngine(lm, store, EngineConfig(on_store_error="raise"))
    assert eng.serving_store is store
    eng.ingest(PASSAGES)
    redis_server.kill()
    with pytest.raises(StoreError, match=f"127.0.0.1:{redis_server.port}"):
        ask(eng)
    store.close()


def test_engine_starts_while_redis_is_down(lm: Any, redis_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    url = redis_server.url + f"?prefix=kvrag-start-{uuid.uuid4().hex}:"  # nothing listens there yet
    with pytest.raises(StoreError, match="cannot reach Redis"):
        KVRAGEngine.from_pretrained(lm, url, on_store_error="raise")
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        eng = KVRAGEngine.from_pretrained(lm, url, store_retry_s=0.0)
        first = ask(eng)
        ask(eng)
    assert len(messages(caplog, GONE)) == 1 and "connect" in messages(caplog, GONE)[0]
    assert first.stats["chunk_misses"] == 3
    redis_server.start()
    assert ask(eng).stats["chunk_misses"] == 3  # connected now: computed and stored
    r = ask(eng)
    assert r.stats["chunk_hits"] == 3 and r.text == first.text
    assert len(list(eng.store.iter_keys())) >= 3
    eng.store.close()


# ---- disk full ---------------------------------------------------------------------------------------------------
def _entry_and_temp_files(root: Path) -> tuple[list[Path], list[Path]]:
    return sorted(root.glob("*/*.kv")), sorted(root.glob("*/.*.tmp"))


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_disk_full_on_a_real_tiny_filesystem(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "small", "96k") as root:
        store = DiskStore(root)
        chunks = [random_chunk(make_spec(head_dim=32), T=64, seed=i) for i in range(12)]  # ~33 KB each
        stored = []
        with pytest.raises(StoreError) as ei:
            for c in chunks:
                store.put(chunk_key(c), c)
                stored.append(c)
        msg = str(ei.value)
        assert "disk full" in msg and str(root) in msg and "free space" in msg
        assert 1 <= len(stored) < len(chunks)
        entries, temps = _entry_and_temp_files(root)
        assert temps == [] and len(entries) == len(stored)  # no partial entry left behind
        failed = chunks[len(stored)]
        assert not store.contains(chunk_key(failed))
        for c in stored:  # existing entries are intact
            assert_chunks_equal(store.get(chunk_key(c)), c)
        assert verify_store(store).clean


def test_disk_full_at_the_os_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lm: Any,
                                   caplog: pytest.LogCaptureFixture) -> None:
    store = DiskStore(tmp_path / "kv")
    old = random_chunk(make_spec(), T=8, seed=1)
    store.put(chunk_key(old), old)
    real_write = os.write

    def full_write(fd: int, data: Any) -> int:
        if len(data) > 64:
            real_write(fd, bytes(data[:64]))  # a partial write, then the device is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    new = random_chunk(make_spec(), T=8, seed=2)
    monkeypatch.setattr(os, "write", full_write)
    with pytest.raises(StoreError, match="disk full") as ei:
        store.put(chunk_key(new), new)
    assert str(store.root) in str(ei.value)
    # the engine: ingest fails loudly; answering degrades to computing on demand
    eng = KVRAGEngine(lm, store, EngineConfig(store_retry_s=0.0))
    with pytest.raises(StoreError, match="disk full"):
        eng.ingest(PASSAGES[:1])
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        r = ask(eng)
    assert r.stats["chunk_misses"] == 3 and len(messages(caplog, GONE)) == 1
    monkeypatch.undo()
    entries, temps = _entry_and_temp_files(store.root)
    assert temps == [] and entries == [store.path_for(chunk_key(old))]
    assert_chunks_equal(store.get(chunk_key(old)), old)
    assert ask(eng).stats["chunk_misses"] == 3 and ask(eng).stats["chunk_hits"] == 3  # space again: stored


# ---- crash safety ------------------------------------------------------------------------------------------------
N_CHUNKS = 60
CHILD = textwrap.dedent(
    """
    import sys, time
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store import DiskStore
    from kvrag_testing.tiny import tiny_model

    class SlowDisk(DiskStore):  # slows the run down so that the kill lands mid-way, deterministically
        def write_bytes(self, key, data):
            super().write_bytes(key, data)
            time.sleep(0.05)

    texts = [f"Chunk {i}: " + "The quick brown fox jumps over the lazy dog. " * 6 for i in range(int(sys.argv[2]))]
    eng = KVRAGEngine(tiny_model("llama"), SlowDisk(sys.argv[1]), EngineConfig(chunk_prefix="none"))
    print("ready", flush=True)
    eng.ingest(texts)
    print("done", flush=True)
    """
)


def test_sigkilled_ingest_verifies_clean_and_resumes(tmp_path: Path, lm: Any) -> None:
    root = tmp_path / "kv"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(N_CHUNKS)], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while len(_entry_and_temp_files(root)[0]) < 10:
            assert proc.poll() is None and time.monotonic() < deadline, "the ingest ended before it was killed"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    stored = len(_entry_and_temp_files(root)[0])
    assert 10 <= stored < N_CHUNKS

    store = DiskStore(root)  # opening removes the temp file of the killed writer, if the kill hit a write
    assert _entry_and_temp_files(root)[1] == []
    assert verify_store(store).clean and verify_store(store).ok == stored
    assert cli.main(["store", "verify", "--store", f"file://{root}"]) == 0

    texts = [f"Chunk {i}: " + "The quick brown fox jumps over the lazy dog. " * 6 for i in range(N_CHUNKS)]
    eng = KVRAGEngine(lm, store, EngineConfig(chunk_prefix="none"))  # same weights, same keys as the child's
    keys = eng.ingest(texts)
    assert eng.counters["chunks_reused"] == stored  # already stored chunks are not recomputed
    assert eng.counters["chunks_computed"] == N_CHUNKS - stored
    assert sorted(set(keys)) == sorted(store.iter_keys()) and verify_store(store).ok == N_CHUNKS


def test_fallback_store_passes_through_and_exposes_inner(tmp_path: Path) -> None:
    inner = DiskStore(tmp_path)
    fb = FallbackStore(inner, retry_s=0)
    c = random_chunk(make_spec(), T=4, seed=3)
    fb.put(chunk_key(c), c)
    assert_chunks_equal(fb.get(chunk_key(c)), c)
    assert fb.root == inner.root and fb.contains(chunk_key(c)) and not fb.degraded
    s = fb.stats()
    assert s["entries"] == 1 and s["degraded"] is False and s["store_errors"] == 0
    assert FallbackStore(MemoryStore()).get_many([]) == []


class _FullStore(MemoryStore):
    """A store that answers reads but refuses writes while ``full`` (Redis at maxmemory with noeviction, a
    read-only replica)."""

    full = False

    def _put(self, key: str, chunk: Any) -> None:
        if self.full:
            raise StoreError("OOM command not allowed when used memory > 'maxmemory'")
        super()._put(key, chunk)


def test_a_store_that_refuses_writes_still_serves_what_it_holds() -> None:
    """A refused write took the whole store down for retry_s: under steady traffic every request missed entries
    the store still held, and recomputed them."""
    inner = _FullStore()
    fb = FallbackStore(inner, retry_s=60)
    a, b = (random_chunk(make_spec(), T=4, seed=s) for s in (1, 2))
    fb.put(chunk_key(a), a)
    inner.full = True
    fb.put(chunk_key(b), b)  # refused: dropped
    assert fb.degraded
    assert_chunks_equal(fb.get(chunk_key(a)), a)  # reads still go to the store
    assert fb.get(chunk_key(b)) is None and fb.degraded  # a read that works does not end a writes outage
    skipped = fb.stats()["skipped"]
    fb.put(chunk_key(b), b)  # writes are skipped for retry_s
    assert fb.stats()["skipped"] == skipped + 1
    inner.full = False
    fb.retry_s, fb._retry_at = 0.0, 0.0
    fb.put(chunk_key(b), b)  # the next write that works ends it
    assert not fb.degraded and inner.contains(chunk_key(b))


class _DownStore(MemoryStore):
    """A durable tier that cannot be reached."""

    def _get_many(self, keys: Any) -> Any:
        raise StoreError("cannot reach Redis")

    def _get(self, key: str) -> Any:
        raise StoreError("cannot reach Redis")


def test_a_tiered_stores_memory_tier_answers_while_its_durable_tier_is_down() -> None:
    """docs' TieredStore(MemoryStore(), store_from_url("redis://...")): with Redis down, a prompt whose chunks were
    all in the memory tier hit, but one more chunk that was not threw the memory tier's hits away, and for retry_s
    afterwards the memory tier was skipped too."""
    from kvrag.store import TieredStore

    tiered = TieredStore(MemoryStore(), _DownStore())
    fb = FallbackStore(tiered, retry_s=60)
    a, c = (random_chunk(make_spec(), T=4, seed=s) for s in (1, 3))
    tiered.front.put(chunk_key(a), a)
    got = fb.get_many([chunk_key(a), chunk_key(c)])  # the back tier fails on c
    assert fb.degraded and got[1] is None
    assert_chunks_equal(got[0], a)
    again = fb.get_many([chunk_key(a)])  # within retry_s: the back tier is skipped, the front still answers
    assert_chunks_equal(again[0], a)
    assert_chunks_equal(fb.get(chunk_key(a)), a)
