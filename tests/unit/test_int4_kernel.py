"""kvrag's int4 kernel (kvrag.kv.int4_kernel): its arithmetic, row independence, the choice of path and fallbacks."""

from __future__ import annotations

import pytest
import torch

from kvrag.calibration import cpu_flags
from kvrag.kv import int4_kernel, native, quant

FLAG = {"amx": "amx_bf16", "avx512bf16": "avx512_bf16"}


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """The kernel path ``request.param`` loaded for this test alone (skipped where the CPU lacks it)."""
    name = request.param
    if FLAG[name] not in cpu_flags():
        pytest.skip(f"this CPU has no {FLAG[name]}")
    monkeypatch.setenv("KVRAG_INT4_KERNEL", name)
    int4_kernel._load.cache_clear()
    assert int4_kernel.path() == name, int4_kernel.why_not()
    yield name
    int4_kernel._load.cache_clear()


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quant.int4_groups(torch.randn(n, k, generator=gen) * 0.05)


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"], indirect=True)
@pytest.mark.parametrize(("n", "k"), [(48, 64), (1536, 576), (576, 1536), (208, 96)])
def test_product_matches_float32_arithmetic(kernel: str, n: int, k: int) -> None:
    q, scale, zero = _weight(n, k)
    packed = int4_kernel.pack(q, scale, zero)
    w = quant.int4_dequantize(q, scale, zero)
    for m in (1, 5, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got = int4_kernel.mm(x, packed, n)
        exact = x.float() @ w.T
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # the bf16 output's own rounding (2^-8 relative) plus float32 sums: well inside 1% of the largest output
        assert (got.float() - exact).abs().max() <= 0.01 * exact.abs().max()
        theirs = torch._weight_int4pack_mm_for_cpu(  # torch's kernel on the same weight: the same numbers but
            x, torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1), 32,  # for the last bit now and then
            torch.stack([scale, zero], -1).transpose(0, 1).contiguous())
        assert int((got != theirs).sum()) <= max(2, got.numel() // 100)


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"], indirect=True)
def test_a_row_is_the_same_bits_in_any_batch_and_thread_split(kernel: str) -> None:
    n, k = 1536, 576
    q, scale, zero = _weight(n, k, seed=1)
    packed = int4_kernel.pack(q, scale, zero)
    x = (torch.randn(16, k) * torch.rand(16, k) * 4).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = int4_kernel.mm(x, packed, n)
        for m in range(1, 17):
            assert torch.equal(int4_kernel.mm(x[:m].contiguous(), packed, n), batch[:m]), f"{m} rows"
        for i in (0, 7, 15):
            assert torch.equal(int4_kernel.mm(x[i : i + 1].contiguous(), packed, n), batch[i : i + 1])
        torch.set_num_threads(2)
        assert torch.equal(int4_kernel.mm(x, packed, n), batch)
        assert torch.equal(int4_kernel.mm(x[3:11].contiguous(), packed, n), batch[3:11])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"], indirect=True)
def test_quantized_linear_takes_the_kernel_and_the_fingerprint_says_so(kernel: str) -> None:
    lin = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    quant.quantize_linears(torch.nn.Sequential(lin), "int4")
    state = lin._kvrag_quant
    assert state.qweight.scales_zeros is None  # kvrag's layout
    x = torch.randn(3, 64).to(torch.bfloat16)
    q, scale, zero = quant.int4_groups(lin.weight)
    expect = int4_kernel.mm(x, int4_kernel.pack(q, scale, zero), 32) + lin.bias.detach()
    with torch.no_grad():
        assert torch.equal(lin(x), expect)
    assert quant.quant_tag("int4") == f"int4+kvrag-{kernel}"
    assert quant.quant_tag(None) is None


def test_torch_kernel_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRAG_INT4_KERNEL", "torch")
    int4_kernel._load.cache_clear()
    try:
        assert int4_kernel.path() is None and int4_kernel.why_not() == "KVRAG_INT4_KERNEL=torch"
        assert quant.quant_tag("int4") == "int4" and int4_kernel.tag() == "torch"
        lin = torch.nn.Linear(64, 32, bias=False)
        quant.quantize_linears(torch.nn.Sequential(lin), "int4")
        assert lin._kvrag_quant.qweight.scales_zeros is not None  # torch's layout
    finally:
        int4_kernel._load.cache_clear()


def test_a_bad_setting_or_a_missing_path_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRAG_INT4_KERNEL", "fast")
    int4_kernel._load.cache_clear()
    try:
        assert int4_kernel.path() is None
        assert "KVRAG_INT4_KERNEL='fast' is not a setting" in int4_kernel.why_not()
        monkeypatch.setenv("KVRAG_INT4_KERNEL", "amx")
        monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2"}))
        int4_kernel._load.cache_clear()
        assert int4_kernel.path() is None and "lacks it" in int4_kernel.why_not()
        monkeypatch.setenv("KVRAG_INT4_KERNEL", "auto")
        int4_kernel._load.cache_clear()
        assert int4_kernel.path() is None and "neither AMX nor AVX512-BF16" in int4_kernel.why_not()
        if "avx512_bf16" in cpu_flags():  # auto takes the best path the CPU has
            monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
            int4_kernel._load.cache_clear()
            assert int4_kernel.path() == "avx512bf16", int4_kernel.why_not()
    finally:
        int4_kernel._load.cache_clear()


def test_no_compiler_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("KVRAG_INT4_KERNEL", "avx512bf16")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    int4_kernel._load.cache_clear()
    try:
        assert int4_kernel.path() is None and "no-such-cc" in int4_kernel.why_not()
    finally:
        int4_kernel._load.cache_clear()


def test_pack_refuses_shapes_off_the_tiles() -> None:
    q, scale, zero = _weight(48, 64)
    with pytest.raises(ValueError, match="multiple of 16 outputs and 32 inputs"):
        int4_kernel.pack(q[:40], scale[:40], zero[:40])


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"], indirect=True)
def test_float32_rows_give_the_bits_of_converting_around_the_bfloat16_product(kernel: str) -> None:
    n, k = 208, 96  # 13 output tiles: a remainder past the paths' groups of tiles (3 for AMX, 4 or 2 otherwise)
    q, scale, zero = _weight(n, k, seed=2)
    packed = int4_kernel.pack(q, scale, zero)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k, generator=gen) * torch.logspace(-40, 3, k)  # subnormals to large, both signs
        x[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3.3895e38])  # and what rounds up
        got = int4_kernel.mm(x, packed, n)
        assert got.dtype == torch.float32 and bool(torch.isfinite(got[1:]).all())
        bits = got.view(torch.int32)  # bit for bit, the NaNs the infinities make in row 0 included
        assert torch.equal(bits, int4_kernel.mm(x.to(torch.bfloat16), packed, n).float().view(torch.int32))
        assert torch.equal(bits[1:], int4_kernel.mm(x[1:].contiguous(), packed, n).view(torch.int32))


@pytest.mark.parametrize("kernel", ["amx", "avx512bf16"], indirect=True)
def test_a_float32_models_products_skip_the_casts_and_keep_their_bits(kernel: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 208)
    assert quant.quantize_linears(lin, "int4") == 1 and lin._kvrag_quant.qweight.takes_float32
    x = torch.randn(5, 96)
    with torch.inference_mode():
        got = lin(x)
        expected = lin._kvrag_quant.qweight.mm(x.to(torch.bfloat16)).float() + lin.bias
    assert got.dtype == torch.float32 and torch.equal(got, expected)
