"""The captured decode step (``compile_decode``, :mod:`kvrag.kv.compiled`) computes the eager step's bits."""

from __future__ import annotations

import pytest
import torch

from kvrag.kv import batched, compiled, hf_cache
from kvrag.testing.tiny import tiny_model

pytestmark = pytest.mark.slow  # each batch shape compiles (~10-30 s on two cores)


def _rows(model: torch.nn.Module, contexts: list[list[int]], extra: int) -> list[batched.Row]:
    rows = []
    for ids in contexts:
        keys, values = hf_cache.prefill_kv(model, torch.tensor(ids))
        buf = hf_cache.KVBuffer(keys.shape[0], keys.shape[1], keys.shape[3], keys.shape[2] + extra, keys.dtype,
                                keys.device)
        buf.keys[:, :, : keys.shape[2]].copy_(keys)
        buf.values[:, :, : keys.shape[2]].copy_(values)
        rows.append(batched.Row(buf, keys.shape[2]))
    return rows


@pytest.mark.parametrize(("family", "dtype", "quantize"), [("llama", torch.bfloat16, "int4"),
                                                            ("qwen3", torch.float32, None),
                                                            ("qwen2", torch.float32, "int8")])
def test_captured_step_writes_and_returns_the_eager_steps_bits(family: str, dtype: torch.dtype,
                                                                quantize: str | None) -> None:
    model = tiny_model(family, init_std=0.1, dtype=dtype, quantize=quantize).model
    win = batched.windows(model)
    contexts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((37, 90, 61))]
    for batch in (1, 3, 2):  # the several-rows graph, checked at 3 rows, also serves 2
        eager, captured = (_rows(model, contexts[:batch], 12) for _ in range(2))
        toks = [5 + i for i in range(batch)]
        for step in range(6):
            with hf_cache.model_lock(model):
                a = batched.decode_step(model, eager, toks, win)
                b = batched.decode_step(model, captured, toks, win, compiled=True)
            assert torch.equal(a, b), f"batch {batch}, step {step}: the captured step's logits differ"
            for r, s in zip(eager, captured, strict=True):
                assert torch.equal(r.buffer.keys[:, :, r.length], s.buffer.keys[:, :, s.length])
                assert torch.equal(r.buffer.values[:, :, r.length], s.buffer.values[:, :, s.length])
                r.length += 1
                s.length += 1
            toks = [int(t) for t in a.argmax(-1)]
    # both shapes ran captured (their first steps checked bit for bit against the eager step), not the fallback
    assert compiled.captured(model) == {"one row": True, "several rows": True}


def test_a_step_of_more_rows_than_the_quantized_route_stays_eager() -> None:
    assert compiled.why_not(tiny_model("llama").model, 17) is not None
    assert compiled.why_not(tiny_model("llama").model, 16) is None


def test_packed_bfloat16_weights_keep_the_eager_step() -> None:
    model = tiny_model("llama", init_std=0.1, dtype=torch.bfloat16).model
    packed = any(getattr(m, "_kvrag_packed", None) is not None for m in model.modules())
    win = batched.windows(model)
    eager, captured = (_rows(model, [[(5 * j) % 200 + 10 for j in range(40)]], 4) for _ in range(2))
    for step in range(3):
        with hf_cache.model_lock(model):
            a = batched.decode_step(model, eager, [9], win)
            b = batched.decode_step(model, captured, [9], win, compiled=True)
        assert torch.equal(a, b), f"step {step}"
        for r in eager + captured:
            r.length += 1
    if packed:  # this CPU packs bf16 weights (oneDNN bf16): the step stays eager
        assert compiled.captured(model) == {}
    else:  # dense bf16 products: captured, and its first step checked against the eager one (equal steps above)
        assert "one row" in compiled.captured(model)
