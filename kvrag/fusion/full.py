"""``full``: recompute the whole context and the suffix in one forward pass (the quality reference)."""

from __future__ import annotations

from collections.abc import Generator

import torch

from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, Observation, register
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.online import online_costs
from kvrag.fusion.stats import MethodStats
from kvrag.kv import pieces


@register
class Full(FusionMethod):
    """Full prefill of context + suffix, exactly as ``model.generate`` would prefill the same ids.

    The stale KV is ignored. Only the last position's logits are computed, which keeps this baseline as fast as
    transformers allows. Given :attr:`FusionInput.prompt_ids` (a plan that spliced a chunk inexactly, as ``auto``'s
    last level may see), it prefills those -- the prompt's own tokenization, what ``full`` itself is planned with.
    """

    name = "full"
    reads_cache = False

    def fuse(self, inp: FusionInput) -> FusionOutput:
        return pieces.run_whole(self.fuse_pieces(inp, pieces.WHOLE))  # type: ignore[no-any-return]

    def fuse_pieces(self, inp: FusionInput, pace: pieces.Pace) -> Generator[None, None, FusionOutput]:
        """The one forward, parked at linear layers when ``pace`` is due (:func:`kvrag.kv.pieces.forward_pieces`):
        the same computation, so the same bits, as :meth:`fuse`."""
        whole = inp.prompt_ids is not None  # the prompt's own ids, where a splice changed a boundary token
        ids = (inp.prompt_ids if inp.prompt_ids is not None
               else torch.cat([inp.token_ids, inp.suffix_ids.to(inp.token_ids.device)]))
        cache = inp.buffer.as_cache(0) if inp.buffer is not None else None  # the request's buffer: no concatenation
        logits, cache = yield from pieces.forward_pieces(inp.model, ids, cache, start=0, pace=pace)
        return FusionOutput(cache=cache, last_logits=logits[-1], stats=MethodStats(recomputed_fraction=1.0),
                            prompt_tokenized=whole)

    def observe(self, obs: Observation) -> None:
        """Full's measured speed (seconds per analytic FLOP) is what ``auto``'s online correction measures every
        candidate against (:mod:`kvrag.fusion.online`)."""
        flops = ModelCost.from_config(obs.model.config).full_prefill(obs.context_tokens, obs.suffix_tokens)
        online_costs(obs.model).observe_full(flops, obs.ttft_s)
