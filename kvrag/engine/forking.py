"""Fork safety for objects that own threads and locks (the engines' runners).

``os.fork`` copies only the forking thread: a lock held by another thread stays held forever in the child, and a
runner thread the parent had is gone there. Objects registered with :func:`track` are asked to take their locks
before the fork (``_before_fork``), to release them in the parent (``_after_fork_parent``) and to reset themselves
in the child (``_after_fork_child``), in reverse order of taking.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

_TRACKED: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_FORKING: list[ForkAware] = []


class ForkAware(Protocol):
    """An object with fork hooks (the runner): called before ``os.fork`` and after it, in the parent and the child."""

    def _before_fork(self) -> None: ...

    def _after_fork_parent(self) -> None: ...

    def _after_fork_child(self) -> None: ...


def track(obj: ForkAware) -> None:
    """Call ``obj``'s fork hooks around every ``os.fork`` of this process while it lives."""
    _TRACKED.add(obj)


def _before() -> None:
    _FORKING[:] = list(_TRACKED)
    for r in _FORKING:
        r._before_fork()


def _after(child: bool) -> None:
    for r in reversed(_FORKING):
        r._after_fork_child() if child else r._after_fork_parent()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=lambda: _after(False), after_in_child=lambda: _after(True))


__all__ = ["track"]
