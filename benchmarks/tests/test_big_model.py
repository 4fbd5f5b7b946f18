"""``kvrag bench big-model``'s file writer: a Llama GGUF of given shapes with random float16 weights that kvrag (and,
where llama-cpp-python is installed, llama.cpp's quantizer) reads back with those shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")

from kvrag_bench.big_model import LLAMA_31_8B, _tensors, quantize, write_random_f16  # noqa: E402

SMALL = {**LLAMA_31_8B, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "vocab": 49152 + 64,
         "context": 512}


def test_llama_31_8b_shapes_count_eight_billion_parameters() -> None:
    import numpy as np

    n = sum(int(np.prod(dims)) for _, dims in _tensors(LLAMA_31_8B, LLAMA_31_8B["layers"]))
    assert 8.0e9 < n < 8.1e9  # Llama-3.1-8B: 8.03B parameters


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_f16(tmp_path_factory.mktemp("big") / "small.F16.gguf", layers=2, shape=SMALL)


def test_written_file_loads_in_kvrag_with_its_shapes_and_answers(small_file: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag import KVRAGEngine

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    reader = gguf.GGUFReader(small_file)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == SMALL["vocab"]  # the tokenizer padded to the shape
    eng = KVRAGEngine.from_pretrained(str(small_file), dtype="float32", device="cpu", quantize=None)
    cfg = eng.loaded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (2, 256, 512, 4, 2, SMALL["vocab"])
    resp = eng.answer("Question: what is kvrag? Answer:", method="full", max_new_tokens=3)
    assert len(resp.token_ids) == 3


def test_llama_cpp_quantizes_the_written_file(small_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (the benchmarks' peers extra)")
    out = quantize(small_file, tmp_path / "small.Q4_K_M.gguf", threads=1)
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(out).tensors}
    assert "Q4_K" in types and "F16" not in types
