"""One short answer before a server takes requests, so that its first client does not pay the engine's one-time work.

A process's first decode step is checked bit for bit against the model's own forward before a step backend serves
its steps (:mod:`kvrag.kv.step_backend`: the oracle's step and the backend's, side by side), the native kernels are
built or opened and checked, and the fused step lays out its fused weights: seconds on top of an 8B model's first
answer (measured in docs/results/epyc/gguf_resident.md). :func:`warm_up` answers a short prompt of no
chunks with ``full`` -- nothing is written to the store -- and drops the conversation it would leave behind. What it
does not reach stays with the first request that needs it: a packed suffix prefill's check (the first burst), a
repairer's load (the first request with chunks).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kvrag.config import GenerationConfig

if TYPE_CHECKING:
    from kvrag.engine.engine import KVRAGEngine

log = logging.getLogger(__name__)

PROMPT = "Count with me: one two three four five, one two three four five, one two"
"""A prompt whose continuation repeats earlier text, so prompt-lookup speculation drafts and verifies too."""


def warm_up(engine: KVRAGEngine, max_new_tokens: int = 8) -> float:
    """Answer :data:`PROMPT` with ``full`` (greedy, ``max_new_tokens``), forget the conversation it kept, and return
    the seconds it took."""
    t = time.perf_counter()
    engine.answer(PROMPT, method="full", gen=GenerationConfig(max_new_tokens=max_new_tokens))
    engine.conversations.clear()
    took = time.perf_counter() - t
    log.info("warm-up answer: %.2f s", took)
    return took


__all__ = ["PROMPT", "warm_up"]
