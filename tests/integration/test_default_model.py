"""The real default model: one preparation of its GGUF (config, tokenizer) into a fresh KVRAG_HOME, then reuse.

The conversion runs once per module (module-scoped fixture); every test below shares it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvrag import default_model, models
from kvrag.kv.attention import IMPL as GQA_SDPA
from kvrag.paths import kvrag_home

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    home = tmp_path_factory.mktemp("kvrag_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRAG_HOME", str(home))
        t0 = time.perf_counter()
        path = default_model.prepare_default_model(progress=False)
        yield path, time.perf_counter() - t0


def test_conversion_writes_a_plain_checkpoint(prepared: tuple[Path, float]) -> None:
    path, seconds = prepared
    print(f"default-model conversion: {seconds:.1f} s")
    assert path == kvrag_home() / "models" / default_model.DEFAULT_MODEL
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)  # the weights stay in the GGUF file
    assert not any(n.startswith(".") and n != default_model._MARKER for n in names)
    assert not any(p.name.startswith(f".{default_model.DEFAULT_MODEL}.tmp") for p in path.parent.iterdir())
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    marker = default_model.default_model_marker()
    assert marker is not None
    assert marker["gguf_sha256"] == default_model._sha256_file(default_model.default_gguf_path())


def test_reload_gives_identical_logits(prepared: tuple[Path, float]) -> None:
    t0 = time.perf_counter()
    lm = models.load_model(device="cpu", dtype="float32", quantize=None)  # the digest is of dense float32 logits
    print(f"warm load: {time.perf_counter() - t0:.1f} s")
    assert lm.name == default_model.DEFAULT_MODEL and lm.dtype == torch.float32
    assert getattr(lm.model.config, "quantization_config", None) is None
    assert lm.model.config._attn_implementation == GQA_SDPA
    assert lm.rope_type == "default"
    # Bit-identical to the GGUF-loaded model: the conversion recorded the digest of its logits on PROBE_TEXT.
    logits = default_model.probe_logits(lm.model, lm.tokenizer)
    assert default_model.logits_digest(logits) == default_model.default_model_marker()["probe_logits_sha256"]
    text = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = lm.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = lm.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0, ids.shape[1] :])
    again = models.load_model(default_model.DEFAULT_MODEL, device="cpu", dtype="float32", quantize=None)
    assert (again.fingerprint, again.tokenizer_fingerprint) == (lm.fingerprint, lm.tokenizer_fingerprint)
    picked = models.load_model(device="cpu")  # the machine's default dtype and weights, keyed apart when they differ
    assert picked.dtype == models.resolve_dtype(None, torch.device("cpu"))
    assert picked.quantize == models.default_quantize(torch.device("cpu"), picked.dtype, gguf=True)
    assert (picked.fingerprint == lm.fingerprint) == (picked.dtype == torch.float32 and picked.quantize is None)
    q4 = picked if picked.quantize == "int4" else models.load_model(device="cpu", dtype="float32", quantize="int4")
    out = q4.model.generate(ids, max_new_tokens=8, do_sample=False)  # the file's own 4-bit blocks answer too
    assert "Paris" in q4.tokenizer.decode(out[0, ids.shape[1] :])


def test_second_prepare_reuses_the_checkpoint(prepared: tuple[Path, float], monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepared checkpoint is returned as it is: no conversion runs (one would raise here) and no file changes."""
    path, _ = prepared
    before = {f: f.stat().st_mtime_ns for f in path.rglob("*")}

    def no_conversion(*args: object, **kwargs: object) -> Path:
        raise AssertionError("prepare_default_model converted the GGUF again")

    monkeypatch.setattr(default_model, "_prepare", no_conversion)
    assert default_model.prepare_default_model(progress=False) == path
    assert {f: f.stat().st_mtime_ns for f in path.rglob("*")} == before
