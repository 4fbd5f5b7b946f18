"""serde: entry format, integrity checks and codecs."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from kvrag.errors import CacheCorruptError, CacheMismatchError, ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.keys import FORMAT_VERSION
from kvrag.kv.spec import DTYPES
from kvrag.store import serde
from kvrag_testing.store_suite import assert_chunks_equal, make_spec, random_chunk, relative_rmse


def _rebuild(header: dict, payload: bytes, *, fix_payload_sums: bool = True) -> bytes:
    """Re-encode an entry from a (possibly edited) header and payload with valid checksums."""
    h = {k: v for k, v in header.items() if k != "header_sha256"}
    if fix_payload_sums:
        h.update(payload_len=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    h["header_sha256"] = hashlib.sha256(serde._canonical_json(h)).hexdigest()
    hb = serde._canonical_json(h)
    return serde.MAGIC + len(hb).to_bytes(8, "little") + hb + payload


@pytest.fixture
def chunk() -> ChunkKV:
    return random_chunk(make_spec(), T=5, seed=0)


def test_header_fields(chunk: ChunkKV) -> None:
    data = serde.encode(chunk, "float16")
    assert data.startswith(b"KVRAG\x00")
    header, payload = serde.decode_header(data)
    hlen = int.from_bytes(data[6:14], "little")
    assert json.loads(data[14 : 14 + hlen]) == header
    assert header["format_version"] == FORMAT_VERSION
    assert header["spec"] == chunk.spec.to_dict()
    assert (header["codec"], header["num_tokens"], header["payload_len"]) == ("float16", 5, len(payload))
    assert header["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert serde.decode_header(serde.encode(chunk))[0]["codec"] == "float32"  # native resolves to spec dtype


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("codec", serde.CODECS)
def test_round_trip_each_codec(dtype: str, codec: str) -> None:
    chunk = random_chunk(make_spec(dtype), T=16, seed=1)
    got = serde.decode(serde.encode(chunk, codec), expected_spec=chunk.spec)
    assert got.spec == chunk.spec and got.keys.dtype == chunk.spec.torch_dtype
    assert torch.equal(got.token_ids, chunk.token_ids)
    if codec == "native" or codec == "float32" or codec == dtype:
        assert_chunks_equal(got, chunk)
    elif codec == "int8":
        assert relative_rmse(got.keys, chunk.keys) < 1e-2 and relative_rmse(got.values, chunk.values) < 1e-2
    else:  # a narrower float codec: exactly the cast through it
        assert torch.equal(got.keys, chunk.keys.to(DTYPES[codec]).to(chunk.keys.dtype))


def test_int8_zero_rows_and_scales(chunk: ChunkKV) -> None:
    chunk.keys.zero_()
    chunk.values[:, :, 0] = 1e4  # a huge token next to normal ones
    got = serde.decode(serde.encode(chunk, "int8"))
    assert torch.equal(got.keys, chunk.keys)
    assert relative_rmse(got.values, chunk.values) < 1e-2
    _, payload = serde.decode_header(serde.encode(chunk, "int8"))
    from safetensors.torch import load

    t = load(bytes(payload))
    assert t["keys"].dtype == torch.int8 and t["keys_scale"].shape == (2, 2, 5, 1)
    assert t["keys_scale"].dtype == torch.float32


def test_decode_accepts_bytearray_and_memoryview(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    assert_chunks_equal(serde.decode(bytearray(data)), chunk)
    assert_chunks_equal(serde.decode(memoryview(data)), chunk)


def test_unknown_codec(chunk: ChunkKV) -> None:
    with pytest.raises(ConfigError, match="int8"):
        serde.encode(chunk, "zstd")


def test_bad_magic(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    with pytest.raises(CacheCorruptError, match="magic"):
        serde.decode(b"NOTKV\x00" + data[6:])


def test_truncated_everywhere(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    hlen = int.from_bytes(data[6:14], "little")
    for cut in (0, 3, 6, 13, 14, 14 + hlen // 2, 14 + hlen, 14 + hlen + 10, len(data) - 1):
        with pytest.raises(CacheCorruptError, match="truncated|JSON"):
            serde.decode(data[:cut])


def test_trailing_garbage(chunk: ChunkKV) -> None:
    with pytest.raises(CacheCorruptError, match="payload is"):
        serde.decode(serde.encode(chunk) + b"\x00")


def test_bad_checksum(chunk: ChunkKV) -> None:
    data = bytearray(serde.encode(chunk))
    data[-1] ^= 0x40
    with pytest.raises(CacheCorruptError, match="checksum"):
        serde.decode(bytes(data))


def test_bad_json(chunk: ChunkKV) -> None:
    hb = b"{not json"
    with pytest.raises(CacheCorruptError, match="JSON"):
        serde.decode(serde.MAGIC + len(hb).to_bytes(8, "little") + hb)
    hb = b"[1, 2]"
    with pytest.raises(CacheCorruptError, match="JSON object"):
        serde.decode(serde.MAGIC + len(hb).to_bytes(8, "little") + hb)


def test_edited_header_fails_header_checksum(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    edited = data.replace(b'"model_fingerprint":"test-model"', b'"model_fingerprint":"test-modex"')
    assert edited != data
    with pytest.raises(CacheCorruptError, match="header checksum"):
        serde.decode(edited)


def test_every_single_byte_flip_is_detected() -> None:
    chunk = random_chunk(make_spec(layers=1, kv_heads=1, head_dim=2), T=1, seed=3)
    data = serde.encode(chunk)
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            with pytest.raises((CacheCorruptError, CacheMismatchError)):
                serde.decode(bytes(flipped))


def test_format_version_mismatch(chunk: ChunkKV) -> None:
    header, payload = serde.decode_header(serde.encode(chunk))
    with pytest.raises(CacheMismatchError, match="format_version 999"):
        serde.decode(_rebuild({**header, "format_version": 999}, bytes(payload)))


def test_expected_spec_mismatch_names_fields(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    other = make_spec(fingerprint="other-model", head_dim=4)
    with pytest.raises(CacheMismatchError, match="head_dim.*model_fingerprint"):
        serde.decode(data, expected_spec=other)
    with pytest.raises(CacheMismatchError, match="dtype"):
        serde.decode(data, expected_spec=make_spec("float16"))
    assert_chunks_equal(serde.decode(data, expected_spec=make_spec()), chunk)


def test_payload_missing_tensor_or_wrong_shape(chunk: ChunkKV) -> None:
    header, _ = serde.decode_header(serde.encode(chunk))
    only_keys = st_save({"token_ids": chunk.token_ids, "keys": chunk.keys.contiguous()})
    with pytest.raises(CacheCorruptError, match="missing tensor 'values'"):
        serde.decode(_rebuild(header, only_keys))
    wrong = st_save(
        {"token_ids": chunk.token_ids, "keys": chunk.keys[:, :1].contiguous(), "values": chunk.values.contiguous()}
    )
    with pytest.raises(CacheCorruptError, match="'keys' is"):
        serde.decode(_rebuild(header, wrong))
    with pytest.raises(CacheCorruptError, match="safetensors"):
        serde.decode(_rebuild(header, b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"))
    with pytest.raises(CacheCorruptError, match="num_tokens"):
        serde.decode(_rebuild({**header, "num_tokens": -1}, serde.decode_header(serde.encode(chunk))[1].tobytes()))
    with pytest.raises(CacheCorruptError, match="unknown codec"):
        serde.decode(_rebuild({**header, "codec": "native"}, serde.decode_header(serde.encode(chunk))[1].tobytes()))


def test_encode_never_aliases_input(chunk: ChunkKV) -> None:
    data = serde.encode(chunk)
    chunk.keys.zero_()
    assert not torch.equal(serde.decode(data).keys, chunk.keys)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    T=st.integers(0, 9),
    head_dim=st.integers(1, 16),
    dtype=st.sampled_from(sorted(DTYPES)),
    codec=st.sampled_from(serde.CODECS),
    seed=st.integers(0, 2**31 - 1),
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=9, max_size=9),
)
def test_property_round_trip(
    layers: int, heads: int, T: int, head_dim: int, dtype: str, codec: str, seed: int, ids: list[int]
) -> None:
    spec = make_spec(dtype, layers=layers, kv_heads=heads, head_dim=head_dim)
    chunk = random_chunk(spec, T=T, seed=seed)
    chunk.token_ids = torch.tensor(ids[:T], dtype=torch.int64)
    data = serde.encode(chunk, codec)
    got = serde.decode(data, expected_spec=spec)
    assert got.spec == spec and torch.equal(got.token_ids, chunk.token_ids)
    for name in ("keys", "values"):
        x, y = getattr(got, name), getattr(chunk, name)
        assert x.dtype == y.dtype and x.shape == y.shape
        if codec == "int8":
            # Per-element bound: half a quantization step of the row's absmax, plus re-rounding to the spec dtype.
            absmax = y.float().abs().amax(dim=-1, keepdim=True)
            eps = torch.finfo(y.dtype).eps
            bound = absmax / 254 * (1 + 1e-5) + y.float().abs() * eps + absmax * eps
            assert bool(((x.float() - y.float()).abs() <= bound).all())
        else:
            via = DTYPES[serde.resolve_codec(codec, spec)]
            assert torch.equal(x, y.to(via).to(y.dtype))
