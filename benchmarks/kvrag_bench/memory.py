"""Peak memory of a block of work: exact on CUDA, a sampled RSS lower bound on CPU."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from kvrag.kv.native import trim_heap


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        return 0


class PeakMemory:
    """Peak memory a block allocates beyond what was in use when it started.

    On CUDA: ``torch.cuda.max_memory_allocated`` (exact). On CPU: the process RSS sampled every ``interval_s``
    by a background thread after trimming the heap (a lower bound; sampling can miss short spikes).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda_allocated" if device.type == "cuda" else "cpu_rss_sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self._max = 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._max = max(self._max, _rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            # freed heap pages back to the OS, so an RSS increase reflects the block's own allocations (no
            # gc.collect(): tensors are freed by reference counting, and a full collection is slow with transformers)
            trim_heap()
            self._base = self._max = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._max = max(self._max, _rss_bytes())
            self.peak_bytes = int(max(0, self._max - self._base))


__all__ = ["PeakMemory"]
