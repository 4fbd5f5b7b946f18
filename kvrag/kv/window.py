"""Attention windows: each layer's span of keys, the masks kvrag's own attention passes build from it, and the
engine's context limit.

Sliding-window attention (Mistral-7B-v0.1, Qwen2/Qwen3 with ``use_sliding_window``, Gemma 2/3's alternating
layers, SmolLM3 with a window) and chunked attention (Llama-4) let a query at position ``q`` see only the keys
``k > q - W`` (transformers' ``sliding_window_overlay``) or only its own aligned chunk of ``W`` tokens. kvrag serves
such models past the window, in each layer as the model computes it:

* caches keep every token: a chunk is prefilled into full cache layers (:func:`kvrag.kv.hf_cache.new_cache`; the
  model's masks apply each layer's window), so a chunk longer than a window keeps its whole, valid canonical cache,
  and a request's :class:`~kvrag.kv.hf_cache.KVBuffer` holds the whole context;
* ``full``, the suffix prefill and decoding run the model's own forward over that buffer (its masks apply the
  windows), i.e. what ``model.generate`` computes;
* what kvrag computes itself honours each layer's window: the explicit masks of selective recompute
  (:mod:`kvrag.fusion.recompute`, which runs windowed models through its layer-by-layer executor) and of the
  query-attention scoring pass (:func:`window_mask`), and the batched decode step (:mod:`kvrag.kv.batched`).

:func:`layer_windows` reads each layer's window from a config the way transformers' ``DynamicCache(config=...)`` lays
out its cache layers; :func:`attention_window` the smallest one; :func:`context_limit` is the engine's limit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from kvrag.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
#: windowed layer type -> the config field holding its window (as in transformers' ``get_layer_types_and_kwargs``)
WINDOWED_LAYER_TYPES = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


@dataclasses.dataclass(frozen=True)
class AttentionWindow:
    """The smallest attention window of a model.

    Attributes:
        size: W, the keys a query may attend to, itself included (``sliding_window`` / ``attention_chunk_size``).
        kind: the layer type that has it ('sliding_attention' or 'chunked_attention').
        layers: indices of the layers with a window of ``size`` tokens.
        num_layers: decoder layers of the model.
        model: the model's class name (for messages).
    """

    size: int
    kind: str
    layers: tuple[int, ...]
    num_layers: int
    model: str

    def describe(self) -> str:
        """One sentence naming the window and where it applies."""
        if len(self.layers) == self.num_layers:
            where = "every layer"
        elif len(self.layers) <= 6:
            where = "layers " + ", ".join(map(str, self.layers))
        else:
            where = f"{len(self.layers)} of its {self.num_layers} layers"
        what = "a sliding window" if self.kind == "sliding_attention" else "chunks"
        return f"{self.model} attends through {what} of {self.size} tokens at {where}"


class ContextLimit(int):
    """An ``int`` token limit that says where it comes from: ``str()`` gives ``"47 (<reason>)"``, so the engine's
    context-length errors name the attention window without knowing about it. Compares, formats with a spec
    (``f"{n:d}"``), serializes (JSON) and pickles as the plain number."""

    reason: str

    def __new__(cls, value: int, reason: str) -> ContextLimit:
        obj = super().__new__(cls, value)
        obj.reason = reason
        return obj

    def __str__(self) -> str:
        return f"{int(self)} ({self.reason})"

    def __reduce__(self) -> tuple[type[ContextLimit], tuple[int, str]]:
        return (ContextLimit, (int(self), self.reason))


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers: no ``decoder`` argument
        return get()


def layer_windows(config: PretrainedConfig) -> list[tuple[str, int | None]]:
    """Per decoder layer, ``(layer type, window or None)`` as the model's masks and transformers' cache use them.

    Reads ``layer_types`` when the config has it (Gemma-2/3, Qwen2/Qwen3, Llama-4, Ministral, ...), else infers the
    type from ``sliding_window`` / ``attention_chunk_size`` like transformers does. ``use_sliding_window=False``
    (Qwen2/Qwen3 configs that keep a ``sliding_window`` value they do not use) means no window.

    Raises:
        UnsupportedModelError: a layer is neither full, sliding nor chunked attention (linear attention, state-space
            or convolution layers keep no per-token K/V that kvrag could reuse).
    """
    text = _text_config(config)
    n_layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    uses_sliding = getattr(text, "use_sliding_window", True) is not False
    types = getattr(text, "layer_types", None)
    if types is None:
        if uses_sliding and getattr(text, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n_layers
        elif getattr(text, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n_layers
        else:
            types = [FULL_ATTENTION] * n_layers
    out: list[tuple[str, int | None]] = []
    for i, t in enumerate(types):
        if t == FULL_ATTENTION:
            out.append((t, None))
            continue
        field = WINDOWED_LAYER_TYPES.get(t)
        if field is None:
            msg = (
                f"layer {i} of {type(text).__name__} is a {t!r} layer; kvrag reuses per-token K/V caches and serves "
                f"only attention layers of the types {[FULL_ATTENTION, *WINDOWED_LAYER_TYPES]}. Use a model whose "
                "layers are all attention layers."
            )
            raise UnsupportedModelError(msg)
        size = getattr(text, field, None)
        if t == "sliding_attention" and not uses_sliding:
            size = None
        out.append((t, None if size is None else int(size)))
    return out


def attention_window(config: PretrainedConfig, model_name: str | None = None) -> AttentionWindow | None:
    """The smallest attention window of any layer, or None when every layer attends to its whole causal prefix.

    Args:
        config: a transformers model config (multimodal configs: their text config is read).
        model_name: used in messages (default: the config's class name).
    """
    per_layer = layer_windows(config)
    sizes = [w for _, w in per_layer if w is not None]
    if not sizes:
        return None
    size = min(sizes)
    layers = tuple(i for i, (_, w) in enumerate(per_layer) if w == size)
    kind = per_layer[layers[0]][0]
    name = model_name or type(_text_config(config)).__name__
    return AttentionWindow(size=size, kind=kind, layers=layers, num_layers=len(per_layer), model=name)


def context_limit(model: PreTrainedModel, limit: int) -> int:
    """The engine's context limit: ``limit`` (the configured / position-embedding limit), capped by the short regime
    of a length-dependent RoPE (:func:`kvrag.kv.rope.length_regime_limit`); such a cap comes back as a
    :class:`ContextLimit` whose text explains it, so the engine's ``ContextLengthError`` messages name the reason.
    Attention windows do not cap it (see the module docstring).

    Raises:
        UnsupportedModelError: see :func:`layer_windows`.
    """
    from kvrag.kv.rope import length_regime_limit

    window = attention_window(model.config, type(model).__name__)  # refuses layers that are not attention
    if window is not None:
        log.debug("%s; served past the window", window.describe())
    regime = length_regime_limit(model.config)
    if regime is not None and regime[0] < limit:  # LongRoPE / dynamic NTK: only the short regime is served
        log.info("%s; context limit %d instead of %d", regime[1], regime[0], limit)
        return ContextLimit(regime[0], regime[1])
    return int(limit)


def first_key(kind: str, size: int | None, pos: int) -> int:
    """The first key position a query at ``pos`` attends to in a layer of window ``size`` (None: every key) and
    ``kind`` (transformers' sliding / chunked mask overlays)."""
    if size is None:
        return 0
    if kind == "chunked_attention":
        return (pos // size) * size
    return max(0, pos + 1 - size)


def window_mask(kind: str, size: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[N, C] bool, True where a query at ``q_pos`` [N] may see a key at ``k_pos`` [C] under a layer's window of
    ``size`` tokens (the causal part is the caller's). Sliding: ``k > q - W`` (transformers'
    ``sliding_window_overlay``); chunked: the same aligned chunk of ``W`` positions."""
    q, k = q_pos[:, None], k_pos[None, :]
    if kind == "chunked_attention":
        return torch.div(q, size, rounding_mode="floor") == torch.div(k, size, rounding_mode="floor")
    return k > q - size


__all__ = ["AttentionWindow", "ContextLimit", "attention_window", "context_limit", "layer_windows", "window_mask"]
