"""Writing a benchmark's result: ``<stem>.json`` and ``<stem>.md`` in the output folder, the markdown printed."""

from __future__ import annotations

import argparse
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


def writing_main(stem: str, run: Callable[[argparse.Namespace], dict[str, Any]],
                 markdown: Callable[[dict[str, Any]], str]) -> Callable[[argparse.Namespace], int]:
    """A ``kvrag bench`` command's ``main``: ``run(args)``, written by :func:`write_result` under ``args.out`` as
    ``stem``; exit status 0."""

    def main(args: argparse.Namespace) -> int:
        write_result(args.out, stem, run(args), markdown)
        return 0

    return main


__all__ = ["write_result", "writing_main"]
