"""A GGUF file's quantized blocks de-quantized: in torch, and in C (``ggml_dequant.c``), with the same bits.

:func:`dequantize` turns the raw blocks of a GGUF tensor (uint8 ``[rows, row bytes]``, e.g. a view of the file's
memory map) into float32, with the arithmetic of ``gguf.quants.dequantize`` -- the same float32 products and sums
in the same order, so the result is the same bit for bit (tested on files written by the ``gguf`` package). Types:
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, which are the types inside llama.cpp's Q4_0 /
Q4_1 / Q8_0 / Q4_K_M / Q5_K_M / Q6_K files (a K-quant file keeps Q5_0 / Q8_0 for rows not a multiple of 256 wide).
``ggml_dequant.c`` computes the same floats for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K (checked against the torch
code when it loads), and multiplies a few input rows by a weight it de-quantizes on the way (:data:`DOT_TYPES`'
decode-sized products, :class:`kvrag.kv.gguf_quant.GGUFLinear`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from kvrag.kv import native

QK_K = 256
TYPES: dict[str, tuple[int, int]] = {  # name: (weights per block, bytes per block)
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}
"""The GGUF tensor types kvrag keeps resident, by ``gguf.GGMLQuantizationType`` name."""
FLOAT_TYPES = ("F32", "F16", "BF16")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""Types whose blocks are exactly kvrag's int4 groups (one kernel product)."""
SPLIT_TYPES = ("Q5_0", "Q5_1", "Q8_0", "Q5_K")
"""Types whose blocks are two int4 products (``q = 16 hi + lo``)."""


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (little-endian float16) -> float32 [rows, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """``qs`` [n, c * width] -> [n, c, 2, width]: each chunk of ``width`` bytes' low nibbles, then its high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, width)
    return torch.cat([qs & 15, qs >> 4], dim=2)


def _scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 packed bytes of a super-block -> the 8 six-bit scales and mins (uint8 [n, 8] each)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-blocks [n, bytes]: each 32-weight sub-block's scale ``d * sc`` and offset ``dmin * m``
    (float32 [n, 8, 1]), as gguf computes them."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    return (d * sc.float()).reshape(-1, 8, 1), (dmin * mn.float()).reshape(-1, 8, 1)


def _q5(b: torch.Tensor) -> torch.Tensor:
    """Q5_K super-blocks -> their 5-bit ``q`` (uint8 [n, 8, 32])."""
    qh, qs = b[:, 16:48], b[:, 48:176]
    ql = _nibbles(qs, 32).reshape(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    hi = (qh.reshape(-1, 1, 32) >> shifts) & 1
    return ql | (hi << 4)


def _q5_32(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks -> their 5-bit ``q`` (uint8 [n, 32]): the low nibbles after the 4 bytes of high bits
    (bit i of the little-endian word is weight i's)."""
    ql = _nibbles(b[:, qh_at + 4 :], 16).reshape(-1, 32)
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    hi = ((b[:, qh_at : qh_at + 4].reshape(-1, 4, 1) >> shifts) & 1).reshape(-1, 32)
    return ql | (hi << 4)


def _blocks(qtype: str, b: torch.Tensor) -> torch.Tensor:
    """float32 [n, block] of ``n`` blocks of ``qtype`` (uint8 [n, bytes])."""
    n = b.shape[0]
    if qtype == "Q4_0":
        q = _nibbles(b[:, 2:], 16).reshape(n, 32).to(torch.int8) - 8
        return _f16(b[:, :2]) * q.float()
    if qtype == "Q4_1":
        return _f16(b[:, :2]) * _nibbles(b[:, 4:], 16).reshape(n, 32).float() + _f16(b[:, 2:4])
    if qtype == "Q5_0":
        return _f16(b[:, :2]) * (_q5_32(b, 2).to(torch.int8) - 16).float()
    if qtype == "Q5_1":
        return _f16(b[:, :2]) * _q5_32(b, 4).float() + _f16(b[:, 2:4])
    if qtype == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])
    if qtype == "Q4_K":
        d, dm = _k_parts(b)
        q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
        return (d * q - dm).reshape(n, QK_K)
    if qtype == "Q5_K":
        d, dm = _k_parts(b)
        return (d * _q5(b).float() - dm).reshape(n, QK_K)
    if qtype == "Q6_K":
        ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208]
        d = (_f16(b[:, 208:210]) * sc.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
        low = _nibbles(ql, 64).reshape(n, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        return (d * q).reshape(n, QK_K)
    msg = f"GGUF tensor type {qtype} is not one kvrag keeps resident ({', '.join(TYPES)})"
    raise ValueError(msg)


_NATIVE_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
"""The types ``ggml_dequant.c`` de-quantizes (its type numbers)."""


_Dequant = Callable[[int, int, int, int, int, int, int, int], int]
"""``kvrag_dequant(type, blocks, rows, row_bytes, columns, out, bf16, threads)`` (pointers as integers)."""


def _library() -> ctypes.CDLL:
    """``ggml_dequant.c`` built for this machine (:mod:`kvrag.kv.native`) and opened."""
    return native.open_library(Path(__file__).with_name("ggml_dequant.c"), "kvrag_dequant_abi", 5)


def _row_major(raw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``raw`` as [rows, row bytes] whose rows the C code can walk (bytes contiguous, rows apart by a stride at least
    a row long), and that stride."""
    raw = raw.reshape(-1, raw.shape[-1])
    if raw.stride(-1) != 1 or (raw.shape[0] > 1 and raw.stride(0) < raw.shape[1]):
        raw = raw.contiguous()
    return raw, raw.stride(0) if raw.shape[0] > 1 else raw.shape[1]


@functools.cache
def native_dequant() -> _Dequant | None:
    """``kvrag_dequant`` of ``ggml_dequant.c`` (built once per machine, :mod:`kvrag.kv.native`), checked against
    the torch arithmetic below on random blocks of every type; None where it cannot serve (no compiler, a failed
    check, ``KVRAG_DEQUANT=torch``): the torch code de-quantizes then."""
    if native.setting("KVRAG_DEQUANT", ("torch",)) == "torch":
        return None

    def load() -> _Dequant:
        fn = _library().kvrag_dequant
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, vp, i64, i64, i64, vp, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        gen = torch.Generator().manual_seed(0)
        for qtype in _NATIVE_TYPES:
            block, size = TYPES[qtype]
            raw = torch.randint(0, 256, (3, 2 * size), dtype=torch.uint8, generator=gen)
            if qtype != "Q6_K":  # keep the half-precision scales finite
                raw.view(3, 2, size)[..., 1] &= 0x3F
                if qtype in ("Q4_1", "Q4_K", "Q5_K"):
                    raw.view(3, 2, size)[..., 3] &= 0x3F
            else:
                raw.view(3, 2, size)[..., 209] &= 0x3F
            got = dequantize_into(fn, raw, qtype, 2 * block)
            want = _blocks(qtype, raw.reshape(-1, size)).reshape(3, 2 * block)
            half = dequantize_into(fn, raw, qtype, 2 * block, torch.empty(3, 2 * block, dtype=torch.bfloat16))
            if not (torch.equal(got.view(torch.int32), want.view(torch.int32))
                    and torch.equal(half.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))):
                msg = f"ggml_dequant.c self-check: {qtype} differs from the torch de-quantization"
                raise RuntimeError(msg)
        return cast("_Dequant", fn)

    return native.attempt("kvrag's GGUF de-quantization kernel", load)[0]


Dot = Callable[[int, int, int, int, int, int, int, int, int], int]
"""``kvrag_dequant_dot(type, blocks, n, row_bytes, columns, x, rows, y, threads)`` (pointers as integers)."""

DOT_TYPES = ("Q6_K",)
"""Types whose decode-sized products run ``kvrag_dequant_dot`` (:meth:`GGUFLinear.use_int4`): those with no int4
form that ``ggml_dequant.c`` de-quantizes."""


def _check_dot(fn: Dot, bf16: bool) -> None:
    """Raise unless ``fn`` multiplies random blocks of every type it serves like the de-quantized weight (float32
    rounding) and computes each input row alike alone and among others."""
    gen = torch.Generator().manual_seed(1)
    for qtype in ("Q6_K",) if bf16 else _NATIVE_TYPES:
        block, size = TYPES[qtype]
        raw = torch.randint(0, 256, (5, 2 * size), dtype=torch.uint8, generator=gen)
        raw.view(5, 2, size)[..., size - 1 if qtype == "Q6_K" else 1] &= 0x3F  # finite half-precision scales
        if qtype in ("Q4_1", "Q4_K", "Q5_K"):
            raw.view(5, 2, size)[..., 3] &= 0x3F
        w = _blocks(qtype, raw.reshape(-1, size)).reshape(5, 2 * block)
        x = torch.randn(3, 2 * block, generator=gen)
        if bf16:
            x = x.to(torch.bfloat16)
        got, one = dot(fn, raw, qtype, x, bf16=bf16), dot(fn, raw, qtype, x[1:2], bf16=bf16)
        want = x.double() @ w.double().T
        tol = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
        if not (bool(((got.double() - want).abs() <= tol).all()) and torch.equal(one[0], got[1])):
            msg = f"ggml_dequant.c self-check: the {qtype} product differs from the de-quantized weight's"
            raise RuntimeError(msg)


def _dot_function(name: str) -> Dot:
    fn = getattr(_library(), name)
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ctypes.c_int, vp, i64, i64, i64, vp, i64, vp, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Dot", fn)


@functools.cache
def native_dot() -> Dot | None:
    """``kvrag_dequant_dot`` of ``ggml_dequant.c`` (float32 inputs), checked on random blocks of every type against
    the product by the de-quantized weight (float32 rounding) and for rows computed alike alone and together; None
    where it cannot serve (as :func:`native_dequant`)."""
    if native_dequant() is None:
        return None

    def load() -> Dot:
        fn = _dot_function("kvrag_dequant_dot")
        _check_dot(fn, bf16=False)
        return fn

    return native.attempt("kvrag's GGUF de-quantizing product", load)[0]


@functools.cache
def native_dot_bf16() -> Dot | None:
    """``kvrag_dequant_dot_bf16`` of ``ggml_dequant.c``: Q6_K weights times bfloat16 inputs with AVX512-BF16 (one
    VDPBF16PS per 32 weights; its speed against the float32 product: docs/quantization.md), checked as
    :func:`native_dot`; None where the CPU lacks AVX512-BF16 or the library cannot serve (bfloat16 inputs then take
    :func:`native_dot`)."""
    if native_dot() is None:
        return None

    def load() -> Dot | None:
        fn = _dot_function("kvrag_dequant_dot_bf16")
        probe = torch.zeros(1, TYPES["Q6_K"][1], dtype=torch.uint8)
        x, y = torch.zeros(1, QK_K, dtype=torch.bfloat16), torch.empty(1)
        if fn(_NATIVE_TYPES["Q6_K"], probe.data_ptr(), 1, probe.shape[1], QK_K, x.data_ptr(), 1, y.data_ptr(), 1):
            return None  # this CPU has no AVX512-BF16
        _check_dot(fn, bf16=True)
        return fn

    return native.attempt("kvrag's bfloat16 Q6_K product", load)[0]


def dot(fn: Dot, raw: torch.Tensor, qtype: str, x: torch.Tensor, *, bf16: bool = False) -> torch.Tensor:
    """``x`` [rows <= 16, columns] times the transposed weight of ``raw`` [n, row bytes]: [rows, n] float32. ``x``
    goes to ``fn`` in bfloat16 when ``bf16`` (``fn`` is :func:`native_dot_bf16`'s), else in float32."""
    raw, row_bytes = _row_major(raw)
    x = x.to(torch.bfloat16 if bf16 else torch.float32).contiguous()
    y = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)
    if fn(_NATIVE_TYPES[qtype], raw.data_ptr(), raw.shape[0], row_bytes, x.shape[1], x.data_ptr(), x.shape[0],
          y.data_ptr(), torch.get_num_threads()):
        msg = f"kvrag_dequant_dot refused {qtype} rows {tuple(x.shape)}"
        raise ValueError(msg)
    return y


def native_for(qtype: str, raw: torch.Tensor) -> _Dequant | None:
    """The C de-quantization where it serves ``qtype`` blocks in ``raw`` (on the CPU), else None (torch's code)."""
    return native_dequant() if qtype in _NATIVE_TYPES and raw.is_cpu else None


def dequantize_into(fn: _Dequant, raw: torch.Tensor, qtype: str, columns: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``raw`` [rows, row bytes] de-quantized by ``ggml_dequant.c`` into ``out`` (contiguous float32 or bfloat16
    [rows, columns]; a new float32 tensor when None)."""
    raw, row_bytes = _row_major(raw)
    if out is None:
        out = torch.empty(raw.shape[0], columns, dtype=torch.float32)
    fn(_NATIVE_TYPES[qtype], raw.data_ptr(), raw.shape[0], row_bytes, columns, out.data_ptr(),
       int(out.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def dequantize(raw: torch.Tensor, qtype: str, columns: int, *, native: bool = True) -> torch.Tensor:
    """float32 ``[rows, columns]`` of a GGUF tensor's raw bytes ``raw`` (uint8 ``[rows, row bytes]``, any leading
    shape), bit for bit ``gguf.quants.dequantize``: by ``ggml_dequant.c`` where it is built (and ``native``), else
    by torch."""
    lead = raw.shape[:-1]
    if native and raw.numel() and (fn := native_for(qtype, raw)) is not None:
        return dequantize_into(fn, raw, qtype, columns).reshape(*lead, columns)
    if qtype == "F32":
        return raw.contiguous().view(torch.float32).reshape(*lead, columns)
    if qtype == "F16":
        return raw.contiguous().view(torch.float16).float().reshape(*lead, columns)
    if qtype == "BF16":
        return (raw.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(*lead, columns)
    size = TYPES[qtype][1] if qtype in TYPES else 0
    return _blocks(qtype, raw.reshape(-1, size)).reshape(*lead, columns)


def int4_parts(raw: torch.Tensor, qtype: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The int4 products (``q`` [N, K] in 0..15, bfloat16 ``scale`` / ``zero`` [N, K/32]) whose sum is the weight of
    ``raw`` (uint8 [N, row bytes]): one for :data:`INT4_TYPES`, two (high and low bits) for :data:`SPLIT_TYPES`."""
    n = raw.shape[0]
    b = raw.reshape(-1, TYPES[qtype][1])

    def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (q.reshape(n, -1).to(torch.int32), scale.reshape(n, -1).to(torch.bfloat16),
                zero.reshape(n, -1).to(torch.bfloat16))

    if qtype in ("Q4_0", "Q4_1"):
        d = _f16(b[:, :2])
        q = _nibbles(b[:, 2:] if qtype == "Q4_0" else b[:, 4:], 16)
        zero = torch.zeros_like(d) if qtype == "Q4_0" else _f16(b[:, 2:4]) + 8 * d
        return [pack(q, d, zero)]  # type: ignore[list-item]
    if qtype == "Q4_K":
        s, dm = _k_parts(b)
        return [pack(_nibbles(b[:, 16:], 32), s, 8 * s - dm)]  # type: ignore[list-item]
    if qtype == "Q5_K":
        s, dm = _k_parts(b)
        q = _q5(b)
        return [pack((q >> 4) + 8, 16 * s, torch.zeros_like(s)), pack(q & 15, s, 8 * s - dm)]  # type: ignore[list-item]
    if qtype in ("Q5_0", "Q5_1"):  # w = d q - 16 d (Q5_0) or d q + m (Q5_1), q = 16 hi + lo
        d = _f16(b[:, :2])
        q = _q5_32(b, 2 if qtype == "Q5_0" else 4)
        zero = -8 * d if qtype == "Q5_0" else 8 * d + _f16(b[:, 2:4])
        return [pack((q >> 4) + 8, 16 * d, torch.zeros_like(d)), pack(q & 15, d, zero)]  # type: ignore[list-item]
    if qtype == "Q8_0":
        d = _f16(b[:, :2])
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.int32)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)
        return [pack(hi + 8, 16 * d, torch.zeros_like(d)), pack(lo, d, 8 * d)]  # type: ignore[list-item]
    msg = f"GGUF type {qtype} has no int4 form"
    raise ValueError(msg)


__all__ = ["DOT_TYPES", "FLOAT_TYPES", "INT4_TYPES", "QK_K", "SPLIT_TYPES", "TYPES", "Dot", "dequantize",
           "dequantize_into", "dot", "int4_parts", "native_dequant", "native_dot", "native_dot_bf16", "native_for"]
