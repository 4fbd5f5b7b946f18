"""RoPE canonicalization/placement is exact against the model's own rotary embedding; the RoPE support matrix."""

from __future__ import annotations

import types

import pytest
import torch

from kvrag.errors import UnsupportedModelError
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope, check_rope_support, find_rotary_module
from kvrag.kv.spec import KVSpec
from kvrag.models import wrap_model
from kvrag_testing.tiny import FAMILIES, tiny_config, tiny_model, tiny_tokenizer

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


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rotating_into_out_in_blocks_gives_the_same_bits(pairing: str, per_layer: bool, out_dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Assembly rotates a chunk's keys straight into the request buffer a few layers at a time (so the float32
    temporaries stay in the CPU's cache): every block size writes exactly what one whole call writes."""
    from kvrag.kv import rope as rope_mod

    g = torch.Generator().manual_seed(1)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    if per_layer:  # e.g. Gemma 3's local and global layers
        inv = torch.stack([inv, inv / 4, inv, inv / 4, inv])
    rope = Rope(inv, pairing)
    x = torch.randn(5, 3, 37, 16, generator=g).to(torch.bfloat16)
    pos = torch.arange(900, 937)
    outs = []
    for block in (1 << 40, 1, 3 * 37 * 16 * 4 * 2):  # one block; one layer each; two layers each (the last alone)
        monkeypatch.setattr(rope_mod, "BLOCK_BYTES", block)
        buf = torch.zeros(5, 3, 60, 16, dtype=out_dtype)
        rope.place(x, pos, out=buf[:, :, 10:47])
        outs.append(buf)
    assert rope_mod._block_rows(x) == 2
    for got in outs[1:]:
        assert torch.equal(got, outs[0])
    if out_dtype is torch.bfloat16:  # and what rotating without ``out`` returns in the keys' dtype
        assert torch.equal(outs[0][:, :, 10:47], rope.place(x, pos))
    if per_layer:  # fewer layers than the RoPE has: refused, not rotated with the wrong layers' frequencies
        with pytest.raises(ValueError, match="per-layer RoPE rotates"):
            rope.place(x[:4], pos, out=outs[0][:4, :, 10:47])


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


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, LONGROPE])
def test_length_dependent_rope_is_served_in_its_short_regime(rope: dict) -> None:
    """Dynamic NTK and LongRoPE: below original_max_position_embeddings their frequencies are fixed (the short
    regime, which kvrag re-rotates with, exactly); the engine's context stops there, naming the reason."""
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store import MemoryStore

    lm = tiny_model("phi3" if rope["rope_type"] == "longrope" else "llama", rope=rope)
    assert check_rope_support(lm.model) == rope["rope_type"]
    rope_ = Rope.from_model(lm.model)
    ids = torch.randint(5, 256, (24,), generator=torch.Generator().manual_seed(0))
    k0, _ = hf_cache.prefill_kv(lm.model, ids)
    _, cache = hf_cache.forward(lm.model, ids, None, start=700)
    k1, _ = hf_cache.cache_to_tensors(cache)
    torch.testing.assert_close(rope_.place(rope_.canonicalize(k0, torch.arange(24)), torch.arange(700, 724)), k1,
                               atol=2e-5, rtol=1e-4)
    limit = KVRAGEngine(lm, MemoryStore(), EngineConfig()).max_context
    n = rope.get("original_max_position_embeddings", 4096)
    assert int(limit) == min(n, 4096)
    if rope["rope_type"] == "longrope":
        assert "longrope" in str(limit) and "long regime" in str(limit)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
    ],
)
def test_supported_rope_variants(rope: dict) -> None:
    lm = tiny_model("llama", rope=rope)
    assert lm.model.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert check_rope_support(lm.model) == rope["rope_type"]
    default = tiny_model("llama")
    assert not torch.equal(
        find_rotary_module(lm.model).inv_freq, find_rotary_module(default.model).inv_freq
    )



# ------------------------------------------------------------------ the one RoPE support matrix


def test_gpt2_like_model_raises() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    with pytest.raises(UnsupportedModelError, match="no rotary"):
        check_rope_support(cfg)
    model = GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        wrap_model(model, tiny_tokenizer(), name="tiny-gpt2")


def test_model_without_rotary_module_raises() -> None:
    lm = tiny_model("llama")
    del lm.model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match="rotary-embedding module"):
        check_rope_support(lm.model)


def test_rope_matrix_edge_cases() -> None:
    old = types.SimpleNamespace(model_type="old", rope_scaling=None, rope_theta=10000.0)
    assert check_rope_support(old) == "default"
    old_dynamic = types.SimpleNamespace(
        model_type="old", rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e4
    )
    assert check_rope_support(old_dynamic) == "dynamic"
    partial = types.SimpleNamespace(
        model_type="phi", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
    )
    assert check_rope_support(partial) == "default"
    per_layer = types.SimpleNamespace(
        model_type="g3",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_type": "default"},
        },
    )
    assert check_rope_support(per_layer) == "per-layer"
    same = {"rope_type": "default", "rope_theta": 1e4}
    uniform = types.SimpleNamespace(
        model_type="g3", rope_parameters={"full_attention": same, "sliding_attention": same}
    )
    assert check_rope_support(uniform) == "default"
    with pytest.raises(UnsupportedModelError, match="support matrix"):
        check_rope_support(types.SimpleNamespace(model_type="x", rope_parameters={"rope_type": "proportional"}))
    mrope = types.SimpleNamespace(model_type="qwen2_vl", rope_parameters={"rope_type": "default",
                                                                          "mrope_section": [2, 3, 3]})
    with pytest.raises(UnsupportedModelError, match="multimodal"):
        check_rope_support(mrope)
    per_layer_mrope = types.SimpleNamespace(model_type="x", rope_parameters={
        "full_attention": {"rope_type": "default", "mrope_section": [2, 3, 3]}, "sliding_attention": same})
    with pytest.raises(UnsupportedModelError, match="'full_attention'"):
        check_rope_support(per_layer_mrope)


# ------------------------------------------------------------------ one decision for loader, Rope and KVSpec


def test_per_layer_rope_with_same_type_but_other_theta_keeps_each_layers_frequencies() -> None:
    """Layer types are compared by their whole parameters, not by type: another theta is another frequency set,
    and each layer is re-rotated with its own (Gemma 3: local base 10K, global 1M)."""
    lm = tiny_model("gemma3", num_layers=6)
    rope = Rope.from_model(lm.model)
    assert rope.per_layer and tuple(rope.inv_freq.shape) == (6, 8)
    rot = lm.model.model.rotary_emb
    for i, t in enumerate(lm.model.config.layer_types):
        assert torch.equal(rope.inv_freq[i], getattr(rot, f"{t}_inv_freq").float())
    assert not torch.equal(rope.inv_freq[0], rope.inv_freq[5])  # 5 local layers, then the global one


@pytest.mark.parametrize("rope", [{"rope_type": "default", "mrope_section": [2, 3, 3]}, {"rope_type": "proportional"}])
def test_rope_kvspec_and_loader_refuse_alike(rope: dict) -> None:
    """Rope.from_model and KVSpec.from_model_config refuse exactly what the loader's check refuses."""
    lm = tiny_model("llama")
    lm.model.config.rope_parameters = {**lm.model.config.rope_parameters, **rope}
    for build in (lambda: check_rope_support(lm.model), lambda: Rope.from_model(lm.model),
                  lambda: KVSpec.from_model_config(lm.model.config, dtype="float32"),
                  lambda: wrap_model(lm.model, lm.tokenizer, name="x")):
        with pytest.raises(UnsupportedModelError, match="multimodal" if "mrope_section" in rope else rope["rope_type"]):
            build()


def test_rope_from_model_without_rotary_module_raises() -> None:
    lm = tiny_model("qwen2")
    del lm.model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match="rotary-embedding module"):
        Rope.from_model(lm.model)


def test_rotary_module_found_by_inv_freq_whatever_its_name() -> None:
    lm = tiny_model("llama")
    rot = lm.model.model.rotary_emb
    del lm.model.model.rotary_emb
    lm.model.model.add_module("positions", rot)
    assert find_rotary_module(lm.model) is rot
    assert check_rope_support(lm.model) == "default"
    torch.testing.assert_close(Rope.from_model(lm.model).inv_freq, rot.inv_freq.float())


def test_rotary_modules_that_disagree_are_refused() -> None:
    lm = tiny_model("llama")
    other = type(lm.model.model.rotary_emb)(config=tiny_config("llama", rope={"rope_type": "linear", "factor": 2.0}))
    lm.model.model.layers[0].add_module("rotary_emb", other)
    with pytest.raises(UnsupportedModelError, match="different frequencies"):
        check_rope_support(lm.model)


def test_rotary_module_that_disagrees_with_the_configs_rotary_dimensions_is_refused() -> None:
    lm = tiny_model("llama")
    rot = lm.model.model.rotary_emb
    rot.inv_freq = rot.inv_freq[: rot.inv_freq.shape[0] // 2].clone()
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        check_rope_support(lm.model)


@pytest.mark.parametrize("family", FAMILIES)
def test_kvspec_has_one_builder(family: str) -> None:
    """The loader's, the engine's and the trainer's KVSpec are the same object (one builder)."""
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store import MemoryStore

    lm = tiny_model(family)
    built = KVSpec.from_model_config(lm.model.config, dtype=torch.float32, model_fingerprint=lm.fingerprint)
    assert lm.kv_spec() == built == KVRAGEngine(lm, MemoryStore(), EngineConfig()).spec
    assert (built.num_layers, built.num_kv_heads, built.head_dim, built.rope_type) == (2, 2, 16, "default")
    assert lm.kv_spec("float16") == built.with_dtype("float16")
