"""``kvrag bench load --interleave`` on a tiny random model: the three phases, prepares in pieces between the decode
steps in the default phase and in one piece each in the ``whole`` one, and the JSON / markdown written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.store import MemoryStore
from kvrag_testing.tiny import tiny_model

interleave = pytest.importorskip("kvrag_bench.interleave")
load_sweep = pytest.importorskip("kvrag_bench.load_sweep")


def test_interleave_on_a_tiny_model(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    load_sweep.add_arguments(parser)
    interleave.add_arguments(parser)
    args = parser.parse_args(["--interleave", "full,relaxkv", "--streams", "2", "--prepares", "1", "--context", "300",
                              "--steady-tokens", "5", "--out", str(tmp_path)])
    engine = KVRAGEngine(tiny_model("llama", num_layers=4, init_std=0.1), MemoryStore(), EngineConfig())
    result = interleave.run(args, engine=engine)
    phases = result["phases"]
    assert set(phases) == {"steady", "pieces", "whole"}
    assert phases["steady"]["tokens"] > 0 and phases["steady"]["prepare_pieces"] == 0
    assert phases["whole"]["prepare_pieces"] == 2  # one full, one relaxkv, each in one piece
    assert phases["pieces"]["prepare_pieces"] > 2 and set(phases["pieces"]["prepare_s"]) == {"full", "relaxkv"}
    assert result["context_tokens"] >= 300
    assert json.loads((tmp_path / "interleave.json").read_text())["phases"]["whole"]["prepare_pieces"] == 2
    assert "| pieces |" in (tmp_path / "interleave.md").read_text()
    engine.close(cancel=True)
