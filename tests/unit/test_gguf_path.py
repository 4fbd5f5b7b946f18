"""Bring your own model as a GGUF file: a tiny random Llama written with the ``gguf`` library loads by path.

The file is written the way llama.cpp's converter lays a Llama out (kvrag_testing.tiny_gguf); loading it by path
converts it once into KVRAG_HOME/models/<stem>-<sha256 prefix>/ and must reproduce the tiny model bit for bit. A
GGUF of an unsupported architecture, RoPE or quantization type is refused by name before any conversion.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvrag import KVRAGEngine, default_model
from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.models import load_model
from kvrag_testing.tiny import tiny_model
from kvrag_testing.tiny_gguf import write_tiny_gguf, write_unsupported_gguf

pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "The capital of France is Paris. Question: What is the capital of France? Answer:"


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny() -> object:
    return tiny_model("llama", init_std=0.1)


def _logits(lm: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(input_ids=ids).logits  # type: ignore[attr-defined]


def test_gguf_file_loads_by_path_and_matches_the_model(tiny, home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.F32.gguf", tiny)
    eng = KVRAGEngine.from_pretrained(str(gguf), dtype="float32", device="cpu")
    lm = eng.loaded
    assert lm.name == str(gguf) and lm.dtype == torch.float32 and lm.config.model_type == "llama"
    # the tokenizer came from the GGUF's tokenizer.ggml.* metadata: same ids, same chat template
    assert lm.tokenizer(TEXT)["input_ids"] == tiny.tokenizer(TEXT)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    assert lm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tiny.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tiny.tokenizer(TEXT)["input_ids"]])
    assert torch.equal(_logits(lm, ids), _logits(tiny, ids))  # float32 tensors, q/k un-permuted: bit-identical

    # converted once into models/<stem>-<sha256[:12]>, with the marker written last
    sha = default_model._sha256_file(gguf)
    target = home / "models" / f"tiny-llama.F32-{sha[:12]}"
    assert target == default_model.gguf_checkpoint_dir(gguf, sha)
    assert not list(target.glob("*.safetensors"))  # only what the file lacks: config, tokenizer, tensor table
    marker = json.loads((target / default_model._MARKER).read_text())
    assert marker["gguf_sha256"] == sha and marker["gguf_path"] == str(gguf.resolve())
    assert marker["gguf_architecture"] == "llama" and marker["gguf_quantizations"] == ["F32"]
    assert not [p for p in target.parent.iterdir() if ".tmp-" in p.name]

    # full through the engine generates what model.generate does on the same prompt
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False,
                                              add_generation_prompt=True)
    resp = eng.answer(prompt, method="full", max_new_tokens=6)
    p_ids = torch.tensor([lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = tiny.model.generate(p_ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(p_ids))
    assert resp.text == lm.tokenizer.decode(out[0, p_ids.shape[1]:], skip_special_tokens=True)

    # later loads reuse the conversion (found by path, size and mtime), and so does the same file moved to another
    # folder (found by its sha256)
    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "_convert_gguf", no_conversion)
    assert default_model.prepare_gguf(gguf, progress=False) == target
    (tmp_path / "moved").mkdir()
    moved = Path(shutil.move(gguf, tmp_path / "moved" / gguf.name))
    assert default_model.prepare_gguf(moved, progress=False) == target
    # ... and from then on the moved file is found by its path again, not hashed on every load (seconds for GBs)
    monkeypatch.setattr(default_model, "_sha256_file", lambda *a: (_ for _ in ()).throw(AssertionError("hashed")))
    assert default_model.prepare_gguf(moved, progress=False) == target


def test_open_engine_and_cli_take_a_gguf_path(tiny, home: Path, tmp_path: Path, capsys) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny)
    from kvrag.cli import main

    assert main(["pull", str(gguf)]) == 0
    assert "loads fine" in capsys.readouterr().out
    persist = pytest.importorskip("llama_index.postprocessor.kvrag.persist", reason="LlamaIndex adapter not installed")
    engine = persist.open_engine(tmp_path / "idx", model=str(gguf), dtype="float32", device="cpu")
    assert engine.loaded.name == str(gguf) and engine.loaded.config.model_type == "llama"


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"architecture": "rwkv6"}, "architecture 'rwkv6' is not supported"),
    ({"quantization": "Q8_1"}, "quantization type Q8_1 is not supported"),
    ({"architecture": "gpt2"}, "no rotary position embeddings"),
], ids=["architecture", "quantization", "no-rope"])
def test_unsupported_gguf_is_refused_by_name(kwargs: dict, named: str, home: Path, tmp_path: Path) -> None:
    gguf = write_unsupported_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(UnsupportedModelError, match=named):
        KVRAGEngine.from_pretrained(str(gguf), device="cpu")
    models = home / "models"
    written = [p.name for p in models.iterdir() if not p.name.endswith(".lock")] if models.exists() else []
    assert written == []


def test_bad_gguf_paths_say_what_to_pass(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no GGUF file at"):
        load_model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a GGUF file")
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        load_model(str(junk))
    folder = tmp_path / "lmstudio"
    folder.mkdir()
    (folder / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"holds GGUF files but no config\.json: pass a file's path"):
        load_model(str(folder))


def test_a_conversion_parses_the_file_once_and_leaves_gguf_as_it_was(tiny, home: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf as gguf_pkg

    from kvrag.gguf_reading import parsed_once

    path = write_tiny_gguf(tmp_path / "tiny-llama.F32.gguf", tiny)
    original_reader, original_names = gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map
    parses: list[str] = []
    real_init = original_reader.__init__

    def counting_init(self: object, path: object, mode: str = "r") -> None:
        parses.append(str(path))
        real_init(self, path, mode)

    monkeypatch.setattr(original_reader, "__init__", counting_init)
    with parsed_once():
        a, b = gguf_pkg.GGUFReader(path), gguf_pkg.GGUFReader(str(path))
        assert a is b and isinstance(a, original_reader) and len(parses) == 1
        assert gguf_pkg.get_tensor_name_map(gguf_pkg.MODEL_ARCH.LLAMA, 2) is \
            gguf_pkg.get_tensor_name_map(gguf_pkg.MODEL_ARCH.LLAMA, 2)
    assert (gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map) == (original_reader, original_names)
    assert gguf_pkg.GGUFReader(path) is not gguf_pkg.GGUFReader(path)  # outside: a plain reader each time
    parses.clear()
    load_model(str(path), dtype="float32", device="cpu")  # the conversion: config, tokenizer, weights, inspection
    assert len(parses) == 1, parses
    assert (gguf_pkg.GGUFReader, gguf_pkg.get_tensor_name_map) == (original_reader, original_names)
