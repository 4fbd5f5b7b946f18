"""Bring your own model as a GGUF file: a tiny random Llama written with the ``gguf`` library loads by path.

The file is written the way llama.cpp's converter lays a Llama out (kvrag_testing.tiny_gguf); loading it by path
converts it once into KVRAG_HOME/models/<stem>-<sha256 prefix>/ and must reproduce the tiny model bit for bit. A
GGUF of an unsupported architecture, RoPE or quantization type is refused by name before any conversion.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag import KVRAGEngine, default_model
from kvrag.config import GenerationConfig
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


@pytest.mark.parametrize("head_size", [True, False])
def test_a_gemma2_gguf_loads_with_the_attention_its_family_takes(home: Path, tmp_path: Path, head_size: bool) -> None:
    """Gemma 2 runs eager attention (transformers refuses SDPA for its soft-capping): its GGUF's one-time
    preparation loaded it with SDPA and every Gemma 2 file failed with transformers' ValueError. A file without
    attention.key_length has heads of hidden size / heads, as llama.cpp reads it (not Gemma 2's class default, 256:
    a size-mismatch error)."""
    from kvrag.kv.attention import attention_implementation

    tiny2 = tiny_model("gemma2", init_std=0.1, sliding_window=8)
    with torch.no_grad():  # llama.cpp's Gemma 2 reads its output from the token embeddings
        tiny2.model.lm_head.weight.copy_(tiny2.model.get_input_embeddings().weight)
    gguf = write_tiny_gguf(tmp_path / "tiny-gemma2.F32.gguf", tiny2, head_size=head_size)
    eng = KVRAGEngine.from_pretrained(str(gguf), dtype="float32", device="cpu")
    lm = eng.loaded
    assert lm.config.model_type == "gemma2"
    assert attention_implementation(lm.config) == "eager" == lm.model.config._attn_implementation
    ids = torch.tensor([tiny2.tokenizer(TEXT)["input_ids"]])
    assert len(ids[0]) > 8  # past the window: the sliding layers' mask is read from the file
    torch.testing.assert_close(_logits(lm, ids), _logits(tiny2, ids), rtol=1e-5, atol=1e-5)  # norms' 1 + w
    out = eng.answer(TEXT, method="full", gen=GenerationConfig(max_new_tokens=4))
    ref = lm.model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref


@pytest.mark.parametrize("damage", ["config.json", "tokenizer.json"])
def test_a_damaged_prepared_folder_says_to_delete_it(tiny, home: Path, tmp_path: Path, damage: str) -> None:
    """A prepared folder with a file cut short or deleted failed with transformers' or the Hub's words ("expected a
    Hugging Face model id", "Couldn't instantiate the backend tokenizer"); deleting the folder mends it."""
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.F32.gguf", tiny)
    load_model(str(gguf), dtype="float32", device="cpu")
    (folder,) = [p for p in (home / "models").iterdir() if p.is_dir()]
    if damage == "config.json":
        (folder / damage).write_text((folder / damage).read_text()[:20])
    else:
        (folder / damage).unlink()
    with pytest.raises(ConfigError, match=f"{re.escape(str(folder))}, looks damaged: delete it and load again") as e:
        load_model(str(gguf), dtype="float32", device="cpu")
    assert "Hugging Face model id" not in str(e.value) and str(e.value).count("delete it") == 1
    shutil.rmtree(folder)
    assert load_model(str(gguf), dtype="float32", device="cpu").config.model_type == "llama"


def test_a_float_gguf_stays_as_published_unless_asked(tiny, home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """kvrag's default int4 route is the file's own 4-bit blocks; a float GGUF has none, and its weights were
    re-quantized to int4 on machines whose default is int4. Asked for (quantize="int4"), they still are."""
    from kvrag import models

    monkeypatch.delenv(models.QUANTIZE_ENV, raising=False)
    monkeypatch.setattr(models, "default_quantize", lambda *a, **k: "int4")  # the default on a bf16-native CPU
    path = write_tiny_gguf(tmp_path / "tiny-llama.F16.gguf", tiny, quantization="F16")
    lm = models.load_model(str(path), dtype="float32", device="cpu")
    assert lm.quantize is None
    assert not any(getattr(m, "_kvrag_quant", None) for m in lm.model.modules())
    asked = models.load_model(str(path), dtype="float32", device="cpu", quantize="int4")
    assert asked.quantize == "int4" and asked.fingerprint != lm.fingerprint
    quantized = models.load_model(str(write_tiny_gguf(tmp_path / "tiny-llama.Q8_0.gguf", tiny, quantization="Q8_0")),
                                  dtype="float32", device="cpu")
    assert quantized.quantize == "int4"  # the file's own blocks


def test_a_llama3_rope_freqs_tensor_becomes_the_configs_rope_scaling(tiny, home: Path, tmp_path: Path) -> None:
    """llama.cpp writes Llama 3.x's RoPE scaling as the tensor rope_freqs.weight, which transformers' GGUF reader
    ignores: such a file loaded as plain RoPE, another model. kvrag reads it back as the llama3 parameters."""
    from transformers import LlamaForCausalLM

    from kvrag import gguf_rope
    from kvrag.errors import UnsupportedModelError
    from kvrag.models import load_model

    config = tiny.model.config
    base, dim = float(config.rope_parameters["rope_theta"]), config.head_dim
    divisors = gguf_rope.llama3_divisors(base, dim, 8.0, 1.0, 4.0, 8192)
    assert 1.0 < divisors.max() and divisors.min() == 1.0 and len(set(divisors.tolist())) > 2  # all three regimes
    path = write_tiny_gguf(tmp_path / "tiny-llama31.gguf", tiny, extra={gguf_rope.ROPE_FREQS: divisors})
    lm = load_model(str(path), dtype="float32", device="cpu", quantize=None)
    params = lm.model.config.rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    ref_config = type(config).from_dict({**config.to_dict(), "rope_parameters": dict(params)})
    ref = LlamaForCausalLM(ref_config).model.rotary_emb.inv_freq
    assert torch.allclose(lm.model.model.rotary_emb.inv_freq, ref)
    assert not torch.allclose(ref, tiny.model.model.rotary_emb.inv_freq)  # the scaling changes the positions
    odd = write_tiny_gguf(tmp_path / "tiny-odd.gguf", tiny, extra={gguf_rope.ROPE_FREQS: divisors[::-1].copy()})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_model(str(odd), dtype="float32", device="cpu", quantize=None)


def test_a_gguf_without_its_suffix_is_read_as_one(tiny, home: Path, tmp_path: Path) -> None:
    """Ollama keeps its models as blobs/sha256-<digest>: a GGUF file is known by its magic bytes too."""
    from kvrag.default_model import is_gguf_path
    from kvrag.models import load_model

    blob = tmp_path / "blobs" / "sha256-3bc7f0e1"
    blob.parent.mkdir()
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny).rename(blob)
    assert is_gguf_path(blob) and not is_gguf_path(tmp_path) and not is_gguf_path(tmp_path / "missing")
    lm = load_model(str(blob), dtype="float32", device="cpu", quantize=None)
    ids = torch.tensor([tiny.tokenizer(TEXT)["input_ids"]])
    assert torch.equal(_logits(lm, ids), _logits(tiny, ids))


def test_an_unwritable_home_is_named(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag.models import load_model

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "a-file" / "home"))  # under a file: cannot be created
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny)
    with pytest.raises(ConfigError, match="KVRAG_HOME to a writable directory"):
        load_model(str(path), dtype="float32", device="cpu")


def test_one_part_of_a_split_gguf_says_to_merge(tiny, home: Path, tmp_path: Path) -> None:
    from kvrag.models import load_model

    part = write_tiny_gguf(tmp_path / "tiny-00001-of-00002.gguf", tiny, header={"split.count": 2})
    with pytest.raises(ConfigError, match="one of 2 parts of a split GGUF.*llama-gguf-split --merge"):
        load_model(str(part), dtype="float32", device="cpu")


@pytest.mark.parametrize(("header", "expected"), [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 256},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
])
def test_the_headers_rope_scaling_becomes_the_configs(tiny, home: Path, tmp_path: Path, header: dict[str, Any],
                                                      expected: dict[str, Any]) -> None:
    """llama.cpp writes linear (Gemma 3 4B-27B) and YaRN (long-context Qwen2.5) RoPE scaling as header keys, which
    transformers' GGUF reader read for gpt-oss only: such files loaded as plain-RoPE models, other models."""
    path = write_tiny_gguf(tmp_path / "tiny-scaled.gguf", tiny, header=header)
    lm = load_model(str(path), dtype="float32", device="cpu", quantize=None)
    params = lm.model.config.rope_parameters
    assert {k: params[k] for k in expected} == expected
    assert not torch.allclose(lm.model.model.rotary_emb.inv_freq, tiny.model.model.rotary_emb.inv_freq) or \
        expected["rope_type"] == "yarn"  # linear divides the frequencies; YaRN scales them by band
    ids = torch.tensor([tiny.tokenizer(TEXT)["input_ids"]])
    assert not torch.equal(_logits(lm, ids), _logits(tiny, ids))  # another model than the unscaled one


def test_a_rope_scaling_kvrag_cannot_read_is_refused(tiny, home: Path, tmp_path: Path) -> None:
    from kvrag.models import load_model

    path = write_tiny_gguf(tmp_path / "tiny-longrope.gguf", tiny,
                           header={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(str(path), dtype="float32", device="cpu")


def test_the_no_repairer_hint_names_the_gguf_file(tiny, home: Path, tmp_path: Path) -> None:
    """The hint named the prepared folder (config.name_or_path), which holds no weights: the command failed."""
    path = write_tiny_gguf(tmp_path / "mine.gguf", tiny)
    eng = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize=None)
    eng.ingest(["\n\nA day pass costs 9 marks."])
    with pytest.raises(ConfigError, match=f"--model {re.escape(str(path))} "):
        eng.answer("Context:\n\nA day pass costs 9 marks.\n\nQ: cost?", ["\n\nA day pass costs 9 marks."],
                   "cacherepair", max_new_tokens=1)


def test_a_head_size_other_than_hidden_over_heads_loads(tiny, home: Path, tmp_path: Path) -> None:
    """A Llama file whose heads are not hidden size / heads wide (Mistral Nemo: 5120 / 32 heads, heads of 128)
    loads with the file's head size (``{arch}.attention.key_length``, as llama.cpp reads it) and reproduces the
    model bit for bit."""
    from transformers import AutoModelForCausalLM

    from kvrag_testing.tiny import wrap_model

    config = tiny.model.config.__class__.from_dict({**tiny.model.config.to_dict(), "head_dim": 32})
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    wide = wrap_model(model, tiny.tokenizer, name="tiny-wide-heads", dtype=torch.float32)
    path = write_tiny_gguf(tmp_path / "tiny-wide-heads.gguf", wide,
                           header={"llama.attention.key_length": 32, "llama.attention.value_length": 32})
    lm = load_model(str(path), dtype="float32", device="cpu")
    assert lm.config.head_dim == 32
    ids = torch.tensor([tiny.tokenizer(TEXT)["input_ids"]])
    assert torch.equal(_logits(lm, ids), _logits(wide, ids))


def test_the_header_sets_the_head_size_and_gemma_27bs_query_scaling_as_llama_cpp_does() -> None:
    """llama.cpp scales a 27B Gemma's queries by hidden size / heads (by layer count: 46 for Gemma 2, 62 for Gemma 3),
    every other size by the head size (transformers' configs default to 256); it takes the head size from
    ``{arch}.attention.key_length``, which transformers' reader leaves out for Qwen3."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, Gemma3TextConfig, Qwen3Config

    from kvrag.gguf_attention import apply_attention_shape

    def reader(arch: str, **keys: int) -> Any:
        fields = {"general.architecture": arch, **{f"{arch}.attention.{k}": v for k, v in keys.items()}}
        return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()})

    cases = [(Gemma3TextConfig, "gemma3", 62, 5376, 32, 128, 168), (Gemma3TextConfig, "gemma3", 26, 1152, 4, 256, 256),
             (Gemma2Config, "gemma2", 46, 4608, 32, 128, 144), (Gemma2Config, "gemma2", 42, 3584, 16, 256, 256)]
    for cls, arch, layers, hidden, heads, head, scalar in cases:
        config = cls(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                     head_dim=head)
        apply_attention_shape(reader(arch, key_length=head, value_length=head), config, "m.gguf")
        assert (config.head_dim, config.query_pre_attn_scalar) == (head, scalar), (arch, layers)
    qwen3 = Qwen3Config()  # transformers reads no head size for Qwen3: the class default, 128
    apply_attention_shape(reader("qwen3", key_length=64, value_length=64), qwen3, "m.gguf")
    assert qwen3.head_dim == 64
    with pytest.raises(UnsupportedModelError, match="keys of 192 and values of 128"):
        apply_attention_shape(reader("llama", key_length=192, value_length=128), cases[0][0](), "m.gguf")


def test_a_renamed_gguf_reuses_its_prepared_folder(tiny, home: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file renamed after its first load is recognised by its content (sha256) instead of prepared again, and from
    then on found by its new path without hashing (seconds for a multi-GB file)."""
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.gguf", tiny)
    target = default_model.prepare_gguf(gguf, progress=False)
    renamed = gguf.rename(tmp_path / "my-assistant.gguf")

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("prepared again")

    monkeypatch.setattr(default_model, "_convert_gguf", no_conversion)
    assert default_model.prepare_gguf(renamed, progress=False) == target
    monkeypatch.setattr(default_model, "_sha256_file", lambda *a: (_ for _ in ()).throw(AssertionError("hashed")))
    assert default_model.prepare_gguf(renamed, progress=False) == target
    lm = load_model(str(renamed), dtype="float32", device="cpu")
    ids = torch.tensor([tiny.tokenizer(TEXT)["input_ids"]])
    assert torch.equal(_logits(lm, ids), _logits(tiny, ids))
