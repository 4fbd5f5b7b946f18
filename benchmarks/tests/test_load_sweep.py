"""``kvrag bench load``'s sweep on a tiny random model: both frameworks' stock pipelines, concurrent clients whose
answers equal the sequential ones, decode steps shared, and the JSON / markdown / plot written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_model

load_sweep = pytest.importorskip("kvrag_bench.load_sweep")


def test_sweep_on_a_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("langchain_kvrag")
    pytest.importorskip("llama_index.postprocessor.kvrag")
    import argparse

    parser = argparse.ArgumentParser()
    load_sweep.add_arguments(parser)
    args = parser.parse_args(["--clients", "1,3", "--questions", "2", "--max-new-tokens", "8", "--context", "300",
                              "--burst", "3", "--out", str(tmp_path)])
    cfg = load_sweep.config_from_args(args)
    assert cfg.clients == (1, 3) and cfg.frameworks == ("llamaindex", "langchain")
    engine = KVRAGEngine(tiny_model("llama", init_std=0.1), MemoryStore(), EngineConfig())
    result = load_sweep.run_sweep(cfg, engine=engine)
    for fw in ("llamaindex", "langchain"):
        levels = result["frameworks"][fw]["levels"]
        assert [lv["clients"] for lv in levels] == [1, 3]
        assert all(lv["errors"] == 0 and lv["same_answer_rate"] == 1.0 for lv in levels)
        assert levels[1]["mean_batch"] > 1  # three clients decoded in shared steps
        burst = result["frameworks"][fw]["burst"]
        assert burst["clients"] == 3 and burst["errors"] == 0 and burst["same_answer_rate"] == 1.0
        assert burst["speedup"] > 0 and burst["itl_p50_s"] is not None and burst["ttft_p99_s"] >= burst["ttft_p50_s"]
        # the baseline: the same questions one by one right before and right after the burst, caches warm
        before, after = burst["sequential_runs_s"]
        assert burst["sequential_s"] == pytest.approx((before + after) / 2)
        assert burst["speedup"] == pytest.approx(burst["sequential_s"] / burst["wall_s"])
    d = result["decode"]
    assert d["batch8"]["step_ms"] > 0 and d["weight_read_bound_ms"] > 0 and d["context_tokens"] >= 300
    assert json.loads((tmp_path / "sweep.json").read_text())["model"] == result["model"]
    assert (tmp_path / "sweep.png").stat().st_size > 0 and "| langchain | 3 |" in (tmp_path / "sweep.md").read_text()
    assert "| llamaindex | 3 |" in (tmp_path / "sweep.md").read_text().split("| burst |")[1]
    # the files say how to rerun them and where they ran
    assert result["command"] == "kvrag bench load --clients 1,3 --questions 2 --max-new-tokens 8 --context 300 --burst 3"
    assert result["environment"]["hardware"]["cores"] >= 1 and "git_sha" in result["environment"]
    assert f"`{result['command']}` -- commit" in (tmp_path / "sweep.md").read_text()


def test_one_by_one_times_every_question_in_turn() -> None:
    asked: list[str] = []
    seconds = load_sweep.one_by_one(lambda q: asked.append(q) or {}, ["a", "b", "a"])
    assert asked == ["a", "b", "a"] and seconds >= 0
