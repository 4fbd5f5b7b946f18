"""Storage size figures (kvrag.store.sizing) and ``kvrag store stats`` on a persisted index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvrag import cli
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv.spec import KVSpec
from kvrag.store import DiskStore, serde
from kvrag.store.sizing import codec_table, collection_size, entry_bytes
from kvrag_testing.store_suite import random_chunk
from kvrag_testing.tiny import tiny_model

DEFAULT_SPEC = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32")  # SmolLM2-135M


@pytest.mark.parametrize("codec", ["float32", "float16", "bfloat16", "int8"])
def test_entry_bytes_is_what_serde_writes(codec: str) -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
    assert entry_bytes(spec, 13, codec) == len(serde.encode(random_chunk(spec, 13, seed=3), codec))


def test_default_model_codec_table() -> None:
    rows = {r["codec"]: r for r in codec_table(DEFAULT_SPEC, tokens_per_chunk=256)}
    assert rows["float32"]["raw_bytes_per_token"] == 2 * 30 * 3 * 64 * 4 == 46080
    assert rows["float16"]["raw_bytes_per_token"] == rows["bfloat16"]["raw_bytes_per_token"] == 23040
    assert rows["int8"]["raw_bytes_per_token"] == 11520
    for r in rows.values():  # stored = raw + token id + header (+ int8 scales), a little more than raw
        assert r["raw_bytes_per_token"] < r["bytes_per_token"] < 1.1 * r["raw_bytes_per_token"]
        assert r["file_bytes"] >= r["entry_bytes"] * 100_000 and r["redis_bytes"] > r["entry_bytes"] * 100_000
    assert rows["float32"]["memory_bytes"] == (46080 + 8) * 256 * 100_000  # native tensors + int64 token ids
    assert rows["int8"]["file_bytes"] < rows["float16"]["file_bytes"] < rows["float32"]["file_bytes"]


def test_store_stats_reports_size_of_a_persisted_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    faiss = pytest.importorskip("faiss")
    from kvrag.index import Chunk, ChunkIndex

    eng = KVRAGEngine(tiny_model("llama"), DiskStore(tmp_path / "kv"))
    texts = [f"Chunk {i}: the quick brown fox jumps over the lazy dog." for i in range(5)]
    eng.ingest(texts)
    chunks = [Chunk(id=f"d#{i}", source="d", text=t, num_tokens=len(eng.tokenize(t))) for i, t in enumerate(texts)]
    vecs = faiss.IndexFlatIP(4)
    vecs.add(np.eye(5, 4, dtype="float32"))
    ChunkIndex(chunks, vecs, {"format": 1}).save(tmp_path / "idx")
    url = f"file://{tmp_path / 'kv'}"
    size = collection_size(DiskStore(tmp_path / "kv"), [c.num_tokens for c in chunks])
    assert size["entries"] == 5 and size["tokens"] == sum(c.num_tokens for c in chunks) and size["codec"] == "float32"
    assert size["projected_100k_chunks_bytes"] == int(size["bytes"] / 5 * 100_000)
    assert cli.main(["store", "stats", "--persist", str(tmp_path / "idx"), "--store", url]) == 0
    out = capsys.readouterr().out
    assert "size: 5 entries" in out and "bytes per token" in out and "100K such chunks would take" in out


@pytest.mark.parametrize("action", ["stats", "verify", "gc"])
def test_a_store_path_that_does_not_exist_is_an_error_not_an_empty_store(tmp_path: Path, action: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Opening a file store creates its folder: a mistyped path reported an empty, healthy store and left a folder."""
    typo = tmp_path / "no" / "such-store"
    for url in (str(typo), f"file://{typo}"):
        assert cli.main(["store", action, "--store", url]) == 2
        assert "no KV store at" in capsys.readouterr().err and not typo.exists()
    DiskStore(tmp_path / "a store")  # an existing one, addressed as store_from_url reads it: quoted, with options
    assert cli.main(["store", action, "--store", f"file://{tmp_path}/a%20store?codec=int8"]) == 0
    assert "no KV store at" not in capsys.readouterr().err


def test_a_llamaindex_persist_dir_is_read_by_the_store_commands_and_named_by_ask(tmp_path: Path, capsys) -> None:
    """llama-index-postprocessor-kvrag's build_index keeps its caches in PERSIST/kvcache (kvrag ingest: PERSIST/kv):
    `kvrag store stats --persist` said "no KV store", and `kvrag ask --persist` only "not a kvrag index"."""
    persist = tmp_path / "li"
    KVRAGEngine(tiny_model("llama"), DiskStore(persist / "kvcache")).ingest(["A passage about the harbour."])
    (persist / "docstore.json").write_text("{}")
    assert cli.main(["store", "stats", "--persist", str(persist)]) == 0
    assert "size: 1 entries" in capsys.readouterr().out
    assert cli.main(["ask", "Where?", "--persist", str(persist)]) != 0
    err = capsys.readouterr().err
    assert "LlamaIndex index" in err and "kvcache" in err, err
