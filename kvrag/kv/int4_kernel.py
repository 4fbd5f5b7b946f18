"""kvrag's own int4 x bfloat16 product for decode-sized inputs on x86 CPUs with AVX512-BF16 (``int4_gemm.c``).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) dequantizes the weights to float32 and multiplies per
input row, so a batch of 8 rows costs 8 rows' decoding and float32 FMAs (decode is bound by decoding the weights, so
batching gains little; measured in docs/results/amx/load_int4_kernel_*.md). ``int4_gemm.c`` decodes each 4-bit
weight once per call for all the rows:

* ``amx`` (the default on CPUs with AMX): the decoded weights of a tile of 16 outputs and a group of 32 inputs
  become one tile of the matrix unit and one ``TDPBF16PS`` multiplies them by up to 16 rows (faster than torch's
  kernel for a batched decode step, on par for one row);
* ``avx512bf16`` (the default on AVX512-BF16 CPUs without AMX): ``VDPBF16PS`` multiplies 32 decoded weights by
  two broadcast inputs for 16 outputs, for up to 8 rows per decoded weight (faster than torch's kernel for a batched
  decode step on such a CPU, on par for one row; not faster than torch's on an AMX host, where the AMX path serves;
  docs/results/epyc/ab_host2_int4_kernel.md).

Both apply each group's bf16 scale and zero in float32 and round the output to bfloat16, like torch's kernel; their
outputs differ from it (and from each other) in the last bfloat16 bit now and then. A process uses one path for
every int4 product, and each row is computed the same way whatever the other rows of its call and the thread
split are, so a request's tokens do not depend on its batch (tested bit for bit). The path is part of the model's
fingerprint (:func:`tag`).

The C source is compiled once per machine with the system's C compiler into ``$KVRAG_HOME/kernels`` (about a
second) and loaded with ctypes (the call releases the GIL; threads come from the OpenMP runtime torch loaded). No
compiler, a CPU with neither AMX nor AVX512-BF16, a failed self-check or ``KVRAG_INT4_KERNEL=torch`` leave torch's
kernel in place, with the reason in :func:`why_not`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ConfigError
from kvrag.kv import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int4_gemm.c")
PATHS = ("amx", "avx512bf16")
"""kvrag's kernel paths, best first; ``KVRAG_INT4_KERNEL`` picks one of these or ``torch``."""
PORTABLE = "portable"
"""``KVRAG_INT4_KERNEL=portable``: the kernel's plain-C path on any x86 CPU (slow; never chosen by ``auto``), for
testing the callers where neither SIMD path can run."""
_ABI = 6
_PATH_ARG = {"avx512bf16": 0, "amx": 1, PORTABLE: 2}
TILE, GROUP = 16, 32


class _Lib:
    def __init__(self, path: str) -> None:
        lib = native.open_library(SOURCE, "kvrag_int4_abi", _ABI)
        if path == "amx" and not lib.kvrag_int4_amx_init():
            msg = "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
            raise RuntimeError(msg)
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        self.fns: dict[torch.dtype, Any] = {}
        for dtype, name in ((torch.bfloat16, "kvrag_int4_mm"), (torch.float32, "kvrag_int4_mm_f32")):
            fn = getattr(lib, name)
            fn.argtypes = [vp, i64, i64, vp, i64, vp, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
            self.fns[dtype] = fn
        self.amx = _PATH_ARG[path]

    def mm(self, x: torch.Tensor, packed: torch.Tensor, n: int, threads: int) -> torch.Tensor:
        m, k = x.shape
        out = torch.empty((m, n), dtype=x.dtype)
        if self.fns[x.dtype](x.data_ptr(), m, k, packed.data_ptr(), n, out.data_ptr(), self.amx, threads):
            raise MemoryError(f"kvrag's int4 kernel: no memory for a [{m}, {k}] x [{k}, {n}] product")
        return out


@functools.cache
def _load() -> tuple[str | None, _Lib | None, str | None]:
    """(path, library, why not): the kernel this process uses, chosen once."""
    try:
        wanted = native.setting("KVRAG_INT4_KERNEL", ("torch", *PATHS, PORTABLE))
    except ConfigError as e:
        return None, None, str(e)
    if wanted == "torch":
        return None, None, "KVRAG_INT4_KERNEL=torch"
    flags = native.cpu_flags()
    have = [p for p in PATHS if ("amx_bf16" if p == "amx" else "avx512_bf16") in flags] + [PORTABLE]
    if wanted == "auto":  # the best path this CPU has (PATHS is best first)
        if have == [PORTABLE]:
            return None, None, "this CPU has neither AMX nor AVX512-BF16, which kvrag's int4 kernel needs"
        path = have[0]
    elif wanted not in have:
        return None, None, f"KVRAG_INT4_KERNEL={wanted} but this CPU lacks it (has: {sorted(have[:-1]) or 'neither'})"
    else:
        path = wanted

    def load() -> _Lib:
        lib = _Lib(path)
        _self_check(lib)
        return lib

    lib, why = native.attempt(f"kvrag's {path} int4 kernel", load)
    if lib is None:
        return None, None, why
    log.info("int4 products: kvrag's %s kernel", path)
    return path, lib, None


def path() -> str | None:
    """The kernel path int4 products take in this process ('amx' / 'avx512bf16' / 'portable'), None for torch's
    kernel."""
    return _load()[0]


def why_not() -> str | None:
    """Why torch's kernel serves int4 products here (None when kvrag's does)."""
    return _load()[2]


def tag() -> str:
    """What a model fingerprint records of the int4 products' kernel: 'torch' or 'kvrag-<path>'."""
    p = path()
    return "torch" if p is None else f"kvrag-{p}"


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """kvrag's layout (int4_gemm.c's header) of ``q`` [N, K] in 0..15 and bfloat16 ``scale`` / ``zero`` [N, K/32]
    (``w = (q - 8) scale + zero``): uint8 [N/16, K/32, 320]."""
    n, k = q.shape
    if n % TILE or k % GROUP:
        msg = f"int4 weights need a multiple of {TILE} outputs and {GROUP} inputs, not {tuple(q.shape)}"
        raise ValueError(msg)
    g = k // GROUP
    qq = q.to(torch.uint8).reshape(n // TILE, TILE, g, 8, 2, 2)  # tile, output, group, chunk, lo/hi, kk
    b = (qq[..., 0, :] | (qq[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(n // TILE, g, 8 * 32)

    def side(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).reshape(n // TILE, TILE, g).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([b, side(scale), side(zero)], -1).contiguous()


def mm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [M, K] contiguous bfloat16 times the packed weight: [M, n] bfloat16. A float32 ``x`` gives float32:
    the bits of ``mm(x.bfloat16(), ...).float()``, converted inside the kernel (no tensor operations around it)."""
    lib = _load()[1]
    assert lib is not None, "kvrag's int4 kernel is not loaded here"
    return lib.mm(x, packed, n, torch.get_num_threads())


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float32 [N, K] weight that ``q`` [N, K] in 0..15 and ``scale`` / ``zero`` [N, K/group] stand for,
    ``(q - 8) * scale + zero``: what both int4 kernels multiply by (``kvrag.kv.quant.int4_dequantize``)."""
    n, k = q.shape
    w = (q.reshape(n, k // group, group).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return w.reshape(n, k)


def _self_check(lib: _Lib) -> None:
    """The kernel against float32 arithmetic on a random weight, for 1-16 rows, each row alone and in a batch."""
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(n, k // GROUP, generator=gen) * 0.01).to(torch.bfloat16)
    packed = pack(q, scale, zero)
    x = torch.randn(16, k, generator=gen).to(torch.bfloat16)
    ref = x.float() @ dequantize(q, scale, zero).T
    full = lib.mm(x, packed, n, 1)
    err = (full.float() - ref).abs().max().item()
    tol = 0.02 * ref.abs().max().item()
    if not err <= tol:
        msg = f"self-check: max error {err:.3g} against float32 > {tol:.3g}"
        raise AssertionError(msg)
    for m in (1, 3, 8):
        if not torch.equal(lib.mm(x[:m].contiguous(), packed, n, 2), full[:m]):
            msg = f"self-check: {m} rows differ from the same rows in a batch of 16"
            raise AssertionError(msg)


__all__ = ["PATHS", "PORTABLE", "SOURCE", "dequantize", "mm", "pack", "path", "tag", "why_not"]
