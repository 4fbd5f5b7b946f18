"""Sliding-window models: served past the window, each layer with its own window -- ``full`` is ``model.generate``,
every recompute-everything setting is ``full``, chunk caches longer than a window stay whole. Tiny Mistral (window at
every layer), Qwen2 (``use_sliding_window``, window at the upper layers) and Gemma 3 (5 local : 1 global layers)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.assemble import assemble
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import UnsupportedModelError
from kvrag.fusion import get_method
from kvrag.kv import hf_cache
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.window import attention_window, layer_windows
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_bench.ablations import register_ablations
from kvrag_testing.batching import compare_batched_to_alone
from kvrag_testing.equivalence import kl
from kvrag_testing.fusion_suite import context_kv, greedy_tokens
from kvrag_testing.tiny import tiny_model

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


def test_the_window_does_not_cap_the_context(sw: Any) -> None:
    eng = KVRAGEngine(sw, MemoryStore())
    assert type(eng.max_context) is int and eng.max_context == 4096  # max_position_embeddings
    assert KVRAGEngine(sw, MemoryStore(), EngineConfig(max_context=20)).max_context == 20


def test_a_prefill_keeps_every_token_past_the_window(sw: Any) -> None:
    """transformers' sliding cache layer keeps W - 1 tokens; kvrag's prefills keep every token in every layer (the
    model's masks still apply the window), so a chunk longer than the window has its whole cache."""
    ids = torch.arange(5, 5 + WINDOW + 20)
    k, v = hf_cache.prefill_kv(sw.model, ids)
    assert k.shape[2] == v.shape[2] == WINDOW + 20
    ref = sw.model(ids.view(1, -1), use_cache=True).cache  # the model's own sliding cache: the last W - 1 tokens
    windowed = set(attention_window(sw.model.config).layers)
    for i, layer in enumerate(ref.layers):
        n = int(layer.keys.shape[2])
        assert n == (WINDOW - 1 if i in windowed else WINDOW + 20)
        torch.testing.assert_close(k[i, :, -n:], layer.keys[0], atol=1e-5, rtol=0)


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


def _assert_method_equals_full(model: Any, rope: Rope, spec_kv: Any, lens: tuple[tuple[str, int], ...], spec: str,
                               g: torch.Generator) -> int:
    """Random pieces of ``lens`` (kind, tokens) and a 5-token suffix: ``spec``'s context KV within 1e-4 of ``full``'s
    and the same 6 greedy tokens. Returns the context length."""
    pieces = [(kind, compute_chunk_kv(model, rope, spec_kv, torch.randint(5, 256, (n,), generator=g).tolist()), None)
              for kind, n in lens]
    suffix = torch.randint(5, 256, (5,), generator=g)
    ref_inp = assemble(model, rope, spec_kv, pieces, suffix)
    ref = get_method("full").fuse(ref_inp)
    fk, fv = context_kv(ref, ref_inp.context_len)
    ref_tokens = greedy_tokens(ref_inp, ref, 6)
    inp = assemble(model, rope, spec_kv, pieces, suffix)
    out = get_method(spec).fuse(inp)
    k, v = context_kv(out, inp.context_len)
    torch.testing.assert_close(k, fk, atol=1e-4, rtol=0)
    torch.testing.assert_close(v, fv, atol=1e-4, rtol=0)
    assert greedy_tokens(inp, out, 6) == ref_tokens
    return int(ref_inp.context_len)


@pytest.mark.parametrize("spec", ["stale", "full", "relaxkv:r=1.0", "prophetkv:r=1.0", "cacheblend:r=1.0",
                                  "epic:k=1000", "relaxkv-fullctx:r=1.0"])
def test_every_method_is_exact_within_the_window(sw: Any, spec: str) -> None:
    """One chunk from position 0 for stale; a prefix + three chunks for the recompute-everything settings."""
    model, spec_kv = sw.model, sw.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(7)
    lens = (("chunk", 30),) if spec == "stale" else (("prefix", 5), ("chunk", 9), ("chunk", 8), ("chunk", 8))
    context_len = _assert_method_equals_full(model, rope, spec_kv, lens, spec, g)
    assert context_len + 5 < WINDOW


# --- past the window -----------------------------------------------------------------------------------------------


def test_chunk_longer_than_the_window_is_served_exactly(sw: Any) -> None:
    """A chunk of more than W tokens: its cache is whole, and from position 0 (after the exact prefix it was
    conditioned on) ``stale`` equals ``full``; ``full`` equals ``model.generate``."""
    eng = KVRAGEngine(sw, MemoryStore(), EngineConfig(chunk_prefix="none"))
    long_chunk = render_passage("The quick brown fox jumps over the lazy dog. " * 6, "Fox")
    assert len(eng.tokenize(long_chunk)) > WINDOW
    eng.ingest([long_chunk])
    plan = eng.plan_parts("", [long_chunk], "\nQuestion: who jumps?\nAnswer:")
    full, stale = (eng.prepare(plan, m) for m in ("full", "stale"))
    torch.testing.assert_close(stale.last_logits, full.last_logits, atol=1e-4, rtol=0)
    ids = list(plan.token_ids)
    ref = sw.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=6, eos_token_id=4, pad_token_id=1)[0, len(ids):].tolist()
    got = eng.answer_plan(plan, "full", GenerationConfig(max_new_tokens=6)).token_ids
    assert got == [t for t in ref[: ref.index(4) if 4 in ref else len(ref)]]


@pytest.mark.parametrize("spec", ["relaxkv:r=1.0", "prophetkv:r=1.0", "cacheblend:r=1.0", "epic:k=1000",
                                  "relaxkv-fullctx:r=1.0"])
def test_recompute_everything_equals_full_past_the_window(sw: Any, spec: str) -> None:
    """A prefix + three chunks, 2.5 windows in all: each layer's window is honoured by the recompute's masks."""
    model, spec_kv = sw.model, sw.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(8)
    lens = (("prefix", 5), ("chunk", 30), ("chunk", 45), ("chunk", 20))
    context_len = _assert_method_equals_full(model, rope, spec_kv, lens, spec, g)
    assert context_len > 2 * WINDOW


@pytest.mark.parametrize("method", ["full", "stale", "relaxkv:r=0.3", "cacheblend:r=0.3", "prophetkv", "epic:k=4"])
def test_prompt_longer_than_the_window_every_method_runs(sw: Any, method: str) -> None:
    eng = KVRAGEngine(sw, MemoryStore())
    docs = [render_passage(t, None) for t in ("Paris is the capital of France.", "Berlin is in Germany.",
                                              "The fox jumps.", "Ada wrote the first program.")]
    eng.ingest(docs)
    prompt = "Context:" + "".join(docs) + "\nQuestion: which city is in France?\nAnswer:"
    assert len(eng.tokenize(prompt)) > WINDOW
    resp = eng.answer(prompt, chunks=docs, method=method, max_new_tokens=3)
    assert resp.stats.chunks_found == 4 and len(resp.token_ids) <= 3


# --- hybrid local / global: Gemma 3 ----------------------------------------------------------------------------------

GEMMA3_WINDOW = 64
SENTENCES = ["Paris is the capital of France and has many museums.", "Berlin is the capital of Germany.",
             "The quick brown fox jumps over the lazy dog.", "Rotary position embeddings rotate queries and keys.",
             "Each chunk of text is encoded once and reused.", "The committee wrote the report in the year 2021.",
             "Numbers such as 10 100 and 1000 appear in tables.", "The model reads the context, then the question."]


def test_gemma3_with_a_64_token_window_serves_a_400_token_4_chunk_prompt() -> None:
    """5 local layers (64-token window, base 10K) : 1 global layer (base 1M). ``full`` == ``model.generate`` on a
    ~450-token prompt of four chunks longer than the window; every reuse method runs and repairs: its KL to ``full``
    (summed over two questions) stays below ``stale``'s."""
    lm = tiny_model("gemma3", num_layers=6, init_std=0.1, sliding_window=GEMMA3_WINDOW)
    assert [w for _, w in layer_windows(lm.model.config)] == [GEMMA3_WINDOW] * 5 + [None]
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    docs = [render_passage(" ".join((SENTENCES * 2)[i : i + 4]), f"Doc {i}") for i in range(0, 8, 2)]
    eng.ingest(docs)
    prompts = [RagTemplate().render(eng.tokenizer, docs, q) for q in ("What is the capital of France?",
                                                                      "Who wrote the report?")]
    n_tokens = len(eng.tokenize(prompts[0]))
    assert 380 <= n_tokens <= 460 and all(len(eng.tokenize(d)) > GEMMA3_WINDOW for d in docs)
    ids = eng.tokenize(prompts[0])
    ref = lm.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=8, eos_token_id=4, pad_token_id=1)[0, len(ids):].tolist()
    got = eng.answer(prompts[0], chunks=docs, method="full", max_new_tokens=8).token_ids
    assert got == ref[: ref.index(4) if 4 in ref else len(ref)]
    full = [eng.prepare(eng.plan(p, docs), "full").last_logits for p in prompts]
    kls = {}
    for method in ("stale", "relaxkv:r=0.3", "cacheblend:r=0.3", "prophetkv:r=0.3", "epic:k=16"):
        preps = [eng.prepare(eng.plan(p, docs), method) for p in prompts]
        assert all(p.stats.chunks_found == 4 and p.stats.chunk_hits == 4 for p in preps)
        kls[method] = sum(kl(f, p.last_logits) for f, p in zip(full, preps, strict=True))
    assert kls["stale"] > 1e-3, kls  # reuse without repair is measurably off on this model
    assert all(v < kls["stale"] for m, v in kls.items() if m != "stale"), kls
    preps = [eng.prepare(eng.plan(p, docs), m) for p, m in zip(prompts, ("relaxkv:r=0.3", "stale"), strict=True)]
    assert compare_batched_to_alone(lm.model, preps, 4).worst < 1e-4  # batched decode past the window == batch 1
