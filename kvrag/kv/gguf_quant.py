"""A GGUF file's own quantized blocks as model weights: de-quantization in torch and the modules that hold them.

:func:`dequantize` turns the raw blocks of a GGUF tensor (uint8 ``[rows, row bytes]``, e.g. a view of the file's
memory map) into float32, with the arithmetic of ``gguf.quants.dequantize`` -- the same float32 products and sums
in the same order, so the result is the same bit for bit (tested on files written by the ``gguf`` package). Types:
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, which are the types inside llama.cpp's Q4_0 /
Q4_1 / Q8_0 / Q4_K_M / Q5_K_M / Q6_K files (a K-quant file keeps Q5_0 / Q8_0 for rows not a multiple of 256 wide).

:class:`GGUFLinear` keeps a linear layer's blocks and computes its products two ways:

* inputs of at most :data:`kvrag.kv.quant.MAX_ROWS` rows (decode steps, short suffixes), when the model was loaded
  with ``quantize="int4"``: the int4 kernels of :mod:`kvrag.kv.quant` on the blocks re-laid out once at load. A
  Q4_0 / Q4_1 block and each 32-weight sub-block of a Q4_K super-block is exactly one of those kernels' groups
  (``w = (q - 8) scale + zero``: Q4_0 ``scale = d``; Q4_1 ``zero = m + 8 d``; Q4_K ``scale = d sc``, ``zero =
  8 d sc - dmin m``), the file's own 4-bit ``q`` unchanged and the scale and zero rounded to bfloat16, the kernels'
  format. Q5_0, Q5_1, Q8_0 and Q5_K weights are two such products (``q = 16 hi + lo``) whose outputs add up. Q6_K (groups of 16
  weights) has no such form: its decode-sized products de-quantize each weight row a chunk at a time in
  ``ggml_dequant.c`` and multiply it there in float32 (``kvrag_dequant_dot``), reading the file's blocks in place;
* larger inputs (prefill, ingest), other types, ``quantize=None``: the layer's weight de-quantized into one scratch
  buffer shared by every layer of the model (reused, never kept; by ``ggml_dequant.c`` where it builds, with the
  same bits), then the dense product in the compute dtype. A prefill's product costs hundreds of multiply-adds per
  weight, the de-quantization a handful of operations.

:class:`GGUFEmbedding` de-quantizes only the rows its ids look up; a tied output head is a :class:`GGUFLinear` on
the same blocks.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from kvrag.kv import int4_kernel, native, quant

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


@functools.cache
def _native() -> _Dequant | None:
    """``kvrag_dequant`` of ``ggml_dequant.c`` (built once per machine, :mod:`kvrag.kv.native`), checked against
    the torch arithmetic below on random blocks of every type; None where it cannot serve (no compiler, a failed
    check, ``KVRAG_DEQUANT=torch``): the torch code de-quantizes then."""
    if native.setting("KVRAG_DEQUANT", ("torch",)) == "torch":
        return None

    def load() -> _Dequant:
        lib = native.open_library(Path(__file__).with_name("ggml_dequant.c"), "kvrag_dequant_abi", 3)
        fn = lib.kvrag_dequant
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
            got = _native_dequantize(fn, raw, qtype, 2 * block)
            want = _blocks(qtype, raw.reshape(-1, size)).reshape(3, 2 * block)
            half = _native_dequantize(fn, raw, qtype, 2 * block, torch.empty(3, 2 * block, dtype=torch.bfloat16))
            if not (torch.equal(got.view(torch.int32), want.view(torch.int32))
                    and torch.equal(half.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))):
                msg = f"ggml_dequant.c self-check: {qtype} differs from the torch de-quantization"
                raise RuntimeError(msg)
        return cast("_Dequant", fn)

    return native.attempt("kvrag's GGUF de-quantization kernel", load)[0]


_Dot = Callable[[int, int, int, int, int, int, int, int, int], int]
"""``kvrag_dequant_dot(type, blocks, n, row_bytes, columns, x, rows, y, threads)`` (pointers as integers)."""

DOT_TYPES = ("Q6_K",)
"""Types whose decode-sized products run ``kvrag_dequant_dot`` (:meth:`GGUFLinear.use_int4`): those with no int4
form that ``ggml_dequant.c`` de-quantizes."""


@functools.cache
def _native_dot() -> _Dot | None:
    """``kvrag_dequant_dot`` of ``ggml_dequant.c``, checked on random blocks of every type against the product by
    the de-quantized weight (float32 rounding) and for rows computed alike alone and together; None where it cannot
    serve (as :func:`_native`)."""
    if _native() is None:
        return None

    def load() -> _Dot:
        lib = native.open_library(Path(__file__).with_name("ggml_dequant.c"), "kvrag_dequant_abi", 3)
        fn = lib.kvrag_dequant_dot
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ctypes.c_int, vp, i64, i64, i64, vp, i64, vp, ctypes.c_int]
        fn.restype = ctypes.c_int
        gen = torch.Generator().manual_seed(1)
        for qtype in _NATIVE_TYPES:
            block, size = TYPES[qtype]
            raw = torch.randint(0, 256, (5, 2 * size), dtype=torch.uint8, generator=gen)
            raw.view(5, 2, size)[..., size - 1 if qtype == "Q6_K" else 1] &= 0x3F  # finite half-precision scales
            if qtype in ("Q4_1", "Q4_K", "Q5_K"):
                raw.view(5, 2, size)[..., 3] &= 0x3F
            w = _blocks(qtype, raw.reshape(-1, size)).reshape(5, 2 * block)
            x = torch.randn(3, 2 * block, generator=gen)
            got, one = _dot(fn, raw, qtype, x), _dot(fn, raw, qtype, x[1:2])
            want = x.double() @ w.double().T
            tol = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
            if not (bool(((got.double() - want).abs() <= tol).all()) and torch.equal(one[0], got[1])):
                msg = f"ggml_dequant.c self-check: the {qtype} product differs from the de-quantized weight's"
                raise RuntimeError(msg)
        return cast("_Dot", fn)

    return native.attempt("kvrag's GGUF de-quantizing product", load)[0]


def _dot(fn: _Dot, raw: torch.Tensor, qtype: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows <= 16, columns] (float32) times the transposed weight of ``raw`` [n, row bytes]: [rows, n]."""
    raw = raw.reshape(-1, raw.shape[-1])
    if raw.stride(-1) != 1 or (raw.shape[0] > 1 and raw.stride(0) < raw.shape[1]):
        raw = raw.contiguous()
    x = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], raw.shape[0], dtype=torch.float32)
    if fn(_NATIVE_TYPES[qtype], raw.data_ptr(), raw.shape[0], raw.stride(0) if raw.shape[0] > 1 else raw.shape[1],
          x.shape[1], x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads()):
        msg = f"kvrag_dequant_dot refused {qtype} rows {tuple(x.shape)}"
        raise ValueError(msg)
    return y


def _native_for(qtype: str, raw: torch.Tensor) -> _Dequant | None:
    """The C de-quantization where it serves ``qtype`` blocks in ``raw`` (on the CPU), else None (torch's code)."""
    return _native() if qtype in _NATIVE_TYPES and raw.is_cpu else None


def _native_dequantize(fn: _Dequant, raw: torch.Tensor, qtype: str, columns: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``raw`` [rows, row bytes] de-quantized by ``ggml_dequant.c`` into ``out`` (contiguous float32 or bfloat16
    [rows, columns]; a new float32 tensor when None)."""
    raw = raw.reshape(-1, raw.shape[-1])
    if raw.stride(-1) != 1 or (raw.shape[0] > 1 and raw.stride(0) < raw.shape[1]):
        raw = raw.contiguous()
    if out is None:
        out = torch.empty(raw.shape[0], columns, dtype=torch.float32)
    fn(_NATIVE_TYPES[qtype], raw.data_ptr(), raw.shape[0], raw.stride(0) if raw.shape[0] > 1 else raw.shape[1],
       columns, out.data_ptr(), int(out.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def dequantize(raw: torch.Tensor, qtype: str, columns: int, *, native: bool = True) -> torch.Tensor:
    """float32 ``[rows, columns]`` of a GGUF tensor's raw bytes ``raw`` (uint8 ``[rows, row bytes]``, any leading
    shape), bit for bit ``gguf.quants.dequantize``: by ``ggml_dequant.c`` where it is built (and ``native``), else
    by torch."""
    lead = raw.shape[:-1]
    if native and raw.numel() and (fn := _native_for(qtype, raw)) is not None:
        return _native_dequantize(fn, raw, qtype, columns).reshape(*lead, columns)
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


TILE_WEIGHTS = 1 << 22
"""Weights de-quantized at a time by a dense product (16 MB of float32, the scratch buffer's size): a larger layer
is multiplied tile by tile of output rows."""
_PACK_ROWS = 4096
"""Rows re-laid out at a time (bounds the int32 temporaries of a large embedding / head)."""


def _int4_weights(blocks: torch.Tensor, qtype: str) -> list[quant._Int4]:
    """The int4 kernel weights (:class:`kvrag.kv.quant._Int4`) of :func:`int4_parts`, built ``_PACK_ROWS`` rows at a
    time for kvrag's kernel (whose layout is whole tiles of 16 rows, so the pieces concatenate)."""
    if int4_kernel.path() is None:
        return [quant._Int4.from_parts(*p) for p in int4_parts(blocks, qtype)]
    out: list[quant._Int4] = []
    for r in range(0, blocks.shape[0], _PACK_ROWS):
        for i, p in enumerate(int4_parts(blocks[r : r + _PACK_ROWS], qtype)):
            piece = int4_kernel.pack(*p)
            if i == len(out):
                w = quant._Int4.__new__(quant._Int4)
                w.n, w.scales_zeros = blocks.shape[0], None
                w.packed = piece.new_empty(blocks.shape[0] // int4_kernel.TILE, *piece.shape[1:])
                out.append(w)
            t = r // int4_kernel.TILE
            out[i].packed[t : t + piece.shape[0]] = piece
    return out


class Scratch:
    """One buffer a model's GGUF layers de-quantize their weights into for dense products (grown to the largest
    layer, reused). Guarded by a lock; a thread that finds it taken de-quantizes into a buffer of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf: dict[torch.dtype, torch.Tensor] = {}

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.buf.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            with torch.inference_mode(False):  # a normal tensor: written inside and outside inference mode
                buf = self.buf[dtype] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


class _Split:
    """Two int4 products whose outputs add up to the weight's product (Q8_0, Q5_K)."""

    __slots__ = ("hi", "lo", "n")

    def __init__(self, hi: quant._Int4, lo: quant._Int4) -> None:
        self.hi, self.lo, self.n = hi, lo, hi.n

    takes_float32 = False

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return (self.hi.mm(x).float() + self.lo.mm(x).float()).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.hi.nbytes + self.lo.nbytes)


PREFILL_ROUTES = ("exact", "int4")


def prefill_route() -> str:
    """How a GGUF layer with int4 weights multiplies more than :data:`kvrag.kv.quant.MAX_ROWS` rows
    (``KVRAG_GGUF_PREFILL``): ``exact`` (the default) de-quantizes the file's blocks for a dense product; ``int4``
    runs kvrag's int4 kernel on every product (where that kernel serves; elsewhere ``exact``). Both keep a prompt's K/V independent of
    how it is split (kvrag's kernel computes each row alike whatever the others); ``int4`` rounds a float32 model's
    prefill activations to bfloat16 and its weights' scales as decode does, never reads the file's pages after the
    load, and is keyed apart (``+int4-prefill``). Measured: docs/results/epyc/gguf_resident.md."""
    v = native.setting("KVRAG_GGUF_PREFILL", PREFILL_ROUTES)
    return "int4" if v == "int4" and int4_kernel.path() is not None else "exact"


class FilePages:
    """The pages of a GGUF file's memory map that hold one tensor's blocks (``length`` bytes from ``offset``)."""

    __slots__ = ("length", "mapping", "offset")

    def __init__(self, mapping: mmap.mmap, offset: int, length: int) -> None:
        self.mapping, self.offset, self.length = mapping, offset, length

    def give_back(self) -> None:
        """Drop the tensor's whole pages from this process's resident set (``MADV_DONTNEED``; a read-only shared
        file map, so nothing is lost: a later read maps them in again from the page cache or the file)."""
        page = mmap.PAGESIZE
        start = -(-self.offset // page) * page
        end = (self.offset + self.length) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class GGUFLinear(torch.nn.Module):
    """A linear layer whose weight is a GGUF tensor's raw blocks (``blocks``: uint8 [out, row bytes]), see the
    module docstring. ``weight`` is a meta tensor of the weight's shape and compute dtype (for code that reads
    shapes); nothing of float size is kept."""

    blocks: torch.Tensor

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype, scratch: Scratch,
                 bias: torch.Tensor | None = None, *, head: bool = False, pages: FilePages | None = None) -> None:
        super().__init__()
        self.pages = pages
        self.in_features, self.out_features = in_features, int(blocks.shape[0])
        self.qtype, self.dtype, self.scratch, self.head = qtype, dtype, scratch, head
        self.register_buffer("blocks", blocks)
        self.register_buffer("ggml_type", torch.tensor(list(TYPES).index(qtype)))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.int4: quant._Int4 | _Split | None = None
        self.all_rows = False  # every product on the int4 weights (KVRAG_GGUF_PREFILL=int4, :func:`prefill_route`)
        self.dot: _Dot | None = None  # decode-sized products by kvrag_dequant_dot (:data:`DOT_TYPES`)

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=self.dtype, device="meta")

    def use_int4(self, all_rows: bool = False) -> bool:
        """Give the layer its int4 kernel weights (:data:`INT4_TYPES`, :data:`SPLIT_TYPES`), when its shape fits
        the kernel's tiles, for products of at most :data:`kvrag.kv.quant.MAX_ROWS` rows or, ``all_rows``, every
        product (:func:`prefill_route`); returns whether it did."""
        if self.qtype in DOT_TYPES and self.blocks.is_cpu and not all_rows:
            self.dot = _native_dot()  # the file's blocks, de-quantized in the product: no layout of their own
            return self.dot is not None
        if (self.qtype not in INT4_TYPES + SPLIT_TYPES or self.out_features % 16 or self.in_features % quant.GROUP
                or not self.blocks.is_cpu):
            return False
        parts = _int4_weights(self.blocks, self.qtype)
        self.int4 = parts[0] if len(parts) == 1 else _Split(*parts)
        self.all_rows = all_rows
        if self.pages is not None:  # decode-sized products no longer read the file's pages: out of the resident set
            self.pages.give_back()
        return True

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 weight rows ``index`` (any shape): [..., in_features]."""
        return dequantize(self.blocks[index], self.qtype, self.in_features)

    def dense_tile(self, r0: int, r1: int, dtype: torch.dtype, scratch: bool) -> torch.Tensor:
        """Weight rows ``r0:r1`` in ``dtype``: in the model's scratch buffer when ``scratch`` (the caller holds its
        lock; valid until the next tile), else in a buffer of their own."""
        fn = _native_for(self.qtype, self.blocks) if dtype in (torch.float32, torch.bfloat16) else None
        if fn is not None:
            shape = (r1 - r0, self.in_features)
            out = (self.scratch.take(shape[0] * shape[1], dtype, self.blocks.device).view(shape) if scratch
                   else torch.empty(shape, dtype=dtype))
            return _native_dequantize(fn, self.blocks[r0:r1], self.qtype, self.in_features, out)
        w = dequantize(self.blocks[r0:r1], self.qtype, self.in_features)
        if w.dtype == dtype:
            return w
        if not scratch:
            return w.to(dtype)
        return self.scratch.take(w.numel(), dtype, w.device).view(w.shape).copy_(w)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the file's exact weights, :data:`TILE_WEIGHTS` weights de-quantized at a time. A layer that
        also holds int4 weights gives the file's pages back afterwards, so a prefill keeps at most one such layer's
        pages resident beside the int4 layouts (re-reading them from the page cache costs a minor fault a page)."""
        step = max(16, TILE_WEIGHTS // self.in_features)
        lead = x.shape[:-1]
        # Two dimensions, contiguous: given a strided 3-D input (a prefill's last position, for the head), linear
        # would broadcast the weight tile and copy it for a batched product, on every tile.
        x = x.reshape(-1, self.in_features)
        own = self.scratch.lock.acquire(blocking=False)
        try:
            if step >= self.out_features:
                y = torch.nn.functional.linear(x, self.dense_tile(0, self.out_features, x.dtype, own), self.bias)
                return y.view(*lead, self.out_features)
            y = x.new_empty(x.shape[0], self.out_features)
            for r0 in range(0, self.out_features, step):
                r1 = min(r0 + step, self.out_features)
                bias = None if self.bias is None else self.bias[r0:r1]
                y[:, r0:r1] = torch.nn.functional.linear(x, self.dense_tile(r0, r1, x.dtype, own), bias)
            return y.view(*lead, self.out_features)
        finally:
            if own:
                self.scratch.lock.release()
            if self.int4 is not None and self.pages is not None:  # read again at the next dense product
                self.pages.give_back()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        if self.dot is not None and x.is_cpu and x.numel() <= quant.MAX_ROWS * k:
            y = _dot(self.dot, self.blocks, self.qtype, x.reshape(-1, k)).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        int4 = self.int4
        if int4 is not None and x.is_cpu and (self.all_rows or x.numel() <= quant.MAX_ROWS * k):
            flat = x.reshape(-1, k)
            if flat.dtype == torch.float32 and int4.takes_float32:
                y = int4.mm(flat.contiguous())
            else:
                y = int4.mm(flat.to(torch.bfloat16).contiguous()).to(x.dtype)
            if self.head:  # the likely next tokens' logits from the file's exact weights
                idx = y.topk(min(quant.REFINE_TOP, y.shape[-1]), dim=-1).indices
                exact = torch.einsum("rd,rkd->rk", flat, self.rows(idx).to(flat.dtype))
                if self.bias is not None:
                    exact = exact + self.bias[idx]
                y.scatter_(-1, idx, exact.to(y.dtype))
            elif self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return self.dense(x)

    def extra_repr(self) -> str:
        kernel = ", int4 decode" if self.int4 is not None else ", de-quantizing decode" if self.dot is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}{kernel}"


class GGUFEmbedding(torch.nn.Module):
    """Token embeddings kept as a GGUF tensor's raw blocks (uint8 [vocab, row bytes]): a lookup de-quantizes only
    its rows. ``embed_scale`` (Gemma) multiplies the rows as the model's own embedding does."""

    blocks: torch.Tensor

    def __init__(self, blocks: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(blocks.shape[0]), dim
        self.qtype, self.dtype = qtype, dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("ggml_type", torch.tensor(list(TYPES).index(qtype)))
        self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype, device="meta")

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``index`` (any shape): [..., embedding_dim]."""
        return dequantize(self.blocks[index], self.qtype, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(ids).to(self.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype}"


def resident_bytes(model: PreTrainedModel) -> int:
    """Bytes of the GGUF blocks and int4 kernel weights ``model``'s GGUF modules hold (the blocks counted once
    when shared by a tied head)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, GGUFLinear | GGUFEmbedding):
            blocks: torch.Tensor = mod.blocks
            if blocks.data_ptr() not in seen:
                seen.add(blocks.data_ptr())
                total += blocks.numel()
            if isinstance(mod, GGUFLinear) and mod.int4 is not None:
                total += mod.int4.nbytes
    return total


__all__ = ["DOT_TYPES", "FLOAT_TYPES", "INT4_TYPES", "PREFILL_ROUTES", "SPLIT_TYPES", "TYPES", "FilePages", "GGUFEmbedding",
           "GGUFLinear", "Scratch", "dequantize", "int4_parts", "prefill_route", "resident_bytes"]
