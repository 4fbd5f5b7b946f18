"""What a CacheRepair training run exposes to the code that saves, restores and evaluates it.

:class:`kvrag.repair.train.Trainer` is the one implementation; :mod:`kvrag.repair.checkpoint` and
:mod:`kvrag.repair.evaluate` depend on this protocol instead of on the trainer, so ``train`` sits above them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from kvrag.kv.spec import KVSpec
from kvrag.repair.config import RepairConfig
from kvrag.repair.dataset import PairDataset
from kvrag.repair.model import RepairModel
from kvrag.repair.pairs import PairedExample
from kvrag.repair.train_config import TrainConfig


class TrainingRun(Protocol):
    """A training run's settings, network, optimizer state and counters (all read and restored by a checkpoint)."""

    cfg: TrainConfig
    rcfg: RepairConfig
    spec: KVSpec
    out: Path
    device: torch.device
    model: RepairModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    eval_set: PairDataset | None
    step: int
    samples: int
    tokens: int
    wall_s: float

    def _inputs(self, ex: PairedExample) -> tuple[torch.Tensor, ...]:
        """(stale, embeddings, chunk index, positions, delta) of one example, on the run's device."""
        ...


__all__ = ["TrainingRun"]
