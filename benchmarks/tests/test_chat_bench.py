"""``kvrag bench chat`` in process (kvrag_bench.chat_bench.converse): two tiny engines, conversation cache on / off,
with each turn's ``full`` answer as the reference both are compared with, and the table it renders."""

from __future__ import annotations

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.store.memory import MemoryStore
from kvrag_bench.chat_bench import _scenario_lines, _summary, converse
from kvrag_testing.tiny import tiny_model


def test_a_conversation_reuses_history_and_is_compared_with_full() -> None:
    model = tiny_model("llama", init_std=0.02, seed=2)
    store = MemoryStore()
    reuse = KVRAGEngine(model, store, EngineConfig(max_context=1024, method="stale"))
    recompute = KVRAGEngine(model, store, EngineConfig(max_context=1024, method="stale", conversation_cache_bytes=0))
    chunks = ["\n\nThe tram runs every ten minutes.", "\n\nA day pass costs five euros."]
    questions = ["How often does the tram run?", "What does a pass cost?", "And a week?"]
    rows = converse(reuse, recompute, lambda k: chunks, questions, "stale", GenerationConfig(max_new_tokens=4),
                    full_reference=True)
    assert [r["reused_conversation"] > 0 for r in rows] == [False, True, True]
    assert all(r["same_answer"] for r in rows)  # stale's kept context is the one a fresh stale request assembles
    for r in rows:  # the reference is recomputed each turn: the reusing engine's history is its own answers
        assert isinstance(r["same_as_full_reuse"], bool) and r["same_as_full_reuse"] == r["same_as_full_recompute"]
    s = _summary(rows)
    assert s["same_as_full_reuse"] == sum(r["same_as_full_reuse"] for r in rows) and s["turns"] == 3
    md = "\n".join(_scenario_lines("fixed", {"rows": rows, "summary": s}))
    assert "| level reuse / recompute | same as full reuse / recompute |" in md
    assert f"reuse {s['same_as_full_reuse']}/3" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3 and len({line.count("|") for line in table}) == 1


def test_changing_passages_measure_the_moved_history_kl() -> None:
    """Passages that change every turn: the reusing engine's KL is measured with the turn before's history moved
    (before its answer replaces that kept entry), so from turn 2 on it is not the history-prefilled one."""
    model = tiny_model("llama", init_std=0.02, seed=2)
    store = MemoryStore()
    reuse = KVRAGEngine(model, store, EngineConfig(max_context=1024, method="stale"))
    recompute = KVRAGEngine(model, store, EngineConfig(max_context=1024, method="stale", conversation_cache_bytes=0))
    turns = [["\n\nThe tram runs every ten minutes."], ["\n\nA day pass costs five euros."],
             ["\n\nThe ferry leaves at noon."]]
    questions = ["How often does the tram run?", "What does a pass cost?", "And a week?"]
    rows = converse(reuse, recompute, lambda k: turns[k], questions, "stale", GenerationConfig(max_new_tokens=4),
                    kl=True)
    assert [r["reused_conversation"] > 0 for r in rows] == [False, True, True]
    assert rows[0]["kl_history_moved"] == rows[0]["kl_history_prefilled"]  # turn 1: no history
    assert all(r["kl_history_moved"] != r["kl_history_prefilled"] for r in rows[1:])
    assert reuse.conversations.stats()["moved_hits"] == 2 * 2  # each later turn: the KL prepare and the answer
    s = _summary(rows)
    assert s["mean_kl_history_moved"] == sum(r["kl_history_moved"] for r in rows) / 3
