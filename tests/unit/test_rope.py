"""RoPE canonicalization/placement is exact against the model's own rotary embedding."""

from __future__ import annotations

import pytest
import torch

from kvrag.errors import UnsupportedModelError
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope
from kvrag.testing.tiny import FAMILIES, tiny_model

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
}


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rotate_then_unrotate_is_identity(pairing: str) -> None:
    g = torch.Generator().manual_seed(0)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rope = Rope(inv, pairing)
    x = torch.randn(2, 3, 50, 16, generator=g)
    pos = torch.arange(1000, 1050)
    back = rope.canonicalize(rope.place(x, pos), pos)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # rotations compose: R(a) R(b) = R(a + b)
    a, b = torch.full((50,), 17), torch.arange(50)
    torch.testing.assert_close(rope.place(rope.place(x, a), b), rope.place(x, a + b), atol=1e-5, rtol=1e-5)


def test_interleaved_differs_from_half() -> None:
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x = torch.randn(1, 5, 8)
    pos = torch.arange(3, 8)
    assert not torch.allclose(Rope(inv, "half").place(x, pos), Rope(inv, "interleaved").place(x, pos))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope_name", list(ROPES))
def test_canonicalize_then_place_equals_direct_prefill(family: str, rope_name: str) -> None:
    lm = tiny_model(family, rope=ROPES[rope_name])
    rope = Rope.from_model(lm.model)
    ids = torch.randint(5, 256, (24,), generator=torch.Generator().manual_seed(1))
    # The chunk prefilled alone at positions 0..T-1 ...
    k0, v0 = hf_cache.prefill_kv(lm.model, ids)
    canon = rope.canonicalize(k0, torch.arange(24))
    # ... placed at offset 700 equals the same ids prefilled directly at positions 700..723 (no other context).
    _, cache = hf_cache.forward(lm.model, ids, None, start=700)
    k1, v1 = hf_cache.cache_to_tensors(cache)
    torch.testing.assert_close(rope.place(canon, torch.arange(700, 724)), k1, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(v0, v1, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_types_raise(rope_type: str) -> None:
    params = {"rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":
        params = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                  "original_max_position_embeddings": 1024}
    with pytest.raises(UnsupportedModelError, match=rope_type):
        lm = tiny_model("llama", rope=params)
        Rope.from_model(lm.model)
