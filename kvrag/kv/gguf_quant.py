"""A GGUF file's own quantized blocks as model weights: the modules that hold them and compute with them.

The blocks are de-quantized by :mod:`kvrag.kv.gguf_blocks` (torch, or ``ggml_dequant.c``, bit for bit
``gguf.quants.dequantize``; its names are re-exported here).

:class:`GGUFLinear` keeps a linear layer's blocks and computes its products two ways:

* inputs of at most :data:`kvrag.kv.quant.MAX_ROWS` rows (decode steps, short suffixes), when the model was loaded
  with ``quantize="int4"``: the int4 kernels of :mod:`kvrag.kv.quant` on the blocks re-laid out once at load. A
  Q4_0 / Q4_1 block and each 32-weight sub-block of a Q4_K super-block is exactly one of those kernels' groups
  (``w = (q - 8) scale + zero``: Q4_0 ``scale = d``; Q4_1 ``zero = m + 8 d``; Q4_K ``scale = d sc``, ``zero =
  8 d sc - dmin m``), the file's own 4-bit ``q`` unchanged and the scale and zero rounded to bfloat16, the kernels'
  format. Q5_0, Q5_1, Q8_0 and Q5_K weights are two such products (``q = 16 hi + lo``) whose outputs add up. Q6_K (groups of 16
  weights) has no such form: its decode-sized products read the file's blocks in place in ``ggml_dequant.c`` --
  bfloat16 inputs on a CPU with AVX512-BF16 by ``kvrag_dequant_dot_bf16`` (the 6-bit values as exact bfloat16
  numbers, one VDPBF16PS per 32 weights), other inputs de-quantized a chunk at a time and multiplied in float32
  (``kvrag_dequant_dot``);
* larger inputs (prefill, ingest), other types, ``quantize=None``: the layer's weight de-quantized into one scratch
  buffer shared by every layer of the model (reused, never kept; by ``ggml_dequant.c`` where it builds, with the
  same bits), then the dense product in the compute dtype. A prefill's product costs hundreds of multiply-adds per
  weight, the de-quantization a handful of operations.

:class:`GGUFEmbedding` de-quantizes only the rows its ids look up; a tied output head is a :class:`GGUFLinear` on
the same blocks.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.kv import int4_kernel, linear, native, quant
from kvrag.kv.gguf_blocks import (
    DOT_TYPES,
    FLOAT_TYPES,
    INT4_TYPES,
    SPLIT_TYPES,
    TYPES,
    Dot,
    dequantize,
    dequantize_into,
    dot,
    int4_parts,
    native_dot,
    native_dot_bf16,
    native_for,
)
from kvrag.kv.routes import ROUTE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TILE_WEIGHTS = 1 << 22
"""Weights de-quantized at a time by a dense product (16 MB of float32, the scratch buffer's size): a larger layer
is multiplied tile by tile of output rows."""
_PACK_ROWS = 4096
"""Rows re-laid out at a time (bounds the int32 temporaries of a large embedding / head)."""


def _int4_weights(blocks: torch.Tensor, qtype: str, order: torch.Tensor | None = None,
                  pages: FilePages | None = None) -> list[quant._Int4]:
    """The int4 kernel weights (:class:`kvrag.kv.quant._Int4`) of :func:`int4_parts`, rows in ``order`` (the
    blocks' own order by default), built ``_PACK_ROWS`` rows at a time for kvrag's kernel (whose layout is whole
    tiles of 16 rows, so the pieces concatenate). ``pages``: the blocks' file pages, each piece's given back once it
    is laid out (rows in the blocks' order only), so that a large tensor's pages and its layouts are not resident
    together."""
    if int4_kernel.path() is None:
        return [quant._Int4.from_parts(*p) for p in int4_parts(blocks if order is None else blocks[order], qtype)]
    out: list[quant._Int4] = []
    for r in range(0, blocks.shape[0], _PACK_ROWS):
        rows = blocks[r : r + _PACK_ROWS] if order is None else blocks[order[r : r + _PACK_ROWS]]
        for i, p in enumerate(int4_parts(rows, qtype)):
            piece = int4_kernel.pack(*p)
            if i == len(out):
                w = quant._Int4.__new__(quant._Int4)
                w.n, w.scales_zeros = blocks.shape[0], None
                w.packed = piece.new_empty(blocks.shape[0] // int4_kernel.TILE, *piece.shape[1:])
                out.append(w)
            t = r // int4_kernel.TILE
            out[i].packed[t : t + piece.shape[0]] = piece
        if pages is not None and order is None:
            pages.give_back(r * blocks.stride(0), (r + rows.shape[0]) * blocks.stride(0))
    return out


class Scratch:
    """One buffer a model's GGUF layers de-quantize their weights into for dense products (grown to the largest
    layer, reused). Guarded by a lock; a thread that finds it taken de-quantizes into a buffer of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buf: dict[torch.dtype, torch.Tensor] = {}

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.buf.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            with torch.inference_mode(False):  # a normal tensor: written inside and outside inference mode
                buf = self.buf[dtype] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]


class _Split:
    """Two int4 products whose outputs add up to the weight's product (Q8_0, Q5_K)."""

    __slots__ = ("hi", "lo", "n")

    def __init__(self, hi: quant._Int4, lo: quant._Int4) -> None:
        self.hi, self.lo, self.n = hi, lo, hi.n

    takes_float32 = False

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return (self.hi.mm(x).float() + self.lo.mm(x).float()).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.hi.nbytes + self.lo.nbytes)


PREFILL_ROUTES = ("exact", "int4")


def prefill_route() -> str:
    """How a GGUF layer with int4 weights multiplies more than :data:`kvrag.kv.quant.MAX_ROWS` rows
    (``KVRAG_GGUF_PREFILL``): ``exact`` (the default) de-quantizes the file's blocks for a dense product; ``int4``
    runs kvrag's int4 kernel on every product (where that kernel serves; elsewhere ``exact``). Both keep a prompt's K/V independent of
    how it is split (kvrag's kernel computes each row alike whatever the others); ``int4`` rounds a float32 model's
    prefill activations to bfloat16 and its weights' scales as decode does, never reads the file's pages after the
    load, and is keyed apart (``+int4-prefill``). Measured: docs/results/epyc/gguf_resident.md."""
    v = native.setting("KVRAG_GGUF_PREFILL", PREFILL_ROUTES)
    return "int4" if v == "int4" and int4_kernel.path() is not None else "exact"


class FilePages:
    """The pages of a GGUF file's memory map that hold one tensor's blocks (``length`` bytes from ``offset``)."""

    __slots__ = ("length", "mapping", "offset")

    def __init__(self, mapping: mmap.mmap, offset: int, length: int) -> None:
        self.mapping, self.offset, self.length = mapping, offset, length

    def give_back(self, start: int = 0, end: int | None = None) -> None:
        """Drop the whole pages of the tensor's bytes ``start:end`` (all of them by default) from this process's
        resident set (``MADV_DONTNEED``; a read-only shared file map, so nothing is lost: a later read maps them in
        again from the page cache or the file)."""
        page = mmap.PAGESIZE
        stop = self.length if end is None else min(end, self.length)
        start = -(-(self.offset + start) // page) * page
        end = (self.offset + stop) // page * page
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class GGUFLinear(torch.nn.Module):
    """A linear layer whose weight is a GGUF tensor's raw blocks (``blocks``: uint8 [out, row bytes]), see the
    module docstring. ``weight`` is a meta tensor of the weight's shape and compute dtype (for code that reads
    shapes); nothing of float size is kept. ``order`` (int64 [out]): output j is the blocks' row ``order[j]`` (the
    file's rows kept in the file's order where the model orders them otherwise: Llama's q / k); the int4 layouts
    are built in the model's order, and the other routes compute in the file's order and gather the outputs."""

    blocks: torch.Tensor
    order: torch.Tensor | None

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, dtype: torch.dtype, scratch: Scratch,
                 bias: torch.Tensor | None = None, *, head: bool = False, pages: FilePages | None = None,
                 order: torch.Tensor | None = None) -> None:
        super().__init__()
        self.pages = pages
        self.in_features, self.out_features = in_features, int(blocks.shape[0])
        self.qtype, self.dtype, self.scratch, self.head = qtype, dtype, scratch, head
        self.register_buffer("blocks", blocks)
        self.register_buffer("order", order, persistent=False)
        self.register_buffer("ggml_type", torch.tensor(list(TYPES).index(qtype)))
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.int4: quant._Int4 | _Split | None = None
        self.all_rows = False  # every product on the int4 weights (KVRAG_GGUF_PREFILL=int4, :func:`prefill_route`)
        self.dot: Dot | None = None  # decode-sized products by kvrag_dequant_dot (:data:`DOT_TYPES`)
        self.dot_bf16: Dot | None = None  # the same on bfloat16 inputs, where the CPU has AVX512-BF16

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=self.dtype, device="meta")

    def use_int4(self, all_rows: bool = False) -> bool:
        """Give the layer its int4 kernel weights (:data:`INT4_TYPES`, :data:`SPLIT_TYPES`), when its shape fits
        the kernel's tiles, for products of at most :data:`kvrag.kv.quant.MAX_ROWS` rows or, ``all_rows``, every
        product (:func:`prefill_route`); returns whether it did."""
        if self.qtype in DOT_TYPES and self.blocks.is_cpu and not all_rows:
            self.dot = native_dot()  # the file's blocks, de-quantized in the product: no layout of their own
            self.dot_bf16 = native_dot_bf16() if self.qtype == "Q6_K" else None
            return self.dot is not None
        if (self.qtype not in INT4_TYPES + SPLIT_TYPES or self.out_features % 16 or self.in_features % quant.GROUP
                or not self.blocks.is_cpu):
            return False
        parts = _int4_weights(self.blocks, self.qtype, self.order, self.pages)
        self.int4 = parts[0] if len(parts) == 1 else _Split(*parts)
        self.all_rows = all_rows
        if self.pages is not None:  # decode-sized products no longer read the file's pages: out of the resident set
            self.pages.give_back()
        return True

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 weight rows ``index`` (any shape; the model's row numbers): [..., in_features]."""
        return dequantize(self.blocks[index if self.order is None else self.order[index]], self.qtype,
                          self.in_features)

    def _in_order(self, y: torch.Tensor) -> torch.Tensor:
        """Outputs computed in the blocks' row order, in the model's (:attr:`order`)."""
        return y if self.order is None else y.index_select(-1, self.order)

    def dense_tile(self, r0: int, r1: int, dtype: torch.dtype, scratch: bool) -> torch.Tensor:
        """The blocks' rows ``r0:r1`` (the file's order) in ``dtype``: in the model's scratch buffer when ``scratch``
        (the caller holds its lock; valid until the next tile), else in a buffer of their own."""
        fn = native_for(self.qtype, self.blocks) if dtype in (torch.float32, torch.bfloat16) else None
        if fn is not None:
            shape = (r1 - r0, self.in_features)
            out = (self.scratch.take(shape[0] * shape[1], dtype, self.blocks.device).view(shape) if scratch
                   else torch.empty(shape, dtype=dtype))
            return dequantize_into(fn, self.blocks[r0:r1], self.qtype, self.in_features, out)
        w = dequantize(self.blocks[r0:r1], self.qtype, self.in_features)
        if w.dtype == dtype:
            return w
        if not scratch:
            return w.to(dtype)
        return self.scratch.take(w.numel(), dtype, w.device).view(w.shape).copy_(w)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the file's exact weights, :data:`TILE_WEIGHTS` weights de-quantized at a time. A layer that
        also holds int4 weights gives the file's pages back afterwards, so a prefill keeps at most one such layer's
        pages resident beside the int4 layouts (re-reading them from the page cache costs a minor fault a page)."""
        return self._dense([x])[0]

    def _dense(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`dense` of each input (one dtype), each weight tile de-quantized once for all of them: each input's
        product is the one it has alone (the same tiles, the same calls)."""
        step = max(16, TILE_WEIGHTS // self.in_features)
        # Two dimensions, contiguous: given a strided 3-D input (a prefill's last position, for the head), linear
        # would broadcast the weight tile and copy it for a batched product, on every tile.
        flats = [linear.as_rows(x.reshape(-1, self.in_features)) for x in xs]  # a bf16 row: as it is among others
        dtype = flats[0].dtype
        inner: torch.Tensor | None = self.bias  # in the blocks' row order, added in each product as a dense layer does
        if inner is not None and self.order is not None:
            inner = torch.empty_like(inner).index_copy_(0, self.order, inner)
        # a product autograd records keeps its weight tile for backward: a tile of its own, not the shared scratch
        # buffer the next tile overwrites
        own = not any(_needs_grad(x) for x in flats) and self.scratch.lock.acquire(blocking=False)
        try:
            if step >= self.out_features:
                w = self.dense_tile(0, self.out_features, dtype, own)
                ys = [torch.nn.functional.linear(x, w, inner) for x in flats]
            else:
                ys = [x.new_empty(x.shape[0], self.out_features) for x in flats]
                for r0 in range(0, self.out_features, step):
                    r1 = min(r0 + step, self.out_features)
                    w, bias = self.dense_tile(r0, r1, dtype, own), None if inner is None else inner[r0:r1]
                    for x, y in zip(flats, ys, strict=True):
                        y[:, r0:r1] = torch.nn.functional.linear(x, w, bias)
            return [self._in_order(y[: x.numel() // self.in_features]).view(*x.shape[:-1], self.out_features)
                    for x, y in zip(xs, ys, strict=True)]
        finally:
            if own:
                self.scratch.lock.release()
            if self.int4 is not None and self.pages is not None:  # read again at the next dense product
                self.pages.give_back()

    def _decode_sized(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` multiplies ``x`` on the decode products (int4 weights, or the de-quantizing dot);
        never where autograd needs the product (the kernels have no backward): the dense route then."""
        if _needs_grad(x):
            return False
        small = x.numel() <= quant.MAX_ROWS * x.shape[-1] and not ROUTE.dense
        return x.is_cpu and ((self.dot is not None and 0 < x.numel() and small)
                             or (self.int4 is not None and (self.all_rows or small)))

    def forward_segments(self, x: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        """:meth:`forward` over ``x`` [1, T, in] one segment of ``segments`` tokens at a time, concatenated (a packed
        prefill of several requests' suffixes, :func:`kvrag.kv.direct.forward`): each segment gets the product it
        gets alone -- its route, its shapes, its bits -- while the segments that take the dense route share each
        de-quantized weight tile instead of de-quantizing the layer once each."""
        parts = list(x.split(list(segments), dim=1))
        dense = [i for i, p in enumerate(parts) if not self._decode_sized(p)]
        outs = [p if i in dense else self.forward(p) for i, p in enumerate(parts)]  # dense ones: placeholders
        if dense:
            for i, y in zip(dense, self._dense([parts[i] for i in dense]), strict=True):
                outs[i] = y
        return torch.cat(outs, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        if self.dot is not None and self._decode_sized(x):
            fn = self.dot_bf16 if x.dtype == torch.bfloat16 and self.dot_bf16 is not None else self.dot
            y = dot(fn, self.blocks, self.qtype, x.reshape(-1, k), bf16=fn is self.dot_bf16)
            y = self._in_order(y).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        int4 = self.int4
        if int4 is not None and self._decode_sized(x):
            flat = x.reshape(-1, k)
            if flat.dtype == torch.float32 and int4.takes_float32:
                y = int4.mm(flat.contiguous())
            else:
                y = int4.mm(flat.to(torch.bfloat16).contiguous()).to(x.dtype)
            if self.head:  # the likely next tokens' logits from the file's exact weights
                idx = y.topk(min(quant.REFINE_TOP, y.shape[-1]), dim=-1).indices
                exact = torch.einsum("rd,rkd->rk", flat, self.rows(idx).to(flat.dtype))
                if self.bias is not None:
                    exact = exact + self.bias[idx]
                y.scatter_(-1, idx, exact.to(y.dtype))
            elif self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return self.dense(x)

    def extra_repr(self) -> str:
        kernel = ", int4 decode" if self.int4 is not None else ", de-quantizing decode" if self.dot is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.qtype}{kernel}"


class GGUFEmbedding(torch.nn.Module):
    """Token embeddings kept as a GGUF tensor's raw blocks (uint8 [vocab, row bytes]): a lookup de-quantizes only
    its rows. ``embed_scale`` (Gemma) multiplies the rows as the model's own embedding does."""

    blocks: torch.Tensor

    def __init__(self, blocks: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(blocks.shape[0]), dim
        self.qtype, self.dtype = qtype, dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("ggml_type", torch.tensor(list(TYPES).index(qtype)))
        self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.dtype, device="meta")

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``index`` (any shape): [..., embedding_dim]."""
        return dequantize(self.blocks[index], self.qtype, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(ids).to(self.dtype)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype}"


def resident_bytes(model: PreTrainedModel) -> int:
    """Bytes of the GGUF blocks and int4 kernel weights ``model``'s GGUF modules hold (the blocks counted once
    when shared by a tied head)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, GGUFLinear | GGUFEmbedding):
            blocks: torch.Tensor = mod.blocks
            if blocks.data_ptr() not in seen:
                seen.add(blocks.data_ptr())
                total += blocks.numel()
            if isinstance(mod, GGUFLinear) and mod.int4 is not None:
                total += mod.int4.nbytes
    return total


__all__ = ["DOT_TYPES", "FLOAT_TYPES", "INT4_TYPES", "PREFILL_ROUTES", "SPLIT_TYPES", "TYPES", "FilePages", "GGUFEmbedding",
           "GGUFLinear", "Scratch", "dequantize", "int4_parts", "prefill_route", "resident_bytes"]
