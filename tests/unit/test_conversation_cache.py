"""The conversation cache (kvrag/engine/conversation.py): the next turn of a chat reuses the answered turn's KV.

Exactness (``full`` with a reused prefix == ``model.generate`` given that prefix's KV), answers against
recomputation, LRU / byte / entry bounds, the bytes counted in the KV bound the scheduler leases from, stats.
"""

from __future__ import annotations

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.conversation import PREFILL_ROWS, ConversationCache
from kvrag.engine.lease import KVBudget
from kvrag.engine.planner import common_prefix
from kvrag.engine.scheduler import RequestState, Scheduler
from kvrag.errors import ConfigError
from kvrag.kv import hf_cache
from kvrag.prompting import render_chat, render_passage
from kvrag_testing.tiny import FAMILIES, tiny_engine

PASSAGES = [render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
            render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin")]
QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which city is larger?", "Name a museum."]


def chat(eng, method: str, turns: int, n: int = 8, chunks=PASSAGES):
    """Ask ``turns`` questions one after another, each answer appended to the history; returns the responses and
    the prompts."""
    msgs = [{"role": "system", "content": "Answer from these passages.\n" + "".join(chunks)}]
    out, prompts = [], []
    for q in QUESTIONS[:turns]:
        msgs.append({"role": "user", "content": q})
        prompt = render_chat(eng.tokenizer, msgs)
        r = eng.answer(prompt, chunks, method, max_new_tokens=n)
        out.append(r)
        prompts.append(prompt)
        msgs.append({"role": "assistant", "content": r.text})
    return out, prompts


def make(family: str = "llama", **cfg):
    """A tiny engine whose greedy answers run to ``max_new_tokens`` (no early EOS) on these prompts."""
    return tiny_engine(family, init_std=0.02, seed=0 if family == "qwen2" else 2, **cfg)


def generate(eng, ids, n, cache=None) -> list[int]:
    """``model.generate``'s greedy tokens up to its first EOS (``cache``: a prefix cache it continues from)."""
    prefix = {} if cache is None else {"cache": cache}
    out = eng.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             **prefix, do_sample=False, max_new_tokens=n,
                             pad_token_id=eng.tokenizer.pad_token_id)[0, len(ids):].tolist()
    eos = eng._eos_ids()
    return out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_full_with_a_reused_prefix_is_model_generate_after_that_prefix(family: str) -> None:
    """The reused positions are the KV the model computed on the same ids: ``full`` then generates exactly what
    ``model.generate`` does when given that prefix cache (the only difference from a fresh request)."""
    eng = make(family)
    (r1, r2), prompts = chat(eng, "full", 2)
    # turn 2 reuses turn 1's prompt but the last PREFILL_ROWS ids: the answer and its new message are prefilled
    n2 = len(eng.tokenize(prompts[1]))
    assert r1.stats.conversation_tokens == 0 and r2.stats.conversation_tokens == n2 - PREFILL_ROWS > 0
    prompt = prompts[1] + r2.text + "<|im_end|>\n<|im_start|>user\nWhich city is larger?<|im_end|>\n<|im_start|>assistant\n"
    ids = tuple(eng.tokenize(prompt))
    hit = eng.conversations.match(ids, repr(eng.method("full")), 0)  # what turn 3 reuses: turn 2's kept KV
    assert hit is not None and hit.length == min(n2, len(ids) - PREFILL_ROWS)
    e = hit.entry
    prefix = hf_cache.make_cache(e.keys[:, :, : hit.length].clone(), e.values[:, :, : hit.length].clone(),
                                 eng.model.config)
    r3 = eng.answer(prompt, PASSAGES, "full", max_new_tokens=8)
    assert r3.stats.conversation_tokens == hit.length
    assert r3.token_ids == generate(eng, list(ids), 8, prefix)
    # and equal to recomputing the whole history here (decode-written K/V is within low bits of prefill-written)
    assert r3.token_ids == generate(eng, list(ids), 8)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["stale", "full"])
def test_answers_with_reused_history_equal_recomputed_ones(method: str, family: str) -> None:
    reuse = make(family)
    fresh = make(family, conversation_cache_bytes=0)
    got, _ = chat(reuse, method, 4)
    ref, _ = chat(fresh, method, 4)
    assert [r.stats.conversation_tokens > 0 for r in got] == [False, True, True, True]
    assert all(r.stats.conversation_tokens == 0 for r in ref)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    # the hit prefilled only the new text: its prompt is the turn before's prompt + answer + the new message
    r = got[2]
    assert r.stats.reused_tokens == r.stats.conversation_tokens > got[1].stats.context_tokens
    assert r.stats.chunk_hits == 2 and r.stats.hit_rate == 1.0


def test_a_repeated_prompt_is_computed_afresh() -> None:
    """Not a next turn: the same prompt again is not served from the kept answer, so ``full`` on it still equals
    ``model.generate`` on its ids."""
    eng = make()
    prompt = render_chat(eng.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    a = eng.answer(prompt, (), "full", max_new_tokens=8)
    b = eng.answer(prompt, (), "full", max_new_tokens=8)
    assert b.stats.conversation_tokens == 0 and a.token_ids == b.token_ids
    assert b.token_ids == generate(eng, eng.tokenize(prompt), 8)


def test_another_method_or_changed_chunks_do_not_reuse() -> None:
    eng = make()
    (r1,), prompts = chat(eng, "stale", 1)
    msgs_next = prompts[0] + r1.text + "<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n"
    assert eng.answer(msgs_next, PASSAGES, "full", max_new_tokens=2).stats.conversation_tokens == 0
    other = [PASSAGES[1], PASSAGES[0]]  # the chunks changed: the history is no longer behind the same prefix
    (r,), _ = chat(eng, "stale", 1, chunks=other)
    assert r.stats.conversation_tokens == 0


def _cache(T: int, budget: KVBudget, L: int = 2, H: int = 1, D: int = 4):
    buf = hf_cache.KVBuffer(L, H, D, T + 3, torch.float32, "cpu")
    buf.keys.normal_()
    buf.values.normal_()
    return buf.as_cache(T)


def test_lru_entries_and_bytes_bounds() -> None:
    budget = KVBudget(10_000, 10)
    cc = ConversationCache(budget, max_bytes=300, max_entries=3)
    ids = {k: tuple(range(100 * k, 100 * k + 12)) for k in range(6)}  # a prompt of 8 tokens: 80 bytes each
    for k in range(3):
        assert cc.keep(ids[k], 8, "stale", _cache(12, budget))
    assert len(cc) == 3 and cc.nbytes == budget.cached == 240
    assert cc.match(ids[0] + (7,), "stale") is not None  # touched: now the most recent
    assert cc.keep(ids[3], 8, "stale", _cache(12, budget))  # over max_entries: the least recent (1) leaves
    assert cc.match(ids[1] + (7,), "stale") is None and cc.match(ids[0] + (7,), "stale") is not None
    big = tuple(range(1000, 1030))  # a prompt of 25 tokens, 250 bytes: the others leave for it
    assert cc.keep(big, 25, "stale", _cache(30, budget))
    assert cc.nbytes == budget.cached == 250 and len(cc) == 1
    assert not cc.keep(tuple(range(2000, 2041)), 31, "stale", _cache(41, budget))  # alone over max_bytes
    assert cc.stats()["too_large"] == 1


def test_a_buffer_with_little_spare_room_is_kept_without_a_copy() -> None:
    """A request's buffer whose room past the prompt is at most SPARE_SHARE of it is kept as it is (views: no copy of
    the prompt's K/V, counted at its whole capacity); a roomier one's prompt is copied out and counted alone."""
    from kvrag.engine.conversation import SPARE_SHARE

    budget = KVBudget(100_000, 10)
    cc = ConversationCache(budget, max_bytes=10_000, max_entries=8)
    prompt = 40
    snug = _cache(int(prompt * (1 + SPARE_SHARE)) - 3, budget)  # capacity: prompt * (1 + SPARE_SHARE)
    roomy = _cache(int(prompt * (1 + SPARE_SHARE)), budget)  # three positions more
    for cache, ids, shared in ((snug, tuple(range(45)), True), (roomy, tuple(range(100, 145)), False)):
        buf, _ = hf_cache.buffer_of(cache)
        assert cc.keep(ids, prompt, "stale", cache)
        entry = cc.match(ids + (1,), "stale").entry  # type: ignore[union-attr]
        assert torch.equal(entry.keys, buf.keys[:, :, :prompt]) and torch.equal(entry.values, buf.values[:, :, :prompt])
        same = entry.keys.untyped_storage().data_ptr() == buf.keys.untyped_storage().data_ptr()
        assert same is shared
        assert entry.nbytes == (buf.capacity if shared else prompt) * budget.bytes_per_token
    assert cc.nbytes == budget.cached == 10 * (50 + 40)


def test_a_hostile_client_cannot_grow_it() -> None:
    """Many distinct conversations: never more than the bounds, whatever the order."""
    budget = KVBudget(50_000, 16)
    cc = ConversationCache(budget, max_bytes=4_000, max_entries=8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        T = int(torch.randint(5, 120, (1,), generator=gen))
        ids = tuple(torch.randint(0, 1000, (T,), generator=gen).tolist())
        cc.keep(ids, T // 2, "stale", _cache(T, budget))
        assert len(cc) <= 8 and cc.nbytes <= 4_000 and budget.cached == cc.nbytes
        cc.match(ids + (1, 2), "stale")


def test_the_next_turn_replaces_the_turn_before() -> None:
    budget = KVBudget(10_000, 10)
    cc = ConversationCache(budget, max_bytes=5_000, max_entries=8)
    t1 = tuple(range(10))
    assert cc.keep(t1, 6, "stale", _cache(10, budget))
    hit = cc.match(t1 + (50, 51), "stale")
    assert hit is not None and hit.length == 6  # the prompt: the answer is prefilled again
    assert cc.match(t1[:6] + (99, 98), "stale") is None  # diverges inside the answer's first token: not a next turn
    t2 = t1 + (50, 51, 52)
    assert cc.keep(t2, 12, "stale", _cache(13, budget))
    assert len(cc) == 1 and cc.nbytes == 120
    assert cc.match(t2 + (1,), "full") is None  # another method's KV is never reused
    # a later turn asked differently (the conversation branches after turn 1's answer) still reuses turn 1
    hit = cc.match(t1 + (50, 77, 78), "stale")
    assert hit is not None and hit.length == 11
    long = t2 + tuple(range(60, 60 + PREFILL_ROWS))  # a long new text: the whole kept prompt is reused
    hit = cc.match(long, "stale")
    assert hit is not None and hit.length == 12
    p = tuple(range(1000, 1100))  # a short new text after a long prompt: PREFILL_ROWS ids are prefilled
    assert cc.keep(p + (7, 8), 100, "stale", _cache(102, budget))
    hit = cc.match(p + (7, 8, 9), "stale")
    assert hit is not None and hit.length == 103 - PREFILL_ROWS
    assert cc.match(p + (7, 8, 9), "stale", min_length=90).length == 100  # type: ignore[union-attr]
    assert cc.match(t1[:6] + (99,), "stale") is None  # a new question after the same first prompt: computed afresh


def test_kept_bytes_count_in_the_lease_accounting_and_give_way_to_requests() -> None:
    budget = KVBudget(1_000, 10)
    cc = ConversationCache(budget, max_bytes=1_000, max_entries=8)
    s = Scheduler(budget, max_batch_size=2)
    for k in range(4):
        assert cc.keep(tuple(range(100 * k, 100 * k + 24)), 20, "stale", _cache(24, budget))
    assert budget.cached == 800 and budget.snapshot()["cached"] == 800
    a = s.add(30)  # 300 bytes (30 positions): do not fit beside 800 kept bytes: the least recent entries are given back
    plan = s.schedule()
    assert plan.prepare == a and s.state(a) is RequestState.PREPARING
    assert budget.used + budget.cached <= budget.limit and len(cc) == 3 and cc.stats()["reclaimed"] == 1
    # an entry is only kept beside the leases: with 600 bytes leased, 450 more do not fit (the others leave)
    b = s.add(60)  # 600 bytes
    s.cancel(a)
    s.schedule()
    assert s.state(b) is RequestState.PREPARING and budget.used == 600 and budget.used + budget.cached <= 1_000
    assert not cc.keep(tuple(range(900, 950)), 45, "stale", _cache(50, budget))
    assert budget.used + budget.cached <= 1_000
    s.cancel(b)
    s.schedule()
    assert budget.used == 0


def test_engine_counts_kept_conversations_in_its_bound() -> None:
    eng = make(kv_memory_bytes=2 * 2**20)
    chat(eng, "stale", 2)
    kv = eng.runner.stats()["kv"]
    assert kv["used"] == 0 and 0 < kv["cached"] == eng.conversations.nbytes <= kv["limit"] // 4
    off = make(conversation_cache_bytes=0)
    chat(off, "stale", 2)
    assert off.runner.stats()["kv"]["cached"] == 0 and len(off.conversations) == 0


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="conversation_cache_bytes"):
        EngineConfig(conversation_cache_bytes=-1)
    with pytest.raises(ConfigError, match="conversation_cache_entries"):
        EngineConfig(conversation_cache_entries=0)


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix((1, 2, 3), (1, 9, 3)) == 1
    assert common_prefix((), (1,)) == 0
    for n in range(12):
        a = tuple(range(12))
        b = a[:n] + (99,) + a[n + 1 :]
        assert common_prefix(a, b) == n


def test_a_streamed_answer_is_kept_with_the_ids_its_kv_stands_for() -> None:
    eng = make()
    prompt = render_chat(eng.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    prep = eng.prepare(eng.plan(prompt, ()), "stale", reserve=6)
    text = "".join(eng.stream(prep, GenerationConfig(max_new_tokens=6)))
    assert text is not None
    (entry,) = eng.conversations._entries.values()
    n = len(prep.plan.token_ids)
    assert entry.ids[:n] == prep.plan.token_ids and entry.ids[n:] == tuple(prep.token_ids[: len(entry.ids) - n])
    assert entry.keys.shape[2] == entry.prompt_len == n and len(entry.ids) == hf_cache.cache_length(prep.cache)


def test_history_segments_are_the_earlier_turns() -> None:
    from kvrag.adapters import history_segments

    msgs = [{"role": "system", "content": "ctx"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "human", "content": "q2"}, {"role": "ai", "content": " "}, {"role": "user", "content": "q3"}]
    assert history_segments(msgs) == ["q1", "a1", "q2"]
    assert history_segments(msgs[:2]) == [] and history_segments([]) == []


def test_history_as_segments_when_the_chunks_change() -> None:
    """Chunks that change every turn: the earlier messages are reused from the store (placed at their new position)
    instead of prefilled again; with ``full`` (which reads no cache) the answer is the recomputed one."""
    from kvrag.adapters import chunk_texts, with_history

    eng = make(conversation_cache_bytes=0)
    history: list[dict[str, str]] = []
    prefilled = {}
    for turn, q in enumerate(QUESTIONS[:3]):
        chunks = [PASSAGES[turn % 2]]
        msgs = [{"role": "system", "content": "Answer.\n" + chunks[0]}, *history, {"role": "user", "content": q}]
        prompt = render_chat(eng.tokenizer, msgs)
        seg = chunk_texts(with_history(chunks, msgs))
        plain = eng.answer(prompt, chunks, "stale", max_new_tokens=8)
        r = eng.answer(prompt, seg, "stale", max_new_tokens=8)
        full_seg, full = (eng.answer(prompt, c, "full", max_new_tokens=8).token_ids for c in (seg, chunks))
        assert full_seg == full
        prefilled[turn] = (plain.stats.suffix_tokens, r.stats.suffix_tokens, r.stats.chunks_found,
                           (r.stats.chunk_hits, r.stats.chunk_misses))
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.text}]
    plain3, seg3, found3, hits3 = prefilled[2]
    # the passage and four earlier messages: the passage and turn 1's messages read from the store, turn 2's
    # question and answer (new) computed alone and stored
    assert found3 == 1 + 4 and hits3 == (3, 2)
    assert seg3 < plain3 // 2


def test_auto_agree_rechecks_a_kept_context_below_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto:agree`` on a next turn over a context its ladder left below ``full``: an unsure first token computes the
    prompt as ``full`` (the answer a recomputing engine gives when it escalates too, and the conversation kept is
    then ``full``'s); a confident one answers from the kept context."""
    from kvrag.fusion import escalate

    method = "auto:agree=0.9"
    reuse, fresh = make(), make(conversation_cache_bytes=0)
    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (0.0,))  # turn 1: the ladder stops at its first level
    (r1,), _ = chat(reuse, method, 1)
    assert r1.stats.method_stats.auto_choice == "stale" and r1.stats.conversation_tokens == 0
    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (1.01,))  # no first token is this sure: escalate
    msgs = [{"role": "system", "content": "Answer from these passages.\n" + "".join(PASSAGES)},
            {"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": r1.text},
            {"role": "user", "content": QUESTIONS[1]}]
    prompt = render_chat(reuse.tokenizer, msgs)
    r2 = reuse.answer(prompt, PASSAGES, method, max_new_tokens=8)
    ms = r2.stats.method_stats
    assert ms.auto_choice == "full" and ms.auto_confidences and ms.auto_confidences[0] < 1.01
    assert "conversation hit" in (ms.auto_reason or "") and r2.stats.conversation_tokens == 0
    ref = fresh.answer(prompt, PASSAGES, method, max_new_tokens=8)  # stale, unsure, then full: the same computation
    assert ref.stats.method_stats.auto_choice == "full" and r2.token_ids == ref.token_ids
    (entry,) = reuse.conversations._entries.values()
    assert entry.level == "full"
    # the kept context is full's now: the next turn reuses it without a check, whatever the threshold
    msgs += [{"role": "assistant", "content": r2.text}, {"role": "user", "content": QUESTIONS[2]}]
    r3 = reuse.answer(render_chat(reuse.tokenizer, msgs), PASSAGES, method, max_new_tokens=8)
    assert r3.stats.conversation_tokens > 0 and r3.stats.method_stats.auto_choice == "full"


def test_auto_agree_answers_a_confident_next_turn_from_the_kept_context(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag.fusion import escalate

    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (0.0,))
    reuse = make()
    r1, r2 = chat(reuse, "auto:agree=0.9", 2)[0]
    assert r1.stats.conversation_tokens == 0 and r2.stats.conversation_tokens > 0
    ms = r2.stats.method_stats
    assert ms.auto_choice == "stale" and ">= 0.000 over the kept stale" in (ms.auto_reason or "")
    assert reuse.method("auto:agree=0.9").kept_context_threshold("full") is None
    assert reuse.method("stale").kept_context_threshold("stale") is None


def test_auto_escalated_to_full_over_an_inexact_splice_is_full_and_its_next_turn_reuses_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A passage placed after indentation: its first token merges with the spaces inside the prompt, so the plan
    splices it inexactly. ``auto``'s last level computes the prompt's own ids, as ``full`` does -- the same
    answer token for token -- and the next turn reuses that conversation."""
    from kvrag.fusion import escalate

    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (1.01,))  # every ladder ends at full
    eng = make()
    chunks = ["source: fares.md\n\nA day pass costs 9 marks.", *PASSAGES]
    msgs = [{"role": "system", "content": "Documents:\n\n  " + "".join(chunks)},
            {"role": "user", "content": QUESTIONS[0]}]
    prompt = render_chat(eng.tokenizer, msgs)
    eng.ingest(chunks, progress=False)
    plan = eng.plan(prompt, chunks)
    assert plan.inexact_chunks > 0 and plan.token_ids != tuple(eng.tokenize(prompt))  # the case under test
    auto_prep, full_prep = (eng.prepare(eng.plan(prompt, chunks), m, reserve=1) for m in ("auto:agree=0.9", "full"))
    assert auto_prep.plan.token_ids == full_prep.plan.token_ids == tuple(eng.tokenize(prompt))
    assert torch.equal(auto_prep.last_logits, full_prep.last_logits)  # the same computation, bit for bit
    del auto_prep, full_prep  # their KV goes back
    r1 = eng.answer(prompt, chunks, "auto:agree=0.9", max_new_tokens=8)
    full = eng.answer(prompt, chunks, "full", max_new_tokens=8)
    assert r1.token_ids == full.token_ids == generate(eng, eng.tokenize(prompt), 8)
    assert r1.stats.method_stats.auto_choice == "full" and r1.stats.reused_tokens == 0
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": QUESTIONS[1]}]
    prompt2 = render_chat(eng.tokenizer, msgs)
    hit = eng.prepare(eng.plan(prompt2, chunks), "auto:agree=0.9", reserve=1)  # over full's kept context: full's bits
    fresh = make(conversation_cache_bytes=0)
    ref = fresh.prepare(fresh.plan(prompt2, chunks), "full", reserve=1)
    assert hit.stats.conversation_tokens > 0 and torch.equal(hit.last_logits, ref.last_logits)
    del hit, ref
    r2 = eng.answer(prompt2, chunks, "auto:agree=0.9", max_new_tokens=8)
    assert r2.stats.conversation_tokens > 0  # kept under the prompt's own ids: reused
    assert r2.stats.chunk_hits == len(chunks) and r2.stats.inexact_chunks == 1  # counted on the spliced plan
    assert r2.stats.method_stats.auto_choice == "full"
    assert r2.token_ids == generate(eng, eng.tokenize(prompt2), 8)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kept_conversation_is_the_bits_of_one_prefill_of_the_whole_history(dtype: torch.dtype) -> None:
    """Every kept position was written by a prefill (the answer's decode-written K/V is prefilled again with the next
    message) and a prefill row's bits do not depend on the split: turn 3's kept K/V equal one prefill of its ids."""
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore
    from kvrag_testing.tiny import tiny_model

    eng = KVRAGEngine(tiny_model("llama", init_std=0.02, seed=2, dtype=dtype), MemoryStore(), EngineConfig())
    out, prompts = chat(eng, "full", 3)
    assert [r.stats.conversation_tokens > 0 for r in out] == [False, True, True]
    (entry,) = eng.conversations._entries.values()
    assert entry.prompt_len == len(eng.tokenize(prompts[2]))
    with torch.inference_mode():
        keys, values = hf_cache.prefill_kv(eng.model, torch.tensor(entry.ids[: entry.prompt_len]))
    assert torch.equal(entry.keys, keys) and torch.equal(entry.values, values)


def test_auto_escalated_to_full_reports_nothing_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole prompt recomputed by auto's last level: no token's K/V came from the store or a kept turn, so the
    stats (and kvrag serve's cached_tokens) say 0, as for ``full`` -- also over an exact splice."""
    from kvrag.fusion import escalate

    monkeypatch.setitem(escalate.AGREE_THRESHOLDS, 0.9, (1.01,))  # every ladder ends at full
    eng = make()
    prompt = render_chat(eng.tokenizer, [{"role": "system", "content": "Documents:" + "".join(PASSAGES)},
                                         {"role": "user", "content": QUESTIONS[0]}])
    eng.ingest(PASSAGES, progress=False)
    assert eng.plan(prompt, PASSAGES).inexact_chunks == 0  # the case under test: nothing re-tokenized
    stale = eng.answer(prompt, PASSAGES, "stale", max_new_tokens=2)
    assert stale.stats.reused_tokens > 0
    r = eng.answer(prompt, PASSAGES, "auto:agree=0.9", max_new_tokens=2)
    assert r.stats.method_stats.auto_choice == "full" and r.stats.chunk_hits == len(PASSAGES)
    assert r.stats.reused_tokens == 0 and r.stats.conversation_tokens == 0
