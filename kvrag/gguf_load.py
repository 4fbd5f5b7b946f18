"""Load a GGUF file's model with its weights resident in the file's own blocks (:mod:`kvrag.kv.gguf_quant`).

The model is built on the meta device from its config (read from the GGUF header by transformers once, when
:mod:`kvrag.default_model` prepares the file), so no float copy of a weight is made. Each tensor is then taken from
a read-only memory map of the file, by the offsets recorded at preparation (:func:`tensor_table`; no header parse at
load): a quantized linear weight becomes a :class:`~kvrag.kv.gguf_quant.GGUFLinear`, quantized token embeddings a
:class:`~kvrag.kv.gguf_quant.GGUFEmbedding` (and a tied output head a ``GGUFLinear`` on the same blocks); float
tensors (norms, biases, an F32 / F16 / BF16 weight) become ordinary parameters in the compute dtype. Names are
mapped and tensors post-processed by transformers' own GGUF code (``get_gguf_hf_weights_map`` and the tensor
processors: Llama's q / k row order, Gemma's norm offset); a quantized weight keeps the file's row order in its pages,
and its layer reads the rows in the model's order (``GGUFLinear``'s ``order``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from kvrag.errors import UnsupportedModelError
from kvrag.gguf_reading import parsed_once
from kvrag.kv import native
from kvrag.kv.gguf_quant import (
    FLOAT_TYPES,
    TYPES,
    FilePages,
    GGUFEmbedding,
    GGUFLinear,
    Scratch,
    dequantize,
    prefill_route,
)

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

TENSORS_FILE = "gguf_tensors.json"
"""The prepared folder's table of the file's tensors (name, type, GGUF dims, byte offset and size)."""
_ROW_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor")
"""transformers' tensor processors whose change to a quantized weight is a reordering of whole rows (or none)."""


class TensorRow(TypedDict):
    """One tensor of :data:`TENSORS_FILE`: name, type name, GGUF dims, absolute byte offset and byte size."""

    name: str
    type: str
    dims: list[int]
    offset: int
    bytes: int


def tensor_table(reader: GGUFReader) -> list[TensorRow]:
    """Each tensor of a ``gguf.GGUFReader``: name, type name, GGUF dims, absolute byte offset and byte size."""
    from gguf import GGMLQuantizationType

    return [{"name": t.name, "type": GGMLQuantizationType(t.tensor_type).name, "dims": [int(d) for d in t.shape],
             "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]


def check_resident(architecture: str, table: list[TensorRow]) -> None:
    """Refuse by name an architecture whose quantized tensors kvrag cannot keep resident (tensor types it does not
    keep are de-quantized at load instead, with a warning)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    proc = TENSOR_PROCESSORS.get(architecture)
    if proc is not None and proc.__name__ not in _ROW_PROCESSORS:
        msg = (f"GGUF architecture {architecture!r}: transformers re-lays its tensors ({proc.__name__}) in a way "
               "kvrag does not apply to quantized blocks; use the model's Hugging Face checkpoint folder")
        raise UnsupportedModelError(msg)
    other = sorted({t["type"] for t in table} - set(TYPES))
    if other:
        log.warning("GGUF tensor type(s) %s are not kept resident (kvrag keeps %s): those tensors are de-quantized "
                    "into the compute dtype at load", ", ".join(other), ", ".join(TYPES))


def _set_module(model: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _file_bytes(path: Path) -> tuple[torch.Tensor, mmap.mmap]:
    """The whole file as a read-only uint8 tensor over a memory map (nothing read until a page is touched), and the
    map (whose pages a layer gives back once it holds its weights in another form, :class:`FilePages`)."""
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # read-only by design: kvrag never writes to a weight
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)), mapping


def build_empty(config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The model of ``config`` with its parameters on the meta device (buffers such as RoPE tables are real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype,  # type: ignore[no-any-return]
                                                attn_implementation=attn_implementation)


def load_resident(gguf: Path, table: list[TensorRow], config: PretrainedConfig, *, architecture: str,
                  dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The causal LM of a GGUF file with its quantized tensors resident (see the module docstring).

    Raises:
        UnsupportedModelError: a tensor type kvrag does not keep, an architecture whose tensors transformers
            re-lays beyond row order, or a tensor the model lacks / a parameter the file lacks.
    """
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    check_resident(architecture, table)
    model = build_empty(config, dtype, attn_implementation)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with parsed_once():
        names = get_gguf_hf_weights_map(model, processor)
    data, mapping = _file_bytes(gguf)
    base = data.data_ptr()
    scratch = Scratch()
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[torch.Tensor, str, int, FilePages, torch.Tensor | None]] = {}
    for t in table:
        hf = names.get(t["name"])
        if hf is None:
            log.debug("GGUF tensor %s has no parameter in the model; not loaded", t["name"])
            continue
        dims, qtype = t["dims"], t["type"]
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        raw = data[t["offset"] : t["offset"] + t["bytes"]].view(rows, -1)
        if qtype in FLOAT_TYPES or qtype not in TYPES or not hf.endswith(".weight") or len(dims) != 2:
            if qtype in TYPES:
                w = dequantize(raw, qtype, dims[0]).reshape(*reversed(dims)).numpy()
            else:  # a type kvrag does not keep resident: the gguf package de-quantizes it
                from gguf import GGMLQuantizationType
                from gguf.quants import dequantize as gguf_dequantize

                w = gguf_dequantize(raw.numpy(), GGMLQuantizationType[qtype]).reshape(*reversed(dims))
            w = processor.process(weights=w, name=t["name"]).weights
            dense[hf] = torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
            continue
        pages = FilePages(mapping, raw.data_ptr() - base, t["bytes"])
        quantized[hf] = (raw, qtype, dims[0], pages, _row_order(processor, t["name"], rows))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    module_names = {id(m): n for n, m in model.named_modules()}
    embed_name = module_names.get(id(embed))
    head_name = module_names.get(id(head)) if head is not None else None
    for hf, (blocks, qtype, cols, pages, order) in quantized.items():
        prefix = hf.removesuffix(".weight")
        old = model.get_submodule(prefix)
        shape = tuple(old.weight.shape)  # type: ignore[union-attr, arg-type]
        if shape != (blocks.shape[0], cols):
            msg = f"GGUF tensor for {hf} is [{blocks.shape[0]}, {cols}], the model's parameter {list(shape)}"
            raise UnsupportedModelError(msg)
        if prefix == embed_name:
            if order is not None:
                msg = f"GGUF tensor for {hf}: transformers re-orders the embedding rows, which kvrag does not apply"
                raise UnsupportedModelError(msg)
            new: torch.nn.Module = GGUFEmbedding(blocks, qtype, cols, dtype, getattr(old, "embed_scale", None))
        elif isinstance(old, torch.nn.Linear):
            new = GGUFLinear(blocks, qtype, cols, dtype, scratch, dense.pop(f"{prefix}.bias", None),
                             head=prefix == head_name, pages=pages, order=order)
        else:
            msg = f"GGUF tensor {hf} is quantized but {type(old).__name__} is neither a linear layer nor embeddings"
            raise UnsupportedModelError(msg)
        _set_module(model, prefix, new)
    tie = head_name is not None and f"{head_name}.weight" not in quantized and f"{head_name}.weight" not in dense
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    if tie and embed_name is not None:
        emb = model.get_submodule(embed_name)
        if isinstance(emb, GGUFEmbedding) and head_name is not None:
            bias = getattr(model.get_submodule(head_name), "bias", None)
            emb_pages = quantized[f"{embed_name}.weight"][3] if f"{embed_name}.weight" in quantized else None
            _set_module(model, head_name, GGUFLinear(emb.blocks, emb.qtype, emb.embedding_dim, dtype, scratch,
                                                     None if bias is None or bias.is_meta else bias, head=True,
                                                     pages=emb_pages))
        else:
            model.get_submodule(head_name).weight = emb.weight  # type: ignore[arg-type]
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left or unexpected:
        msg = (f"GGUF file {gguf.name}: the model's {left[:5]} are not in the file"
               + (f", and the file's {unexpected[:5]} are not in the model" if unexpected else ""))
        raise UnsupportedModelError(msg)
    del missing
    model.eval()
    return model


def _row_order(processor: Any, name: str, rows: int) -> torch.Tensor | None:
    """How transformers' tensor processor re-orders the rows of tensor ``name`` (``rows`` rows): None when it leaves
    them, else row j of the model's weight = row ``order[j]`` of the file's. Found by processing the row numbers
    (:data:`_ROW_PROCESSORS` only move whole rows), so the file's blocks stay in its pages."""
    idx = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    got = processor.process(weights=idx, name=name).weights
    if got is idx or np.array_equal(got, idx):
        return None
    order = np.asarray(got).reshape(-1)
    if order.shape != (rows,) or not np.array_equal(np.sort(order), idx[:, 0]):
        msg = f"GGUF tensor {name}: transformers' {type(processor).__name__} changes it beyond its row order"
        raise UnsupportedModelError(msg)
    return torch.from_numpy(order.copy())


def use_int4(model: torch.nn.Module) -> int:
    """Give each GGUF linear layer of ``model`` whose type has an int4 form its kernel weights (decode-sized
    products, or every product under ``KVRAG_GGUF_PREFILL=int4``: :meth:`GGUFLinear.use_int4`); returns how many."""
    all_rows = prefill_route() == "int4"
    n = 0
    for mod in model.modules():
        if isinstance(mod, GGUFLinear) and mod.int4 is None:
            with contextlib.suppress(ValueError):
                n += int(mod.use_int4(all_rows))
    if n:
        native.trim_heap()  # the re-layout's temporaries: freed, but kept in the heap otherwise
    return n


__all__ = ["TENSORS_FILE", "build_empty", "check_resident", "load_resident", "tensor_table", "use_int4"]
