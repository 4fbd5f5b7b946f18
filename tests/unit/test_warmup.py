"""The server's warm-up answer (kvrag.engine.warmup): it runs the one-time step checks before any client, writes
nothing to the store, keeps no conversation, and leaves later answers as they would be without it."""

from __future__ import annotations

import pytest

from kvrag.kv import step_backend
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_warm_up_checks_the_steps_and_leaves_nothing_behind() -> None:
    from kvrag.engine.warmup import warm_up

    store = MemoryStore()
    eng = tiny_engine("llama", store=store)
    cold = tiny_engine("llama")
    try:
        assert step_backend.chosen(eng.model, "decode") is None
        assert warm_up(eng, max_new_tokens=6) > 0
        assert step_backend.chosen(eng.model, "decode") is not None  # the first step's check is behind it
        assert store.stats()["entries"] == 0 and len(eng.conversations) == 0
        docs = ["The ferry leaves from the north pier every hour.", "Tickets cost twelve euros on board."]
        prompt = f"Context: {docs[0]} {docs[1]} Question: where does the ferry leave from? Answer:"
        eng.ingest(docs)
        cold.ingest(docs)
        for method in ("full", "stale"):
            got = eng.answer(prompt, docs, method=method, max_new_tokens=6).token_ids
            assert got == cold.answer(prompt, docs, method=method, max_new_tokens=6).token_ids
    finally:
        eng.close()
        cold.close()
