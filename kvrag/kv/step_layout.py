"""What the fused decode step (:mod:`kvrag.kv.fused_step`) follows of each model family's decoder: where the norms
sit around attention and the MLP, the q / k norms, the multipliers, the RoPE tables of each layer and what the
output head does to the logits -- each as the family's transformers forward computes it, named by model class.

A family missing here is refused by name (:data:`REFUSED` says why, else "not a layout it writes out"), and the
model's own forward serves its steps.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder layout.

    Attributes:
        order: ``pre`` (Llama: ``h + attn(norm1(h))``, ``h + mlp(norm2(h))``), ``sandwich`` (Gemma 2/3: a norm before
            and after each of attention and the MLP, ``post_attention_layernorm`` on the attention's output and
            ``pre_`` / ``post_feedforward_layernorm`` around the MLP), ``post`` (OLMo 2: no norm before, one after
            each of attention and the MLP) or ``parallel`` (Cohere: ``h + attn(x) + mlp(x)``, ``x = norm1(h)``).
        qk_norm: ``head`` (a norm over each head's q / k: Qwen3, Gemma 3, Cohere with ``use_qk_norm``), ``full``
            (over the whole q / k projection: OLMo 2) or None.
        per_type_rope: RoPE tables per layer type (Gemma 3: ``rotary_emb(h, pos, layer_type)``).
        multipliers: Granite's ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling``.
        final_softcap: the logits soft-capped by ``config.final_logit_softcapping`` where it is set (Gemma 2/3).
        global_without_rope: global layers of a model with a window take no RoPE (EXAONE 4).
        rope_pairs: RoPE rotates interleaved pairs (2i, 2i + 1) (Cohere) instead of the halves (i, i + D/2).
        rope_wide: q / k are rotated in float32 and rounded once (Cohere: ``q.float()``; OLMo 2: float32 tables).
        logit_scale: the logits multiplied by ``config.logit_scale`` (Cohere).
        residual_last: a parallel block sums ``attn + mlp + residual`` in that order (Phi), not ``residual + attn +
            mlp``.
    """

    order: str = "pre"
    qk_norm: str | None = None
    per_type_rope: bool = False
    multipliers: bool = False
    final_softcap: bool = False
    global_without_rope: bool = False
    rope_pairs: bool = False
    rope_wide: bool = False
    logit_scale: bool = False
    residual_last: bool = False


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(qk_norm="head"),
    "GemmaForCausalLM": Family(),
    "Gemma3ForCausalLM": Family("sandwich", "head", per_type_rope=True, final_softcap=True),
    "GraniteForCausalLM": Family(multipliers=True),
    "SmolLM3ForCausalLM": Family(),
    "Phi3ForCausalLM": Family(),
    "Olmo2ForCausalLM": Family("post", "full", rope_wide=True),
    "CohereForCausalLM": Family("parallel", rope_pairs=True, rope_wide=True, logit_scale=True),
    "StableLmForCausalLM": Family(),
    "PhiForCausalLM": Family("parallel", residual_last=True),
    "Exaone4ForCausalLM": Family("post", "head", global_without_rope=True),
}
"""Model classes the fused step runs (by class name, as transformers names them)."""

REFUSED: dict[str, str] = {
    "Gemma2ForCausalLM": "attention logit soft-capping: transformers runs it with eager attention, so its requests "
                         "decode one per step through the model's forward",
    "GptOssForCausalLM": "attention sinks: transformers runs it with eager attention, so its requests decode one per "
                         "step through the model's forward",
    "GPTNeoXForCausalLM": "its fused query_key_value lays q, k and v out head by head (kvrag's kernel reads the q, "
                          "k and v blocks side by side)",
}
"""Families the fused step does not run, with why (the model's forward serves them)."""


def order(model: PreTrainedModel) -> str:
    """``model``'s :attr:`Family.order` (StableLM with ``use_parallel_residual``: ``parallel``)."""
    fam = FAMILIES[type(model).__name__]
    return "parallel" if fam.order == "pre" and getattr(model.config, "use_parallel_residual", False) else fam.order


def rotary_dim(model: PreTrainedModel) -> int:
    """How many dimensions of each head RoPE rotates (``partial_rotary_factor`` of the head; the rest pass)."""
    cfg = model.config
    d = int(model.model.layers[0].self_attn.head_dim)
    rp = getattr(cfg, "rope_parameters", None)
    factor = (rp.get("partial_rotary_factor") if isinstance(rp, dict) else None) or getattr(
        cfg, "partial_rotary_factor", None) or 1.0
    return int(d * float(factor))


def why_not(model: PreTrainedModel) -> str | None:
    """None when ``model``'s class and modules are a layout of :data:`FAMILIES`, else why not."""
    name = type(model).__name__
    fam = FAMILIES.get(name)
    if fam is None:
        return f"{name}: {REFUSED.get(name, 'not one of the layouts it writes out')}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers")) or not (
            hasattr(inner, "norm") or hasattr(inner, "final_layernorm")):
        return f"{name} lacks the expected submodules"
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "use_bidirectional_attention", False):
        return f"{name}: attention logit soft-capping or bidirectional attention"
    norms = {"pre": ("input_layernorm", "post_attention_layernorm"),
             "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm"),
             "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
             "parallel": ("input_layernorm",)}[order(model)]
    for layer in inner.layers[: cfg.num_hidden_layers]:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or mlp is None or not all(hasattr(layer, n) for n in norms):
            return f"{name}'s decoder layer lacks the expected norms / attention / MLP"
        if not (hasattr(a, "qkv_proj") or all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj"))) or not all(
                hasattr(a, p) for p in ("scaling", "head_dim")) or not (hasattr(a, "o_proj") or hasattr(a, "dense")):
            return f"{name}'s attention lacks the expected projections"
        gated = hasattr(mlp, "down_proj") and (hasattr(mlp, "gate_up_proj") or all(
            hasattr(mlp, p) for p in ("gate_proj", "up_proj", "act_fn")))
        if not (gated or (hasattr(mlp, "fc1") and hasattr(mlp, "fc2"))):  # Phi: fc2(act(fc1(x))), its own forward
            return f"{name}'s MLP is neither a gated MLP nor fc1 / fc2"
        has_q, has_k = getattr(a, "q_norm", None) is not None, getattr(a, "k_norm", None) is not None
        if has_q != has_k or has_q != (fam.qk_norm is not None) and not (fam.rope_pairs and has_q) \
                or hasattr(a, "q_layernorm"):
            return f"{name}: q / k norms other than the family's ({fam.qk_norm or 'none'})"
    return None


def rope_key(model: PreTrainedModel, i: int) -> str | None:
    """Which RoPE table layer ``i`` uses: '' (the model's one table), a layer type (Gemma 3) or None (no RoPE:
    SmolLM3's ``use_rope`` False layers, EXAONE 4's global layers where it has a window)."""
    a = model.model.layers[i].self_attn
    fam = FAMILIES[type(model).__name__]
    if not getattr(a, "use_rope", True) or (fam.global_without_rope and a.sliding_window is not None
                                               and not a.is_sliding):
        return None
    if fam.per_type_rope:
        return str(model.config.layer_types[i])
    return ""


def rope_tables(model: PreTrainedModel, keys: set[str | None], h: torch.Tensor,
                pos: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """The RoPE tables ([Q, D] cos, sin, contiguous) of each key of :func:`rope_key` for positions ``pos``, as the
    model's forward computes them (None for None)."""
    rot = model.model.rotary_emb
    out: dict[str | None, tuple[torch.Tensor, torch.Tensor] | None] = {}
    n = pos.numel()
    for k in keys:
        if k is None:
            out[k] = None
            continue
        cos, sin = rot.forward(h, pos, k) if k else rot.forward(h, position_ids=pos)
        out[k] = (cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous())
    return out


def embed(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    """The model forward's input embeddings of ``ids``."""
    h = model.model.embed_tokens.forward(ids)
    if FAMILIES[type(model).__name__].multipliers:
        h = h * model.model.embedding_multiplier
    return h


def head(model: PreTrainedModel, h: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """The final norm, the LM head over the kept positions (``keep``: 0 all, n the last n, a 1D tensor those) and
    the family's logit scaling or soft-capping, as its forward computes them."""
    inner = model.model
    h = (inner.norm if hasattr(inner, "norm") else inner.final_layernorm).forward(h)
    if isinstance(keep, torch.Tensor):
        logits = model.lm_head.forward(h[:, keep, :])
    else:
        logits = model.lm_head.forward(h if keep == 0 else h[:, -keep:, :])
    fam = FAMILIES[type(model).__name__]
    if fam.multipliers:
        logits = logits / model.config.logits_scaling
    if fam.logit_scale:
        logits = logits * model.logit_scale
    cap = getattr(model.config, "final_logit_softcapping", None) if fam.final_softcap else None
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


__all__ = ["FAMILIES", "REFUSED", "Family", "embed", "head", "order", "rope_key", "rope_tables", "rotary_dim",
           "why_not"]
