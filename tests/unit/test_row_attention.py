"""kvrag's one-token attention (kvrag.kv.row_attention): its arithmetic, entry independence, where it serves and the
fallbacks."""

from __future__ import annotations

import pytest
import torch

from kvrag.calibration import cpu_flags
from kvrag.kv import attention, batched, native, row_attention, step_backend
from kvrag.kv.hf_cache import KVBuffer
from kvrag_testing.tiny import tiny_model

DTYPES = [torch.float32, torch.bfloat16]


def _need(dtype: torch.dtype) -> None:
    if row_attention.why_not(dtype) is not None:
        pytest.skip(f"kvrag's row attention does not serve {dtype} here: {row_attention.why_not(dtype)}")


def _case(gen: torch.Generator, heads: int, kv_heads: int, d: int, lengths: list[int], dtype: torch.dtype,
          spread: float = 1.0) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, int, int]]]:
    q = (torch.randn(1, heads, len(lengths), d, generator=gen) * spread).to(dtype)
    keys = []
    for i, n in enumerate(lengths):
        cap = n + 5 + i
        k = torch.randn(kv_heads, cap, d, generator=gen).to(dtype)
        v = torch.randn(kv_heads, cap, d, generator=gen).to(dtype)
        keys.append((k, v, 3, 3 + n))  # positions 3 .. 3 + n - 1 of a buffer with room behind
    return q, keys


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (8, 2, 128), (6, 2, 16), (14, 2, 48), (5, 5, 40),
                                                     (12, 1, 64)])
def test_matches_float64_attention(dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> None:
    _need(dtype)
    gen = torch.Generator().manual_seed(heads * d)
    lengths = [1, 2, 15, 16, 17, 300, 1100]
    for spread in (1.0, 8.0):  # 8: scores far apart, softmax dominated by a few keys
        q, keys = _case(gen, heads, kv_heads, d, lengths, dtype, spread)
        out = torch.empty(1, len(lengths), heads, d, dtype=dtype)
        row_attention.attend(q, keys, out, d**-0.5)
        for i, (k, v, a, b) in enumerate(keys):
            ref = row_attention.reference(q[0, :, i], k[:, a:b], v[:, a:b], d**-0.5)
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, i : i + 1], k[None, :, a:b], v[None, :, a:b], scale=d**-0.5, enable_gqa=True)[0, :, 0]
            err = (out[0, i].double() - ref).abs().max().item()
            torch_err = (sdpa.double() - ref).abs().max().item()
            # within the output dtype's rounding of the exact result (float32: sums of ~1K terms in order), or
            # within twice torch's SDPA's error
            bound = (2**-8 if dtype == torch.bfloat16 else 3e-6) * max(1.0, ref.abs().max().item())
            assert err <= max(bound, 2 * torch_err), (i, b - a, err, torch_err)
            assert torch.isfinite(out[0, i]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_entry_gets_the_same_bits_alone_among_others_and_with_any_thread_count(dtype: torch.dtype) -> None:
    _need(dtype)
    gen = torch.Generator().manual_seed(1)
    lengths = [40, 1, 333, 64, 7, 129]
    q, keys = _case(gen, 9, 3, 64, lengths, dtype)
    together = torch.empty(1, len(lengths), 9, 64, dtype=dtype)
    row_attention.attend(q, keys, together, 0.125)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            again = torch.empty_like(together)
            row_attention.attend(q, keys, again, 0.125)
            assert torch.equal(again, together), threads
            for i in range(len(lengths)):
                alone = torch.empty(1, 1, 9, 64, dtype=dtype)
                row_attention.attend(q[:, :, i : i + 1], [keys[i]], alone, 0.125)
                assert torch.equal(alone[0, 0], together[0, i]), (threads, i)
            sub = torch.empty(1, 3, 9, 64, dtype=dtype)
            row_attention.attend(q[:, :, 2:5], keys[2:5], sub, 0.125)
            assert torch.equal(sub[0], together[0, 2:5])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_queries_and_keys_are_read_as_they_lie(dtype: torch.dtype) -> None:
    _need(dtype)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 9, 1, 64, generator=gen).to(dtype).transpose(0, 2)  # [1, H, 3, D], query stride = rows apart
    big = torch.randn(2, 3, 50, 64, generator=gen).to(dtype)  # K and V of three queries as views into one tensor
    keys = [(big[0], big[1], 0, 50), (big[0, :, ::2], big[1, :, ::2], 1, 20), (big[0], big[1], 10, 11)]
    out = torch.empty(1, 3, 9, 64, dtype=dtype)
    row_attention.attend(q, keys, out, None)  # scale None: 1 / sqrt(D), as SDPA's
    for i, (k, v, a, b) in enumerate(keys):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i : i + 1].float(), k[None, :, a:b].float(), v[None, :, a:b].float(), enable_gqa=True)
        torch.testing.assert_close(out[0, i].float(), ref[0, :, 0], atol=2e-2 if dtype == torch.bfloat16 else 2e-6,
                                   rtol=0)


def test_window_start_reads_suffix_masks_only() -> None:
    assert row_attention.window_start(None, 9) == 0
    m = torch.zeros(1, 1, 1, 9, dtype=torch.bool)
    m[..., 4:] = True
    assert row_attention.window_start(m, 9) == 4
    m[..., 6] = False
    assert row_attention.window_start(m, 9) is None  # a hole: not a window
    assert row_attention.window_start(torch.zeros(1, 1, 1, 9, dtype=torch.bool), 9) is None
    assert row_attention.window_start(torch.zeros(1, 1, 1, 9), 9) is None  # additive masks go to SDPA
    assert row_attention.window_start(torch.ones(1, 1, 2, 9, dtype=torch.bool), 9) is None


def test_it_serves_the_models_own_one_token_forward_and_the_batched_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny models' decode runs through the kernel both ways, so the generate-equivalence tests exercise it."""
    _need(torch.float32)
    lm = tiny_model("llama")
    calls: list[int] = []
    real = row_attention.attend

    def counting(query: torch.Tensor, keys: list, out: torch.Tensor, scale: float | None) -> torch.Tensor:
        calls.append(len(keys))
        return real(query, keys, out, scale)

    monkeypatch.setattr(row_attention, "attend", counting)
    ids = torch.arange(3, 20)[None]
    gen = lm.model.generate(ids, max_new_tokens=3, do_sample=False)
    layers = lm.model.config.num_hidden_layers
    assert len(calls) == 2 * layers and set(calls) == {1}  # the two one-token steps after the prefill

    calls.clear()
    cfg = lm.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bufs = []
    for n in (5, 9):
        buf = KVBuffer(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, 16, torch.float32, "cpu")
        buf.keys.normal_()
        buf.values.normal_()
        bufs.append(batched.Row(buf, n))
    lib = row_attention.library(torch.float32)
    real_fused = lib.rope_attend

    def counting_fused(*args: object) -> int:
        calls.append(int(args[2]))  # type: ignore[call-overload]
        return int(real_fused(*args))

    monkeypatch.setattr(lib, "rope_attend", counting_fused)
    batched.decode_step(lm.model, bufs, [4, 5], batched.windows(lm.model))  # the first also checks the fused step
    calls.clear()
    for r in bufs:
        r.length += 1
    batched.decode_step(lm.model, bufs, [6, 7], batched.windows(lm.model))
    assert calls == [2] * layers  # both rows of each layer in one call (the fused step's RoPE + attention)
    assert step_backend.chosen(lm.model, "decode") == "fused"
    assert gen.shape[1] == ids.shape[1] + 3


@pytest.mark.parametrize(("setting", "why"), [("torch", "KVRAG_ROW_ATTENTION=torch"),
                                              ("fast", "KVRAG_ROW_ATTENTION='fast' is not a setting")])
def test_torch_asked_or_a_bad_setting_leaves_sdpa(monkeypatch: pytest.MonkeyPatch, setting: str, why: str) -> None:
    monkeypatch.setenv("KVRAG_ROW_ATTENTION", setting)
    row_attention._load.cache_clear()
    try:
        q = torch.randn(1, 6, 1, 16)
        assert not row_attention.serves(q) and why in row_attention.why_not(torch.float32)
        k = torch.randn(1, 2, 10, 16)
        got, _ = attention.gqa_sdpa_attention(_Module(3), q, k, k, None, scaling=0.25)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, scale=0.25, enable_gqa=True)
        assert torch.equal(got, ref.transpose(1, 2))  # torch's SDPA, bit for bit
    finally:
        row_attention._load.cache_clear()


def test_a_cpu_without_the_instructions_or_a_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse4_2"}))
    row_attention._load.cache_clear()
    try:
        assert "lacks avx2, fma" in row_attention.why_not(torch.float32)
        assert "avx512_bf16" in row_attention.why_not(torch.bfloat16)
        assert "no kvrag row-attention path" in row_attention.why_not(torch.float16)
        monkeypatch.setattr(native, "cpu_flags", cpu_flags)
        monkeypatch.setenv("KVRAG_HOME", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        row_attention._load.cache_clear()
        if {"avx2", "fma"} <= cpu_flags():
            assert "no-such-cc" in row_attention.why_not(torch.float32)
        assert not row_attention.serves(torch.randn(1, 6, 1, 16))
    finally:
        row_attention._load.cache_clear()


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


_WIDE_SCRIPT = """
import sys, torch
from kvrag.kv import row_attention
gen = torch.Generator().manual_seed(5)
outs = []
for heads, kv_heads, d in ((9, 3, 64), (8, 2, 128), (14, 2, 48), (5, 5, 40), (12, 1, 64)):
    for n in (1, 7, 33, 300, 1100):
        q = torch.randn(1, heads, 3, d, generator=gen)
        keys = [(torch.randn(kv_heads, n + 4, d, generator=gen) * 3, torch.randn(kv_heads, n + 4, d, generator=gen),
                 1, 1 + max(1, n - j)) for j in range(3)]
        out = torch.empty(1, 3, heads, d)
        outs.append(row_attention.attend(q, keys, out, 0.11).clone())
torch.save(outs, sys.argv[1])
"""


def test_the_wide_float32_path_computes_the_narrow_paths_bits(tmp_path: object) -> None:
    """On CPUs with AVX512-VL the float32 path sums up to 3 query heads per pass over the values; its outputs are the
    bits of the one-head-a-pass path (KVRAG_ROW_ATTENTION_NARROW, read once per process: two processes here)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _need(torch.float32)
    if not {"avx512f", "avx512vl"} <= cpu_flags():
        pytest.skip("no AVX512-VL here: only the one-head-a-pass path runs")
    got = {}
    for name, env in (("wide", {}), ("narrow", {"KVRAG_ROW_ATTENTION_NARROW": "1"})):
        out = Path(str(tmp_path)) / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _WIDE_SCRIPT, str(out)], check=True, env={**os.environ, **env},
                       timeout=120)
        got[name] = torch.load(out)
    assert len(got["wide"]) == 25
    assert all(torch.equal(a, b) for a, b in zip(got["wide"], got["narrow"], strict=True))
