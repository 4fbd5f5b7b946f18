"""SDPA attention without repeated K/V heads: the ``kvrag_sdpa`` implementation registered with transformers.

With grouped-query attention and an explicit mask (every forward that continues a cache: the suffix prefill after
the reused chunks, RelaxKV's and CacheBlend's recomputation over a context, CacheRepair-hybrid anchors),
transformers' ``sdpa`` implementation copies every layer's keys and values ``num_key_value_groups`` times
(``repeat_kv``) before calling ``scaled_dot_product_attention``, because it enables SDPA's own GQA broadcasting
only for mask-free calls. On the CPU that copy is a large share of a short forward over a long cache (a question
suffix over thousands of cached tokens: the copy moves every cached K/V ``num_key_value_groups`` times, the
attention reads it once). ``kvrag_sdpa`` passes the mask and the
un-repeated K/V to ``scaled_dot_product_attention(..., enable_gqa=True)`` instead, which gives bit-identical
outputs (tested) without the copy. A one-token query of batch 1 (a decode step: ``model.generate``, a single-token
forward over a cache) over all keys or a suffix of them runs kvrag's one-token kernel where it serves
(:mod:`kvrag.kv.row_attention`), the kernel kvrag's batched and verify steps run, so ``model.generate`` and kvrag's
decoding compute the same bits. Every other call (no mask, no GQA, not on the CPU, extra features such as softcap or
position bias) goes to transformers' ``sdpa`` unchanged.

It is registered through transformers' own extension points (``AttentionInterface`` and
``AttentionMaskInterface``, with SDPA's mask builder), and :func:`use_gqa_sdpa` switches a loaded model to it,
so ``model.generate`` and every kvrag path run the same attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvrag.kv import batched, row_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMPL = "kvrag_sdpa"
"""The registered implementation name (``model.config._attn_implementation`` after :func:`use_gqa_sdpa`)."""


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, with masked grouped-query calls on the CPU broadcasting K/V heads and
    one-token calls through kvrag's row attention."""
    if batched.active():  # a batched decode step: each row attends to its own request buffer (kvrag.kv.batched)
        return batched.attention(module, query, key, value, scaling)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    special = (  # what neither kvrag's GQA call nor its row attention computes
        key.shape[-1] != value.shape[-1]
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
        or module.training
    )
    if (query.shape[2] == 1 and query.shape[0] == 1 and not special and not dropout
            and getattr(module, "sinks", None) is None and row_attention.serves(query)):
        start = row_attention.window_start(attention_mask, key.shape[2])
        if start is not None:  # the kernel kvrag's decode steps use (see there)
            out = torch.empty((1, 1, query.shape[1], value.shape[-1]), dtype=query.dtype)
            return row_attention.attend(query, [(key[0], value[0], start, key.shape[2])], out, scaling), None
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if (not special and not dropout and query.device.type == "cpu" and attention_mask is not None
            and attention_mask.dtype == torch.bool and query.shape[2] >= BAND_MIN_QUERIES
            and attention_mask.shape[-2:] == (query.shape[2], key.shape[2])):
        return banded_attention(query, key, value, attention_mask, scaling), None
    plain = attention_mask is None or groups == 1 or query.shape[2] == 1 or query.device.type != "cpu" or special
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


BAND_MIN_QUERIES = 512
"""Masked calls with at least this many queries run :func:`banded_attention`."""
BAND_QUERY_BLOCK = 256
"""Queries per call in :func:`banded_attention`."""
KEY_ALIGN = 512
"""A block's first key is rounded down to a multiple of this: torch's CPU flash attention walks keys in blocks of
512 from the first key it is given, so an aligned start keeps a row's key blocks, and so its sums, where a call over
all keys has them."""


def banded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    """SDPA over ``query`` in blocks of :data:`BAND_QUERY_BLOCK` rows, each over only the keys its mask rows allow.

    A long prefill's mask is a band: causal (a block's rows see no key after its last row) and, in sliding-window
    layers (Gemma 2/3, Mistral, Qwen2's windows...), none before its first row's window. torch's CPU flash
    attention reads every key of an explicit mask, so one call over 2K queries in a 512-token window computes
    four times the scores it keeps. Here each block's call gets the keys from the first its rows allow (rounded
    down to :data:`KEY_ALIGN`) to the last, and the mask cut to them; the keys left out are masked for every row
    of the block, so they add exact zeros to its sums. Returns [batch, queries, heads, head_dim] as
    transformers' attention functions do.

    Args:
        query: [batch, heads, queries, head_dim].
        key, value: [batch, kv_heads, keys, head_dim]; kv_heads divides heads (grouped-query attention).
        mask: bool [batch, 1 or heads, queries, keys], True where a query attends.
        scaling: the softmax scale (None: 1/sqrt(head_dim)).
    """
    n_q, n_k = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    out = torch.empty((query.shape[0], n_q, query.shape[1], value.shape[-1]), dtype=query.dtype)
    cols = torch.arange(n_k)
    for q0 in range(0, n_q, BAND_QUERY_BLOCK):
        q1 = min(n_q, q0 + BAND_QUERY_BLOCK)
        rows = mask[:, :, q0:q1]
        seen = cols[rows.any(dim=2).any(dim=1).any(dim=0)]
        k0, k1 = (0, n_k) if seen.numel() == 0 else (int(seen[0]) // KEY_ALIGN * KEY_ALIGN, int(seen[-1]) + 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], attn_mask=rows[..., k0:k1], scale=scaling,
            enable_gqa=gqa)
        out[:, q0:q1] = o.transpose(1, 2)
    return out


def register() -> None:
    """Register ``kvrag_sdpa`` with transformers (idempotent): the attention function and SDPA's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if IMPL not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPL, gqa_sdpa_attention)
    if IMPL not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(IMPL, sdpa_mask)


def use_gqa_sdpa(model: PreTrainedModel) -> bool:
    """Switch a model that runs transformers' ``sdpa`` to ``kvrag_sdpa``; True when it was switched.

    Models configured for another implementation (eager, flash attention, ...) are left as they are.
    """
    from transformers import PretrainedConfig

    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
    if not configs or any(getattr(c, "_attn_implementation", None) != "sdpa" for c in configs.values()):
        return False
    register()
    for c in configs.values():
        c._attn_implementation = IMPL
    return True


__all__ = ["IMPL", "gqa_sdpa_attention", "register", "use_gqa_sdpa"]
