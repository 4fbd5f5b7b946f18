"""Quantized weights (kvrag.kv.quant): the int4 / int8 products, their routing, the output head's form, the
default rule and the loading options. ``full`` == ``model.generate`` on quantized tiny models is in test_engine.py,
on the quantized default model in tests/integration."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.kv import quant
from kvrag_testing.tiny import FAMILIES, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

def _q41_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight made of GGUF Q4_1-style blocks (w = d * q + m per 32 columns, q in 0..15 with 0 and 15 attained),
    with d and m on the bfloat16 grid, as the embedded default's dequantized weights are on the float16 grid."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    m = (-8 * d + torch.randn(n, k // 32, 1, generator=g) * 1e-3).to(torch.bfloat16).float()
    m = (m + 8 * d).to(torch.bfloat16).float() - 8 * d  # zero = m + 8 d representable in bf16
    return (d * q + m).reshape(n, k)


def test_int4_groups_recover_q41_blocks_exactly() -> None:
    w = _q41_weight(48, 96)
    q, scale, zero = quant.int4_groups(w)
    assert q.min() >= 0 and q.max() <= 15 and scale.dtype == zero.dtype == torch.bfloat16
    torch.testing.assert_close(quant.int4_dequantize(q, scale, zero), w, rtol=0, atol=1e-6)


def test_int4_groups_error_is_bounded_on_random_weights() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    q, scale, zero = quant.int4_groups(w)
    err = (quant.int4_dequantize(q, scale, zero) - w).abs()
    # half a step of each group's 16 levels (+ the bf16 rounding of the group's scale and zero)
    step = scale.float().repeat_interleave(32, dim=1)
    assert bool((err <= 0.5 * step * 1.02 + 1e-3 * w.abs()).all())


@pytest.mark.parametrize("mode", quant.MODES)
def test_short_inputs_take_the_quantized_product_and_long_ones_the_dense(mode: str) -> None:
    lin = torch.nn.Linear(96, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_q41_weight(48, 96))
    dense = lin.weight.detach().clone()
    assert quant.quantize_linears(lin, mode) == 1 and quant.quantization_of(lin) == mode
    assert quant.quantize_linears(lin, mode) == 0  # idempotent
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for rows in (1, 3, quant.MAX_ROWS):
            x = torch.randn(rows, 96, generator=g)
            got = lin(x)
            ref = F.linear(x.to(torch.bfloat16).float(), dense, lin.bias)  # the kernel's bf16 activations
            assert got.dtype == torch.float32 and got.shape == (rows, 48)
            tol = 2e-2 if mode == "int8" else 1e-2  # int8: per-channel rounding; int4: bf16 output rounding
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
            assert not torch.equal(got, F.linear(x, dense, lin.bias))  # really the quantized route
        x = torch.randn(quant.MAX_ROWS + 1, 96, generator=g)
        assert torch.equal(lin(x), F.linear(x, dense, lin.bias))  # prefill-sized: the dense weight, exactly
        x3 = torch.randn(2, 3, 96, generator=g)  # leading dims are kept
        assert lin(x3).shape == (2, 3, 48)


def test_a_changed_weight_is_never_served_from_the_stale_copy() -> None:
    lin = torch.nn.Linear(64, 32, bias=False)
    quant.quantize_linears(lin, "int4")
    with torch.no_grad():
        lin.weight.mul_(2)  # in place: the quantized copy is now stale
    x = torch.randn(1, 64)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_bad_modes_and_devices_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="int4.*int8"):
        quant.parse_mode("int3")
    assert quant.parse_mode("none") is None and quant.parse_mode(None) is None and quant.parse_mode("INT4") == "int4"
    odd = torch.nn.Linear(40, 16)
    with pytest.raises(ConfigError, match="multiple of 32"):
        quant.quantize_linears(odd, "int4")
    meta = torch.nn.Linear(64, 8, device="meta")
    with pytest.raises(ConfigError, match="CPU only"):
        quant.quantize_linears(meta, "int8")


def test_fingerprints_separate_quantizations() -> None:
    fps = {q: tiny_model("llama", quantize=q).fingerprint for q in (None, "int4", "int8")}
    assert len(set(fps.values())) == 3
    assert tiny_model("llama").fingerprint == fps[None]  # dense fingerprints are unchanged by the feature


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_decode_stays_close_to_dense(family: str) -> None:
    """The quantized products change a decode step's logits by about the weights' rounding, not more."""
    dense, q4 = tiny_model(family), tiny_model(family, quantize="int4")
    ids = torch.tensor([list(range(5, 45))])
    with torch.inference_mode():
        cache = DynamicCache(config=dense.model.config)
        dense.model(input_ids=ids, cache=cache, use_cache=True)
        ref = dense.model(input_ids=torch.tensor([[50]]), cache=cache, use_cache=True).logits[0, -1]
        cache = DynamicCache(config=q4.model.config)
        q4.model(input_ids=ids, cache=cache, use_cache=True)  # prefill-sized: dense products, the same cache
        got = q4.model(input_ids=torch.tensor([[50]]), cache=cache, use_cache=True).logits[0, -1]
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    assert 0 < float((p.exp() * (p - q)).sum()) < 1e-3


def test_the_output_head_keeps_q8_0_blocks_to_bf16_precision() -> None:
    """The LM head's 8-bit groups (two int4 products) reproduce a Q8_0-style weight (w = d q, q in -127..127) to
    within the kernel's bfloat16 rounding -- about what a bf16 copy of the weight loses, far less than per-channel
    int8 (torch's int8 kernel) loses."""
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (64, 4, 32), generator=g)
    q[..., 0] = 127
    d = (torch.rand(64, 4, 1, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    w = (d * q).reshape(64, 128)
    step = d.expand(64, 4, 32).reshape(64, 128)
    eye = torch.eye(128, dtype=torch.bfloat16)

    def err(weight: object) -> torch.Tensor:  # |W e_j - w_j| in units of the block's step d
        return (weight.mm(eye).float().t() - w).abs() / step  # type: ignore[attr-defined]

    groups, per_channel = err(quant._Int8Groups(w)), err(quant._Int8(w))
    bf16_copy = (w.to(torch.bfloat16).float() - w).abs() / step
    assert groups.max() < 1.0 and groups.mean() < 1.5 * bf16_copy.mean()
    assert per_channel.mean() > 3 * groups.mean()
    lm = tiny_model("llama", quantize="int4")
    assert isinstance(lm.model.get_output_embeddings()._kvrag_quant.qweight, quant._Int8Groups)
    assert isinstance(lm.model.model.layers[0].mlp.up_proj._kvrag_quant.qweight, quant._Int4)


def test_the_default_quantization_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag import models
    from kvrag.calibration import Calibration, DtypeCalibration

    cpu = torch.device("cpu")
    monkeypatch.delenv(models.QUANTIZE_ENV, raising=False)
    monkeypatch.setattr(models, "load_calibration", lambda kind=None: None)
    for flag, want in (("amx_bf16", "int4"), ("avx512_bf16", "int4"), (None, None)):
        monkeypatch.setattr(models, "cpu_native_bf16", lambda flag=flag: flag)
        assert models.default_quantize(cpu, torch.float32, gguf=True) == want
        assert models.default_quantize(cpu, torch.float32, gguf=False) is None  # a checkpoint stays dense
    assert models.default_quantize(torch.device("cuda"), torch.bfloat16, gguf=True) is None

    def dc(e2e: float) -> DtypeCalibration:
        return DtypeCalibration("float32", 1000.0, 50.0, {"stale": 0.1}, {"stale": e2e})

    cal = Calibration("cpu-x", "m", 1, {"float32": dc(1.0), "float32+int4": dc(2.0)})  # measured: dense faster
    assert cal.preferred_quantize("float32") == "none" and cal.preferred_dtype == "float32"
    assert cal.preferred_quantize("bfloat16") is None
    monkeypatch.setattr(models, "load_calibration", lambda kind=None: cal)
    monkeypatch.setattr(models, "cpu_native_bf16", lambda: "avx512_bf16")
    assert models.default_quantize(cpu, torch.float32, gguf=True) is None
    monkeypatch.setenv(models.QUANTIZE_ENV, "int8")
    assert models.default_quantize(cpu, torch.float32, gguf=True) == "int8"
    monkeypatch.setenv(models.QUANTIZE_ENV, "int5")
    with pytest.raises(ConfigError, match="KVRAG_QUANTIZE"):
        models.default_quantize(cpu, torch.float32, gguf=True)


def test_from_pretrained_and_open_engine_take_quantize(tmp_path) -> None:
    from llama_index.postprocessor.kvrag.persist import open_engine

    lm = tiny_model("qwen2")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    dense = KVRAGEngine.from_pretrained(str(tmp_path / "m"), quantize=None, dtype="float32")
    q8 = KVRAGEngine.from_pretrained(str(tmp_path / "m"), quantize="int8", dtype="float32")
    assert dense.loaded.quantize is None and q8.loaded.quantize == "int8"
    assert dense.loaded.fingerprint != q8.loaded.fingerprint  # caches never cross quantizations
    eng = open_engine(tmp_path / "idx", model=str(tmp_path / "m"), quantize="int4", dtype="float32")
    assert eng.loaded.quantize == "int4" and quant.quantization_of(eng.model) == "int4"
    with pytest.raises(ConfigError, match="quantize="):
        KVRAGEngine.from_pretrained(str(tmp_path / "m"), quantize="fp4")
