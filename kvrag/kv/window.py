"""Attention windows: the smallest span of keys any layer of a model attends to, and the context limit it sets.

Sliding-window attention (Mistral-7B-v0.1, Qwen2/Qwen3 with ``use_sliding_window``, Gemma-2/3's alternating
layers) and chunked attention (Llama-4) let a query at position ``q`` see only the keys ``k > q - W``
(transformers' ``sliding_window_overlay``) or only its own aligned chunk of ``W`` tokens. Within one window, i.e.
for sequences of at most ``W`` tokens, both are exactly full causal attention, so every kvrag path (chunk prefill,
re-rotation, the explicit masks of selective recompute, the scoring pass) is exact there. Beyond it they are not:
the recompute masks and the scoring pass are causal, and transformers' sliding-window cache layer
(``DynamicSlidingWindowLayer``) keeps only the last ``W - 1`` tokens, so a chunk's prefilled cache would come back
truncated. kvrag therefore serves such a model within ``W - 1`` tokens (the longest prefill whose cache keeps every
token) and refuses longer chunks and prompts with :class:`~kvrag.errors.ContextLengthError` naming the window.

Generation may run past the window: decoding uses the model's own forward and transformers' sliding cache, i.e.
exactly what ``model.generate`` computes.

:func:`context_limit` is the one entry point (``KVRAGEngine.__init__`` calls it); :func:`attention_window` reads
the window from a config the way transformers' ``DynamicCache(config=...)`` lays out its cache layers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvrag.errors import UnsupportedModelError

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

    @property
    def max_tokens(self) -> int:
        """Longest sequence kvrag serves exactly: W - 1 (transformers' sliding cache layer keeps W - 1 tokens)."""
        return max(1, self.size - 1)

    def describe(self) -> str:
        """One sentence naming the window and what a request needs to be served."""
        if len(self.layers) == self.num_layers:
            where = "every layer"
        elif len(self.layers) <= 6:
            where = "layers " + ", ".join(map(str, self.layers))
        else:
            where = f"{len(self.layers)} of its {self.num_layers} layers"
        what = "a sliding window" if self.kind == "sliding_attention" else "chunks"
        return (
            f"{self.model} attends through {what} of {self.size} tokens at {where}; kvrag serves it exactly only "
            f"within one window (there windowed attention equals full causal attention; transformers' sliding cache "
            f"keeps {self.size - 1} tokens), so a chunk with its conditioning prefix, and a whole prompt, must fit "
            f"in {self.max_tokens} tokens -- or use a model with full attention"
        )


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

    def __reduce__(self) -> tuple[Any, tuple[int, str]]:
        return (ContextLimit, (int(self), self.reason))


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older transformers: no ``decoder`` argument
        return get()


def layer_windows(config: Any) -> list[tuple[str, int | None]]:
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


def attention_window(config: Any, model_name: str | None = None) -> AttentionWindow | None:
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


def context_limit(model: Any, limit: int) -> int:
    """The engine's context limit: ``limit`` (the configured / position-embedding limit), capped by the short regime
    of a length-dependent RoPE (:func:`kvrag.kv.rope.length_regime_limit`) and by the model's attention window (:attr:`AttentionWindow.max_tokens`). A cap comes back as a :class:`ContextLimit` whose text
    explains it, so the engine's ``ContextLengthError`` messages name the window and what would fit.

    Raises:
        UnsupportedModelError: see :func:`layer_windows`.
    """
    from kvrag.kv.rope import length_regime_limit

    regime = length_regime_limit(model.config)
    if regime is not None and regime[0] < limit:  # LongRoPE / dynamic NTK: only the short regime is served
        log.info("%s; context limit %d instead of %d", regime[1], regime[0], limit)
        limit = ContextLimit(regime[0], regime[1])
    window = attention_window(model.config, type(model).__name__)
    if window is None or limit <= window.max_tokens:
        return limit if isinstance(limit, ContextLimit) else int(limit)
    log.info("%s; context limit %d instead of %d", window.describe(), window.max_tokens, limit)
    return ContextLimit(window.max_tokens, window.describe())


__all__ = ["AttentionWindow", "ContextLimit", "attention_window", "context_limit", "layer_windows"]
