"""Continuous batching on the real default model: in float32 a batched step's logits are within 1e-4 of each request
decoded alone (the model's own forward over a DynamicCache copy, as ``model.generate`` keeps it) and concurrent
answers equal sequential ones; in bfloat16 a batched step moves the logits by about what bf16 itself does
(:data:`BF16_TOLERANCE`) and greedy answers still equal sequential ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.index import make_chunks, read_documents
from kvrag.kv import batched, hf_cache
from kvrag.models import cpu_native_bf16, load_model
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.batching import compare_batched_to_alone

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]
DOCS = Path(__file__).parent.parent / "data" / "docs"
QUESTIONS = ["How tall is the Harrow Point Lighthouse?", "Who designed it?", "When did it open?",
             "What is this text about?"]
GEN = GenerationConfig(max_new_tokens=12)
BF16_TOLERANCE = 1.5
"""bf16: batched-step logits within this factor of the bf16 noise floor (max |bf16 - fp32| logit of the same
requests decoded alone, same tokens). A batched GEMM rounds its bf16 outputs after summing in another order, an
error of the same kind and size as bf16's own rounding, so the bound is that floor with a margin for the maximum of
a few hundred thousand logits."""


@pytest.fixture(scope="module")
def fp32_engine() -> KVRAGEngine:
    return KVRAGEngine(load_model(None, dtype="float32", quantize=None), MemoryStore(), EngineConfig())


@pytest.fixture(scope="module")
def bf16_engine() -> KVRAGEngine:
    if cpu_native_bf16() is None:
        pytest.skip("this CPU has no native bfloat16 unit (AMX / AVX512-BF16): bf16 would be emulated")
    return KVRAGEngine(load_model(None, dtype="bfloat16", quantize=None), MemoryStore(), EngineConfig())


@pytest.fixture(scope="module")
def int4_engine() -> KVRAGEngine:
    return KVRAGEngine(load_model(None, dtype="float32", quantize="int4"), MemoryStore(), EngineConfig())


def _plans(engine: KVRAGEngine) -> list:
    chunks = [render_passage(c.text)
              for c in make_chunks(read_documents(DOCS), lambda t: len(engine.tokenize(t)), 128)]
    engine.ingest(chunks)
    out = []
    for i, q in enumerate(QUESTIONS):  # a different chunk selection (and length) per request
        ps = chunks[i : i + 2 + i % 3]
        out.append(engine.plan_parts(*RagTemplate().parts(engine.tokenizer, ps, q)))
    return out


def _step_diffs(engine: KVRAGEngine, plans: list, steps: int,
                reference: KVRAGEngine | None = None) -> tuple[float, float]:
    """Largest |batched - alone| logit over ``steps`` batched steps of all plans (methods mixed), and with a
    ``reference`` engine (another dtype) the largest |alone - alone on the reference| for the same tokens."""
    methods = ["stale", "full", "stale", "full"]
    preps = [engine.prepare(p, m) for p, m in zip(plans, methods, strict=True)]
    refs = [reference.prepare(p, m) for p, m in zip(plans, methods, strict=True)] if reference else []
    got = compare_batched_to_alone(engine.model, preps, steps, reference_model=reference and reference.model,
                                   reference_preps=refs)
    return got.worst, got.floor


def _concurrent_answers(engine: KVRAGEngine, plans: list) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in plans]

    def work(i: int) -> None:
        out[i] = engine.answer_plan(plans[i], "stale", GEN).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


@pytest.mark.parametrize("variant", ["fp32_engine", "bf16_engine", "int4_engine"])
def test_batch_of_one_is_bit_identical_to_the_models_own_step(request: pytest.FixtureRequest, variant: str) -> None:
    engine = request.getfixturevalue(variant)
    prep = engine.prepare(_plans(engine)[0], "stale")
    buf, n = hf_cache.buffer_of(prep.cache)
    buf.reserve(n + 4)
    copy = hf_cache.KVBuffer.wrap(buf.keys.clone(), buf.values.clone()).as_cache(n)
    row, tok = batched.Row(buf, n), int(prep.last_logits.argmax())
    for _ in range(4):
        with hf_cache.model_lock(engine.model):
            got = batched.decode_step(engine.model, [row], [tok], batched.windows(engine.model))[0]
        ref, _ = hf_cache.forward(engine.model, torch.tensor([tok]), copy)
        assert torch.equal(got, ref[-1])
        row.length += 1
        tok = int(got.argmax())


def test_fp32_batched_logits_and_answers_equal_batch1(fp32_engine: KVRAGEngine) -> None:
    plans = _plans(fp32_engine)
    assert len({p.total_len for p in plans}) > 1
    assert _step_diffs(fp32_engine, plans, 6)[0] < 1e-4
    sequential = [fp32_engine.answer_plan(p, "stale", GEN).token_ids for p in plans]
    before = fp32_engine.batcher.stats()["rows_stepped"]
    assert _concurrent_answers(fp32_engine, plans) == sequential
    assert fp32_engine.batcher.stats()["rows_stepped"] > before


def test_bf16_batched_logits_within_the_bf16_noise_floor(bf16_engine: KVRAGEngine, fp32_engine: KVRAGEngine) -> None:
    engine = bf16_engine
    plans = _plans(engine)
    # the noise floor: what bf16 itself changes, i.e. the same requests decoded alone in bf16 vs in fp32 (same tokens)
    batched_vs_alone, floor = _step_diffs(engine, plans, 6, reference=fp32_engine)
    assert batched_vs_alone <= BF16_TOLERANCE * floor  # measured on a CPU with AMX: 0 (identical), floor 0.62
    sequential = [engine.answer_plan(p, "stale", GEN).token_ids for p in plans]
    assert _concurrent_answers(engine, plans) == sequential


def test_int4_batched_logits_within_the_quantization_noise_floor(int4_engine: KVRAGEngine,
                                                                  fp32_engine: KVRAGEngine) -> None:
    """int4 products run with bf16 activations and outputs, so a batched GEMM's other summation order moves the
    logits by bf16-sized amounts: bounded by the same factor of int4's own floor (int4 alone vs dense fp32 alone)."""
    plans = _plans(int4_engine)
    batched_vs_alone, floor = _step_diffs(int4_engine, plans, 6, reference=fp32_engine)
    assert 0 < floor and batched_vs_alone <= BF16_TOLERANCE * floor
    sequential = [int4_engine.answer_plan(p, "stale", GEN).token_ids for p in plans]
    assert _concurrent_answers(int4_engine, plans) == sequential


def test_int8_kv_concurrent_answers_equal_sequential() -> None:
    """kv_dtype="int8" on the real model in kvrag's defaults: each row's bits do not depend on its batch there
    either (quantized once as written, read per entry), so concurrent greedy answers equal sequential ones."""
    from kvrag.kv import row_attention

    lm = load_model(None)
    why = row_attention.why_not(lm.dtype, torch.int8)
    if why is not None:
        pytest.skip(f"kvrag's row attention does not read int8 K/V here: {why}")
    engine = KVRAGEngine(lm, MemoryStore(), EngineConfig(kv_dtype="int8"))
    plans = _plans(engine)
    sequential = [engine.answer_plan(p, "stale", GEN).token_ids for p in plans]
    assert all(sequential)
    assert _concurrent_answers(engine, plans) == sequential
