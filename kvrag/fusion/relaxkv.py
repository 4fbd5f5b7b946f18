"""``relaxkv``: query-guided repair targets AND a query-relevant recomputation context (RelaxKV, arXiv 2609.33503).

Selective repair methods choose which token states to recompute but let them attend to their whole causal prefix.
RelaxKV also chooses the context: from layer-wise query attention it derives per-layer anchors, active targets
(recomputed from layer 0 up to their deepest anchor layer) and one shared context ``U`` (the anchor union); every
active target attends only to the causally valid part of ``U``. See docs/methods.md#relaxkv for the reading we
implement; everything the paper summary leaves open is a parameter here (marked [decision] below).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import torch

from kvrag.fusion.base import Bool, FusionInput, FusionMethod, FusionOutput, register
from kvrag.fusion.recompute import (
    budget,
    check_choice,
    check_ratio,
    exact_mask,
    fusion_output,
    positions_of,
    recompute_input_pieces,
    top_positions,
)
from kvrag.fusion.scoring import query_attention_scores_pieces
from kvrag.kv import pieces


@dataclasses.dataclass
class RelaxSchedule:
    """RelaxKV's repair schedule (RelaxKV §3.2-§3.3, §A.1).

    Attributes:
        anchors: per layer, the [k] anchor positions A_l (sorted).
        deepest: [Tc] int64, h(t) = the deepest layer whose anchors contain t (-1: never an anchor).
        active: per layer, the active targets S_l = {t not exact : h(t) >= l} (sorted; nested, shrinking).
        union: [|U|] the shared context U = ∪_l A_l (plus every exact position with ``exact_context='all'``).
    """

    anchors: list[torch.Tensor]
    deepest: torch.Tensor
    active: list[torch.Tensor]
    union: torch.Tensor


def relaxkv_schedule(
    scores: torch.Tensor, k: int, exact: torch.Tensor, *, exact_context: str = "anchors"
) -> RelaxSchedule:
    """Anchors, active targets and shared context from per-layer scores.

    Args:
        scores: [L, Tc] query-attention score per layer and context position.
        k: anchors per layer (``budget(r, Tc)``).
        exact: [Tc] bool, positions whose KV is already exact (never targets).
        exact_context: 'anchors' (exact positions compete for anchor slots; when picked they join U but are not
            recomputed) or 'all' (exact positions are not ranked, so the k slots all go to repairable positions,
            and every exact position joins U, which keeps the sink in the context).

    Returns:
        RelaxSchedule.
    """
    n_layers, tc = scores.shape
    exact = exact.cpu()
    cand = torch.ones(tc, dtype=torch.bool) if exact_context == "anchors" else ~exact
    # RelaxKV §3.2: top-k anchors independently at every layer
    anchors = [top_positions(scores[layer], k, cand) for layer in range(n_layers)]
    deepest = torch.full((tc,), -1, dtype=torch.long)
    for layer, a in enumerate(anchors):
        deepest[a] = layer  # layers ascend, so the last write is the deepest
    # RelaxKV §3.2 / §A.1: a token is active from layer 0 through its deepest anchor layer
    active = [positions_of((deepest >= layer) & ~exact) for layer in range(n_layers)]
    in_u = deepest >= 0
    if exact_context == "all":
        in_u |= exact
    # RelaxKV §3.3: one shared context, the anchor union
    return RelaxSchedule(anchors, deepest, active, positions_of(in_u))


@register
class RelaxKV(FusionMethod):
    """RelaxKV repair: layer-wise query-attention anchors, active targets, sparse shared context.

    Steps (RelaxKV §3.1-§3.4; docs/methods.md#relaxkv):

    1. Scoring pass (§3.2): the whole question suffix attends over the stale cache; per layer the attention
       to each context position is reduced to one score (``agg``, ``score``).
    2. Anchors (§3.2): per layer the top ``k = max(1, round_half_up(r * Tc))`` positions.
    3. Active targets (§3.2, §A.1): a position is recomputed at layers 0..h(t), h(t) its deepest anchor layer.
    4. Context (§3.3): ``context='anchors'``: each target attends to the causally valid part of U = ∪ anchors
       (RelaxKV); ``context='full'``: its full causal prefix (the paper's full-prefix control, §A.4; the ablation
       ``relaxkv-fullctx``, :mod:`kvrag_bench.ablations`).
    5. Update (§3.4): fresh K/V of active targets overwrite the cache; everything else stays stale. Targets read
       fresh K/V of positions active at the same layer and stale K/V for the rest.

    Parameters ([decision] = not fixed by the paper summary; tune on data):
        r: anchor ratio per layer, in (0, 1]. r = 1 recomputes everything with full context, i.e. ``full``.
        context: 'anchors' | 'full' (see step 4).
        agg: [decision] reduction of the per-head scores: 'mean' (rank-equivalent to ProphetKV's sum) or 'max'.
        score: [decision] 'prob' (softmax over the context keys, ProphetKV's denominator) or 'logit' (scaled
            q·k logits), averaged over the suffix rows.
        exclude_first_chunk: [decision] treat the first non-prefix span as exact (never a target; InfoFlow
            excludes the first chunk). Useful when chunks are conditioned on the leading prefix.
        exact_context: [decision] how exact positions (the leading 'prefix' span, and the first chunk with
            ``exclude_first_chunk``) enter the context: 'anchors' (they compete for anchor slots and join U when
            picked; docs/methods.md#relaxkv) or 'all' (not ranked; all of them join U).

    Measured choices (SmolLM2-135M-Instruct, qa_dev rows 300-306, 7 requests, ~1.6K context tokens, r = 0.15;
    ``kvrag bench --offset 300 --methods ...``; KL(full || method) along the full-prefill answer, mean; stale 0.630):

    ======================================  =======  ==========================  ==============
    variant                                 KL       recomputed (layer, token)   |U| / Tc
    ======================================  =======  ==========================  ==============
    default (agg=mean, score=prob, ...)     0.183    0.395                       0.538
    agg=max                                 0.194    0.443                       0.603
    exact_context=all                       0.181    0.400                       0.608
    agg=max, exact_context=all              0.193    0.448                       0.667
    exclude_first_chunk=true                0.207    0.391                       0.538
    score=logit                             0.190    0.355                       0.490
    r=0.10                                  0.268    0.293                       0.414
    relaxkv-fullctx (full causal context)   0.165    0.395                       1.0
    ======================================  =======  ==========================  ==============

    So the defaults stay: mean over heads of softmax probabilities (cheapest that is best or tied: ``max`` and
    ``exact_context='all'`` recompute more for no gain), and the first chunk stays a target (with the engine's
    default conditioning it was computed after the chat header only, not after the one-shot preamble, so it is
    stale too). The differences between variants are within noise on 7 requests; the sparse context costs about
    0.02 KL against the full-context control (as in the paper's §A.4: small quality loss, less attention work).
    """

    name = "relaxkv"
    params = {
        "r": (float, 0.15),
        "context": (str, "anchors"),
        "agg": (str, "mean"),
        "score": (str, "prob"),
        "exclude_first_chunk": (Bool, False),
        "exact_context": (str, "anchors"),
    }
    r: float
    context: str
    agg: str
    score: str
    exclude_first_chunk: bool
    exact_context: str

    def validate(self) -> None:
        check_ratio(self.name, "r", self.r)
        check_choice(self.name, "context", self.context, ("anchors", "full"))
        check_choice(self.name, "agg", self.agg, ("mean", "max"))
        check_choice(self.name, "score", self.score, ("prob", "logit"))
        check_choice(self.name, "exact_context", self.exact_context, ("anchors", "all"))

    def schedule(self, inp: FusionInput) -> tuple[RelaxSchedule, int, int, float]:
        """Run the scoring pass and derive the schedule: (schedule, k, scoring edges, scoring seconds)."""
        return pieces.run_whole(self._schedule_pieces(inp, pieces.WHOLE))  # type: ignore[no-any-return]

    def _schedule_pieces(self, inp: FusionInput,
                         pace: pieces.Pace) -> Generator[None, None, tuple[RelaxSchedule, int, int, float]]:
        scores, score_edges, score_s = yield from query_attention_scores_pieces(inp, heads=self.agg, kind=self.score,
                                                                                pace=pace)
        k = budget(self.r, inp.context_len)
        exact = exact_mask(inp, first_chunk=self.exclude_first_chunk)
        return relaxkv_schedule(scores, k, exact, exact_context=self.exact_context), k, score_edges, score_s

    def fuse(self, inp: FusionInput) -> FusionOutput:
        return pieces.run_whole(self.fuse_pieces(inp, pieces.WHOLE))  # type: ignore[no-any-return]

    def fuse_pieces(self, inp: FusionInput, pace: pieces.Pace) -> Generator[None, None, FusionOutput]:
        """The scoring pass, then the recompute, one layer at a time, ending a piece between two layers when
        ``pace`` is due: the same layer calls, so the same bits, as :meth:`fuse`."""
        sched, k, score_edges, score_s = yield from self._schedule_pieces(inp, pace)
        yield from pace.boundary()
        ctx = sched.union if self.context == "anchors" else None
        res, cache, last = yield from recompute_input_pieces(inp, sched.active, ctx, pace)
        tc = max(1, inp.context_len)
        u_frac = sched.union.numel() / tc if self.context == "anchors" else 1.0
        return fusion_output(
            inp,
            res,
            cache=cache,
            last_logits=last,
            context_fraction=u_frac,
            score_s=score_s,
            score_edges=score_edges,
            anchors_per_layer=k,
            union_fraction=sched.union.numel() / tc,
            sink_in_context=bool(self.context == "full" or (sched.union.numel() and int(sched.union[0]) == 0)),
        )

