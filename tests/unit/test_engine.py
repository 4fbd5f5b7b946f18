"""Engine equivalences on tiny models: full == model.generate, stale with one chunk == full, streaming."""

from __future__ import annotations

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import get_method
from kvrag.kv import hf_cache
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.tiny import FAMILIES, tiny_model

PASSAGES = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
]


def make_engine(family: str = "llama", dtype: torch.dtype = torch.float32, quantize: str | None = None,
                **cfg) -> KVRAGEngine:
    return KVRAGEngine(tiny_model(family, dtype=dtype, quantize=quantize), MemoryStore(), EngineConfig(**cfg))


@pytest.mark.parametrize(("dtype", "quantize"), [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.float32, "int4"), (torch.float32, "int8")])
@pytest.mark.parametrize("family", FAMILIES)
def test_full_matches_model_generate(family: str, dtype: torch.dtype, quantize: str | None) -> None:
    """Token for token in every compute dtype kvrag may pick and with quantized weights (the same model object, so
    the same kernels: generate's decode steps run the same quantized products)."""
    eng = make_engine(family, dtype, quantize)
    assert eng.loaded.quantize == quantize
    prefix, ps, suffix = RagTemplate().parts(eng.tokenizer, PASSAGES, "What is the capital of France?")
    plan = eng.plan_parts(prefix, ps, suffix)
    ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
    n = 12
    ref = eng.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
        max_new_tokens=n, min_new_tokens=n, pad_token_id=eng.tokenizer.pad_token_id,
    )[0, len(ids):].tolist()
    resp = eng.answer_plan(plan, "full", GenerationConfig(max_new_tokens=n))
    # min_new_tokens suppresses EOS in generate; compare the prefix up to our first EOS (if any)
    assert resp.token_ids == ref[: len(resp.token_ids)]
    assert len(resp.token_ids) == n or ref[len(resp.token_ids)] in eng._eos_ids()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_preamble", [True, False])
def test_stale_single_chunk_equals_full(family: str, with_preamble: bool) -> None:
    eng = make_engine(family, chunk_prefix="template" if with_preamble else "none")
    if with_preamble:
        # the only text before the chunk is exactly the conditioning preamble
        prefix, suffix = eng.template_preamble(), "Question: capital of France?<|im_end|>\n<|im_start|>assistant\n"
    else:
        prefix, suffix = "", "Question: capital of France?"
    plan = eng.plan_parts(prefix, PASSAGES[:1], suffix)
    outs = {}
    for m in ("full", "stale"):
        prep = eng.prepare(plan, m)
        outs[m] = (hf_cache.cache_to_tensors(prep.cache), prep.last_logits)
    (kf, vf), lf = outs["full"]
    (ks, vs), ls = outs["stale"]
    torch.testing.assert_close(ks, kf, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(vs, vf, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ls, lf, atol=1e-4, rtol=1e-4)
    gen = GenerationConfig(max_new_tokens=8)
    assert eng.answer_plan(plan, "stale", gen).token_ids == eng.answer_plan(plan, "full", gen).token_ids


def test_stale_multi_chunk_differs_from_full_and_reports_stats() -> None:
    eng = make_engine()
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "Who?")
    r1 = eng.answer(prompt, PASSAGES, "stale", max_new_tokens=4)
    assert r1.stats["chunks_found"] == 3 and r1.stats["chunk_misses"] == 3 and r1.stats["hit_rate"] == 0.0
    r2 = eng.answer(prompt, PASSAGES, "stale", max_new_tokens=4)
    assert r2.stats["chunk_hits"] == 3 and r2.stats["hit_rate"] == 1.0
    assert r2.stats["reused_tokens"] == r2.stats["context_tokens"]
    for k in ("fetch_s", "assemble_s", "repair_s", "suffix_prefill_s", "ttft_s", "total_s"):
        assert r2.timings[k] >= 0
    pf = eng.prepare(eng.plan(prompt, PASSAGES), "full")
    ps = eng.prepare(eng.plan(prompt, PASSAGES), "stale")
    kf, _ = hf_cache.cache_to_tensors(pf.cache)
    ks, _ = hf_cache.cache_to_tensors(ps.cache)
    assert not torch.allclose(kf, ks, atol=1e-4)  # later chunks really are stale


def test_streaming_concatenates_to_answer() -> None:
    eng = make_engine()
    plan = eng.plan_parts("Context:\n", PASSAGES[:2], "Question: who?\nAnswer:")
    gen = GenerationConfig(max_new_tokens=10)
    streamed = "".join(eng.stream(eng.prepare(plan, "stale"), gen))
    assert streamed == eng.answer_plan(plan, "stale", gen).text


def test_stop_strings_and_sampling_are_deterministic_with_seed() -> None:
    eng = make_engine()
    plan = eng.plan_parts("Context:\n", PASSAGES[:1], "Q:")
    g = GenerationConfig(max_new_tokens=12, do_sample=True, seed=3, top_p=0.9, top_k=20)
    a, b = eng.answer_plan(plan, "stale", g), eng.answer_plan(plan, "stale", g)
    assert a.token_ids == b.token_ids
    full = eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=12)).text
    if len(full) > 3:
        stop = full[2:4]
        cut = eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=12, stop=(stop,))).text
        assert stop not in cut and full.startswith(cut)


def test_context_overflow_and_bad_method_raise() -> None:
    eng = make_engine(max_context=40)
    plan = eng.plan_parts("Context:\n", PASSAGES, "Q:")
    with pytest.raises(ContextLengthError, match="context window"):
        eng.prepare(plan, "stale")
    with pytest.raises(ConfigError, match="valid methods"):
        get_method("nope")
    with pytest.raises(ConfigError, match="valid parameters"):
        get_method("stale:r=0.5")


@pytest.mark.parametrize("method", ["full", "stale", "relaxkv:r=0.5"])
def test_kv_buffer_growth_during_decode_changes_nothing(method: str) -> None:
    """A request buffer is sized once, at prepare, for prompt + ``reserve`` new tokens: a request prepared with no
    room for decoding is refused a stream (a clear error, no growth past its KV lease); one prepared with room
    decodes the same tokens without reallocating, and the repaired context KV lives in the request's buffer (no
    concatenation)."""
    eng = make_engine("llama")
    prefix, ps, suffix = RagTemplate().parts(eng.tokenizer, PASSAGES, "What is the capital of France?")
    plan = eng.plan_parts(prefix, ps, suffix)
    gen = GenerationConfig(max_new_tokens=10)
    ref = eng.answer_plan(plan, method, gen)
    none = eng.prepare(plan, method, reserve=0)
    assert none.cache.layers[0].buf.capacity == plan.total_len  # exactly the prompt
    with pytest.raises(ConfigError, match="reserve=10"):
        next(eng.stream(none, gen))
    tight = eng.prepare(plan, method, reserve=gen.max_new_tokens)
    buf = tight.cache.layers[0].buf
    cap = buf.capacity
    assert cap == plan.total_len + gen.max_new_tokens
    text = "".join(eng.stream(tight, gen))
    assert tight.token_ids == ref.token_ids and text == ref.text
    assert buf.capacity == cap  # no allocation while decoding
    k, _ = hf_cache.cache_to_tensors(tight.cache)
    assert k.shape[2] == plan.total_len + len(tight.token_ids) - 1  # the last sampled token is not fed back


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_epic_with_k_0_is_stale(quantize: str | None) -> None:
    """``epic:k=0`` recomputes nothing: it is ``stale`` (docs/methods.md), the same tokens and the suffix prefilled
    as for ``stale`` -- not folded into a layer pass of its own, whose products took another route than stale's
    suffix prefill (on the real model with int4 weights: "on Sundays." against "on Sunday.")."""
    eng = make_engine(quantize=quantize)
    ps = [render_passage(t) for t in ("A day pass costs 9 marks in all three zones.",
                                      "The last ferry leaves Tamsin Isle at 23:40 on weekdays.")]
    prompt = RagTemplate().render(eng.tokenizer, ps, "When does the last ferry leave?")
    stale = eng.answer(prompt, chunks=ps, method="stale", max_new_tokens=8)
    epic = eng.answer(prompt, chunks=ps, method="epic:k=0", max_new_tokens=8)
    assert epic.token_ids == stale.token_ids
    assert epic.stats.method_stats.recomputed_fraction == 0 and not epic.stats.method_stats.suffix_folded


def test_reused_tokens_leave_out_what_was_recomputed_at_every_layer() -> None:
    """``reused_tokens`` counts context tokens whose stored K/V reach the answer: all of them for ``stale``, the
    exact prefix only for a recompute-everything setting (every chunk token recomputed at every layer; it reported
    every fetched token), none for ``full``."""
    eng = make_engine()
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "What is the capital of France?")
    eng.answer(prompt, chunks=PASSAGES, method="stale", max_new_tokens=2)  # caches the chunks and the prefix
    stale = eng.answer(prompt, chunks=PASSAGES, method="stale", max_new_tokens=2).stats
    assert stale.reused_tokens == stale.context_tokens
    for method in ("relaxkv:r=1", "cacheblend:r=1"):
        st = eng.answer(prompt, chunks=PASSAGES, method=method, max_new_tokens=2).stats
        assert st.reused_tokens == st.context_tokens - st.chunk_tokens > 0, method
    assert eng.answer(prompt, chunks=PASSAGES, method="full", max_new_tokens=2).stats.reused_tokens == 0


def test_seeds_equal_in_their_low_32_bits_sample_differently() -> None:
    """torch's CPU generator keeps a seed's low 32 bits, so seed -1 and 2**63 - 1 (both valid OpenAI seeds) sampled
    the same answer; seeds 0 .. 2**32 - 1 keep their samples."""
    from kvrag.engine.generate import generator_seed

    assert [generator_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    assert len({generator_seed(s) for s in (-1, 2**63 - 1, 2**32, -(2**63), 2**200)}) == 5
    eng = make_engine()
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "Say something.")

    def sample(seed: int) -> list[int]:
        return eng.answer(prompt, chunks=PASSAGES, method="stale", max_new_tokens=12, do_sample=True,
                          temperature=1.5, seed=seed).token_ids

    assert sample(-1) == sample(-1) and sample(-1) != sample(2**63 - 1)
