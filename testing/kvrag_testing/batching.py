"""The batched decode step's oracle: every request decoded together vs each alone through the model's own forward.

Used by the unit tests (tiny models) and the integration tests (the default model) of :mod:`kvrag.kv.batched`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvrag.kv import batched, hf_cache
from kvrag.prompting import render_passage

PASSAGES = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
    render_passage("Rotary position embeddings rotate queries and keys by position.", "RoPE"),
]
"""Four short passages the tests of batching, packing and the soak answer from (tiny models, tiny tokenizer)."""


@dataclasses.dataclass
class StepComparison:
    """What :func:`compare_batched_to_alone` found.

    Attributes:
        worst: the largest |batched - alone| next-token logit over every row and step.
        floor: with reference requests, the largest |alone - alone on the reference model| for the same tokens (e.g.
            the bf16 noise floor against float32); 0 without.
        tokens: per row, the greedy tokens fed (the prepare's first, then the batched step's).
    """

    worst: float
    floor: float
    tokens: list[list[int]]


def _alone(prep: Any, model: Any) -> Any:
    """A DynamicCache copy of a prepared request's KV (as ``model.generate`` keeps it)."""
    k, v = hf_cache.cache_to_tensors(prep.cache)
    return hf_cache.make_cache(k.clone(), v.clone(), model.config)


def compare_batched_to_alone(model: Any, preps: Sequence[Any], steps: int, *, reference_model: Any = None,
                             reference_preps: Sequence[Any] = ()) -> StepComparison:
    """Decode prepared requests together for ``steps`` batched steps (:func:`kvrag.kv.batched.decode_step`) and each
    alone through the model's own forward over a copy of its KV, feeding both the batched greedy tokens; with
    ``reference_preps`` (the same requests prepared on ``reference_model``), each alone on that model too."""
    rows, alone, toks = [], [], []
    for p in preps:
        alone.append(_alone(p, model))
        buf, n = hf_cache.buffer_of(p.cache)
        buf.reserve(n + steps)
        rows.append(batched.Row(buf, n))
        toks.append(int(p.last_logits.argmax()))
    other = [_alone(p, reference_model) for p in reference_preps]
    worst = floor = 0.0
    seen = [[t] for t in toks]
    for _ in range(steps):
        with hf_cache.model_lock(model):
            logits = batched.decode_step(model, rows, toks, batched.windows(model))
        for i, row in enumerate(rows):
            ref, _ = hf_cache.forward(model, torch.tensor([toks[i]]), alone[i])
            worst = max(worst, float((ref[-1] - logits[i]).abs().max()))
            if other:
                ref2, _ = hf_cache.forward(reference_model, torch.tensor([toks[i]]), other[i])
                floor = max(floor, float((ref2[-1] - ref[-1]).abs().max()))
            row.length += 1
        toks = [int(t) for t in logits.argmax(-1)]
        for s, t in zip(seen, toks, strict=True):
            s.append(t)
    return StepComparison(worst, floor, seen)


__all__ = ["PASSAGES", "StepComparison", "compare_batched_to_alone"]
