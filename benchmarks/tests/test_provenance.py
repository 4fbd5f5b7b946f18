"""Every result names its machine kind, CPU bf16 unit and compute dtype (tables are per (machine kind, dtype))."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrag import models
from kvrag_bench import aggregate, provenance
from kvrag_bench.config import BenchConfig
from kvrag_bench.runner import QABenchmark

DATA = Path(__file__).resolve().parents[1] / "data" / "qa_tiny.jsonl"


def test_machine_info_on_cuda_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kind is kvrag's own machine kind (the one calibrations and cost models are keyed by) of the model's
    device."""
    from kvrag import calibration

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    hw = {"gpu": "NVIDIA H200", "cpu_bf16": "amx_bf16"}
    assert provenance.machine_info(torch.device("cuda", 0), torch.bfloat16, hw) == {
        "kind": "cuda-nvidia-h200", "device": "cuda:0", "dtype": "bfloat16", "cpu_bf16": "amx_bf16"}
    monkeypatch.setattr(calibration, "cpu_flags", lambda: frozenset({"avx2"}))
    info = provenance.machine_info("cpu", torch.float32, {"gpu": None, "cpu_bf16": None})
    assert info == {"kind": "cpu-avx2", "device": "cpu", "dtype": "float32", "cpu_bf16": None}
    assert provenance.machine_label({"machine": info}) == "cpu-avx2, float32"


def test_hardware_reports_the_cpu_bf16_unit_kvrag_detects() -> None:
    assert provenance.hardware()["cpu_bf16"] == models.cpu_native_bf16()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summary_and_its_headline_name_machine_kind_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              dtype: torch.dtype) -> None:
    """A real (tiny-model) run in each dtype: summary.json's ``machine`` and the first line of summary.md."""
    from kvrag import calibration
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store import MemoryStore
    from kvrag_testing.tiny import tiny_model

    flags = frozenset({"avx2", "avx512f", "avx512_bf16"})  # as on an AVX512-BF16 machine (no AMX)
    monkeypatch.setattr(calibration, "cpu_flags", lambda: flags)
    monkeypatch.setattr(models, "cpu_flags", lambda: flags)
    engine = KVRAGEngine(tiny_model("llama", dtype=dtype), MemoryStore(), EngineConfig())
    cfg = BenchConfig(data=str(DATA), out=str(tmp_path), methods=("full", "stale"), limit=1, max_new_tokens=2,
                      bootstrap=0, plots=False, progress=False, warmup=0)
    QABenchmark(cfg, engine).run()
    js = json.loads((tmp_path / "summary.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert js["machine"] == {"kind": "cpu-avx512bf16", "device": "cpu", "dtype": name, "cpu_bf16": "avx512_bf16"}
    assert js["hardware"]["cpu_bf16"] == "avx512_bf16"
    md = (tmp_path / "summary.md").read_text()
    assert md.splitlines()[0] == f"# kvrag QA benchmark: cpu-avx512bf16, {name}"
    assert "CPU native bf16: avx512_bf16" in md
    assert aggregate.summary_markdown(js) == md  # the file is the summary's rendering
