"""``kvrag bench ingest`` end to end on a tiny model: every mode ingests, every chunk is served, codecs apply."""

from __future__ import annotations

import json
from pathlib import Path

from kvrag.store.factory import store_from_url
from kvrag_bench.ingest_bench import IngestBenchConfig, ingest_markdown, run_ingest_bench
from kvrag_testing.tiny import tiny_model

GROUPS = [
    {"titles": ["Paris", "Lyon"], "passages": ["Paris is the capital of France.", "Lyon lies on the Rhone."]},
    {"titles": ["Berlin", "Rhine", "Alps"], "passages": ["Berlin is in Germany.", "The Rhine flows north.",
                                                         "The Alps are high mountains in Europe."]},
]


def test_ingest_bench_serial_and_batched_on_a_tiny_model(tmp_path: Path) -> None:
    src = tiny_model("llama")
    src.model.save_pretrained(tmp_path / "model")
    src.tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps(g) + "\n" for g in GROUPS))
    store = tmp_path / "kv"
    cfg = IngestBenchConfig(data=str(data), limit=5, modes=("serial", "batched"), batch_size=2, rounds=2,
                            store=f"file://{store}", answers=2, codec="float16", out=str(tmp_path / "out"),
                            model=str(tmp_path / "model"), progress=False)
    result = run_ingest_bench(cfg)
    assert result["chunks"] == 5
    for m in ("serial", "batched"):
        mode = result["modes"][m]
        assert (mode["served"], mode["missing_or_bad"]) == (5, 0)
        assert mode["entries"] >= 5  # + the prompt template's cached text from the hit-rate answers
        assert mode["answer_hit_rate_min"] == 1.0 and mode["chunks_per_s"] > 0
    dirs = sorted(p for p in store.iterdir() if p.is_dir())
    assert len(dirs) == 2  # one fresh store per mode
    for d in dirs:
        st = store_from_url(f"file://{d}")
        (key, *_) = list(st.iter_keys())
        raw = st.get_bytes(key)
        assert raw is not None and b"float16" in raw[:4096]  # the codec reached every mode's store
    assert "serial" in ingest_markdown(result) and (tmp_path / "out" / "ingest.json").is_file()
