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


def _band(n_q: int, n_k: int, window: int | None) -> torch.Tensor:
    """The bool mask of ``n_q`` new tokens after ``n_k - n_q`` cached ones, causal, within ``window`` if given."""
    rows = torch.arange(n_q)[:, None] + n_k - n_q
    cols = torch.arange(n_k)[None, :]
    keep = cols <= rows
    if window is not None:
        keep &= rows - cols < window
    return keep.view(1, 1, n_q, n_k)


@pytest.mark.parametrize(("n_q", "n_k", "window", "heads"), [
    (1100, 1100, 300, (4, 1)),  # a prefill through sliding-window layers (Gemma 3's 1 K/V head)
    (1100, 1100, None, (4, 2)),  # causal only: every block keeps keys 0.. its last row
    (700, 1500, 600, (2, 2)),  # a long suffix after 800 cached tokens, no grouping
])
def test_banded_attention_equals_one_call(n_q: int, n_k: int, window: int | None, heads: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    h, hk = heads
    q = torch.randn(1, h, n_q, 32, generator=g)
    k = torch.randn(1, hk, n_k, 32, generator=g)
    v = torch.randn(1, hk, n_k, 32, generator=g)
    mask = _band(n_q, n_k, window)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hk != h)
    got = attention.banded_attention(q, k, v, mask, None)
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=2e-6, rtol=1e-5)
    exact = ((q.double() @ k.double().repeat_interleave(h // hk, 1).transpose(-1, -2)) / 32 ** 0.5)
    exact = exact.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(h // hk, 1)
    err_one = (ref.double() - exact).abs().max()
    assert (got.double() - exact.transpose(1, 2)).abs().max() <= 2 * err_one + 1e-7  # as accurate as one call


def test_banded_attention_takes_every_long_masked_call() -> None:
    """Long masked calls go through it; a mask that is not [queries, keys] (a padding-only row mask) does not."""
    n = attention.BAND_MIN_QUERIES
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    mod = _Module(2).eval()
    seen: list[int] = []
    real = attention.banded_attention

    def spy(*args: object) -> torch.Tensor:
        seen.append(n)
        return real(*args)  # type: ignore[arg-type]

    attention.banded_attention = spy  # type: ignore[assignment]
    try:
        ref, _ = sdpa_attention_forward(mod, q, k, v, _band(n, n, 100), scaling=0.25)
        got, _ = attention.gqa_sdpa_attention(mod, q, k, v, _band(n, n, 100), scaling=0.25)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        assert seen == [n]
        padding = torch.ones(1, 1, 1, n, dtype=torch.bool)
        attention.gqa_sdpa_attention(mod, q, k, v, padding, scaling=0.25)
        assert seen == [n]
    finally:
        attention.banded_attention = real  # type: ignore[assignment]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_model_long_prompt_generate_and_cache(family: str) -> None:
    """A prompt past BAND_MIN_QUERIES through sliding-window layers: the banded prefill's logits and K/V match
    one-call attention's."""
    lm = tiny_model(family, sliding_window=128)
    n = attention.BAND_MIN_QUERIES + 100
    ids = torch.randint(3, lm.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    banded, cache_b = hf_cache.forward(lm.model, ids, None, start=0, logits_to_keep=4)
    low = attention.BAND_MIN_QUERIES
    attention.BAND_MIN_QUERIES = 10**9
    try:
        one, cache_o = hf_cache.forward(lm.model, ids, None, start=0, logits_to_keep=4)
    finally:
        attention.BAND_MIN_QUERIES = low
    torch.testing.assert_close(banded, one, atol=1e-4, rtol=1e-4)
    for a, b in zip(hf_cache.cache_to_tensors(cache_b), hf_cache.cache_to_tensors(cache_o), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
