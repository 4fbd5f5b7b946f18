"""Store maintenance: raw-bytes access, verify, gc and migrate (library and `kvrag store ...`), on real backends."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrag import cli
from kvrag.errors import ConfigError
from kvrag.store import DiskStore, KVStore, MemoryStore, TieredStore, serde
from kvrag.store.maintenance import gc_store, inspect_entry, migrate_store, verify_store
from kvrag_testing.store_suite import (
    assert_chunks_equal,
    chunk_key,
    make_spec,
    random_chunk,
    with_format_version,
)

A, B = "model-a", "model-b"


def damaged(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def open_backend(kind: str, tmp_path: Path, redis_srv: Any = None) -> KVStore:
    if kind == "disk":
        return DiskStore(tmp_path / f"kv-{uuid.uuid4().hex[:6]}")
    if kind == "memory":
        return MemoryStore(codec="float32")  # keeps encoded bytes, so damaged entries can sit in it
    if kind == "tiered":
        return TieredStore(MemoryStore(), DiskStore(tmp_path / f"kv-{uuid.uuid4().hex[:6]}"))
    from kvrag.store.redis import RedisStore

    return RedisStore(redis_srv.url, prefix=f"kvrag-m-{uuid.uuid4().hex}:")


@pytest.fixture(params=["disk", "memory", "tiered", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    srv = request.getfixturevalue("redis_srv") if request.param == "redis" else None
    s = open_backend(request.param, tmp_path, srv)
    yield s
    s.close()


def populate(store: KVStore) -> dict[str, list[str]]:
    """2 entries of model A, 1 of model B, 1 of an older format version, 1 damaged; returns keys by kind."""
    a = [random_chunk(make_spec(fingerprint=A), T=5 + i, seed=i) for i in range(2)]
    b = random_chunk(make_spec("float16", fingerprint=B), T=4, seed=7)
    old = random_chunk(make_spec(fingerprint=A), T=3, seed=8)
    bad = random_chunk(make_spec(fingerprint=A), T=6, seed=9)
    for c in (*a, b):
        store.put(chunk_key(c), c)
    store.put_bytes(chunk_key(old), with_format_version(serde.encode(old), 0))
    store.put_bytes(chunk_key(bad), damaged(serde.encode(bad)))
    return {"a": [chunk_key(c) for c in a], "b": [chunk_key(b)], "old": [chunk_key(old)], "bad": [chunk_key(bad)]}


def test_raw_bytes_round_trip_and_checks(backend: KVStore) -> None:
    c = random_chunk(make_spec(), T=7, seed=1)
    k = chunk_key(c)
    assert backend.get_bytes(k) is None
    backend.put_bytes(k, serde.encode(c))
    assert_chunks_equal(serde.decode(backend.get_bytes(k) or b""), c)
    assert_chunks_equal(backend.get(k), c)
    with pytest.raises(ConfigError, match="magic"):
        backend.put_bytes(k, b"\x80\x04 not an entry")
    with pytest.raises(ConfigError):
        backend.get_bytes("../" + "a" * 61)


def test_inspect_entry_classifies() -> None:
    c = random_chunk(make_spec(fingerprint=A), T=3, seed=2)
    data = serde.encode(c)
    assert inspect_entry(data).reason is None
    assert inspect_entry(data, [A]).reason is None
    assert inspect_entry(data, [B]).reason == "other_model"
    assert inspect_entry(with_format_version(data, 99)).reason == "format_version"
    assert inspect_entry(damaged(data)).reason == "corrupt"
    assert inspect_entry(data[:20]).reason == "corrupt"


def test_verify_gc_dry_run_then_gc(backend: KVStore) -> None:
    keys = populate(backend)
    v = verify_store(backend, [A])
    assert (v.scanned, v.ok, v.clean) == (5, 2, False)
    assert {r: sorted(k) for r, k in v.bad.items()} == {
        "other_model": keys["b"], "format_version": keys["old"], "corrupt": keys["bad"]}
    assert verify_store(backend).bad.keys() == {"format_version", "corrupt"}  # every model kept
    assert len(list(backend.iter_keys())) == 5  # verify changes nothing

    dry = gc_store(backend, [A], dry_run=True)
    assert dry.removed == {"corrupt": 1, "format_version": 1, "other_model": 1} and dry.kept == 2
    assert dry.bytes_freed > 0 and len(list(backend.iter_keys())) == 5

    g = gc_store(backend, [A])
    assert g.removed == dry.removed and g.total_removed == 3
    assert sorted(backend.iter_keys()) == sorted(keys["a"])
    assert verify_store(backend, [A]).clean
    assert gc_store(backend, [A]).total_removed == 0  # idempotent


def test_gc_without_fingerprints_keeps_every_model(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    keys = populate(store)
    g = gc_store(store)
    assert g.removed == {"corrupt": 1, "format_version": 1, "other_model": 0}
    assert sorted(store.iter_keys()) == sorted(keys["a"] + keys["b"])


@pytest.mark.parametrize(("src_kind", "dst_kind"), [("disk", "redis"), ("redis", "disk"), ("disk", "memory")])
def test_migrate_copies_and_verifies(tmp_path: Path, redis_srv: Any, src_kind: str, dst_kind: str) -> None:
    src, dst = open_backend(src_kind, tmp_path, redis_srv), open_backend(dst_kind, tmp_path, redis_srv)
    keys = populate(src)
    m = migrate_store(src, dst, dry_run=True)
    assert (m.copied, list(dst.iter_keys())) == (3, [])
    m = migrate_store(src, dst)
    assert m.ok and m.copied == 3 and m.skipped == {"corrupt": 1, "format_version": 1, "other_model": 0}
    assert sorted(dst.iter_keys()) == sorted(keys["a"] + keys["b"])
    for k in keys["a"] + keys["b"]:
        got, want = dst.get(k), src.get(k)
        assert want is not None
        assert_chunks_equal(got, want)
    again = migrate_store(src, dst)
    assert (again.copied, again.skipped_existing) == (0, 3)
    assert migrate_store(src, dst, overwrite=True, keep_fingerprints=[A]).copied == 2
    assert len(list(src.iter_keys())) == 5  # the source is never modified
    src.close()
    dst.close()


class _BitFlipDisk(DiskStore):
    """A disk whose writes arrive damaged (to exercise migrate's read-back check)."""

    def _put_bytes(self, key: str, data: bytes) -> None:
        super()._put_bytes(key, damaged(data))


def test_migrate_removes_copies_that_do_not_read_back(tmp_path: Path) -> None:
    src, dst = DiskStore(tmp_path / "src"), _BitFlipDisk(tmp_path / "dst")
    keys = populate(src)
    m = migrate_store(src, dst)
    assert not m.ok and sorted(m.failed_keys) == sorted(keys["a"] + keys["b"]) and m.copied == 0
    assert list(dst.iter_keys()) == []


def test_cli_store_gc_on_a_shared_store_keeps_other_models(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`kvrag store gc --persist IDX` took the index's model as the only one to keep, also on a store the index
    names (a Redis shared by several indexes, models and dtypes): it removed their caches as "other model". The
    manifest speaks for the index's own folder only; elsewhere --model / --keep-fingerprint say what to remove."""
    shared, own = tmp_path / "shared", tmp_path / "idx" / "kv"
    keys, own_keys = populate(DiskStore(shared)), populate(DiskStore(own))
    (tmp_path / "idx" / "index.json").write_text(json.dumps({"model_fingerprint": A, "store": f"file://{shared}"}))
    assert cli.main(["store", "gc", "--persist", str(tmp_path / "idx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"]["other_model"] == 0
    assert all(DiskStore(shared).contains(k) for k in keys["b"])
    assert cli.main(["store", "gc", "--persist", str(tmp_path / "idx"), "--keep-fingerprint", A, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"]["other_model"] == len(keys["b"])
    (tmp_path / "idx" / "index.json").write_text(json.dumps({"model_fingerprint": A}))  # its own PERSIST/kv
    assert cli.main(["store", "gc", "--persist", str(tmp_path / "idx"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"]["other_model"] == len(own_keys["b"])


def test_cli_store_gc_keeps_the_models_entries_in_the_dtypes_named(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`kvrag store gc --model M` kept only M as loaded on this machine (its default dtype) and reported M's own
    caches in another dtype as "other model"; --dtype names the dtypes whose caches to keep, and the report says
    what such an entry may be."""
    from kvrag import KVRAGEngine
    from kvrag_testing.tiny import tiny_model

    model = tmp_path / "model"
    lm = tiny_model("llama")
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    kv = tmp_path / "kv"
    for dtype in ("float32", "bfloat16"):
        eng = KVRAGEngine.from_pretrained(str(model), f"file://{kv}", dtype=dtype, device="cpu")
        eng.ingest(["The ferry leaves the harbour at dawn and returns at dusk."])
        eng.close()
    gc = ["store", "gc", "--store", f"file://{kv}", "--model", str(model), "--dry-run"]
    assert cli.main([*gc, "--dtype", "float32", "--dtype", "bfloat16"]) == 0
    assert "kept 2, would remove 0 " in capsys.readouterr().out
    assert cli.main([*gc, "--dtype", "float32"]) == 0
    assert "kept 1, would remove 1 (0 corrupt, 0 format version, 1 other model, dtype or quantization)" in \
        capsys.readouterr().out
    assert len(list(DiskStore(kv).iter_keys())) == 2  # a dry run
    assert cli.main(["store", "gc", "--store", f"file://{kv}", "--dtype", "float32", "--dry-run"]) == 2  # no --model
    assert "give --model too" in capsys.readouterr().err


def test_cli_store_verify_gc_migrate(tmp_path: Path, redis_srv: Any, capsys: pytest.CaptureFixture[str]) -> None:
    src_dir = tmp_path / "src"
    keys = populate(DiskStore(src_dir))
    url = f"file://{src_dir}"

    def run(*argv: str) -> tuple[int, str]:
        rc = cli.main(["store", *argv, "--store", url])
        return rc, capsys.readouterr().out

    rc, out = run("verify")
    assert rc == 1 and "3/5 entries ok" in out and f"BAD {keys['bad'][0]} (corrupt)" in out
    rc, out = run("gc", "--dry-run", "--keep-fingerprint", A)
    assert rc == 0 and "would remove 3 (1 corrupt, 1 format version, 1 other model, dtype or quantization)" in out
    rc, out = run("migrate", "--to", redis_srv.url + "?prefix=kvrag-cli-mig:", "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["copied"] == 3 and rep["ok"] and rep["skipped"]["corrupt"] == 1
    rc, out = run("gc", "--keep-fingerprint", A, "--json")
    assert rc == 0 and json.loads(out)["total_removed"] == 3
    rc, out = run("verify")
    assert rc == 0 and "2/2 entries ok" in out
    from kvrag.store.redis import RedisStore

    dst = RedisStore(redis_srv.url, prefix="kvrag-cli-mig:")
    assert sorted(dst.iter_keys()) == sorted(keys["a"] + keys["b"])
    dst.close()
    with pytest.raises(SystemExit):
        cli.main(["store", "migrate", "--store", url])  # --to is required


def test_cli_migrate_to_another_codec_says_engines_there_will_not_find_the_entries(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    populate(DiskStore(tmp_path / "src"))
    for to, warned in ((f"file://{tmp_path / 'same'}", False), (f"file://{tmp_path / 'q'}?codec=int8", True)):
        assert cli.main(["store", "migrate", "--store", f"file://{tmp_path / 'src'}", "--to", to]) == 0
        assert ("use different codecs (native and int8)" in capsys.readouterr().err) is warned
