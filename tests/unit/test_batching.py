"""Continuous batching: batched steps equal batch-1 steps; answers under any interleaving equal sequential ones; the
batch size and KV memory bounds make requests wait; requests whose consumer stops leave and free their slot."""

from __future__ import annotations

import gc
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import EngineBusyError
from kvrag.kv import batched, hf_cache
from kvrag.prompting import RagTemplate
from kvrag.repair.config import RepairConfig
from kvrag.repair.model import RepairModel
from kvrag.store import MemoryStore
from kvrag_testing.batching import PASSAGES, compare_batched_to_alone
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = PASSAGES
REQUESTS = [
    ([0, 1, 2], "What is the capital of France?"),
    ([2], "Who jumps over the dog?"),
    ([3, 0], "What rotates the keys?"),
    ([1, 3], "What is the capital of Germany?"),
    ([0, 2, 3, 1], "Answer in one sentence."),
]
GEN = GenerationConfig(max_new_tokens=10)


def _engine(family: str = "qwen2", dtype: torch.dtype = torch.float32, **config: Any) -> KVRAGEngine:
    eng = KVRAGEngine(tiny_model(family, init_std=0.1, dtype=dtype), MemoryStore(), EngineConfig(**config))
    eng.ingest(DOCS)
    return eng


def _plan(eng: KVRAGEngine, i: int) -> Any:
    idx, q = REQUESTS[i % len(REQUESTS)]
    passages = [DOCS[j] for j in idx]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, q), passages)


@pytest.fixture(scope="module")
def repairer(tmp_path_factory: pytest.TempPathFactory) -> Callable[[KVRAGEngine], str]:
    """``cacherepair`` with a random tiny repairer for an engine's model (as tests/unit/test_cacherepair.py builds)."""
    root = tmp_path_factory.mktemp("repairers")

    def spec(eng: KVRAGEngine) -> str:
        s = eng.loaded.kv_spec()
        cfg = RepairConfig.from_preset("tiny", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
                                       head_dim=s.head_dim, embed_dim=64)
        torch.manual_seed(0)
        m = RepairModel(cfg)
        torch.nn.init.normal_(m.head.weight, std=0.05)
        m.set_stats(torch.rand(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim) + 0.5,
                    torch.rand(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim) + 0.1)
        path = m.eval().save_pretrained(Path(root) / eng.loaded.fingerprint[:12], target_fingerprint=eng.loaded.fingerprint)
        return f"cacherepair:checkpoint={path}"

    return spec


# ---- the step: batched logits == batch-1 logits --------------------------------------------------------------------
def _step_diffs(eng: KVRAGEngine, steps: int) -> tuple[float, list[list[int]]]:
    """Requests of different lengths and methods decoded together vs each alone
    (:func:`kvrag_testing.batching.compare_batched_to_alone`): the largest logit difference and the tokens."""
    preps = [eng.prepare(_plan(eng, i), m) for i, m in enumerate(["stale", "full", "relaxkv:r=0.3", "stale", "full"])]
    got = compare_batched_to_alone(eng.model, preps, steps)
    return got.worst, got.tokens


@pytest.mark.parametrize(("family", "window"), [("llama", None), ("qwen2", None), ("qwen3", None), ("mistral", None),
                                                ("mistral", 240), ("qwen2", 240)])
def test_batched_step_logits_equal_batch1_fp32(family: str, window: int | None) -> None:
    """Rows of different lengths and fusion methods; with a window of 240 the longest rows decode past it."""
    eng = KVRAGEngine(tiny_model(family, init_std=0.1, sliding_window=window), MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    worst, seen = _step_diffs(eng, 24)
    assert worst < 1e-4
    assert len({tuple(s) for s in seen}) > 1


@pytest.mark.parametrize(("family", "dtype"), [("llama", torch.bfloat16), ("qwen3", torch.float32),
                                               ("mistral", torch.bfloat16)])
def test_batch_of_one_is_bit_identical_to_the_models_own_step(family: str, dtype: torch.dtype) -> None:
    """One row: the same attention call and the same GEMM shapes as the model's forward over the request's cache."""
    eng = _engine(family, dtype=dtype)
    prep = eng.prepare(_plan(eng, 0), "stale")
    buf, n = hf_cache.buffer_of(prep.cache)
    buf.reserve(n + 8)
    copy = hf_cache.KVBuffer.wrap(buf.keys.clone(), buf.values.clone()).as_cache(n)
    row, tok = batched.Row(buf, n), int(prep.last_logits.argmax())
    for _ in range(8):
        got = batched.decode_step(eng.model, [row], [tok], batched.windows(eng.model))[0]
        ref, _ = hf_cache.forward(eng.model, torch.tensor([tok]), copy)
        assert torch.equal(got, ref[-1])
        row.length += 1
        tok = int(got.argmax())


def test_batched_step_bf16_within_the_bf16_noise_floor() -> None:
    """bf16: a batched step moves the logits no more than bf16 itself does (the noise floor: batch-1 bf16 vs
    batch-1 fp32 logits of the same prompts), and greedy answers batched equal those decoded alone."""
    engines = {dtype: _engine("llama", dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    batched_vs_alone, _ = _step_diffs(engines[torch.bfloat16], 12)
    floor = 0.0
    for i in range(len(REQUESTS)):
        a, b = (e.prepare(_plan(e, i), "full").last_logits for e in engines.values())
        floor = max(floor, float((a - b).abs().max()))
    assert floor > 0
    assert batched_vs_alone <= floor
    eng = engines[torch.bfloat16]  # the same greedy answers batched as alone
    seq = [_answer(eng, i, "stale", GEN) for i in range(len(REQUESTS))]
    assert _concurrently(lambda i: _answer(eng, i, "stale", GEN), len(REQUESTS)) == seq


# ---- answers under interleavings ------------------------------------------------------------------------------------
def _answer(eng: KVRAGEngine, i: int, method: str, gen: GenerationConfig, rng: random.Random | None = None) -> list[int]:
    if rng is not None:
        time.sleep(rng.random() * 0.05)
    prep = eng.prepare(_plan(eng, i), method, reserve=gen.max_new_tokens)
    for _ in eng.stream(prep, gen):
        if rng is not None and rng.random() < 0.3:
            time.sleep(rng.random() * 0.01)  # a slow consumer
    return list(prep.token_ids)


def _concurrently(fn: Callable[[int], Any], n: int) -> list[Any]:
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("max_batch_size", [2, 8])
def test_mixed_methods_under_random_interleavings_equal_sequential(max_batch_size: int, repairer: Any) -> None:
    eng = _engine(max_batch_size=max_batch_size)
    methods = ["stale", "full", "relaxkv:r=0.3", repairer(eng)]
    jobs = [(i % len(REQUESTS), methods[i % len(methods)]) for i in range(12)]
    sequential = {(i, m): _answer(eng, i, m, GEN) for i, m in set(jobs)}
    assert len({tuple(v) for v in sequential.values()}) > 2
    for seed in range(2):
        got = _concurrently(lambda k, seed=seed: _answer(eng, *jobs[k], GEN, random.Random(seed * 100 + k)), len(jobs))
        assert got == [sequential[j] for j in jobs]
    stats = eng.batcher.stats()
    assert 1 < stats["max_rows"] <= max_batch_size  # steps were shared, never by more than max_batch_size
    assert stats["decoding"] == 0 and stats["kv"]["used"] == 0 and stats["kv"]["leases"] == 0


def test_sampling_stops_and_eos_per_request_in_a_batch() -> None:
    eng = _engine()
    gens = [GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=30, top_p=0.9, seed=s)
            for s in range(3)]
    texts = [eng.answer_plan(_plan(eng, i), "stale", GenerationConfig(max_new_tokens=12)).text for i in range(3)]
    gens += [GenerationConfig(max_new_tokens=12, stop=(t[3:5],)) for t in texts if len(t) > 5]
    gens.append(GenerationConfig(max_new_tokens=200))  # runs to EOS or the budget
    seq = [(r.token_ids, r.text) for r in (eng.answer_plan(_plan(eng, k), "stale", g) for k, g in enumerate(gens))]

    def one(k: int) -> tuple[list[int], str]:
        r = eng.answer_plan(_plan(eng, k), "stale", gens[k])
        return r.token_ids, r.text

    assert _concurrently(one, len(gens)) == seq


def test_unbatchable_model_is_stepped_one_request_at_a_time() -> None:
    lm = tiny_model("llama", init_std=0.1)
    lm.model.config._attn_implementation = "sdpa"  # not kvrag_sdpa: no batched step for it
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    assert eng.batcher.unbatchable
    seq = [_answer(eng, i, "stale", GEN) for i in range(4)]
    assert _concurrently(lambda i: _answer(eng, i, "stale", GEN), 4) == seq


# ---- bounds: batch size and KV memory ------------------------------------------------------------------------------
def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_request_that_does_not_fit_the_kv_bound_waits() -> None:
    long_gen = GenerationConfig(max_new_tokens=300)
    probe = _engine()
    sizes = [_plan(probe, i).total_len for i in range(2)]
    per_token = probe.batcher.budget.bytes_per_token
    need = [sizes[0] + long_gen.max_new_tokens, sizes[1] + GEN.max_new_tokens]
    eng = _engine(kv_memory_bytes=per_token * (sum(need) - 1))  # either fits, not both
    seq = [_answer(eng, i, "stale", GEN) for i in range(2)]
    assert len(_answer(eng, 0, "stale", long_gen)) > 50  # the first request decodes for a while (no early EOS)
    first = eng.stream(eng.prepare(_plan(eng, 0), "stale", reserve=long_gen.max_new_tokens), long_gen)
    next(first)
    lock = hf_cache.model_lock(eng.model)
    out: dict[str, list[int]] = {}
    with lock:  # no decode step can run: the first request keeps decoding, holding its KV
        assert sum(eng.batcher.stats()[k] for k in ("decoding", "joining")) == 1
        t = threading.Thread(target=lambda: out.setdefault("b", _answer(eng, 1, "stale", GEN)))
        t.start()
        assert _wait_for(lambda: eng.batcher.stats()["kv"]["waiting"] == 1)
        time.sleep(0.2)
        assert t.is_alive() and "b" not in out  # still waiting: its KV does not fit
    t.join(60)  # the first request ends (its consumer is paused) and gives its KV back
    assert out["b"] == seq[1]
    first.close()
    # bigger than the whole bound: admitted alone, never stuck
    tiny = _engine(kv_memory_bytes=1)
    held = [tiny.prepare(_plan(tiny, i), "stale", reserve=GEN.max_new_tokens) for i in range(1)]
    for p in held:
        "".join(tiny.stream(p, GEN))
    assert [p.token_ids for p in held] == seq[:1]
    assert _concurrently(lambda i: _answer(tiny, i % 2, "stale", GEN), 4) == [seq[0], seq[1]] * 2
    # a thread holding an unstreamed request does not prepare past the bound: its second request waits in line
    # and is refused after the wait limit, naming the bound
    busy = _engine(kv_memory_bytes=1, admission_timeout_s=0.3)
    kept = busy.prepare(_plan(busy, 0), "stale", reserve=GEN.max_new_tokens)
    with pytest.raises(EngineBusyError, match=r"kv_memory_bytes=1\b.*held by 1 requests"):
        busy.prepare(_plan(busy, 1), "stale")
    assert "".join(busy.stream(kept, GEN)) and kept.token_ids == seq[0]


def test_consumers_that_stop_free_their_slot_and_memory() -> None:
    eng = _engine(max_batch_size=1)
    seq = _answer(eng, 2, "stale", GEN)
    kv = lambda: eng.batcher.stats()["kv"]  # noqa: E731

    closed = eng.stream(eng.prepare(_plan(eng, 0), "stale", reserve=200), GenerationConfig(max_new_tokens=200))
    next(closed)
    closed.close()
    assert _wait_for(lambda: kv()["used"] == 0 and eng.batcher.stats()["decoding"] == 0)

    abandoned = eng.stream(eng.prepare(_plan(eng, 1), "stale", reserve=200), GenerationConfig(max_new_tokens=200))
    next(abandoned)
    del abandoned  # never closed: garbage collection ends it
    gc.collect()
    assert _wait_for(lambda: kv()["used"] == 0 and eng.batcher.stats()["decoding"] == 0)

    unstreamed = eng.prepare(_plan(eng, 3), "stale")
    assert kv()["leases"] == 1
    del unstreamed
    gc.collect()
    assert kv()["used"] == 0 and kv()["leases"] == 0
    assert _answer(eng, 2, "stale", GEN) == seq  # the single slot is free again
