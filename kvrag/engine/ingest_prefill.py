"""Batched chunk prefill for ingest: several chunks per forward, each exactly as if prefilled alone.

:func:`compute_chunk_kvs` is the batched counterpart of :func:`kvrag.engine.assemble.compute_chunk_kv`. Every chunk
is conditioned on the same prefix (the chat template's system header), so the prefix is prefilled **once** and its
K/V is shared by every row of every batch. Chunks are grouped by length (sorted, so a batch pads little), right-
padded to the batch's longest chunk and prefilled together after the shared prefix at positions ``P .. P+T-1``.

Why this is exact: attention is causal, so a chunk's real token ``i`` only attends to the prefix and to its own
tokens ``<= i``; right padding only ever comes *after* a row's real tokens and is masked as well (``attention_mask``
0), so it cannot reach them. A row's K/V therefore equals its one-at-a-time prefill up to floating-point summation
order (measured fp32 max abs diff: ~1e-6 on the tiny models, <= 3.4e-5 on SmolLM2-135M; tests use 1e-4). Every
product takes the dense route (:func:`kvrag.kv.routes.dense_products`), as a chunk alone does: a short chunk's rows
would otherwise take the decode products alone and the dense ones in a batch.

Like ``hf_cache``, this module touches transformers' ``DynamicCache`` (only to seed it with the shared prefix and to
read the batch's K/V back); ``hf_cache`` handles batch size 1 only. Sliding-window caches (which drop old tokens)
are not batched: a batch whose prefix + longest chunk exceeds the window is computed one chunk at a time instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import ConfigError
from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.routes import dense_products
from kvrag.kv.spec import KVSpec

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
"""Chunks per forward, chosen by measurement (docs/results.md, "Ingest": batch sizes 1, 4, 8 and 16 side by side on
real passages): 8 was fastest; larger batches lose again (bigger activations, more cache misses)."""

DEFAULT_MAX_BATCH_TOKENS = 4096
"""Upper bound on padded tokens per forward (B x longest chunk), so long chunks form smaller batches."""

MAX_PAD_FRACTION = 0.2
"""A chunk joins a batch only if it is at least ``1 - MAX_PAD_FRACTION`` as long as the batch's longest, so at most
~20% of a batch's positions are padding (padding costs as much compute as real tokens)."""


def plan_batches(lengths: Sequence[int], batch_size: int, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> list[list[int]]:
    """Group chunk indices into batches of similar length (pure; no tensors).

    Indices are sorted by length (longest first, stable) and cut into consecutive groups of at most ``batch_size``
    chunks and at most ``max_batch_tokens`` padded tokens (a single chunk longer than that forms its own batch),
    whose lengths are within :data:`MAX_PAD_FRACTION` of the group's longest.

    Args:
        lengths: T of every chunk.
        batch_size: chunks per batch (>= 1).
        max_batch_tokens: cap on ``len(batch) * max(T in batch)``.

    Returns:
        Batches of indices into ``lengths``; every index appears exactly once.
    """
    if batch_size < 1:
        msg = f"batch_size must be >= 1, got {batch_size}; use 1 to prefill one chunk at a time"
        raise ConfigError(msg)
    if max_batch_tokens < 1:
        msg = f"max_batch_tokens must be >= 1, got {max_batch_tokens}"
        raise ConfigError(msg)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]  # sorted: the first index of a batch is its longest
        too_short = lengths[i] < (1.0 - MAX_PAD_FRACTION) * longest
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * longest > max_batch_tokens or too_short):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _prefix_cache(model: PreTrainedModel, keys: torch.Tensor, values: torch.Tensor, batch: int) -> DynamicCache:
    """A DynamicCache holding the shared prefix K/V [L, H_kv, P, D] repeated for ``batch`` rows."""
    cache = hf_cache.new_cache(model)  # every token kept, also in sliding-window layers
    for layer in range(keys.shape[0]):
        k = keys[layer].unsqueeze(0).expand(batch, -1, -1, -1).contiguous()  # [B, H_kv, P, D]
        v = values[layer].unsqueeze(0).expand(batch, -1, -1, -1).contiguous()
        cache.update(k, v, layer)
    return cache


def _batch_tensors(cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack a batch-B cache into keys, values [L, B, H_kv, S, D]."""
    ks = [layer.keys for layer in cache.layers]
    vs = [layer.values for layer in cache.layers]
    return torch.stack(ks), torch.stack(vs)


@torch.inference_mode()
def _prefill_batch(
    model: PreTrainedModel,
    rope: Rope,
    spec: KVSpec,
    rows: Sequence[Sequence[int]],
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
    p: int,
) -> list[ChunkKV] | None:
    """Prefill ``rows`` (B chunks, longest first) after the shared prefix; None if the cache dropped tokens."""
    device = model.device
    b, t_max = len(rows), max(len(r) for r in rows)
    ids = torch.zeros((b, t_max), dtype=torch.long)  # pad id 0: masked, and causally after every real token
    mask = torch.zeros((b, p + t_max), dtype=torch.long)
    mask[:, :p] = 1
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, p : p + len(r)] = 1
    pos = torch.arange(p, p + t_max).expand(b, -1)  # [B, T]
    cache = None
    if prefix_kv is not None:
        cache = _prefix_cache(model, prefix_kv[0], prefix_kv[1], b)
    else:
        cache = hf_cache.new_cache(model)
    with dense_products():  # the bits a chunk gets alone (kvrag.kv.compute.compute_chunk_kv), whatever the batch
        model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device), cache=cache,
            use_cache=True, logits_to_keep=1,
        )
    k, v = _batch_tensors(cache)  # [L, B, H_kv, P+T, D]
    if k.shape[3] != p + t_max:  # a sliding-window layer kept only the last tokens
        return None
    k = rope.canonicalize(k[:, :, :, p:], torch.arange(p, p + t_max, device=k.device))  # [L, B, H_kv, T, D]
    v = v[:, :, :, p:]
    dt = spec.torch_dtype
    out = []
    for i, r in enumerate(rows):
        n = len(r)
        out.append(ChunkKV(
            token_ids=torch.tensor(list(r), dtype=torch.long),
            keys=k[:, i, :, :n].to("cpu", dt).contiguous(),  # [L, H_kv, T_i, D]
            values=v[:, i, :, :n].to("cpu", dt).contiguous(),
            spec=spec,
        ))
    return out


@torch.inference_mode()
def prefill_prefix(model: PreTrainedModel, prefix_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K/V [L, H_kv, P, D] (RoPE applied) of the conditioning prefix alone; None for an empty prefix.

    Causal attention makes a prefix's K/V independent of what follows it, so this equals the prefix part of any
    ``prefix + chunk`` prefill.
    """
    if not len(prefix_ids):
        return None
    with dense_products():
        return hf_cache.prefill_kv(model, torch.tensor(list(prefix_ids), dtype=torch.long))


@torch.inference_mode()
def compute_chunk_kvs(
    model: PreTrainedModel,
    rope: Rope,
    spec: KVSpec,
    ids_list: Sequence[Sequence[int]],
    prefix_ids: Sequence[int] = (),
    batch_size: int = DEFAULT_BATCH_SIZE,
    *,
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    on_batch: Callable[[list[int], list[ChunkKV]], None] | None = None,
) -> list[ChunkKV]:
    """Canonical caches of many chunks, ``batch_size`` chunks per forward, each conditioned on ``prefix_ids``.

    Equals ``[compute_chunk_kv(model, rope, spec, ids, prefix_ids) for ids in ids_list]`` up to floating-point
    summation order (fp32: max abs diff <= 1e-4; bf16/fp16: docs/architecture.md#batched-ingest), with the prefix
    prefilled once.

    Args:
        ids_list: N chunks' token ids (each non-empty).
        prefix_ids: P conditioning ids shared by every chunk (their KV is not returned).
        batch_size: chunks per forward; 1 prefills one chunk at a time (the prefix still shared).
        max_batch_tokens: cap on padded tokens per forward (``len(batch) * longest``).
        prefix_kv: :func:`prefill_prefix` of ``prefix_ids``, when the caller computed it already (e.g. once for
            many calls); computed here otherwise.
        on_batch: called after each batch with (indices into ``ids_list``, their chunks), e.g. to store them
            and advance a progress bar while the next batch runs.

    Returns:
        N ChunkKV (keys/values [L, H_kv, T_i, D] at ``spec.dtype`` on the CPU), in the order of ``ids_list``.

    Raises:
        ConfigError: an empty chunk, or a bad ``batch_size`` / ``max_batch_tokens``.
    """
    for i, r in enumerate(ids_list):
        if len(r) == 0:
            msg = f"chunk #{i} has no token ids; drop empty chunks before computing caches"
            raise ConfigError(msg)
    batches = plan_batches([len(r) for r in ids_list], batch_size, max_batch_tokens)
    p = len(prefix_ids)
    if prefix_kv is None:
        prefix_kv = prefill_prefix(model, prefix_ids)
    elif prefix_kv[0].shape[2] != p:
        msg = f"prefix_kv holds {prefix_kv[0].shape[2]} positions but prefix_ids has {p}; pass prefill_prefix(model, prefix_ids)"
        raise ConfigError(msg)
    out: list[ChunkKV | None] = [None] * len(ids_list)
    for idx in batches:
        rows = [ids_list[i] for i in idx]
        got = _prefill_batch(model, rope, spec, rows, prefix_kv, p)
        if got is None:
            log.debug("batch of %d chunks exceeds a sliding window; computing them one at a time", len(idx))
            got = [compute_chunk_kv(model, rope, spec, r, prefix_ids) for r in rows]
        for i, ch in zip(idx, got, strict=True):
            out[i] = ch
        if on_batch is not None:
            on_batch(idx, got)
    assert all(c is not None for c in out)
    return out  # type: ignore[return-value]


__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_MAX_BATCH_TOKENS", "compute_chunk_kvs", "plan_batches", "prefill_prefix"]
