"""Prepacked bfloat16 linear layers on the CPU: the model's own ``nn.Linear`` modules, with oneDNN weights packed once.

On the CPU, ``F.linear`` in bfloat16 runs oneDNN's matmul and re-lays-out ("reorders") the weight into oneDNN's
blocked format on **every call**. For a prefill (thousands of rows) that is noise; for a decode step or a short
suffix (1-32 rows) the reorder costs about as much as the product itself, and a decode step spends most of its time
in these products (docs/results.md, "Decode, int4 and dense bfloat16"). Packing the weight once (what PyTorch's own inductor
does for frozen CPU graphs) gives **bit-identical** outputs for inputs of two or more rows -- the same oneDNN kernel,
minus the reorder; larger inputs keep ``F.linear`` (:data:`MAX_ROWS`) -- and the stored caches' keys and contents do
not change. A one-row input runs the multi-row kernel too (:data:`ONE_ROW`), so every row of a decode-sized product
has the same bits however many rows share it; ``model.generate`` runs the same modules, so ``full`` still generates
exactly what it does.

:func:`pack_linears` gives each ``nn.Linear`` of a bf16 CPU model a packed copy of its weight and routes its forward
through ``torch.ops.mkldnn._linear_pointwise`` (the op inductor emits for the same purpose). The dense weight stays
(state dicts, fingerprints, tied embeddings and training read it), so a model's linear weights take twice their
memory in bf16; ``KVRAG_PACKED_LINEAR=0`` turns packing off. A module falls back to ``F.linear`` whenever the packed
copy could be wrong or unusable: its weight was replaced or changed in place since packing, moved off the CPU or to
another dtype, or autograd needs a graph.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrag.kv.routes import ROUTE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

ENV = "KVRAG_PACKED_LINEAR"
"""Set to 0 to keep transformers' plain ``F.linear`` (e.g. to save the packed copies' memory)."""
MAX_ROWS = 64
"""Inputs of at most this many rows (tokens x batch) take the packed weight; larger ones take ``F.linear``. The
reorder is noise for a prefill's thousands of rows (packed and plain take the same time there), and with several
threads oneDNN partitions large products differently for a packed weight (a [300, 576] x [576, 576] product
differed by 0.125 at 2 threads, never at 1), so prefill and ingest keep transformers' exact numerics on every
thread count; decode steps, batched decode and question suffixes are the rows that gain."""
ONE_ROW = 2
"""A one-row input is multiplied as this many copies of itself, and the first row kept. oneDNN multiplies a single
row with another kernel than two or more rows, which sums over K in another order once K passes ~1K (SmolLM2's
``down_proj``, K = 1536: the row differs in the last bf16 bit from the same row among others in ~6% of products,
``tests/unit/test_packed_linear.py``), while the rows of a product of two or more are each computed alone. So a
one-token decode step (``model.generate``'s included), a verify step's positions and a batched step's rows all get
the bits the row gets in any packed product: speculative and batched decoding give plain decoding's tokens. The
extra row costs ~1.5% of a dense bf16 decode step (docs/speculative.md)."""


def packing_available() -> bool:
    """Whether this torch build can pack bf16 linear weights for oneDNN on this CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class _Packed:
    """A linear module's packed weight and the identity of the dense weight it was packed from."""

    __slots__ = ("packed", "ptr", "version")

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.ptr, self.version = weight.data_ptr(), weight._version

    def valid_for(self, weight: torch.Tensor) -> bool:
        return (weight.data_ptr() == self.ptr and weight._version == self.version
                and weight.dtype == torch.bfloat16 and weight.is_cpu)


def _packed_forward(module: torch.nn.Linear, state: _Packed, x: torch.Tensor) -> torch.Tensor:
    # plain dict reads (module.weight goes through nn.Module.__getattr__): this runs for every product of every step
    params: dict[str, torch.Tensor] = module._parameters  # type: ignore[assignment]
    w, bias = params["weight"], params.get("bias")
    usable = (x.dtype == torch.bfloat16 and x.is_cpu and x.numel() <= MAX_ROWS * x.shape[-1] and not ROUTE.dense
              and state.valid_for(w) and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))
    if not usable:
        return F.linear(x, w, bias)
    if x.numel() == x.shape[-1]:  # one row: through the multi-row kernel (ONE_ROW)
        two = as_rows(x.reshape(1, -1))
        return torch.ops.mkldnn._linear_pointwise(two, state.packed, bias, "none", [], "")[:1].view(*x.shape[:-1], -1)
    return torch.ops.mkldnn._linear_pointwise(x, state.packed, bias, "none", [], "")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D bfloat16 input of one row as :data:`ONE_ROW` copies of it (keep the product's first row), any other
    input as it is: the rows of a bf16 product then have the bits they get among others."""
    if x.shape[0] == 1 and x.dtype == torch.bfloat16:
        return x.expand(ONE_ROW, -1).contiguous()
    return x


def pack_linears(model: PreTrainedModel) -> int:
    """Pack the weights of every ``nn.Linear`` of a bfloat16 model on the CPU (see the module docstring).

    Idempotent; does nothing (returns 0) for other dtypes or devices, without oneDNN bf16 support, or with
    ``KVRAG_PACKED_LINEAR=0``.

    Returns:
        The number of linear modules packed by this call.
    """
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off") or not packing_available():
        return 0
    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear) or getattr(mod, "_kvrag_packed", None) is not None:
            continue
        w = mod.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2:
            continue
        state = _Packed(w)
        mod._kvrag_packed = state  # type: ignore[assignment]
        mod.forward = functools.partial(_packed_forward, mod, state)  # type: ignore[method-assign]
        n += 1
    if n:
        log.debug("packed %d bf16 linear weights for oneDNN", n)
    return n


__all__ = ["ENV", "MAX_ROWS", "ONE_ROW", "as_rows", "pack_linears", "packing_available"]
