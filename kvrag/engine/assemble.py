"""Assembly of the stale context KV.

``assemble`` places chunk caches (computed by :func:`kvrag.kv.compute.compute_chunk_kv`) at their global offsets
and concatenates them into the stale KV a fusion method repairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag.engine.planner import PlannedSegment
from kvrag.fusion.base import FusionInput, Span
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec


@torch.inference_mode()
def assemble(
    model: Any,
    rope: Rope,
    spec: KVSpec,
    pieces: Sequence[tuple[str, ChunkKV, str | None]],
    suffix_ids: Sequence[int] | torch.Tensor,
) -> FusionInput:
    """Place canonical caches at consecutive global offsets and concatenate them (the "stale" KV).

    Args:
        pieces: ordered (kind, chunk, key) with kind 'prefix' | 'chunk' | 'text'.
        suffix_ids: [S] ids prefilled after repair.

    Returns:
        FusionInput with keys/values [L, H_kv, Tc, D] in the model's dtype on its device.
    """
    device = model.device
    mdtype = next(model.parameters()).dtype
    spans: list[Span] = []
    canon_k, vals, ids = [], [], []
    off = 0
    for kind, ch, key in pieces:
        t = ch.num_tokens
        if t == 0:
            continue
        spans.append(Span(off, off + t, kind, key))
        canon_k.append(ch.keys)
        vals.append(ch.values)
        ids.append(ch.token_ids)
        off += t
    if canon_k:
        ck = torch.cat(canon_k, dim=2).to(device, mdtype)  # [L, H_kv, Tc, D]
        v = torch.cat(vals, dim=2).to(device, mdtype)
        tok = torch.cat(ids)
    else:
        shape = (spec.num_layers, spec.num_kv_heads, 0, spec.head_dim)
        ck = torch.zeros(shape, dtype=mdtype, device=device)
        v = torch.zeros(shape, dtype=mdtype, device=device)
        tok = torch.zeros(0, dtype=torch.long)
    k = rope.place(ck, torch.arange(off, device=device))
    sfx = suffix_ids if isinstance(suffix_ids, torch.Tensor) else torch.tensor(list(suffix_ids), dtype=torch.long)
    return FusionInput(
        model=model,
        rope=rope,
        spec=spec,
        token_ids=tok,
        keys=k,
        values=v,
        spans=spans,
        suffix_ids=sfx,
        canonical_keys=ck,
    )


def context_only_input(
    model: Any,
    rope: Rope,
    spec: KVSpec,
    segments: Sequence[PlannedSegment],
    suffix_ids: Sequence[int] | torch.Tensor,
) -> FusionInput:
    """A FusionInput with the context's token ids and spans but empty KV ([L, H_kv, 0, D]).

    For methods that never read the stale cache (``FusionMethod.reads_cache = False``, e.g. ``full``), so that they
    are not charged for fetching and assembling caches they ignore.
    """
    spans = [Span(s.start, s.end, s.kind, None) for s in segments if s.token_ids]
    ids = [t for s in segments for t in s.token_ids]
    mdtype = next(model.parameters()).dtype
    empty = torch.zeros((spec.num_layers, spec.num_kv_heads, 0, spec.head_dim), dtype=mdtype, device=model.device)
    sfx = suffix_ids if isinstance(suffix_ids, torch.Tensor) else torch.tensor(list(suffix_ids), dtype=torch.long)
    return FusionInput(
        model=model,
        rope=rope,
        spec=spec,
        token_ids=torch.tensor(ids, dtype=torch.long),
        keys=empty,
        values=empty,
        spans=spans,
        suffix_ids=sfx,
    )
