"""Provenance of result files: the commit a run executes, library versions, the hardware it ran on, and the kind of
machine and compute dtype its numbers belong to (results are comparable only within one (machine kind, dtype))."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np


def git_sha(cwd: str | os.PathLike[str] | None = None) -> str:
    """``git rev-parse HEAD`` of the repository holding kvrag (or ``cwd``); "unknown" when not available."""
    where = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else "unknown"


def versions() -> dict[str, str]:
    """Versions of python, torch, transformers, kvrag (and numpy)."""
    import torch
    import transformers

    import kvrag

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvrag": kvrag.__version__,
        "numpy": np.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info(device: Any, dtype: Any, hw: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"kind", "device", "dtype", "cpu_bf16"}`` of a run: the machine kind (:func:`kvrag.calibration.machine_kind`
    of the model's device: 'cpu-amx', 'cpu-avx512bf16', 'cpu-avx2', 'cuda-<gpu name>', ...), the device and compute
    dtype the model ran in, and the CPU's native-bf16 unit.

    Args:
        device: the model's device (``torch.device`` or its string).
        dtype: the model's compute dtype (``torch.dtype`` or its name).
        hw: :func:`hardware` (default: measured now).
    """
    from kvrag.calibration import machine_kind

    hw = hw if hw is not None else hardware()
    return {"kind": machine_kind(device), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "cpu_bf16": hw.get("cpu_bf16")}


def machine_label(summary: dict[str, Any]) -> str:
    """``"<kind>, <dtype>"`` of a result file (``machine`` field; "unknown machine" for files written before it)."""
    m = summary.get("machine") or {}
    return f"{m.get('kind', 'unknown machine')}, {m.get('dtype', 'unknown dtype')}"


def hardware() -> dict[str, Any]:
    """CPU model, its native-bf16 unit (``cpu_bf16``: 'amx_bf16' | 'avx512_bf16' | None), logical cores, torch
    threads, RAM, load average and the GPU name (if any)."""
    import torch

    from kvrag.models import cpu_native_bf16

    gpu = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": _cpu_model(),
        "cpu_bf16": cpu_native_bf16(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": _ram_bytes(),
        "gpu": gpu,
        "platform": platform.platform(),
        "load_avg": load,
    }


_RUN_SHA: dict[str, str] = {}


def run_git_sha() -> str:
    """The commit this process runs: ``git rev-parse HEAD`` at its first call (a run calls it when it starts), so a
    commit made while a long benchmark runs is not recorded as the code that produced its numbers."""
    if "sha" not in _RUN_SHA:
        _RUN_SHA["sha"] = git_sha()
    return _RUN_SHA["sha"]


def environment_info() -> dict[str, Any]:
    """``{"git_sha", "versions", "hardware"}`` for result files (``git_sha``: :func:`run_git_sha`; when HEAD has
    moved since, ``git_sha_head`` names the commit checked out when the file was written)."""
    info: dict[str, Any] = {"git_sha": run_git_sha(), "versions": versions(), "hardware": hardware()}
    head = git_sha()
    if head != info["git_sha"]:
        info["git_sha_head"] = head
    return info
