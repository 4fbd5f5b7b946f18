"""Speculative decoding on the real default model: greedy answers with prompt-lookup drafts are token-identical to
plain decoding for every method, alone and batched, and the drafts are accepted often enough to save forwards."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.index import make_chunks, read_documents
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]
DOCS = Path(__file__).parent.parent / "data" / "docs"
QUESTIONS = ["How tall is the Harrow Point Lighthouse?", "Who designed it?", "Quote the first sentence of the text."]
GEN = GenerationConfig(max_new_tokens=16)
METHODS = ("full", "stale", "relaxkv:r=0.15")


@pytest.fixture(scope="module")
def engines(default_model: Any) -> tuple[KVRAGEngine, KVRAGEngine, list[Any]]:
    store = MemoryStore()
    plain = KVRAGEngine(default_model, store, EngineConfig(speculative_tokens=0))
    spec = KVRAGEngine(default_model, store, EngineConfig(speculative_tokens=4, max_batch_size=4, speculative_max_batch=4))
    chunks = [render_passage(c.text) for c in make_chunks(read_documents(DOCS), lambda t: len(plain.tokenize(t)), 128)]
    plain.ingest(chunks)
    plans = [plain.plan_parts(*RagTemplate().parts(plain.tokenizer, chunks[i : i + 3], q))
             for i, q in enumerate(QUESTIONS)]
    return plain, spec, plans


def _tokens(eng: KVRAGEngine, plan: Any, method: str) -> tuple[list[int], Any]:
    prep = eng.prepare(plan, method, reserve=GEN.max_new_tokens)
    "".join(eng.stream(prep, GEN))
    return list(prep.token_ids), prep.stats


def test_answers_are_token_identical_and_save_forwards(engines: Any) -> None:
    plain, spec, plans = engines
    tokens = forwards = 0
    for method in METHODS:
        for plan in plans:
            want, _ = _tokens(plain, plan, method)
            got, stats = _tokens(spec, plan, method)
            assert got == want, method
            tokens += len(got) - 1
            forwards += stats.decode_forwards
    assert forwards < tokens  # drafts were accepted: fewer forwards than tokens after the first


def test_concurrent_answers_with_drafts_equal_plain_sequential(engines: Any) -> None:
    plain, spec, plans = engines
    jobs = [(p, "stale") for p in plans] + [(plans[0], "full")]
    want = [_tokens(plain, p, m)[0] for p, m in jobs]
    got: list[Any] = [None] * len(jobs)

    def work(k: int) -> None:
        got[k] = _tokens(spec, *jobs[k])[0]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want
    stats = spec.runner.stats()
    assert stats["verify_steps"] > 0 and stats["max_rows"] > 1 and stats["kv"]["leases"] == 0
