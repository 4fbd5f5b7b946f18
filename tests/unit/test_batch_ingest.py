"""Batched ingest (kvrag.engine.ingest_prefill): every chunk's K/V and key equal its one-at-a-time prefill."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.ingest_prefill import compute_chunk_kvs, plan_batches, prefill_prefix
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.prompting import render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.equivalence import BF16_REL  # docs/architecture.md#batched-ingest
from kvrag_testing.tiny import FAMILIES, tiny_model

FP32_ATOL = 1e-4  # the bound; measured ~1e-6 on these models


def _random_ids(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _max_diff(a, b) -> float:
    return max((a.keys.float() - b.keys.float()).abs().max().item(),
               (a.values.float() - b.values.float()).abs().max().item())


# ---- planning (pure) -------------------------------------------------------------------------------------------------
def test_plan_batches_covers_every_index_once_grouped_by_length() -> None:
    lengths = [5, 50, 7, 49, 6, 48, 1, 300]
    batches = plan_batches(lengths, batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) <= 3 for b in batches)
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True)  # longest first, so a batch holds similar lengths
    assert [[lengths[i] for i in b] for b in batches] == [[300], [50, 49, 48], [7, 6], [5], [1]]  # <= 20% padding
    capped = plan_batches(lengths, batch_size=8, max_batch_tokens=100)
    assert all(len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1 for b in capped)
    assert [7] in capped  # the 300-token chunk is alone
    assert plan_batches([], 4) == []


@pytest.mark.parametrize("bad", [0, -1])
def test_plan_batches_rejects_bad_sizes(bad: int) -> None:
    with pytest.raises(ConfigError, match="batch_size must be >= 1"):
        plan_batches([3], bad)
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        plan_batches([3], 2, max_batch_tokens=bad)


# ---- exactness ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_prefix", [True, False])
def test_batched_kv_equals_one_at_a_time(family: str, with_prefix: bool) -> None:
    eng = KVRAGEngine(tiny_model(family), MemoryStore(), EngineConfig(chunk_prefix="template" if with_prefix else "none"))
    assert bool(eng.chunk_prefix_ids) == with_prefix
    ids = _random_ids(11, seed=1)
    refs = [compute_chunk_kv(eng.model, eng.rope, eng.spec, r, eng.chunk_prefix_ids) for r in ids]
    for bs in (1, 3, 16):
        got = compute_chunk_kvs(eng.model, eng.rope, eng.spec, ids, eng.chunk_prefix_ids, bs)
        assert len(got) == len(ids)
        for r, ref, g in zip(ids, refs, got, strict=True):
            assert g.token_ids.tolist() == r and g.keys.shape == ref.keys.shape and g.keys.dtype == ref.keys.dtype
            assert _max_diff(ref, g) <= FP32_ATOL, (family, bs)


def test_batched_kv_bf16_within_documented_tolerance() -> None:
    lm = tiny_model("qwen3", dtype=torch.bfloat16)
    eng = KVRAGEngine(lm, MemoryStore())
    ids = _random_ids(6, seed=2)
    got = compute_chunk_kvs(eng.model, eng.rope, eng.spec, ids, eng.chunk_prefix_ids, 4)
    for r, g in zip(ids, got, strict=True):
        ref = compute_chunk_kv(eng.model, eng.rope, eng.spec, r, eng.chunk_prefix_ids)
        assert g.keys.dtype == torch.bfloat16
        scale = max(ref.keys.float().abs().max().item(), ref.values.float().abs().max().item())
        assert _max_diff(ref, g) <= BF16_REL * scale


def test_prefix_kv_is_checked_and_empty_chunks_refused() -> None:
    eng = KVRAGEngine(tiny_model("llama"), MemoryStore())
    pk = prefill_prefix(eng.model, eng.chunk_prefix_ids)
    assert pk is not None and pk[0].shape[2] == len(eng.chunk_prefix_ids)
    assert prefill_prefix(eng.model, ()) is None
    with pytest.raises(ConfigError, match="prefix_kv holds"):
        compute_chunk_kvs(eng.model, eng.rope, eng.spec, [[5, 6]], eng.chunk_prefix_ids[:-1], 2, prefix_kv=pk)
    with pytest.raises(ConfigError, match="chunk #1 has no token ids"):
        compute_chunk_kvs(eng.model, eng.rope, eng.spec, [[5], []], (), 2)


# ---- engine.ingest ---------------------------------------------------------------------------------------------
TEXTS = [render_passage(f"Passage {i}. " + "The quick brown fox jumps over the lazy dog. " * (1 + i % 5), f"T{i}")
         for i in range(14)]


def test_ingest_batched_stores_the_same_keys_and_kv_as_one_at_a_time() -> None:
    lm = tiny_model("llama")
    one, many = KVRAGEngine(lm, MemoryStore()), KVRAGEngine(lm, MemoryStore())
    k1 = one.ingest(TEXTS, batch_size=1)
    k8 = many.ingest(TEXTS, batch_size=8)
    assert k1 == k8 == [many.chunk_key(many.tokenize(t)) for t in TEXTS]
    for k in k1:
        a, b = one.store.get(k), many.store.get(k)
        assert a is not None and b is not None and _max_diff(a, b) <= FP32_ATOL
        ref = many.compute(b.token_ids.tolist())  # the single-chunk path
        assert _max_diff(ref, b) <= FP32_ATOL
    assert many.counters["chunks_computed"] == len(TEXTS) + 14  # 14 ingested + 14 reference computes


def test_ingest_resumes_skips_empty_and_dedupes(caplog: pytest.LogCaptureFixture) -> None:
    eng = KVRAGEngine(tiny_model("qwen3"), MemoryStore())
    first = eng.ingest(TEXTS[:5], batch_size=4)
    assert eng.counters["chunks_computed"] == 5
    with caplog.at_level(logging.WARNING, logger="kvrag.engine.engine"):
        keys = eng.ingest([*TEXTS, "  \n", TEXTS[7]], batch_size=4)
    assert "skipping empty or whitespace-only chunk #14" in caplog.text
    assert keys[:5] == first and len(keys) == len(TEXTS) + 1 and keys[-1] == keys[7]
    assert eng.counters["chunks_computed"] == len(TEXTS)  # only the 9 new ones, the repeat computed once
    assert eng.counters["chunks_reused"] == 5 + 1
    assert sorted(eng.store.iter_keys()) == sorted(set(keys))


def test_ingest_bad_batch_size_and_too_long_chunk_store_nothing() -> None:
    eng = KVRAGEngine(tiny_model("llama"), MemoryStore(), EngineConfig(max_context=32, chunk_prefix="none"))
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
        eng.ingest(["short text"], batch_size=0)
    long = "The quick brown fox jumps over the lazy dog. " * 10
    with pytest.raises(ContextLengthError, match="smaller chunks"):
        eng.ingest(["short text", long], batch_size=4)
    assert list(eng.store.iter_keys()) == []  # lengths are checked before anything is computed


def test_ensure_reports_cached_and_skips_empty() -> None:
    eng = KVRAGEngine(tiny_model("mistral"), MemoryStore())
    out = eng.ensure([TEXTS[0], "", TEXTS[1], TEXTS[0]], batch_size=2)
    assert [c for _, c in out] == [False, False, False, True] and out[1] == (None, False)
    assert out[0][0].key == out[3][0].key == eng.chunk_key(eng.tokenize(TEXTS[0]))
    again = eng.ensure([TEXTS[1], TEXTS[2]])
    assert [c for _, c in again] == [True, False]
    ref = eng.chunk_ref(eng.tokenize(TEXTS[2]), text=TEXTS[2])
    assert eng.ensure([ref]) == [(again[1][0], True)] and ref == again[1][0]


@pytest.mark.parametrize(("dtype", "route"), [(torch.float32, "int4"), (torch.bfloat16, "int4"),
                                              (torch.bfloat16, "packed")])
def test_chunk_caches_take_the_dense_products_whatever_their_rows(dtype: torch.dtype, route: str) -> None:
    """Products of at most 16 rows take the decode route (int4 weights, packed bf16 linears): a chunk of a few tokens
    prefilled alone got other bits than inside a batch, so the answer to a request depended on how its passages had
    been registered (one POST or several). Every chunk forward takes the dense products now: the same bits as the
    same model without the decode route, alone and in batches of any size."""
    from kvrag.kv.linear import pack_linears

    fast = tiny_model("qwen2", init_std=0.1, dtype=dtype, quantize="int4" if route == "int4" else None)
    dense = tiny_model("qwen2", init_std=0.1, dtype=dtype)  # the same weights, dense products only
    if route == "packed" and not pack_linears(fast.model):
        pytest.skip("no oneDNN bf16 packed linears on this CPU")
    spec = KVSpec.from_model_config(dense.model.config, dtype=dtype)
    rope = Rope.from_model(dense.model)
    prefix = [3, 4, 5]
    ids = [[7 + i for i in range(n)] for n in (4, 11, 13, 15, 18)]
    want = [compute_chunk_kv(dense.model, rope, spec, r, prefix) for r in ids]
    for a, b in zip(want, [compute_chunk_kv(fast.model, rope, spec, r, prefix) for r in ids], strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), len(a.token_ids)
    for batch in (1, 2, 8):
        got = compute_chunk_kvs(fast.model, rope, spec, ids, prefix, batch)
        for a, b in zip(compute_chunk_kvs(dense.model, rope, spec, ids, prefix, batch), got, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), (batch, len(a.token_ids))
