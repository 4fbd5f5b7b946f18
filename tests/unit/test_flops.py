"""The analytic FLOP model behind the bench's FLOP-share / overhead columns."""

from __future__ import annotations

import pytest

from kvrag.fusion.cost import ModelCost
from kvrag.fusion.stats import MethodStats
from kvrag_testing.tiny import FAMILIES, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_state_flops_match_the_layers_linear_weights(family: str) -> None:
    """2 FLOPs per multiply-add: a (layer, token) state costs twice the layer's projection + MLP weights."""
    model = tiny_model(family, num_layers=2).model
    cost = ModelCost.from_config(model.config)
    layer = model.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if type(m).__name__ == "Linear")
    assert cost.state_flops == pytest.approx(2 * linear)
    assert cost.head_flops == pytest.approx(2 * model.lm_head.weight.numel())


def test_shares() -> None:
    model = tiny_model("llama", num_layers=2).model
    cost = ModelCost.from_config(model.config)
    tc, s = 300, 20
    assert cost.share(MethodStats(), tc, s, full=True) == pytest.approx(1.0)
    stale = cost.share(MethodStats(recomputed_fraction=0.0), tc, s)
    assert stale == pytest.approx(cost.suffix_prefill(tc, s) / cost.full_prefill(tc, s))
    # recomputing every context state with every causal pair, then the suffix, is a full prefill
    everything = cost.share(MethodStats(recomputed_fraction=1.0, attention_computed_ratio=1.0), tc, s)
    assert everything == pytest.approx(1.0, rel=1e-9)
    half = cost.share(MethodStats(recomputed_fraction=0.5, attention_computed_ratio=0.25, score_edges_ratio=0.05), tc,
                      s)
    assert stale < half < everything
