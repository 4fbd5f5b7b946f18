"""``cacheblend``: recompute the high-KV-deviation tokens (CacheBlend, arXiv 2405.16444; docs/methods.md#cacheblend).

Layer 0 (up to the check layer) recomputes every reusable token with its full causal prefix; at the check layer
(index 1 in the released code) the fresh K/V of every token are compared with the stale ones, and only the top
``r`` fraction by deviation is recomputed from there on, each attending to its full causal prefix (fresh where
recomputed at that layer, stale elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register
from kvrag.fusion.recompute import (
    LayerState,
    budget,
    check_choice,
    check_ratio,
    exact_mask,
    fusion_output,
    positions_of,
    selective_recompute,
    top_positions,
)
from kvrag.kv import hf_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def kv_deviation(fresh: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 deviation summed over KV heads and head dims: [H_kv, N, D] x2 -> [N] float32.

    CacheBlend §2 "HKVD" tokens; the released code uses ``((V_fresh - V_stale) ** 2).sum(heads, dim)``.
    """
    return (fresh.float() - stale.float()).pow(2).sum(dim=(0, 2))


def select_hkvd(model: PreTrainedModel, state: LayerState, k: int, *, deviation: str = "v",
                write_all: bool = True) -> torch.Tensor:
    """CacheBlend's check-layer selection (the released code's single check layer; docs/methods.md#cacheblend).

    Projects fresh K/V of every current target at ``state.layer`` (no attention), ranks by deviation from the
    stale K/V and returns the top ``k`` positions. With ``write_all`` the fresh K/V of every target are written to
    the working cache first (YaoJiayi/CacheBlend: all layer-1 K/V fresh, the selected rows attend to them);
    otherwise only the selected rows are rewritten later (LMCache).
    """
    layer, tgt = state.layer, state.targets
    fk, fv = hf_cache.project_kv(model, layer, state.hidden, tgt.to(state.hidden.device))  # [H_kv, N, D]
    dev_idx = tgt.to(state.keys.device)
    stale = state.keys[layer][:, dev_idx] if deviation == "k" else state.values[layer][:, dev_idx]
    score = kv_deviation(fk if deviation == "k" else fv, stale)  # [N]
    chosen = tgt[top_positions(score, k)]
    if write_all:
        state.keys[layer][:, dev_idx] = fk.to(state.keys.dtype)
        state.values[layer][:, dev_idx] = fv.to(state.values.dtype)
        state.extra_states += int(tgt.numel() - chosen.numel())
    return chosen


@register
class CacheBlend(FusionMethod):
    """CacheBlend as released (one check layer), on our exact position-masked recompute.

    Parameters:
        r: recompute ratio of the reusable positions, in (0, 1]; ``k = max(1, round_half_up(r * C))``, C the
            number of reusable (non-prefix) positions. r = 1 recomputes everything, i.e. ``full``.
        check_layer: the layer where deviation is measured (>= 1: at layer 0 fresh K/V depend only on the token's
            own embedding, so the deviation is 0); layers before it recompute every reusable token.
        deviation: 'v' (released CacheBlend code, and what CacheRepair compared against) or 'k' (LMCache; keys
            rotated at the same global positions on both sides).
        check_write: 'all' (released code: every reusable token gets fresh K/V at the check layer) or 'selected'
            (LMCache: only the selected rows are rewritten there).

    Stats: ``recomputed_per_layer`` / ``recomputed_fraction`` count every (layer, token) state written, including
    the check layer's fresh K/V of every checked token with ``check_write='all'``.

    Deviations from the paper, stated: the paper's gradual filtering over several layers is not in the released
    code nor here; we use our position-based causal mask, not the bottom-right-aligned kernel mask of the public
    implementations (docs/methods.md#selective-recomputation); the question suffix is not part of the recompute (it is
    prefilled over the repaired cache afterwards, which is the same computation).
    """

    name = "cacheblend"
    params = {
        "r": (float, 0.15),
        "check_layer": (int, 1),
        "deviation": (str, "v"),
        "check_write": (str, "all"),
    }
    r: float
    check_layer: int
    deviation: str
    check_write: str

    def validate(self) -> None:
        check_ratio(self.name, "r", self.r)
        if self.check_layer < 1:
            msg = (
                f"method {self.name!r}: check_layer must be >= 1 (layer 0 has no KV deviation), got {self.check_layer}"
            )
            raise ConfigError(msg)
        check_choice(self.name, "deviation", self.deviation, ("v", "k"))
        check_choice(self.name, "check_write", self.check_write, ("all", "selected"))

    def fuse(self, inp: FusionInput) -> FusionOutput:
        n_layers = inp.keys.shape[0]
        if self.check_layer >= n_layers:
            msg = (
                f"method {self.name!r}: check_layer={self.check_layer} but the model has {n_layers} layers; "
                f"use check_layer in [1, {n_layers - 1}]"
            )
            raise ConfigError(msg)
        cand = positions_of(~exact_mask(inp))  # reusable positions
        k = budget(self.r, int(cand.numel()))
        write_all = self.check_write == "all"
        checked = [0]  # tokens whose fresh K/V the check layer computed

        def hook(model: PreTrainedModel, state: LayerState) -> torch.Tensor | None:
            if state.layer != self.check_layer:
                return None
            checked[0] = int(state.targets.numel())
            return select_hkvd(model, state, k, deviation=self.deviation, write_all=write_all)

        # CacheBlend §3: every reusable token until the check layer, then the selected ones
        res = selective_recompute(inp.model, inp.token_ids, *inp.working_kv(), [cand] * n_layers, None, hook=hook,
                                  inplace=True)
        out = fusion_output(inp, res, selected=k, candidates=int(cand.numel()))
        # Count every (layer, token) state written: with check_write='all' the check layer rewrites all the tokens it
        # checked, not only the selected ones the executor then runs (its target list shows only those).
        per_layer = [int(t.numel()) for t in res.targets]
        if write_all:
            per_layer[self.check_layer] = max(per_layer[self.check_layer], checked[0])
        out.stats.recomputed_per_layer = per_layer
        out.stats.recomputed_fraction = sum(per_layer) / max(1, n_layers * inp.context_len)
        return out
