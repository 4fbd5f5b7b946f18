"""Every selective method at its recompute-everything setting reproduces ``full`` on the real default model
(issue 13): a dev-like RAG prompt (a few passages + a question through RagTemplate), the same next-token
distribution and the same greedy answer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrag.config import GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag.testing.fusion_suite import RECOMPUTE_ALL_SPECS

pytestmark = pytest.mark.integration

PASSAGES = [
    ("Harrow Point Lighthouse", "The Harrow Point Lighthouse was built in 1868 by the engineer Edith Crane."),
    ("Marlow Viaduct", "The Marlow Viaduct opened in 1874 and is 3.5 km long, with 44 brick arches."),
    ("Edith Crane", "Edith Crane (1841-1913) was a civil engineer who trained in Glasgow."),
    ("Lode ferry", "The last ferry across the Lode left at nine in the evening."),
]
QUESTION = "Who built the Harrow Point Lighthouse, and in which year?"
RECOMPUTE_ALL = RECOMPUTE_ALL_SPECS
N_TOKENS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(default_model: Any) -> KVRAGEngine:
    eng = KVRAGEngine(default_model, MemoryStore())
    eng.ingest([render_passage(text, title) for title, text in PASSAGES])
    return eng


@pytest.fixture(scope="module")
def prompt(engine: KVRAGEngine) -> tuple[str, list[str]]:
    passages = [render_passage(text, title) for title, text in PASSAGES]
    return RagTemplate().render(engine.tokenizer, passages, QUESTION), passages


def _run(engine: KVRAGEngine, prompt: tuple[str, list[str]], method: str) -> tuple[torch.Tensor, list[int], dict]:
    prep = engine.prepare(engine.plan(*prompt), method)
    logits = prep.last_logits.clone()
    "".join(engine.stream(prep, GenerationConfig(max_new_tokens=N_TOKENS)))
    return logits, list(prep.token_ids), prep.stats


@pytest.fixture(scope="module")
def full(engine: KVRAGEngine, prompt: tuple[str, list[str]]) -> tuple[torch.Tensor, list[int], dict]:
    return _run(engine, prompt, "full")


@pytest.mark.parametrize("method", RECOMPUTE_ALL)
def test_recompute_everything_reproduces_full_on_the_default_model(engine, prompt, full, method: str) -> None:
    ref_logits, ref_tokens, ref_stats = full
    assert ref_stats["chunks_found"] == len(PASSAGES) and ref_stats["context_tokens"] > 100
    logits, tokens, stats = _run(engine, prompt, method)
    assert stats["hit_rate"] == 1.0  # the chunks came from the store, stale, before the repair
    plan = engine.plan(*prompt)
    reusable = sum(len(s.token_ids) for s in plan.context if s.kind != "prefix")
    # every state but those of the exact leading prefix (the template's preamble) was recomputed
    assert stats["method_stats"]["recomputed_fraction"] == pytest.approx(reusable / plan.context_len)
    torch.testing.assert_close(logits, ref_logits, atol=2e-3, rtol=0)
    assert tokens == ref_tokens and len(tokens) >= 1


def test_stale_is_not_full_on_this_prompt(engine, prompt, full) -> None:
    """The prompt is a real test: without repair the next-token distribution moves (so r = 1 had work to do)."""
    logits, _, _ = _run(engine, prompt, "stale")
    assert (logits - full[0]).abs().max() > 0.05
