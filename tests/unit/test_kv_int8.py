"""int8 K/V for decode (``EngineConfig.kv_dtype="int8"``, :mod:`kvrag.kv.int8kv`): the layout's torch reference,
the row kernel over it against float64 attention over the de-quantized K/V, the fused step's C writes against the
model's own forward (torch's quantization) bit for bit, the logits' bounded change, and the engine's accounting."""

from __future__ import annotations

import math

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.kv import batched, hf_cache, int8kv, row_attention
from kvrag.prompting import RagTemplate
from kvrag.store import MemoryStore
from kvrag_testing.rows import DOCS, assert_fused_is_the_models_forward, drift, narrowed, paired_rows
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _need(dtype: torch.dtype = torch.float32) -> None:
    why = row_attention.why_not(dtype, torch.int8)
    if why is not None:
        pytest.skip(f"kvrag's row attention does not serve {dtype} over int8 K/V here: {why}")


def test_group_layout() -> None:
    """Heads of 64: two groups of 32, each its own scale (a large channel in one group leaves the other's steps
    fine); heads of 16 (not a multiple of 32): one group."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    x[:, 5] = 40.0
    q = int8kv.quantize(x)
    assert q.shape == (3, 72) and int8kv.width(64, torch.int8) == 72
    scale = q[:, 64:].contiguous().view(torch.float32)
    assert torch.equal(scale[:, 0], x[:, :32].abs().amax(-1) / 127)
    assert torch.equal(scale[:, 1], x[:, 32:].abs().amax(-1) / 127)
    back = int8kv.dequantize(q, 64)
    assert ((back[:, 32:] - x[:, 32:]).abs() <= scale[:, 1:] * 0.5 + 1e-7).all()
    assert int8kv.group(16) == 16 and int8kv.group(256) == 32 and int8kv.width(256, torch.int8) == 288


def test_a_buffer_keeps_its_head_dim_where_widths_coincide() -> None:
    """Heads of 160 (five groups) and of 176 (one group: not a multiple of 32) both take 180 bytes a position; an
    int8 buffer keeps the head dim it was made with, and the cache handed back de-quantizes with it."""
    assert int8kv.width(160, torch.int8) == int8kv.width(176, torch.int8) == 180
    for d in (160, 176):
        src = hf_cache.KVBuffer(1, 1, d, 3, torch.float32, "cpu")
        src.keys.normal_()
        src.values.normal_()
        row = batched.Row.for_decode(src, 3, 3, torch.int8)
        assert row.buffer.head_dim == d
        back, _ = hf_cache.cache_to_tensors(row.cache(torch.float32))
        assert back.shape[-1] == d and torch.equal(back, int8kv.dequantize(int8kv.quantize(src.keys[:, :, :3]), d))
    with pytest.raises(ValueError, match="for heads of 64"):
        int8kv.dequantize(torch.zeros(2, 20, dtype=torch.int8), 64)


def test_quantize_layout_and_round_trip() -> None:
    """A position is its int8 values then its float32 scale (max |x| / 127); de-quantized within half a step; an
    all-zero position keeps scale 1 and zeros; the largest value maps to +-127 exactly."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=gen)
    x[1, 2, 4] = 0.0
    q = int8kv.quantize(x)
    assert q.dtype == torch.int8 and q.shape == (2, 3, 5, 20)
    scale = q[..., 16:].contiguous().view(torch.float32)
    assert torch.equal(scale[0, 0, 0], x[0, 0, 0].abs().amax(-1, keepdim=True) / 127)
    assert scale[1, 2, 4].item() == 1.0 and not q[1, 2, 4, :16].any()
    assert q[..., :16].abs().amax(-1)[0].eq(127).all()
    back = int8kv.dequantize(q, 16)
    assert back.shape == x.shape
    assert ((back - x).abs() <= scale * 0.5 + 1e-7).all()
    assert int8kv.width(16, torch.int8) == 20 and int8kv.width(16, torch.bfloat16) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(6, 2, 64), (9, 3, 64), (8, 2, 128), (4, 1, 256), (4, 4, 16)])
def test_int8_kernel_against_float64_over_the_dequantized_kv(dtype: torch.dtype, heads: int, kv_heads: int,
                                                             d: int) -> None:
    """Queries in float32 / bfloat16 over int8 K/V: within float32 rounding (bfloat16: the output's rounding) of
    float64 attention over the de-quantized K/V; a query alone gets the bits it gets among others."""
    _need(dtype)
    gen = torch.Generator().manual_seed(1)
    lengths = (1, 3, 17, 64, 301)
    q = torch.randn(1, heads, len(lengths), d, generator=gen).to(dtype)
    keys = [(int8kv.quantize(torch.randn(kv_heads, n + 5, d, generator=gen)),
             int8kv.quantize(torch.randn(kv_heads, n + 5, d, generator=gen)), 3, n + 3) for n in lengths]
    out = torch.empty(1, len(lengths), heads, d, dtype=dtype)
    row_attention.attend(q, keys, out, None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (k, v, a, b) in enumerate(keys):
        ref = row_attention.reference(q[0, :, i].float(), int8kv.dequantize(k[:, a:b], d),
                                      int8kv.dequantize(v[:, a:b], d), 1 / math.sqrt(d))
        assert (out[0, i].double() - ref).abs().max().item() < tol
        alone = torch.empty(1, 1, heads, d, dtype=dtype)
        row_attention.attend(q[:, :, i : i + 1], [keys[i]], alone, None)
        assert torch.equal(alone[0, 0], out[0, i])


def test_kernel_refuses_a_position_of_the_wrong_width() -> None:
    _need()
    q = torch.randn(1, 2, 1, 16)
    k = torch.zeros(2, 4, 16, dtype=torch.int8)  # no scale bytes
    with pytest.raises(ValueError, match="take 20"):
        row_attention.attend(q, [(k, k, 0, 4)], torch.empty(1, 1, 2, 16), None)


@pytest.mark.parametrize(("family", "dtype", "quantize", "window"), [
    ("llama", torch.float32, None, None), ("qwen3", torch.float32, "int4", None),
    ("gemma3", torch.float32, None, 8), ("llama", torch.bfloat16, None, None), ("qwen3", torch.bfloat16, None, None),
    ("mistral", torch.float32, "int8", 40),
])
def test_fused_step_over_int8_rows_is_the_models_forward(family: str, dtype: torch.dtype, quantize: str | None,
                                                         window: int | None) -> None:
    """Rows holding int8 K/V: plain and verify steps through the fused step (its kernel quantizes each fresh
    position in C) and through the model's own forward (torch's :func:`kvrag.kv.int8kv.quantize`) give the same
    logits and write the same bytes."""
    _need(dtype)
    lm = tiny_model(family, init_std=0.1, quantize=quantize, sliding_window=window, dtype=dtype)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 12)
    a, b = narrowed(a, torch.int8), narrowed(b, torch.int8)
    assert a[0].buffer.quantized
    assert_fused_is_the_models_forward(lm.model, a, b, toks)


INT8_KV_LOGIT_BOUND = 0.15
"""Largest |logit| change int8 K/V may cause on the tiny llama below (init std 0.1, 3 rows, 8 decode steps): 0.023
measured (next-token KL 3.1e-5), the bound ~6x that."""


def test_int8_kv_moves_logits_by_a_bounded_amount() -> None:
    """Decoding the same tokens over float32 K/V and over int8 copies of them: logits within the measured bound,
    next-token distributions within a small KL, and not identical (the quantization is real)."""
    _need()
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 12)
    worst, kl, same = drift(lm.model, a, narrowed(b, torch.int8), toks)
    assert not same
    assert worst < INT8_KV_LOGIT_BOUND
    assert kl < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_decodes_over_int8_kv_and_accounts_for_its_bytes(dtype: torch.dtype) -> None:
    """kv_dtype="int8": the budget counts the int8 layout's bytes; the answer streams; the cache handed back
    after the stream is de-quantized into the model's dtype and covers the answer."""
    _need(dtype)
    lm = tiny_model("llama", init_std=0.1, dtype=dtype)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="int8"))
    spec = eng.spec
    assert eng.runner.kv_dtype == torch.int8
    assert eng.runner.budget.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * int8kv.width(spec.head_dim, torch.int8)
    eng.ingest(DOCS)
    gen = GenerationConfig(max_new_tokens=6)
    plan = eng.plan(RagTemplate().render(eng.tokenizer, DOCS, "What is the capital of France?"), DOCS)
    prep = eng.prepare(plan, "stale", reserve=gen.max_new_tokens)
    assert hf_cache.buffer_of(prep.cache)[0].capacity == plan.total_len  # the prompt's scratch, model dtype
    text = "".join(eng.stream(prep, gen))
    assert text
    keys, _ = hf_cache.cache_to_tensors(prep.cache)
    assert keys.dtype == dtype and keys.shape[2] >= len(prep.token_ids)


def test_int8_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel does not read int8 K/V, or the heads are not a multiple of 16, the engine refuses with the
    reason and the fix."""
    lm = tiny_model("llama")
    monkeypatch.setattr(row_attention, "why_not", lambda *_: "this CPU lacks avx512bw")
    with pytest.raises(ConfigError, match=r"lacks avx512bw.*kv_dtype='auto'"):
        KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="int8"))
    with pytest.raises(ConfigError, match="heads of 24, not a multiple of 16"):
        batched.decode_kv_dtype(lm.model, "int8", None, 24)


def test_int8_buffer_round_trips_and_refuses_other_readers() -> None:
    """put() quantizes into and de-quantizes out of an int8 buffer a layer at a time; a transformers cache over it
    and a suffix prefill into it are refused."""
    src = hf_cache.KVBuffer(2, 3, 16, 5, torch.float32, "cpu")
    src.keys.normal_()
    src.values.normal_()
    row = batched.Row.for_decode(src, 4, 9, torch.int8)
    q = row.buffer
    assert q.quantized and q.head_dim == 16 and q.capacity == 9 and q.keys.shape[-1] == 20
    assert torch.equal(q.keys[:, :, :4], int8kv.quantize(src.keys[:, :, :4]))
    back, _ = hf_cache.cache_to_tensors(row.cache(torch.float32))
    assert torch.equal(back, int8kv.dequantize(q.keys[:, :, :4], 16))
    assert hf_cache.KVBuffer.bytes_per_token(2, 3, 16, torch.int8) == 2 * 2 * 3 * 20
    with pytest.raises(ValueError, match="only kvrag's batched steps"):
        q.as_cache(4)


@pytest.mark.parametrize("mode", ["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_paths_simd_and_portable_threads_and_entries(mode: str, dtype: torch.dtype) -> None:
    """Both int8 paths of the C library (the AVX512 one, and the plain-C one any x86 CPU runs): within rounding of
    float64 attention over the de-quantized K/V (heads of 64, two groups; of 48, one group), and an entry's bits do
    not depend on the other entries of its call or the thread split."""
    import os

    from kvrag.calibration import cpu_flags

    if mode == "simd" and not set(row_attention._NEEDS[(dtype, torch.int8)]) <= cpu_flags():
        pytest.skip("this CPU lacks AVX512-F/BW/DQ/VL for the int8 SIMD path")
    lib = row_attention._Lib(portable=mode == "portable")
    try:
        gen = torch.Generator().manual_seed(3)
        for heads, kv_heads, d in ((6, 2, 64), (4, 2, 48)):
            lengths = [1, 33, 300, 7]
            q = torch.randn(1, heads, len(lengths), d, generator=gen).to(dtype)
            keys = [(int8kv.quantize(torch.randn(kv_heads, n + 4, d, generator=gen)),
                     int8kv.quantize(torch.randn(kv_heads, n + 4, d, generator=gen)), 2, n + 2) for n in lengths]
            out = torch.empty(1, len(lengths), heads, d, dtype=dtype)
            row_attention._call(lib, q, keys, out, d**-0.5, 3)
            for i, (k, v, a, b) in enumerate(keys):
                ref = row_attention.reference(q[0, :, i].float(), int8kv.dequantize(k[:, a:b], d),
                                              int8kv.dequantize(v[:, a:b], d), d**-0.5)
                bound = 2**-8 * ref.abs().max().item() if dtype == torch.bfloat16 else 2e-6
                assert (out[0, i].double() - ref).abs().max().item() <= bound
                alone = torch.empty(1, 1, heads, d, dtype=dtype)
                row_attention._call(lib, q[:, :, i : i + 1], [keys[i]], alone, d**-0.5, 1)
                assert torch.equal(alone[0, 0], out[0, i])
    finally:  # the process's own kernel (the same library) as this process's setting has it
        lib.portable(int(os.environ.get("KVRAG_ROW_ATTENTION", "").strip().lower() == "portable"))


def test_int8_fused_step_tests_pass_through_the_portable_path() -> None:
    """This file's fused-step and engine tests in a process whose row attention takes the plain-C paths (what an
    x86 CPU without AVX512 can run): the C writes still equal torch's quantization bit for bit; none skips."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KVRAG_ROW_ATTENTION": "portable", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs", str(Path(__file__)),
         "-k", "fused_step_over_int8_rows or engine_decodes_over_int8"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail


def test_int8_kv_keeps_no_conversation() -> None:
    """The prompt's K/V are quantized when decoding starts: a kept turn would reuse rounded K/V (and be counted at
    int8's bytes while held in the model dtype), so the conversation cache is off with int8 K/V."""
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="int8", conversation_cache_bytes=1 << 30))
    assert not eng.conversations.enabled
    eng.answer("Hello there, how are you?", [], "full", max_new_tokens=3)
    assert not eng.conversations._entries
    assert KVRAGEngine(lm, MemoryStore(), EngineConfig()).conversations.enabled
