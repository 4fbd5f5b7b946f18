"""Prefill attention whose every row gets the same bits however a prompt is split into forwards.

torch's CPU flash attention walks a call's keys in blocks of 512, and a row's sums (so its low bits) depend on the
width of the last block, which one call sets by its own extent; it also computes a split of fewer than 4 query rows
with another kernel. One SDPA call per forward therefore gives a position other bits after a cached prefix (a suffix,
a chat's next turn) than in one prefill of the whole prompt. :func:`aligned_attention` removes both dependences; the
model's own forward (``kvrag_sdpa``, :mod:`kvrag.kv.attention`) and the runner's suffix prefill
(:mod:`kvrag.kv.batched`) both run it.
"""

from __future__ import annotations

import torch

ROW_BLOCK = 256
"""Query rows are grouped by the multiple of this their key index falls before, and each group's call spans keys up to
that multiple. A row's sums depend on the width of the last key block its call walks (tested), not on how many rows
share the call, so a row gets the same bits in any forward. Measured on SmolLM2-135M (1.9K tokens, one thread): a
whole prefill 1-4% and a 40-token suffix over the rest ~5% slower than one SDPA call; 32 made the suffix ~15% slower
(more passes over the keys), 512 the prefill ~7% (more masked keys per row)."""
MIN_ROWS = 4
"""torch's CPU flash attention computes its queries in splits of 32 rows (64 from 192 rows on), and a split of fewer
than this many rows takes another kernel (other float32 bits): a group whose last split would be that short is
padded with copies of its last row (:func:`padded_rows`)."""


def padded_rows(rows: int) -> int:
    """The rows an :func:`aligned_attention` call computes for ``rows`` queries: no split shorter than
    :data:`MIN_ROWS` (measured for every count of 1-256 rows, float32 and bfloat16)."""
    split = 32 if rows < 192 else 64
    tail = rows % split
    return rows + MIN_ROWS - tail if 0 < tail < MIN_ROWS else rows


KEY_ALIGN = 512
"""A block's first key is rounded down to a multiple of this: torch's CPU flash attention walks keys in blocks of
512 from the first key it is given, so an aligned start keeps a row's key blocks, and so its sums, where a call over
all keys has them."""


def aligned_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float | None) -> torch.Tensor:
    """SDPA whose every row is computed alike however the prompt is split into forwards: the same bits for a
    position whether it is prefilled with the whole prompt, after a cached prefix (a suffix, a chat's next turn), or
    in pieces.

    torch's CPU flash attention walks a call's keys in blocks of 512, and a row's sums (so its low bits) depend on
    the width of the last block, which one call sets by its own extent: the same position prefilled with the whole
    prompt and after a cached prefix got different bits. Here the queries run in groups that end where a query's
    key index reaches a multiple of :data:`ROW_BLOCK` (the query at index ``i`` of ``n_q`` sits at key index
    ``n_k - n_q + i``, as in causal self-attention over a cache), each over the keys from the first its rows may
    see (rounded down to :data:`KEY_ALIGN`) to that multiple, past the last key padded with zero keys the mask
    leaves out. A row's call then walks the same key blocks under the same mask row wherever it is computed, and
    the keys left out or padded add exact zeros. Groups also skip keys outside sliding windows (a long prefill
    through Gemma 3 / Mistral windows reads only its band).

    Args:
        query: [batch, heads, queries, head_dim].
        key, value: [batch, kv_heads, keys, head_dim]; kv_heads divides heads (grouped-query attention).
        mask: bool [batch, 1 or heads, queries, keys], True where a query attends; None: causal.
        scaling: the softmax scale (None: 1/sqrt(head_dim)).

    Returns:
        [batch, queries, heads, head_dim], as transformers' attention functions return it.
    """
    n_q, n_k = query.shape[2], key.shape[2]
    first = n_k - n_q
    gqa = key.shape[1] != query.shape[1]
    out = torch.empty((query.shape[0], n_q, query.shape[1], value.shape[-1]), dtype=query.dtype)
    q0 = 0
    while q0 < n_q:
        at = first + q0
        q1 = min(n_q, q0 + ROW_BLOCK - at % ROW_BLOCK)
        end = (at // ROW_BLOCK + 1) * ROW_BLOCK
        if mask is None:
            rows = (torch.arange(end)[None, :] <= torch.arange(at, first + q1)[:, None]).view(1, 1, q1 - q0, end)
            k0 = 0
        else:
            rows = mask[:, :, q0:q1]
            seen = torch.nonzero(rows.any(dim=2).any(dim=1).any(dim=0)).flatten()
            if seen.numel():
                k0, last = int(seen[0]) // KEY_ALIGN * KEY_ALIGN, int(seen[-1]) + 1
                end = max(end, -(-last // ROW_BLOCK) * ROW_BLOCK)
            else:
                k0, end = 0, max(end, n_k)
            if end > n_k:
                rows = torch.nn.functional.pad(rows, (0, end - n_k), value=False)
        k, v = key[:, :, k0:end], value[:, :, k0:end]
        if end > n_k:
            pad = (0, 0, 0, end - n_k)
            k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
        q = query[:, :, q0:q1]
        rows = rows[..., k0:end]
        fill = padded_rows(q1 - q0) - (q1 - q0)
        if fill:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, fill, -1)], dim=2)
            rows = torch.cat([rows, rows[:, :, -1:].expand(-1, -1, fill, -1)], dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rows, scale=scaling, enable_gqa=gqa)
        out[:, q0:q1] = o[:, :, : q1 - q0].transpose(1, 2)
        q0 = q1
    return out


__all__ = ["KEY_ALIGN", "MIN_ROWS", "ROW_BLOCK", "aligned_attention", "padded_rows"]
