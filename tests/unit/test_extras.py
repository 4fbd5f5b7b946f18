"""The core's optional parts are extras (kvrag[faiss], [embed], [gguf], [train], [redis], [ray]): ``import kvrag``
works without any of them, and each place that needs one fails with an ImportError naming its extra.

A missing package is simulated with ``sys.modules[name] = None``, which makes ``import name`` raise ImportError
exactly as an uninstalled package does.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvrag import cli, default_model, models
from kvrag.index import Chunk, ChunkIndex, import_faiss

ROOT = Path(__file__).resolve().parents[2]
EXTRA_PACKAGES = ("faiss", "sentence_transformers", "gguf", "redis", "ray", "matplotlib")


def missing(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_import_kvrag_works_with_none_of_the_extras() -> None:
    block = "; ".join(f"sys.modules[{n!r}] = None" for n in (*EXTRA_PACKAGES, "llama_index", "langchain_core"))
    code = (f"import sys; {block}; import kvrag, kvrag.cli, kvrag.adapters, kvrag.index, kvrag.models, "
            "kvrag.engine.engine, kvrag.fusion, kvrag.store, kvrag.default_model, kvrag.repair.card; "
            "kvrag.cli.build_parser(); from kvrag import KVRAGEngine, load_model, MemoryStore; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_faiss_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing(monkeypatch, "faiss")
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[faiss\]'"):
        import_faiss()
    with pytest.raises(ImportError, match=r"kvrag\[faiss\]"):
        ChunkIndex.build([Chunk("a#0", "a", "text", 1)], object(), {})
    (tmp_path / "index.json").write_text("{}")
    with pytest.raises(ImportError, match=r"kvrag\[faiss\]"):
        ChunkIndex.load(tmp_path)


def test_sentence_transformers_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, "sentence_transformers")
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[embed\]'"):
        models.load_embedder()


def test_gguf_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The embedded default model's one-time conversion needs gguf; a converted model loads without it."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf)
    missing(monkeypatch, "gguf")
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[gguf\]'"):
        default_model.prepare_default_model(progress=False)
    assert not (tmp_path / "home" / "models" / default_model.DEFAULT_MODEL).exists()  # nothing half-written


def test_redis_and_ray_missing_name_their_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag import distributed
    from kvrag.store import redis as redis_store

    missing(monkeypatch, "redis", "ray")
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[redis\]'"):
        redis_store._import_redis()
    with pytest.raises(ImportError, match=r"pip install 'kvrag\[ray\]'"):
        distributed._import_ray()


def test_matplotlib_missing_leaves_the_card_without_a_curve_and_names_the_extra(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvrag.repair.card import plot_curve

    missing(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with caplog.at_level(logging.WARNING, logger="kvrag.repair.card"):
        assert plot_curve(tmp_path / "curve.jsonl", tmp_path / "curve.png") is None
    assert "pip install 'kvrag[train]'" in caplog.text
    assert not (tmp_path / "curve.png").exists()


@pytest.mark.parametrize(("package", "extra"), [("faiss", "faiss"), ("sentence_transformers", "embed")])
def test_cli_ingest_and_ask_fail_before_loading_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str], package: str,
                                                       extra: str) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Some text to index.")

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the missing extra was reported")

    monkeypatch.setattr(cli, "_engine", no_model)
    missing(monkeypatch, package)
    for argv in (["ingest", str(docs), "--persist", str(tmp_path / "idx")],
                 ["ask", "What?", "--persist", str(tmp_path / "idx")]):
        assert cli.main(argv) == 2
        assert f"pip install 'kvrag[{extra}]'" in capsys.readouterr().err


def test_core_pyproject_declares_the_extras_and_keeps_them_out_of_the_hard_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML in the standard library")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"])
    for pkg in ("faiss", "sentence-transformers", "gguf", "matplotlib", "redis", "ray", "llama-index", "langchain"):
        assert pkg not in deps, pkg
    extras = project["optional-dependencies"]
    assert {"faiss", "embed", "gguf", "train", "redis", "ray", "all", "dev"} <= set(extras)
    assert extras["faiss"][0].startswith("faiss-cpu") and extras["embed"][0].startswith("sentence-transformers")
    assert extras["gguf"][0].startswith("gguf") and extras["train"][0].startswith("matplotlib")
    for extra in ("faiss", "embed", "gguf", "train", "redis", "ray"):
        assert extra in extras["all"][0], extra
