"""Long prepares in pieces (:mod:`kvrag.kv.pieces`): a method's pieces compute exactly what its whole call
computes (every family, float32 and bfloat16), the runner steps the running requests between the pieces of a
``full`` / ``relaxkv`` prepare, a prepare with nobody decoding is one piece, and a cancel between two pieces -- or
inside a long forward with nobody decoding -- stops the prepare and frees its lease."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.assemble import assemble
from kvrag.engine.cancel import CancelToken, cancel_scope
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import RequestCancelledError
from kvrag.fusion import FusionInput, get_method
from kvrag.kv import hf_cache, pieces
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.prompting import RagTemplate, render_passage
from kvrag.repair.config import RepairConfig
from kvrag.repair.model import RepairModel
from kvrag.store import MemoryStore
from kvrag.threads import set_own_threads
from kvrag_bench.ablations import register_ablations
from kvrag_testing.tiny import ALL_FAMILIES, FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = (torch.float32, torch.bfloat16)
LAYOUT = (("prefix", 6), ("chunk", 40), ("text", 4), ("chunk", 37))
SPECS = ("full", "relaxkv:r=0.3", "relaxkv-fullctx:r=0.3", "relaxkv:r=1.0")


@functools.lru_cache(maxsize=4)
def _case(family: str, dtype: torch.dtype) -> tuple[Any, Rope, Any, list, torch.Tensor]:
    lm = tiny_model(family, num_layers=4, init_std=0.1, dtype=dtype)
    model, spec = lm.model, lm.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(7)
    chunks = []
    for i, (kind, n) in enumerate(LAYOUT):
        ids = torch.randint(5, int(model.config.vocab_size), (n,), generator=g).tolist()
        chunks.append((kind, compute_chunk_kv(model, rope, spec, ids), f"{kind}{i}" if kind == "chunk" else None))
    suffix = torch.randint(5, int(model.config.vocab_size), (9,), generator=g)
    return model, rope, spec, chunks, suffix


def _input(family: str, dtype: torch.dtype, zero_copy: bool) -> FusionInput:
    model, rope, spec, chunks, suffix = _case(family, dtype)
    inp = assemble(model, rope, spec, chunks, suffix)
    return inp if zero_copy else dataclasses.replace(inp, buffer=None)


def _in_pieces(gen: Generator[None, None, Any], between: Callable[[], None]) -> tuple[Any, int]:
    """Drive a piece generator, calling ``between()`` (another request's forward) at every boundary."""
    n = 0
    try:
        while True:
            next(gen)
            n += 1
            between()
    except StopIteration as stop:
        return stop.value, n


def _same(a: Any, b: Any) -> None:
    for x, y in zip(hf_cache.cache_to_tensors(a.cache), hf_cache.cache_to_tensors(b.cache), strict=True):
        assert x.shape == y.shape and torch.equal(x, y)
    assert (a.last_logits is None) == (b.last_logits is None)
    if a.last_logits is not None:
        assert torch.equal(a.last_logits, b.last_logits)
    assert a.stats.recomputed_per_layer == b.stats.recomputed_per_layer


# every family's layer code in float32; bfloat16 changes the kernels, not the layer code: the four core families
CASES = [(f, torch.float32) for f in ALL_FAMILIES] + [(f, torch.bfloat16) for f in FAMILIES]


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{str(d)}" for f, d in CASES])
def test_a_method_in_pieces_computes_exactly_its_whole_call(family: str, dtype: torch.dtype) -> None:
    """Bit for bit (cache and next-token logits), with another forward of the same model between every two pieces,
    on the engine's zero-copy input (suffix folded) and on a plain one."""
    register_ablations()
    model = _case(family, dtype)[0]
    other = torch.arange(5, 17)

    def step() -> None:  # a decode step's stand-in: another request's forward of the same model
        hf_cache.forward(model, other, None, start=0)

    for spec in SPECS:
        m = get_method(spec)
        for zero_copy in (True, False):
            whole = m.fuse(_input(family, dtype, zero_copy))
            split, n = _in_pieces(m.fuse_pieces(_input(family, dtype, zero_copy), pieces.Pace(lambda: 0.0)), step)
            assert n >= 3, (spec, n)  # a boundary at every linear layer (full) / between every two layers
            _same(split, whole)
    assert not [t for t in threading.enumerate() if t.name == "kvrag-prepare-piece"]


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_pieces_end_at_quantized_products_too(quantize: str) -> None:
    """Small inputs take the quantized (and packed) products instead of ``F.linear``: pieces end there too, and the
    result is still the whole call's."""
    lm = tiny_model("llama", num_layers=4, init_std=0.1, dtype=torch.bfloat16, quantize=quantize)
    rope, s = Rope.from_model(lm.model), lm.kv_spec()
    chunks = [(kind, compute_chunk_kv(lm.model, rope, s, list(range(5 + i, 5 + i + n))), f"c{i}")
              for i, (kind, n) in enumerate(LAYOUT)]
    suffix = torch.arange(30, 39)
    for spec in ("full", "relaxkv:r=0.1"):
        m = get_method(spec)
        whole = m.fuse(assemble(lm.model, rope, s, chunks, suffix))
        split, n = _in_pieces(m.fuse_pieces(assemble(lm.model, rope, s, chunks, suffix), pieces.Pace(lambda: 0.0)),
                              lambda: None)
        assert n >= 3 * 4, (spec, n)  # several per layer
        _same(split, whole)


def test_hybrid_in_pieces_computes_exactly_its_whole_call(tmp_path: Path) -> None:
    lm = tiny_model("llama", num_layers=4, init_std=0.1)
    s = lm.kv_spec()
    cfg = RepairConfig.from_preset("tiny", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                   embed_dim=int(lm.model.config.hidden_size))
    torch.manual_seed(0)
    path = RepairModel(cfg).eval().save_pretrained(tmp_path / "rep", target_fingerprint=s.model_fingerprint)
    rope = Rope.from_model(lm.model)
    chunks = [(kind, compute_chunk_kv(lm.model, rope, s, list(range(5 + i, 5 + i + n))), f"c{i}")
              for i, (kind, n) in enumerate(LAYOUT)]
    suffix = torch.arange(30, 39)
    for spec in (f"hybrid:r=0.3,checkpoint={path}", f"hybrid:r=0.3,context=anchors,checkpoint={path}"):
        m = get_method(spec)
        whole = m.fuse(assemble(lm.model, rope, s, chunks, suffix))
        split, n = _in_pieces(m.fuse_pieces(assemble(lm.model, rope, s, chunks, suffix), pieces.Pace(lambda: 0.0)),
                              lambda: None)
        assert n >= 3
        _same(split, whole)


@pytest.mark.parametrize(("step_s", "helper"), [(None, 2), (0.0, 1)])
def test_a_forward_in_pieces_runs_on_the_runners_threads_while_nobody_decodes(step_s: float | None,
                                                                            helper: int) -> None:
    """The runner runs on its own thread count (``EngineConfig.runner_threads``, e.g. ``kvrag serve``: the cores,
    every other thread one). The helper thread a forward runs on in pieces takes the runner's count while nobody
    decodes (torch's default for new threads ran every long prefill of ``kvrag serve`` on one core), and one thread
    while requests decode between its pieces (a second OpenMP team beside the runner's would outnumber the cores)."""
    seen: dict[str, int] = {}

    def runner() -> None:
        set_own_threads(2)
        seen["runner"] = torch.get_num_threads()

        def fn() -> torch.Tensor:
            x = torch.nn.functional.linear(torch.ones(3, 4), torch.ones(5, 4))  # a checkpoint: the count is fitted
            seen["helper"] = torch.get_num_threads()
            return x

        pace = pieces.Pace(lambda: step_s, cancelled=lambda: False)
        out, _ = _in_pieces(pieces.call_pieces(fn, pace), lambda: None)
        assert torch.equal(out, torch.full((3, 5), 4.0))

    assert torch.get_num_threads() == 1  # the module's fixture: torch's default for new threads
    t = threading.Thread(target=runner)
    t.start()
    t.join(20)
    assert seen == {"runner": 2, "helper": helper}


def test_pace() -> None:
    assert not pieces.WHOLE.active() and not pieces.WHOLE.due()
    budget: list[float | None] = [None]
    pace = pieces.Pace(lambda: budget[0])
    assert not pace.active() and not pace.due()  # nobody waits: never a boundary
    budget[0] = 3600.0
    assert pace.active() and not pace.due()
    budget[0] = 0.0
    assert pace.due()
    assert list(pace.boundary()) == [None] and pace.pieces == 1 and pace.paused_s >= 0.0

    def gen() -> Generator[None, None, int]:
        yield from pieces.WHOLE.boundary()
        return 5

    assert pieces.run_whole(gen()) == 5


def test_a_forward_that_fails_between_pieces_raises_in_the_caller() -> None:
    model = _case("llama", torch.float32)[0]
    bad = torch.tensor([10**6])  # no such token: the embedding fails in the helper thread
    with pytest.raises(IndexError):
        pieces.run_whole(pieces.forward_pieces(model, bad, None, start=0, pace=pieces.Pace(lambda: 0.0)))
    gen = pieces.forward_pieces(model, torch.arange(5, 40), None, start=0, pace=pieces.Pace(lambda: 0.0))
    next(gen)
    gen.close()  # closed between two pieces: the parked forward unwinds, its thread ends
    assert not [t for t in threading.enumerate() if t.name == "kvrag-prepare-piece"]


# ---- the runner ------------------------------------------------------------------------------------------------------
DOCS = [render_passage(f"Passage {i}: the harbour ferry number {i} leaves at {i + 6} o'clock from pier {i}.", f"P{i}")
        for i in range(3)]
GEN = GenerationConfig(max_new_tokens=6)


def _engine() -> KVRAGEngine:
    eng = KVRAGEngine(tiny_model("qwen2", num_layers=4, init_std=0.1), MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    return eng


def _plan(eng: KVRAGEngine, q: str = "When does it leave?") -> Any:
    return eng.plan(RagTemplate().render(eng.tokenizer, DOCS, q), DOCS)


def _events(eng: KVRAGEngine) -> list[tuple[str, int]]:
    """Record ``("piece", rid)`` for every prepare piece and ``("step", rows)`` for every decode step."""
    events: list[tuple[str, int]] = []
    run_prepare, step = eng.runner._run_prepare, eng.runner._step

    def piece(h: Any, **kw: Any) -> None:
        run_prepare(h, **kw)
        events.append(("piece", h.rid))

    def stepped(rows: list[Any]) -> None:
        step(rows)
        events.append(("step", len(rows)))

    eng.runner._run_prepare = piece  # type: ignore[method-assign]
    eng.runner._step = stepped  # type: ignore[method-assign]
    return events


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not cond():
        time.sleep(0.005)
    return cond()


@pytest.mark.parametrize("method", ["full", "relaxkv:r=0.3"])
def test_running_requests_step_between_the_pieces_of_a_long_prepare(method: str, monkeypatch: Any) -> None:
    eng = _engine()
    alone = eng.prepare(_plan(eng), method, reserve=GEN.max_new_tokens)  # nobody decodes: one piece
    assert eng.runner.stats()["prepare_pieces"] == eng.runner.stats()["prepares"]
    ref_k, ref_v = (t.clone() for t in hf_cache.cache_to_tensors(alone.cache))
    ref_tokens = eng.answer_plan(_plan(eng), method, GEN).token_ids
    monkeypatch.setattr(pieces, "PIECE_OF_STEP", 0.0)  # every possible boundary is one
    events = _events(eng)
    running = eng.stream(eng.prepare(_plan(eng, "Where?"), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)
    prep = eng.prepare(_plan(eng), method, reserve=GEN.max_new_tokens)
    mine = [i for i, (kind, rid) in enumerate(events) if kind == "piece" and rid == prep.kv_lease.rid]
    assert len(mine) >= 4
    for a, b in zip(mine, mine[1:], strict=False):  # one decode step of the running request between two pieces
        assert events[a + 1 : b] == [("step", 1)]
    k, v = hf_cache.cache_to_tensors(prep.cache)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v) and torch.equal(prep.last_logits, alone.last_logits)
    assert "".join(eng.stream(prep, GEN)) is not None and prep.token_ids == ref_tokens
    running.close()
    del alone  # its lease back
    assert _wait_for(lambda: not eng.runner.stats()["states"])


@pytest.mark.parametrize("batch_size", [1, 4])
def test_running_requests_step_between_the_pieces_of_a_chunk_registration(batch_size: int, monkeypatch: Any) -> None:
    """Chunk caches computed outside a request (a ``kvrag serve`` registration, a retriever's misses) while a
    stream decodes: in the runner's turn, in pieces with a decode step between two, the same K/V as on an idle
    engine, and no lease left behind."""
    eng = _engine()
    texts = [render_passage(f"Registered passage {i}: " + "the night ferry leaves pier four at noon. " * 6, f"R{i}")
             for i in range(3)]
    ref = eng.ensure(texts, store=MemoryStore(), fetch=True, batch_size=batch_size)  # nobody decodes: one piece
    monkeypatch.setattr(pieces, "PIECE_OF_STEP", 0.0)  # every possible boundary is one
    running = eng.stream(eng.prepare(_plan(eng, "Where?"), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)
    events = _events(eng)
    got = eng.ensure(texts, fetch=True, batch_size=batch_size)
    pieces_at = [i for i, (kind, _) in enumerate(events) if kind == "piece"]
    assert len(pieces_at) >= 4
    for a, b in zip(pieces_at, pieces_at[1:], strict=False):  # the running stream steps between two pieces
        assert ("step", 1) in events[a + 1 : b]
    for (r, _), (g, was) in zip(ref, got, strict=True):
        assert r is not None and g is not None and r.kv is not None and g.kv is not None and not was
        assert torch.equal(r.kv.keys, g.kv.keys) and torch.equal(r.kv.values, g.kv.values)
    running.close()
    assert _wait_for(lambda: not eng.runner.stats()["states"] and eng.runner.stats()["kv"]["used"] == 0)


def test_a_registration_whose_client_leaves_stops_between_two_pieces(monkeypatch: Any) -> None:
    eng = _engine()
    monkeypatch.setattr(pieces, "PIECE_OF_STEP", 0.0)
    running = eng.stream(eng.prepare(_plan(eng, "Where?"), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)
    events = _events(eng)
    text = render_passage("A long registered passage: " + "the night ferry leaves pier four at noon. " * 12, "R")
    token, out = CancelToken(), {}

    def register() -> None:
        try:
            with cancel_scope(token):
                out["value"] = eng.ensure([text], batch_size=1)
        except RequestCancelledError as e:
            out["error"] = e

    t = threading.Thread(target=register, daemon=True)
    t.start()
    assert _wait_for(lambda: sum(kind == "piece" for kind, _ in events) >= 2)
    token.cancel()
    at_cancel = len(events)
    t.join(20)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert sum(kind == "piece" for kind, _ in events[at_cancel:]) <= 2  # stopped at the next piece boundary
    key = eng.identify([text])[0]
    assert key is not None and not eng.serving_store.contains_many([str(key.key)])[0]  # nothing half-done stored
    running.close()
    assert _wait_for(lambda: not eng.runner.stats()["states"] and eng.runner.stats()["kv"]["used"] == 0)
    assert not [t for t in threading.enumerate() if t.name == "kvrag-prepare-piece"]


def test_a_cancel_between_two_pieces_stops_the_prepare_and_frees_its_lease(monkeypatch: Any) -> None:
    eng = _engine()
    monkeypatch.setattr(pieces, "PIECE_OF_STEP", 0.0)
    events = _events(eng)
    running = eng.stream(eng.prepare(_plan(eng, "Where?"), "stale", reserve=2000), GenerationConfig(max_new_tokens=2000))
    next(running)
    token, out = CancelToken(), {}
    before = len(events)

    def cold() -> None:
        try:
            with cancel_scope(token):
                out["value"] = eng.prepare(_plan(eng), "full", reserve=GEN.max_new_tokens)
        except RequestCancelledError as e:
            out["error"] = e

    t = threading.Thread(target=cold, daemon=True)
    t.start()
    assert _wait_for(lambda: sum(kind == "piece" for kind, _ in events[before:]) >= 2)
    token.cancel()
    at_cancel = len(events)
    t.join(20)
    assert isinstance(out.get("error"), RequestCancelledError)
    assert sum(kind == "piece" for kind, _ in events[at_cancel:]) <= 2  # stopped at the next piece boundary
    running.close()
    assert _wait_for(lambda: not eng.runner.stats()["states"] and eng.runner.stats()["kv"]["used"] == 0)
    assert not [t for t in threading.enumerate() if t.name == "kvrag-prepare-piece"]


@pytest.mark.parametrize(("method", "at"), [("full", 1), ("relaxkv:r=0.3", 2)])
def test_a_cancel_while_nobody_decodes_stops_a_long_prepare_at_the_next_checkpoint(method: str, at: int) -> None:
    """A client that leaves during a long prefill on an otherwise idle engine: the prefill stops at the next
    checkpoint instead of running to its end while the requests behind it wait. ``at``: the first layer's call
    during which the client leaves (relaxkv's first forward is its question-sized scoring pass, which runs whole)."""
    eng = _engine()
    plan = _plan(eng)
    assert plan.context_len > pieces.SHORT_FORWARD  # a forward long enough to run at the checkpoints
    layers = eng.model.model.layers
    token, out, calls = CancelToken(), {}, {"first": 0, "last after": 0}

    def leave(*_: Any) -> None:
        calls["first"] += 1
        if calls["first"] == at:
            token.cancel()

    def count(*_: Any) -> None:
        calls["last after"] += token.cancelled

    hooks = [layers[0].register_forward_pre_hook(leave), layers[-1].register_forward_pre_hook(count)]
    try:
        def cold() -> None:
            try:
                with cancel_scope(token):
                    out["value"] = eng.prepare(plan, method, reserve=GEN.max_new_tokens)
            except RequestCancelledError as e:
                out["error"] = e

        t = threading.Thread(target=cold, daemon=True)
        t.start()
        t.join(20)
    finally:
        for h in hooks:
            h.remove()
    assert isinstance(out.get("error"), RequestCancelledError) and "value" not in out
    assert calls["last after"] == 0  # the forward stopped inside the first layer
    assert _wait_for(lambda: not eng.runner.stats()["states"] and eng.runner.stats()["kv"]["used"] == 0)
    assert not [t for t in threading.enumerate() if t.name == "kvrag-prepare-piece"]
    # the engine serves the next request, and a prepare nobody cancels still computes what it did
    ref = eng.answer_plan(_plan(eng), method, GEN).token_ids
    assert eng.answer_plan(_plan(eng), method, GEN).token_ids == ref
