"""int8 K/V for decode (``EngineConfig.kv_dtype="int8"``): the layout and its torch reference.

A position of a KV head holds its ``D`` values as int8 followed by one float32 scale per group of :data:`GROUP`
dimensions (one group of ``D`` where ``D`` is not a multiple of it): a decode buffer of int8 K/V is
``[L, H_kv, capacity, D + 4 * groups]`` int8 (:class:`kvrag.kv.kvbuffer.KVBuffer`), 72 bytes a position for heads
of 64 against bfloat16's 128. Each group is scaled symmetrically by its absmax, for that one position (llama.cpp's
q8_0 K/V cache scales blocks of 32 the same way; vLLM's 8-bit caches scale per token and head), so a position is
quantized once, when it is written, and never again:

    scale = max |x| / 127  (1 where that is 0),   q = round(x / scale) within -127 .. 127  (nearest even)

:func:`quantize` runs these operations in torch and ``row_attention.c``'s ``put_i8`` runs the same float32
operations in C, so both write the same bytes (a decode step through either matches the other bit for bit, which
the step backends' first-step check verifies). The scales sit beside their values so that an attention entry's keys
and values stay one address each and a position is one contiguous read. Groups of 32 rather than one scale per
head: a scale sets the rounding step of every value it covers from the largest of them, and groups confine a large
value's coarse step to its own 32 dims (next-token cost of both layouts in docs/results/epyc/kv_int8.md).
"""

from __future__ import annotations

import torch

GROUP = 32
"""Dimensions sharing one scale (``row_attention.c``'s ``I8_GROUP``)."""
SCALE_BYTES = 4
"""Bytes of one group's float32 scale."""


def group(head_dim: int) -> int:
    """Dimensions per scale for heads of ``head_dim``: :data:`GROUP`, or the whole head where it is not a multiple."""
    return GROUP if head_dim % GROUP == 0 else head_dim


def width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements a position of one KV head takes in a buffer of ``dtype``: ``head_dim``, or for int8 K/V
    ``head_dim`` bytes and the groups' scales."""
    return head_dim + SCALE_BYTES * (head_dim // group(head_dim)) if dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] (any float dtype) as int8 positions [..., width(D)]: each position's values and its groups'
    scales."""
    d = x.shape[-1]
    gs = group(d)
    xf = x.float().reshape(*x.shape[:-1], d // gs, gs)
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-127, 127).to(torch.int8).reshape(x.shape)
    return torch.cat([q, safe.reshape(*x.shape[:-1], d // gs).contiguous().view(torch.int8)], -1)


def dequantize(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int8 positions [..., width(head_dim)] as float32 [..., head_dim] (values times their groups' scales). The
    head dim is passed, not derived from the width: two head dims can share one (160 and 176 both take 180 bytes)."""
    d = head_dim
    if q.shape[-1] != width(d, torch.int8):
        msg = f"int8 positions of {q.shape[-1]} bytes for heads of {d} (which take {width(d, torch.int8)})"
        raise ValueError(msg)
    gs = group(d)
    scale = q[..., d:].contiguous().view(torch.float32)  # [..., groups]
    return (q[..., :d].float().reshape(*q.shape[:-1], d // gs, gs) * scale[..., None]).reshape(*q.shape[:-1], d)


__all__ = ["GROUP", "SCALE_BYTES", "dequantize", "group", "quantize", "width"]
