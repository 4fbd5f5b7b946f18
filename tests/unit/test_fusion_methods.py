"""Fusion methods on tiny random models: the standard suite for every built-in method, recompute-all equivalence
for the variants, parameter validation, the selective-recompute executor and the scoring pass."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrag.errors import ConfigError
from kvrag.fusion import get_method
from kvrag.fusion.recompute import budget, selective_recompute
from kvrag.fusion.scoring import query_attention_scores
from kvrag.kv import hf_cache
from kvrag.kv.attention import IMPL as GQA_SDPA
from kvrag_bench.ablations import register_ablations
from kvrag_testing.fusion_suite import (
    RECOMPUTE_ALL_ATOL,
    FusionCase,
    FusionMethodTests,
    check_suffix_fold,
    context_kv,
    fusion_case,
    greedy_tokens,
)
from kvrag_testing.tiny import FAMILIES

register_ablations()  # relaxkv-fullctx (the full-prefix control) is tested here

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the standard suite -----------------------------------------------------------------------------------------


class TestFull(FusionMethodTests):
    """``full`` against the suite's oracle: one plain transformers forward under eager attention (the case's
    ``full_keys`` / ``full_tokens`` are not computed by ``full``), so this is not ``full`` compared with itself."""

    method_spec = "full"
    recompute_all_spec = "full"


class TestStale(FusionMethodTests):
    method_spec = "stale"


class TestRelaxKV(FusionMethodTests):
    method_spec = "relaxkv:r=0.3"
    recompute_all_spec = "relaxkv:r=1.0"


class TestRelaxKVFullContext(FusionMethodTests):
    method_spec = "relaxkv-fullctx:r=0.3"
    recompute_all_spec = "relaxkv-fullctx:r=1.0"


class TestCacheBlend(FusionMethodTests):
    method_spec = "cacheblend:r=0.3"
    recompute_all_spec = "cacheblend:r=1.0"


class TestEpic(FusionMethodTests):
    method_spec = "epic:k=4"
    recompute_all_spec = "epic:k=1000"


class TestProphetKV(FusionMethodTests):
    method_spec = "prophetkv:r=0.3"
    recompute_all_spec = "prophetkv:r=1.0"


# --- recompute-all for the non-default variants (two families: one with q/k norms) ------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "spec",
    [
        "relaxkv:r=1.0,exact_context=all",
        "relaxkv:r=1.0,agg=max,score=logit",
        "cacheblend:r=1.0,deviation=k,check_write=selected",
    ],
)
def test_recompute_all_variants_equal_full(family: str, spec: str) -> None:
    case = fusion_case(family)
    inp = case.fusion_input()
    out = get_method(spec).fuse(inp)
    k, v = context_kv(out, inp.context_len)
    torch.testing.assert_close(k, case.full_keys, atol=RECOMPUTE_ALL_ATOL, rtol=0)
    torch.testing.assert_close(v, case.full_values, atol=RECOMPUTE_ALL_ATOL, rtol=0)
    assert greedy_tokens(inp, out, 4) == case.full_tokens


# --- parameters ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "relaxkv:r=0",
        "relaxkv:r=-0.1",
        "relaxkv:r=1.5",
        "relaxkv:r=nan",
        "relaxkv:context=sparse",
        "relaxkv:agg=sum",
        "relaxkv:score=entropy",
        "relaxkv:exact_context=none",
        "relaxkv-fullctx:r=0",
        "cacheblend:r=0",
        "cacheblend:r=1.01",
        "cacheblend:check_layer=0",
        "cacheblend:deviation=kv",
        "cacheblend:check_write=none",
        "epic:k=-1",
        "epic:k=two",
        "prophetkv:r=0",
        "prophetkv:r=2",
        "prophetkv:bogus=1",
    ],
)
def test_out_of_range_parameters_raise_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        get_method(spec)


def test_ablations_are_not_user_methods() -> None:
    """``relaxkv-fullctx`` (an ablation control) is neither listed nor resolved until registered explicitly."""
    import subprocess
    import sys

    code = ("import kvrag.fusion as f\n"
            "from kvrag.errors import ConfigError\n"
            "assert 'relaxkv-fullctx' not in f.available_methods()\n"
            "try:\n    f.get_method('relaxkv-fullctx')\nexcept ConfigError as e:\n    print(e)\n"
            "from kvrag_bench.ablations import register_ablations\n"
            "assert register_ablations() == ['relaxkv-fullctx']\n"
            "assert 'relaxkv-fullctx' in f.available_methods() and f.get_method('relaxkv-fullctx').context == 'full'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "unknown fusion method 'relaxkv-fullctx'" in out.stdout and "register_ablations()" in out.stdout
    with pytest.raises(ConfigError) as e:  # a plain typo (or a client of kvrag serve) is not told about kvrag_bench
        get_method("fastest")
    assert "kvrag_bench" not in str(e.value) and "valid methods" in str(e.value)


def test_defaults_and_alias() -> None:
    assert get_method("relaxkv").config == {
        "r": 0.15,
        "context": "anchors",
        "agg": "mean",
        "score": "prob",
        "exclude_first_chunk": False,
        "exact_context": "anchors",
    }
    assert get_method("relaxkv-fullctx").context == "full"  # type: ignore[attr-defined]
    assert get_method("cacheblend").r == 0.15  # type: ignore[attr-defined]
    assert get_method("epic").k == 16  # type: ignore[attr-defined]
    assert get_method("prophetkv").r == 0.20  # type: ignore[attr-defined]
    assert get_method("relaxkv:exclude_first_chunk=false").exclude_first_chunk is False  # type: ignore[attr-defined]


def test_cacheblend_check_layer_beyond_the_model() -> None:
    case = fusion_case("llama")
    with pytest.raises(ConfigError, match="check_layer"):
        get_method("cacheblend:check_layer=4").fuse(case.fusion_input())  # the suite's models have 4 layers


# --- method behaviour ---------------------------------------------------------------------------------------------


def _rel_err(case: FusionCase, out: Any, tc: int) -> float:
    k, v = context_kv(out, tc)
    ek = ((k - case.full_keys).norm() / case.full_keys.norm()).item()
    ev = ((v - case.full_values).norm() / case.full_values.norm()).item()
    return ek + ev


@pytest.mark.parametrize("family", FAMILIES)
def test_moderate_ratio_is_not_worse_than_stale(family: str) -> None:
    """Loose sanity check on random weights, not a quality claim.

    Methods whose targets attend to their full causal prefix only replace stale states by states computed from
    more (fresher) information, so at r = 0.3 their KV must not be further from ``full`` than ``stale``; they pass
    with margin here. RelaxKV's sparse context drops every position outside U from a target's attention, which on
    these random models (attention spread over many keys, no sinks) can make a target worse than its stale state:
    on the former 2-layer, init-std 0.02 Llama its relative KV error was 2.15 vs stale's 2.08 (on the suite's 4-layer,
    std 0.1 models it is 1.65 vs 2.06). It gets a 10% allowance, and that observation
    is the reason the sparse-context choice must be measured on real models.
    """
    case = fusion_case(family)
    inp = case.fusion_input()
    stale = _rel_err(case, get_method("stale").fuse(inp), inp.context_len)
    allowance = {"relaxkv:r=0.3": 1.10}
    for spec in ("relaxkv:r=0.3", "relaxkv-fullctx:r=0.3", "cacheblend:r=0.3", "epic:k=4", "prophetkv:r=0.3"):
        err = _rel_err(case, get_method(spec).fuse(case.fusion_input()), inp.context_len)
        assert err <= stale * allowance.get(spec, 1.0), f"{spec}: KV error {err:.4f} > stale {stale:.4f}"


def test_relaxkv_stats_and_context_restriction() -> None:
    case = fusion_case("qwen3")
    inp = case.fusion_input()
    sparse = get_method("relaxkv:r=0.3").fuse(inp).stats
    full_ctx = get_method("relaxkv-fullctx:r=0.3").fuse(inp).stats
    assert sparse.anchors_per_layer == budget(0.3, inp.context_len) == 13
    assert sparse.recomputed_per_layer == full_ctx.recomputed_per_layer  # same targets
    assert sparse.recomputed_per_layer == sorted(sparse.recomputed_per_layer, reverse=True)
    assert 0 < sparse.context_fraction < 1 and full_ctx.context_fraction == 1.0
    assert sparse.attention_edges_ratio < full_ctx.attention_edges_ratio < 1.0
    for key in ("recomputed_fraction", "context_fraction", "attention_edges_ratio", "score_s", "recompute_s"):
        assert getattr(sparse, key) is not None and key in sparse.to_dict()


def test_untargeted_positions_keep_their_stale_kv() -> None:
    case = fusion_case("qwen2")
    inp = case.fusion_input()
    for spec in ("relaxkv:r=0.3", "prophetkv:r=0.3", "epic:k=4", "cacheblend:r=0.3,check_write=selected"):
        out = get_method(spec).fuse(inp)
        k, v = context_kv(out, inp.context_len)
        changed = (k != inp.keys).any(dim=(1, 3)) | (v != inp.values).any(dim=(1, 3))  # [L, Tc]
        assert not changed[:, :6].any(), spec  # the exact prefix is never rewritten
        per_layer = out.stats.recomputed_per_layer
        assert all(int(changed[layer].sum()) <= per_layer[layer] for layer in range(len(per_layer))), spec


def test_cacheblend_check_write_all_refreshes_every_token_at_the_check_layer() -> None:
    case = fusion_case("llama")
    inp = case.fusion_input()
    out = get_method("cacheblend:r=0.3").fuse(inp)
    k, v = context_kv(out, inp.context_len)
    torch.testing.assert_close(v[:2], case.full_values[:2], atol=1e-4, rtol=0)  # layers 0 and 1: fresh everywhere
    changed = (v != inp.values).any(dim=(1, 3))  # [L, Tc]
    assert changed[2:].sum(dim=1).tolist() == [11, 11]  # after the check layer: only the selected tokens
    assert out.stats.recomputed_per_layer == [37, 37, 11, 11]  # the check layer's writes counted


# --- the executor ---------------------------------------------------------------------------------------------------


def test_selective_recompute_rejects_non_nested_targets() -> None:
    case = fusion_case("llama")
    inp = case.fusion_input()
    with pytest.raises(ValueError, match="nested"):
        targets = [torch.tensor([7]), torch.tensor([8]), torch.tensor([8]), torch.tensor([8])]
        selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, targets)


def test_selective_recompute_block_size_does_not_change_the_result() -> None:
    case = fusion_case("mistral")
    inp = case.fusion_input()
    tgt = torch.arange(6, inp.context_len)
    u = torch.tensor([0, 3, 8, 12, 20, 25, 30, 41])
    plan = [tgt, tgt[::2], tgt[::2], tgt[::4]]
    a = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, plan, u, block_size=4096)
    b = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, plan, u, block_size=5)
    torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)
    assert a.edges == b.edges and a.states == b.states == sum(len(t) for t in plan)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sparse", [False, True])
def test_prefix_executor_equals_the_layer_reference(family: str, sparse: bool) -> None:
    """One layer call per layer with blocked prefix attention == one layer call per target block over a gathered
    context (dense bias): same K/V, same useful edges, fewer computed pairs."""
    case = fusion_case(family)
    inp = case.fusion_input()
    tgt = torch.arange(3, inp.context_len)
    u = torch.tensor([0, 3, 8, 12, 20, 25, 30, 41]) if sparse else None
    plan = [tgt, tgt[::2], tgt[::2], tgt[::4]]
    ref = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, plan, u, executor="layer")
    for rows in (5, 32, 4096):
        out = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, plan, u, executor="prefix",
                                  block_size=rows)
        torch.testing.assert_close(out.keys, ref.keys, atol=2e-5, rtol=0)
        torch.testing.assert_close(out.values, ref.values, atol=2e-5, rtol=0)
        assert out.edges == ref.edges and out.states == ref.states
        assert out.edges <= out.computed_edges <= ref.computed_edges
    assert out.computed_edges == ref.computed_edges or rows == 4096  # one block: the same dense rectangle


def test_prefix_executor_refuses_special_attention() -> None:
    case = fusion_case("llama")
    inp = case.fusion_input()
    attn = hf_cache.decoder_layers(inp.model)[0].self_attn
    attn.sliding_window = 8
    try:
        with pytest.raises(ValueError, match="plain softmax attention"):
            selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, [torch.tensor([9])] * 4,
                                executor="prefix")
        res = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, [torch.tensor([9])] * 4)
        assert res.states == 4  # 'auto' fell back to the layer executor
    finally:
        del attn.sliding_window


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["epic:k=3", "prophetkv:r=0.3", "relaxkv-fullctx:r=0.3"])
def test_suffix_fold_equals_the_separate_suffix_prefill(family: str, spec: str) -> None:
    """Full-context methods on the engine's zero-copy input prefill the suffix inside the recompute: cache and
    logits equal repairing first and prefilling the suffix afterwards (``hybrid``: tests/unit/test_cacherepair.py)."""
    check_suffix_fold(fusion_case(family), spec)


def test_suffix_ids_need_full_context_and_room() -> None:
    case = fusion_case("qwen2")
    inp = case.fusion_input()
    tgt = [torch.tensor([9])] * 4
    with pytest.raises(ValueError, match="full causal context"):
        selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, tgt, torch.tensor([0, 9]),
                            suffix_ids=inp.suffix_ids)
    with pytest.raises(ValueError, match="must hold"):
        selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, tgt, suffix_ids=inp.suffix_ids)


def test_sparse_context_reads_only_u() -> None:
    """With context U, stale K/V outside U (and outside the targets) cannot influence the repair; with the full
    causal prefix they do."""
    case = fusion_case("qwen3")
    inp = case.fusion_input()
    tgt = torch.tensor([10, 14, 20, 30])
    u = torch.tensor([0, 2, 10, 14, 16, 20, 30])
    outside = torch.tensor([p for p in range(inp.context_len) if p not in set(u.tolist())])
    noisy_k, noisy_v = inp.keys.clone(), inp.values.clone()
    noisy_k[:, :, outside] += 1.0
    noisy_v[:, :, outside] -= 1.0
    for ctx, same in ((u, True), (None, False)):
        a = selective_recompute(inp.model, inp.token_ids, inp.keys, inp.values, [tgt] * 4, ctx)
        b = selective_recompute(inp.model, inp.token_ids, noisy_k, noisy_v, [tgt] * 4, ctx)
        assert torch.allclose(a.keys[:, :, tgt], b.keys[:, :, tgt], atol=1e-6) is same
        assert torch.allclose(a.values[1][:, tgt], b.values[1][:, tgt], atol=1e-6) is same


# --- transformers helpers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_scoring_pass_matches_eager_attention(family: str) -> None:
    """The captured post-RoPE (post q-norm) queries give the same context attention as the model's own eager
    attention over the stale cache (renormalised over the context columns), for every family."""
    case = fusion_case(family)
    inp = case.fusion_input()
    model = case.model
    scores, edges, _ = query_attention_scores(inp)
    assert model.config._attn_implementation == GQA_SDPA  # restored after the capture
    saved = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        cache = hf_cache.make_cache(inp.keys, inp.values, model.config)
        tc, s = inp.context_len, int(inp.suffix_ids.shape[0])
        out = model(
            input_ids=inp.suffix_ids.view(1, -1),
            position_ids=torch.arange(tc, tc + s).view(1, -1),
            cache=cache,
            output_attentions=True,
        )
    finally:
        model.config._attn_implementation = saved
    for layer, att in enumerate(out.attentions):
        a = att[0, :, :, :tc].float()  # [H, S, Tc]
        ref = (a / a.sum(-1, keepdim=True)).mean(dim=(0, 1))
        torch.testing.assert_close(scores[layer], ref, atol=1e-5, rtol=1e-4)
    # pairs the pass computed: one dense [S, Tc + S] logit block per layer (the masked suffix pairs included)
    assert edges == len(out.attentions) * s * (tc + s)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_project_kv_equals_run_layer_kv_and_capture_is_transparent(family: str) -> None:
    case = fusion_case(family)
    inp = case.fusion_input()
    model = case.model
    pos = torch.arange(6, 12)
    hidden = hf_cache.embed(model, inp.token_ids[pos])
    mask = torch.cat([torch.ones(6, 6, dtype=torch.bool), torch.tril(torch.ones(6, 6, dtype=torch.bool))], dim=1)
    ctx_k, ctx_v = inp.keys[1][:, :6], inp.values[1][:, :6]
    h, fk, fv = hf_cache.run_layer(model, 1, hidden, pos, ctx_k, ctx_v, mask)
    pk, pv = hf_cache.project_kv(model, 1, hidden, pos)
    torch.testing.assert_close(pk, fk, atol=1e-6, rtol=0)
    torch.testing.assert_close(pv, fv, atol=1e-6, rtol=0)
    seen: list[tuple[int, tuple[int, ...]]] = []
    with hf_cache.capture_attention(model, lambda mod, q, k, m, sc: seen.append((mod.layer_idx, tuple(q.shape)))):
        h2, _, _ = hf_cache.run_layer(model, 1, hidden, pos, ctx_k, ctx_v, mask)
    torch.testing.assert_close(h2, h, atol=1e-6, rtol=0)
    assert seen == [(1, (1, 4, 6, 16))]
    assert model.config._attn_implementation == GQA_SDPA


def test_bfloat16_model_keeps_dtype_and_recompute_all_is_close() -> None:
    """bf16 end to end (scoring in fp32, recompute in the model dtype): dtype kept, r = 1 within bf16 noise."""
    from kvrag.engine.assemble import assemble
    from kvrag.kv.compute import compute_chunk_kv
    from kvrag.kv.rope import Rope
    from kvrag_testing.fusion_suite import LAYOUT
    from kvrag_testing.tiny import tiny_model

    lm = tiny_model("qwen3", dtype=torch.bfloat16)
    model, spec = lm.model, lm.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(0)
    pieces = [
        (kind, compute_chunk_kv(model, rope, spec, torch.randint(5, 256, (n,), generator=g).tolist()), None)
        for kind, n in LAYOUT
    ]
    suffix = torch.randint(5, 256, (7,), generator=g)
    inp = assemble(model, rope, spec, pieces, suffix)
    fk, fv = context_kv(get_method("full").fuse(inp), inp.context_len)
    for spec_ in ("relaxkv:r=1.0", "prophetkv:r=1.0", "cacheblend:r=1.0"):
        k, v = context_kv(get_method(spec_).fuse(assemble(model, rope, spec, pieces, suffix)), inp.context_len)
        assert k.dtype == v.dtype == torch.bfloat16
        assert (k.float() - fk.float()).abs().max() < 0.1 and (v.float() - fv.float()).abs().max() < 0.1
