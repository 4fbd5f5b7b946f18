"""Settings of a CacheRepair training run and its learning-rate schedule (CacheRepair Appendix A "Optimization")."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from kvrag.errors import ConfigError
from kvrag.jsontypes import JSONObject
from kvrag.repair.config import PRESETS
from kvrag.repair.documents import PER_LEAD

PRESET_LR: dict[str, float] = {"tiny": 1e-3, "small": 1e-3, "base": 3e-4, "medium": 3e-4, "large": 3e-4}
"""Default peak LR per preset. The paper's 3e-4 (Appendix A) is for 100k updates; for the ~1k-update CPU runs of
``small`` a 1e-3 peak reached a lower held-out loss (dev sweep on SmolLM2-135M, 150 updates: normalized MSE 0.621
at 1e-3, 0.661 at 2e-3, 0.697 at 3e-4)."""


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run (the CLI maps its flags one to one).

    Attributes:
        data: passage-group JSONL.
        out: output directory.
        preset: repairer capacity (see :data:`kvrag.repair.model.PRESETS`); d_b / num_blocks / d_seg override it.
        steps: optimizer updates.
        batch_docs: documents per update (the paper's effective batch is 4).
        lr, min_lr: peak and final learning rate of the cosine schedule (None: :data:`PRESET_LR` and lr / 10).
        warmup: linear warmup updates (None: 2% of ``steps``, as 2,000 of 100,000 in the paper).
        weight_decay, clip: AdamW weight decay (matrices only) and gradient-norm clipping.
        max_tokens, max_chunks: document budget (chunk tokens) and chunks per document.
        chunk_format: ``str.format`` template of one chunk with {title} and {passage}, or ``'per-lead'`` (the
            default): each document rendered as its drawn lead's prompt family renders chunks
            (:func:`kvrag.repair.leads.chunk_style`).
        chunk_prefix: 'template' (chunks conditioned on the chat template's system header, as the engine does by
            default) or 'none'.
        max_train_docs: use a fixed pseudo-random subset of this many training groups (None: all).
        eval_docs: held-aside documents evaluated every ``eval_every`` updates.
        stats_docs: training documents pooled for sigma_stale / sigma_delta.
        pairs: pair-cache directory (None: OUT/pairs); cache_pairs=False disables caching.
        cache_dtype: 'float16' | 'float32' storage of cached pairs.
        sources: only groups with these ``source`` values (None: all).
        lead_kinds: the real-prompt leads drawn per document for the joint reference
            (:data:`kvrag.repair.leads.LEAD_KINDS`; None: all of them; []: the conditioning prefix only, as v1).
        exact_lead: the lead is part of each example as exact chunk 0 (read, never repaired) -- what
            ``cacherepair`` serves for a checkpoint trained this way.
        init_from: a repairer directory whose weights and normalization statistics start this run (continued
            training with a fresh optimizer and schedule); its architecture, target model and conditioning must be
            this run's. None: random initialization.
    """

    data: str
    out: str
    preset: str = "small"
    d_b: int | None = None
    num_blocks: int | None = None
    d_seg: int | None = None
    steps: int = 1000
    batch_docs: int = 4
    lr: float | None = None
    min_lr: float | None = None
    warmup: int | None = None
    weight_decay: float = 0.01
    clip: float = 1.0
    max_tokens: int = 1024
    max_chunks: int = 20
    chunk_format: str = PER_LEAD
    chunk_prefix: str = "template"
    max_train_docs: int | None = None
    eval_docs: int = 16
    eval_modulus: int = 50
    eval_every: int = 100
    save_every: int = 100
    log_every: int = 10
    stats_docs: int = 32
    pairs: str | None = None
    cache_pairs: bool = True
    cache_dtype: str = "float16"
    sources: list[str] | None = None
    lead_kinds: list[str] | None = None
    exact_lead: bool = True
    init_from: str | None = None
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        for name in ("steps", "batch_docs", "eval_every", "save_every", "log_every", "stats_docs", "max_tokens"):
            if getattr(self, name) < (0 if name == "steps" else 1):
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.final_lr <= self.peak_lr:
            raise ConfigError(f"need 0 < min_lr <= lr, got lr={self.peak_lr}, min_lr={self.final_lr}")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.chunk_prefix not in ("template", "none"):
            raise ConfigError(f"chunk_prefix must be 'template' or 'none', got {self.chunk_prefix!r}")
        if self.eval_docs < 0:
            raise ConfigError(f"eval_docs must be >= 0, got {self.eval_docs}")
        if self.lead_kinds is None:
            from kvrag.repair.leads import DEFAULT_LEAD_KINDS

            self.lead_kinds = list(DEFAULT_LEAD_KINDS)
        from kvrag.repair.leads import LEAD_KINDS

        unknown = [k for k in self.lead_kinds if k not in LEAD_KINDS]
        if unknown:
            raise ConfigError(f"unknown lead kinds {unknown}; valid kinds: {', '.join(LEAD_KINDS)}")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else PRESET_LR[self.preset]

    @property
    def final_lr(self) -> float:
        return self.min_lr if self.min_lr is not None else self.peak_lr / 10

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, round(0.02 * self.steps))

    @property
    def pairs_dir(self) -> Path | None:
        if not self.cache_pairs:
            return None
        return Path(self.pairs) if self.pairs else Path(self.out) / "pairs"

    def to_dict(self) -> JSONObject:
        """The fields plus the resolved schedule (peak_lr, final_lr, warmup_steps)."""
        return {**dataclasses.asdict(self), "peak_lr": self.peak_lr, "final_lr": self.final_lr,
                "warmup_steps": self.warmup_steps}


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for update ``step`` (0-based): linear warmup, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


__all__ = ["PRESET_LR", "TrainConfig", "lr_factor"]
