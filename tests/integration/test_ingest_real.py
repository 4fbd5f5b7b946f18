"""Batched ingest on the real default model: same keys and K/V as one chunk at a time (fp32: <= 1e-4; bf16: the
documented bf16 bound of :mod:`kvrag_testing.equivalence`)."""

from __future__ import annotations

import pytest

from kvrag.engine.engine import KVRAGEngine
from kvrag.prompting import render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.equivalence import assert_close_in_dtype

pytestmark = pytest.mark.integration

TEXTS = [render_passage(t, f"Doc {i}") for i, t in enumerate([
    "The lighthouse on Kessler Point was built in 1871 by the harbour board.",
    "Ferries leave the north pier every forty minutes; the last one departs at 22:10.",
    "A day pass costs 9 marks and covers every ferry and bus line in the district.",
    "The observatory opens its dome to visitors on clear Friday nights from April to October.",
    "Apples from the cooperative are pressed into cider in late autumn.",
])]


def test_batched_ingest_equals_one_at_a_time_on_the_default_model(default_model) -> None:
    one, many = KVRAGEngine(default_model, MemoryStore()), KVRAGEngine(default_model, MemoryStore())
    k1, k4 = one.ingest(TEXTS, batch_size=1), many.ingest(TEXTS, batch_size=4)
    assert k1 == k4
    for k, t in zip(k1, TEXTS, strict=True):
        ref = one.compute(one.tokenize(t))  # compute_chunk_kv: prefix + chunk in one forward
        got = many.store.get(k)
        assert got is not None and got.token_ids.tolist() == ref.token_ids.tolist()
        assert_close_in_dtype(got.keys, ref.keys, default_model.dtype, fp32_atol=1e-4)
        assert_close_in_dtype(got.values, ref.values, default_model.dtype, fp32_atol=1e-4)
