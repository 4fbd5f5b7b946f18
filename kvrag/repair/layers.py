"""The CacheRepair network's building blocks (CacheRepair §4.1): the stale-KV segment encoder, the repairer's
block-causal transformer block with its own RoPE, and the block-causal mask. :mod:`kvrag.repair.model` assembles
them into :class:`~kvrag.repair.model.RepairModel`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvrag.repair.config import RepairConfig


class StaleEncoder(nn.Module):
    """CacheRepair §4.1: one d_h -> d_seg projection per (layer, K/V, head) segment, concatenated, mapped to d_b."""

    def __init__(self, num_segments: int, head_dim: int, d_seg: int, d_b: int) -> None:
        super().__init__()
        self.seg_weight = nn.Parameter(torch.randn(num_segments, head_dim, d_seg) / math.sqrt(head_dim))
        self.seg_bias = nn.Parameter(torch.zeros(num_segments, d_seg))
        self.out = nn.Linear(num_segments * d_seg, d_b)

    def forward(self, x: torch.Tensor, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, N, S, D] stale KV -> s [B, N, d_b].

        Args:
            inv_scale: [S, D] per-coordinate factor applied to ``x`` first (1 / sigma_stale). It is folded into the
                [S, D, d_seg] projection instead of scaling the [N, S, D] input: the same map, one pass over the
                stale KV fewer.
        """
        w = self.seg_weight if inv_scale is None else self.seg_weight * inv_scale[..., None]
        seg = torch.einsum("bnsd,sde->bnse", x, w) + self.seg_bias  # [B, N, S, d_seg]
        seg = F.gelu(seg)  # nonlinearity between the two linear maps (the paper does not name one)
        return self.out(seg.flatten(2))  # [B, N, S * d_seg] -> [B, N, d_b]

    def forward_kv(self, keys: torch.Tensor, values: torch.Tensor, inv_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """:meth:`forward` of ``pack_kv(keys, values)`` [N, S, D] without packing: keys, values [L, H_kv, N, D]
        (any strides with a unit last one, e.g. a slice of a cache) -> s [N, d_b].

        Each (layer, K/V, head) segment is already an [N, D] matrix there, so the per-segment projections are two
        batched GEMMs over the caller's tensors; only the small [N, S, d_seg] result is reordered.
        """
        L, H, N, D = keys.shape
        w = self.seg_weight if inv_scale is None else self.seg_weight * inv_scale[..., None]  # [S, D, d_seg]
        w = w.to(keys.dtype).view(L, 2, H, D, -1)
        seg = torch.empty(N, L, 2, H, w.shape[-1], dtype=keys.dtype, device=keys.device)
        for c, x in enumerate((keys, values)):  # [L*H, N, D] @ [L*H, D, d_seg] -> [L, H, N, d_seg]
            y = torch.bmm(x.reshape(L * H, N, D), w[:, c].reshape(L * H, D, -1))
            seg[:, :, c].copy_(y.view(L, H, N, -1).permute(2, 0, 1, 3))
        seg = F.gelu(seg.view(N, L * 2 * H, -1) + self.seg_bias)
        return self.out(seg.flatten(1))


def _rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, N, dim] (rotate-half layout) for positions [B, N]."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv  # [B, N, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RepairBlock(nn.Module):
    """Pre-LN transformer block: block-causal attention with the repairer's own RoPE, then an MLP (ratio 3)."""

    def __init__(self, cfg: RepairConfig) -> None:
        super().__init__()
        d = cfg.d_b
        self.heads = cfg.attn_heads
        self.head_dim = d // self.heads
        self.theta = cfg.rope_theta
        self.ln1 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(d, cfg.mlp_ratio * d)
        self.fc2 = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """h [B, N, d_b]; mask [B, 1, N, N] bool (True = may attend); cos/sin [B, 1, N, head_dim].

        With ``spans`` (batch size 1, the chunks' [start, end) in order) the block-causal attention runs chunk by
        chunk over its prefix, with no N x N mask: chunk c's queries attend to keys [0, end_c) (the same pairs the
        mask allows, none of the masked ones).
        """
        B, N, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)  # [B, heads, N, hd]
        if spans is None:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e]) for s, e in spans],
                          dim=2)
        h = h + self.proj(a.transpose(1, 2).reshape(B, N, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


def _chunk_spans(chunk_index: torch.Tensor) -> list[tuple[int, int]] | None:
    """[start, end) of each chunk of a non-decreasing, unpadded [N] chunk index; None if it is not such."""
    ci = chunk_index.detach().cpu()
    if ci.numel() == 0 or bool((ci < 0).any()) or bool((ci[1:] < ci[:-1]).any()):
        return None
    _, counts = torch.unique_consecutive(ci, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def block_causal_mask(chunk_index: torch.Tensor) -> torch.Tensor:
    """CacheRepair §4.1 mask: token i may attend to token j iff chunk(j) <= chunk(i).

    Args:
        chunk_index: [B, N] chunk ordinal of every token; negative marks padding (never attended to; a padding
            row attends to itself only so that softmax stays finite).

    Returns:
        [B, 1, N, N] bool.
    """
    ci = chunk_index[:, :, None]
    cj = chunk_index[:, None, :]
    allowed = (cj <= ci) & (cj >= 0)
    eye = torch.eye(chunk_index.shape[1], dtype=torch.bool, device=chunk_index.device)[None]
    return (allowed | eye)[:, None]


__all__ = ["RepairBlock", "StaleEncoder", "block_causal_mask"]
