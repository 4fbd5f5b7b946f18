"""Analytic FLOPs of a request, per method, as a share of a full prefill (``kvrag bench`` "FLOP share" column).

The model (multiply-adds count 2 FLOPs; decoder-only transformer with GQA and a gated MLP, the families kvrag
serves):

* one (layer, token) state costs ``2 h (2 H d + 2 H_kv d) + 2 * 3 h m`` -- q/o projections (H d wide), k/v
  projections (H_kv d), gate/up/down of the MLP (width m);
* one attention (query, key) pair at one layer costs ``4 H d`` -- q.k and p.v for every query head;
* the LM head on the last position costs ``2 h V`` (only the last position's logits are computed).

A **full prefill** of Tc context + S suffix tokens: ``L (Tc + S)`` states, ``L (Tc+S)(Tc+S+1)/2`` causal pairs,
one head. A reusing method pays the **suffix prefill** (``L S`` states, ``L (S Tc + S(S+1)/2)`` pairs, one head)
plus what its own :class:`~kvrag.fusion.stats.MethodStats` say it computed: recomputed states
(``recomputed_fraction * L Tc``) and attention pairs (``attention_computed_ratio`` -- pairs the kernels evaluated,
masked ones included -- and ``score_edges_ratio``, times the context's full causal pairs ``L Tc (Tc+1)/2``), a
scoring pass over the suffix (``L S`` states when ``score_edges_ratio`` > 0; the last layer's MLP included, a small
overestimate), and a learned repairer's own FLOPs (``repairer_flops``). Norms, RoPE, softmax, copies and the KV
fetch are not counted: they are what the "overhead" factor (measured TTFT ratio / FLOP share) exposes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvrag.fusion.stats import MethodStats

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Per-unit FLOPs of one model (see the module docstring)."""

    num_layers: int
    state_flops: float
    pair_flops: float
    head_flops: float

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelCost:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = int(c.hidden_size)
        heads = int(c.num_attention_heads)
        kv = int(getattr(c, "num_key_value_heads", None) or heads)
        d = int(getattr(c, "head_dim", None) or h // heads)
        m = int(getattr(c, "intermediate_size", 4 * h))
        return cls(
            num_layers=int(c.num_hidden_layers),
            state_flops=2.0 * h * (2 * heads * d + 2 * kv * d) + 2.0 * 3 * h * m,
            pair_flops=4.0 * heads * d,
            head_flops=2.0 * h * int(c.vocab_size),
        )

    def full_prefill(self, tc: int, s: int) -> float:
        n = tc + s
        return self.num_layers * (n * self.state_flops + n * (n + 1) / 2 * self.pair_flops) + self.head_flops

    def suffix_prefill(self, tc: int, s: int) -> float:
        pairs = s * tc + s * (s + 1) / 2
        return self.num_layers * (s * self.state_flops + pairs * self.pair_flops) + self.head_flops

    def method(self, stats: MethodStats, tc: int, s: int, *, full: bool = False) -> float:
        """FLOPs a method spent on a request, from its statistics."""
        if full:
            return self.full_prefill(tc, s)
        L = self.num_layers
        ctx_pairs = L * tc * (tc + 1) / 2
        f = self.suffix_prefill(tc, s)
        f += float(stats.recomputed_fraction or 0.0) * L * tc * self.state_flops
        f += float(stats.attention_computed_ratio or 0.0) * ctx_pairs * self.pair_flops
        score = float(stats.score_edges_ratio or 0.0)
        if score > 0:
            f += L * s * self.state_flops + score * ctx_pairs * self.pair_flops
        f += float(stats.repairer_flops or 0.0)
        return f

    def share(self, stats: MethodStats, tc: int, s: int, *, full: bool = False) -> float:
        """The method's FLOPs over a full prefill's on the same request."""
        return self.method(stats, tc, s, full=full) / self.full_prefill(tc, s)


__all__ = ["ModelCost"]
