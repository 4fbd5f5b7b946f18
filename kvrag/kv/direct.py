"""A batched step's forward run directly over the model's own modules, without transformers' per-call machinery.

A decode step of a small model is many small operations, and on the CPU the Python around them costs about as much
as some of the operations: transformers' model forward checks and routes its keyword arguments, builds masks,
collects outputs and goes through a decorated call per layer and per attention (a measurable share of a
step at batch 1, found by switching this loop on and off). gpt-fast avoids
this by writing the model itself; kvrag keeps transformers' modules -- the embeddings, rotary embedding, norms,
projections (with kvrag's quantized or packed forwards), MLP and LM head are the model's own, called in the order
and with the arguments the model's forward uses -- and only the loop around them is its own: per layer,
``x = norm(h)``, the q/k/v projections (with Qwen3's q/k norms), the family's ``apply_rotary_pos_emb``, the batched
step's row attention (:func:`kvrag.kv.batched.attention`), ``o_proj``, the residual, ``post_attention_layernorm``,
the gated MLP's ``down(act(gate(x)) * up(x))``, the residual; then the final norm and the LM head over the kept
positions. The outputs are the same bits as the model's forward (tested per family and dtype).

Gemma 3 is the same loop with its own layout: the scaled embedding module, RoPE tables per layer type (local
sliding-window and global layers), q / k norms, a norm after attention and before / after the MLP (``h + post(attn(
norm(h)))``, ``h + post_ff(mlp(pre_ff(h)))``) and the final logits soft-capped where the config sets it.

Which models: the decoder layouts written out above -- Llama, Mistral, Qwen2, Qwen3 (SmolLM2 is a Llama) and Gemma 3
-- with no forward hooks on any of their modules (the loop calls each module's ``forward`` itself, so hooks would not
run).
It is one backend of :mod:`kvrag.kv.step_backend`, which checks its first step of each model against the model's
forward (logits and written K/V, bit for bit) before it serves that model.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM")
"""Model classes whose decoder layers :func:`forward` runs (by class name, as transformers names them)."""

_all_modules: weakref.WeakKeyDictionary[PreTrainedModel, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def _hooked(modules: Sequence[torch.nn.Module]) -> bool:
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def why_not(model: PreTrainedModel) -> str | None:
    """None when :func:`forward` can run ``model``'s batched steps, else why not."""
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of the layouts it writes out ({', '.join(FAMILIES)})"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return f"{name} lacks the expected submodules"
    layers = list(inner.layers[: model.config.num_hidden_layers])
    norms = ("input_layernorm", "post_attention_layernorm", "mlp") + (
        ("pre_feedforward_layernorm", "post_feedforward_layernorm") if _sandwich(model) else ())
    for layer in layers:
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling",
                                                        "head_dim", "layer_idx")):
            return f"{name}'s attention lacks the expected projections"
        if not all(hasattr(layer, p) for p in norms):
            return f"{name}'s decoder layer lacks the expected norms / MLP"
        if not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{name}'s MLP is not the gated MLP it writes out"
    if _hooked(_modules(model)):
        return "forward hooks on the model or its modules"
    return None


def _sandwich(model: PreTrainedModel) -> bool:
    """Gemma 3's layout: norms after attention and around the MLP, RoPE tables per layer type."""
    return type(model).__name__ == "Gemma3ForCausalLM"


def _segmented(module: torch.nn.Module, x: torch.Tensor, segments: Sequence[int] | None) -> torch.Tensor:
    """``module``'s forward over ``x`` [1, T, ...] one segment of the sequence at a time (None: all at once),
    concatenated; a module with its own ``forward_segments`` (a GGUF layer: :meth:`kvrag.kv.gguf_quant.GGUFLinear.
    forward_segments`, which de-quantizes its weight once for all segments) runs them itself."""
    if segments is None:
        return module.forward(x)
    many = getattr(module, "forward_segments", None)
    if many is not None:
        return many(x, segments)  # type: ignore[no-any-return]
    outs, o = [], 0
    for q in segments:
        outs.append(module.forward(x[:, o : o + q]))
        o += q
    return torch.cat(outs, dim=1)


@torch.inference_mode()
def forward(model: PreTrainedModel, ids: torch.Tensor, pos: torch.Tensor, keep: int | torch.Tensor,
            attention: Callable[..., tuple[torch.Tensor, None]], segments: Sequence[int] | None = None) -> torch.Tensor:
    """The model's forward for a batched step (``ids`` / ``pos`` [B, S]), each layer's attention through
    ``attention(module, query, key, value, scaling)`` (the batched step's, :func:`kvrag.kv.batched.attention`).

    ``segments``: the packed sequence's rows' token counts (``ids`` [1, sum]); every linear layer then runs on one
    row's tokens at a time, each weight for all rows in turn (it stays in the CPU's cache), so a row's products
    have the shape -- and so the rounding and the weight route -- they have with the row alone; everything else is
    row-wise or per row already. GEMM kernels round differently past some row count (oneDNN bfloat16 on AMX: the
    first rows of a [M, 576] x [576, 1536] product change between M = 32 and 64), which would make a request's
    logits depend on what it was packed with.

    Returns:
        logits [B, keep, V] of the last ``keep`` positions (``keep`` 0: all; a 1D tensor: those positions, as
        transformers' ``logits_to_keep`` reads one), in the model's dtype.
    """
    inner = model.model
    rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    # each module's ``forward`` straight away: :mod:`kvrag.kv.step_backend` runs it only while no module has hooks, so
    # this is what ``module(...)`` runs, minus nn.Module's call dispatch (~300 calls a step)
    h = inner.embed_tokens.forward(ids)
    sandwich = _sandwich(model)
    if sandwich:  # a table per layer type, as Gemma3TextModel.forward builds them
        types = model.config.layer_types
        tables = {t: inner.rotary_emb.forward(h, pos, t) for t in set(types)}
    else:
        cos, sin = inner.rotary_emb.forward(h, position_ids=pos)
    b, s = ids.shape
    for i, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        if sandwich:
            cos, sin = tables[types[i]]
        a = layer.self_attn
        shape = (b, s, -1, a.head_dim)
        residual = h
        x = layer.input_layernorm.forward(h)
        q = _segmented(a.q_proj, x, segments).view(shape)
        k = _segmented(a.k_proj, x, segments).view(shape)
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        if q_norm is not None and k_norm is not None:
            q, k = q_norm.forward(q), k_norm.forward(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = _segmented(a.v_proj, x, segments).view(shape).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        o, _ = attention(a, q, k, v, a.scaling)
        o = _segmented(a.o_proj, o.reshape(b, s, -1).contiguous(), segments)
        if sandwich:
            h = residual + layer.post_attention_layernorm.forward(o)
            x = layer.pre_feedforward_layernorm.forward(h)
        else:
            h = residual + o
            x = layer.post_attention_layernorm.forward(h)
        residual = h
        mlp = layer.mlp  # transformers' gated MLP: down(act(gate(x)) * up(x))
        gate = _segmented(mlp.gate_proj, x, segments)
        up = _segmented(mlp.up_proj, x, segments)
        down = _segmented(mlp.down_proj, mlp.act_fn(gate) * up, segments)
        h = residual + (layer.post_feedforward_layernorm.forward(down) if sandwich else down)
    return head(model, h, keep)


def head(model: PreTrainedModel, h: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head over the kept positions of the last layer's output ``h`` [B, S, hidden]
    (``keep`` as :func:`forward` takes it)."""
    h = model.model.norm.forward(h)
    if isinstance(keep, torch.Tensor):
        logits = model.lm_head.forward(h[:, keep, :])
    else:
        logits = model.lm_head.forward(h if keep == 0 else h[:, -keep:, :])
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:  # as Gemma3ForCausalLM.forward (the only family here whose config sets it)
        logits = torch.tanh(logits / cap) * cap
    return logits


def _modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Every module of ``model`` (the loop calls their ``forward`` directly, so none may have hooks)."""
    mods = _all_modules.get(model)
    if mods is None:
        mods = _all_modules[model] = list(model.modules())
    return mods


__all__ = ["FAMILIES", "forward", "head", "why_not"]
