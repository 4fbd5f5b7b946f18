"""Several arrivals' question suffixes in one forward (kvrag.kv.batched.prefill_rows and the runner's parked
prepares): each row computes what the model's own suffix prefill computes over its cache, whatever it is packed
with, on the dense weights; a burst's prepares park and share one forward; answers equal the ones given alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import batched, hf_cache, step_backend
from kvrag.prompting import RagTemplate
from kvrag.store import MemoryStore
from kvrag_testing.batching import PASSAGES
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = PASSAGES
QUESTIONS = [([0, 1, 2], "What is the capital of France?"), ([2], "Who jumps over the dog?"),
             ([3, 0], "What rotates the keys?"), ([1, 3], "What is the capital of Germany, in one word?")]
CONTEXTS = (70, 95, 120)  # past the 40-token windows below
SUFFIXES = ([5, 6, 7], [9], list(range(20, 32)))


def _rows(model: Any, dtype: torch.dtype, extra: int = 16) -> list[batched.Row]:
    """One row per context length, each its own buffer holding the model's prefill of distinct ids."""
    rows = []
    for i, n in enumerate(CONTEXTS):
        keys, values = hf_cache.prefill_kv(model, torch.tensor([(7 * j + 3 * i) % 200 + 10 for j in range(n)]))
        buf = hf_cache.KVBuffer(keys.shape[0], keys.shape[1], keys.shape[3], n + extra, dtype, keys.device)
        buf.keys[:, :, :n].copy_(keys)
        buf.values[:, :, :n].copy_(values)
        rows.append(batched.Row(buf, n))
    return rows


@pytest.mark.parametrize(("family", "window"), [("llama", None), ("qwen2", 40), ("mistral", 40), ("qwen3", None)])
def test_each_row_is_the_models_own_suffix_prefill(family: str, window: int | None) -> None:
    """Packed with rows of other lengths, each row's next-token logits and written K/V are those of the model's own
    forward over its cache (float32: the same sums up to reordering), sliding windows included."""
    lm = tiny_model(family, init_std=0.1, sliding_window=window)
    model, win = lm.model, batched.windows(lm.model)
    rows = _rows(model, lm.dtype)
    packed = batched.prefill_rows(model, rows, SUFFIXES, win)
    for i, ids in enumerate(SUFFIXES):
        n = rows[i].length
        ref, cache = hf_cache.forward(model, torch.tensor(ids), _rows(model, lm.dtype)[i].buffer.as_cache(n), start=n)
        torch.testing.assert_close(packed[i], ref[-1], atol=1e-4, rtol=1e-4)
        keys, values = hf_cache.cache_to_tensors(cache)
        end = n + len(ids)
        torch.testing.assert_close(rows[i].buffer.keys[:, :, :end], keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rows[i].buffer.values[:, :, :end], values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "dtype", "quantize"), [
    ("llama", torch.float32, None), ("llama", torch.bfloat16, "int4"), ("qwen3", torch.bfloat16, None),
    ("qwen2", torch.float32, "int8"), ("gemma", torch.float32, None), ("gemma3", torch.bfloat16, None),
])
def test_a_packed_row_is_bit_identical_to_the_row_alone(family: str, dtype: torch.dtype, quantize: str | None) -> None:
    """What a request computes does not depend on what it was packed with: K/V and logits equal bit for bit (the
    direct loop runs each row's products alone, so short suffixes keep the quantized route; a model the loop does
    not write out, Gemma 1, runs one forward per row). The one exception is a decode step's: the output head runs
    over the rows' last positions together, and a dense float32 GEMM sums a 3-row product in another order than a
    1-row one (~1e-6). Suffixes of 3, 1 and 20 tokens: below and above the quantized route's row limit."""
    lm = tiny_model(family, init_std=0.1, dtype=dtype, quantize=quantize)
    model, win = lm.model, batched.windows(lm.model)
    suffixes = (*SUFFIXES[:2], list(range(40, 60)))
    alone_rows = _rows(model, dtype, extra=24)
    alone = torch.stack([batched.prefill_rows(model, [r], [t], win)[0] for r, t in zip(alone_rows, suffixes,
                                                                                       strict=True)])
    rows = _rows(model, dtype, extra=24)
    packed = batched.prefill_rows(model, rows, suffixes, win)
    assert step_backend.serves(model, "prefill", "direct") is (family != "gemma")  # chosen at the first packing
    if dtype == torch.float32 and quantize is None and family != "gemma":
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
        assert torch.equal(packed.argmax(-1), alone.argmax(-1))
    else:
        assert torch.equal(packed, alone)
    for r, a, t in zip(rows, alone_rows, suffixes, strict=True):
        end = r.length + len(t)
        assert torch.equal(r.buffer.keys[:, :, :end], a.buffer.keys[:, :, :end])
        assert torch.equal(r.buffer.values[:, :, :end], a.buffer.values[:, :, :end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_row_of_a_gguf_model_is_bit_identical_to_the_row_alone(dtype: torch.dtype, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A model resident in a GGUF file's blocks with int4 decode products: short suffixes take the int4 route,
    longer ones the dense route, whose layers de-quantize each weight once for all the rows packed
    (GGUFLinear.forward_segments); each row's K/V and logits are still those it gets alone, bit for bit."""
    pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")
    from kvrag.models import load_model
    from kvrag_testing.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", tiny_model("llama", init_std=0.1), quantization="Q4_0")
    model = load_model(str(path), dtype=dtype, quantize="int4").model
    win = batched.windows(model)
    suffixes = (*SUFFIXES[:2], list(range(40, 60)), list(range(60, 90)))
    alone_rows, rows = _rows(model, dtype, extra=32), _rows(model, dtype, extra=32)
    alone_rows.append(_rows(model, dtype, extra=32)[0])
    rows.append(_rows(model, dtype, extra=32)[0])
    alone = torch.stack([batched.prefill_rows(model, [r], [t], win)[0] for r, t in zip(alone_rows, suffixes,
                                                                                       strict=True)])
    packed = batched.prefill_rows(model, rows, suffixes, win)
    assert step_backend.serves(model, "prefill", "direct")
    assert torch.equal(packed, alone)
    for r, a, t in zip(rows, alone_rows, suffixes, strict=True):
        end = r.length + len(t)
        assert torch.equal(r.buffer.keys[:, :, :end], a.buffer.keys[:, :, :end])
        assert torch.equal(r.buffer.values[:, :, :end], a.buffer.values[:, :, :end])


def test_a_row_without_room_is_refused() -> None:
    lm = tiny_model("llama", init_std=0.1)
    rows = _rows(lm.model, lm.dtype, extra=2)
    with pytest.raises(ValueError, match="no room"):
        batched.prefill_rows(lm.model, rows[:1], [[1, 2, 3]], batched.windows(lm.model))


def _plan(eng: KVRAGEngine, i: int) -> Any:
    idx, q = QUESTIONS[i]
    passages = [DOCS[j] for j in idx]
    return eng.plan(RagTemplate().render(eng.tokenizer, passages, q), passages)


@pytest.mark.parametrize(("method", "pack"), [("stale", True), ("cacheblend:r=0.3", True), ("stale", False)])
def test_a_burst_parks_and_shares_one_suffix_forward_with_the_answers_given_alone(method: str, pack: bool) -> None:
    """Four requests waiting together: each prepare parks at its suffix and one forward prefills all four (with
    ``pack_suffixes=False``: one forward each); every answer equals the one its request gets alone."""
    gen = GenerationConfig(max_new_tokens=8)
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(pack_suffixes=pack))
    eng.ingest(DOCS)
    alone = [eng.answer_plan(_plan(eng, i), method, gen).token_ids for i in range(len(QUESTIONS))]
    before = eng.runner.stats()
    assert before["suffix_prefills"] == before["suffix_rows"] == len(QUESTIONS)  # alone: one row a forward
    out: dict[int, list[int]] = {}
    with eng.runner.lock:  # the runner waits for the model while all four arrive
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, eng.answer_plan(_plan(eng, i), method,
                                                                                          gen).token_ids))
                   for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        end = time.monotonic() + 20
        while eng.runner.stats()["states"].get("waiting", 0) < len(QUESTIONS) - 1 and time.monotonic() < end:
            time.sleep(0.005)
    for t in threads:
        t.join(60)
    after = eng.runner.stats()
    assert after["suffix_rows"] - before["suffix_rows"] == len(QUESTIONS)
    assert after["suffix_prefills"] - before["suffix_prefills"] == (1 if pack else len(QUESTIONS))
    assert [out[i] for i in range(len(QUESTIONS))] == alone


def test_a_parked_request_cancelled_frees_its_lease_and_the_others_finish() -> None:
    """A request cancelled while parked leaves at the next plan (lease back); the others' suffixes still run."""
    from kvrag.engine.cancel import CancelToken, cancel_scope
    from kvrag.errors import RequestCancelledError

    gen = GenerationConfig(max_new_tokens=4)
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(pack_suffixes=True))
    eng.ingest(DOCS)
    token = CancelToken()
    out: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}
    parked = threading.Event()
    real = eng.runner.scheduler.park

    def park(rid: int) -> None:
        real(rid)
        if not parked.is_set():  # the first request to park: cancelled right there, while parked
            parked.set()
            token.cancel()

    eng.runner.scheduler.park = park  # type: ignore[method-assign]

    def ask(i: int) -> None:
        try:
            with cancel_scope(token if i == 0 else None):
                out[i] = eng.answer_plan(_plan(eng, i), "stale", gen).token_ids
        except RequestCancelledError as e:
            errors[i] = e

    with eng.runner.lock:
        first = threading.Thread(target=ask, args=(0,))
        first.start()
        end = time.monotonic() + 20
        while not eng.runner.stats()["states"].get("preparing") and time.monotonic() < end:
            time.sleep(0.005)
        second = threading.Thread(target=ask, args=(1,))
        second.start()
        while not eng.runner.stats()["states"].get("waiting") and time.monotonic() < end:
            time.sleep(0.005)
    for t in (first, second):
        t.join(60)
    assert parked.is_set()
    assert isinstance(errors.get(0), RequestCancelledError) and 1 in out
    stats = eng.runner.stats()
    assert (stats["suffix_prefills"], stats["suffix_rows"]) == (1, 1)  # the cancelled one never ran its suffix
    end = time.monotonic() + 20
    while eng.runner.stats()["states"] and time.monotonic() < end:
        time.sleep(0.01)
    assert not eng.runner.stats()["states"] and eng.runner.stats()["kv"]["used"] == 0
