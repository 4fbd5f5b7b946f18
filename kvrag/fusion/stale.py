"""``stale``: use the concatenated chunk caches as they are (the speed floor, no repair)."""

from __future__ import annotations

from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register
from kvrag.fusion.stats import MethodStats


@register
class Stale(FusionMethod):
    """No cross-chunk repair: every chunk keeps the KV it had when prefilled alone."""

    name = "stale"

    def fuse(self, inp: FusionInput) -> FusionOutput:
        cache = inp.cache_over(inp.keys, inp.values)  # read-only: no copy
        return FusionOutput(cache=cache, stats=MethodStats(recomputed_fraction=0.0))
