"""[tool.llamahub] names an importable module and classes that it exports (what LlamaHub lists)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest


def test_llamahub_section_points_at_exported_classes() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML in the standard library")
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    hub = meta["tool"]["llamahub"]
    module = importlib.import_module(hub["import_path"])
    assert meta["project"]["name"] == "-".join(hub["import_path"].split(".")).replace("_", "-")
    assert hub["class_authors"], "list the integration's classes"
    for cls in hub["class_authors"]:
        assert cls in module.__all__ and isinstance(getattr(module, cls), type), cls
