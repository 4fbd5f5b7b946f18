"""An independent oracle for the selective-recompute executor (issue 13): at r < 1 RelaxKV, RelaxKV-fullctx,
ProphetKV, EPIC and CacheBlend must produce, at every layer, exactly the K/V (and next-token logits) of a dense
reference written here: each decoder layer of the tiny model runs ONCE over the whole context with a dense
[Tc, Tc] mask, the non-target rows' K/V substituted by the stale ones. No block loop, no context gather, no index
bookkeeping -- so it checks the executor (``kvrag.fusion.recompute.selective_recompute``), not the schedules: the
schedules are taken from the methods' own ``schedule()`` / selection.

Semantics the reference encodes (docs/methods.md#selective-recomputation; RelaxKV §3.3-§3.4): at layer l a
target t attends to the positions j <= t that are readable -- every position (full causal prefix) or only
U ∪ targets_l (RelaxKV's sparse context) -- with FRESH K/V at this layer's targets and STALE K/V elsewhere; its fresh
K/V replace the stale ones at layer l and its output is its input to layer l+1. Also here: CacheBlend's selective
phase really runs at 4 layers, and its statistics count every state it writes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.cache_utils import DynamicCache

from kvrag.fusion import FusionInput, get_method
from kvrag.fusion.cacheblend import CacheBlend
from kvrag.fusion.epic import epic_positions
from kvrag.fusion.prophetkv import prophet_select
from kvrag.fusion.recompute import budget, exact_mask
from kvrag.fusion.relaxkv import RelaxKV
from kvrag.fusion.scoring import query_attention_scores
from kvrag.kv import hf_cache
from kvrag_bench.ablations import register_ablations
from kvrag_testing.fusion_suite import SUITE_LAYERS, FusionCase, context_kv, fusion_case
from kvrag_testing.tiny import FAMILIES

register_ablations()  # relaxkv-fullctx (the full-prefix control) is tested here

ATOL = 1e-5  # fp32, 4 layers, init_std 0.1: the executor and the reference agree to ~3e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _SubstituteCache:
    """The cache a decoder layer sees in the reference: ``update`` gets the fresh K/V of EVERY row and returns them
    at the target rows and the stale K/V everywhere else."""

    def __init__(self, stale_k: torch.Tensor, stale_v: torch.Tensor, fresh_rows: torch.Tensor) -> None:
        self.stale_k, self.stale_v, self.rows = stale_k, stale_v, fresh_rows  # [H_kv, Tc, D] x2, [Tc] bool
        self.fresh_k: torch.Tensor | None = None
        self.fresh_v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self.fresh_k, self.fresh_v = k[0], v[0]  # [H_kv, Tc, D]
        sel = self.rows.view(1, -1, 1)
        return torch.where(sel, k[0], self.stale_k)[None], torch.where(sel, v[0], self.stale_v)[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _dense_layer(model: Any, layer: int, hidden: torch.Tensor, k_work: torch.Tensor, v_work: torch.Tensor,
                 fresh_rows: torch.Tensor, query_rows: torch.Tensor, readable: torch.Tensor) -> tuple[Any, ...]:
    """Run decoder layer ``layer`` over all Tc rows: K/V fresh at ``fresh_rows``, stale (``k_work``) elsewhere; each
    row in ``query_rows`` attends to the readable positions j <= itself; other rows attend to themselves only (their
    outputs are never used). Returns (hidden out [1, Tc, hid], fresh K, fresh V [H_kv, Tc, D])."""
    base = model.model
    tc = hidden.shape[1]
    pos = torch.arange(tc)
    allowed = (pos[None, :] <= pos[:, None]) & readable[None, :]  # [Tc, Tc] dense
    allowed[~query_rows] = torch.eye(tc, dtype=torch.bool)[~query_rows]
    bias = torch.zeros(tc, tc).masked_fill(~allowed, torch.finfo(torch.float32).min)
    cache = _SubstituteCache(k_work[layer], v_work[layer], fresh_rows)
    out = base.layers[layer](
        hidden, attention_mask=bias[None, None], position_ids=pos[None], cache=cache, use_cache=True,
        position_embeddings=base.rotary_emb(hidden, pos[None]),
    )
    out = out[0] if isinstance(out, tuple) else out
    assert cache.fresh_k is not None and cache.fresh_v is not None
    return out, cache.fresh_k, cache.fresh_v


@torch.inference_mode()
def dense_reference(inp: FusionInput, targets: list[torch.Tensor], context: torch.Tensor | None = None,
                    blend: tuple[int, int, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Repaired K/V [L, H_kv, Tc, D] by the dense reference.

    Args:
        targets: per layer, the positions recomputed (nested).
        context: None (full causal prefix) or U, the positions (besides this layer's targets) a target may read.
        blend: CacheBlend's (check layer, k, write_all): at the check layer the top-k targets by squared V
            deviation from stale are selected; they alone go on; with write_all every checked target's fresh K/V
            is written there (and read by the selected rows).
    """
    model = inp.model
    n_layers, _, tc, _ = inp.keys.shape
    k_work, v_work = inp.keys.clone(), inp.values.clone()
    pos = torch.arange(tc)
    rows = [torch.isin(pos, t) for t in targets]  # [Tc] bool per layer
    hidden = model.model.embed_tokens(inp.token_ids[None])  # [1, Tc, hid]
    for layer in range(n_layers):
        tgt = rows[layer]
        if not tgt.any():
            break
        readable = torch.ones(tc, dtype=torch.bool) if context is None else torch.isin(pos, context)
        readable = readable | tgt
        fresh_rows = tgt
        if blend is not None and layer == blend[0]:
            _, _, fv = _dense_layer(model, layer, hidden, k_work, v_work, tgt, tgt, readable)  # fresh V of all
            dev = (fv.float() - v_work[layer].float()).pow(2).sum(dim=(0, 2))  # [Tc]
            dev[~tgt] = -torch.inf
            order = torch.sort(dev, descending=True, stable=True).indices[: blend[1]]
            chosen = torch.zeros(tc, dtype=torch.bool)
            chosen[order] = True
            fresh_rows = tgt if blend[2] else chosen
            tgt = chosen
            rows[layer + 1 :] = [r & chosen for r in rows[layer + 1 :]]
        out, fk, fv = _dense_layer(model, layer, hidden, k_work, v_work, fresh_rows, tgt, readable | fresh_rows)
        k_work[layer][:, fresh_rows] = fk[:, fresh_rows]
        v_work[layer][:, fresh_rows] = fv[:, fresh_rows]
        hidden = out
    return k_work, v_work


@torch.inference_mode()
def next_token_logits(inp: FusionInput, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Logits [V] after prefilling the suffix over the given context K/V (a plain full-attention DynamicCache)."""
    cache = DynamicCache()
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    tc, s = inp.context_len, int(inp.suffix_ids.shape[0])
    out = inp.model(input_ids=inp.suffix_ids[None], position_ids=torch.arange(tc, tc + s)[None], cache=cache,
                    use_cache=True)
    return out.logits[0, -1].float()


def _method_logits(inp: FusionInput, out: Any) -> torch.Tensor:
    if out.last_logits is not None:
        return out.last_logits
    logits, _ = hf_cache.forward(inp.model, inp.suffix_ids, out.cache, start=inp.context_len)
    return logits[-1]


def _schedule(spec: str, inp: FusionInput) -> tuple[list[torch.Tensor], torch.Tensor | None, Any]:
    """(targets per layer, context U or None, CacheBlend's blend argument) from the method's own selection."""
    method = get_method(spec)
    n_layers = inp.keys.shape[0]
    if isinstance(method, RelaxKV):
        sched, _, _, _ = method.schedule(inp)
        return sched.active, (sched.union if method.context == "anchors" else None), None
    if spec.startswith("prophetkv"):
        scores, _, _ = query_attention_scores(inp, heads="mean", kind="prob")
        return [prophet_select(scores, ~exact_mask(inp), method.r)] * n_layers, None, None  # type: ignore[attr-defined]
    if spec.startswith("epic"):
        return [epic_positions(inp.spans, method.k)] * n_layers, None, None  # type: ignore[attr-defined]
    assert isinstance(method, CacheBlend)
    cand = torch.nonzero(~exact_mask(inp)).flatten()
    k = budget(method.r, int(cand.numel()))
    return [cand] * n_layers, None, (method.check_layer, k, method.check_write == "all")


SPECS = [
    "relaxkv:r=0.3",
    "relaxkv:r=0.15,exact_context=all",
    "relaxkv-fullctx:r=0.3",
    "prophetkv:r=0.3",
    "epic:k=3",
    "cacheblend:r=0.3",
    "cacheblend:r=0.3,check_write=selected",
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", SPECS)
def test_executor_matches_the_dense_reference_at_every_layer(family: str, spec: str) -> None:
    case = fusion_case(family)
    inp = case.fusion_input()
    assert inp.keys.shape[0] == SUITE_LAYERS >= 4
    targets, ctx, blend = _schedule(spec, inp)
    ref_k, ref_v = dense_reference(inp, targets, ctx, blend)
    out = get_method(spec).fuse(case.fusion_input())
    k, v = context_kv(out, inp.context_len)
    for layer in range(k.shape[0]):
        for name, got, want in (("K", k, ref_k), ("V", v, ref_v)):
            err = (got[layer] - want[layer]).abs().amax().item()
            assert err <= ATOL, f"{spec}: layer {layer} {name} differs from the dense reference by {err:.2e} > {ATOL}"
    torch.testing.assert_close(_method_logits(inp, out), next_token_logits(inp, ref_k, ref_v), atol=ATOL, rtol=0)
    # the repair did something: the reference is not just the stale cache
    assert (ref_v - inp.values).abs().amax() > 1e-2


def test_reference_is_not_trivially_close_to_the_executor() -> None:
    """The oracle can fail: dropping the sparse context (full prefix instead of U) or reading stale instead of fresh
    K/V at the same layer moves the result far beyond the tolerance."""
    case = fusion_case("qwen3")
    inp = case.fusion_input()
    targets, ctx, _ = _schedule("relaxkv:r=0.3", inp)
    assert ctx is not None
    out_k, out_v = context_kv(get_method("relaxkv:r=0.3").fuse(case.fusion_input()), inp.context_len)
    wrong_ctx_k, wrong_ctx_v = dense_reference(inp, targets, None)
    assert (out_v - wrong_ctx_v).abs().amax() > 100 * ATOL
    shallow = [targets[0]] + [t[:0] for t in targets[1:]]  # stop after layer 0
    sk, sv = dense_reference(inp, shallow, ctx)
    assert (out_v - sv).abs().amax() > 100 * ATOL


# --- CacheBlend's selective phase and its statistics ---------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_cacheblend_selective_phase_differs_from_full_and_from_stale(family: str) -> None:
    """At 4 layers the layers after the check layer recompute only the selected tokens: the result differs
    measurably from both full and stale there (at 2 layers it silently equalled full)."""
    case: FusionCase = fusion_case(family)
    inp = case.fusion_input()
    k, v = context_kv(get_method("cacheblend:r=0.3").fuse(case.fusion_input()), inp.context_len)
    after = slice(2, None)  # check_layer=1
    assert (v[after] - case.full_values[after]).abs().amax() > 0.05
    assert (v[after] - inp.values[after]).abs().amax() > 0.05
    assert (k[after] - case.full_keys[after]).abs().amax() > 0.05


@pytest.mark.parametrize("check_write", ["all", "selected"])
def test_cacheblend_stats_count_every_state_written(check_write: str) -> None:
    """recomputed_fraction / recomputed_per_layer equal the (layer, token) states whose K/V actually changed,
    measured on a stale cache poisoned with +10 so that any rewrite is visible."""
    case = fusion_case("llama")
    inp = case.fusion_input()
    reusable = inp.reusable_mask
    poisoned = inp.values.clone()
    poisoned[:, :, reusable] += 10.0
    inp.values = poisoned
    out = get_method(f"cacheblend:r=0.3,check_write={check_write}").fuse(inp)
    _, v = context_kv(out, inp.context_len)
    written = ((v - inp.values).abs() > 1.0).any(dim=(1, 3))  # [L, Tc]
    n_layers, tc = written.shape
    assert out.stats.recomputed_per_layer == written.sum(dim=1).tolist()
    assert out.stats.recomputed_fraction == pytest.approx(int(written.sum()) / (n_layers * tc))
    cand, k = int(reusable.sum()), budget(0.3, int(reusable.sum()))
    check = [cand, cand, k, k] if check_write == "all" else [cand, k, k, k]
    assert written.sum(dim=1).tolist() == check
