"""Property test over random chunkings of a prompt (issue 13): however a context is split into a leading exact
prefix, stored chunks and text spans, every method at its recompute-everything setting decodes the greedy tokens of
``full``, and ``stale`` with the whole context as one chunk does too (docs/architecture.md#tests: equivalences)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrag.engine.assemble import assemble
from kvrag.fusion import get_method
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag_testing.fusion_suite import RECOMPUTE_ALL_SPECS, fusion_case, greedy_tokens
from kvrag_testing.tiny import FAMILIES

RECOMPUTE_ALL = RECOMPUTE_ALL_SPECS
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def chunkings(draw: Any) -> tuple[str, list[tuple[str, list[int]]], list[int]]:
    """(family, [(kind, ids)] covering a random context, suffix ids)."""
    family = draw(st.sampled_from(FAMILIES))
    n = draw(st.integers(8, 36))
    ids = draw(st.lists(st.integers(5, 255), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=5)))
    bounds = [0, *cuts, n]
    kinds = [draw(st.sampled_from(["prefix", "chunk"]))] + [
        draw(st.sampled_from(["chunk", "chunk", "text"])) for _ in range(len(bounds) - 2)
    ]
    pieces = [(kind, ids[a:b]) for kind, a, b in zip(kinds, bounds, bounds[1:], strict=False)]
    suffix = draw(st.lists(st.integers(5, 255), min_size=1, max_size=5))
    return family, pieces, suffix


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chunkings())
def test_recompute_everything_and_single_chunk_stale_decode_like_full(
    drawn: tuple[str, list[tuple[str, list[int]]], list[int]],
) -> None:
    family, split, suffix_ids = drawn
    model = fusion_case(family).model  # the suite's 4-layer, init-std 0.1 model (built once)
    spec = fusion_case(family).spec
    rope = Rope.from_model(model)
    suffix = torch.tensor(suffix_ids)
    pieces = [(kind, compute_chunk_kv(model, rope, spec, ids), f"{kind}{i}") for i, (kind, ids) in enumerate(split)]

    def tokens(method: str, parts: Any) -> list[int]:
        inp = assemble(model, rope, spec, parts, suffix)
        return greedy_tokens(inp, get_method(method).fuse(inp), STEPS)

    ref = tokens("full", pieces)
    for method in RECOMPUTE_ALL:
        assert tokens(method, pieces) == ref, f"{method} on chunking {[(k, len(i)) for k, i in split]}"
    whole = [t for _, ids in split for t in ids]
    assert tokens("stale", [("chunk", compute_chunk_kv(model, rope, spec, whole), "all")]) == ref
