"""The examples run as written: both quickstarts, the chatbot notebook (nbclient) and ``make demo``'s entry point.
(README.md's own code blocks are run by ``test_readme.py``.)

They share one persist dir (index + chunk caches), as a user's repeated runs would: the first example builds the
LlamaIndex index and caches, the notebook and the demo reload them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
Q = "How much does a day pass cost?"

pytest.importorskip("llama_index.llms.kvrag", reason="integration packages not installed")


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("examples")
    old = os.environ.get("KVRAG_EXAMPLE_DIR")
    os.environ["KVRAG_EXAMPLE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("KVRAG_EXAMPLE_DIR", None)
    else:
        os.environ["KVRAG_EXAMPLE_DIR"] = old


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sample_documents():
    docs = sorted((EXAMPLES / "data").glob("*.md"))
    assert 5 <= len(docs) <= 8
    for d in docs:
        assert 300 <= len(d.read_text(encoding="utf-8").split()) <= 600, d.name


def test_llamaindex_quickstart(example_dir, capsys):
    load_example("llamaindex_quickstart").main(["--question", Q, "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "built the index" in out and "hit_rate=1.00" in out
    assert (example_dir / "llamaindex" / "kvcache").is_dir()


def test_langchain_quickstart(example_dir, capsys):
    load_example("langchain_quickstart").main(["--question", Q, "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "hit_rate=1.00" in out and "batch:" in out


def test_chatbot_notebook(example_dir):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(EXAMPLES / "chatbot.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "bot:" in text and "hit rate 1.00" in text
    assert "chunks," in text


def test_demo_main(example_dir, capsys):
    demo = load_example("demo")

    methods, _notes = demo.pick_methods(None)
    assert methods[:2] == ["full", "stale"]
    rc = demo.main(["--persist", str(example_dir / "llamaindex"), "--methods", "full,stale", "--question", Q,
                    "--max-new-tokens", "8", "--hf-baseline"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "reloaded the index" in out
    for label in ("full", "stale", "HuggingFaceLLM", "TTFT e2e", "hit rate", "same answer as full", "vs full"):
        assert label in out
    # says what the default model is, what its answers show, and how to rerun with another model (last line)
    assert "SmolLM2-135M-Instruct (135M parameters, from a 4-bit Q4_1 GGUF)" in out
    assert "not answer quality" in out and demo.SAME_AS_FULL_NOTE in out
    assert out.strip().splitlines()[-1].endswith(demo.RERUN_WITH_YOUR_MODEL)


def test_demo_runs_on_a_gguf_file(tmp_path, capsys, monkeypatch):
    """`make demo MODEL=path/to/model.gguf`: the same demo on a GGUF the user brings (here a tiny random Llama)."""
    pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")
    from kvrag_testing.tiny import tiny_model
    from kvrag_testing.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "my-model.gguf", tiny_model("llama"))
    demo = load_example("demo")
    assert demo.persist_dir_for(str(gguf)).name == "llamaindex-my-model.gguf"
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    rc = demo.main(["--model", str(gguf), "--methods", "full,stale", "--question", Q, "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"model: {gguf}" in out and "SmolLM2" not in out
    assert "indexed" in out and "same answer as full" in out

