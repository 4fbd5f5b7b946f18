"""CacheRepair: a small learned network that repairs stale (independently computed) chunk KV.

* :mod:`kvrag.repair.config` — presets, :class:`RepairConfig`, the packed KV feature layout.
* :mod:`kvrag.repair.model` — the network, ``save_pretrained`` / ``from_pretrained``.
* :mod:`kvrag.repair.documents` — passage groups -> chunk token ids; :mod:`kvrag.repair.leads` — real-prompt leads.
* :mod:`kvrag.repair.pairs` — paired stale / joint KV of one document, normalization statistics, regions.
* :mod:`kvrag.repair.dataset` — the streamed corpus index and the (disk-cached) pair dataset.
* :mod:`kvrag.repair.train_config`, :mod:`kvrag.repair.train`, :mod:`kvrag.repair.evaluate`,
  :mod:`kvrag.repair.checkpoint`, :mod:`kvrag.repair.train_cli` — settings, loop, evaluation, resumable state and
  the ``kvrag train-repairer`` entry point.
* :mod:`kvrag.repair.card` — publish a trained repairer with its model card; :mod:`kvrag.repair.shipped` — where.

The serving side is the registered fusion method ``cacherepair`` (:mod:`kvrag.fusion.cacherepair`).
"""

from __future__ import annotations

from typing import Any

from kvrag.repair.config import PRESETS, RepairConfig, pack_kv, unpack_kv
from kvrag.repair.model import RepairModel

__all__ = ["PRESETS", "RepairConfig", "RepairModel", "TrainConfig", "Trainer", "pack_kv", "train_main", "unpack_kv"]


def __getattr__(name: str) -> Any:  # the training side (tqdm, data pipeline) is imported on first use
    if name == "TrainConfig":
        from kvrag.repair.train_config import TrainConfig

        return TrainConfig
    if name == "Trainer":
        from kvrag.repair.train import Trainer

        return Trainer
    if name == "train_main":
        from kvrag.repair.train_cli import train_main

        return train_main
    raise AttributeError(f"module 'kvrag.repair' has no attribute {name!r}")
