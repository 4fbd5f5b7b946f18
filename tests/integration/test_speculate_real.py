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


def test_a_verify_step_gives_plain_steps_logits_in_dense_bfloat16(default_model_bf16: Any) -> None:
    """The real model in bfloat16 with the file's weights de-quantized for every product (``quantize=None``): a
    verify forward of 9 tokens gives, at each position, the logits of plain one-token steps bit for bit. oneDNN sums
    a one-row bf16 product over K in another order than a product of several rows (``down_proj``, K = 1536), so
    without one-row products running the multi-row kernel (``kvrag.kv.linear.ONE_ROW``) positions of this prompt
    differed by up to 0.4 in a logit, and greedy answers with speculation left ``model.generate``'s on exact bf16
    ties (the second question: "opens at 10:00" against "is open on Mondays")."""
    import torch

    from kvrag.kv import batched, hf_cache

    m, tok = default_model_bf16.model, default_model_bf16.tokenizer
    win = batched.windows(m)
    ids = torch.tensor(tok("The harbour museum opens at 10:00 and closes at 17:00, except on Mondays. A day pass "
                           "costs 9 marks. Q: When does the harbour museum open? A: The harbour museum")["input_ids"])
    feed = tok(" opens at 10:00 and", add_special_tokens=False)["input_ids"]

    def row() -> batched.Row:
        _, cache = hf_cache.forward(m, ids, None, start=0)
        k, v = hf_cache.cache_to_tensors(cache)
        buf = hf_cache.KVBuffer.wrap(k.clone(), v.clone())
        buf.reserve(len(ids) + len(feed))
        return batched.Row(buf, len(ids))

    with torch.inference_mode():
        plain, r = [], row()
        for t in feed:
            plain.append(batched.decode_step(m, [r], [t], win)[0])
            r.length += 1
        got = batched.verify_step(m, [row()], [feed], win)
    assert len(feed) == 9
    assert [torch.equal(g, p) for g, p in zip(got, plain, strict=True)] == [True] * len(feed)


def test_full_with_speculation_is_model_generate_in_dense_bfloat16(default_model_bf16: Any) -> None:
    """``full`` with speculation on (the default) generates what ``model.generate`` does on the same ids, in
    bfloat16 with de-quantized weights, on a prompt whose greedy answer meets an exact bf16 tie (" opens" and " is"
    at 23.5: the old one-row products gave "opens at 10:00" with drafts, "is open on Mondays" without)."""
    import torch

    passages = [render_passage(p) for p in (
        "Children under six travel free when accompanied by an adult with a valid ticket.",
        "The harbour museum opens at 10:00 and closes at 17:00, except on Mondays.",
        "A day pass costs 9 marks and gives unlimited travel in all three zones.",
        "The last ferry leaves Tamsin Isle at 23:40 on weekdays and at 22:10 on Sundays.")]
    eng = KVRAGEngine(default_model_bf16, MemoryStore(), EngineConfig(speculative_tokens=3))
    try:
        plan = eng.plan_parts(*RagTemplate().parts(eng.tokenizer, passages, "When does the harbour museum open?"))
        ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
        with torch.inference_mode():
            out = eng.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=10, eos_token_id=eng._eos_ids(),
                                     pad_token_id=eng.tokenizer.pad_token_id)[0, len(ids):].tolist()
        got = eng.answer_plan(plan, "full", GenerationConfig(max_new_tokens=10))
        assert got.token_ids == out[: len(got.token_ids)] and len(got.token_ids) == 10, (got.token_ids, out)
        assert got.stats.decode_forwards < len(got.token_ids) - 1  # drafts were verified
    finally:
        eng.close()
