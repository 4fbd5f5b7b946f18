"""What users see: "same answer as full" (normalized and token-identical) and first-token agreement, per method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.store.memory import MemoryStore
from kvrag_bench import aggregate
from kvrag_bench.config import BenchConfig
from kvrag_bench.metrics import same_answer, same_tokens
from kvrag_bench.runner import QABenchmark
from kvrag_testing.tiny import tiny_model

DATA = Path(__file__).resolve().parents[1] / "data" / "qa_tiny.jsonl"


def test_same_answer_uses_the_f1_normalization() -> None:
    assert same_answer("The Eiffel Tower.", "eiffel  tower")
    assert same_answer("", "")
    assert not same_answer("Eiffel Tower", "Eiffel")
    assert not same_answer("1862", "1863")


def test_same_tokens_is_exact() -> None:
    assert same_tokens([1, 2, 3], (1, 2, 3))
    assert not same_tokens([1, 2, 3], [1, 2])
    assert not same_tokens([1, 2, 4], [1, 2, 3])
    assert same_tokens([], [])


def _rec(answer: str, tokens: list[int], first: bool) -> dict[str, Any]:
    return {"answer": answer, "token_ids": tokens, "first_token_agree": first, "f1": 0.0, "em": 0.0, "kl": 0.1,
            "ttft_s": 1.0}


def test_summary_same_answer_hand_computed() -> None:
    # m: request a same tokens; b same normalized answer, other tokens; c a different answer, same first token
    rows = [
        {"id": "a", "methods": {"full": _rec("Paris", [5, 6], True), "m": _rec("Paris", [5, 6], True)}},
        {"id": "b", "methods": {"full": _rec("the Alps", [7, 8], True), "m": _rec("Alps.", [9], False)}},
        {"id": "c", "methods": {"full": _rec("1862", [1, 2], True), "m": _rec("1863", [1, 3], True)}},
        {"id": "d", "methods": {"full": _rec("no", [4], True), "m": _rec("yes", [3], False)}},
    ]
    s = aggregate.summarize(rows, ["full", "m"], n_boot=200, env={})
    m, full = s["methods"]["m"], s["methods"]["full"]
    assert m["same_answer"] == pytest.approx(0.5)
    assert m["same_tokens"] == pytest.approx(0.25)
    assert m["first_token_agreement"] == pytest.approx(0.5)
    assert full["same_answer"] == 1.0 and full["same_tokens"] == 1.0 and full["same_answer_ci"] == [1.0, 1.0]
    lo, hi = m["same_answer_ci"]
    assert 0.0 <= lo < 0.5 < hi <= 1.0
    lo, hi = m["first_token_agreement_ci"]
    assert lo < 0.5 < hi
    md = aggregate.summary_markdown(s)
    assert "same answer as full" in md
    assert "| `m` | 4 | 0.50 [" in md


def test_summary_without_full_has_no_same_answer() -> None:
    rows = [{"id": "a", "methods": {"stale": _rec("x", [1], True)}}]
    m = aggregate.summarize(rows, ["stale"], n_boot=10, env={})["methods"]["stale"]
    assert m["same_answer"] is None and m["same_answer_ci"] is None and m["same_tokens"] is None


def test_bench_run_reports_same_answer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = KVRAGEngine(tiny_model("llama"), MemoryStore(), EngineConfig())
    cfg = BenchConfig(data=str(DATA), out=str(tmp_path / "out"), methods=["full", "stale", "full"], limit=3,
                      max_new_tokens=4, kl_tokens=4, bootstrap=50, progress=False, warmup=0, plots=False)
    s = QABenchmark(cfg, engine).run()
    rows = aggregate.read_jsonl(tmp_path / "out" / "results.jsonl")
    st = s["methods"]["stale"]
    expect = sum(same_answer(r["methods"]["stale"]["answer"], r["methods"]["full"]["answer"]) for r in rows) / 3
    assert st["same_answer"] == pytest.approx(expect)
    assert s["methods"]["full#2"]["same_tokens"] == 1.0  # full twice: the same tokens
    assert "same answer as full" in (tmp_path / "out" / "summary.md").read_text()


def test_ladder_simulation_hand_computed() -> None:
    from kvrag_bench.fidelity_probe import simulate

    def row(i: int, cr: str, t_cr: float) -> dict[str, Any]:
        return {"row": i, "methods": {"full": {"answer": "x", "ttft_s": 10.0},
                                      "cacherepair": {"answer": cr, "ttft_s": t_cr}}}

    rows = [row(0, "x", 1.0), row(1, "y", 2.0)]
    conf = {0: {"cacherepair": 0.9, "full": 0.5}, 1: {"cacherepair": 0.3, "full": 0.5}}
    # threshold 0.5: row 0 keeps CacheRepair's (same) answer; row 1 escalates to full and pays both
    same, p50, mean = simulate(rows, conf, ["cacherepair", "full"], 0.5)
    assert same == 1.0 and mean == pytest.approx((0.1 + 1.2) / 2) and p50 == pytest.approx(0.65)
    same, _, mean = simulate(rows, conf, ["cacherepair", "full"], 0.0)  # never escalates
    assert same == 0.5 and mean == pytest.approx(0.15)
