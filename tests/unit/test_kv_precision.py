"""K/V at the precision decode needs (``EngineConfig.kv_dtype``): the row kernel's float32 queries over bfloat16
K/V are its float32 path over the widened K/V, bit for bit; the fused step and the model's own forward write and
read bfloat16 rows alike; bfloat16 K/V moves a float32 model's logits by a bounded amount; the engine decodes in
it, accounts for its bytes and hands back a cache in the model's dtype."""

from __future__ import annotations

import math

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.kv import batched, hf_cache, row_attention, step_backend
from kvrag.prompting import RagTemplate
from kvrag.store import MemoryStore
from kvrag_testing.rows import DOCS, assert_fused_is_the_models_forward, drift, narrowed, paired_rows
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _need() -> None:
    why = row_attention.why_not(torch.float32, torch.bfloat16)
    if why is not None:
        pytest.skip(f"kvrag's row attention does not serve float32 over bfloat16 K/V here: {why}")


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(6, 2, 64), (4, 4, 128), (9, 3, 64), (8, 2, 32)])
def test_bf16_kv_kernel_is_the_float32_kernel_on_the_widened_kv(heads: int, kv_heads: int, d: int) -> None:
    """Queries in float32 over bfloat16 K/V: the bits of the float32 path over the same K/V widened to float32
    (torch's ``.float()``), and within float32 rounding of float64 attention over them."""
    _need()
    gen = torch.Generator().manual_seed(1)
    lengths = (1, 3, 17, 64, 301)
    q = torch.randn(1, heads, len(lengths), d, generator=gen)
    keys = [(torch.randn(kv_heads, n + 5, d, generator=gen).bfloat16(),
             torch.randn(kv_heads, n + 5, d, generator=gen).bfloat16(), 3, n + 3) for n in lengths]
    out = torch.empty(1, len(lengths), heads, d)
    row_attention.attend(q, keys, out, None)
    wide = torch.empty_like(out)
    row_attention.attend(q, [(k.float(), v.float(), a, b) for k, v, a, b in keys], wide, None)
    assert torch.equal(out, wide)
    for i, (k, v, a, b) in enumerate(keys):
        ref = row_attention.reference(q[0, :, i], k[:, a:b], v[:, a:b], 1 / math.sqrt(d))
        assert (out[0, i].double() - ref).abs().max().item() < 1e-5


def test_mixed_kv_dtypes_in_one_call_are_refused() -> None:
    _need()
    q = torch.randn(1, 2, 2, 64)
    k32, k16 = torch.randn(2, 4, 64), torch.randn(2, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="beside"):
        row_attention.attend(q, [(k16, k16, 0, 4), (k32, k32, 0, 4)], torch.empty(1, 2, 2, 64), None)


@pytest.mark.parametrize(("family", "quantize", "window"), [
    ("llama", None, None), ("qwen3", "int4", None), ("gemma3", None, 8), ("smollm3", None, None),
    ("mistral", "int8", 40),
])
def test_fused_step_over_bf16_rows_is_the_models_forward(family: str, quantize: str | None,
                                                         window: int | None) -> None:
    """A float32 model's rows holding bfloat16 K/V: plain and verify steps through the fused step and through the
    model's own forward (which writes its fresh K/V into the rows by torch's rounding) give the same logits and
    write the same K/V, bit for bit."""
    _need()
    lm = tiny_model(family, init_std=0.1, quantize=quantize, sliding_window=window,
                    num_layers=4 if family == "smollm3" else 2)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 12)
    a, b = narrowed(a, torch.bfloat16), narrowed(b, torch.bfloat16)
    assert a[0].buffer.keys.dtype == torch.bfloat16
    assert_fused_is_the_models_forward(lm.model, a, b, toks)


BF16_KV_LOGIT_BOUND = 0.05
"""Largest |logit| change bfloat16 K/V may cause on the tiny llama below (init std 0.1, 3 rows, 8 decode steps):
0.0072 measured (next-token KL 3.2e-6), the bound ~7x that."""


def test_bf16_kv_moves_float32_logits_by_a_bounded_amount() -> None:
    """Decoding the same tokens over float32 and over bfloat16 copies of the same K/V: logits within the measured
    bound, next-token distributions within a small KL, and not identical (the rounding is real)."""
    _need()
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 12)
    worst, kl, same = drift(lm.model, a, narrowed(b, torch.bfloat16), toks)
    assert not same
    assert worst < BF16_KV_LOGIT_BOUND
    assert kl < 1e-4


def test_engine_decodes_over_bf16_kv_and_accounts_for_its_bytes() -> None:
    """kv_dtype="bfloat16" on a float32 model: half the budget's bytes per token; greedy answers of the first
    tokens equal float32 K/V's on this model (its margins are wide); the cache handed back after the stream is in the
    model's dtype and covers the answer."""
    _need()
    lm = tiny_model("llama", init_std=0.1)
    wide = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    narrow = KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="bfloat16"))
    assert narrow.runner.budget.bytes_per_token * 2 == wide.runner.budget.bytes_per_token
    assert KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="float32")).runner.budget.bytes_per_token == (
        wide.runner.budget.bytes_per_token)
    gen = GenerationConfig(max_new_tokens=6)
    answers = []
    for eng in (wide, narrow):
        eng.ingest(DOCS)
        plan = eng.plan(RagTemplate().render(eng.tokenizer, DOCS, "What is the capital of France?"), DOCS)
        prep = eng.prepare(plan, "stale", reserve=gen.max_new_tokens)
        # the prompt's float32 buffer holds the answer's room only where decode writes into it
        assert hf_cache.buffer_of(prep.cache)[0].capacity == plan.total_len + (0 if eng is narrow else 6)
        text = "".join(eng.stream(prep, gen))
        keys, _ = hf_cache.cache_to_tensors(prep.cache)
        assert keys.dtype == torch.float32
        assert keys.shape[2] >= len(prep.token_ids)
        answers.append((text, list(prep.token_ids)))
    assert answers[0] == answers[1]


def test_kv_dtype_setting_is_checked() -> None:
    with pytest.raises(ConfigError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int3")
    lm = tiny_model("llama", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="kv_dtype='auto'"):
        KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="float32"))
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="bfloat16"))  # the model's own dtype
    assert eng.runner.kv_dtype == torch.bfloat16


def test_for_decode_keeps_the_prompt_and_makes_room() -> None:
    buf = hf_cache.KVBuffer(2, 3, 8, 5, torch.float32, "cpu")
    buf.keys.normal_()
    buf.values.normal_()
    same = batched.Row.for_decode(buf, 4, 9)
    assert same.buffer is buf and buf.capacity >= 9 and same.length == 4
    low = batched.Row.for_decode(buf, 4, 9, torch.bfloat16).buffer
    assert low.capacity == 9 and low.keys.dtype == torch.bfloat16
    assert torch.equal(low.keys[:, :, :4], buf.keys[:, :, :4].bfloat16())
    assert torch.equal(low.values[:, :, :4], buf.values[:, :, :4].bfloat16())
    back, _ = hf_cache.cache_to_tensors(batched.Row(low, 4).cache(torch.float32))
    assert back.dtype == torch.float32 and torch.equal(back, low.keys[:, :, :4].float())


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.int8])
def test_torch_attention_reads_narrow_rows_widened(monkeypatch: pytest.MonkeyPatch, kv: torch.dtype) -> None:
    """Where kvrag's kernel does not serve, torch's SDPA reads the bfloat16 rows widened (int8 rows de-quantized)
    to the queries' dtype: the same logits as the kernel's up to float32 summation order."""
    why = row_attention.why_not(torch.float32, kv)
    if why is not None:
        pytest.skip(f"kvrag's row attention does not serve float32 over {kv} K/V here: {why}")
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    a, b = narrowed(a, kv), narrowed(b, kv)
    wins = batched.windows(lm.model)
    step_backend.choose(lm.model, "decode", "hf")
    try:
        ref = batched.decode_step(lm.model, a, toks, wins)
        monkeypatch.setattr(row_attention, "serves", lambda *_: False)
        got = batched.decode_step(lm.model, b, toks, wins)
    finally:
        step_backend.choose(lm.model, "decode", None)
    assert (got - ref).abs().max().item() < 1e-4
