"""Where the repairer checkpoints shipped with kvrag live (read by ``cacherepair``, written by ``repair.card``)."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "repairers"
"""Where checkpoints shipped with kvrag live: ``kvrag/data/repairers/<model-name>/``."""

__all__ = ["SHIPPED_DIR"]
