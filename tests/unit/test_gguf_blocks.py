"""GGUF blocks resident in the model: kvrag's de-quantization against the ``gguf`` package's, bit for bit.

Tiny GGUF files are written with the ``gguf`` package: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / BF16 by its own quantizers, Q4_K /
Q5_K / Q6_K as random valid blocks (it has no quantizer for them: random bytes with finite float16 scales). kvrag
reads them back from a memory map of the file (:mod:`kvrag.gguf_load`) and de-quantizes them
(:mod:`kvrag.kv.gguf_quant`); the float32 bits must equal ``gguf.quants.dequantize``'s. A tiny Llama written in
Q4_0 / Q4_1 / Q8_0 then loads resident and must give the logits of transformers' own GGUF loader (which de-quantizes
with ``gguf``) bit for bit, and ``full`` must generate what ``model.generate`` does on the resident model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvrag import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.gguf_load import _file_bytes, tensor_table
from kvrag.kv import gguf_blocks, gguf_quant, int4_kernel, quant
from kvrag.kv.attention import use_gqa_sdpa
from kvrag.kv.gguf_quant import GGUFEmbedding, GGUFLinear
from kvrag.kv.native import cpu_flags
from kvrag_testing.tiny import tiny_model
from kvrag_testing.tiny_gguf import write_tiny_gguf

gguf = pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16")
RANDOM_BLOCKS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's float16 scales
ROWS, COLS = 48, 512


def _random_blocks(qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ROWS x COLS weights of ``qtype`` whose float16 scales are finite (within 2^-10..2^-4)."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(ROWS, COLS // block, size), dtype=np.uint8)
    for off in RANDOM_BLOCKS[qtype]:
        scales = (rng.uniform(2.0**-10, 2.0**-4, size=raw.shape[:2]) * rng.choice([-1, 1], size=raw.shape[:2]))
        raw[..., off : off + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One GGUF of each type: the gguf quantizer's output, or random valid blocks."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in QUANTIZED:
        qtype = gguf.GGMLQuantizationType[name]
        w = (rng.standard_normal((ROWS, COLS)) * rng.uniform(0.01, 2.0, size=(ROWS, 1))).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    for name in RANDOM_BLOCKS:
        writer.add_tensor(name, _random_blocks(name, rng), raw_dtype=gguf.GGMLQuantizationType[name])
    writer.add_tensor("F16", rng.standard_normal((ROWS, COLS)).astype(np.float16))
    writer.add_tensor("F32", rng.standard_normal((ROWS, COLS)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _resident(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    """Each tensor as kvrag keeps it: rows of raw bytes over the file's memory map, and its type."""
    data, _ = _file_bytes(path)
    out = {}
    for t in tensor_table(gguf.GGUFReader(path)):
        rows = int(np.prod(t["dims"][1:]))
        out[t["name"]] = (data[t["offset"] : t["offset"] + t["bytes"]].view(rows, -1), t["type"])
    return out


@pytest.mark.parametrize("qtype", [*QUANTIZED, *RANDOM_BLOCKS, "F16", "F32"])
def test_dequantized_blocks_equal_gguf_bit_for_bit(blocks_file: Path, qtype: str) -> None:
    reader = gguf.GGUFReader(blocks_file)
    tensor = next(t for t in reader.tensors if t.name == qtype)
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    assert expected.shape == (ROWS, COLS) and np.isfinite(expected).all()
    raw, got_type = _resident(blocks_file)[qtype]
    assert got_type == qtype
    for native in (True, False):  # ggml_dequant.c (where it builds) and the torch arithmetic
        got = gguf_quant.dequantize(raw, qtype, COLS, native=native)
        assert got.dtype == torch.float32 and tuple(got.shape) == (ROWS, COLS)
        assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))  # the float32 bits
        # rows looked up alone (embeddings, the output head's refined logits) are the same bits
        idx = torch.tensor([[5, 0], [ROWS - 1, 5]])
        assert np.array_equal(gguf_quant.dequantize(raw[idx], qtype, COLS, native=native).numpy(),
                              expected[idx.numpy()])
    if qtype in gguf_quant.TYPES and qtype not in gguf_quant.FLOAT_TYPES:
        # a dense product's bfloat16 tile: the float32 weight rounded as torch rounds it
        lin = GGUFLinear(raw, qtype, COLS, torch.bfloat16, gguf_quant.Scratch())
        for scratch in (True, False):
            tile = lin.dense_tile(2, 7, torch.bfloat16, scratch)
            assert torch.equal(tile.view(torch.int16), torch.from_numpy(expected[2:7]).bfloat16().view(torch.int16))


def test_native_dequantization_is_built_where_a_compiler_is() -> None:
    """The C de-quantization serves wherever a C compiler exists (its self-check passed); else the reason is a
    missing compiler, not a wrong result."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc"):
        assert gguf_blocks.native_dequant() is not None


@pytest.mark.parametrize("qtype", [*gguf_quant.INT4_TYPES, *gguf_quant.SPLIT_TYPES])
def test_int4_form_keeps_the_files_q_and_rounds_only_the_scales(blocks_file: Path, qtype: str) -> None:
    """The kernel's groups (``(q - 8) scale + zero``) of a block type: summed, they give the file's weight up to the
    bfloat16 rounding of each group's scale and zero; with float32 scales they give it to float32 rounding."""
    raw, _ = _resident(blocks_file)[qtype]
    exact = gguf_quant.dequantize(raw, qtype, COLS)
    parts = gguf_quant.int4_parts(raw, qtype)
    assert len(parts) == (1 if qtype in gguf_quant.INT4_TYPES else 2)
    for q, scale, zero in parts:
        assert q.shape == (ROWS, COLS) and int(q.min()) >= 0 and int(q.max()) <= 15
        assert scale.dtype == zero.dtype == torch.bfloat16 and scale.shape == (ROWS, COLS // 32)
    approx = sum(int4_kernel.dequantize(q, s, z) for q, s, z in parts)
    scale_mag = sum(s.float().abs().repeat_interleave(32, -1) for _, s, _ in parts)
    err = (approx - exact).abs()
    # each group's value moves by at most bf16's half-ulp of |scale| * 8 + |zero| (2^-8 relative, generously x2)
    bound = (scale_mag * 16 + exact.abs()) * 2.0**-8 + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


def test_resident_linear_decode_route_is_close_and_the_dense_route_exact(blocks_file: Path) -> None:
    """A Q4_K layer: its dense route multiplies by the file's exact weight; its int4 route (decode-sized rows)
    stays within bfloat16 error of it, and a tied head's refined top logits are the dense route's values."""
    raw, _ = _resident(blocks_file)["Q4_K"]
    scratch = gguf_quant.Scratch()
    lin = GGUFLinear(raw, "Q4_K", COLS, torch.float32, scratch)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(0))
    exact = x @ gguf_quant.dequantize(raw, "Q4_K", COLS).T
    assert torch.equal(lin(x), torch.nn.functional.linear(x, gguf_quant.dequantize(raw, "Q4_K", COLS)))
    if not lin.use_int4():
        pytest.skip("the int4 kernel does not take this shape here")
    y = lin(x)
    assert (y - exact).abs().max() <= 0.02 * exact.abs().max()
    # up to MAX_ROWS rows the int4 route, each row the same bits alone as in the batch; more rows the exact weight
    # (however a prompt is split past MAX_ROWS rows, its products are the file's exact weights')
    limit = quant.MAX_ROWS
    xs = torch.randn(limit + 1, COLS, generator=torch.Generator().manual_seed(1))
    batch = lin(xs[:limit])
    assert all(torch.equal(batch[i], lin(xs[i : i + 1])[0]) for i in (0, limit // 2, limit - 1))
    assert not torch.equal(batch, torch.nn.functional.linear(xs[:limit], gguf_quant.dequantize(raw, "Q4_K", COLS)))
    assert torch.equal(lin(xs), torch.nn.functional.linear(xs, gguf_quant.dequantize(raw, "Q4_K", COLS)))
    head = GGUFLinear(raw, "Q4_K", COLS, torch.float32, scratch, head=True)
    head.use_int4()
    top = head(x).topk(5, -1)
    assert torch.allclose(top.values, exact.gather(-1, top.indices), rtol=1e-5, atol=1e-5)
    emb = GGUFEmbedding(raw, "Q4_K", COLS, torch.float32)
    ids = torch.tensor([[3, 1, 3]])
    assert torch.equal(emb(ids), gguf_quant.dequantize(raw, "Q4_K", COLS)[ids])


class _Recording(gguf_quant.FilePages):
    def __init__(self) -> None:
        super().__init__(None, 0, 0)  # type: ignore[arg-type]  # no mapping: give_back only records
        self.calls: list[tuple[int, int | None]] = []

    def give_back(self, start: int = 0, end: int | None = None) -> None:
        self.calls.append((start, end))


def test_int4_layouts_give_each_pieces_file_pages_back_as_they_are_built(blocks_file: Path, monkeypatch) -> None:
    """A large tensor's file pages and its int4 layouts are not resident together: each piece of rows gives its
    pages back once laid out (rows in the file's order), the layouts the same bytes as built in one piece."""
    raw, _ = _resident(blocks_file)["Q4_K"]
    whole = GGUFLinear(raw, "Q4_K", COLS, torch.float32, gguf_quant.Scratch())
    if not whole.use_int4() or int4_kernel.path() is None:
        pytest.skip("kvrag's int4 kernel does not serve here")
    monkeypatch.setattr(gguf_quant, "_PACK_ROWS", 16)
    pages = _Recording()
    pieces = GGUFLinear(raw, "Q4_K", COLS, torch.float32, gguf_quant.Scratch(), pages=pages)
    assert pieces.use_int4()
    assert isinstance(pieces.int4, quant._Int4) and isinstance(whole.int4, quant._Int4)
    assert torch.equal(pieces.int4.packed, whole.int4.packed)
    rb = raw.stride(0)
    assert pages.calls == [(0, 16 * rb), (16 * rb, 32 * rb), (32 * rb, 48 * rb), (0, None)]
    ordered = _Recording()  # rows read in another order: only the whole tensor's pages, once built
    GGUFLinear(raw, "Q4_K", COLS, torch.float32, gguf_quant.Scratch(), pages=ordered,
               order=torch.arange(ROWS).flip(0)).use_int4()
    assert ordered.calls == [(0, None)]


def test_file_pages_give_back_only_whole_pages_of_the_range() -> None:
    advised: list[tuple[int, int]] = []

    class Mapping:
        def madvise(self, _flag: int, start: int, length: int) -> None:
            advised.append((start, length))

    page = gguf_quant.mmap.PAGESIZE
    pages = gguf_quant.FilePages(Mapping(), 100, 4 * page)  # type: ignore[arg-type]
    pages.give_back(0, 2 * page)  # bytes 100 .. 2 page + 100: the one whole page from page 1
    pages.give_back(2 * page, 2 * page + 50)  # inside one page: nothing
    pages.give_back()  # the whole tensor: pages 1 .. 3 (page 4 holds its last 100 bytes and what follows)
    assert advised == [(page, page), (page, 3 * page)]


def test_q6_k_decode_products_de_quantize_inside_the_product(blocks_file: Path) -> None:
    """A Q6_K layer (no int4 form) under ``quantize="int4"``: products of up to MAX_ROWS rows by kvrag_dequant_dot --
    the file's weight to float32 rounding, each row the same bits alone as in the batch, the file's pages read in
    place; more rows the dense route's exact product."""
    if gguf_blocks.native_dot() is None:
        pytest.skip("no C compiler: Q6_K takes the dense route for every product")
    raw, _ = _resident(blocks_file)["Q6_K"]
    weight = gguf_quant.dequantize(raw, "Q6_K", COLS)
    lin = GGUFLinear(raw, "Q6_K", COLS, torch.float32, gguf_quant.Scratch())
    assert lin.use_int4() and lin.int4 is None and "de-quantizing decode" in repr(lin)
    xs = torch.randn(quant.MAX_ROWS + 1, COLS, generator=torch.Generator().manual_seed(3))
    batch = lin(xs[:-1])
    want = xs[:-1].double() @ weight.double().T
    assert (batch.double() - want).abs().max() <= 1e-5 * (xs[:-1].abs().double() @ weight.abs().double().T).max()
    assert all(torch.equal(batch[i], lin(xs[i : i + 1])[0]) for i in (0, 5, quant.MAX_ROWS - 1))
    assert torch.equal(lin(xs), torch.nn.functional.linear(xs, weight))  # past MAX_ROWS: the dense route
    # the bits: lane j of 16 sums weight * input for columns j, j + 16, ... in order, then the lanes in order
    # (every path of ggml_dequant.c: the generic loop and the AVX-512 one)
    x = xs[:2]
    prod = (weight[None] * x[:, None]).view(2, weight.shape[0], -1, 16)
    lanes = torch.zeros(2, weight.shape[0], 16)
    for k in range(prod.shape[2]):
        lanes = lanes + prod[:, :, k]
    want_bits = torch.zeros(2, weight.shape[0])
    for j in range(16):
        want_bits = want_bits + lanes[..., j]
    assert torch.equal(gguf_blocks.dot(gguf_blocks.native_dot(), raw, "Q6_K", x), want_bits)
    half = GGUFLinear(raw, "Q6_K", COLS, torch.bfloat16, gguf_quant.Scratch())
    half.use_int4()
    got = half(xs[:3].to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(xs[:3].to(torch.bfloat16).float(), weight),
                               atol=0.05, rtol=0.01)


def test_q6_k_bfloat16_products_on_avx512_bf16(blocks_file: Path) -> None:
    """bfloat16 inputs to a Q6_K layer take kvrag_dequant_dot_bf16 where the CPU has AVX512-BF16: the product by the
    file's weight to float32 rounding (no input rounded), each input row the same bits alone as among 1-16 others
    (the kernel takes up to 4 rows a pass), and the layer's bfloat16 forward is that product rounded once."""
    fn = gguf_blocks.native_dot_bf16()
    if gguf_blocks.native_dot() is None or not {"avx512_bf16", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("no AVX512-BF16 (or no C compiler): bfloat16 inputs take the float32 product")
    assert fn is not None, "the CPU has AVX512-BF16, but kvrag_dequant_dot_bf16 failed its self-check"
    raw, _ = _resident(blocks_file)["Q6_K"]
    weight = gguf_quant.dequantize(raw, "Q6_K", COLS).double()
    xs = torch.randn(quant.MAX_ROWS, COLS, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    alone = torch.stack([gguf_blocks.dot(fn, raw, "Q6_K", xs[i : i + 1], bf16=True)[0] for i in range(len(xs))])
    want = xs.double() @ weight.T
    assert (alone.double() - want).abs().max() <= 1e-6 * (xs.double().abs() @ weight.abs().T).max()
    for rows in (2, 3, 4, 5, 9, quant.MAX_ROWS):
        assert torch.equal(gguf_blocks.dot(fn, raw, "Q6_K", xs[:rows], bf16=True), alone[:rows]), rows
    lin = GGUFLinear(raw, "Q6_K", COLS, torch.bfloat16, gguf_quant.Scratch())
    assert lin.use_int4() and lin.dot_bf16 is fn
    assert torch.equal(lin(xs[:3]), alone[:3].to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_rows_kept_in_the_files_order_compute_as_the_reordered_copy(blocks_file: Path, qtype: str) -> None:
    """A layer on the file's blocks with a row ``order`` (Llama's q / k) gives the bits of a layer on a re-ordered
    copy of them on every route: the int4 / dot decode products, the dense route (in tiles or not, with a bias),
    the exact rows the head refines with."""
    raw, _ = _resident(blocks_file)[qtype]
    order = torch.randperm(ROWS, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(ROWS)
    for dtype in (torch.float32, torch.bfloat16):
        kept = GGUFLinear(raw, qtype, COLS, dtype, gguf_quant.Scratch(), bias.to(dtype), order=order)
        copy = GGUFLinear(raw[order].clone(), qtype, COLS, dtype, gguf_quant.Scratch(), bias.to(dtype))
        assert kept.use_int4() == copy.use_int4()
        x = torch.randn(3, quant.MAX_ROWS + 4, COLS, generator=torch.Generator().manual_seed(6)).to(dtype)
        for rows in (x[:, :1], x[0, :5], x):  # decode-sized, and the dense route
            assert torch.equal(kept(rows), copy(rows))
        kept.scratch.buf.clear()
        assert torch.equal(kept.rows(torch.tensor([[4, 0]])), copy.rows(torch.tensor([[4, 0]])))


def test_dense_route_takes_strided_and_batched_inputs_tile_by_tile(blocks_file: Path, monkeypatch) -> None:
    """The dense route on a prefill's last position (a strided [batch, 1, k] view) and on [batch, rows, k], in one
    tile and in tiles of 16 rows: the product by the file's exact weight, the input's leading shape kept."""
    raw, _ = _resident(blocks_file)["Q6_K"]
    weight = gguf_quant.dequantize(raw, "Q6_K", COLS)
    hidden = torch.randn(2, 20, COLS, generator=torch.Generator().manual_seed(2))
    for tile in (gguf_quant.TILE_WEIGHTS, 16 * COLS):
        monkeypatch.setattr(gguf_quant, "TILE_WEIGHTS", tile)
        lin = GGUFLinear(raw, "Q6_K", COLS, torch.float32, gguf_quant.Scratch())
        for x in (hidden[:, -1:, :], hidden):
            y = lin(x)
            assert y.shape == (*x.shape[:-1], weight.shape[0])
            torch.testing.assert_close(y, torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gradients_through_a_resident_layer_are_the_dense_layers(blocks_file: Path, monkeypatch, qtype: str) -> None:
    """Autograd through a GGUF layer (training soft tokens or a probe through the frozen model) gave wrong input
    gradients without an error: each weight tile was de-quantized into the model's shared scratch buffer, which the
    next tile overwrote before backward read it; decode-sized products took kernels without autograd. With
    gradients wanted the layer computes on tiles of its own, for any number of rows."""
    raw, _ = _resident(blocks_file)[qtype]
    weight = gguf_quant.dequantize(raw, qtype, COLS)
    monkeypatch.setattr(gguf_quant, "TILE_WEIGHTS", 16 * COLS)  # several tiles
    lin = GGUFLinear(raw, qtype, COLS, torch.float32, gguf_quant.Scratch())
    lin.use_int4()
    for rows in (3, 40):  # a decode-sized product and a prefill-sized one
        x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows), requires_grad=True)
        up = torch.randn(rows, weight.shape[0], generator=torch.Generator().manual_seed(7))
        (lin(x) * up).sum().backward()
        ref = x.detach().clone().requires_grad_(True)
        (torch.nn.functional.linear(ref, weight) * up).sum().backward()
        assert x.grad is not None and ref.grad is not None
        torch.testing.assert_close(x.grad, ref.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("qtype", "dtype"), [("Q4_K", torch.float32), ("Q4_K", torch.bfloat16),
                                               ("Q6_K", torch.bfloat16), ("Q8_0", torch.float32)])
def test_segments_get_the_products_they_get_alone_from_one_de_quantization(blocks_file: Path, monkeypatch,
                                                                        qtype: str, dtype: torch.dtype) -> None:
    """A packed prefill's segments (kvrag.kv.direct.forward): each segment's product equals, bit for bit, the
    layer's product of that segment alone -- decode-sized segments on the decode route, longer ones on the dense
    route -- in one tile and in tiles of 16 rows, while the dense route de-quantizes each tile once for all of its
    segments."""
    raw, _ = _resident(blocks_file)[qtype]
    bias = torch.randn(ROWS, generator=torch.Generator().manual_seed(5)).to(dtype)
    segments = [3, quant.MAX_ROWS + 4, 1, quant.MAX_ROWS + 1, 30]
    x = torch.randn(1, sum(segments), COLS, generator=torch.Generator().manual_seed(4)).to(dtype)
    for tile in (gguf_quant.TILE_WEIGHTS, 16 * COLS):
        monkeypatch.setattr(gguf_quant, "TILE_WEIGHTS", tile)
        lin = GGUFLinear(raw, qtype, COLS, dtype, gguf_quant.Scratch(), bias=bias)
        lin.use_int4()
        tiles: list[tuple[int, ...]] = []
        monkeypatch.setattr(lin, "dense_tile", lambda *a, f=lin.dense_tile, seen=tiles: seen.append(a) or f(*a))
        alone = torch.cat([lin(part) for part in x.split(segments, dim=1)], dim=1)
        calls_alone, tiles[:] = len(tiles), []
        got = lin.forward_segments(x, segments)
        assert torch.equal(got, alone)
        dense = 3 if lin.int4 is not None or lin.dot is not None else len(segments)  # segments on the dense route
        assert len(tiles) * dense == calls_alone  # one de-quantization of each tile for all of them


@pytest.mark.parametrize("quantization", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_loads_resident_and_matches_transformers(quantization: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    tiny = tiny_model("llama", init_std=0.1)
    path = write_tiny_gguf(tmp_path / f"tiny-{quantization}.gguf", tiny, quantization=quantization)
    eng = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize=None)
    model = eng.loaded.model
    layer = model.model.layers[0]
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and isinstance(layer.self_attn.q_proj, GGUFLinear)
    assert layer.self_attn.q_proj.qtype == quantization and isinstance(model.lm_head, GGUFLinear)
    # Llama's q / k rows: the file's pages (no copy), read in transformers' order
    assert all(p.order is not None and p.pages is not None for p in (layer.self_attn.q_proj, layer.self_attn.k_proj))
    assert layer.self_attn.v_proj.order is None
    assert not any(p.dtype == torch.float32 and p.dim() == 2 for p in model.parameters())  # no float weight
    assert not list((tmp_path / "home" / "models").glob("*/*.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert use_gqa_sdpa(reference)  # the attention every kvrag model runs: the weights are what is compared
    ids = torch.tensor([eng.loaded.tokenizer("The capital of France is Paris. The capital of")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    prompt = "Question: what is the capital of France? Answer:"
    resp = eng.answer(prompt, method="full", max_new_tokens=6)
    p_ids = torch.tensor([eng.loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(p_ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(p_ids))
    assert resp.token_ids == out[0, p_ids.shape[1]:].tolist()


def test_int4_decode_route_on_the_files_blocks_fuses_and_full_equals_generate(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantize="int4"`` on a Q4_0 file: the layers' int4 weights come from the blocks, fuse (q/k/v, gate/up) into
    one product with the same bits, are keyed apart from the dense route, and ``full`` equals ``model.generate``."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    tiny = tiny_model("llama", init_std=0.1)
    path = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", tiny, quantization="Q4_0")
    eng = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize="int4")
    dense = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize=None)
    assert eng.loaded.fingerprint != dense.loaded.fingerprint
    attn = eng.loaded.model.model.layers[0].self_attn
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert all(m.int4 is not None for m in mods)
    # the file's pages a layer gave back once it held its int4 weights still read as the file's bytes; q / k keep
    # them too (transformers' row order applied to the outputs, not to a copy)
    assert attn.q_proj.order is not None and attn.k_proj.order is not None and attn.v_proj.order is None
    table = {t["name"]: t for t in tensor_table(gguf.GGUFReader(path))}
    for mod, name in ((attn.q_proj, "q"), (attn.v_proj, "v")):
        t = table[f"blk.0.attn_{name}.weight"]
        with path.open("rb") as f:
            f.seek(t["offset"])
            on_disk = f.read(t["bytes"])
        assert mod.pages is not None and mod.blocks.numpy().tobytes() == on_disk
        x = torch.randn(quant.MAX_ROWS + 1, mod.in_features)  # the dense route reads the pages and gives them back
        weight = mod.rows(torch.arange(mod.out_features))
        assert torch.equal(mod(x), torch.nn.functional.linear(x, weight))
        assert mod.blocks.numpy().tobytes() == on_disk
    if int4_kernel.path() is not None:
        fused = quant.fuse_int4(mods)
        assert fused is not None and fused.valid()
        x = torch.randn(3, 64)
        assert torch.equal(fused.mm(x), torch.cat([m(x) for m in mods], -1))
    prompt = "Question: what is the capital of France? Answer:"
    resp = eng.answer(prompt, method="full", max_new_tokens=6)
    p_ids = torch.tensor([eng.loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = eng.loaded.model.generate(p_ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(p_ids))
    assert resp.token_ids == out[0, p_ids.shape[1]:].tolist()


def test_int4_prefill_route_is_split_invariant_keyed_apart_and_full_equals_generate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVRAG_GGUF_PREFILL=int4``: every product of an int4 layer runs the int4 kernel, so a prompt's rows are the
    same bits whether multiplied together or in pieces; the model is keyed apart from the exact route, and ``full``
    still equals ``model.generate``. A bad value is refused by name."""
    if int4_kernel.path() is None:
        pytest.skip("kvrag's int4 kernel does not serve here (the route needs its row-independent products)")
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", tiny_model("llama", init_std=0.1), quantization="Q4_0")
    exact = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize="int4")
    monkeypatch.setenv("KVRAG_GGUF_PREFILL", "int4")
    eng = KVRAGEngine.from_pretrained(str(path), dtype="float32", device="cpu", quantize="int4")
    assert eng.loaded.fingerprint != exact.loaded.fingerprint
    v = eng.loaded.model.model.layers[0].self_attn.v_proj
    assert v.all_rows and not exact.loaded.model.model.layers[0].self_attn.v_proj.all_rows
    x = torch.randn(3 * quant.MAX_ROWS, v.in_features, generator=torch.Generator().manual_seed(2))
    whole = v(x)
    assert torch.equal(whole, torch.cat([v(x[:5]), v(x[5:30]), v(x[30:])]))  # split anywhere: the same bits
    assert not torch.equal(whole, exact.loaded.model.model.layers[0].self_attn.v_proj(x))  # not the exact route
    prompt = "Question: what is the capital of France? Answer:"
    resp = eng.answer(prompt, method="full", max_new_tokens=6)
    p_ids = torch.tensor([eng.loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = eng.loaded.model.generate(p_ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(p_ids))
    assert resp.token_ids == out[0, p_ids.shape[1]:].tolist()
    monkeypatch.setenv("KVRAG_GGUF_PREFILL", "fast")
    with pytest.raises(ConfigError, match="KVRAG_GGUF_PREFILL"):
        gguf_quant.prefill_route()
