"""What the framework integration packages' tests share: the real default model's engine as session fixtures, and
the check of a LlamaHub ``[tool.llamahub]`` section.

A conftest takes the fixtures by importing them (``from kvrag_testing.integrations import engine, loaded``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def engine() -> Any:
    """One engine per process (shared by every test directory of a run): default model + memory store."""
    from kvrag.adapters import shared_engine

    return shared_engine(None, "memory://")


@pytest.fixture(scope="session")
def loaded(engine: Any) -> Any:
    """The engine's loaded default model."""
    return engine.loaded


def check_llamahub_section(pyproject: Path) -> None:
    """``[tool.llamahub]`` of ``pyproject`` names an importable module and classes it exports (what LlamaHub lists),
    and the distribution's name matches the import path."""
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML in the standard library")
    meta = tomllib.loads(pyproject.read_text())
    hub = meta["tool"]["llamahub"]
    module = importlib.import_module(hub["import_path"])
    assert meta["project"]["name"] == "-".join(hub["import_path"].split(".")).replace("_", "-")
    assert hub["class_authors"], "list the integration's classes"
    for cls in hub["class_authors"]:
        assert cls in module.__all__ and isinstance(getattr(module, cls), type), cls


__all__ = ["check_llamahub_section", "engine", "loaded"]
