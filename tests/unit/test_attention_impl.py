"""kvrag_sdpa: transformers' SDPA without repeated K/V heads for masked grouped-query calls, bit-identical; one-token\ncalls through kvrag's row attention where it serves."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvrag.kv import attention, hf_cache, row_attention
from kvrag_testing.tiny import NUM_HEADS, NUM_KV_HEADS, tiny_model


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize(("q_len", "masked"), [(7, True), (1, True), (7, False)])
def test_same_output_as_transformers_sdpa(q_len: int, masked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    h, hk, d, kv_len = 6, 2, 16, 40
    q = torch.randn(1, h, q_len, d, generator=g)
    k = torch.randn(1, hk, kv_len, d, generator=g)
    v = torch.randn(1, hk, kv_len, d, generator=g)
    mask = None
    if masked:  # the causal mask of q_len new tokens after kv_len - q_len cached ones (what a suffix prefill gets)
        mask = (torch.arange(q_len)[:, None] + kv_len - q_len >= torch.arange(kv_len)[None, :]).view(1, 1, q_len, kv_len)
    mod = _Module(h // hk).eval()
    ref, _ = sdpa_attention_forward(mod, q, k, v, mask, scaling=d ** -0.5)
    got, _ = attention.gqa_sdpa_attention(mod, q, k, v, mask, scaling=d ** -0.5)
    assert got.shape == ref.shape == (1, q_len, h, d)
    if q_len == 1 and row_attention.serves(q):  # one-token calls: kvrag's kernel (tests/unit/test_row_attention.py)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    else:
        assert torch.equal(got, ref)


def test_loaded_models_use_it_and_forwards_are_unchanged() -> None:
    assert NUM_HEADS > NUM_KV_HEADS  # the tiny models are grouped-query, so the fast path is exercised
    lm = tiny_model("qwen2")
    assert lm.model.config._attn_implementation == attention.IMPL
    ids = torch.arange(3, 40)
    _, cache = hf_cache.forward(lm.model, ids[:30], None, start=0)
    fast, _ = hf_cache.forward(lm.model, ids[30:], cache, start=30, logits_to_keep=7)  # masked GQA call
    lm.model.config._attn_implementation = "sdpa"
    try:
        _, cache = hf_cache.forward(lm.model, ids[:30], None, start=0)
        stock, _ = hf_cache.forward(lm.model, ids[30:], cache, start=30, logits_to_keep=7)
    finally:
        lm.model.config._attn_implementation = attention.IMPL
    assert torch.equal(fast, stock)


def test_other_implementations_are_left_alone() -> None:
    lm = tiny_model("llama")
    lm.model.config._attn_implementation = "eager"
    try:
        assert attention.use_gqa_sdpa(lm.model) is False
        assert lm.model.config._attn_implementation == "eager"
    finally:
        lm.model.config._attn_implementation = attention.IMPL
    assert attention.use_gqa_sdpa(lm.model) is False  # already switched: nothing to do
