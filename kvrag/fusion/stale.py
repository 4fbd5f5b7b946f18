"""``stale``: use the concatenated chunk caches as they are (the speed floor, no repair)."""

from __future__ import annotations

from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register
from kvrag.kv import hf_cache


@register
class Stale(FusionMethod):
    """No cross-chunk repair: every chunk keeps the KV it had when prefilled alone."""

    name = "stale"

    def fuse(self, inp: FusionInput) -> FusionOutput:
        cache = hf_cache.make_cache(inp.keys, inp.values, inp.model.config)
        return FusionOutput(cache=cache, stats={"recomputed_fraction": 0.0})
