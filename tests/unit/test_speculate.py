"""Speculative decoding from the prompt: prompt-lookup drafts, the verify step's logits equal plain steps', and
greedy answers token-identical to plain decoding -- alone, in continuous batches, for every family and method."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.speculate import PromptLookup, SpeculationConfig, draft_rows
from kvrag.errors import ConfigError
from kvrag.kv import batched, hf_cache
from kvrag.kv.attention import IMPL
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_testing.families import SERVED
from kvrag_testing.tiny import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums and the river Seine.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city with many parks.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog again and again.", "Fox"),
]
QUESTIONS = [([0, 1], "What is the capital of France?"), ([2], "Who jumps over the dog?"),
             ([1, 2, 0], "Repeat the first passage.")]
GEN = GenerationConfig(max_new_tokens=16)


def test_prompt_lookup_drafts_what_followed_the_longest_latest_match() -> None:
    d = PromptLookup([1, 2, 3, 4, 5, 9, 2, 7, 1, 2], max_ngram=2, min_ngram=1)
    assert d.draft(3) == [3, 4, 5]  # the bigram (1, 2) was followed by 3 4 5
    d = PromptLookup([7, 8, 1, 7, 8, 2, 7, 8], max_ngram=2, min_ngram=1)
    assert d.draft(1) == [2]  # the latest earlier occurrence wins
    d = PromptLookup([5, 1, 2, 6, 9, 2, 3, 1, 2], max_ngram=2, min_ngram=1)
    assert d.draft(2) == [6, 9]  # (1, 2) -> 6 beats the unigram (2,) -> 3
    d.push(6)
    assert d.draft(2) == [9, 2]  # the answer's own tokens extend the index
    assert PromptLookup([1, 2, 3], max_ngram=2).draft(4) == []  # 3 never occurred before
    assert PromptLookup([4, 4], max_ngram=1).draft(0) == []
    assert d.draft(100) == d.ids[4:]  # never past the end


def test_rejected_drafts_back_off_and_an_accepted_one_resumes() -> None:
    d = PromptLookup([1, 2, 3, 1, 2], max_ngram=2, min_ngram=1)
    assert d.draft(2) == [3, 1]
    d.feedback(2, 0)
    assert d.draft(2) == [3, 1]  # one miss: still drafting
    waits = []
    for _ in range(6):  # misses in a row: wait 2, 4, 8, 16, 16 ... steps
        d.feedback(2, 0)
        n = 0
        while not d.draft(2):
            n += 1
        waits.append(n)
    assert waits == [2, 4, 8, 16, 16, 16]
    d.feedback(2, 1)
    d.feedback(0, 0)  # no draft: no news
    assert d.draft(2) == [3, 1] and d.misses == 0


def test_bad_speculation_settings_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_ngram"):
        EngineConfig(speculative_ngram=0)
    with pytest.raises(ConfigError, match="speculative_min_ngram"):
        EngineConfig(speculative_min_ngram=0)
    eng = KVRAGEngine(tiny_model("llama"), MemoryStore(), EngineConfig(speculative_ngram=1))
    assert eng.runner.speculation.min_ngram == 1  # the default minimum (2) is capped to the longest
    with pytest.raises(ConfigError, match="min_ngram"):
        SpeculationConfig(min_ngram=3, max_ngram=2)
    assert not SpeculationConfig(max_draft=0).enabled
    with pytest.raises(ConfigError, match="speculative_max_batch"):
        EngineConfig(speculative_max_batch=0)
    with pytest.raises(ConfigError, match="max_batch"):
        SpeculationConfig(max_batch=0)
    assert KVRAGEngine(tiny_model("llama"), MemoryStore(), EngineConfig(speculative_max_batch=3)
                       ).runner.speculation.max_batch == 3


def test_drafts_stop_above_max_batch_requests_and_resume_below() -> None:
    """vLLM's disable-by-batch-size: a step of more than ``max_batch`` rows drafts nothing (a plain step), one of at
    most that many drafts as before."""
    rows = []
    for _ in range(3):
        d = PromptLookup([1, 2, 3, 4, 1, 2, 3, 4], 3, 1)
        for t in (1, 2):
            d.push(t)
        state = SimpleNamespace(cfg=SimpleNamespace(max_new_tokens=50), steps=2)
        rows.append(SimpleNamespace(drafter=d, state=state, row=SimpleNamespace(buffer=SimpleNamespace(capacity=99),
                                                                                 length=10)))
    spec = SpeculationConfig(max_draft=2, max_batch=2)
    assert draft_rows(rows, spec) is None
    assert draft_rows(rows[:2], spec) == [[3, 4], [3, 4]]
    assert draft_rows(rows, SpeculationConfig(max_draft=2, max_batch=3)) == [[3, 4]] * 3


def _buffer(model: Any, ids: torch.Tensor, extra: int) -> hf_cache.KVBuffer:
    _, cache = hf_cache.forward(model, ids, None, start=0)
    k, v = hf_cache.cache_to_tensors(cache)
    buf = hf_cache.KVBuffer.wrap(k.clone(), v.clone())
    buf.reserve(len(ids) + extra)
    return buf


@pytest.mark.parametrize("weights", ["int4", "int8", "bfloat16", "float32"])
@pytest.mark.parametrize("family", [f.family for f in SERVED])
def test_verify_step_logits_equal_plain_steps(family: str, weights: str) -> None:
    """Feeding a row several tokens in one verify forward gives, at each position, the logits plain one-token
    steps give after the same tokens: bit for bit where the products compute each row alone (quantized weights,
    bf16), within float32 GEMM reordering for dense float32. Rows of different lengths share the forward."""
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    lm = tiny_model(family, init_std=0.1, dtype=dtype, quantize=weights if weights.startswith("int") else None)
    if batched.batchable(lm.model, IMPL) is not None:
        pytest.skip(f"{family} is decoded one request at a time (no batched step, no drafts)")
    m, win = lm.model, batched.windows(lm.model)
    prompts = [torch.arange(5, 45), torch.arange(60, 83)]
    feeds = [[7, 9, 11, 13], [21]]
    with torch.inference_mode():
        plain = []
        for ids, feed in zip(prompts, feeds, strict=True):
            row = batched.Row(_buffer(m, ids, 8), len(ids))
            for t in feed:
                plain.append(batched.decode_step(m, [row], [t], win)[0])
                row.length += 1
        rows = [batched.Row(_buffer(m, ids, 8), len(ids)) for ids in prompts]
        got = batched.verify_step(m, rows, feeds, win)
    assert got.shape[0] == sum(map(len, feeds))
    for g, p in zip(got, plain, strict=True):
        if weights == "float32":
            torch.testing.assert_close(g, p, atol=1e-4, rtol=0)
        else:
            assert torch.equal(g, p)


def _engine(family: str, spec: int, quantize: str | None = None, **config: Any) -> KVRAGEngine:
    lm = tiny_model(family, init_std=0.1, quantize=quantize)
    config.setdefault("speculative_min_ngram", 1)  # random tiny models copy little: one-token matches draft more
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig(speculative_tokens=spec, **config))
    eng.ingest(DOCS)
    return eng


def _answer(eng: KVRAGEngine, i: int, method: str, gen: GenerationConfig = GEN) -> Any:
    idx, q = QUESTIONS[i]
    passages = [DOCS[j] for j in idx]
    return eng.answer(RagTemplate().render(eng.tokenizer, passages, q), passages, method, gen)


METHODS = ("full", "stale", "relaxkv:r=0.3", "cacheblend:r=0.3")


@pytest.mark.parametrize("quantize", [None, "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_answers_are_token_identical_with_speculation(family: str, quantize: str | None) -> None:
    plain, spec = _engine(family, 0, quantize), _engine(family, 4, quantize)
    spec.store = plain.store  # the same chunk caches
    drafted = accepted = 0
    for method in METHODS:
        for i in range(len(QUESTIONS)):
            a, b = _answer(plain, i, method), _answer(spec, i, method)
            assert b.token_ids == a.token_ids, (method, i)
            assert b.text == a.text
            assert a.stats.drafted_tokens == 0 and a.stats.decode_forwards == len(a.token_ids) - 1
            s = b.stats
            assert s.decode_forwards is not None and s.accepted_tokens is not None and s.drafted_tokens is not None
            assert s.accepted_tokens <= s.drafted_tokens
            assert len(b.token_ids) - 1 <= s.decode_forwards + s.accepted_tokens <= len(b.token_ids)
            drafted += s.drafted_tokens
            accepted += s.accepted_tokens
    assert drafted > 0 and accepted > 0  # both the accept and the reject paths ran
    assert spec.runner.stats()["verify_steps"] > 0


def test_sampling_requests_are_not_drafted() -> None:
    plain, spec = _engine("qwen2", 0), _engine("qwen2", 4)
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=30, seed=5)
    a, b = _answer(plain, 0, "stale", gen), _answer(spec, 0, "stale", gen)
    assert a.token_ids == b.token_ids and b.stats.drafted_tokens == 0


def test_rows_accepting_different_lengths_share_steps_and_equal_sequential() -> None:
    """Continuous batching with drafts: concurrent requests (different accepted lengths per step) answer exactly
    what each answers alone without speculation; reservations all return."""
    plain = _engine("llama", 0, "int4")
    spec = _engine("llama", 4, "int4", max_batch_size=4, speculative_max_batch=4)
    spec.store = plain.store
    jobs = [(i % len(QUESTIONS), m) for i, m in enumerate(["stale", "full", "stale", "relaxkv:r=0.3", "stale", "full"])]
    want = [_answer(plain, i, m).token_ids for i, m in jobs]
    got: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            got[k] = _answer(spec, *jobs[k]).token_ids
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == want
    stats = spec.runner.stats()
    assert stats["verify_steps"] > 0 and stats["max_rows"] > 1
    assert stats["kv"]["used"] == 0 and stats["kv"]["leases"] == 0 and stats["decoding"] == 0


def test_drafts_never_pass_max_new_tokens_or_the_buffer() -> None:
    """Answers of every length up to a small ``max_new_tokens`` equal plain decoding's prefixes."""
    plain, spec = _engine("mistral", 0), _engine("mistral", 8)
    spec.store = plain.store
    full = _answer(plain, 2, "stale", GenerationConfig(max_new_tokens=12)).token_ids
    for n in (1, 2, 3, 5, 12):
        got = _answer(spec, 2, "stale", GenerationConfig(max_new_tokens=n)).token_ids
        assert got == full[:n]
