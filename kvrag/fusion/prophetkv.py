"""``prophetkv``: recompute the context tokens the question attends to most (ProphetKV, arXiv 2602.02579).

The paper body was not available; this follows the reading in docs/methods.md#prophetkv: per-layer query-to-context
attention over the stale cache (Stage I), a uniform mean over layers (Stage II), one global top-``r`` token set
recomputed at every layer from embeddings with its full causal prefix.
"""

from __future__ import annotations

import torch

from kvrag.fusion.base import Bool, FusionInput, FusionMethod, FusionOutput, register
from kvrag.fusion.recompute import (
    budget,
    check_ratio,
    exact_mask,
    fusion_output,
    recompute_input,
    top_positions,
)
from kvrag.fusion.scoring import query_attention_scores


def prophet_select(scores: torch.Tensor, candidates: torch.Tensor, r: float) -> torch.Tensor:
    """ProphetKV Stage II: uniform mean of the per-layer scores, global top ``max(1, round_half_up(r * C))``.

    Args:
        scores: [L, Tc] per-layer query relevance alpha_l.
        candidates: [Tc] bool, positions that may be recomputed (C = their count).
        r: recompute ratio.

    Returns:
        Sorted int64 positions (ties broken by lower position).
    """
    fused = scores.float().mean(dim=0)  # [Tc] alpha_bar
    return top_positions(fused, budget(r, int(candidates.sum())), candidates)


@register
class ProphetKV(FusionMethod):
    """ProphetKV: query-driven global token selection, full causal prefix as context.

    Stage I (docs/methods.md#prophetkv): the whole question suffix runs over the stale cache (kvrag's reading
    where the available descriptions disagree: "query over the pre-calculated caches"); ``alpha_l[t]`` = softmax
    over the Tc context keys of the post-RoPE query logits, averaged over suffix rows and query heads
    (rank-equivalent to the paper's sum). Stage II: mean over
    all layers, top ``k`` of the reusable positions (the leading 'prefix' span is exact and not a candidate).
    Recompute: that set at every layer from embeddings, each attending to its full causal prefix; the suffix is
    prefilled over the repaired cache afterwards (same computation as recomputing it jointly).

    Parameters:
        r: recompute ratio of the candidates, in (0, 1] (paper default 0.20). r = 1 is ``full``.
        exclude_first_chunk: also exclude the first non-prefix span from candidates (default False).
    """

    name = "prophetkv"
    params = {"r": (float, 0.20), "exclude_first_chunk": (Bool, False)}
    r: float
    exclude_first_chunk: bool

    def validate(self) -> None:
        check_ratio(self.name, "r", self.r)

    def fuse(self, inp: FusionInput) -> FusionOutput:
        n_layers = inp.keys.shape[0]
        scores, score_edges, score_s = query_attention_scores(inp, heads="mean", kind="prob")
        cand = ~exact_mask(inp, first_chunk=self.exclude_first_chunk)
        tgt = prophet_select(scores, cand, self.r)
        res, cache, last = recompute_input(inp, [tgt] * n_layers)
        return fusion_output(
            inp, res, cache=cache, last_logits=last, score_s=score_s, score_edges=score_edges,
            selected=int(tgt.numel()), candidates=int(cand.sum())
        )
