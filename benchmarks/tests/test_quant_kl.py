"""``kvrag bench quant-kl`` on a tiny random model and the sample QA file: int4 moves the next-token distributions
a little (KL > 0, small), the reference's own dtype as a variant moves nothing (KL 0, every answer the same)."""

from __future__ import annotations

import json
from pathlib import Path

from kvrag_bench.cli import main
from kvrag_testing.tiny import tiny_model

DATA = Path(__file__).resolve().parents[1] / "data" / "qa_tiny.jsonl"


def test_quant_kl_on_a_tiny_model(tmp_path: Path) -> None:
    lm = tiny_model("llama", num_layers=2, init_std=0.1)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    rc = main(["bench", "quant-kl", "--data", str(DATA), "--limit", "2", "--variants", "int4,float32", "--tokens", "6",
               "--model", str(tmp_path / "m"), "--dtype", "float32", "--threads", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "quant_kl.json").read_text())
    q4, same = res["variants"]["int4"], res["variants"]["float32"]
    assert same["kl_max"] == 0.0 and same["same_answer"] == same["requests"] == 2
    assert 0.0 < q4["kl_mean"] < 0.05 and q4["positions"] >= 2
    assert "| int4 |" in (out / "quant_kl.md").read_text()
