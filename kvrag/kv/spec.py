"""KVSpec: the shape, dtype and RoPE identity of a model's KV cache, built from a model config in one place."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """Return the canonical name ('float32', 'float16', 'bfloat16') of a torch dtype."""
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    msg = f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}"
    raise ConfigError(msg)


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return DTYPES[name]
    except KeyError as e:
        msg = f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}"
        raise ConfigError(msg) from e


class KVSpecRecord(TypedDict, total=False):
    """A :class:`KVSpec`'s JSON form (in every stored entry's header); keys a version does not know are ignored."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope_type: str
    rope_pairing: str
    model_fingerprint: str


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Everything that fixes the layout of one model's KV cache.

    Attributes:
        num_layers: L, decoder layers.
        num_kv_heads: H_kv, key/value heads (GQA).
        head_dim: D.
        dtype: storage dtype name of K and V ('float32' | 'float16' | 'bfloat16').
        rope_type: transformers rope type ('default', 'linear', 'llama3', 'yarn', 'dynamic', 'longrope'; 'per-layer'
            when layer types use different ones).
        rope_pairing: 'half' (rotate_half, Llama/Qwen/Mistral/...) or 'interleaved' (Cohere, GPT-J style).
        model_fingerprint: hex digest identifying weights + architecture + compute dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope_type: str = "default"
    rope_pairing: str = "half"
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            msg = f"KVSpec dimensions must be positive, got {self}"
            raise ConfigError(msg)
        dtype_from_name(self.dtype)
        if self.rope_pairing not in ("half", "interleaved"):
            msg = f"rope_pairing must be 'half' or 'interleaved', got {self.rope_pairing!r}"
            raise ConfigError(msg)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V for one token across all layers at the storage dtype."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def with_dtype(self, dtype: str) -> KVSpec:
        return dataclasses.replace(self, dtype=dtype)

    def to_dict(self) -> KVSpecRecord:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "rope_type": self.rope_type, "rope_pairing": self.rope_pairing,
                "model_fingerprint": self.model_fingerprint}

    @classmethod
    def from_dict(cls, d: KVSpecRecord) -> KVSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        known: dict[str, Any] = {k: v for k, v in d.items() if k in fields}  # checked by __post_init__
        return cls(**known)

    @classmethod
    def from_model_config(cls, config: PretrainedConfig, *, dtype: torch.dtype | str, model_fingerprint: str = "",
                          rope_pairing: str | None = None) -> KVSpec:
        """The KVSpec of a transformers model's KV cache: the one builder the loader, engine and trainer use.

        Args:
            config: the model's config (multimodal configs: their text config is used).
            dtype: storage dtype of K and V (a ``torch.dtype`` or its name).
            model_fingerprint: :func:`kvrag.fingerprint.model_fingerprint` of the model.
            rope_pairing: 'half' (rotate_half) or 'interleaved'; default: the family's
                (:func:`kvrag.kv.rope.rope_pairing`).

        Raises:
            UnsupportedModelError: the config's RoPE is not in the support matrix
                (:func:`kvrag.kv.rope.check_rope_support`).
        """
        from kvrag.kv.rope import check_rope_support
        from kvrag.kv.rope import rope_pairing as family_pairing

        text = text_config(config)
        heads = int(text.num_attention_heads)
        return cls(
            num_layers=int(text.num_hidden_layers),
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
            rope_type=check_rope_support(config),
            rope_pairing=rope_pairing or family_pairing(config),
            model_fingerprint=model_fingerprint,
        )


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The text (decoder) part of a transformers config; the config itself for text-only models."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
