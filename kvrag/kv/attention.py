"""SDPA attention without repeated K/V heads: the ``kvrag_sdpa`` implementation registered with transformers.

On the CPU every multi-row call (a prefill, a suffix after reused chunks, a chat's next turn, RelaxKV's and
CacheBlend's recomputation over a context) runs :func:`aligned_attention`: the grouped-query K/V passed to
``scaled_dot_product_attention(..., enable_gqa=True)`` without transformers' ``repeat_kv`` copy (a large share of a
short forward over a long cache), and every row computed alike however the prompt is split into forwards, so a
position prefilled after a cached prefix gets the same bits as in one prefill of the whole prompt (tested; it is
what makes a reused conversation or cached preamble exact). A one-token query of batch 1 (a decode step:
``model.generate``, a single-token forward over a cache) over all keys or a suffix of them runs kvrag's one-token
kernel where it serves (:mod:`kvrag.kv.row_attention`), the kernel kvrag's batched and verify steps run, so
``model.generate`` and kvrag's decoding compute the same bits. Every other call (not on the CPU, extra features such
as softcap or position bias, a float mask) goes to transformers' ``sdpa`` unchanged.

It is registered through transformers' own extension points (``AttentionInterface`` and
``AttentionMaskInterface``, with SDPA's mask builder), and :func:`use_gqa_sdpa` switches a loaded model to it,
so ``model.generate`` and every kvrag path run the same attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvrag.kv import batched, row_attention
from kvrag.kv.aligned import aligned_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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
    """transformers' ``sdpa`` attention, with multi-row calls on the CPU through :func:`aligned_attention` and
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
    if (not special and not dropout and query.device.type == "cpu" and query.shape[2] > 1
            and getattr(module, "sinks", None) is None):
        causal = (attention_mask is None and is_causal is not False and getattr(module, "is_causal", True)
                  and query.shape[2] == key.shape[2])
        if causal or (attention_mask is not None and attention_mask.dtype == torch.bool
                      and attention_mask.shape[-2:] == (query.shape[2], key.shape[2])):
            return aligned_attention(query, key, value, attention_mask, scaling), None
    plain = attention_mask is None or groups == 1 or query.shape[2] == 1 or query.device.type != "cpu" or special
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``kvrag_sdpa`` with transformers (idempotent): the attention function and SDPA's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if IMPL not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPL, gqa_sdpa_attention)
    if IMPL not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(IMPL, sdpa_mask)


def attention_implementation(config: PretrainedConfig) -> str:
    """The attention implementation kvrag loads a model with: 'sdpa' (switched to ``kvrag_sdpa`` by
    :func:`use_gqa_sdpa`), or 'eager' for the families transformers refuses SDPA for (attention logit soft-capping
    in Gemma 2, attention sinks in GPT-OSS); those decode one request per step (:func:`kvrag.kv.batched.batchable`).
    Every load uses it: a checkpoint folder's, a GGUF file's and that file's one-time preparation."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)  # type: ignore[attr-defined]
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


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


__all__ = ["IMPL", "aligned_attention", "attention_implementation", "gqa_sdpa_attention", "register", "use_gqa_sdpa"]
