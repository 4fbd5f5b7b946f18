"""A kept conversation's history moved behind new passages (kvrag.engine.relocate)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrag.engine.conversation import Entry
from kvrag.engine.planner import common_suffix
from kvrag.engine.relocate import MIN_MOVED, find_moved, moved_plan
from kvrag.kv import hf_cache
from kvrag.prompting import render_chat, render_passage
from kvrag_testing.tiny import tiny_engine

PASSAGES = [render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
            render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
            render_passage("Madrid is the capital of Spain. It lies in the middle of the country.", "Madrid")]
QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which city is larger?"]


def _entry(ids: list[int], prompt_len: int, method: str = "stale", L: int = 2, H: int = 1, D: int = 4) -> Entry:
    keys = torch.randn(L, H, prompt_len, D)
    return Entry(tuple(ids), prompt_len, prompt_len, method, keys, torch.randn(L, H, prompt_len, D), 0)


def test_common_suffix() -> None:
    assert common_suffix([1, 2, 3], [9, 2, 3]) == 2
    assert common_suffix([1, 2, 3], [1, 2, 3]) == 3
    assert common_suffix([1, 2, 3], [4]) == 0
    assert common_suffix([], [1]) == 0
    assert common_suffix(list(range(100)), [7, *range(40, 100)]) == 60


def test_find_moved_takes_the_kept_tail_followed_by_its_answer() -> None:
    history = list(range(1000, 1040))  # the kept prompt's tail: the history
    kept = _entry([5, 6, 7, *history, 77, 78], prompt_len=43)  # old passages, history, answer 77 78
    ids = [5, 9, 9, 9, 9, *history, 77, 78, 200, 201]  # new passages, the same history, the answer, a new message
    m = find_moved([kept], ids, context_len=5, method="stale")
    assert m is not None and (m.old_start, m.new_start, m.length) == (3, 5, 40)
    # the block must start after the request's context, and is cut there when it would reach into it
    assert find_moved([kept], ids, context_len=10, method="stale").length == 35
    # another method's conversation, a tail not followed by the kept answer, a too short tail: no move
    assert find_moved([kept], ids, context_len=5, method="cacherepair") is None
    assert find_moved([kept], [5, 9, *history, 99, 200], context_len=2, method="stale") is None
    # the kept answer must follow whole: another conversation's history that only starts its answer alike is not moved
    assert find_moved([kept], [5, 9, *history, 77, 79, 200], context_len=2, method="stale") is None
    short = _entry([5, *history[: MIN_MOVED - 1], 77], prompt_len=MIN_MOVED)
    assert find_moved([short], [9, *history[: MIN_MOVED - 1], 77, 3], context_len=1, method="stale") is None
    # the longest tail of several kept requests wins
    longer = _entry([1, 2, 4, 9, *history, 77], prompt_len=44)
    assert find_moved([kept, longer], [5, 2, 4, 9, *history, 77, 3], context_len=1, method="stale").length == 43


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi", "gpt_neox"])  # per-layer tables, partial rotary
def test_moved_plan_holds_the_kept_kv_without_rope(family: str) -> None:
    eng = tiny_engine(family, init_std=0.02, seed=2)
    prompt = render_chat(eng.tokenizer, [{"role": "system", "content": "Answer.\n" + PASSAGES[0]},
                                         {"role": "user", "content": QUESTIONS[0]}])
    plan = eng.plan(prompt, [PASSAGES[0]])
    ids = list(plan.token_ids)
    n = len(plan.suffix.token_ids) - 1
    old = torch.arange(7, 7 + n)
    keys, values = hf_cache.prefill_kv(eng.model, torch.tensor(ids))
    kept_ids = [ids[0]] * 7 + ids[plan.context_len: plan.context_len + n] + [ids[-1]]
    L, H, _, D = keys.shape
    kk = torch.zeros(L, H, 7 + n, D, dtype=keys.dtype)
    kk[:, :, 7:] = eng.rope.rotate(eng.rope.canonicalize(keys[:, :, plan.context_len: -1],
                                                         torch.arange(plan.context_len, len(ids) - 1)), old)
    vv = torch.zeros_like(kk)
    vv[:, :, 7:] = values[:, :, plan.context_len: -1]
    e = Entry(tuple(kept_ids), 7 + n, 7 + n, "stale", kk, vv, 0)
    m = find_moved([e], ids + [1], plan.context_len, "stale", min_length=2)
    assert m is not None and (m.old_start, m.new_start, m.length) == (7, plan.context_len, n)
    moved = moved_plan(plan, m, eng.rope, eng.spec)
    assert moved.token_ids == plan.token_ids and moved.context_len == len(ids) - 1
    seg = moved.context[-1]
    held = moved.held[seg.key]
    assert seg.kind == "kept" and held.token_ids.tolist() == ids[plan.context_len: -1]
    torch.testing.assert_close(held.values, values[:, :, plan.context_len: -1].to(held.values.dtype))
    # placed back at the request's positions, the keys are the prefill's
    placed = eng.rope.rotate(held.keys, torch.arange(plan.context_len, len(ids) - 1))
    torch.testing.assert_close(placed.float(), keys[:, :, plan.context_len: -1].float(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not match"):
        moved_plan(plan, dataclasses.replace(m, new_start=m.new_start + 1), eng.rope, eng.spec)


def _chat(eng, method: str, turns: int, **kw):
    """A chat whose passages change every turn; returns the responses."""
    history: list[dict[str, str]] = []
    out = []
    for turn, q in enumerate(QUESTIONS[:turns]):
        chunks = [PASSAGES[turn % len(PASSAGES)]]
        msgs = [{"role": "system", "content": "Answer.\n" + chunks[0]}, *history, {"role": "user", "content": q}]
        r = eng.answer(render_chat(eng.tokenizer, msgs), chunks, method, max_new_tokens=8, **kw)
        out.append(r)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.text}]
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_chat_whose_passages_change_moves_its_kept_history(family: str) -> None:
    eng = tiny_engine(family, init_std=0.02, seed=2, move_history=True)
    off = tiny_engine(family, init_std=0.02, seed=2, move_history=False)
    rs = _chat(eng, "stale", 3)
    plain = _chat(off, "stale", 3)
    assert rs[0].stats.conversation_tokens == 0
    for r, p in zip(rs[1:], plain[1:], strict=True):
        # the history comes from the kept conversation; only the answer and the new message are prefilled
        assert r.stats.conversation_tokens >= MIN_MOVED
        assert r.stats.suffix_tokens < p.stats.suffix_tokens
        assert r.stats.suffix_tokens + r.stats.conversation_tokens <= p.stats.suffix_tokens
        assert p.stats.conversation_tokens == 0
    assert eng.conversations.stats()["moved_hits"] == 2 and "moved_hits" not in off.conversations.stats()
    # each turn's entry replaces the one it moved from: one entry for the conversation, as for a fixed-chunk chat
    assert len(eng.conversations) == 1 and len(off.conversations) == 3


def test_full_never_moves_a_kept_history() -> None:
    eng = tiny_engine("llama", init_std=0.02, seed=2, move_history=True)
    rs = _chat(eng, "full", 3)
    assert all(r.stats.conversation_tokens == 0 for r in rs)
    assert eng.conversations.stats().get("moved_hits", 0) == 0


def test_a_chat_without_chunks_moves_its_history_behind_a_new_system_message() -> None:
    """Passages pasted into the system message, not offered as chunks: the new system message is the prefix
    (computed exactly from position 0), the kept history follows it."""
    eng = tiny_engine("llama", init_std=0.02, seed=2, move_history=True)
    history: list[dict[str, str]] = []
    for turn, q in enumerate(QUESTIONS[:2]):
        msgs = [{"role": "system", "content": "Answer.\n" + PASSAGES[turn]}, *history, {"role": "user", "content": q}]
        prompt = render_chat(eng.tokenizer, msgs)
        if turn:
            prep = eng.prepare(eng.plan(prompt, []), "stale", reserve=1)
            kinds = [s.kind for s in prep.plan.context]
            assert kinds == ["prefix", "kept"] and prep.plan.context[0].start == 0
            assert prep.stats.conversation_tokens == len(prep.plan.context[1].token_ids) >= MIN_MOVED
            del prep
        r = eng.answer(prompt, [], "stale", max_new_tokens=8)
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.text}]


def test_an_escalation_to_full_over_a_moved_history_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto:agree`` unsure over the moved history computes the prompt as ``full``: the answer is a recomputing
    engine's (the moved K/V do not reach ``full``'s computation), and its (``full``) entry replaces the one it moved
    from. Nothing reused reached the answer, so nothing is counted as reused."""
    from kvrag.fusion import escalate

    method = "auto:agree=0.9"
    eng = tiny_engine("llama", init_std=0.02, seed=2, move_history=True)
    fresh = tiny_engine("llama", init_std=0.02, seed=2, conversation_cache_bytes=0)
    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (0.0,))  # turn 1: the ladder stops at its first level
    (r1,) = _chat(eng, method, 1)
    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (1.01,))  # no first token is this sure: escalate
    msgs = [{"role": "system", "content": "Answer.\n" + PASSAGES[1]}, {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": r1.text}, {"role": "user", "content": QUESTIONS[1]}]
    prompt = render_chat(eng.tokenizer, msgs)
    r2 = eng.answer(prompt, [PASSAGES[1]], method, max_new_tokens=8)
    assert eng.conversations.stats()["moved_hits"] == 1
    assert r2.stats.method_stats.auto_choice == "full" and r2.stats.conversation_tokens == r2.stats.reused_tokens == 0
    assert r2.token_ids == fresh.answer(prompt, [PASSAGES[1]], method, max_new_tokens=8).token_ids
    (entry,) = eng.conversations._entries.values()
    assert entry.level == "full" and entry.ids[: entry.prompt_len] == tuple(eng.tokenize(prompt))
