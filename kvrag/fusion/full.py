"""``full``: recompute the whole context and the suffix in one forward pass (the quality reference)."""

from __future__ import annotations

import torch

from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register
from kvrag.kv import hf_cache


@register
class Full(FusionMethod):
    """Full prefill of context + suffix, exactly as ``model.generate`` would prefill the same ids.

    The stale KV is ignored. Only the last position's logits are computed, which keeps this baseline as fast as
    transformers allows.
    """

    name = "full"
    reads_cache = False

    def fuse(self, inp: FusionInput) -> FusionOutput:
        ids = torch.cat([inp.token_ids, inp.suffix_ids.to(inp.token_ids.device)])
        cache = inp.buffer.as_cache(0) if inp.buffer is not None else None  # the request's buffer: no concatenation
        logits, cache = hf_cache.forward(inp.model, ids, cache, start=0)
        return FusionOutput(cache=cache, last_logits=logits[-1], stats={"recomputed_fraction": 1.0})
