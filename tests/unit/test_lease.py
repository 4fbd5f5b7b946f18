"""The lease owns the request's buffer (kvrag.engine.lease): a request's KV is sized once, at admission, from prompt
+ ``reserve``; ``runner.submit`` only compares; the buffer a request decodes in is the lease's, never reallocated
and never grown (a fixed KVBuffer refuses instead of doubling)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.lease import KVBudget, Lease
from kvrag.engine.scheduler import Scheduler
from kvrag.errors import ConfigError, LeaseExceededError
from kvrag.fusion.base import FusionInput, FusionOutput
from kvrag.fusion.stale import Stale
from kvrag.fusion.stats import MethodStats
from kvrag.kv import batched, hf_cache
from kvrag.kv.kvbuffer import BufferLayer
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
]


def _engine(**config: Any) -> KVRAGEngine:
    eng = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(**config))
    eng.ingest(DOCS)
    return eng


def _plan(eng: KVRAGEngine) -> Any:
    return eng.plan(RagTemplate().render(eng.tokenizer, DOCS, "What is the capital of France?"), DOCS)


class _Rows:
    """Records every row :meth:`Lease.decode_row` hands out, with its buffer's storage at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[tuple[batched.Row, int, Lease]] = []
        real = Lease.decode_row

        def spy(lease: Lease, buf: hf_cache.KVBuffer, length: int) -> batched.Row:
            row = real(lease, buf, length)
            self.rows.append((row, row.buffer.keys.data_ptr(), lease))
            return row

        monkeypatch.setattr(Lease, "decode_row", spy)


def test_a_fixed_buffer_refuses_to_grow_and_a_wrapped_one_still_grows() -> None:
    fixed = hf_cache.KVBuffer(2, 1, 4, 5, torch.float32, "cpu", fixed=True)
    fixed.reserve(5)  # within: fine
    with pytest.raises(LeaseExceededError, match="holds 5 positions.*6 were asked for.*never grows.*reserve"):
        fixed.reserve(6)
    layer = BufferLayer(fixed, 0, 4)
    with pytest.raises(LeaseExceededError):  # a forward writing two positions past the fourth
        layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    assert fixed.capacity == 5
    loose = hf_cache.KVBuffer.wrap(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))
    loose.reserve(4)
    assert loose.capacity == 6 and not loose.fixed  # an unleased buffer (a tool's) grows by doubling


def test_the_scheduler_leases_the_positions_it_was_given() -> None:
    s = Scheduler(KVBudget(10_000, 16, torch.bfloat16), 2)
    rid = s.add(40)
    s.schedule()
    lease = s.requests[rid].lease
    assert lease is not None and lease.positions == 40 and lease.nbytes == 40 * 16 == s.budget.used
    s.cancel(rid)
    s.schedule()
    assert lease.released and lease.buffer is None and s.budget.used == 0


def test_submit_only_compares_and_refuses_more_than_was_leased() -> None:
    eng = _engine()
    plan = _plan(eng)
    prep = eng.prepare(plan, "stale", reserve=5)
    lease = prep.kv_lease
    assert lease is not None and lease.positions == plan.total_len + 5
    assert eng.runner.stats()["kv"]["used"] == lease.nbytes == eng.runner.budget.bytes_for(plan.total_len + 5)
    buf, length = hf_cache.buffer_of(prep.cache)
    assert buf is lease.buffer and buf.fixed and buf.capacity == lease.positions and length == plan.total_len
    with pytest.raises(ConfigError, match=r"max_new_tokens=6 but the request was prepared for 5 new tokens.*reserve=6"):
        next(eng.stream(prep, GenerationConfig(max_new_tokens=6)))
    assert eng.runner.stats()["kv"]["used"] == lease.nbytes  # refused before anything moved: still leased, still READY
    text = "".join(eng.stream(prep, GenerationConfig(max_new_tokens=5)))
    assert text == eng.answer_plan(plan, "stale", GenerationConfig(max_new_tokens=5)).text
    assert eng.runner.stats()["kv"]["used"] == 0 and lease.released and lease.buffer is None


@pytest.mark.parametrize("method", ["full", "stale", "relaxkv:r=0.5"])
@pytest.mark.parametrize("speculative_tokens", [0, 3])
def test_a_leased_buffer_is_never_reallocated_while_decoding(monkeypatch: pytest.MonkeyPatch, method: str,
                                                             speculative_tokens: int) -> None:
    """The row a request decodes in is the very buffer its prepare computed the prompt in (no copy), with exactly
    the leased positions, and its storage is the same at the last token as at the first."""
    eng = _engine(speculative_tokens=speculative_tokens)
    plan = _plan(eng)
    gen = GenerationConfig(max_new_tokens=12)
    spy = _Rows(monkeypatch)
    prep = eng.prepare(plan, method, reserve=gen.max_new_tokens)
    prompt_buf = hf_cache.buffer_of(prep.cache)[0]
    "".join(eng.stream(prep, gen))
    (row, ptr, lease), = spy.rows
    assert row.buffer is prompt_buf and row.buffer.fixed
    assert row.buffer.capacity == plan.total_len + gen.max_new_tokens == lease.positions
    assert row.buffer.keys.data_ptr() == ptr  # never reallocated
    assert row.length == plan.total_len + len(prep.token_ids) - 1  # the last sampled token is not fed back


def test_narrower_decode_kv_gets_its_buffer_once_at_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_dtype=bfloat16 under float32: the prompt is computed in a scratch buffer of exactly the prompt, the lease's
    own bfloat16 buffer of prompt + reserve is made once at submit and decoded in without reallocating."""
    eng = _engine(kv_dtype="bfloat16", speculative_tokens=0)
    plan = _plan(eng)
    gen = GenerationConfig(max_new_tokens=7)
    spy = _Rows(monkeypatch)
    prep = eng.prepare(plan, "stale", reserve=gen.max_new_tokens)
    scratch = hf_cache.buffer_of(prep.cache)[0]
    assert scratch.capacity == plan.total_len and scratch.fixed and scratch.keys.dtype == torch.float32
    assert prep.kv_lease is not None and prep.kv_lease.buffer is None  # not yet: made at submit
    "".join(eng.stream(prep, gen))
    (row, ptr, lease), = spy.rows
    assert row.buffer is not scratch and row.buffer.keys.dtype == torch.bfloat16 and row.buffer.fixed
    assert row.buffer.capacity == lease.positions == plan.total_len + gen.max_new_tokens
    assert row.buffer.keys.data_ptr() == ptr


class _CopyingStale(Stale):
    """``stale`` that hands back its K/V outside the request's buffer (as a method that cannot repair in place)."""

    name = "copying-stale-test"

    def fuse(self, inp: FusionInput) -> FusionOutput:
        cache = hf_cache.make_cache(inp.keys.clone(), inp.values.clone(), inp.model.config)
        return FusionOutput(cache=cache, stats=MethodStats(recomputed_fraction=0.0))


def test_kv_handed_back_outside_the_buffer_is_copied_into_the_lease_not_grown(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine(speculative_tokens=0)
    plan = _plan(eng)
    gen = GenerationConfig(max_new_tokens=6)
    spy = _Rows(monkeypatch)
    prep = eng.prepare(plan, _CopyingStale(), reserve=gen.max_new_tokens)
    text = "".join(eng.stream(prep, gen))
    (row, ptr, lease), = spy.rows
    assert row.buffer.capacity == lease.positions and row.buffer.keys.data_ptr() == ptr
    assert text == eng.answer_plan(plan, "stale", gen).text
