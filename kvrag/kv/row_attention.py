"""kvrag's one-token attention on x86 CPUs (``row_attention.c``): a decode step's rows in one call per layer.

A decode step attends each request's one new token over that request's own keys. torch's CPU SDPA serves such a
call through its flash-attention kernel, built for blocks of many queries: for one query it reads the layer's K/V
well below the rate at which one core can stream them (docs/architecture.md,
docs/results/epyc/ab_host2_row_attention.md). ``row_attention.c`` computes the scores, the softmax and the weighted
sum for each (query, KV head) in one pass over the head's keys and one over its values, and takes every query of a layer
-- all rows of a batched step, all drafted positions of a verify step -- in one call, split over torch's OpenMP
threads.

Its arithmetic is its own (float32 scores, softmax and sums; the output rounded to the model's dtype), so the
outputs differ from torch's SDPA in the last bits. It therefore serves *every* one-token attention of a model that
runs ``kvrag_sdpa`` -- kvrag's batched and verify steps and the model's own forward (``model.generate``,
single-token forwards over a cache) alike -- so ``full`` still generates what ``model.generate`` does on the same
model object, and each entry's result never depends on the other entries of its call or on the thread split (a
row's tokens do not depend on its batch).

Paths: bfloat16 with AVX512-BF16 (head dim even), float32 with AVX2 + FMA (head dim a multiple of 8), and float32
queries over bfloat16 keys and values (a decode buffer narrower than a float32 model, :mod:`kvrag.kv.hf_cache`'s
``KVBuffer.for_decode``) with AVX2 + FMA: each bfloat16 element widened to float32 exactly as it is loaded, then the
float32 path's arithmetic -- the same bits as the float32 path over the widened K/V; and float32 or bfloat16 queries
over int8 K/V (:mod:`kvrag.kv.int8kv`'s layout, ``EngineConfig.kv_dtype="int8"``) with AVX512-F/BW/DQ/VL (head dim a
multiple of 16): each int8 value widened exactly and scaled by its group's scale, float32 arithmetic. CPU
tensors only. Anything else, no C compiler, a failed self-check, or
``KVRAG_ROW_ATTENTION=torch`` leaves torch's SDPA in place for every call of that dtype, with the reason in
:func:`why_not`. ``KVRAG_ROW_ATTENTION=portable`` serves every path on any x86 CPU through the kernel's plain-C
code (slower; for testing the callers where the SIMD paths cannot run).
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from kvrag.errors import ConfigError
from kvrag.kv import int8kv, native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_attention.c")
_ABI = 7
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_NEEDS = {(torch.bfloat16, torch.bfloat16): (*_AVX512, "avx512_bf16"),
          (torch.float32, torch.float32): ("avx2", "fma"),
          (torch.float32, torch.bfloat16): ("avx2", "fma"),
          (torch.float32, torch.int8): _AVX512,
          (torch.bfloat16, torch.int8): _AVX512}
"""The CPU flags each path -- (query dtype, K/V dtype) -- is compiled for (row_attention.c's target attributes)."""
_MODES = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.bfloat16): 1, (torch.float32, torch.bfloat16): 2,
          (torch.float32, torch.int8): 3, (torch.bfloat16, torch.int8): 4}
"""row_attention.c's ``mode`` of each path."""


def mode(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> int:
    """row_attention.c's ``mode`` for queries in ``dtype`` over K/V in ``kv_dtype`` (None: the same)."""
    return _MODES[(dtype, dtype if kv_dtype is None else kv_dtype)]


class _Lib:
    def __init__(self, portable: bool = False) -> None:
        lib = native.open_library(SOURCE, "kvrag_row_attention_abi", _ABI)
        self.portable = lib.kvrag_row_attention_portable  # (1 / 0): the plain-C path for every call, or not
        self.portable.argtypes = [ctypes.c_int]
        self.portable(int(portable))
        fn = lib.kvrag_row_attention
        i64 = ctypes.c_int64
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self.fn = fn
        ra = lib.kvrag_rope_attend
        vp = ctypes.c_void_p
        ra.argtypes = [ctypes.c_int, vp, i64, vp, i64, vp, vp, i64, i64, i64, i64, ctypes.c_float, vp, vp, ctypes.c_int,
                       ctypes.c_int]
        ra.restype = ctypes.c_int
        self.rope_attend = ra

    def run(self, mode: int, entries: array.array, count: int, heads: int, kv_heads: int, d: int, q_head: int,
            scale: float, threads: int) -> None:
        if self.fn(mode, entries.buffer_info()[0], count, heads, kv_heads, d, q_head, scale, threads):
            raise MemoryError("kvrag's row attention: no memory for the scores")


@functools.cache
def _load(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> tuple[_Lib | None, str | None]:
    """(library, why not) for one-token attention of ``dtype`` queries over ``kv_dtype`` K/V (None: the same):
    chosen once per pair and process."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    what = str(dtype) if kv_dtype == dtype else f"{dtype} queries over {kv_dtype} K/V"
    try:
        wanted = native.setting("KVRAG_ROW_ATTENTION", ("torch", "portable"))
    except ConfigError as e:
        return None, str(e)
    if wanted == "torch":
        return None, "KVRAG_ROW_ATTENTION=torch"
    needs = _NEEDS.get((dtype, kv_dtype))
    if needs is None:
        return None, f"no kvrag row-attention path for {what}"
    missing = [f for f in needs if f not in native.cpu_flags()]
    if missing and wanted != "portable":
        return None, f"this CPU lacks {', '.join(missing)} for the {what} path"

    def load() -> _Lib:
        lib = _Lib(portable=wanted == "portable")
        _self_check(lib, dtype, kv_dtype)
        return lib

    lib, why = native.attempt(f"kvrag's row attention for {what}", load)
    if lib is not None:
        log.info("one-token attention (%s): kvrag's kernel", what)
    return lib, why


def library(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> _Lib:
    """The loaded kernel library serving ``dtype`` queries over ``kv_dtype`` K/V (None: the same; its
    ``rope_attend`` is :mod:`kvrag.kv.fused_step`'s call); RuntimeError where it does not serve (:func:`why_not`
    says why)."""
    lib, why = _load(dtype, kv_dtype)
    if lib is None:
        raise RuntimeError(f"kvrag's row attention does not serve {dtype} over {kv_dtype or dtype} K/V here: {why}")
    return lib


def why_not(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str | None:
    """Why torch's SDPA serves one-token attention of ``dtype`` queries over ``kv_dtype`` K/V (None: the same) here
    (None when kvrag's kernel does)."""
    return _load(dtype, kv_dtype)[1]


def serves(query: torch.Tensor, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether one-token attention of ``query`` over K/V in ``kv_dtype`` (None: the query's dtype) runs kvrag's
    kernel: decided by the device, dtypes and head dim only, so every call of a model decides alike."""
    if query.device.type != "cpu":
        return False
    d = query.shape[-1]
    if (query.dtype == torch.bfloat16 and d % 2) or (query.dtype == torch.float32 and d % 8):
        return False
    if kv_dtype == torch.int8 and d % 16:
        return False
    return _load(query.dtype, kv_dtype)[0] is not None


def window_start(mask: torch.Tensor | None, keys: int) -> int | None:
    """The first key a one-token query attends to under ``mask`` ([.., keys] boolean, True = attend), when the mask
    admits a suffix of the keys (none: 0); None for any other mask (torch's SDPA then serves the call)."""
    if mask is None:
        return 0
    if mask.dtype != torch.bool or mask.shape[-1] != keys or mask.numel() != keys:
        return None
    m = mask.reshape(keys)
    start = keys - int(m.sum())
    return start if start < keys and bool(m[start:].all()) else None


def attend(query: torch.Tensor, keys: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]], out: torch.Tensor,
           scale: float | None) -> torch.Tensor:
    """One-token attention of ``query[:, :, i]`` over ``keys[i]``, written into ``out[0, i]``.

    Args:
        query: [1, H, Q, D] (any strides); keys: per query, (K, V, start, stop) with K / V [H_kv, T, D] (D
            contiguous, positions D apart; int8: [H_kv, T, width], :mod:`kvrag.kv.int8kv`) and the query attending
            to positions ``start .. stop - 1``.
        out: [1, Q, H, D] contiguous, the query's dtype.

    K / V are in the query's dtype, bfloat16 under float32 queries, or int8.

    Returns:
        ``out``.
    """
    lib = _load(query.dtype, keys[0][0].dtype)[0]
    assert lib is not None, "kvrag's row attention does not serve this dtype here"
    return _call(lib, query, keys, out, 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale),
                 torch.get_num_threads())


def _call(lib: _Lib, query: torch.Tensor, keys: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]],
          out: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
    _, heads, _, d = query.shape
    kv_heads = keys[0][0].shape[0]
    if heads % kv_heads:
        msg = f"{heads} query heads do not share {kv_heads} KV heads evenly"
        raise ValueError(msg)
    if query.stride(-1) != 1:
        query = query.contiguous()
    el = query.element_size()
    kv_dtype = keys[0][0].dtype
    kvel = torch.empty((), dtype=kv_dtype).element_size()
    pd = int8kv.width(d, kv_dtype)  # elements between positions
    q0, qs, o0, os_ = query.data_ptr(), query.stride(2) * el, out.data_ptr(), out.stride(1) * el
    flat, keep = array.array("q"), []
    for i, (k, v, start, stop) in enumerate(keys):
        ks = k.stride()
        if k.dtype != kv_dtype or v.dtype != kv_dtype:
            msg = f"keys / values of {k.dtype} / {v.dtype} beside {kv_dtype} in one call"
            raise ValueError(msg)
        if k.shape[-1] != pd:
            msg = f"keys of {k.shape[-1]} elements a position for heads of {d} ({kv_dtype} K/V take {pd})"
            raise ValueError(msg)
        if ks[1:] != (pd, 1) or v.stride() != ks:
            k, v = k.contiguous(), v.contiguous()
            keep.append((k, v))  # alive until the call returns
            ks = k.stride()
        flat.extend((q0 + i * qs, k.data_ptr() + start * pd * kvel, v.data_ptr() + start * pd * kvel, ks[0],
                     stop - start, o0 + i * os_))
    lib.run(mode(query.dtype, kv_dtype), flat, len(keys), heads, kv_heads, d, query.stride(1), scale, threads)
    return out


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of ``query`` [H, D] over ``key`` / ``value`` [H_kv, T, D]: [H, D]."""
    g = query.shape[0] // key.shape[0]
    k = key.double().repeat_interleave(g, 0)
    v = value.double().repeat_interleave(g, 0)
    w = torch.softmax(torch.einsum("hd,htd->ht", query.double(), k) * scale, -1)
    return torch.einsum("ht,htd->hd", w, v)


def _self_check(lib: _Lib, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """The kernel against float64 arithmetic for several key counts, each query alone and in one call; float32
    queries over bfloat16 K/V also bit for bit against the float32 path over the same K/V widened (int8 K/V: the
    float64 reference runs over them de-quantized)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 6, 2, 64
    lengths = (1, 7, 33, 300)
    q = torch.randn(1, heads, len(lengths), d, generator=gen).to(dtype)

    def kv_of(x: torch.Tensor) -> torch.Tensor:
        return int8kv.quantize(x) if kv_dtype == torch.int8 else x.to(kv_dtype)

    def widened(x: torch.Tensor) -> torch.Tensor:
        return int8kv.dequantize(x, d) if kv_dtype == torch.int8 else x

    kv = [(kv_of(torch.randn(kv_heads, n + 3, d, generator=gen)), kv_of(torch.randn(kv_heads, n + 3, d, generator=gen)),
           2, n + 2) for n in lengths]
    out = torch.empty(1, len(lengths), heads, d, dtype=dtype)
    _call(lib, q, kv, out, 0.125, 2)
    if kv_dtype not in (dtype, torch.int8):
        wide = torch.empty_like(out)
        _call(lib, q, [(k.to(dtype), v.to(dtype), a, b) for k, v, a, b in kv], wide, 0.125, 2)
        if not torch.equal(wide, out):
            msg = f"self-check ({dtype} over {kv_dtype} K/V): differs from the {dtype} path over the widened K/V"
            raise AssertionError(msg)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for i, (k, v, a, b) in enumerate(kv):
        ref = reference(q[0, :, i], widened(k[:, a:b]), widened(v[:, a:b]), 0.125)
        err = (out[0, i].double() - ref).abs().max().item()
        if not err <= tol:
            msg = f"self-check ({dtype}): max error {err:.3g} against float64 over {b - a} keys > {tol}"
            raise AssertionError(msg)
        alone = torch.empty(1, 1, heads, d, dtype=dtype)
        _call(lib, q[:, :, i : i + 1], [kv[i]], alone, 0.125, 1)
        if not torch.equal(alone[0, 0], out[0, i]):
            msg = f"self-check ({dtype}): a query alone differs from the same query among others"
            raise AssertionError(msg)


__all__ = ["SOURCE", "attend", "library", "mode", "reference", "serves", "why_not", "window_start"]
