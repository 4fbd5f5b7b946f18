"""A request's KV storage (:class:`KVBuffer`) and the transformers cache layer that writes into it in place.

Split from :mod:`kvrag.kv.hf_cache` (which re-exports :class:`KVBuffer` and keeps every other use of transformers'
caches); a request's buffer is leased and sized by :mod:`kvrag.engine.lease`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvrag.errors import LeaseExceededError
from kvrag.kv import int8kv


class KVBuffer:
    """One request's KV storage, allocated once: keys/values [L, H_kv, capacity, D].

    The query path moves KV once: fetched chunk caches are rotated straight into the buffer, fusion methods write
    their fresh K/V into it in place, and the suffix prefill and every decode step append into it through
    :meth:`as_cache` (a transformers cache whose layers write in place instead of concatenating).

    A ``fixed`` buffer -- a request's, sized by its KV lease (:mod:`kvrag.engine.lease`) -- never grows: asking it
    for more than ``capacity`` positions raises :class:`~kvrag.errors.LeaseExceededError`. Any other buffer (a
    wrapped cache, a tool's scratch) grows past ``capacity`` by one copy, at least doubling.

    A buffer of ``dtype`` int8 holds decode K/V in :mod:`kvrag.kv.int8kv`'s layout ([L, H_kv, capacity, width]:
    each position's int8 values and float32 group scales). Only the batched steps read and write it (the fused step's
    kernel, or the batched attention, which quantize each fresh position as they write it); :meth:`put` quantizes
    a model-dtype buffer's positions into it (and de-quantizes them out of it, for the cache handed back after an
    answer), and a transformers cache over it (:meth:`as_cache`) is refused.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, *, fixed: bool = False) -> None:
        shape = (num_layers, num_kv_heads, max(1, capacity), int8kv.width(head_dim, dtype))
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.fixed = fixed
        self.head_dim = head_dim  # kept: an int8 position's width does not always tell it

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of keys and values one position takes in a buffer of ``dtype`` (int8: with its scales)."""
        el = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * int8kv.width(head_dim, dtype) * el

    @classmethod
    def wrap(cls, keys: torch.Tensor, values: torch.Tensor) -> KVBuffer:
        """A (growable) buffer that owns the given contiguous keys/values [L, H_kv, T, D] (no copy)."""
        buf = cls.__new__(cls)
        buf.keys, buf.values, buf.fixed, buf.head_dim = keys, values, False, int(keys.shape[3])
        return buf

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    @property
    def quantized(self) -> bool:
        """Whether the buffer holds int8 K/V (:mod:`kvrag.kv.int8kv`)."""
        return self.keys.dtype == torch.int8

    def reserve(self, n: int) -> None:
        """Make room for ``n`` positions: a no-op within ``capacity``; past it a fixed buffer refuses
        (:class:`~kvrag.errors.LeaseExceededError`), any other grows (at least doubling; keeps the contents)."""
        if n <= self.capacity:
            return
        if self.fixed:
            msg = (f"a request's KV buffer holds {self.capacity} positions, fixed when its lease was taken (prompt + "
                   f"reserve new tokens), and {n} were asked for: a leased buffer never grows; prepare the request "
                   "with a larger reserve (engine.prepare(..., reserve=max_new_tokens))")
            raise LeaseExceededError(msg)
        new = max(n, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            t = torch.empty((*old.shape[:2], new, old.shape[3]), dtype=old.dtype, device=old.device)
            t[:, :, : old.shape[2]].copy_(old)
            setattr(self, name, t)

    def put(self, src: KVBuffer, length: int) -> None:
        """Copy the first ``length`` positions of ``src`` into this buffer's first ``length`` (rounded to this
        buffer's dtype; into or out of int8, quantized or de-quantized a layer at a time); ``length`` must fit."""
        self.reserve(length)
        if src.keys.data_ptr() == self.keys.data_ptr():
            return
        if src.quantized != self.quantized:
            d = self.head_dim

            def conv(x: torch.Tensor) -> torch.Tensor:
                return int8kv.dequantize(x, d) if src.quantized else int8kv.quantize(x)

            for i in range(self.keys.shape[0]):
                self.keys[i, :, :length].copy_(conv(src.keys[i, :, :length]))
                self.values[i, :, :length].copy_(conv(src.values[i, :, :length]))
            return
        self.keys[:, :, :length].copy_(src.keys[:, :, :length])
        self.values[:, :, :length].copy_(src.values[:, :, :length])

    def context(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views keys, values [L, H_kv, n, D] of the first ``n`` positions (no copy)."""
        self.reserve(n)
        return self.keys[:, :, :n], self.values[:, :, :n]

    def as_cache(self, length: int) -> Cache:
        """A transformers cache over the first ``length`` positions that appends in place (batch size 1)."""
        if self.quantized:
            msg = ("a transformers cache over int8 K/V: only kvrag's batched steps read them (a model decoding "
                   "through its own forward needs kv_dtype='auto')")
            raise ValueError(msg)
        self.reserve(length)
        return Cache(layers=[BufferLayer(self, i, length) for i in range(self.keys.shape[0])])


class BufferLayer(DynamicLayer):
    """A DynamicLayer backed by one layer of a :class:`KVBuffer`: ``update`` writes in place, never concatenates."""

    def __init__(self, buf: KVBuffer, layer: int, length: int) -> None:
        super().__init__()
        self.buf, self.layer, self.length = buf, layer, length
        self.device = buf.keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.buf.keys[self.layer : self.layer + 1, :, : self.length]  # [1, H_kv, T, D]
        self.values = self.buf.values[self.layer : self.layer + 1, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        end = self.length + int(key_states.shape[-2])
        self.buf.reserve(end)
        self.buf.keys[self.layer, :, self.length : end].copy_(key_states[0])
        self.buf.values[self.layer, :, self.length : end].copy_(value_states[0])
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        self._views()

    def reset(self) -> None:
        self.length = 0
        self._views()


__all__ = ["BufferLayer", "KVBuffer"]
