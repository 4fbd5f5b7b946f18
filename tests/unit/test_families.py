"""The family matrix (:mod:`kvrag_testing.families`): every served family, as a tiny random model built offline from
its transformers config, through the equivalence oracle in float32 and bfloat16; the refusals; and the docs table
rendered from the same data."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.assemble import assemble
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ContextLengthError, UnsupportedModelError
from kvrag.fusion import get_method
from kvrag.kv import batched, fused_step, hf_cache, row_attention, step_backend
from kvrag.kv.attention import IMPL
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope, check_rope_support
from kvrag.store import MemoryStore
from kvrag_testing.batching import compare_batched_to_alone
from kvrag_testing.equivalence import assert_close_in_dtype, bf16_kl_bound, kl
from kvrag_testing.families import FUSED, RECOMPUTE_ALL, REUSE, SERVED, render_table, table_in
from kvrag_testing.fusion_suite import LAYOUT, SUFFIX_LEN
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = tuple(f.family for f in SERVED)
DTYPES = (torch.float32, torch.bfloat16)
LAYERS = 4
INIT_STD = 0.1
DOCS_MODELS = Path(__file__).resolve().parents[2] / "docs" / "models.md"

# Chunks joined by single spaces: each chunk after the first starts a word that the prompt's tokenization merges
# with the space before it, so the chunk boundary falls inside a token.
CHUNKS = [
    "Paris is the capital of France and has many museums.",
    "Berlin is the capital of Germany and a large city.",
    "The quick brown fox jumps over the lazy dog.",
]
QUESTION = "Question: What is the capital of France? Answer:"


@functools.lru_cache(maxsize=4)
def _lm(family: str, dtype: torch.dtype) -> Any:
    return tiny_model(family, num_layers=LAYERS, init_std=INIT_STD, dtype=dtype)


def _engine(family: str, dtype: torch.dtype) -> KVRAGEngine:
    return KVRAGEngine(_lm(family, dtype), MemoryStore(), EngineConfig())


# --- full is model.generate on any prompt string ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_full_equals_generate_with_chunk_boundaries_inside_tokens(family: str, dtype: torch.dtype) -> None:
    """``full`` prefills the prompt's own tokenization, so it is ``model.generate`` on the prompt string even where
    the reuse methods splice chunks whose boundary tokens differ (reported in ``inexact_chunks``)."""
    eng = _engine(family, dtype)
    prompt = "Context: " + " ".join(CHUNKS) + " " + QUESTION
    plan = eng.plan(prompt, CHUNKS)
    assert plan.found == 3 and plan.inexact_chunks >= 1  # a boundary really falls inside a token
    ids = eng.tokenizer(prompt)["input_ids"]
    assert list(plan.token_ids) != ids
    n = 10
    got = eng.answer_plan(plan, "full", GenerationConfig(max_new_tokens=n))
    assert got.token_ids == _generate(eng, ids, n)
    stale = eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=2))  # reuse splices and says so
    assert stale.stats.inexact_chunks == plan.inexact_chunks and stale.stats.chunk_hits + stale.stats.chunk_misses == 3


def _generate(eng: KVRAGEngine, ids: list[int], n: int) -> list[int]:
    """``model.generate``'s greedy tokens after ``ids`` (at most ``n``; an EOS ends them and is not kept, as in a
    kvrag answer)."""
    out = eng.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, eos_token_id=eng._eos_ids(),
                             pad_token_id=eng.tokenizer.pad_token_id)[0, len(ids):].tolist()
    eos = set(eng._eos_ids())
    return [t for t in out[: next((i for i, t in enumerate(out) if t in eos), len(out))]]


# --- positions: re-rotated keys are the keys a prefill computes there ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_rerotated_keys_equal_a_prefill_at_those_positions(family: str, dtype: torch.dtype) -> None:
    """Every layer (per-layer bases, layers without RoPE, partial rotary, interleaved pairs): keys prefilled at
    0..T-1, canonicalized and placed at 300..300+T-1 equal the same ids prefilled at 300.. directly."""
    lm = _lm(family, dtype)
    rope = Rope.from_model(lm.model)
    ids = torch.randint(5, 256, (20,), generator=torch.Generator().manual_seed(3))
    k0, v0 = hf_cache.prefill_kv(lm.model, ids)
    _, cache = hf_cache.forward(lm.model, ids, None, start=300)
    k1, v1 = hf_cache.cache_to_tensors(cache)
    placed = rope.place(rope.canonicalize(k0, torch.arange(20)), torch.arange(300, 320))
    assert_close_in_dtype(placed, k1, dtype, fp32_atol=5e-5)
    assert_close_in_dtype(v0, v1, dtype, fp32_atol=5e-5)
    if dtype == torch.float32:  # and the rotation is not a no-op where the layer has RoPE
        assert (k0 - k1).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_load_time_check_passes_every_family_and_refuses_a_layer_that_skips_rope(dtype: torch.dtype) -> None:
    """:func:`check_rerotation` judges each layer on the same inputs at both positions: it passes every supported
    family in both dtypes, and names the layer of a model whose code leaves one layer's keys unrotated."""
    from kvrag.kv.compute import check_rerotation

    for family in FAMILIES:
        lm = _lm(family, dtype)
        check_rerotation(lm.model, Rope.from_model(lm.model), name=family)
    lm = tiny_model("llama", num_layers=LAYERS, init_std=INIT_STD, dtype=dtype)
    rope = Rope.from_model(lm.model)

    def no_rope(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "position_embeddings": (torch.ones_like(cos), torch.zeros_like(sin))}

    hook = hf_cache.decoder_layers(lm.model)[2].register_forward_pre_hook(no_rope, with_kwargs=True)
    try:
        with pytest.raises(UnsupportedModelError, match="in layer 2 "):
            check_rerotation(lm.model, rope, name="patched")
    finally:
        hook.remove()


def test_layers_without_rope_keep_their_keys_as_they_are() -> None:
    """SmolLM3's NoPE layers: the canonical key is the cached key (no rotation), every other layer is rotated."""
    lm = _lm("smollm3", torch.float32)
    rope = Rope.from_model(lm.model)
    nope = [i for i, use in enumerate(lm.model.config.no_rope_layers) if not use]
    assert nope == [3]
    ids = torch.randint(5, 256, (12,), generator=torch.Generator().manual_seed(4))
    k, _ = hf_cache.prefill_kv(lm.model, ids)
    canon = rope.canonicalize(k, torch.arange(12))
    assert torch.equal(canon[3], k[3])
    assert not torch.equal(canon[0], k[0])


def test_partial_rotary_turns_only_the_rotary_part() -> None:
    lm = _lm("phi", torch.float32)
    rope = Rope.from_model(lm.model)
    assert (rope.rotary_dim, rope.head_dim) == (8, 16)
    x = torch.randn(LAYERS, 2, 5, 16)
    y = rope.place(x, torch.arange(100, 105))
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])


@pytest.mark.parametrize(("family", "rope"), [
    ("phi3", {"partial_rotary_factor": 0.75, "rope_type": "longrope", "short_factor": [1.0] * 6,
              "long_factor": [3.0] * 6, "original_max_position_embeddings": 1024}),  # Phi-4-mini's layout
    ("gemma3", {"rope_type": "linear", "factor": 8.0}),  # Gemma 3's global layers: linear scaling, local: none
])
def test_released_rope_layouts_rerotate_exactly(family: str, rope: dict) -> None:
    """Partial rotary under LongRoPE (Phi-4-mini) and per-layer-type scaling (Gemma 3): re-rotation exact, ``full``
    == ``model.generate``."""
    lm = tiny_model(family, num_layers=LAYERS, init_std=INIT_STD, rope=rope)
    r = Rope.from_model(lm.model)
    ids = torch.randint(5, 256, (20,), generator=torch.Generator().manual_seed(5))
    k0, _ = hf_cache.prefill_kv(lm.model, ids)
    _, cache = hf_cache.forward(lm.model, ids, None, start=300)
    k1, _ = hf_cache.cache_to_tensors(cache)
    torch.testing.assert_close(r.place(r.canonicalize(k0, torch.arange(20)), torch.arange(300, 320)), k1,
                               atol=5e-5, rtol=0)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    prompt = "Context: " + " ".join(CHUNKS) + " " + QUESTION
    assert eng.answer(prompt, CHUNKS, "full", max_new_tokens=6).token_ids == _generate(eng, eng.tokenize(prompt), 6)


def test_one_layers_rotation_is_that_layers_slice_of_the_whole() -> None:
    """``Rope.layer(i)`` (what CacheRepair places each layer's residual with) rotates like row ``i`` of the
    per-layer rotation: Gemma 3's global layer with its own base, SmolLM3's NoPE layer not at all."""
    for family in ("gemma3", "smollm3"):
        rope = Rope.from_model(_lm(family, torch.float32).model)
        assert rope.per_layer
        x, pos = torch.randn(LAYERS, 2, 6, 16), torch.arange(50, 56)
        whole = rope.place(x, pos)
        for i in range(LAYERS):
            torch.testing.assert_close(rope.layer(i).place(x[i], pos), whole[i], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "smollm3", "phi"])
def test_cacherepair_runs_with_per_layer_and_partial_rope(family: str, tmp_path: Path) -> None:
    """``cacherepair`` (a random tiny repairer for the model) places each layer's key residual with that layer's
    rotation: it runs through the engine and gives finite logits."""
    from kvrag.repair.config import RepairConfig
    from kvrag.repair.model import RepairModel

    eng = _engine(family, torch.float32)
    s = eng.loaded.kv_spec()
    cfg = RepairConfig.from_preset("tiny", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                   embed_dim=64)
    torch.manual_seed(0)
    m = RepairModel(cfg)
    torch.nn.init.normal_(m.head.weight, std=0.05)
    path = m.eval().save_pretrained(tmp_path / "rep", target_fingerprint=eng.loaded.fingerprint)
    prompt = "Context: " + " ".join(CHUNKS) + " " + QUESTION
    for method in (f"cacherepair:checkpoint={path}", f"hybrid:checkpoint={path},r=0.1"):
        prep = eng.prepare(eng.plan(prompt, CHUNKS), method)
        assert torch.isfinite(prep.last_logits).all(), method
        assert prep.stats.chunk_hits + prep.stats.chunk_misses == 3


# --- the fusion oracle ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _case(family: str, dtype: torch.dtype) -> tuple[Any, Rope, Any, list, torch.Tensor]:
    """The fusion suite's layout (an exact prefix, three chunks, a text span; a question suffix) for ``family``."""
    lm = _lm(family, dtype)
    model, spec = lm.model, lm.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(1234)
    pieces = []
    for i, (kind, n) in enumerate(LAYOUT):
        ids = torch.randint(5, 256, (n,), generator=g).tolist()
        pieces.append((kind, compute_chunk_kv(model, rope, spec, ids), f"{kind}{i}" if kind == "chunk" else None))
    return model, rope, spec, pieces, torch.randint(5, 256, (SUFFIX_LEN,), generator=g)


def _fuse(family: str, dtype: torch.dtype, method: str, steps: int = 3) -> tuple[torch.Tensor, list[int], Any]:
    """Next-token logits after the suffix [V], the greedy tokens after them, and the fused context K/V."""
    model, rope, spec, pieces, suffix = _case(family, dtype)
    inp = assemble(model, rope, spec, pieces, suffix)
    out = get_method(method).fuse(inp)
    kv = tuple(t[:, :, : inp.context_len].clone() for t in hf_cache.cache_to_tensors(out.cache))
    cache, pos = out.cache, inp.context_len + SUFFIX_LEN
    if out.last_logits is None:
        logits, cache = hf_cache.forward(model, inp.suffix_ids, cache, start=inp.context_len)
        first = logits[-1]
    else:
        first = out.last_logits
    last, tokens = first, []
    for _ in range(steps):
        tokens.append(int(torch.argmax(last)))
        logits, cache = hf_cache.forward(model, torch.tensor([tokens[-1]]), cache, start=pos)
        last, pos = logits[-1], pos + 1
    return first.float(), tokens, kv


@functools.lru_cache(maxsize=4)
def _full(family: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], Any]:
    return _fuse(family, dtype, "full")


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_everything_equals_full_float32(family: str) -> None:
    ref_logits, ref_tokens, (fk, fv) = _full(family, torch.float32)
    for method in RECOMPUTE_ALL:
        logits, tokens, (k, v) = _fuse(family, torch.float32, method)
        torch.testing.assert_close(k, fk, atol=1e-4, rtol=0, msg=lambda m, s=method: f"{s}: {m}")
        torch.testing.assert_close(v, fv, atol=1e-4, rtol=0, msg=lambda m, s=method: f"{s}: {m}")
        torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=0)
        assert tokens == ref_tokens, method


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_everything_equals_full_bfloat16(family: str) -> None:
    """bf16 (the rule of :mod:`kvrag_testing.equivalence`): as close to fp32 ``full`` as bf16 ``full`` is, twice
    over, and the same greedy tokens as bf16 ``full``; ``stale`` breaks the rule on the same case."""
    ref, _, _ = _full(family, torch.float32)
    full_bf16, full_tokens, _ = _full(family, torch.bfloat16)
    bound = bf16_kl_bound(kl(ref, full_bf16))
    for method in RECOMPUTE_ALL:
        logits, tokens, _ = _fuse(family, torch.bfloat16, method)
        assert kl(ref, logits) <= bound, (method, kl(ref, logits), bound)
        assert tokens == full_tokens, method
    stale, _, _ = _fuse(family, torch.bfloat16, "stale")
    assert kl(ref, stale) > bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_reuse_method_runs_within_bounds(family: str, dtype: torch.dtype) -> None:
    """Each reuse method repairs into finite K/V no larger than the exact K/V's range (x2) and finite logits."""
    _, _, (fk, fv) = _full(family, dtype)
    for method in REUSE:
        logits, tokens, (k, v) = _fuse(family, dtype, method, steps=1)
        assert torch.isfinite(logits).all() and torch.isfinite(k).all() and torch.isfinite(v).all(), method
        assert k.float().abs().max() <= 2 * fk.float().abs().max(), method
        assert v.float().abs().max() <= 2 * fv.float().abs().max(), method
        assert 0 <= tokens[0] < 256


# --- decoding --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_batch_one(family: str) -> None:
    eng = _engine(family, torch.float32)
    why = batched.batchable(eng.model, IMPL)
    expected = next(f.decode for f in SERVED if f.family == family)
    if expected != "batched":  # decoded one request per step by the scheduler, as the table says
        assert why is not None and expected.startswith("one request per step")
        return
    assert why is None
    preps = [eng.prepare(eng.plan("Context: " + " ".join(CHUNKS[:k]) + " " + QUESTION, CHUNKS), m)
             for k, m in ((1, "stale"), (3, "full"), (2, "relaxkv:r=0.3"))]
    got = compare_batched_to_alone(eng.model, preps, 6)
    assert got.worst < 1e-4
    fused_in = next(f.fused_in for f in SERVED if f.family == family)  # the backend the table names served them
    if row_attention.why_not(torch.float32) is None:  # the fused step's kernel serves float32 on this CPU
        assert (step_backend.chosen(eng.model, "decode") == "fused") is ("float32" in fused_in)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_step_serves_the_families_the_table_says(family: str) -> None:
    """The fused step serves the family in the dtypes the table says (its bits are tests/unit/test_fused_step.py's)
    and refuses it, naming why, in the others."""
    f = next(f for f in SERVED if f.family == family)
    assert f.step.startswith(FUSED) is bool(f.fused_in)
    for dtype in DTYPES:
        if row_attention.why_not(dtype) is not None:  # the fused step's kernel does not serve it on this CPU
            continue
        why = fused_step.why_not(_lm(family, dtype).model)
        assert (why is None) is (str(dtype).removeprefix("torch.") in f.fused_in), (dtype, why)


@pytest.mark.parametrize(("family", "impl"), [("gemma2", "eager"), ("gpt_oss", "eager"), ("gemma3", IMPL)])
def test_load_model_picks_the_attention_transformers_accepts(family: str, impl: str, tmp_path: Path) -> None:
    """transformers refuses SDPA for Gemma 2 (soft-capping) and GPT-OSS (sinks): a checkpoint of either loads with
    eager attention, the others with kvrag's SDPA."""
    from kvrag.models import load_model

    lm = tiny_model(family, num_layers=2)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.model.config._attn_implementation == impl
    assert loaded.fingerprint == lm.fingerprint


# --- chat templates of the families -----------------------------------------------------------------------------------

CHAT_TEMPLATES = {
    "gemma": "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == "
             "'assistant' else message['role']) + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
    "phi3": "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    "smollm3": "{{ '<|im_start|>system\n## Metadata\n\nReasoning Mode: /no_think\n\n<|im_end|>\n' }}"
               "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
}
"""The turn markers of Gemma (``<start_of_turn>``, contents trimmed), Phi-3 (``<|user|>`` ... ``<|end|>``) and
SmolLM3 (ChatML after a metadata system turn)."""


@pytest.mark.parametrize("family", sorted(CHAT_TEMPLATES))
def test_family_chat_templates_splice_exactly(family: str) -> None:
    """A RAG prompt rendered with the family's chat template (what the LlamaIndex and LangChain adapters render
    through :func:`kvrag.prompting.render_chat`): every passage is found and spliced exactly (no inexact chunk),
    ``full`` == ``model.generate`` and the reuse methods hit every chunk."""
    from kvrag.models import wrap_model
    from kvrag.prompting import RagTemplate, render_passage
    from kvrag_testing.tiny import tiny_tokenizer

    lm = _lm(family, torch.float32)
    lm = wrap_model(lm.model, tiny_tokenizer(chat_template=CHAT_TEMPLATES[family]), name=f"tiny-{family}-chat")
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    passages = [render_passage(c, f"Doc {i}") for i, c in enumerate(CHUNKS)]
    eng.ingest(passages)
    prompt = RagTemplate().render(eng.tokenizer, passages, "What is the capital of France?")
    plan = eng.plan(prompt, passages)
    assert (plan.found, plan.inexact_chunks) == (3, 0)
    assert list(plan.token_ids) == eng.tokenize(prompt)
    got = eng.answer_plan(plan, "full", GenerationConfig(max_new_tokens=6))
    assert got.token_ids == _generate(eng, eng.tokenize(prompt), 6)
    stale = eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=1))
    assert stale.stats.chunk_hits == 3


# --- refusals and limits ---------------------------------------------------------------------------------------------


def test_longrope_long_regime_is_refused_with_the_reason() -> None:
    lm = tiny_model("phi3", num_layers=2, rope={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                "long_factor": [4.0] * 8, "original_max_position_embeddings": 64})
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    assert int(eng.max_context) == 64
    with pytest.raises(ContextLengthError, match="longrope"):
        eng.answer("word " * 80, max_new_tokens=1)
    ids = eng.tokenizer("Context: " + CHUNKS[0] + " " + QUESTION)["input_ids"]  # the short regime is served exactly
    got = eng.answer("Context: " + CHUNKS[0] + " " + QUESTION, [CHUNKS[0]], "full", max_new_tokens=4)
    assert got.token_ids == _generate(eng, ids, 4)


def test_a_layer_that_positions_keys_otherwise_is_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time measurement (:func:`kvrag.kv.compute.check_rerotation`) catches what configs do not show:
    without the rule that EXAONE 4's global layers skip RoPE, re-rotation would be wrong in layer 3 -- refused."""
    from kvrag.kv import rope as rope_module

    monkeypatch.setattr(rope_module, "GLOBAL_NOPE_MODEL_TYPES", frozenset())
    with pytest.raises(UnsupportedModelError, match="layer 3 .*relative error"):
        tiny_model("exaone4", num_layers=4, init_std=INIT_STD)


def test_multimodal_rope_is_refused_by_name() -> None:
    lm = tiny_model("llama", num_layers=1)
    lm.model.config.rope_parameters = {**lm.model.config.rope_parameters, "mrope_section": [2, 3, 3]}
    with pytest.raises(UnsupportedModelError, match="multimodal RoPE"):
        check_rope_support(lm.model, name="tiny-vl")


# --- the docs table --------------------------------------------------------------------------------------------------


def test_docs_table_is_the_rendered_matrix() -> None:
    """docs/models.md holds exactly the table rendered from the matrix these tests check (regenerate it with
    ``python -m kvrag_testing.families``)."""
    assert table_in(DOCS_MODELS) == render_table()
