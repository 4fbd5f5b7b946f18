"""kvrag bench load --http against a live kvrag serve (tiny model, 127.0.0.1): every request answered, all
registered paragraphs hit, every concurrent answer equal to the one given alone."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("httpx")

from kvrag.serve import LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag_bench import http_load  # noqa: E402
from kvrag_testing.tiny import tiny_engine  # noqa: E402


def test_retrieve_is_lexical_and_in_document_order() -> None:
    paras = ["the ferry leaves at noon", "trams run every ten minutes", "a day pass costs 9 marks"]
    assert http_load.retrieve("How much does a day pass cost?", paras, 1) == [paras[2]]
    assert http_load.retrieve("When does the ferry leave? trams?", paras, 2) == paras[:2]


def test_http_levels(tmp_path: Path) -> None:
    engine = tiny_engine("qwen2", method="stale")
    with LiveServer(create_app(engine, ServeConfig(max_queue=16)), drain_timeout_s=5) as srv:
        args = argparse.Namespace(http=srv.url, docs=None, top_k=2, clients="1,4", questions=1, max_new_tokens=4,
                                  method="stale", model=None, dtype=None, device=None, threads=None,
                                  max_batch_size=8, out=str(tmp_path), burst=3)
        res = http_load.run(args)
    assert [lv["clients"] for lv in res["levels"]] == [1, 4]
    b = res["burst"]
    assert b["clients"] == b["requests"] == 3 and b["errors"] == 0 and b["same_answer_rate"] == 1.0
    assert len(b["sequential_runs_s"]) == 2 and b["speedup"] == b["sequential_s"] / b["wall_s"] > 0
    assert "| burst |" in (tmp_path / "http_load.md").read_text()
    for lv in res["levels"]:
        assert lv["errors"] == 0 and lv["same_answer_rate"] == 1.0 and lv["hit_rate"] == 1.0
        assert lv["tokens_per_s"] > 0 and lv["ttft_p50_s"] is not None
    assert (tmp_path / "http_load.md").read_text().startswith("`kvrag bench load --http`")
