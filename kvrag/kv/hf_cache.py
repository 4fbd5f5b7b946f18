"""The only module that touches transformers' Cache classes and decoder-layer internals.

Everything else in kvrag handles KV as plain tensors [L, H_kv, T, D] (batch size 1). This module converts
between those tensors and transformers caches, runs (partial) forward passes, and runs single decoder layers
over an explicit key/value context for selective recomputation.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import DynamicCache


def make_cache(keys: torch.Tensor | None, values: torch.Tensor | None, config: Any) -> DynamicCache:
    """A DynamicCache holding keys/values [L, H_kv, T, D] (placed, i.e. RoPE applied) for batch size 1."""
    cache = DynamicCache(config=config)
    if keys is None or values is None or keys.shape[2] == 0:
        return cache
    for layer in range(keys.shape[0]):
        cache.update(keys[layer].unsqueeze(0), values[layer].unsqueeze(0), layer)
    return cache


def cache_to_tensors(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a batch-1 cache into keys, values [L, H_kv, T, D]."""
    ks = [layer.keys[0] for layer in cache.layers]  # type: ignore[union-attr,index]
    vs = [layer.values[0] for layer in cache.layers]  # type: ignore[union-attr,index]
    return torch.stack(ks), torch.stack(vs)


def cache_length(cache: DynamicCache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


@torch.inference_mode()
def forward(
    model: Any,
    input_ids: torch.Tensor,
    cache: DynamicCache | None = None,
    *,
    start: int | None = None,
    logits_to_keep: int = 1,
) -> tuple[torch.Tensor, DynamicCache]:
    """Run the model on ``input_ids`` [T] at positions start..start+T-1 after ``cache``.

    Returns the logits of the last ``logits_to_keep`` positions [logits_to_keep, V] (float32) and the
    extended cache. Computing logits for the last position only keeps full prefill as fast as it can be.
    """
    if cache is None:
        cache = DynamicCache(config=model.config)
    past = cache_length(cache)
    start = past if start is None else start
    ids = input_ids.to(model.device).view(1, -1)
    pos = torch.arange(start, start + ids.shape[1], device=model.device).view(1, -1)
    out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0].float(), cache  # the DynamicCache is extended in place


def prefill_kv(model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``input_ids`` [T] from position 0 and return keys, values [L, H_kv, T, D] (RoPE applied)."""
    _, cache = forward(model, input_ids, None, start=0, logits_to_keep=1)
    return cache_to_tensors(cache)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    base = getattr(model, "model", model)
    return list(base.layers)


def embed(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings [1, T, hidden] as the model's forward computes them."""
    base = getattr(model, "model", model)
    return base.embed_tokens(input_ids.to(model.device).view(1, -1))


def rotary(model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    base = getattr(model, "model", model)
    return base.rotary_emb(hidden, positions.to(hidden.device).view(1, -1))


class _ContextCache:
    """Duck-typed cache for one decoder-layer call: prepends a fixed K/V context and records the fresh K/V.

    The attention module calls ``update(k, v, layer_idx, ...)`` with the targets' freshly projected (and
    RoPE-rotated, q/k-normed) keys and values; we return context ++ fresh so the layer attends over both.
    """

    def __init__(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor) -> None:
        self.ctx_k = ctx_k  # [1, H_kv, C, D]
        self.ctx_v = ctx_v
        self.fresh_k: torch.Tensor | None = None
        self.fresh_v: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.fresh_k, self.fresh_v = key_states, value_states
        return torch.cat([self.ctx_k, key_states], dim=-2), torch.cat([self.ctx_v, value_states], dim=-2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.ctx_k.shape[-2])


@torch.inference_mode()
def run_layer(
    model: Any,
    layer_idx: int,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run decoder layer ``layer_idx`` for target tokens over an explicit context.

    Args:
        hidden: [1, N, hidden] input hidden states of the N target tokens.
        positions: [N] global positions of the targets (for RoPE).
        ctx_k, ctx_v: [H_kv, C, D] context keys (RoPE applied) and values the targets may attend to.
        mask: [N, C + N] bool, True where target i may attend to context j / target j.

    Returns:
        (hidden_out [1, N, hidden], fresh_k [H_kv, N, D], fresh_v [H_kv, N, D]).
    """
    layer = decoder_layers(model)[layer_idx]
    cos_sin = rotary(model, hidden, positions)
    cache = _ContextCache(ctx_k.unsqueeze(0), ctx_v.unsqueeze(0))
    dtype = hidden.dtype
    bias = torch.zeros(mask.shape, dtype=dtype, device=hidden.device)
    bias.masked_fill_(~mask.to(hidden.device), torch.finfo(dtype).min)
    out = layer(
        hidden,
        attention_mask=bias.view(1, 1, *mask.shape),
        position_ids=positions.to(hidden.device).view(1, -1),
        cache=cache,
        use_cache=True,
        position_embeddings=cos_sin,
    )
    if isinstance(out, tuple):
        out = out[0]
    assert cache.fresh_k is not None and cache.fresh_v is not None
    return out, cache.fresh_k[0], cache.fresh_v[0]


# --- selective-recompute helpers (fusion methods) ------------------------------------------------------------------


class _StopAfterKV(Exception):
    """Raised by :class:`_ProjectOnlyCache` to leave a decoder layer right after its K/V projection."""


class _ProjectOnlyCache(_ContextCache):
    """Records the fresh (normed, RoPE-rotated) K/V a layer produces, then aborts the layer before attention."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.fresh_k, self.fresh_v = key_states, value_states
        raise _StopAfterKV


@torch.inference_mode()
def project_kv(
    model: Any, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V decoder layer ``layer_idx`` would write for hidden states [1, N, hidden] at global ``positions`` [N].

    Runs only the layer's input norm, projections, q/k norms and RoPE (the layer is left when it hands its fresh
    K/V to the cache), so it costs no attention. Used by CacheBlend's deviation check.

    Returns:
        (keys [H_kv, N, D] RoPE applied, values [H_kv, N, D]).
    """
    layer = decoder_layers(model)[layer_idx]
    cos_sin = rotary(model, hidden, positions)
    empty = torch.zeros(0, device=hidden.device, dtype=hidden.dtype)
    cache = _ProjectOnlyCache(empty, empty)
    try:
        layer(
            hidden,
            attention_mask=None,
            position_ids=positions.to(hidden.device).view(1, -1),
            cache=cache,
            use_cache=True,
            position_embeddings=cos_sin,
        )
    except _StopAfterKV:
        pass
    if cache.fresh_k is None or cache.fresh_v is None:
        msg = f"decoder layer {layer_idx} of {type(model).__name__} did not hand its K/V to the cache"
        raise RuntimeError(msg)
    return cache.fresh_k[0], cache.fresh_v[0]


AttentionProbe = Callable[[Any, torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], None]
_PROBE_IMPL = "kvrag_probe"
_probe_stack: list[tuple[str | None, AttentionProbe]] = []


def _default_eager(module: Any) -> Callable[..., Any]:
    """The model family's own ``eager_attention_forward`` (every transformers modeling file defines one)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return fn  # type: ignore[no-any-return]


def _probe_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    """Registered attention function: show the probe q/k, then run the model's original attention unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    orig, probe = _probe_stack[-1]
    probe(module, query, key, attention_mask, kwargs.get("scaling"))
    default = _default_eager(module)
    fn = default if orig in (None, "eager") else ALL_ATTENTION_FUNCTIONS.get_interface(orig, default)
    return fn(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def capture_attention(model: Any, probe: AttentionProbe) -> Iterator[None]:
    """While active, every attention call of ``model`` first calls ``probe(module, query, key, mask, scaling)``.

    ``query`` is [1, H, N, D] exactly as the attention kernel receives it (after q-norm, where the family has one,
    and RoPE at the tokens' global positions); ``key`` is [1, H_kv, C, D] (cache context ++ fresh keys); ``mask`` is
    the additive bias the layer got. ``module.layer_idx`` names the layer. The attention output itself is computed
    by the model's configured implementation, so hidden states are unchanged. Use it around :func:`run_layer`
    calls only: the model's own forward builds masks for the configured implementation name.
    """
    from transformers import AttentionInterface, PretrainedConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _PROBE_IMPL not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_PROBE_IMPL, _probe_attention)
    configs: dict[int, Any] = {}
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if isinstance(cfg, PretrainedConfig):
            configs[id(cfg)] = cfg
    saved = {k: cfg._attn_implementation for k, cfg in configs.items()}
    orig = getattr(model.config, "_attn_implementation", None)
    _probe_stack.append((orig, probe))
    try:
        for cfg in configs.values():
            cfg._attn_implementation = _PROBE_IMPL
        yield
    finally:
        _probe_stack.pop()
        for k, cfg in configs.items():
            cfg._attn_implementation = saved[k]
