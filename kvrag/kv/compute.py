"""Compute one chunk's canonical KV cache: prefill it alone (after an optional conditioning prefix), remove RoPE.

The one way a chunk cache is made, shared by the engine (ingest and cache misses), the CacheRepair pair builder
(stale halves of its training pairs) and the test suites, so a repairer is trained on caches computed exactly like
the ones it repairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.rope import Rope
from kvrag.kv.routes import dense_products
from kvrag.kv.spec import KVSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def compute_chunk_kv(
    model: PreTrainedModel, rope: Rope, spec: KVSpec, token_ids: Sequence[int], prefix_ids: Sequence[int] = ()
) -> ChunkKV:
    """Prefill ``prefix_ids + token_ids`` and keep the chunk part, canonicalized.

    Args:
        token_ids: the chunk's T ids.
        prefix_ids: P conditioning ids (e.g. the chat template's system header acting as attention sink); their
            KV is discarded, only the chunk's T positions are returned.

    Returns:
        ChunkKV with keys/values [L, H_kv, T, D] at ``spec.dtype`` on the CPU.

    Every product takes the dense route (:func:`kvrag.kv.routes.dense_products`), so a short chunk gets the bits it
    gets inside a batch of chunks (:func:`kvrag.engine.ingest_prefill.compute_chunk_kvs`).
    """
    p = len(prefix_ids)
    ids = torch.tensor([*prefix_ids, *token_ids], dtype=torch.long)
    with dense_products():
        k, v = hf_cache.prefill_kv(model, ids)  # [L, H_kv, P+T, D]
    k, v = k[:, :, p:], v[:, :, p:]
    pos = torch.arange(p, p + len(token_ids))
    k = rope.canonicalize(k, pos)
    dt = spec.torch_dtype
    return ChunkKV(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long),
        keys=k.to("cpu", dt).contiguous(),
        values=v.to("cpu", dt).contiguous(),
        spec=spec,
    )


REROTATION_TOL = 0.1
"""Largest per-layer ``max|placed - direct| / max|direct|`` :func:`check_rerotation` accepts. Each layer is checked
on the same input hidden states at both positions, so only that layer's own rounding counts (SmolLM2-135M: 0.0000
in float32, ~0.01 in bfloat16 on every CPU kind); keys left unrotated differ by >= 0.31, so a layer that rotates
otherwise than kvrag does stands far above it. (Comparing two whole prefills instead lets bfloat16 differences
grow through the layers: 0.016 on an AVX512-BF16 CPU but 0.19 by layer 12 with AMX kernels.)"""


@torch.inference_mode()
def check_rerotation(model: PreTrainedModel, rope: Rope, *, name: str, offset: int = 37, tokens: int = 8) -> None:
    """Refuse a model whose keys kvrag's rotations do not re-position exactly: in every layer, the keys it projects
    for a few tokens' hidden states at positions 0.., re-rotated to ``offset``.., must be the keys it projects for
    the same hidden states at ``offset``.. directly.

    The layers' inputs come from one prefill at 0..; each layer's K projection, norms and RoPE then run alone
    (:func:`kvrag.kv.hf_cache.project_kv`) at both positions, so a layer is judged by its own positioning only.
    The support matrix (:func:`kvrag.kv.rope.check_rope_support`) reads RoPE from configs and rotary modules; this
    catches what they cannot show, e.g. an attention that skips RoPE in some layers in code.

    Raises:
        UnsupportedModelError: naming the first layer that differs and by how much.
    """
    from kvrag.errors import UnsupportedModelError

    vocab = int(getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                        "vocab_size", 0) or 0)
    ids = torch.arange(tokens) % max(1, vocab - 8) + 5
    hidden = hf_cache.layer_inputs(model, ids)
    at0, at_offset = torch.arange(tokens), torch.arange(offset, offset + tokens)
    k0 = torch.stack([hf_cache.project_kv(model, i, h, at0)[0] for i, h in enumerate(hidden)])
    k1 = torch.stack([hf_cache.project_kv(model, i, h, at_offset)[0] for i, h in enumerate(hidden)])
    placed = rope.place(rope.canonicalize(k0, at0), at_offset)
    scale = k1.float().abs().amax(dim=(1, 2, 3)).clamp_min(1e-12)
    err = (placed.float() - k1.float()).abs().amax(dim=(1, 2, 3)) / scale  # [L]
    bad = [i for i, e in enumerate(err.tolist()) if e > REROTATION_TOL]
    if bad:
        msg = (f"{name} ({type(model).__name__}): re-rotating cached keys does not reproduce the keys the model "
               f"computes at other positions in layer {bad[0]} (relative error {float(err[bad[0]]):.2f} > "
               f"{REROTATION_TOL}); its attention positions keys in a way kvrag does not model (e.g. RoPE skipped "
               "or applied otherwise in some layers), so its caches cannot be reused exactly")
        raise UnsupportedModelError(msg)


__all__ = ["REROTATION_TOL", "check_rerotation", "compute_chunk_kv"]
