"""Long prepares in pieces on the real default model: ``full`` and ``relaxkv`` split at every possible boundary, with
another request's forward between the pieces, compute exactly the whole call's cache and next-token logits
(float32 dense, bfloat16 dense, int4 weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.assemble import assemble
from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.results import Timings
from kvrag.fusion import get_method
from kvrag.kv import hf_cache, pieces
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PASSAGES = [render_passage(f"Passage {i}: the ferry to the island number {i} leaves pier {i + 2} at {i + 6} o'clock "
                           "every day except Sundays, when it leaves an hour later.", f"P{i}") for i in range(4)]


def _check(lm: Any) -> None:
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(PASSAGES)
    plan = eng.plan_parts(*RagTemplate().parts(eng.tokenizer, PASSAGES, "When does ferry 3 leave?"))
    keys, got, _ = eng._fetch_stored(plan)
    chunks, _, _ = pieces.run_whole(eng._complete(plan, keys, got, Timings(), pieces.WHOLE))  # misses computed
    other = torch.arange(100, 140)
    for spec in ("full", "relaxkv:r=0.15"):
        m = get_method(spec)

        def inp() -> Any:
            return assemble(eng.model, eng.rope, eng.spec, chunks, plan.suffix.token_ids)  # noqa: B023

        whole = m.fuse(inp())
        gen, n = m.fuse_pieces(inp(), pieces.Pace(lambda: 0.0)), 0
        try:
            while True:
                next(gen)
                n += 1
                if n % 16 == 0:  # another request's work between two pieces
                    hf_cache.forward(eng.model, other, None, start=0)
        except StopIteration as stop:
            split = stop.value
        assert n > 30, (spec, n)
        for a, b in zip(hf_cache.cache_to_tensors(whole.cache), hf_cache.cache_to_tensors(split.cache), strict=True):
            assert torch.equal(a, b), spec
        assert (whole.last_logits is None) == (split.last_logits is None)
        if whole.last_logits is not None:
            assert torch.equal(whole.last_logits, split.last_logits), spec


def test_pieces_are_bit_identical_float32(default_model_fp32: Any) -> None:
    _check(default_model_fp32)


def test_pieces_are_bit_identical_bfloat16(default_model_bf16: Any) -> None:
    _check(default_model_bf16)


def test_pieces_are_bit_identical_int4(default_model_int4: Any) -> None:
    _check(default_model_int4)
