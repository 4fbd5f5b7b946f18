"""The fused decode / verify step (kvrag.kv.fused_step, with kvrag_rope_attend and quant.Fused): the bits of the
model's own forward per family, dtype, weight format and attention window; fused products equal to the separate
ones; models or steps it does not take keep the direct loop; a changed weight is never served from a fused copy."""

from __future__ import annotations

import array
import logging
from typing import Any

import pytest
import torch

from kvrag.calibration import cpu_flags
from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import batched, fused_step, hf_cache, int4_kernel, quant, row_attention, step_backend
from kvrag.store import MemoryStore
from kvrag_testing.rows import DOCS, paired_rows
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _need(dtype: torch.dtype) -> None:
    why = row_attention.why_not(dtype)
    if why is not None:
        pytest.skip(f"kvrag's row attention does not serve {dtype} here: {why}")


def _set(model: Any, fused: bool) -> None:
    """Steps through the fused step (``fused``) or through the model's own forward (the oracle)."""
    step_backend.choose(model, "decode", "fused" if fused else "hf")


def _same_kv(a: list[batched.Row], b: list[batched.Row], fed: list[int]) -> None:
    for ra, rb, q in zip(a, b, fed, strict=True):
        n = ra.length + q
        assert torch.equal(ra.buffer.keys[:, :, :n], rb.buffer.keys[:, :, :n])
        assert torch.equal(ra.buffer.values[:, :, :n], rb.buffer.values[:, :, :n])


def _with_config(family: str, dtype: torch.dtype, quantize: str | None, **overrides: Any) -> Any:
    """A tiny random model of ``family`` with config fields ``overrides`` (which :func:`tiny_model` does not set)."""
    from transformers import AutoModelForCausalLM

    from kvrag.models import wrap_model
    from kvrag_testing.tiny import attn_implementation, tiny_config, tiny_tokenizer

    cfg = tiny_config(family, init_std=0.1)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation(family))
    with torch.no_grad():  # LayerNorm weights start at one: make the q / k norms' weights matter
        for m in model.modules():
            if type(m).__name__.endswith("LayerNorm") and getattr(m, "weight", None) is not None:
                m.weight.uniform_(0.5, 1.5)
    model = model.to(dtype=dtype).eval()
    return wrap_model(model, tiny_tokenizer(), name=f"tiny-{family}-custom", dtype=dtype, quantize=quantize)


@pytest.mark.parametrize(("family", "dtype", "quantize", "window"), [
    ("llama", torch.float32, None, None), ("llama", torch.float32, "int4", None), ("llama", torch.bfloat16, None, None),
    ("llama", torch.bfloat16, "int4", None), ("llama", torch.float32, "int8", None),
    ("qwen2", torch.float32, None, 40), ("qwen2", torch.bfloat16, "int4", None),
    ("mistral", torch.float32, "int4", 40), ("mistral", torch.bfloat16, None, None),
    ("qwen3", torch.float32, "int8", None), ("qwen3", torch.bfloat16, None, None), ("qwen3", torch.float32, "int4", 40),
    ("gemma3", torch.float32, None, None), ("gemma3", torch.bfloat16, None, None), ("gemma3", torch.float32, "int4", 8),
    ("gemma3", torch.bfloat16, "int4", 8), ("gemma", torch.float32, None, None), ("gemma", torch.bfloat16, "int4", None),
    ("granite", torch.float32, None, None), ("granite", torch.bfloat16, None, None),
    ("smollm3", torch.float32, None, None), ("smollm3", torch.bfloat16, "int4", None),
    ("phi3", torch.float32, None, None), ("phi3", torch.bfloat16, "int4", None),
    ("olmo2", torch.float32, None, None), ("olmo2", torch.float32, "int4", None), ("olmo2", torch.bfloat16, None, None),
    ("olmo2", torch.bfloat16, "int4", None), ("cohere", torch.float32, None, None), ("cohere", torch.bfloat16, None, None),
    ("cohere", torch.float32, "int4", None), ("cohere", torch.bfloat16, "int4", None),
    ("exaone4", torch.float32, None, 8), ("exaone4", torch.bfloat16, "int4", None),
    ("stablelm", torch.float32, None, None), ("stablelm", torch.bfloat16, "int4", None),
    ("stablelm-parallel", torch.float32, None, None), ("stablelm-parallel", torch.bfloat16, None, None),
    ("cohere-qknorm", torch.float32, None, None), ("cohere-qknorm", torch.bfloat16, "int4", None),
    ("phi", torch.float32, None, None), ("phi", torch.bfloat16, "int4", None),
    ("phi3-partial", torch.float32, None, None), ("phi3-partial", torch.bfloat16, "int4", None),
])
def test_fused_steps_are_the_models_forward_bit_for_bit(family: str, dtype: torch.dtype, quantize: str | None,
                                                        window: int | None) -> None:
    """Plain steps (3 rows of different lengths and methods) and a verify step (1, 2 and 3 positions per row),
    fused and through the model's own forward, over copies of the same KV: identical logits and written K/V.
    (SmolLM3 and EXAONE 4 with 4 layers: their last one has no RoPE; Gemma 3's first layer is a sliding one, its
    second global.)"""
    _need(dtype)
    family, _, variant = family.partition("-")  # partial: Phi-4-mini's 3/4 of each head rotated
    if variant == "qknorm":  # Command-R+'s per-head q / k LayerNorms
        lm = _with_config(family, dtype, quantize, use_qk_norm=True)
    else:
        lm = tiny_model(family, init_std=0.1, dtype=dtype, quantize=quantize, sliding_window=window,
                        num_layers=4 if family in ("smollm3", "exaone4") else 2,
                        rope={"partial_rotary_factor": 0.75} if variant == "partial" else None)
    if variant == "parallel":  # StableLM's parallel residual (StableLM-3B-4E1T's is off, some configs have it)
        lm.model.config.use_parallel_residual = True
        for layer in lm.model.model.layers:
            layer.use_parallel_residual = True
    if family == "gemma3" and quantize == "int4":  # the released Gemma 3 configs leave it unset
        lm.model.config.final_logit_softcapping = 2.0
    assert fused_step.why_not(lm.model) is None
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 12)
    wins = batched.windows(lm.model)
    for _ in range(6):
        _set(lm.model, True)
        got = batched.decode_step(lm.model, a, toks, wins)
        _set(lm.model, False)
        ref = batched.decode_step(lm.model, b, toks, wins)
        assert torch.equal(got, ref)
        _same_kv(a, b, [1] * len(a))
        for r in a + b:
            r.length += 1
        toks = [int(t) for t in ref.argmax(-1)]
    feeds = [[t, 7, 9][: i + 1] for i, t in enumerate(toks)]
    _set(lm.model, True)
    got = batched.verify_step(lm.model, a, feeds, wins)
    _set(lm.model, False)
    ref = batched.verify_step(lm.model, b, feeds, wins)
    assert torch.equal(got, ref)
    _same_kv(a, b, [len(f) for f in feeds])
    step_backend.choose(lm.model, "decode", None)


def test_a_window_shorter_than_the_context_is_applied() -> None:
    """Rows longer than a sliding window: the fused step attends to the window only, as the model does (the rows
    of the bit-for-bit test above stay within 40 positions for some requests; these pass a window of 8)."""
    _need(torch.float32)
    lm = tiny_model("mistral", init_std=0.1, sliding_window=8)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    assert min(r.length for r in a) > 8
    wins = batched.windows(lm.model)
    _set(lm.model, True)
    got = batched.decode_step(lm.model, a, toks, wins)
    _set(lm.model, False)
    assert torch.equal(got, batched.decode_step(lm.model, b, toks, wins))
    step_backend.choose(lm.model, "decode", None)


def test_the_first_step_is_checked_and_served_after() -> None:
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, _, toks = paired_rows(eng, 4)
    step_backend.choose(lm.model, "decode", None)
    batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert step_backend.chosen(lm.model, "decode") == "fused"


@pytest.mark.parametrize(("how", "said"), [("differs", "differs"), ("raises", "failed")])
def test_a_fused_step_that_differs_is_not_used(how: str, said: str, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The first step returns the model's own result, warns, and later steps run the next backend that computes
    the model's bits (the direct loop)."""
    _need(torch.float32)
    lm = tiny_model("qwen2", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    real = fused_step.forward

    def wrong(*args: Any) -> torch.Tensor:
        if how == "raises":
            raise RuntimeError("boom")
        return real(*args) + 1e-3

    monkeypatch.setattr(fused_step, "forward", wrong)
    step_backend.choose(lm.model, "decode", None)
    wins = batched.windows(lm.model)
    with caplog.at_level(logging.WARNING, logger="kvrag.kv.step_backend"):
        got = batched.decode_step(lm.model, a, toks, wins)
    assert said in caplog.text and "fused" in caplog.text and step_backend.chosen(lm.model, "decode") == "direct"
    _set(lm.model, False)
    assert torch.equal(got, batched.decode_step(lm.model, b, toks, wins))
    step_backend.choose(lm.model, "decode", None)


def test_models_it_does_not_take_say_why() -> None:
    assert "soft-capping" in str(fused_step.why_not(tiny_model("gemma2", init_std=0.1).model))
    assert "GPTNeoXForCausalLM" in str(fused_step.why_not(tiny_model("gpt_neox", init_std=0.1).model))
    assert "float16" in str(fused_step.why_not(tiny_model("llama", init_std=0.1, dtype=torch.float16).model))


def test_hooks_keep_the_models_forward() -> None:
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, _, toks = paired_rows(eng, 4)
    batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert step_backend.chosen(lm.model, "decode") == "fused"
    seen = []
    handle = lm.model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *_: seen.append(1))
    try:
        batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    finally:
        handle.remove()
    assert seen == [1]


def test_a_row_without_room_is_refused_before_anything_is_written() -> None:
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1)
    cfg = lm.model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    buf = hf_cache.KVBuffer(cfg.num_hidden_layers, cfg.num_key_value_heads, d, 4, torch.float32, "cpu")
    buf.keys.normal_()
    before = buf.keys.clone()
    row = batched.Row(buf, 4)  # full: no room for the step's position
    with pytest.raises(ValueError, match="no room"):
        fused_step.forward(lm.model, torch.tensor([[5]]), torch.tensor([[4]]), 1, [row], [1], batched.windows(lm.model))
    assert torch.equal(buf.keys, before)


def _kvrag_int4() -> None:
    if int4_kernel.path() is None:
        pytest.skip(f"kvrag's int4 kernel is not loaded here: {int4_kernel.why_not()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_products_are_the_separate_products(dtype: torch.dtype) -> None:
    """q / k / v (with Qwen2's biases) as one int4 product: its columns are each layer's own outputs, bit for bit,
    for 1 and several rows, and the layers' weights became views of the fused one (no second copy)."""
    _kvrag_int4()
    lm = tiny_model("qwen2", init_std=0.1, dtype=dtype, quantize="int4")
    a = lm.model.model.layers[1].self_attn
    mods = (a.q_proj, a.k_proj, a.v_proj)
    with torch.inference_mode():
        xs = [torch.randn(m, a.q_proj.weight.shape[1]).to(dtype) for m in (1, 5, quant.MAX_ROWS)]
        refs = [torch.cat([m(x) for m in mods], -1) for x in xs]
        before = quant.quantized_bytes(lm.model)
        fused = quant.fuse_int4(mods)
        assert fused is not None and fused.valid() and fused.bias is not None
        assert quant.quantized_bytes(lm.model) == before
        assert mods[1]._kvrag_quant.qweight.packed.data_ptr() > fused.packed.data_ptr()  # a view into it
        for x, ref in zip(xs, refs, strict=True):
            assert torch.equal(fused.mm(x), ref)
            assert torch.equal(torch.cat([m(x) for m in mods], -1), ref)  # the layers' own products, unchanged


def test_the_fused_plan_hands_each_layers_freed_layouts_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the fused products frees each layer's own int4 layouts (the fused copy replaces them); the heap's
    pages are handed back after every layer, so they are not resident beside the fused copies until reused."""
    _kvrag_int4()
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1, quantize="int4")
    built: list[object] = []
    real = fused_step._Layer
    monkeypatch.setattr(fused_step, "_Layer", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    trims: list[int] = []
    monkeypatch.setattr(fused_step.native, "trim_heap", lambda: trims.append(len(built)))
    plan = fused_step._Plan(lm.model, fused_step.row_attention.library(lm.model.dtype))
    n = lm.model.config.num_hidden_layers
    assert trims == list(range(1, n + 1))  # once after each layer's fused products are made
    assert all(lay.qkv is not None and lay.gu is not None for lay in plan.layers)


def test_a_changed_weight_is_not_served_from_the_fused_copy() -> None:
    _kvrag_int4()
    _need(torch.float32)
    lm = tiny_model("llama", init_std=0.1, quantize="int4")
    mlp = lm.model.model.layers[0].mlp
    fused = quant.fuse_int4((mlp.gate_proj, mlp.up_proj))
    assert fused is not None and fused.valid()
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)
    assert not fused.valid()  # the step then runs each layer's own forward, which serves the new weight densely


def test_layers_it_cannot_fuse() -> None:
    lm = tiny_model("llama", init_std=0.1)  # dense weights
    a = lm.model.model.layers[0].self_attn
    assert quant.fuse_int4((a.q_proj, a.k_proj, a.v_proj)) is None
    if "avx512_bf16" not in cpu_flags() and "amx_bf16" not in cpu_flags():
        lm = tiny_model("llama", init_std=0.1, quantize="int4")  # torch's int4 kernel: not fused
        a = lm.model.model.layers[0].self_attn
        assert quant.fuse_int4((a.q_proj, a.k_proj, a.v_proj)) is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gemma", "gemma3", "granite", "smollm3",
                                    "phi3", "exaone4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_norm_is_the_modules_forward(family: str, dtype: torch.dtype) -> None:
    lm = tiny_model(family, init_std=0.1, dtype=dtype)
    a = lm.model.model.layers[0].self_attn
    norm = a.q_norm if family in ("qwen3", "gemma3", "exaone4") else lm.model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)
    lean = fused_step._rms_norm(norm)
    assert lean is not norm.forward  # the family's norm is one it computes
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows, scale in ((1, 1e-3), (3, 1.0), (8, 40.0)):
            x = (torch.randn(rows, 1, norm.weight.shape[0], generator=gen) * scale).to(dtype)
            assert torch.equal(lean(x), norm.forward(x))
    with torch.no_grad():
        norm.weight.mul_(2)  # a changed weight is read again
    with torch.inference_mode():
        assert torch.equal(lean(x), norm.forward(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_attend_is_transformers_rope_then_the_row_attention(dtype: torch.dtype) -> None:
    """kvrag_rope_attend alone on random rows of a q/k/v product (values up to 1e4: RoPE's products and sums
    round differently if they were contracted into fused multiply-adds): the keys it writes are
    ``apply_rotary_pos_emb``'s bit for bit, the values are copied, and each query's output is what
    :func:`row_attention.attend` computes for the rotated query over the same keys."""
    _need(dtype)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, cap = 6, 2, 64, 40
    positions = [(0, 17), (0, 18), (1, 5)]  # (row, position): two queries of row 0 (a verify step), one of row 1
    qkv = (torch.randn(len(positions), (heads + 2 * kv_heads) * d, generator=gen) * 1e2).to(dtype)
    qkv[0, :8] *= 100
    angles = torch.tensor([p for _, p in positions], dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    bufs = [(torch.randn(kv_heads, cap, d, generator=gen).to(dtype), torch.randn(kv_heads, cap, d, generator=gen)
             .to(dtype)) for _ in range(2)]
    ent = array.array("q")
    for r, p in positions:
        ent.extend((bufs[r][0].data_ptr(), bufs[r][1].data_ptr(), bufs[r][0].stride(0), p, 2))
    qbuf = torch.empty(len(positions), heads, d, dtype=dtype)
    out = torch.empty(len(positions), heads, d, dtype=dtype)
    lib = row_attention.library(dtype)
    assert lib.rope_attend(int(dtype == torch.bfloat16), ent.buffer_info()[0], len(positions), qkv.data_ptr(),
                           qkv.shape[1], cos.data_ptr(), sin.data_ptr(), d, heads, kv_heads, d, 0.125,
                           qbuf.data_ptr(), out.data_ptr(), 1, 0) == 0
    q = qkv[:, : heads * d].view(-1, heads, 1, d).transpose(0, 2)  # [1, H, Q, D]
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(-1, kv_heads, 1, d).transpose(0, 2)
    v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)
    for i, (r, p) in enumerate(positions):
        qr, kr = apply_rotary_pos_emb(q[:, :, i : i + 1], k[:, :, i : i + 1], cos[i : i + 1][None], sin[i : i + 1][None])
        assert torch.equal(qbuf[i], qr[0, :, 0])
        assert torch.equal(bufs[r][0][:, p], kr[0, :, 0])
        assert torch.equal(bufs[r][1][:, p], v[i])
    ref = torch.empty(1, len(positions), heads, d, dtype=dtype)
    row_attention.attend(qbuf.transpose(0, 1)[None], [(bufs[r][0], bufs[r][1], 2, p + 1) for r, p in positions], ref,
                         0.125)
    assert torch.equal(out, ref[0])
