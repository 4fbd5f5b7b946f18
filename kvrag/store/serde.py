"""ChunkKV <-> bytes: a JSON header (spec, version, checksums) followed by a safetensors payload.

Wire format (one value per key, identical on disk and in Redis)::

    b"KVRAG\\x00"                      6 bytes magic
    header_len                         8 bytes, little-endian unsigned
    header                             header_len bytes of UTF-8 JSON (canonical: sorted keys, no spaces)
    payload                            safetensors bytes: token_ids [T] int64, keys/values [L, H_kv, T, D]
                                       (+ keys_scale/values_scale [L, H_kv, T, 1] float32 for codec int8)

The header holds ``format_version``, ``spec`` (KVSpec.to_dict), ``codec``, ``num_tokens``, ``payload_len``,
``payload_sha256`` and ``header_sha256`` (sha256 of the canonical header JSON without that field), so every byte
of an entry is covered by a check. Never pickle: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TypedDict

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvrag.errors import CacheCorruptError, CacheMismatchError, ConfigError
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.keys import FORMAT_VERSION
from kvrag.kv.spec import DTYPES, KVSpec, KVSpecRecord

MAGIC = b"KVRAG\x00"
_LEN_BYTES = 8
_PREFIX_LEN = len(MAGIC) + _LEN_BYTES
# A header is a few hundred bytes; anything bigger is a corrupt length field, not a real header.
_MAX_HEADER_LEN = 1 << 20

CODECS: tuple[str, ...] = ("native", "float16", "bfloat16", "float32", "int8")
_REQUIRED_FIELDS = ("format_version", "spec", "codec", "num_tokens", "payload_len", "payload_sha256", "header_sha256")


def resolve_codec(codec: str, spec: KVSpec) -> str:
    """Return the concrete codec name ('native' becomes the spec's dtype name).

    Raises:
        ConfigError: for an unknown codec.
    """
    if codec not in CODECS:
        msg = f"unknown KV codec {codec!r}; expected one of {list(CODECS)}"
        raise ConfigError(msg)
    return spec.dtype if codec == "native" else codec


class _HeaderBody(TypedDict):
    format_version: int
    spec: KVSpecRecord
    codec: str
    num_tokens: int
    payload_len: int
    payload_sha256: str


class EntryHeader(_HeaderBody, total=False):
    """An entry's JSON header: its format version, spec, concrete codec, token count, and the payload's and its own
    checksums (:func:`decode_header` checks that every field is present; :func:`decode` checks their values)."""

    header_sha256: str


def _canonical_json(obj: Mapping[str, object]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 quantization per token and head over D.

    Args:
        x: [L, H_kv, T, D] float tensor.

    Returns:
        q: [L, H_kv, T, D] int8 and scale: [L, H_kv, T, 1] float32 with x ~= q * scale.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # [L, H_kv, T, 1]
    # An all-zero row has scale 0; any positive scale then encodes it exactly as zeros.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def encode(chunk: ChunkKV, codec: str = "native") -> bytes:
    """Serialize a chunk cache.

    Args:
        chunk: token_ids [T], keys/values [L, H_kv, T, D] on any device.
        codec: 'native' (the spec's dtype), 'float16', 'bfloat16', 'float32' or 'int8'
            (per-token-per-head absmax over D, float32 scales).

    Returns:
        The entry bytes (magic + header + safetensors payload).

    Raises:
        ConfigError: for an unknown codec or tensors that do not match the spec.
    """
    chunk.validate()
    spec = chunk.spec
    concrete = resolve_codec(codec, spec)
    keys = chunk.keys.detach().to("cpu")
    values = chunk.values.detach().to("cpu")
    tensors: dict[str, torch.Tensor] = {
        "token_ids": chunk.token_ids.detach().to("cpu", torch.int64).contiguous(),
    }
    if concrete == "int8":
        tensors["keys"], tensors["keys_scale"] = _quantize_int8(keys)
        tensors["values"], tensors["values_scale"] = _quantize_int8(values)
    else:
        dt = DTYPES[concrete]
        # clone() so the payload never shares storage with the caller's (or with each other's) tensors.
        tensors["keys"] = keys.to(dt).contiguous().clone()
        tensors["values"] = values.to(dt).contiguous().clone()
    payload = st_save(tensors)
    header: EntryHeader = {
        "format_version": FORMAT_VERSION,
        "spec": spec.to_dict(),
        "codec": concrete,
        "num_tokens": chunk.num_tokens,
        "payload_len": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    header["header_sha256"] = hashlib.sha256(_canonical_json(header)).hexdigest()
    hbytes = _canonical_json(header)
    return b"".join((MAGIC, len(hbytes).to_bytes(_LEN_BYTES, "little"), hbytes, payload))


def spec_diff(stored: KVSpec, expected: KVSpec) -> list[str]:
    """Names and values of the KVSpec fields that differ, e.g. ["head_dim: stored 64, expected 128"]."""
    a, b = stored.to_dict(), expected.to_dict()
    return [f"{k}: stored {a.get(k)!r}, expected {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def decode_header(data: bytes | bytearray | memoryview) -> tuple[EntryHeader, memoryview]:
    """Parse and verify the magic, lengths and header of an entry (not the payload checksum).

    Returns:
        (header dict, payload view).

    Raises:
        CacheCorruptError: truncated data, bad magic, bad length, bad JSON or header checksum.
        CacheMismatchError: the entry was written by another format version.
    """
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX_LEN:
        msg = f"truncated KV entry: {len(view)} bytes, expected at least {_PREFIX_LEN}"
        raise CacheCorruptError(msg)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        msg = f"bad magic {bytes(view[: len(MAGIC)])!r}, expected {MAGIC!r}: not a kvrag KV entry"
        raise CacheCorruptError(msg)
    hlen = int.from_bytes(view[len(MAGIC) : _PREFIX_LEN], "little")
    if hlen > _MAX_HEADER_LEN or _PREFIX_LEN + hlen > len(view):
        msg = f"truncated KV entry: header length {hlen}, but only {len(view) - _PREFIX_LEN} bytes follow"
        raise CacheCorruptError(msg)
    try:
        header: EntryHeader = json.loads(bytes(view[_PREFIX_LEN : _PREFIX_LEN + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        msg = f"bad JSON header in KV entry: {e}"
        raise CacheCorruptError(msg) from e
    if not isinstance(header, dict):
        msg = f"bad KV entry header: expected a JSON object, got {type(header).__name__}"
        raise CacheCorruptError(msg)
    # The version is checked before the rest so a newer/older layout reads as foreign, not as damage.
    if header.get("format_version") != FORMAT_VERSION:
        msg = f"KV entry format_version {header.get('format_version')!r} differs from this kvrag's {FORMAT_VERSION}"
        raise CacheMismatchError(msg)
    missing = [f for f in _REQUIRED_FIELDS if f not in header]
    if missing:
        msg = f"bad KV entry header: missing fields {missing}"
        raise CacheCorruptError(msg)
    unhashed = {k: v for k, v in header.items() if k != "header_sha256"}
    if hashlib.sha256(_canonical_json(unhashed)).hexdigest() != header["header_sha256"]:
        msg = "KV entry header checksum mismatch (header bytes were altered)"
        raise CacheCorruptError(msg)
    return header, view[_PREFIX_LEN + hlen :]


def decode(data: bytes | bytearray | memoryview, expected_spec: KVSpec | None = None) -> ChunkKV:
    """Deserialize and verify an entry; returns fresh tensors in the spec's dtype on CPU.

    Args:
        data: bytes produced by :func:`encode`.
        expected_spec: when given, the stored spec must equal it.

    Returns:
        ChunkKV with token_ids [T] int64 and keys/values [L, H_kv, T, D].

    Raises:
        CacheCorruptError: truncated data, bad magic/JSON, checksum or shape mismatch.
        CacheMismatchError: another format version, or a spec that differs from ``expected_spec``.
    """
    header, payload = decode_header(data)
    try:
        spec = KVSpec.from_dict(header["spec"])
    except (ConfigError, TypeError) as e:
        msg = f"bad KV entry header: invalid spec {header['spec']!r}: {e}"
        raise CacheCorruptError(msg) from e
    if expected_spec is not None and spec != expected_spec:
        msg = f"KV entry belongs to another model/spec; differs in {spec_diff(spec, expected_spec)}"
        raise CacheMismatchError(msg)
    if len(payload) != header["payload_len"]:
        msg = f"truncated KV entry: payload is {len(payload)} bytes, header says {header['payload_len']}"
        raise CacheCorruptError(msg)
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        msg = "KV entry payload checksum mismatch (sha256 differs)"
        raise CacheCorruptError(msg)
    codec = header["codec"]
    if codec not in CODECS or codec == "native":
        msg = f"bad KV entry header: unknown codec {codec!r}"
        raise CacheCorruptError(msg)
    try:
        tensors = st_load(bytes(payload))
    except Exception as e:  # safetensors raises its own error types; any failure here is damage
        msg = f"bad safetensors payload in KV entry: {e}"
        raise CacheCorruptError(msg) from e
    return _build_chunk(tensors, header, spec, codec)


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if t is None:
        msg = f"KV entry payload is missing tensor {name!r}"
        raise CacheCorruptError(msg)
    if tuple(t.shape) != shape or t.dtype != dtype:
        msg = f"KV entry tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}"
        raise CacheCorruptError(msg)
    return t


def _build_chunk(tensors: dict[str, torch.Tensor], header: EntryHeader, spec: KVSpec, codec: str) -> ChunkKV:
    n = header["num_tokens"]
    if not isinstance(n, int) or n < 0:
        msg = f"bad KV entry header: num_tokens {n!r}"
        raise CacheCorruptError(msg)
    kv_shape = (spec.num_layers, spec.num_kv_heads, n, spec.head_dim)  # [L, H_kv, T, D]
    token_ids = _check("token_ids", tensors.get("token_ids"), (n,), torch.int64)
    out: dict[str, torch.Tensor] = {}
    for name in ("keys", "values"):
        if codec == "int8":
            q = _check(name, tensors.get(name), kv_shape, torch.int8)
            scale = _check(f"{name}_scale", tensors.get(f"{name}_scale"), kv_shape[:3] + (1,), torch.float32)
            out[name] = (q.float() * scale).to(spec.torch_dtype)
        else:
            out[name] = _check(name, tensors.get(name), kv_shape, DTYPES[codec]).to(spec.torch_dtype)
    return ChunkKV(token_ids=token_ids, keys=out["keys"], values=out["values"], spec=spec, codec=codec)
