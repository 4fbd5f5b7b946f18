"""Writing a benchmark's result: ``<stem>.json`` and ``<stem>.md`` in the output folder, the markdown printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_result(out: str | Path, stem: str, result: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> Path:
    """Write ``result`` as JSON and its markdown summary under ``out`` (created), print the markdown; returns the
    folder."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (folder / f"{stem}.md").write_text(md + "\n")
    print(md)
    return folder


__all__ = ["write_result"]
