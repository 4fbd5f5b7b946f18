"""The equivalence contract in bfloat16 on every tiny family, on every machine (bf16 is emulated where the CPU has
no bf16 units: slow there, so the cases are small).

Rule (:mod:`kvrag_testing.equivalence`): with ``floor = KL(fp32 full || bf16 full)`` measured on the same case,
every method at its recompute-everything setting in bf16 has ``KL(fp32 full || bf16 method) <= 2 floor + 1e-4`` and
decodes the same greedy tokens as ``full`` in bf16. ``stale`` (no repair) is shown to violate the rule on the same
cases, so the rule can fail.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from kvrag.engine.assemble import assemble
from kvrag.fusion import FusionInput, get_method
from kvrag.kv import hf_cache
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag_testing.equivalence import bf16_kl_bound, kl
from kvrag_testing.fusion_suite import LAYOUT, RECOMPUTE_ALL_SPECS, SUFFIX_LEN, SUITE_INIT_STD, SUITE_LAYERS
from kvrag_testing.tiny import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DECODE_STEPS = 4


@functools.lru_cache(maxsize=8)
def _case(family: str, dtype: torch.dtype) -> tuple[Any, Rope, Any, list, torch.Tensor]:
    """The fusion suite's case for ``family`` (same weights and ids in every dtype: weights rounded to ``dtype``)."""
    lm = tiny_model(family, num_layers=SUITE_LAYERS, seed=0, init_std=SUITE_INIT_STD, dtype=dtype)
    model, spec = lm.model, lm.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(1234)
    vocab = int(model.config.vocab_size)
    pieces = []
    for i, (kind, n) in enumerate(LAYOUT):
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        pieces.append((kind, compute_chunk_kv(model, rope, spec, ids), f"{kind}{i}" if kind == "chunk" else None))
    return model, rope, spec, pieces, torch.randint(5, vocab, (SUFFIX_LEN,), generator=g)


def _input(family: str, dtype: torch.dtype) -> FusionInput:
    model, rope, spec, pieces, suffix = _case(family, dtype)
    return assemble(model, rope, spec, pieces, suffix)


def _run(family: str, dtype: torch.dtype, method: str) -> tuple[torch.Tensor, list[int]]:
    """Next-token logits after the suffix [V] (float32) and the greedy tokens after them."""
    inp = _input(family, dtype)
    out = get_method(method).fuse(inp)
    cache, pos = out.cache, inp.context_len + int(inp.suffix_ids.shape[0])
    if out.last_logits is None:
        logits, cache = hf_cache.forward(inp.model, inp.suffix_ids, cache, start=inp.context_len)
        first = logits[-1]
    else:
        first = out.last_logits
    last, tokens = first, []
    for _ in range(DECODE_STEPS):
        tokens.append(int(torch.argmax(last)))
        logits, cache = hf_cache.forward(inp.model, torch.tensor([tokens[-1]]), cache, start=pos)
        last, pos = logits[-1], pos + 1
    return first.float(), tokens


@functools.lru_cache(maxsize=8)
def _reference(family: str) -> tuple[torch.Tensor, torch.Tensor, list[int], float]:
    """(fp32 full logits, bf16 full logits, bf16 full tokens, the bf16 noise floor) of a family's case."""
    ref, _ = _run(family, torch.float32, "full")
    full_bf16, tokens = _run(family, torch.bfloat16, "full")
    return ref, full_bf16, tokens, kl(ref, full_bf16)


@pytest.mark.parametrize("method", RECOMPUTE_ALL_SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_everything_equals_full_in_bfloat16(family: str, method: str) -> None:
    ref, _, full_tokens, floor = _reference(family)
    logits, tokens = _run(family, torch.bfloat16, method)
    assert kl(ref, logits) <= bf16_kl_bound(floor), (kl(ref, logits), floor)
    assert tokens == full_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_bf16_rule_rejects_an_unrepaired_cache(family: str) -> None:
    """The rule has teeth: ``stale`` in bf16 (no repair) is further from fp32 full than the bound allows."""
    ref, _, _, floor = _reference(family)
    logits, _ = _run(family, torch.bfloat16, "stale")
    assert kl(ref, logits) > bf16_kl_bound(floor)


def test_the_noise_floor_is_a_small_nonzero_bf16_effect() -> None:
    """bf16 moves full's distribution measurably (the floor is real) but little (the bound stays tight)."""
    floors = [_reference(f)[3] for f in FAMILIES]
    assert all(0.0 < f < 0.05 for f in floors), floors
