"""ChunkKV: one chunk's token ids and its canonical (RoPE-removed) KV."""

from __future__ import annotations

import dataclasses

import torch

from kvrag.errors import ConfigError
from kvrag.kv.spec import KVSpec


@dataclasses.dataclass
class ChunkKV:
    """A chunk's cache in canonical coordinates.

    Attributes:
        token_ids: [T] int64, the exact ids the chunk contributes to a prompt.
        keys: [L, H_kv, T, D] keys with RoPE removed (so they can be placed at any offset).
        values: [L, H_kv, T, D] values (position-free already).
        spec: the KVSpec the tensors follow.
        codec: the codec a stored entry was read back from (its header's: ``int8``, ``float16``, ..., or the spec's
            dtype name for a native entry); None for a cache computed or kept in this process as it is.
    """

    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    spec: KVSpec
    codec: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size())

    def validate(self) -> None:
        """Raise ConfigError when the tensors do not match the spec."""
        s = self.spec
        expected = (s.num_layers, s.num_kv_heads, self.token_ids.shape[0] if self.token_ids.dim() == 1 else -1, s.head_dim)
        if self.token_ids.dim() != 1:
            msg = f"token_ids must be 1-D [T], got shape {tuple(self.token_ids.shape)}"
            raise ConfigError(msg)
        for name, t in (("keys", self.keys), ("values", self.values)):
            if tuple(t.shape) != expected:
                msg = f"ChunkKV.{name} has shape {tuple(t.shape)}, expected [L, H_kv, T, D] = {expected}"
                raise ConfigError(msg)
