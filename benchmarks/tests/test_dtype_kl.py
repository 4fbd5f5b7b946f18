"""``kvrag bench dtype-kl`` on a tiny model: float32 vs bfloat16 full prefill, and the CLI wiring."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvrag.errors import ConfigError
from kvrag_bench.dtype_kl import DtypeKLConfig, markdown, run_dtype_kl
from kvrag_testing.tiny import tiny_model

ROW = {"id": "q1", "question": "Which city is the capital of France?", "answers": ["Paris"],
       "contexts": [{"title": "Paris", "text": "Paris is the capital and largest city of France."},
                    {"title": "Lyon", "text": "Lyon is a city in France on the Rhone."}]}


def test_dtype_kl_tiny_model(tmp_path: Path) -> None:
    src = tiny_model("qwen2", init_std=0.1)
    src.model.save_pretrained(tmp_path / "m")
    src.tokenizer.save_pretrained(tmp_path / "m")
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "id": "q2", "question": "Where is Lyon?"}) + "\n")
    res = run_dtype_kl(DtypeKLConfig(data=str(data), limit=2, model=str(tmp_path / "m"), device="cpu",
                                     out=str(tmp_path / "out"), progress=False), command="test")
    s = res["summary"]
    kls = [r["kl"] for r in res["rows"]]
    # bf16 rounding of this 2-layer model on ~540-token prompts: KL measured 1.0e-4 .. 1.6e-4 per row (AMX, and
    # with oneDNN limited to AVX2 and to SSE4.1); each bound is ~5x past the extremes, so a run that compared
    # float32 with float32 (KL 0) or bf16 of another prompt or weights (KL > 1e-2) fails
    assert s["requests"] == 2 and all(2e-5 < kl < 8e-4 for kl in kls), kls
    assert s["kl_mean"] == pytest.approx(statistics.fmean(kls)) and s["top1_agreement"] == 1.0
    assert all(r["seconds_float32"] > 0 and r["seconds_bfloat16"] > 0 for r in res["rows"])
    assert "KL(float32 full || bfloat16 full)" in markdown(res) and (tmp_path / "out" / "dtype_kl.json").is_file()
    with pytest.raises(ConfigError, match="compares float32 with another dtype"):
        run_dtype_kl(DtypeKLConfig(data=str(data), dtype="float32"))


def test_cli_is_wired() -> None:
    from kvrag.cli import build_parser
    from kvrag_bench.cli import run_dtype_kl as cli_run

    args = build_parser().parse_args(["bench", "dtype-kl", "--data", "x.jsonl", "--limit", "3", "--threads", "1"])
    assert args.func.__wrapped__ is cli_run and (args.limit, args.dtype, args.threads) == (3, "bfloat16", 1)
