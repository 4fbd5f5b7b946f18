"""``ape``: an attention temperature for the reused chunks (after APE, Yang et al., ICML'25), over a base repair.

APE observes that chunks encoded in parallel draw attention differently from the same text encoded in sequence,
and corrects the question's attention to them, without training, with a temperature (and a scale factor) on the
attention logits of the parallel-encoded tokens. Dividing a logit ``q . k`` by ``t`` is scaling the key ``k`` by
``1 / t``, and RoPE rotates keys linearly, so kvrag applies the temperature by scaling the placed keys of every
reusable position (chunks and text, not the exact prefix) in the request's cache once, after the base method: the
suffix prefill and every decode step then attend to the reused chunks at temperature ``t`` and to the prefix, the
question and the answer as usual. APE's scale factor (a constant added to those logits) is not applied: it is not a
key scaling. ``t = 1`` is the base method unchanged.
"""

from __future__ import annotations

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register, shared_method
from kvrag.fusion.recompute import check_choice


@register
class Ape(FusionMethod):
    """A base repair, then the reused chunks' keys scaled by ``1 / t`` at every layer.

    Parameters:
        t: attention temperature for the reused positions, > 0 (default 1.0: no change).
        base: the repair applied first: 'stale' or 'cacherepair' (default 'cacherepair').
    """

    name = "ape"
    params = {"t": (float, 1.0), "base": (str, "cacherepair")}
    reads_canonical_keys = True  # the cacherepair base reads them
    t: float
    base: str

    def validate(self) -> None:
        check_choice(self.name, "base", self.base, ("stale", "cacherepair"))
        if not 1e-3 <= self.t <= 1e3:  # beyond, the scaled keys overflow: no answer at all
            msg = f"method {self.name!r}: t (the attention temperature) must be in [0.001, 1000], got {self.t}"
            raise ConfigError(msg)

    def fuse(self, inp: FusionInput) -> FusionOutput:
        work = inp.owned()
        out = shared_method(self.base).fuse(work)
        if self.t != 1.0:
            mask = work.reusable_mask.to(work.keys.device)
            work.keys[:, :, mask] *= 1.0 / self.t
        return FusionOutput(cache=work.cache_over(work.keys, work.values), stats=out.stats)
