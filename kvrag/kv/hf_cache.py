"""The only module that touches transformers' Cache classes and decoder-layer internals (with
:mod:`kvrag.kv.kvbuffer`, the request buffer's cache layer; :class:`KVBuffer` is re-exported here).

Everything else in kvrag handles KV as plain tensors [L, H_kv, T, D] (batch size 1). This module converts between
those tensors and transformers caches, runs (partial) forward passes, and runs single decoder layers over an explicit
key/value context for selective recomputation."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from transformers.cache_utils import Cache, DynamicCache

from kvrag.kv.kvbuffer import BufferLayer, KVBuffer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class LayerCache(Protocol):
    """A decoder layer's cache as its attention calls it: ``update`` gets the fresh K/V, returns what it reads."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> Any: ...


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model`` that keeps every token: transformers' sliding-window cache layers keep only the
    last ``W - 1`` tokens, so a model with windowed layers gets full layers (its masks still apply each layer's
    window), which lets a chunk longer than a window keep its whole cache."""
    return _full_cache(model.config)


def _full_cache(config: PretrainedConfig) -> DynamicCache:
    from kvrag.kv.window import layer_windows

    if any(w is not None for _, w in layer_windows(config)):
        return DynamicCache()
    return DynamicCache(config=config)


def make_cache(keys: torch.Tensor | None, values: torch.Tensor | None, config: PretrainedConfig) -> DynamicCache:
    """A DynamicCache holding keys/values [L, H_kv, T, D] (placed, i.e. RoPE applied) for batch size 1 (every token
    kept, also in sliding-window layers)."""
    cache = _full_cache(config)
    if keys is None or values is None or keys.shape[2] == 0:
        return cache
    for layer in range(keys.shape[0]):
        cache.update(keys[layer].unsqueeze(0), values[layer].unsqueeze(0), layer)
    return cache


def cache_to_tensors(cache: Cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys, values [L, H_kv, T, D] of a batch-1 cache (views of the buffer for a :meth:`KVBuffer.as_cache`
    cache, else stacked copies)."""
    layers = list(cache.layers)
    if layers and all(isinstance(layer, BufferLayer) for layer in layers):
        first = layers[0]
        assert isinstance(first, BufferLayer)
        if all(layer.length == first.length for layer in layers):  # type: ignore[union-attr]
            return first.buf.keys[:, :, : first.length], first.buf.values[:, :, : first.length]
    ks = [layer.keys[0] for layer in cache.layers]  # type: ignore[union-attr,index]
    vs = [layer.values[0] for layer in cache.layers]  # type: ignore[union-attr,index]
    return torch.stack(ks), torch.stack(vs)


def buffer_of(cache: Cache) -> tuple[KVBuffer, int]:
    """The request buffer behind a batch-1 cache and the positions it holds: the buffer itself for a
    :meth:`KVBuffer.as_cache` cache (no copy), else a new buffer holding a copy of the cache's keys/values."""
    layers = list(cache.layers)
    if layers and all(isinstance(layer, BufferLayer) for layer in layers):
        first = layers[0]
        assert isinstance(first, BufferLayer)
        if all(layer.buf is first.buf and layer.length == first.length for layer in layers):  # type: ignore[union-attr]
            return first.buf, first.length
    keys, values = cache_to_tensors(cache)
    return KVBuffer.wrap(keys.contiguous(), values.contiguous()), int(keys.shape[2])


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


@torch.inference_mode()
def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: Cache | None = None,
    *,
    start: int | None = None,
    logits_to_keep: int = 1,
) -> tuple[torch.Tensor, Cache]:
    """Run the model on ``input_ids`` [T] at positions start..start+T-1 after ``cache``.

    Returns the logits of the last ``logits_to_keep`` positions [logits_to_keep, V] (float32) and the
    extended cache. Computing logits for the last position only keeps full prefill as fast as it can be.
    """
    if cache is None:
        cache = new_cache(model)
    past = cache_length(cache)
    start = past if start is None else start
    ids = input_ids.to(model.device).view(1, -1)
    pos = torch.arange(start, start + ids.shape[1], device=model.device).view(1, -1)
    out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0].float(), cache  # the DynamicCache is extended in place


def prefill_kv(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``input_ids`` [T] from position 0 and return keys, values [L, H_kv, T, D] (RoPE applied)."""
    _, cache = forward(model, input_ids, None, start=0, logits_to_keep=1)
    return cache_to_tensors(cache)


@torch.inference_mode()
def layer_inputs(model: PreTrainedModel, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states [1, T, hidden] each decoder layer receives when ``input_ids`` [T] are prefilled from
    position 0 (captured by forward pre-hooks, so whatever a family does before its layers is included)."""
    seen: list[torch.Tensor] = []

    def grab(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    hooks = [layer.register_forward_pre_hook(grab, with_kwargs=True) for layer in decoder_layers(model)]
    try:
        forward(model, input_ids, None, start=0, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return seen


def logits_head(model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``head(hidden [1, N, hidden]) -> logits [N, V]`` (float32) as the model's forward computes them from its
    last decoder layer's output (final norm, then the LM head); None for families that post-process logits
    (soft-capping, scaling) or are laid out otherwise, whose own forward must compute them."""
    cfg = model.config
    if (getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0)
            or getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0)):
        return None
    base = getattr(model, "model", model)
    norm, lm_head = getattr(base, "norm", None), model.get_output_embeddings()
    if norm is None or lm_head is None:
        return None
    @torch.inference_mode()
    def head(hidden: torch.Tensor) -> torch.Tensor:
        return lm_head(norm(hidden))[0].float()  # type: ignore[no-any-return]

    return head


def _base(model: PreTrainedModel) -> Any:
    """The decoder stack under the LM head (``model.model``, or e.g. GPT-NeoX's ``model.gpt_neox``)."""
    base = getattr(model, "model", None)
    return base if base is not None else getattr(model, "base_model", model)


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    return list(_base(model).layers)


def embed(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings [1, T, hidden] as the model's forward computes them (with Granite's embedding multiplier;
    Gemma's scaled embedding module scales itself)."""
    base = _base(model)
    hidden = model.get_input_embeddings()(input_ids.to(model.device).view(1, -1))
    mult = getattr(base, "embedding_multiplier", None)
    return hidden if mult is None else hidden * mult


def rotary(model: PreTrainedModel, hidden: torch.Tensor, positions: torch.Tensor,
           layer_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) the model's forward hands decoder layer ``layer_idx``: those of the layer's type where the
    rotary module has one set per layer type (Gemma 3)."""
    base = _base(model)
    rot = base.rotary_emb
    pos = positions.to(hidden.device).view(1, -1)
    if getattr(rot, "layer_types", None) and layer_idx is not None:
        return rot(hidden, pos, base.config.layer_types[layer_idx])  # type: ignore[no-any-return]
    return rot(hidden, pos)  # type: ignore[no-any-return]


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
    model: PreTrainedModel,
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
    cache = _ContextCache(ctx_k.unsqueeze(0), ctx_v.unsqueeze(0))
    dtype = hidden.dtype
    bias = torch.zeros(mask.shape, dtype=dtype, device=hidden.device)
    bias.masked_fill_(~mask.to(hidden.device), torch.finfo(dtype).min)
    out = call_layer(model, layer_idx, hidden, positions, cache, bias.view(1, 1, *mask.shape))
    assert cache.fresh_k is not None and cache.fresh_v is not None
    return out, cache.fresh_k[0], cache.fresh_v[0]


def call_layer(
    model: PreTrainedModel, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor, cache: LayerCache,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Decoder layer ``layer_idx`` on hidden states [1, N, hidden] at global ``positions`` [N] with a duck-typed
    ``cache`` (its ``update`` receives the layer's fresh K/V and returns what the attention reads) and an additive
    ``attention_mask`` [1, 1, N, C] (None where a probe computes the attention). Returns the layer's output
    [1, N, hidden]. The one place that knows a decoder layer's calling convention."""
    layer = decoder_layers(model)[layer_idx]
    cache_kw = "layer_past" if _takes_layer_past(cast(Any, type(layer))) else "cache"  # GPT-NeoX names it layer_past
    out = layer(
        hidden,
        attention_mask=attention_mask,
        position_ids=positions.to(hidden.device).view(1, -1),
        use_cache=True,
        position_embeddings=rotary(model, hidden, positions, layer_idx),
        **{cache_kw: cache},
    )
    return out[0] if isinstance(out, tuple) else out


@functools.lru_cache(maxsize=64)
def _takes_layer_past(layer_type: Any) -> bool:
    params = inspect.signature(layer_type.forward).parameters
    return "layer_past" in params and "cache" not in params


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels so wall-clock timings are honest on accelerators."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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
    model: PreTrainedModel, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V decoder layer ``layer_idx`` would write for hidden states [1, N, hidden] at global ``positions`` [N].

    Runs only the layer's input norm, projections, q/k norms and RoPE (the layer is left when it hands its fresh
    K/V to the cache), so it costs no attention. Used by CacheBlend's deviation check.

    Returns:
        (keys [H_kv, N, D] RoPE applied, values [H_kv, N, D]).
    """
    empty = torch.zeros(0, device=hidden.device, dtype=hidden.dtype)
    cache = _ProjectOnlyCache(empty, empty)
    try:
        call_layer(model, layer_idx, hidden, positions, cache, None)
    except _StopAfterKV:
        pass
    if cache.fresh_k is None or cache.fresh_v is None:
        msg = f"decoder layer {layer_idx} of {type(model).__name__} did not hand its K/V to the cache"
        raise RuntimeError(msg)
    return cache.fresh_k[0], cache.fresh_v[0]


AttentionProbe = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], None]
_PROBE_IMPL = "kvrag_probe"
# id(config) -> stack of (that config's own attention implementation, probe). Keyed per config (i.e. per model),
# never process-global, so a probe only ever sees the attention calls of the model it was installed on.
_probes: dict[int, list[tuple[str | None, AttentionProbe]]] = {}
_model_locks: weakref.WeakKeyDictionary[PreTrainedModel, threading.RLock] = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def model_lock(model: PreTrainedModel) -> threading.RLock:
    """The re-entrant lock of ``model`` (one per model object, shared by every engine built on it).

    :func:`capture_attention` switches the attention implementation in the model's (shared) config for its
    duration, so every forward of that model -- by any engine, any thread -- must hold this lock: a forward that runs
    while another thread's probe is installed would go through that probe."""
    with _model_locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


def held_here(lock: threading.RLock) -> bool:
    """Whether the calling thread holds ``lock`` (a :func:`model_lock`): true inside a prepare, where nothing may wait
    on a caller the model work blocks."""
    return bool(lock._is_owned())  # type: ignore[attr-defined]


def _default_eager(module: torch.nn.Module) -> Callable[..., Any]:
    """The model family's own ``eager_attention_forward`` (every transformers modeling file defines one)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    return fn  # type: ignore[no-any-return]


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    """Registered attention function: show the probe q/k, then run the model's original attention unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stack = _probes.get(id(module.config))
    if not stack:
        msg = (f"attention implementation {_PROBE_IMPL!r} called for {type(module).__name__} without an active "
               "capture_attention() on its model; the probe is only valid inside that context")
        raise RuntimeError(msg)
    orig, probe = stack[-1]
    if getattr(probe, "computes_attention", False):  # the probe returns the attention output itself
        out = probe(module, query, key, attention_mask, kwargs.get("scaling"), value)  # type: ignore[call-arg]
        if out is not None:
            return out
    else:
        probe(module, query, key, attention_mask, kwargs.get("scaling"))
    default = _default_eager(module)
    fn = default if orig in (None, "eager") else ALL_ATTENTION_FUNCTIONS.get_interface(orig, default)
    return fn(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def capture_attention(model: PreTrainedModel, probe: AttentionProbe) -> Iterator[None]:
    """While active, every attention call of ``model`` first calls ``probe(module, query, key, mask, scaling)``.

    ``query`` is [1, H, N, D] exactly as the attention kernel receives it (after q-norm, where the family has one,
    and RoPE at the tokens' global positions); ``key`` is [1, H_kv, C, D] (cache context ++ fresh keys); ``mask`` is
    the additive bias the layer got. ``module.layer_idx`` names the layer. The attention output itself is computed
    by the model's configured implementation, so hidden states are unchanged -- unless the probe has an attribute
    ``computes_attention = True``: it is then called with ``value`` [1, H_kv, C, D] as a sixth argument and may
    return ``(attn_output [1, N, H, D], None)`` (eager attention's layout), which the layer uses instead, so the
    probe computes the attention once instead of beside the kernel; returning None falls back to the kernel. Use it around :func:`run_layer`
    calls only: the model's own forward builds masks for the configured implementation name.

    Holds :func:`model_lock` for its duration (the model's config is switched to the probe implementation); callers
    that run other forwards of the same model from other threads must hold that lock too (the engine does).
    Re-entrant: a nested capture on the same model shadows the outer probe until it exits.
    """
    from transformers import AttentionInterface, PretrainedConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _PROBE_IMPL not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(_PROBE_IMPL, _probe_attention)
    with model_lock(model):
        configs: dict[int, PretrainedConfig] = {}
        for mod in model.modules():
            cfg = getattr(mod, "config", None)
            if isinstance(cfg, PretrainedConfig):
                configs[id(cfg)] = cfg
        saved = {k: cfg._attn_implementation for k, cfg in configs.items()}
        for k in configs:
            stack = _probes.setdefault(k, [])
            # the implementation to run after the probe: the config's own, or the outer capture's original
            stack.append((stack[-1][0] if stack else saved[k], probe))
        try:
            for cfg in configs.values():
                cfg._attn_implementation = _PROBE_IMPL
            yield
        finally:
            for k, cfg in configs.items():
                cfg._attn_implementation = saved[k]
                stack = _probes[k]
                stack.pop()
                if not stack:
                    del _probes[k]
