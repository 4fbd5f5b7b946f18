"""[tool.llamahub] names an importable module and classes that it exports (what LlamaHub lists)."""

from __future__ import annotations

from pathlib import Path

from kvrag_testing.integrations import check_llamahub_section


def test_llamahub_section_points_at_exported_classes() -> None:
    check_llamahub_section(Path(__file__).resolve().parents[2] / "pyproject.toml")
