"""CacheRepair: a small learned network that repairs stale (independently computed) chunk KV.

* :mod:`kvrag.repair.model` — the network, presets, ``save_pretrained`` / ``from_pretrained``.
* :mod:`kvrag.repair.data` — paired stale / joint KV from a passage-group corpus, normalization statistics.
* :mod:`kvrag.repair.train` — the training loop and the ``kvrag train-repairer`` entry point.

The serving side is the registered fusion method ``cacherepair`` (:mod:`kvrag.fusion.cacherepair`).
"""

from __future__ import annotations

from typing import Any

from kvrag.repair.model import PRESETS, RepairConfig, RepairModel, pack_kv, unpack_kv

__all__ = ["PRESETS", "RepairConfig", "RepairModel", "TrainConfig", "Trainer", "pack_kv", "train_main", "unpack_kv"]


def __getattr__(name: str) -> Any:  # the training side (tqdm, data pipeline) is imported on first use
    if name in ("TrainConfig", "Trainer", "train_main"):
        from kvrag.repair import train

        return getattr(train, name)
    raise AttributeError(f"module 'kvrag.repair' has no attribute {name!r}")
