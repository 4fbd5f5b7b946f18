"""``make gpu-check`` without a GPU: says so clearly and exits 0, running nothing."""

from __future__ import annotations

import pytest
import torch

from kvrag_bench import gpu_check


def test_without_cuda_it_says_so_and_exits_zero(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "g")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "g").exists()  # nothing was run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_equivalence_on_cuda() -> None:
    rows = gpu_check.equivalence("cuda", (torch.float32,))
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equivalence_checks_pass_on_cpu(dtype: torch.dtype) -> None:
    """The gpu-check equivalence (full == model.generate; every recompute-everything method == full) also holds on
    the CPU, in float32 (6 tokens) and bfloat16 (the first BF16_TOKENS tokens: the documented bf16 tolerance)."""
    rows = gpu_check.equivalence("cpu", (dtype,))
    assert len(rows) == 4 * (1 + 2 * 5) and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert sum("zero-copy" in r["check"] for r in rows) == 4 * 5
