"""The memory bound of a decode step: the bytes one step reads and the machine's copy bandwidth, shared by
``kvrag bench decode`` (:mod:`kvrag_bench.decode_bench`) and ``kvrag bench load`` (:mod:`kvrag_bench.load_sweep`)."""

from __future__ import annotations

import time
from typing import Any


def step_bytes(model: Any, rows: int, context: int, kv_bytes: float | None = None) -> int:
    """Bytes one decode step reads: every linear weight once in its current format (a GGUF layer's int4 layout or
    blocks), one embedding row per row,
    every other parameter (norms), and each row's KV over ``context`` positions (``kv_bytes`` per element, an int8
    position's scale shared out over its elements; None: the model dtype's)."""
    import torch

    from kvrag.kv.gguf_quant import GGUFLinear
    from kvrag.kv.quant import quantized_bytes

    linear, other = 0, 0
    quantized = {id(m.weight) for m in model.modules() if getattr(m, "_kvrag_quant", None) is not None}
    emb = model.get_input_embeddings().weight
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and id(mod.weight) not in quantized:
            linear += mod.weight.numel() * mod.weight.element_size()
        elif isinstance(mod, GGUFLinear):  # a GGUF file's layer: its int4 layout, else its blocks
            linear += mod.int4.nbytes if mod.int4 is not None else mod.blocks.numel() * mod.blocks.element_size()
    seen = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} | {id(emb)}
    for p in model.parameters():
        if id(p) not in seen:
            other += p.numel() * p.element_size()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = int(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (kv_bytes or emb.element_size())
             * context)
    return linear + quantized_bytes(model) + other + rows * (emb.shape[1] * emb.element_size() + kv)


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (what streaming the weights once costs)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


__all__ = ["copy_bandwidth", "step_bytes"]
