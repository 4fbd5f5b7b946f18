"""Every selective method at its recompute-everything setting reproduces ``full`` on the real default model: a
dev-like RAG prompt (a few passages + a question through RagTemplate), in both compute dtypes kvrag may pick.

float32 (the exact oracle): the same next-token logits within 2e-3 and the same greedy answer. bfloat16: the rule
of :mod:`kvrag_testing.equivalence` -- KL(fp32 full || bf16 method) <= 2 x KL(fp32 full || bf16 full) + 1e-4 (the
measured bf16 noise floor on this prompt) and the same greedy answer as ``full`` in bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrag.config import GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import quant
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.equivalence import assert_close_in_dtype, bf16_kl_bound, kl
from kvrag_testing.fusion_suite import RECOMPUTE_ALL_SPECS

PASSAGES = [
    ("Harrow Point Lighthouse", "The Harrow Point Lighthouse was built in 1868 by the engineer Edith Crane."),
    ("Marlow Viaduct", "The Marlow Viaduct opened in 1874 and is 3.5 km long, with 44 brick arches."),
    ("Edith Crane", "Edith Crane (1841-1913) was a civil engineer who trained in Glasgow."),
    ("Lode ferry", "The last ferry across the Lode left at nine in the evening."),
]
QUESTION = "Who built the Harrow Point Lighthouse, and in which year?"
RECOMPUTE_ALL = RECOMPUTE_ALL_SPECS
N_TOKENS = 8

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

Run = tuple[torch.Tensor, list[int], Any]


def _engine(loaded: Any) -> KVRAGEngine:
    eng = KVRAGEngine(loaded, MemoryStore())
    eng.ingest([render_passage(text, title) for title, text in PASSAGES])
    return eng


@pytest.fixture(scope="module")
def engine(default_model_fp32: Any) -> KVRAGEngine:
    return _engine(default_model_fp32)


@pytest.fixture(scope="module")
def engine_bf16(default_model_bf16: Any) -> KVRAGEngine:
    return _engine(default_model_bf16)


@pytest.fixture(scope="module")
def engine_int4(default_model_int4: Any) -> KVRAGEngine:
    return _engine(default_model_int4)


@pytest.fixture(scope="module")
def prompt(engine: KVRAGEngine) -> tuple[str, list[str]]:
    passages = [render_passage(text, title) for title, text in PASSAGES]
    return RagTemplate().render(engine.tokenizer, passages, QUESTION), passages


def _run(engine: KVRAGEngine, prompt: tuple[str, list[str]], method: str) -> Run:
    prep = engine.prepare(engine.plan(*prompt), method)
    logits = prep.last_logits.clone()
    "".join(engine.stream(prep, GenerationConfig(max_new_tokens=N_TOKENS)))
    return logits, list(prep.token_ids), prep.stats


@pytest.fixture(scope="module")
def full(engine: KVRAGEngine, prompt: tuple[str, list[str]]) -> Run:
    return _run(engine, prompt, "full")


@pytest.fixture(scope="module")
def full_bf16(engine_bf16: KVRAGEngine, prompt: tuple[str, list[str]]) -> Run:
    return _run(engine_bf16, prompt, "full")


def _check_recomputed_everything(engine: KVRAGEngine, prompt: tuple[str, list[str]], stats: Any) -> None:
    assert stats["hit_rate"] == 1.0  # the chunks came from the store, stale, before the repair
    plan = engine.plan(*prompt)
    reusable = sum(len(s.token_ids) for s in plan.context if s.kind != "prefix")
    # every state but those of the exact leading prefix (the template's preamble) was recomputed
    assert stats.method_stats.recomputed_fraction == pytest.approx(reusable / plan.context_len)


@pytest.mark.parametrize("method", RECOMPUTE_ALL)
def test_recompute_everything_reproduces_full_on_the_default_model(engine, prompt, full, method: str) -> None:
    ref_logits, ref_tokens, ref_stats = full
    assert ref_stats["chunks_found"] == len(PASSAGES) and ref_stats["context_tokens"] > 100
    logits, tokens, stats = _run(engine, prompt, method)
    _check_recomputed_everything(engine, prompt, stats)
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=0)
    assert tokens == ref_tokens and len(tokens) >= 1


@pytest.mark.parametrize("method", RECOMPUTE_ALL)
def test_recompute_everything_reproduces_full_in_bfloat16(engine_bf16, prompt, full, full_bf16, method: str) -> None:
    ref_logits = full[0]
    floor = kl(ref_logits, full_bf16[0])  # how far bf16 moves full's own next-token distribution
    assert 0.0 <= floor < 0.05  # bf16 is a faithful approximation on this prompt (a sanity bound, not the test)
    logits, tokens, stats = _run(engine_bf16, prompt, method)
    _check_recomputed_everything(engine_bf16, prompt, stats)
    assert kl(ref_logits, logits) <= bf16_kl_bound(floor), (kl(ref_logits, logits), floor)
    assert tokens == full_bf16[1] and len(tokens) >= 1


@pytest.mark.parametrize("method", RECOMPUTE_ALL)
def test_recompute_everything_reproduces_full_with_int4_weights(engine_int4, prompt, method: str) -> None:
    """The contract on the quantized default: the same model object's ``full`` is the reference.

    In float32 the int4 output head computes the 64 largest logits exactly and rounds the rest to bfloat16
    (:mod:`kvrag.kv.quant`), so a hidden state a few float32 ulps off can move one of those by one bfloat16 step
    (0.0625 at ~10): the largest (exact in both runs) are held to 2e-3, every logit to 2e-3 plus one bfloat16 step
    of its size. In bfloat16, as two bfloat16 computations of one function through the whole model."""
    ref_logits, ref_tokens, _ = _run(engine_int4, prompt, "full")
    logits, tokens, stats = _run(engine_int4, prompt, method)
    _check_recomputed_everything(engine_int4, prompt, stats)
    if engine_int4.loaded.dtype != torch.float32:
        assert_close_in_dtype(logits, ref_logits, engine_int4.loaded.dtype, fp32_atol=2e-3)
    else:
        top = ref_logits.topk(quant.REFINE_TOP // 4).indices
        torch.testing.assert_close(logits[top], ref_logits[top], atol=2e-3, rtol=0)
        step = torch.exp2(torch.floor(torch.log2(ref_logits.abs().clamp(min=1e-30))) - 7)  # a bfloat16 ulp of each
        assert bool(((logits - ref_logits).abs() <= 2e-3 + step).all()), (logits - ref_logits).abs().max()
    assert tokens == ref_tokens and len(tokens) >= 1


def test_stale_is_not_full_on_this_prompt(engine, prompt, full) -> None:
    """The prompt is a real test: without repair the next-token distribution moves (so r = 1 had work to do)."""
    logits, _, _ = _run(engine, prompt, "stale")
    assert (logits - full[0]).abs().max() > 0.05
