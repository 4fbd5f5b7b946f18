"""Assembly of the stale context KV.

``assemble`` places chunk caches (computed by :func:`kvrag.kv.compute.compute_chunk_kv`) at their global offsets
and concatenates them into the stale KV a fusion method repairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.engine.planner import PlannedSegment
from kvrag.fusion.base import FusionInput, Span
from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def assemble(
    model: PreTrainedModel,
    rope: Rope,
    spec: KVSpec,
    pieces: Sequence[tuple[str, ChunkKV, str | None]],
    suffix_ids: Sequence[int] | torch.Tensor,
    *,
    buffer: hf_cache.KVBuffer | None = None,
    chunk_prefix_ids: Sequence[int] = (),
    canonical: bool = False,
) -> FusionInput:
    """Place canonical caches at consecutive global offsets into one request buffer (the "stale" KV).

    Zero-copy: each chunk's canonical keys are rotated straight into the request's
    :class:`~kvrag.kv.hf_cache.KVBuffer` (fp32 math) and its values copied in. The returned input's
    ``keys``/``values`` are views of that buffer, which fusion methods repair in place and the suffix prefill and
    decode append to.

    Args:
        pieces: ordered (kind, chunk, key) with kind 'prefix' | 'chunk' | 'text'.
        suffix_ids: [S] ids prefilled after repair.
        buffer: the buffer to assemble into, in the model's dtype with room for context + suffix (the engine's:
            :meth:`kvrag.engine.lease.Lease.prompt_buffer`, sized by the request's lease); None: a new one of
            exactly context + suffix positions.
        chunk_prefix_ids: what the chunk caches were conditioned on (recorded on the input).
        canonical: also gather the chunks' canonical keys (RoPE removed, as stored) into ``canonical_keys``, for
            methods that read them (``FusionMethod.reads_canonical_keys``).

    Returns:
        FusionInput with keys/values [L, H_kv, Tc, D] in the model's dtype on its device, ``buffer`` set.
    """
    device = model.device
    mdtype = next(model.parameters()).dtype
    sfx = suffix_ids if isinstance(suffix_ids, torch.Tensor) else torch.tensor(list(suffix_ids), dtype=torch.long)
    used = [(kind, ch, key) for kind, ch, key in pieces if ch.num_tokens > 0]
    tc = sum(ch.num_tokens for _, ch, _ in used)
    buf = buffer if buffer is not None else hf_cache.KVBuffer(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                              tc + int(sfx.shape[0]), mdtype, device)
    buf.reserve(tc + int(sfx.shape[0]))  # a leased buffer refuses when short (LeaseExceededError)
    keys, values = buf.context(tc)  # [L, H_kv, Tc, D] views
    ckeys = torch.empty_like(keys) if canonical else None
    spans: list[Span] = []
    ids = []
    off = 0
    for kind, ch, key in used:
        t = ch.num_tokens
        spans.append(Span(off, off + t, kind, key))
        pos = torch.arange(off, off + t, device=device)
        rope.place(ch.keys.to(device, non_blocking=True), pos, out=keys[:, :, off : off + t])
        if ckeys is not None:
            ckeys[:, :, off : off + t].copy_(ch.keys, non_blocking=True)
        values[:, :, off : off + t].copy_(ch.values, non_blocking=True)
        ids.append(ch.token_ids)
        off += t
    tok = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return FusionInput(
        model=model,
        rope=rope,
        spec=spec,
        token_ids=tok,
        keys=keys,
        values=values,
        spans=spans,
        suffix_ids=sfx,
        canonical_keys=ckeys,
        buffer=buf,
        chunk_prefix_ids=tuple(chunk_prefix_ids),
    )


def context_only_input(
    model: PreTrainedModel,
    rope: Rope,
    spec: KVSpec,
    segments: Sequence[PlannedSegment],
    suffix_ids: Sequence[int] | torch.Tensor,
    *,
    buffer: hf_cache.KVBuffer | None = None,
) -> FusionInput:
    """A FusionInput with the context's token ids and spans but empty KV ([L, H_kv, 0, D]).

    For methods that never read the stale cache (``FusionMethod.reads_cache = False``, e.g. ``full``), so that they
    are not charged for fetching and assembling caches they ignore. Its (empty) request buffer is ``buffer`` (as in
    :func:`assemble`; None: one of exactly the prompt), so ``full`` also prefills and decodes without concatenation.
    """
    spans = [Span(s.start, s.end, s.kind, None) for s in segments if s.token_ids]
    ids = [t for s in segments for t in s.token_ids]
    mdtype = next(model.parameters()).dtype
    sfx = suffix_ids if isinstance(suffix_ids, torch.Tensor) else torch.tensor(list(suffix_ids), dtype=torch.long)
    buf = buffer if buffer is not None else hf_cache.KVBuffer(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                                              len(ids) + int(sfx.shape[0]), mdtype, model.device)
    buf.reserve(len(ids) + int(sfx.shape[0]))
    keys, values = buf.context(0)
    return FusionInput(
        model=model,
        rope=rope,
        spec=spec,
        token_ids=torch.tensor(ids, dtype=torch.long),
        keys=keys,
        values=values,
        spans=spans,
        suffix_ids=sfx,
        buffer=buf,
    )
