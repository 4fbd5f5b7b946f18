"""Building kvrag's C kernels: each source compiled once per machine with the system's C compiler.

The shared library lands in ``$KVRAG_HOME/kernels/<stem>-<hash>.so``, the hash covering the source, the compiler and
the machine, so an edited source or another compiler builds anew; concurrent processes each build and the last
atomic rename wins. Built with OpenMP where the compiler has it (the kernels then share the runtime torch loaded).

Every kernel module (:mod:`kvrag.kv.row_attention`, :mod:`kvrag.kv.int4_kernel`) loads through here: its environment
setting read (:func:`setting`), the library built, opened and its ABI checked (:func:`open_library`), and the
module's own self-check run, any failure leaving torch's kernel in place with the reason (:func:`attempt`).
:func:`trim_heap` hands the C heap's free pages back after weights are re-laid out.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvrag.errors import ConfigError
from kvrag.paths import kvrag_home

log = logging.getLogger(__name__)
T = TypeVar("T")


def build(source: Path) -> Path:
    """The shared library built from ``source`` for this machine (built now if missing); RuntimeError when there is
    no C compiler or it fails."""
    src = source.read_bytes()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        msg = "no C compiler (cc / gcc) on PATH"
        raise RuntimeError(msg)
    key = hashlib.sha256(src + cc.encode() + os.uname().machine.encode()).hexdigest()[:16]
    out = kvrag_home() / "kernels" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        base = [cc, "-O3", "-shared", "-fPIC", str(source), "-o", str(so)]
        res = subprocess.run([*base[:4], "-fopenmp", *base[4:]], capture_output=True, text=True, check=False)
        if res.returncode != 0:  # a compiler without OpenMP: one thread
            res = subprocess.run(base, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            msg = f"{cc} failed on {source.name}: {res.stderr.strip()[-400:]}"
            raise RuntimeError(msg)
        os.replace(so, out)
    return out


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``'s names: avx2, avx512_bf16, amx_bf16, ...)."""
    from kvrag.calibration import cpu_flags as flags

    return flags()


def setting(var: str, choices: tuple[str, ...]) -> str:
    """Environment variable ``var`` (default ``auto``), lower-cased: one of ``auto`` or ``choices``; ConfigError
    naming the choices otherwise."""
    v = os.environ.get(var, "auto").strip().lower() or "auto"
    if v not in ("auto", *choices):
        msg = f"{var}={v!r} is not a setting; use auto (kvrag's kernel where it serves) or {', '.join(choices)}"
        raise ConfigError(msg)
    return v


def open_library(source: Path, abi_symbol: str, abi: int) -> ctypes.CDLL:
    """The library built from ``source`` (:func:`build`), opened; RuntimeError when its ``abi_symbol()`` is not
    ``abi`` (a stale build) or it cannot be built."""
    lib = ctypes.CDLL(str(build(source)))
    got = getattr(lib, abi_symbol)()
    if got != abi:
        msg = f"{source.name} ABI {got} != {abi}"
        raise RuntimeError(msg)
    return lib


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). Weights re-laid
    out in pieces (the int4 layouts, a fused product's copy of its layers' layouts) free pieces below the allocator's
    map threshold into the heap, which keeps their pages in the process: without this they stay in its resident set
    until the heap reuses them."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def attempt(what: str, load: Callable[[], T]) -> tuple[T | None, str | None]:
    """(``load()``, None), or (None, why) where loading or its self-check failed (OSError, RuntimeError,
    AssertionError), logged as a warning naming ``what``: torch's kernel then serves."""
    try:
        return load(), None
    except (OSError, RuntimeError, AssertionError) as e:
        log.warning("%s is not used (torch's kernel is): %s", what, e)
        return None, str(e)


__all__ = ["attempt", "build", "cpu_flags", "open_library", "setting", "trim_heap"]
