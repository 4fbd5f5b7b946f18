"""Sliding-window models (issue 13): served exactly within one window, refused clearly beyond it -- never a shape
error. Tiny Mistral (window at every layer) and Qwen2 (``use_sliding_window``, window at the upper layers)."""

from __future__ import annotations

import pickle
import types
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.assemble import assemble
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ContextLengthError, UnsupportedModelError
from kvrag.fusion import get_method
from kvrag.fusion.ablations import register_ablations
from kvrag.kv import hf_cache
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.window import ContextLimit, attention_window, layer_windows
from kvrag.prompting import render_passage
from kvrag.store import MemoryStore
from kvrag.testing.fusion_suite import context_kv, greedy_tokens
from kvrag.testing.tiny import tiny_model

register_ablations()  # relaxkv-fullctx (the full-prefix control) is tested here

WINDOW = 40
SW_FAMILIES = ("mistral", "qwen2")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=SW_FAMILIES)
def sw(request: Any) -> Any:
    return tiny_model(request.param, num_layers=4, init_std=0.1, sliding_window=WINDOW)


# --- reading the window ----------------------------------------------------------------------------------------------


def _configs() -> list[tuple[str, Any, int | None, tuple[int, ...]]]:
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    small = {"num_hidden_layers": 6, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128}
    return [
        ("mistral-sw", MistralConfig(**small, sliding_window=24), 24, tuple(range(6))),
        ("mistral-full", MistralConfig(**small, sliding_window=None), None, ()),
        # Qwen2 keeps sliding_window=4096 in its config but does not use it unless use_sliding_window
        ("qwen2-default", Qwen2Config(**small), None, ()),
        ("qwen2-sw", Qwen2Config(**small, use_sliding_window=True, sliding_window=32, max_window_layers=4), 32, (4, 5)),
        ("gemma2", Gemma2Config(**small, sliding_window=64), 64, (0, 2, 4)),
        ("gemma3", Gemma3TextConfig(**small, sliding_window=48), 48, (0, 1, 2, 3, 4)),
    ]


@pytest.mark.parametrize("name", [c[0] for c in _configs()])
def test_attention_window_matches_the_transformers_cache_layout(name: str) -> None:
    """The window we read is the one transformers' DynamicCache(config=...) builds its sliding layers with."""
    from transformers.cache_utils import DynamicCache

    _, cfg, size, layers = next(c for c in _configs() if c[0] == name)
    w = attention_window(cfg)
    assert (w.size if w else None) == size
    assert (w.layers if w else ()) == layers
    cache_windows = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                     for layer in DynamicCache(config=cfg).layers]
    assert cache_windows == [win for _, win in layer_windows(cfg)]


def test_non_attention_layers_are_refused() -> None:
    cfg = types.SimpleNamespace(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(UnsupportedModelError, match="'linear_attention' layer"):
        attention_window(cfg)


def test_context_limit_is_the_window_and_explains_itself(sw: Any) -> None:
    eng = KVRAGEngine(sw, MemoryStore())
    assert eng.max_context == WINDOW - 1 and isinstance(eng.max_context, ContextLimit)
    assert f"sliding window of {WINDOW} tokens" in str(eng.max_context)
    assert f"{eng.max_context:d}" == str(WINDOW - 1) and pickle.loads(pickle.dumps(eng.max_context)) == WINDOW - 1
    assert KVRAGEngine(sw, MemoryStore(), EngineConfig(max_context=20)).max_context == 20  # a smaller limit stays
    full = tiny_model("qwen2", num_layers=4)
    assert type(KVRAGEngine(full, MemoryStore()).max_context) is int  # no window: max_position_embeddings


def test_the_limit_is_the_longest_prefill_whose_cache_keeps_every_token(sw: Any) -> None:
    """transformers' sliding cache layer keeps W - 1 tokens: a prefill of W - 1 tokens comes back whole (so every
    chunk the engine accepts does), one of W tokens would lose its first token (why the limit is W - 1)."""
    ids = torch.arange(5, 5 + WINDOW)
    assert hf_cache.prefill_kv(sw.model, ids[: WINDOW - 1])[0].shape[2] == WINDOW - 1
    _, cache = hf_cache.forward(sw.model, ids, None, start=0)
    windowed = set(attention_window(sw.model.config).layers)
    kept = [int(layer.keys.shape[2]) for layer in cache.layers]
    assert kept == [WINDOW - 1 if i in windowed else WINDOW for i in range(len(kept))]


# --- exact within the window -------------------------------------------------------------------------------------------


def test_within_the_window_the_sliding_model_is_the_full_attention_model(sw: Any) -> None:
    """Same weights without the window give the same logits on a prompt shorter than the window (the premise)."""
    family = sw.name.split("-")[1]
    full = tiny_model(family, num_layers=4, init_std=0.1)
    ids = torch.arange(7, 7 + WINDOW - 1).view(1, -1)
    torch.testing.assert_close(sw.model(ids).logits, full.model(ids).logits, atol=1e-5, rtol=0)


def _docs() -> list[str]:
    return [render_passage("Paris is in France.", None), render_passage("Ada wrote code.", None)]


def test_full_equals_model_generate_and_decodes_past_the_window(sw: Any) -> None:
    eng = KVRAGEngine(sw, MemoryStore(), EngineConfig(chunk_prefix="none"))
    docs = _docs()
    prompt = "Q:" + "".join(docs) + "\nA:"
    ids = eng.tokenize(prompt)
    assert len(ids) < WINDOW - 1
    n = WINDOW  # decoding runs well past the window: the model's own sliding attention, as in model.generate
    ref = sw.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=1)[0, len(ids):].tolist()
    got = eng.answer(prompt, chunks=docs, method="full", gen=GenerationConfig(max_new_tokens=n)).token_ids
    assert len(got) >= 1 and got == ref[: len(got)]
    assert len(ids) + len(ref) > WINDOW


@pytest.mark.parametrize("spec", ["stale", "full", "relaxkv:r=1.0", "prophetkv:r=1.0", "cacheblend:r=1.0",
                                  "epic:k=1000", "relaxkv-fullctx:r=1.0"])
def test_every_method_is_exact_within_the_window(sw: Any, spec: str) -> None:
    """One chunk from position 0 for stale; a prefix + three chunks for the recompute-everything settings."""
    model, spec_kv = sw.model, sw.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(7)
    lens = (("chunk", 30),) if spec == "stale" else (("prefix", 5), ("chunk", 9), ("chunk", 8), ("chunk", 8))
    pieces = [(kind, compute_chunk_kv(model, rope, spec_kv, torch.randint(5, 256, (n,), generator=g).tolist()), None)
              for kind, n in lens]
    suffix = torch.randint(5, 256, (5,), generator=g)
    ref_inp = assemble(model, rope, spec_kv, pieces, suffix)
    assert ref_inp.context_len + 5 < WINDOW
    ref = get_method("full").fuse(ref_inp)
    fk, fv = context_kv(ref, ref_inp.context_len)
    ref_tokens = greedy_tokens(ref_inp, ref, 6)
    inp = assemble(model, rope, spec_kv, pieces, suffix)
    out = get_method(spec).fuse(inp)
    k, v = context_kv(out, inp.context_len)
    torch.testing.assert_close(k, fk, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, fv, atol=1e-4, rtol=0)
    assert greedy_tokens(inp, out, 6) == ref_tokens


# --- refused beyond it ----------------------------------------------------------------------------------------------------


def test_chunk_longer_than_the_window_is_refused_clearly(sw: Any) -> None:
    eng = KVRAGEngine(sw, MemoryStore())
    long_chunk = render_passage("The quick brown fox jumps over the lazy dog. " * 6, "Fox")
    assert len(eng.tokenize(long_chunk)) > WINDOW
    with pytest.raises(ContextLengthError, match=f"sliding window of {WINDOW} tokens") as e:
        eng.ingest([long_chunk])
    assert f"must fit in {WINDOW - 1} tokens" in str(e.value)
    with pytest.raises(ContextLengthError, match="sliding window"):
        eng.answer("Q:" + long_chunk + "\nA:", chunks=[long_chunk], method="relaxkv", max_new_tokens=2)


@pytest.mark.parametrize("method", ["full", "stale", "relaxkv:r=0.3", "cacheblend:r=0.3", "prophetkv"])
def test_prompt_longer_than_the_window_is_refused_clearly(sw: Any, method: str) -> None:
    eng = KVRAGEngine(sw, MemoryStore())
    docs = [render_passage(t, None) for t in ("Paris is the capital of France.", "Berlin is in Germany.",
                                              "The fox jumps.", "Ada wrote the first program.")]
    eng.ingest(docs)  # every chunk fits alone
    prompt = "Context:" + "".join(docs) + "\nQuestion: which city is in France?\nAnswer:"
    assert len(eng.tokenize(prompt)) > WINDOW
    with pytest.raises(ContextLengthError, match=f"sliding window of {WINDOW} tokens"):
        eng.answer(prompt, chunks=docs, method=method, max_new_tokens=2)
