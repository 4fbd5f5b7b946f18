"""Helpers for the llama-index-postprocessor-kvrag tests."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[4] / "examples" / "data"
DOC_FILES = ["02_fares.md", "03_trams.md", "04_ferries.md"]


def read_docs(names=DOC_FILES):
    from llama_index.core import SimpleDirectoryReader

    files = [str(DATA / n) for n in names]
    return SimpleDirectoryReader(input_files=files, file_metadata=lambda p: {"source": Path(p).name}).load_data()


def splitter():
    from llama_index.core.node_parser import SentenceSplitter

    return SentenceSplitter(chunk_size=200, chunk_overlap=0)


