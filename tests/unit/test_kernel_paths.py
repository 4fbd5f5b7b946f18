"""Every path of kvrag's C kernels, checked on every x86 CPU: the int4 product (AMX, AVX512-BF16 and the portable
plain-C path) and the one-token attention (the SIMD paths and the portable one, float32 and bfloat16), each against
torch's arithmetic; and the fused decode step's bfloat16 and int4 tests run through the portable paths, which is
how a CPU without AVX512-BF16 (an AVX2-only CI machine) checks the callers those tests cover. A SIMD path the CPU
lacks is skipped; the portable paths run everywhere (``KVRAG_ROW_ATTENTION=portable``,
``KVRAG_INT4_KERNEL=portable``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvrag.calibration import cpu_flags
from kvrag.kv import int4_kernel, native, row_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INT4_FLAG = {"amx": "amx_bf16", "avx512bf16": "avx512_bf16", int4_kernel.PORTABLE: None}


@pytest.fixture(params=list(INT4_FLAG))
def int4_lib(request: pytest.FixtureRequest) -> int4_kernel._Lib:
    flag = INT4_FLAG[request.param]
    if flag is not None and flag not in cpu_flags():
        pytest.skip(f"this CPU has no {flag}")
    lib = int4_kernel._Lib(request.param)
    int4_kernel._self_check(lib)
    return lib


def _int4_case(n: int = 96, k: int = 256, rows: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scale = (torch.rand(n, k // int4_kernel.GROUP, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    zero = (torch.randn(n, k // int4_kernel.GROUP, generator=gen) * 0.01).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen)
    return q, scale, zero, x


@pytest.mark.parametrize(("n", "k"), [(96, 256), (48, 576), (16, 32)])
def test_int4_product_is_the_float_product_rounded(int4_lib: int4_kernel._Lib, n: int, k: int) -> None:
    """Each output is the float32 product by the de-quantized weight (torch's arithmetic) rounded to bfloat16, or
    one bfloat16 step from it: the kernels' own sum order moves the last bit now and then (measured on every path:
    99.8-100% of the outputs equal, none further). A swapped nibble, group or tile layout is off by many steps."""
    q, scale, zero, x = _int4_case(n, k)
    xb = x.to(torch.bfloat16)
    ref = (xb.float() @ int4_kernel.dequantize(q, scale, zero).T).to(torch.bfloat16)
    out = int4_lib.mm(xb, int4_kernel.pack(q, scale, zero), n, 1)
    steps = (out.view(torch.int16).int() - ref.view(torch.int16).int()).abs()  # same signs: bf16 steps apart
    assert bool((torch.sign(out.float()) == torch.sign(ref.float())).all()) and steps.max().item() <= 1, steps.max()
    assert (steps == 0).float().mean().item() >= 0.99


def test_int4_rows_threads_and_float32_entry(int4_lib: int4_kernel._Lib) -> None:
    """A row's outputs do not depend on the other rows of its call nor on the thread split (bit for bit), and the
    float32 entry is the bfloat16 product of the rounded rows, widened (bit for bit, torch's conversions)."""
    q, scale, zero, x = _int4_case(96, 256)
    packed, xb = int4_kernel.pack(q, scale, zero), x.to(torch.bfloat16)
    full = int4_lib.mm(xb, packed, 96, 1)
    for m in (1, 3, 8, 9):
        assert torch.equal(int4_lib.mm(xb[:m].contiguous(), packed, 96, 3), full[:m])
    assert torch.equal(int4_lib.mm(x.contiguous(), packed, 96, 1), full.float())


ATTENTION = [(dt, mode) for dt in (torch.float32, torch.bfloat16) for mode in ("simd", "portable")]


@pytest.fixture
def attention_lib(request: pytest.FixtureRequest) -> Iterator[tuple[row_attention._Lib, torch.dtype]]:
    dtype, mode = request.param
    missing = [f for f in row_attention._NEEDS[(dtype, dtype)] if f not in cpu_flags()]
    if mode == "simd" and missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for the {dtype} SIMD path")
    lib = row_attention._Lib(portable=mode == "portable")
    try:
        yield lib, dtype
    finally:  # the process's own kernel (the same library) as this process's setting has it
        lib.portable(int(os.environ.get("KVRAG_ROW_ATTENTION", "").strip().lower() == "portable"))


def _attention_case(dtype: torch.dtype, heads: int, kv_heads: int, d: int, lengths: list[int],
                    seed: int = 0) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, int, int]]]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, heads, len(lengths), d, generator=gen) * 2).to(dtype)
    keys = [((torch.randn(kv_heads, n + 4, d, generator=gen)).to(dtype),
             torch.randn(kv_heads, n + 4, d, generator=gen).to(dtype), 2, n + 2) for n in lengths]
    return q, keys


@pytest.mark.parametrize("attention_lib", ATTENTION, indirect=True, ids=[f"{d}-{m}" for d, m in ATTENTION])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (8, 2, 128), (6, 2, 16), (5, 5, 40)])
def test_row_attention_is_torchs_attention(attention_lib: tuple[row_attention._Lib, torch.dtype], heads: int,
                                           kv_heads: int, d: int) -> None:
    """Each path against torch's SDPA in float64 on the same (rounded) inputs: within the output dtype's rounding
    (bfloat16: 2^-8 of the largest output, measured up to 0.78 of it -- the output's own rounding; float32: 2e-6,
    measured up to 9e-7 (SIMD) and 1.7e-7 (portable)). Wrong keys, a wrong head mapping or a skipped key are off
    by O(0.1)."""
    lib, dtype = attention_lib
    lengths = [1, 2, 17, 300]
    q, keys = _attention_case(dtype, heads, kv_heads, d, lengths, seed=heads * d)
    out = torch.empty(1, len(lengths), heads, d, dtype=dtype)
    row_attention._call(lib, q, keys, out, d**-0.5, 1)
    for i, (k, v, a, b) in enumerate(keys):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i : i + 1].double(), k[None, :, a:b].double(), v[None, :, a:b].double(), scale=d**-0.5,
            enable_gqa=True)[0, :, 0]
        err = (out[0, i].double() - ref).abs().max().item()
        bound = 2**-8 * ref.abs().max().item() if dtype == torch.bfloat16 else 2e-6
        assert err <= bound, (dtype, b - a, err, bound)


@pytest.mark.parametrize("attention_lib", ATTENTION, indirect=True, ids=[f"{d}-{m}" for d, m in ATTENTION])
def test_row_attention_entries_and_threads_do_not_change_an_entry(
        attention_lib: tuple[row_attention._Lib, torch.dtype]) -> None:
    """An entry's output does not depend on the other entries of its call nor on the thread split (bit for bit)."""
    lib, dtype = attention_lib
    lengths = [1, 33, 300, 7]
    q, keys = _attention_case(dtype, 6, 2, 64, lengths, seed=7)
    out = torch.empty(1, len(lengths), 6, 64, dtype=dtype)
    row_attention._call(lib, q, keys, out, 0.125, 3)
    for i in range(len(lengths)):
        alone = torch.empty(1, 1, 6, 64, dtype=dtype)
        row_attention._call(lib, q[:, :, i : i + 1], [keys[i]], alone, 0.125, 1)
        assert torch.equal(alone[0, 0], out[0, i])


def test_the_portable_switches_are_settings() -> None:
    """``portable`` is a setting of both variables (and a typo is refused naming the choices)."""
    env = {**os.environ, "KVRAG_ROW_ATTENTION": "portable", "KVRAG_INT4_KERNEL": "portable"}
    code = ("import torch; from kvrag.kv import int4_kernel, row_attention; "
            "print(int4_kernel.path(), row_attention.why_not(torch.bfloat16), row_attention.why_not(torch.float32))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["portable", "None", "None"], out.stdout + out.stderr
    env["KVRAG_INT4_KERNEL"] = "portabel"
    code = "from kvrag.kv import int4_kernel; print(int4_kernel.why_not())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=300)
    assert "portable" in out.stdout and "is not a setting" in out.stdout


def test_a_cpu_without_the_simd_paths_takes_the_portable_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2-only CPU: by default torch serves bfloat16 attention and int4 products (kvrag's SIMD paths need
    AVX512-BF16); with the portable settings kvrag's portable paths serve both."""
    avx2 = frozenset({"avx2", "fma", "sse4_2"})
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2)  # both loaders read the flags through native
    try:
        for env, served in (("auto", False), ("portable", True)):
            monkeypatch.setenv("KVRAG_ROW_ATTENTION", env)
            monkeypatch.setenv("KVRAG_INT4_KERNEL", env)
            row_attention._load.cache_clear()
            int4_kernel._load.cache_clear()
            assert (row_attention.why_not(torch.bfloat16) is None) == served, row_attention.why_not(torch.bfloat16)
            assert int4_kernel.path() == ("portable" if served else None), int4_kernel.why_not()
    finally:
        monkeypatch.undo()
        row_attention._load.cache_clear()
        int4_kernel._load.cache_clear()
        row_attention.why_not(torch.float32)  # the process's own settings again (resets the portable switch)
        row_attention.why_not(torch.bfloat16)


def test_fused_step_bf16_and_int4_tests_pass_through_the_portable_paths() -> None:
    """tests/unit/test_fused_step.py's bit-for-bit tests (bfloat16 and int4 among them, which skip where the SIMD
    paths cannot run) in a process whose row attention and int4 products take the portable paths: none skips."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KVRAG_ROW_ATTENTION": "portable", "KVRAG_INT4_KERNEL": "portable", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs",
         str(root / "tests" / "unit" / "test_fused_step.py"), "-k", "bit_for_bit or rope_attend or fused_products"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False)
    tail = res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
