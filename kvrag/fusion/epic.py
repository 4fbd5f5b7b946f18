"""``epic``: recompute the first k tokens of every chunk (EPIC / LegoLink, arXiv 2410.15332; docs/methods.md#epic).

A chunk prefilled alone makes its first tokens attention sinks; after concatenation every chunk head is still a
sink. Recomputing the first ``k`` tokens of each chunk, at every layer, with the real causal prefix turns them
back into ordinary tokens. No run-time signal: a static, position-based rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, Span, register
from kvrag.fusion.recompute import fusion_output, recompute_input
from kvrag.fusion.stats import MethodStats


def epic_positions(spans: Sequence[Span], k: int) -> torch.Tensor:
    """The first ``k`` positions of every non-prefix span that has something before it. EPIC §3 (LegoLink).

    The leading 'prefix' span is exact and keeps its legitimate sink; a span starting at position 0 has no
    predecessor to link to (docs/methods.md#epic), so neither is selected. With a leading prefix span this is
    "every chunk except the first" in the paper's sense, where the first chunk holds the sequence start.

    Returns:
        [sum_i min(k, len_i)] sorted int64 positions.
    """
    pos = [torch.arange(s.start, min(s.end, s.start + k)) for s in spans if s.kind != "prefix" and s.start > 0]
    if not pos or k <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.sort(torch.cat(pos)).values


@register
class Epic(FusionMethod):
    """EPIC/LegoLink: the first ``k`` tokens of each chunk recomputed at all layers from embeddings, each attending
    to its full causal prefix (fresh K/V for other recomputed tokens, stale elsewhere).

    Parameters:
        k: tokens per chunk (>= 0; paper main setting 16, grids 8/16/32/64). ``k = 0`` is ``stale``; ``k`` at
            least the longest chunk recomputes every chunk token, i.e. ``full``.
    """

    name = "epic"
    params = {"k": (int, 16)}
    k: int

    def validate(self) -> None:
        if self.k < 0:
            msg = f"method {self.name!r}: k (tokens recomputed per chunk) must be >= 0, got {self.k}"
            raise ConfigError(msg)

    def fuse(self, inp: FusionInput) -> FusionOutput:
        n_layers = inp.keys.shape[0]
        tgt = epic_positions(inp.spans, self.k)
        if not tgt.numel():  # nothing to recompute: ``stale`` itself (the engine prefills the suffix as for it)
            return FusionOutput(cache=inp.cache_over(inp.keys, inp.values),
                                stats=MethodStats(recomputed_fraction=0.0, selected=0))
        res, cache, last = recompute_input(inp, [tgt] * n_layers)
        return fusion_output(inp, res, cache=cache, last_logits=last, selected=int(tgt.numel()))
