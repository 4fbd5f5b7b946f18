"""Bounded waits for the tests: poll a condition until it holds, failing only when something hangs."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 30.0, interval: float = 0.02) -> None:
    """Return once ``cond()`` is true; an AssertionError ("timed out") after ``timeout`` seconds without it.

    The deadline only catches a hang: a slow machine takes longer, it does not fail."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


__all__ = ["wait_until"]
