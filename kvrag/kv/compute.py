"""Compute one chunk's canonical KV cache: prefill it alone (after an optional conditioning prefix), remove RoPE.

The one way a chunk cache is made, shared by the engine (ingest and cache misses), the CacheRepair pair builder
(stale halves of its training pairs) and the test suites, so a repairer is trained on caches computed exactly like
the ones it repairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec


@torch.inference_mode()
def compute_chunk_kv(
    model: Any, rope: Rope, spec: KVSpec, token_ids: Sequence[int], prefix_ids: Sequence[int] = ()
) -> ChunkKV:
    """Prefill ``prefix_ids + token_ids`` and keep the chunk part, canonicalized.

    Args:
        token_ids: the chunk's T ids.
        prefix_ids: P conditioning ids (e.g. the chat template's system header acting as attention sink); their
            KV is discarded, only the chunk's T positions are returned.

    Returns:
        ChunkKV with keys/values [L, H_kv, T, D] at ``spec.dtype`` on the CPU.
    """
    p = len(prefix_ids)
    ids = torch.tensor([*prefix_ids, *token_ids], dtype=torch.long)
    k, v = hf_cache.prefill_kv(model, ids)  # [L, H_kv, P+T, D]
    k, v = k[:, :, p:], v[:, :, p:]
    pos = torch.arange(p, p + len(token_ids))
    k = rope.canonicalize(k, pos)
    dt = spec.torch_dtype
    return ChunkKV(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long),
        keys=k.to("cpu", dt).contiguous(),
        values=v.to("cpu", dt).contiguous(),
        spec=spec,
    )


__all__ = ["compute_chunk_kv"]
