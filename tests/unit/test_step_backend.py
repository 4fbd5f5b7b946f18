"""The step backends' registry (kvrag.kv.step_backend): one first-step check per model and step kind against the
model's own forward, backends tried in registry order, the oracle's K/V kept where none matches, and refusals by
name."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import batched, direct, fused_step, row_attention, step_backend
from kvrag.store import MemoryStore
from kvrag_testing.rows import DOCS, paired_rows
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(family: str) -> tuple[Any, list[batched.Row], list[batched.Row], list[int]]:
    lm = tiny_model(family, init_std=0.1)
    eng = KVRAGEngine(lm, MemoryStore(), EngineConfig())
    eng.ingest(DOCS)
    a, b, toks = paired_rows(eng, 4)
    step_backend.choose(lm.model, "decode", None)
    return lm.model, a, b, toks


def test_every_backend_names_itself_and_the_oracle_is_last() -> None:
    names = [b.name for b in step_backend.REGISTRY]
    assert names == ["fused", "direct", "hf"] and step_backend.REGISTRY[-1] is step_backend.ORACLE
    model = tiny_model("gemma", init_std=0.1).model  # embeddings scaled in the model's forward: not direct's
    why = step_backend.why_not(model, "decode")
    assert why["hf"] is None and "GemmaForCausalLM" in str(why["direct"])
    assert step_backend.why_not(tiny_model("gemma3", init_std=0.1).model, "decode")["direct"] is None
    assert why["fused"] is None or row_attention.why_not(torch.float32) is not None
    assert set(step_backend.why_not(model, "prefill")) == {"direct", "hf"}  # the fused step takes no prefills
    with pytest.raises(ValueError, match="no backend 'fused' for prefill"):
        step_backend.choose(model, "prefill", "fused")


def test_where_no_backend_matches_the_oracles_kv_stays(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A backend that writes wrong K/V (and returns the right logits) and one that fails: the first step returns
    the oracle's logits, warns for both, leaves exactly the oracle's K/V in the rows, and the oracle serves."""
    model, a, b, toks = _rows("qwen2")
    real = fused_step.forward

    def bad_kv(m: Any, ids: torch.Tensor, pos: torch.Tensor, keep: Any, rows: Any, counts: Any,
               windows: Any) -> torch.Tensor:
        out = real(m, ids, pos, keep, rows, counts, windows)
        for r in rows:
            r.buffer.keys[:, :, r.length] += 1.0
        return out

    def fails(*args: Any) -> torch.Tensor:
        raise RuntimeError("boom")

    monkeypatch.setattr(fused_step, "forward", bad_kv)
    monkeypatch.setattr(direct, "forward", fails)
    wins = batched.windows(model)
    with caplog.at_level(logging.WARNING, logger="kvrag.kv.step_backend"):
        got = batched.decode_step(model, a, toks, wins)
    assert step_backend.chosen(model, "decode") == "hf"
    text = caplog.text
    assert "the direct step failed" in text or row_attention.why_not(torch.float32) is not None
    assert "fused step differs" in text or row_attention.why_not(torch.float32) is not None
    assert torch.equal(got, batched.decode_step(model, b, toks, wins))  # the oracle, on the copies
    for ra, rb in zip(a, b, strict=True):
        n = ra.length + 1
        assert torch.equal(ra.buffer.keys[:, :, :n], rb.buffer.keys[:, :, :n])
        assert torch.equal(ra.buffer.values[:, :, :n], rb.buffer.values[:, :, :n])
    step_backend.choose(model, "decode", None)


def test_each_step_kind_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle runs on the first step of a kind only; later steps run the chosen backend alone."""
    model, a, _, toks = _rows("llama")
    calls: list[str] = []
    real = step_backend.ORACLE.run

    class Counting:
        name, kinds = "hf", ("decode", "prefill")

        def why_not(self, m: Any) -> None:
            return None

        def run(self, step: step_backend.Step) -> torch.Tensor:
            calls.append("hf")
            return real(step)

    counting = Counting()
    monkeypatch.setattr(step_backend, "ORACLE", counting)
    monkeypatch.setattr(step_backend, "REGISTRY", (*step_backend.REGISTRY[:-1], counting))
    wins = batched.windows(model)
    for _ in range(3):
        batched.decode_step(model, a, toks, wins)
        for r in a:
            r.length += 1
    assert calls == ["hf"]
    assert step_backend.chosen(model, "decode") == ("fused" if row_attention.why_not(torch.float32) is None
                                                     else "direct")
    step_backend.choose(model, "decode", None)
