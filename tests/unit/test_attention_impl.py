"""kvrag_sdpa: transformers' SDPA without repeated K/V heads for masked grouped-query calls, bit-identical; one-token\ncalls through kvrag's row attention where it serves."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvrag.kv import aligned, attention, hf_cache, row_attention
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
    if (q_len == 1 and row_attention.serves(q)) or masked:  # kvrag's kernel (test_row_attention.py) / aligned
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
    torch.testing.assert_close(fast, stock, atol=1e-5, rtol=1e-5)


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
    (1100, 1100, None, (4, 2)),  # causal only
    (700, 1500, 600, (2, 2)),  # a long suffix after 800 cached tokens, no grouping
    (3, 300, None, (4, 2)),  # a short suffix: a group of fewer than MIN_ROWS rows
])
def test_aligned_attention_is_as_accurate_as_one_call(n_q: int, n_k: int, window: int | None,
                                                       heads: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    h, hk = heads
    q = torch.randn(1, h, n_q, 32, generator=g)
    k = torch.randn(1, hk, n_k, 32, generator=g)
    v = torch.randn(1, hk, n_k, 32, generator=g)
    mask = _band(n_q, n_k, window)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hk != h)
    got = attention.aligned_attention(q, k, v, mask, None)
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=2e-6, rtol=1e-5)
    exact = ((q.double() @ k.double().repeat_interleave(h // hk, 1).transpose(-1, -2)) / 32 ** 0.5)
    exact = exact.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(h // hk, 1)
    err_one = (ref.double() - exact).abs().max()
    assert (got.double() - exact.transpose(1, 2)).abs().max() <= 2 * err_one + 1e-7  # as accurate as one call
    if window is None and n_q == n_k:  # a causal prefill without a mask: the same bits as with its mask
        assert torch.equal(attention.aligned_attention(q, k, v, None, None), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 600])
def test_aligned_attention_rows_do_not_depend_on_the_split(dtype: torch.dtype, window: int | None) -> None:
    """A row gets the same bits whether its query comes with the whole prompt or after a prefix of any length: one
    SDPA call does not (the width of its last key block follows the call's extent)."""
    g = torch.Generator().manual_seed(2)
    n = 1400
    q, k, v = (torch.randn(1, h, n, 64, generator=g).to(dtype) for h in (9, 3, 3))
    whole = attention.aligned_attention(q, k, v, _band(n, n, window), None)
    plain_differs = False
    for split in (1, 255, 256, 700, 1300, 1337, 1368, 1397, 1399):
        m = n - split  # queries after a cache of ``split`` positions
        got = attention.aligned_attention(q[:, :, split:], k, v, _band(m, n, window), None)
        assert torch.equal(got, whole[:, split:]), split
        one = torch.nn.functional.scaled_dot_product_attention(q[:, :, split:], k, v, attn_mask=_band(m, n, window),
                                                               enable_gqa=True)
        plain_differs |= not torch.equal(one.transpose(1, 2), whole[:, split:])
    assert plain_differs  # the property is not free: one SDPA call per forward breaks it


def test_aligned_attention_takes_every_multi_row_call() -> None:
    """Masked and causal multi-row calls go through it; a mask that is not [queries, keys] (a padding-only row mask)
    and a one-row call do not."""
    n = 40
    q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    mod = _Module(2).eval()
    seen: list[int] = []
    real = attention.aligned_attention

    def spy(*args: object) -> torch.Tensor:
        seen.append(n)
        return real(*args)  # type: ignore[arg-type]

    attention.aligned_attention = spy  # type: ignore[assignment]
    try:
        ref, _ = sdpa_attention_forward(mod, q, k, v, _band(n, n, 10), scaling=0.25)
        got, _ = attention.gqa_sdpa_attention(mod, q, k, v, _band(n, n, 10), scaling=0.25)
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
        attention.gqa_sdpa_attention(mod, q, k, v, None, scaling=0.25)  # causal prefill without a mask
        assert seen == [n, n]
        padding = torch.ones(1, 1, 1, n, dtype=torch.bool)
        attention.gqa_sdpa_attention(mod, q, k, v, padding, scaling=0.25)
        assert seen == [n, n]
    finally:
        attention.aligned_attention = real  # type: ignore[assignment]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_prompt_prefilled_in_pieces_has_the_bits_of_one_prefill(family: str, dtype: torch.dtype) -> None:
    """What exact conversation and preamble reuse rest on: K/V and logits of a prompt prefilled after a cached
    prefix equal one prefill's, bit for bit, whatever the split (sliding-window layers included). One thread: torch's
    float32 CPU GEMM (MKL) gives other bits for 1-3 rows, and with two threads for some other row counts (5, 10
    measured); its bfloat16 GEMM (oneDNN) for none (docs/architecture.md#conversations)."""
    lm = tiny_model(family, dtype=dtype, **({"sliding_window": 128} if family == "gemma3" else {}))
    n = 700
    ids = torch.randint(3, lm.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits, cache = hf_cache.forward(lm.model, ids, None, start=0, logits_to_keep=1)
        whole = hf_cache.cache_to_tensors(cache)
        for split in (100, 256, 613, 690):
            _, part = hf_cache.forward(lm.model, ids[:split], None, start=0, logits_to_keep=1)
            got, part = hf_cache.forward(lm.model, ids[split:], part, start=split, logits_to_keep=1)
            assert torch.equal(got, logits), split
            for a, b in zip(hf_cache.cache_to_tensors(part), whole, strict=True):
                assert torch.equal(a, b), split
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_after_a_prefix_of_any_length(dtype: torch.dtype) -> None:
    """Every suffix length of 1-256 rows (the last splits of torch's flash attention included, padded_rows)."""
    g = torch.Generator().manual_seed(3)
    n = 512
    q, k, v = (torch.randn(1, h, n, 32, generator=g).to(dtype) for h in (4, 2, 2))
    whole = attention.aligned_attention(q, k, v, None, None)
    bad = [r for r in range(1, 257)
           if not torch.equal(attention.aligned_attention(q[:, :, n - r:], k, v, _band(r, n, None), None), whole[:, n - r:])]
    assert bad == []
    assert [r for r in range(1, 257) if aligned.padded_rows(r) != r] == [1, 2, 3, 33, 34, 35, 65, 66, 67, 97, 98, 99,
                                                                          129, 130, 131, 161, 162, 163, 193, 194, 195]
