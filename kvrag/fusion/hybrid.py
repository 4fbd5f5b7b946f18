"""``hybrid``: CacheRepair first, then RelaxKV's layer-wise anchors scored on the repaired cache (kvrag).

CacheRepair (§4.1) moves every stale token most of the way to its joint KV at the cost of a small network; what is
left is concentrated on few tokens that matter to the question. RelaxKV (§3.2-§3.4) finds exactly those: its
scoring pass now runs over the *repaired* cache, so the anchors are chosen by attention over better keys, and the
recomputed targets attend to their full causal prefix of the repaired cache (``context='full'``, the default) or
to RelaxKV's sparse anchor union U (``context='anchors'``). A small anchor ratio ``r`` then buys most of the gap
at a fraction of RelaxKV's cost. Why ``full`` is the default: the repaired context is good everywhere, so dropping
most of it (the sparse union) costs more than it saves: with the full context the KL to ``full`` is several times
smaller for a modest TTFT cost (docs/methods.md). At ``r = 1`` every position is recomputed with its full causal
context, which is ``full`` (the equivalence test), whatever the repairer did. With the full
context the question suffix is prefilled inside RelaxKV's recompute (:func:`kvrag.fusion.recompute.recompute_input`).

Both steps write into the request's KV buffer in place (:meth:`FusionInput.owned` gives a buffer-less input one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

from kvrag.errors import CheckpointMismatchError, ConfigError
from kvrag.fusion.base import Bool, FusionInput, FusionMethod, FusionOutput, register, shared_method
from kvrag.fusion.cacherepair import CacheRepair
from kvrag.fusion.relaxkv import RelaxKV
from kvrag.kv import pieces


@register
class Hybrid(FusionMethod):
    """CacheRepair, then RelaxKV at a small anchor ratio over the repaired cache.

    Parameters:
        r: RelaxKV's anchor ratio per layer, in (0, 1] (default 0.05).
        checkpoint: the CacheRepair checkpoint (default: the shipped one for the model).
        context, agg, score, exclude_first_chunk, exact_context: RelaxKV's parameters (see :class:`RelaxKV`).
    """

    name = "hybrid"
    reads_canonical_keys = True
    params = {"r": (float, 0.05), "checkpoint": (str, None), "context": (str, "full"), "agg": (str, "mean"),
              "score": (str, "prob"), "exclude_first_chunk": (Bool, False), "exact_context": (str, "anchors")}
    r: float
    checkpoint: str | None

    def validate(self) -> None:
        relax = {k: getattr(self, k) for k in RelaxKV.params}
        try:
            self.relax = RelaxKV(**relax)  # validates r and the RelaxKV choices
        except ConfigError as e:  # named as the method asked for
            raise ConfigError(str(e).replace("method 'relaxkv'", f"method {self.name!r}", 1)) from e
        self.repair = shared_method(CacheRepair(checkpoint=self.checkpoint))  # shares the loaded checkpoint

    def fuse(self, inp: FusionInput) -> FusionOutput:
        return pieces.run_whole(self.fuse_pieces(inp, pieces.WHOLE))  # type: ignore[no-any-return]

    def fuse_pieces(self, inp: FusionInput, pace: pieces.Pace) -> Generator[None, None, FusionOutput]:
        """The repair (one piece), then RelaxKV's pieces (:meth:`RelaxKV.fuse_pieces`)."""
        work = inp.owned()  # both steps write in place
        try:
            rep = self.repair.fuse(work)
        except (ConfigError, CheckpointMismatchError) as e:  # no repairer fits: named as asked, with its parameter
            msg = str(e).replace("cacherepair: ", f"{self.name} (CacheRepair, then RelaxKV): ", 1)
            raise type(e)(msg.replace("`cacherepair:checkpoint=DIR`", f"`{self.name}:checkpoint=DIR`")) from e
        yield from pace.boundary()
        out = yield from self.relax.fuse_pieces(work, pace)  # scores and recomputes over the repaired cache
        # RelaxKV's stats with the repair step's as a part; the repairer's FLOPs count at the top level (what the
        # cost model reads)
        part = dataclasses.replace(rep.stats, repairer_flops=None)
        stats = dataclasses.replace(out.stats, repair=part, repairer_flops=rep.stats.repairer_flops or 0.0)
        return FusionOutput(cache=out.cache, last_logits=out.last_logits, stats=stats)
