"""``kvrag bench load`` on a tiny model: concurrent clients through a real LlamaIndex query engine, in seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.store import MemoryStore
from kvrag.testing.tiny import tiny_model
from kvrag_bench.load_bench import (
    QUESTIONS,
    LoadConfig,
    load_markdown,
    percentile,
    run_load,
    schedule,
)

pytest.importorskip("llama_index.llms.kvrag", reason="needs the LlamaIndex integrations (make setup-dev)")
pytest.importorskip("llama_index.embeddings.huggingface", reason="needs llama-index-embeddings-huggingface")

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"


def test_schedule_and_percentiles() -> None:
    cfg = LoadConfig(clients=3, questions=4, pool=("a", "b", "c", "d", "e"))
    assert schedule(cfg) == [list("abcd"), list("eabc"), list("deab")]
    assert percentile([], 50) is None and percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile(list(map(float, range(101))), 95) == 95.0
    with pytest.raises(ConfigError, match="clients and questions"):
        LoadConfig(clients=0)
    assert len(set(QUESTIONS)) == len(QUESTIONS)


def test_load_tiny_model_no_errors_no_cross_talk(tmp_path: Path) -> None:
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from kvrag.default_model import default_embedder_path

    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("02_fares.md", "03_trams.md", "04_ferries.md"):
        shutil.copy(DATA / name, docs / name)
    engine = KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig())
    embed = HuggingFaceEmbedding(model_name=str(default_embedder_path()))
    cfg = LoadConfig(clients=3, questions=4, max_new_tokens=6, chunk_size=128, docs=str(docs),
                     out=str(tmp_path / "out"), progress=False, pool=QUESTIONS[:5])
    result = run_load(cfg, engine=engine, embed_model=embed)
    assert result["ok"], (result["error_samples"], result["mismatch_samples"])
    assert (result["requests"], result["errors"], result["mismatches"]) == (12, 0, 0)
    assert len(set(result["reference_answers"].values())) > 1  # distinct questions, distinct answers
    assert result["throughput_qps"] > 0 and 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p95"]
    assert result["hit_rate_mean"] == 1.0  # every retrieved chunk came from the store
    rows = result["rows"]
    assert sorted((r["client"], r["index"]) for r in rows) == [(c, j) for c in range(3) for j in range(4)]
    saved = json.loads((tmp_path / "out" / "load.json").read_text())
    assert saved["requests"] == 12 and saved["config"]["clients"] == 3 and "git_sha" in json.dumps(saved)
    assert "0 -> OK" in load_markdown(result)


def test_bench_load_cli_is_wired() -> None:
    from kvrag.cli import build_parser
    from kvrag_bench.cli import run_load as cli_run_load

    args = build_parser().parse_args(["bench", "load", "--clients", "8", "--questions", "50", "--threads", "1",
                                      "--method", "stale", "--max-new-tokens", "16", "--store", "memory://"])
    assert args.func is cli_run_load and (args.clients, args.questions, args.threads) == (8, 50, 1)
