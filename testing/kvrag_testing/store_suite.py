"""KVStoreTests: the standard suite every KVStore backend must pass (docs/architecture.md#tests).

Usage::

    from kvrag_testing.store_suite import KVStoreTests

    class TestMyStore(KVStoreTests):
        def make_store(self, tmp_path, **opts):
            return MyStore(tmp_path, **opts)  # opts: codec=..., expected_spec=...

``make_store`` receives ``codec`` and ``expected_spec`` keyword options for the tests that need them; a backend
that cannot honour an option may ``pytest.skip``. Needs pytest (the ``dev`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.errors import ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.keys import ChunkKey
from kvrag.kv.spec import KVSpec
from kvrag.store.base import KVStore

SPEC_DTYPES = ("float32", "float16", "bfloat16")
BAD_KEYS: tuple[Any, ...] = (
    "",
    "abc",
    "../" + "a" * 61,
    "A" * 64,
    "g" * 64,
    "a" * 63 + "\n",
    "a" * 64 + "\n",
    "a" * 65,
    "a" * 32 + "/" + "a" * 31,
    None,
    123,
)


def make_spec(
    dtype: str = "float32", *, fingerprint: str = "test-model", layers: int = 2, kv_heads: int = 2, head_dim: int = 8
) -> KVSpec:
    """A small KVSpec (L=2, H_kv=2, D=8 by default)."""
    return KVSpec(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, model_fingerprint=fingerprint
    )


def random_chunk(spec: KVSpec, T: int, seed: int) -> ChunkKV:
    """A deterministic random chunk: token_ids [T] int64, keys/values [L, H_kv, T, D] ~ N(0, 1) in spec.dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, spec.num_kv_heads, T, spec.head_dim)  # [L, H_kv, T, D]
    return ChunkKV(
        token_ids=torch.randint(0, 150_000, (T,), generator=g, dtype=torch.int64),
        keys=torch.randn(shape, generator=g).to(spec.torch_dtype),
        values=torch.randn(shape, generator=g).to(spec.torch_dtype),
        spec=spec,
    )


def chunk_key(chunk: ChunkKV, codec: str = "native") -> str:
    """The storage key a real pipeline would give ``chunk``."""
    return ChunkKey.make(
        chunk.token_ids.tolist(),
        model_fingerprint=chunk.spec.model_fingerprint,
        tokenizer_fingerprint=f"test-tokenizer-{chunk.spec.dtype}",
        codec=codec,
    ).digest


def assert_chunks_equal(a: ChunkKV | None, b: ChunkKV) -> None:
    """Bit-exact equality of token ids, keys, values (dtype included) and spec."""
    assert a is not None, "expected a stored chunk, got a miss"
    assert a.spec == b.spec
    assert torch.equal(a.token_ids, b.token_ids.to(torch.int64))
    for name in ("keys", "values"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, f"{name}: dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        # Compare bit patterns so NaNs and -0.0 would count as well.
        assert torch.equal(
            x.view(torch.int16 if x.element_size() == 2 else torch.int32),
            y.view(torch.int16 if y.element_size() == 2 else torch.int32),
        ), f"{name} differs"


def with_format_version(data: bytes, version: int) -> bytes:
    """Entry bytes re-sealed as if kvrag format ``version`` had written them (every checksum stays valid)."""
    import hashlib
    import json

    from kvrag.store import serde

    hlen = int.from_bytes(data[len(serde.MAGIC) : len(serde.MAGIC) + 8], "little")
    start = len(serde.MAGIC) + 8
    header = json.loads(data[start : start + hlen])
    header["format_version"] = version
    del header["header_sha256"]
    header["header_sha256"] = hashlib.sha256(serde._canonical_json(header)).hexdigest()
    hb = serde._canonical_json(header)
    return serde.MAGIC + len(hb).to_bytes(8, "little") + hb + data[start + hlen :]


def relative_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_rms / ||b||_rms in float32."""
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).pow(2).mean().sqrt() / b32.pow(2).mean().sqrt().clamp_min(1e-12))


class KVStoreTests:
    """Behaviour every KVStore must have. Subclass and implement :meth:`make_store`."""

    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        """Return a fresh, empty store; ``opts`` may hold ``codec`` and ``expected_spec``."""
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path: Path) -> Any:
        s = self.make_store(tmp_path)
        yield s
        s.close()

    @pytest.mark.parametrize("dtype", SPEC_DTYPES)
    def test_round_trip_bit_exact(self, store: KVStore, dtype: str) -> None:
        chunk = random_chunk(make_spec(dtype), T=13, seed=1)
        key = chunk_key(chunk)
        store.put(key, chunk)
        assert_chunks_equal(store.get(key), chunk)

    def test_zero_token_chunk(self, store: KVStore) -> None:
        chunk = random_chunk(make_spec(), T=0, seed=2)
        key = chunk_key(chunk)
        store.put(key, chunk)
        assert_chunks_equal(store.get(key), chunk)

    def test_miss_returns_none(self, store: KVStore) -> None:
        key = chunk_key(random_chunk(make_spec(), T=3, seed=3))
        assert store.get(key) is None
        assert not store.contains(key)
        assert store.get_many([key, key]) == [None, None]
        assert store.stats()["misses"] == 3

    def test_contains_delete_iter_keys(self, store: KVStore) -> None:
        chunks = [random_chunk(make_spec(), T=4 + i, seed=10 + i) for i in range(3)]
        keys = [chunk_key(c) for c in chunks]
        assert list(store.iter_keys()) == []
        for k, c in zip(keys, chunks, strict=True):
            store.put(k, c)
        assert sorted(store.iter_keys()) == sorted(keys)
        assert all(store.contains(k) for k in keys)
        assert keys[0] in store
        assert store.delete(keys[1]) is True
        assert store.delete(keys[1]) is False
        assert not store.contains(keys[1])
        assert store.contains_many([keys[2], keys[1], keys[0]]) == [True, False, True]  # in order, one call
        assert store.contains_many([]) == []
        assert store.get(keys[1]) is None
        assert sorted(store.iter_keys()) == sorted([keys[0], keys[2]])
        assert store.stats()["entries"] == 2

    def test_put_many_get_many(self, store: KVStore) -> None:
        chunks = [random_chunk(make_spec("float16"), T=2 + i, seed=20 + i) for i in range(4)]
        keys = [chunk_key(c) for c in chunks]
        store.put_many(zip(keys, chunks, strict=True))
        missing = chunk_key(random_chunk(make_spec(), T=1, seed=99))
        got = store.get_many([keys[2], missing, keys[0], keys[3], keys[1]])
        assert got[1] is None
        for g, i in zip([got[0], got[2], got[3], got[4]], [2, 0, 3, 1], strict=True):
            assert_chunks_equal(g, chunks[i])
        assert store.get_many([]) == []
        store.put_many([])
        s = store.stats()
        assert (s["hits"], s["misses"]) == (4, 1)

    def test_overwrite_same_key(self, store: KVStore) -> None:
        first, second = random_chunk(make_spec(), T=5, seed=30), random_chunk(make_spec(), T=7, seed=31)
        key = chunk_key(first)
        store.put(key, first)
        store.put(key, second)
        assert_chunks_equal(store.get(key), second)
        assert list(store.iter_keys()) == [key]

    def test_returned_tensors_are_not_aliases(self, store: KVStore) -> None:
        chunk = random_chunk(make_spec(), T=6, seed=40)
        original = random_chunk(make_spec(), T=6, seed=40)
        key = chunk_key(chunk)
        store.put(key, chunk)
        # Mutating the caller's tensors after put must not reach the store ...
        chunk.keys.zero_()
        chunk.token_ids.fill_(7)
        got = store.get(key)
        assert_chunks_equal(got, original)
        # ... nor mutating what get returned.
        assert got is not None
        got.keys.add_(1.0)
        got.values.mul_(0.0)
        got.token_ids.fill_(-1)
        assert_chunks_equal(store.get(key), original)

    @pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
    def test_malformed_key_raises_config_error(self, store: KVStore, bad: Any) -> None:
        chunk = random_chunk(make_spec(), T=2, seed=50)
        calls = [
            lambda: store.get(bad),
            lambda: store.put(bad, chunk),
            lambda: store.contains(bad),
            lambda: store.delete(bad),
            lambda: store.get_many([chunk_key(chunk), bad]),
            lambda: store.put_many([(chunk_key(chunk), chunk), (bad, chunk)]),
        ]
        for call in calls:
            with pytest.raises(ConfigError):
                call()
        # A batch with one bad key is rejected before anything is written.
        assert list(store.iter_keys()) == []

    def test_foreign_spec_not_served(self, tmp_path: Path) -> None:
        ours = make_spec(fingerprint="model-a")
        store = self.make_store(tmp_path, expected_spec=ours)
        try:
            for foreign_spec in (make_spec(fingerprint="model-b"), make_spec(fingerprint="model-a", head_dim=4)):
                foreign = random_chunk(foreign_spec, T=4, seed=60)
                key = chunk_key(foreign)
                store.put(key, foreign)
                assert store.get(key) is None
                assert store.get_many([key]) == [None]
                assert store.contains(key), "a foreign entry belongs to another model and must not be deleted"
            mine = random_chunk(ours, T=4, seed=61)
            store.put(chunk_key(mine), mine)
            assert_chunks_equal(store.get(chunk_key(mine)), mine)
            assert store.stats()["foreign_skipped"] >= 4
        finally:
            store.close()

    @pytest.mark.parametrize("dtype", SPEC_DTYPES)
    def test_int8_codec_round_trip(self, tmp_path: Path, dtype: str) -> None:
        store = self.make_store(tmp_path, codec="int8")
        try:
            chunk = random_chunk(make_spec(dtype), T=16, seed=70)
            key = chunk_key(chunk, codec="int8")
            store.put(key, chunk)
            got = store.get(key)
            assert got is not None
            assert got.spec == chunk.spec
            assert torch.equal(got.token_ids, chunk.token_ids)
            for name in ("keys", "values"):
                x, y = getattr(got, name), getattr(chunk, name)
                assert x.dtype == y.dtype and x.shape == y.shape
                assert relative_rmse(x, y) < 1e-2
        finally:
            store.close()

    def test_stats_and_context_manager(self, tmp_path: Path) -> None:
        chunk = random_chunk(make_spec(), T=3, seed=80)
        key = chunk_key(chunk)
        with self.make_store(tmp_path) as store:
            store.put(key, chunk)
            assert store.get(key) is not None
            assert store.get(chunk_key(random_chunk(make_spec(), T=3, seed=81))) is None
            s = store.stats()
            assert s["entries"] == 1 and s["bytes"] is not None and s["bytes"] > 0
            assert (s["hits"], s["misses"], s["corrupt_dropped"]) == (1, 1, 0)
