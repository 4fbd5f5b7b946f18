"""The core on the real default model: full == model.generate, and an ingest -> ask round trip via the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrag import cli
from kvrag.config import GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.index import make_chunks, read_documents
from kvrag.kv import hf_cache
from kvrag.prompting import TEMPLATES, RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.equivalence import assert_close_in_dtype

pytestmark = pytest.mark.integration
DOCS = Path(__file__).parent.parent / "data" / "docs"


@pytest.fixture(scope="module")
def engine(default_model) -> KVRAGEngine:
    return KVRAGEngine(default_model, MemoryStore())


@pytest.fixture(scope="module")
def chunks(engine) -> list[str]:
    """Rendered passages (blank line first), as a prompt contains them."""
    return [render_passage(c.text) for c in make_chunks(read_documents(DOCS), lambda t: len(engine.tokenize(t)), 128)]


@pytest.mark.parametrize("model_fixture", ["default_model_fp32", "default_model_bf16", "default_model_int4"])
def test_full_equals_model_generate_on_default_model(request, chunks, model_fixture: str) -> None:
    """Token for token, in both compute dtypes kvrag may pick and with int4 weights (same ids, same model object,
    same kernels)."""
    engine = KVRAGEngine(request.getfixturevalue(model_fixture), MemoryStore())
    prefix, ps, suffix = RagTemplate().parts(engine.tokenizer, chunks, "How tall is the Harrow Point Lighthouse?")
    plan = engine.plan_parts(prefix, ps, suffix)
    ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
    n = 48  # room for the whole answer: model.generate stops on EOS before the limit, so the stop is checked too
    eos = engine._eos_ids()
    out = engine.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
        max_new_tokens=n, eos_token_id=eos, pad_token_id=engine.tokenizer.pad_token_id,
    )[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(out) if t in eos), None)  # kvrag returns the tokens before the EOS
    ref = out if stop is None else out[:stop]
    assert stop is not None and len(ref) >= 4, (stop, out)  # the case covers an answer that ends on EOS
    got = engine.answer_plan(plan, "full", GenerationConfig(max_new_tokens=n)).token_ids
    assert got == ref, (got, ref)  # the same tokens, the same length, the same stop
    short = engine.answer_plan(plan, "full", GenerationConfig(max_new_tokens=len(ref) - 2)).token_ids
    assert short == ref[: len(ref) - 2]  # and at a max_new_tokens limit before the EOS, exactly that many


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendered_passages_tokenize_as_in_the_whole_prompt(engine, name) -> None:
    """Each passage tokenized alone gives exactly the ids of its place in the tokenized prompt string, so the
    cached prompt is the prompt ``model.generate`` (or any HF pipeline) would see for the same text."""
    passages = [render_passage("Edith Crane (1841-1913) was a civil engineer.", "Edith Crane"),
                render_passage("It opened in 1874; 3.5 km long!", "Marlow Viaduct"),
                render_passage("  body with spaces and a trailing newline\n", None)]
    prefix, ps, suffix = TEMPLATES[name].parts(engine.tokenizer, passages, "Who designed it?")
    plan = engine.plan_parts(prefix, ps, suffix)
    ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
    whole = engine.tokenizer(prefix + "".join(ps) + suffix, add_special_tokens=False)["input_ids"]
    assert ids == whole


def test_stale_first_chunk_exact_and_later_chunks_stale(engine, chunks) -> None:
    prefix, ps, suffix = RagTemplate().parts(engine.tokenizer, chunks, "Who?")
    plan = engine.plan_parts(prefix, ps, suffix)
    assert plan.found == len(chunks)  # every rendered passage splices (its ids occur verbatim in the prompt's)
    kf, vf = hf_cache.cache_to_tensors(engine.prepare(plan, "full").cache)
    ks, vs = hf_cache.cache_to_tensors(engine.prepare(plan, "stale").cache)
    n_pre = len(plan.context[0].token_ids)
    for got, ref in ((ks, kf), (vs, vf)):  # the exact preamble: rounding only (bf16: its own, shape-dependent)
        # float32: measured max 2.0e-5 between the preamble alone and within the whole prompt; bound ~5x that
        assert_close_in_dtype(got[:, :, :n_pre], ref[:, :, :n_pre], engine.loaded.dtype, fp32_atol=1e-4)
    tc = plan.context_len
    rel_k = ((ks[:, :, n_pre:tc] - kf[:, :, n_pre:tc]).norm() / kf[:, :, n_pre:tc].norm()).item()
    rel_v = ((vs[:, :, n_pre:tc] - vf[:, :, n_pre:tc]).norm() / vf[:, :, n_pre:tc].norm()).item()
    # stale chunks are off, but not garbage: measured rel_k 0.174, rel_v 0.309 (float32 and bfloat16 alike); the
    # bounds sit 3-5x from them, so an exact splice (0) or unrelated KV of the same size (~1.4) fails
    assert 0.035 < rel_k < 0.87 and 0.06 < rel_v < 1.0, (rel_k, rel_v)


def test_cli_ingest_and_ask(tmp_path, capsys) -> None:
    persist = tmp_path / "idx"
    assert cli.main(["ingest", str(DOCS), "--persist", str(persist), "--chunk-tokens", "128"]) == 0
    answers = {}
    for method in ("stale", "full"):
        q = "What is the best-known apple variety of the Kessler Orchard Cooperative?"
        assert cli.main(["ask", q, "--persist", str(persist), "--method", method, "--top-k", "3",
                         "--max-new-tokens", "24", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert {"answer", "method", "ttft_s", "hit_rate", "chunks", "timings"} <= set(out)
        # full prefill never reads the chunk caches, so it reports no hits
        assert out["hit_rate"] == (1.0 if method == "stale" else 0.0), (method, out["hit_rate"])
        assert any(c.startswith("orchard.md") for c in out["chunks"])
        answers[method] = out["answer"]
    # full answers from the exact prompt; stale is lossy, and on this question whether its answer names the variety
    # flips with bf16 rounding (one torch thread: "Golden Delicious", two: "Amsel Gold", on an AMX CPU): its
    # quality is the benchmark's to measure, here it must answer from the reused caches (hit rate 1.0 above)
    assert "Amsel Gold" in answers["full"], answers
    assert len(answers["stale"].split()) >= 3, answers
    assert cli.main(["store", "verify", "--persist", str(persist)]) == 0


def test_chunk_after_indentation_is_spliced_inexactly_or_prefilled_when_strict(default_model) -> None:
    from kvrag.config import EngineConfig

    chunk = "source: fares.md\n\nA day pass costs 9 marks."
    prompt = "Documents:\n\n  " + chunk + "\n\nQuestion: how much is a day pass?"  # "  source" merges the space
    loose = KVRAGEngine(default_model, MemoryStore()).plan(prompt, [chunk])
    assert loose.found == 1 and loose.inexact_chunks == 1
    strict = KVRAGEngine(default_model, MemoryStore(), EngineConfig(strict_tokenization=True)).plan(prompt, [chunk])
    assert strict.found == 0 and strict.inexact_chunks == 0
    ids = [t for s in (*strict.context, strict.suffix) for t in s.token_ids]
    assert ids == default_model.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_shipped_cacherepair_moves_stale_kv_towards_full(engine, chunks) -> None:
    """The repairer shipped for the default model is found by fingerprint and brings the spliced KV closer to the
    jointly prefilled KV than stale reuse, for keys and for values."""
    prefix, ps, suffix = RagTemplate().parts(engine.tokenizer, chunks[:6], "How tall is the lighthouse?")
    plan = engine.plan_parts(prefix, ps, suffix)
    start, tc = len(plan.context[0].token_ids), plan.context_len  # after the exact preamble
    kf, vf = hf_cache.cache_to_tensors(engine.prepare(plan, "full").cache)
    ks, vs = hf_cache.cache_to_tensors(engine.prepare(plan, "stale").cache)
    prep = engine.prepare(plan, "cacherepair")
    assert prep.stats.method_stats.repaired_tokens == tc - start
    kr, vr = hf_cache.cache_to_tensors(prep.cache)

    def err(a: torch.Tensor, ref: torch.Tensor) -> float:
        return ((a[:, :, start:tc] - ref[:, :, start:tc]).norm() / ref[:, :, start:tc].norm()).item()

    assert err(kr, kf) < err(ks, kf) and err(vr, vf) < err(vs, vf), (err(kr, kf), err(ks, kf), err(vr, vf), err(vs, vf))


def test_a_chunks_cache_is_the_same_however_its_passages_were_cached(default_model_int4) -> None:
    """Passages cached in one call (batched forwards) or one call each (one forward each, prefix and passage
    together) get the same K/V up to rounding, short ones too, whose forward alone took the int4 decode products
    (an error ~100x the bound): an answer does not depend on how its passages were registered."""
    default_model = default_model_int4
    texts = [render_passage(t) for t in ("Children under six travel free.", "The cable car runs from April.",
                                         "The day pass costs 9 marks and gives unlimited travel in all three zones.")]
    together, apart = KVRAGEngine(default_model, MemoryStore()), KVRAGEngine(default_model, MemoryStore())
    keys = together.ingest(texts)
    assert [k for t in texts for k in apart.ingest([t])] == keys
    for key in keys:  # float32: summation order only (measured <= 3.4e-5); bfloat16: exact here, rounding elsewhere
        a, b = together.store.get(key), apart.store.get(key)
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert_close_in_dtype(x, y, default_model.dtype, fp32_atol=1e-4)


def test_the_chat_header_registered_as_a_chunk_changes_no_answer(engine) -> None:
    """A client registered the chat template's header ("<|im_start|>system\\n"), which starts every chat prompt: it
    was spliced at position 0 -- a cache computed after the chunk prefix, with no attention sink there -- and every
    later answer came out empty or garbled ("" for "What is the capital of France?"). Text that starts the prompt is
    its prefix now."""
    prompt = engine.chat_prompt("What is the capital of France?")
    header = prompt[: prompt.index("\n") + 1]
    assert prompt.startswith(header) and header.strip()
    gen = GenerationConfig(max_new_tokens=8)
    plain = engine.answer(prompt, [], "stale", gen)
    registered = engine.answer(prompt, [header], "stale", gen)
    assert registered.token_ids == plain.token_ids and registered.stats.chunks_found == 0
