"""The size of the KV memory bound (``EngineConfig.kv_memory_bytes``) when none is configured.

The bound itself and the lease of each request are :mod:`kvrag.engine.lease`; who is admitted when is
:mod:`kvrag.engine.scheduler`.
"""

from __future__ import annotations

import logging
import os

import torch

from kvrag.engine.lease import KVBudget, Lease  # their earlier home

log = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.5
"""Default bound: at most this fraction of the device memory available when the engine starts."""


def available_memory(device: torch.device | str) -> int | None:
    """Bytes of memory free on ``device`` now (CUDA: ``mem_get_info``; CPU: the OS's available pages), or None."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def default_kv_bytes(bytes_per_token: int, max_context: int, max_batch_size: int,
                     device: torch.device | str) -> int:
    """A full batch of maximal requests (``max_batch_size x max_context`` tokens), capped at
    :data:`DEFAULT_MEMORY_FRACTION` of the memory available on ``device``, and at least one maximal request."""
    want = max_batch_size * max_context * bytes_per_token
    free = available_memory(device)
    if free is not None:
        want = min(want, int(free * DEFAULT_MEMORY_FRACTION))
    return max(want, max_context * bytes_per_token)


__all__ = ["DEFAULT_MEMORY_FRACTION", "KVBudget", "Lease", "available_memory", "default_kv_bytes"]
