"""The direct batched-step forward (kvrag.kv.direct): the same bits as the model's own forward, per family, dtype and
weight format, for plain and verify steps; models it does not write out, hooked models and a forward that differs
keep the model's forward."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import batched, direct, step_backend
from kvrag.store import MemoryStore
from kvrag_testing.rows import DOCS, paired_rows
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _direct_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode and verify steps through the direct loop where it serves (the fused step, which serves them first
    where it can, is tests/unit/test_fused_step.py's)."""
    monkeypatch.setattr(step_backend, "REGISTRY", tuple(b for b in step_backend.REGISTRY if b.name != "fused"))


def _use(model: Any, served: bool, kind: str = "decode") -> None:
    step_backend.choose(model, kind, "direct" if served else "hf")


def _step(model: Any, rows: list[batched.Row], toks: list[int], served: bool) -> torch.Tensor:
    _use(model, served)
    return batched.decode_step(model, rows, toks, batched.windows(model))


@pytest.mark.parametrize(("family", "dtype", "quantize", "window"), [
    ("llama", torch.float32, None, None), ("llama", torch.bfloat16, None, None), ("llama", torch.bfloat16, "int4", None),
    ("qwen2", torch.float32, None, 40), ("qwen3", torch.bfloat16, None, None), ("qwen3", torch.float32, "int8", None),
    ("mistral", torch.float32, None, 40), ("mistral", torch.bfloat16, None, None),
    ("gemma3", torch.float32, None, None), ("gemma3", torch.bfloat16, "int4", 40),
])
def test_direct_steps_are_the_models_forward_bit_for_bit(family: str, dtype: torch.dtype, quantize: str | None,
                                                         window: int | None) -> None:
    """Plain steps (3 rows of different lengths and methods) and a verify step, through the direct forward and
    through the model's own, over copies of the same KV: identical logits and identical written K/V."""
    lm = tiny_model(family, init_std=0.1, dtype=dtype, quantize=quantize, sliding_window=window)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    assert direct.why_not(lm.model) is None
    a, b, toks = paired_rows(eng, 12)
    for _ in range(6):
        got, ref = _step(lm.model, a, toks, True), _step(lm.model, b, toks, False)
        assert torch.equal(got, ref)
        for r in a + b:
            r.length += 1
        toks = [int(t) for t in ref.argmax(-1)]
    feeds = [[t, 7, 9][: i + 1] for i, t in enumerate(toks)]  # 1, 2 and 3 tokens
    _use(lm.model, True)
    got = batched.verify_step(lm.model, a, feeds, batched.windows(lm.model))
    _use(lm.model, False)
    ref = batched.verify_step(lm.model, b, feeds, batched.windows(lm.model))
    assert torch.equal(got, ref)
    for ra, rb, f in zip(a, b, feeds, strict=True):
        n = ra.length + len(f)
        assert torch.equal(ra.buffer.keys[:, :, :n], rb.buffer.keys[:, :, :n])
        assert torch.equal(ra.buffer.values[:, :, :n], rb.buffer.values[:, :, :n])
    suffixes = [[5, 6, 7, 8, 9][: 2 * i + 1] for i in range(len(a))]  # suffix prefills: 1, 3 and 5 tokens
    for ra, rb, f in zip(a, b, suffixes, strict=True):
        _use(lm.model, True, "prefill")
        got = batched.prefill_rows(lm.model, [ra], [f], batched.windows(lm.model))
        _use(lm.model, False, "prefill")
        assert torch.equal(got, batched.prefill_rows(lm.model, [rb], [f], batched.windows(lm.model)))
        n = ra.length + len(f)
        assert torch.equal(ra.buffer.keys[:, :, :n], rb.buffer.keys[:, :, :n])
        assert torch.equal(ra.buffer.values[:, :, :n], rb.buffer.values[:, :, :n])


def test_the_first_step_decides_and_other_models_keep_their_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = direct.forward

    def spy(model: Any, *args: Any) -> torch.Tensor:
        calls.append(type(model).__name__)
        return real(model, *args)

    monkeypatch.setattr(direct, "forward", spy)
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    assert step_backend.chosen(lm.model, "prefill") is None  # lone suffixes: the model's forward, no check yet
    assert calls == []
    batched.prefill_rows(lm.model, b[:2], [[5, 6], [7]], batched.windows(lm.model))  # the first packed prefill
    assert step_backend.chosen(lm.model, "prefill") == "direct"
    calls.clear()
    for _ in range(2):
        batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert step_backend.chosen(lm.model, "decode") == "direct" and calls == ["LlamaForCausalLM"] * 2  # checked once

    other = tiny_model("gemma", init_std=0.1)  # embeddings scaled in the model's forward: not a layout it writes out
    assert "GemmaForCausalLM" in str(direct.why_not(other.model))
    eng2 = KVRAGEngine(other, MemoryStore(), EngineConfig())
    eng2.ingest(DOCS)
    a2, _, toks2 = paired_rows(eng2, 4)
    batched.decode_step(other.model, a2, toks2, batched.windows(other.model))
    assert step_backend.chosen(other.model, "decode") == "hf" and calls == ["LlamaForCausalLM"] * 2


@pytest.mark.parametrize(("how", "said"), [("differs", "differs"), ("raises", "failed")])
def test_a_direct_forward_that_differs_is_not_used(how: str, said: str, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """What a transformers with other layer arithmetic (or other module attributes) would look like: the first step
    compares, returns the model's own result, warns, and later steps keep the model's forward."""
    lm = tiny_model("qwen2", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    real = direct.forward
    calls = []

    def off(*args: Any) -> torch.Tensor:
        calls.append(1)
        if how == "raises":
            raise AttributeError("'Qwen2Attention' object has no attribute 'q_proj'")
        return real(*args) + 1e-3

    monkeypatch.setattr(direct, "forward", off)
    with caplog.at_level(logging.WARNING, logger="kvrag.kv.step_backend"):
        got = batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert step_backend.chosen(lm.model, "decode") == "hf" and len(calls) == 1
    assert any(said in r.getMessage() for r in caplog.records)
    assert torch.equal(got, _step(lm.model, b, toks, False))  # the model's own result was returned
    batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert len(calls) == 1  # not tried again


def test_hooks_keep_the_models_forward() -> None:
    """A forward hook on any module must run, so a hooked model's steps go through its own forward."""
    lm = tiny_model("llama", init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, _, toks = paired_rows(eng, 4)
    batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    assert step_backend.chosen(lm.model, "decode") == "direct"
    seen = []
    handle = lm.model.model.layers[0].mlp.down_proj.register_forward_hook(lambda *_: seen.append(1))
    try:
        batched.decode_step(lm.model, a, toks, batched.windows(lm.model))
    finally:
        handle.remove()
    assert seen == [1]
