"""The package's import hygiene and public API."""

from __future__ import annotations

import subprocess
import sys


def test_import_kvrag_imports_no_optional_frameworks() -> None:
    code = (
        "import sys, kvrag, kvrag.distributed; kvrag.KVRAGEngine; kvrag.store_from_url; "
        "bad = [m for m in ('redis', 'llama_index', 'langchain_core', 'ray') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_all_names_resolve() -> None:
    import kvrag

    for name in kvrag.__all__:
        assert getattr(kvrag, name) is not None
