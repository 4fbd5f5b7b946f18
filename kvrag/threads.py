"""Torch intra-op threads for one thread of the process (the engine's runner) without changing anyone else's.

``torch.set_num_threads`` sets the calling thread's count *and* torch's default for every thread that runs its
first torch operation later, so calling it from the runner would hand the runner's count to client threads started
afterwards. With torch's OpenMP backend the count is a per-thread OpenMP setting, so :func:`set_own_threads` sets
that alone (``omp_set_num_threads`` of the OpenMP runtime torch is linked with), after torch's own per-thread setup has run
in this thread (which would otherwise overwrite it). Elsewhere -- another backend, a runtime that cannot be found --
it falls back to ``torch.set_num_threads``.

Why a thread would want its own count: GNU OpenMP gives every thread that runs parallel work its own team of
workers, and once the teams hold more threads than the machine has cores it stops spinning between parallel
regions, so each of a decode step's thousands of small operations pays a wake-up. Giving the runner the cores and
every other thread one torch thread keeps the teams within the cores (``EngineConfig.runner_threads``; measured in
docs/results.md, "One runner thread on the cores").
"""

from __future__ import annotations

import ctypes
import functools
import re

import torch

from kvrag.errors import ConfigError


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (None: torch's backend is not OpenMP, or its library was not found).

    Other libraries bring their own OpenMP runtime (faiss's wheel does), each with its own thread settings, so the
    symbol is looked up through torch's own library: ``dlsym`` on its handle searches it and its dependencies."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            maps = f.read()
    except OSError:
        return None
    for path in sorted(set(re.findall(r"\S*/libtorch_cpu[^\s/]*\.so[^\s/]*", maps))):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def set_own_threads(n: int) -> None:
    """Run this thread's torch operations on ``n`` intra-op threads, leaving other threads' counts and torch's
    default for new threads as they are (where torch runs on OpenMP; else ``torch.set_num_threads(n)``)."""
    if n < 1:
        msg = f"a thread needs at least one intra-op thread, got {n}"
        raise ValueError(msg)
    torch.get_num_threads()  # torch's per-thread setup first: it sets this thread's count from its default
    lib = _openmp()
    if lib is None:
        torch.set_num_threads(n)
        return
    lib.omp_set_num_threads(int(n))
    if torch.get_num_threads() != n:  # not the runtime torch reads its count from after all
        torch.set_num_threads(n)


def set_torch_threads(n: int | None, flag: str = "--threads") -> None:
    """``torch.set_num_threads(n)`` for a command's thread option: None or 0 leaves torch's count as it is.

    Raises:
        ConfigError: ``n`` is negative (named by ``flag``).
    """
    if n is None or n == 0:
        return
    if n < 0:
        msg = f"{flag} must be a positive number of threads, got {n}"
        raise ConfigError(msg)
    torch.set_num_threads(int(n))


__all__ = ["set_own_threads", "set_torch_threads"]
