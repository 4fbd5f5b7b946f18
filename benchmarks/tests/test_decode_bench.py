"""``kvrag bench decode`` on a tiny random model saved to a folder: every (context, batch, format) cell is timed,
the bytes-read bound follows each format's bytes, and the JSON / markdown / plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from kvrag_bench.cli import main
from kvrag_testing.tiny import tiny_model


def _bench(tmp_path: Path, contexts: str, quantize: str, *extra: str) -> tuple[Path, dict]:
    """``kvrag bench decode`` on a tiny 2-layer llama saved to ``tmp_path``: (its --out folder, decode.json)."""
    lm = tiny_model("llama", num_layers=2)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    rc = main(["bench", "decode", "--model", str(tmp_path / "m"), "--dtype", "float32", "--threads", "1",
               "--contexts", contexts, "--batches", "1,2", "--quantize", quantize, "--steps", "2", "--rounds", "1",
               "--peer", "none", *extra, "--out", str(out), "--no-progress"])
    assert rc == 0
    return out, json.loads((out / "decode.json").read_text())


def test_decode_bench_on_a_tiny_model(tmp_path: Path) -> None:
    out, res = _bench(tmp_path, "48,96", "none,int4")
    cells = {(c["context"], c["batch"], c["format"]): c for c in res["cells"]}
    assert set(cells) == {(c, b, f) for c in (48, 96) for b in (1, 2) for f in ("none", "int4")}
    for c in cells.values():
        assert c["step_ms"] > 0 and c["bound_ms_per_step"] > 0 and c["ms_per_token"] == c["step_ms"] / c["batch"]
    # int4 reads fewer weight bytes than dense; more context or rows read more KV
    assert cells[(48, 1, "int4")]["bytes_per_step"] < cells[(48, 1, "none")]["bytes_per_step"]
    assert cells[(96, 1, "none")]["bytes_per_step"] > cells[(48, 1, "none")]["bytes_per_step"]
    assert cells[(48, 2, "none")]["bytes_per_step"] > cells[(48, 1, "none")]["bytes_per_step"]
    assert (out / "decode.png").stat().st_size > 0 and "| 96 | 2 | int4 |" in (out / "decode.md").read_text()
    assert res["peer"] is None and res["formats"] == ["none", "int4"]


def test_decode_bench_counts_int8_kv_bytes_and_kv_kl_measures_the_floor(tmp_path: Path) -> None:
    """``--kv-dtypes int8``: int8 rows are timed and read fewer bytes (values plus their scales); ``kvrag bench
    kv-kl --floor`` on the same model reports int8 and the noise row."""
    import torch

    from kvrag.kv import row_attention

    if row_attention.why_not(torch.float32, torch.int8) is not None:
        import pytest

        pytest.skip("kvrag's row attention does not read int8 K/V here")
    _, res = _bench(tmp_path, "48", "none", "--kv-dtypes", "int8")
    cells = {(c["batch"], c["format"]): c for c in res["cells"]}
    assert cells[(2, "none kv=int8")]["step_ms"] > 0
    assert cells[(2, "none kv=int8")]["bytes_per_step"] < cells[(2, "none")]["bytes_per_step"]
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"id": "q0", "question": "Who jumps?", "answers": ["fox"],
                              "contexts": [{"title": "Fox", "text": "The quick brown fox jumps over the lazy dog."}]})
                  + "\n")
    out = tmp_path / "kl"
    rc = main(["bench", "kv-kl", "--model", str(tmp_path / "m"), "--dtype", "float32", "--data", str(qa),
               "--limit", "1", "--kv-dtypes", "int8", "--floor", "--tokens", "4", "--threads", "1", "--out", str(out)])
    assert rc == 0
    kl = json.loads((out / "kv_kl.json").read_text())
    assert set(kl["kv_dtypes"]) == {"int8", "noise"} and "--floor" in kl["command"]
    # the bench's KL is computed in the logits' own dtype (float32 here): >= 0 up to its rounding
    assert all(-1e-6 < m["kl_mean"] < 1 and m["requests"] == 1 for m in kl["kv_dtypes"].values())
