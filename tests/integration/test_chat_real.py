"""A 4-turn chat on the real default model: from turn 2 the turn before's prompt KV is reused (the answer and the new
message are prefilled), ``full`` with the reused prefix is ``model.generate`` after that prefix, and the answers
equal those with the whole history recomputed, every one: the kept K/V are the bits of one prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.conversation import PREFILL_ROWS
from kvrag.engine.engine import KVRAGEngine
from kvrag.index import make_chunks, read_documents
from kvrag.kv import hf_cache
from kvrag.prompting import render_chat, render_passage
from kvrag.store.memory import MemoryStore

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]
DOCS = Path(__file__).parent.parent / "data" / "docs"
QUESTIONS = ["How tall is the Harrow Point Lighthouse?", "Who designed it?", "When was it built?",
             "Summarize what you said."]
GEN = GenerationConfig(max_new_tokens=20)


@pytest.fixture(scope="module")
def setup(default_model: Any) -> tuple[KVRAGEngine, KVRAGEngine, list[str]]:
    store = MemoryStore()
    reuse = KVRAGEngine(default_model, store, EngineConfig())
    recompute = KVRAGEngine(default_model, store, EngineConfig(conversation_cache_bytes=0))
    chunks = [render_passage(c.text) for c in make_chunks(read_documents(DOCS), lambda t: len(reuse.tokenize(t)), 128)]
    reuse.ingest(chunks[:4])
    return reuse, recompute, chunks[:4]


def _prompt(eng: KVRAGEngine, chunks: list[str], history: list[dict[str, str]], q: str) -> str:
    system = {"role": "system", "content": "Answer from these passages.\n" + "".join(chunks)}
    return render_chat(eng.tokenizer, [system, *history, {"role": "user", "content": q}])


@pytest.mark.parametrize("method", ["stale", "full"])
def test_chat_reuses_history_and_answers_as_recomputed(setup: Any, method: str) -> None:
    reuse, recompute, chunks = setup
    history: list[dict[str, str]] = []
    same, before = 0, 0
    for turn, q in enumerate(QUESTIONS):
        prompt = _prompt(reuse, chunks, history, q)
        r = reuse.answer(prompt, chunks, method, GEN)
        f = recompute.answer(prompt, chunks, method, GEN)
        n = r.stats.context_tokens + r.stats.suffix_tokens  # the plan's ids (a chunk may splice one longer)
        if turn == 0:
            assert r.stats.conversation_tokens == 0
        else:  # the turn before's prompt came from the conversation (at least PREFILL_ROWS prefilled)
            assert min(before, n - PREFILL_ROWS) <= r.stats.conversation_tokens <= before
            assert r.stats.reused_tokens >= r.stats.conversation_tokens and f.stats.conversation_tokens == 0
        same += r.token_ids == f.token_ids
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": r.text}]
        before = n
    # every kept position was written by a prefill whose bits do not depend on how the history was split
    assert same == len(QUESTIONS), f"{same}/{len(QUESTIONS)} answers equal the recomputed ones"
    kv = reuse.runner.stats()["kv"]
    assert kv["used"] == 0 and 0 < kv["cached"] <= kv["limit"]


def test_full_with_the_reused_prefix_is_model_generate_after_it(setup: Any) -> None:
    reuse, _, chunks = setup
    first = _prompt(reuse, chunks, [], QUESTIONS[0])
    a = reuse.answer(first, chunks, "full", GEN)
    prompt = _prompt(reuse, chunks, [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": a.text}],
                     QUESTIONS[1])
    ids = reuse.tokenize(prompt)
    hit = reuse.conversations.match(ids, repr(reuse.method("full")), 0)
    assert hit is not None
    keys, values = hit.entry.keys[:, :, : hit.length].clone(), hit.entry.values[:, :, : hit.length].clone()
    r = reuse.answer(prompt, chunks, "full", GEN)
    assert r.stats.conversation_tokens == hit.length
    with hf_cache.model_lock(reuse.model):
        out = reuse.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   cache=hf_cache.make_cache(keys, values, reuse.model.config), do_sample=False,
                                   max_new_tokens=GEN.max_new_tokens,
                                   pad_token_id=reuse.tokenizer.pad_token_id)[0, len(ids):].tolist()
    eos = reuse._eos_ids()
    assert r.token_ids == out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
