"""CacheRepair architecture settings and the packed KV feature layout (CacheRepair §4.1, Table 4).

KV feature layout. The per-token KV of a target with L layers, H_kv KV heads and head dim D is packed into
``[N, S, D]`` with ``S = 2 * L * H_kv`` segments ordered (layer, K/V, head): segment ``s = (l * 2 + c) * H_kv + h``
with ``c = 0`` for K and ``1`` for V (see :func:`pack_kv` / :func:`unpack_kv`). The normalization statistics are
stored as ``[L, 2, H_kv, D]`` (the same order).

:data:`PRESETS` and their parameter counts are described in :mod:`kvrag.repair.model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from kvrag.errors import ConfigError

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"d_b": 64, "num_blocks": 1, "d_seg": 4},
    "small": {"d_b": 256, "num_blocks": 3, "d_seg": 8},
    "base": {"d_b": 256, "num_blocks": 5, "d_seg": 8},
    "medium": {"d_b": 512, "num_blocks": 6, "d_seg": 16},
    "large": {"d_b": 704, "num_blocks": 6, "d_seg": 24},
}


# ---------------------------------------------------------------------------------------------------------------
# KV packing
# ---------------------------------------------------------------------------------------------------------------


def pack_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Pack keys, values [L, H_kv, N, D] into per-token features [N, S, D] (S = 2 L H_kv, order (l, K/V, h))."""
    if keys.shape != values.shape or keys.dim() != 4:
        msg = f"keys/values must both be [L, H_kv, N, D], got {tuple(keys.shape)} and {tuple(values.shape)}"
        raise ConfigError(msg)
    L, H, N, D = keys.shape
    out = torch.empty(N, L, 2, H, D, dtype=torch.promote_types(keys.dtype, values.dtype), device=keys.device)
    out[:, :, 0].copy_(keys.permute(2, 0, 1, 3))  # one strided pass per tensor, no intermediate stack
    out[:, :, 1].copy_(values.permute(2, 0, 1, 3))
    return out.view(N, L * 2 * H, D)  # [N, S, D]


def unpack_kv(feats: torch.Tensor, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_kv`: features [N, S, D] -> keys, values [L, H_kv, N, D]."""
    N, S, D = feats.shape
    if S != 2 * num_layers * num_kv_heads:
        msg = f"feature tensor has {S} segments, expected 2 * {num_layers} * {num_kv_heads}"
        raise ConfigError(msg)
    kv = feats.reshape(N, num_layers, 2, num_kv_heads, D).permute(1, 2, 3, 0, 4)  # [L, 2, H, N, D]
    return kv[:, 0], kv[:, 1]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RepairConfig:
    """Architecture of a repairer (target-dependent sizes + capacity).

    Attributes:
        num_layers: L_M, target decoder layers.
        num_kv_heads: H_KV, target KV heads.
        head_dim: d_h, target head dim.
        embed_dim: target hidden size (width of the frozen token embedding E_M).
        d_b: backbone width.
        num_blocks: B, repair blocks.
        d_seg: per-segment projection width of the StaleEncoder.
        attn_head_dim: repair attention head width (64 in the paper; d_b must be a multiple).
        mlp_ratio: MLP expansion (3 in the paper).
        rope_theta: base of the repairer's own RoPE.
        norm_eps: LayerNorm epsilon.
        preset: the preset name it was built from ('' for custom).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int
    d_b: int = 256
    num_blocks: int = 3
    d_seg: int = 8
    attn_head_dim: int = 64
    mlp_ratio: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    preset: str = ""

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.num_kv_heads, self.head_dim, self.embed_dim, self.d_b, self.d_seg,
                self.attn_head_dim, self.mlp_ratio)
        if min(dims) <= 0 or self.num_blocks < 0:
            msg = f"RepairConfig sizes must be positive, got {self}"
            raise ConfigError(msg)
        heads = min(self.attn_head_dim, self.d_b)
        if self.d_b % heads or heads % 2:
            msg = f"d_b={self.d_b} must be a multiple of the (even) attention head dim {self.attn_head_dim}"
            raise ConfigError(msg)

    @property
    def num_segments(self) -> int:
        """S = 2 L H_kv."""
        return 2 * self.num_layers * self.num_kv_heads

    @property
    def attn_heads(self) -> int:
        return self.d_b // min(self.attn_head_dim, self.d_b)

    @classmethod
    def from_preset(cls, preset: str, *, num_layers: int, num_kv_heads: int, head_dim: int, embed_dim: int,
                    **overrides: int) -> RepairConfig:
        """A config of a named preset for a target of the given shape (``overrides`` replace its integer fields:
        ``d_b``, ``num_blocks``, ``d_seg`` ...)."""
        if preset not in PRESETS:
            msg = f"unknown repairer preset {preset!r}; valid presets: {', '.join(PRESETS)}"
            raise ConfigError(msg)
        fields = {**PRESETS[preset], **overrides}
        return cls(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, embed_dim=embed_dim,
                   preset=preset, **fields)

    def to_dict(self) -> dict[str, int | float | str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, int | float | str]) -> RepairConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            msg = f"repairer architecture has unknown fields {sorted(unknown)} (written by a newer kvrag?)"
            raise ConfigError(msg)
        fields: dict[str, Any] = dict(d)  # the fields as to_dict wrote them (sizes checked by __post_init__)
        return cls(**fields)


__all__ = ["PRESETS", "RepairConfig", "pack_kv", "unpack_kv"]
