"""The 'prefix' executor of :func:`kvrag.fusion.recompute.selective_recompute`: one decoder-layer call per layer
for all of its recompute targets, the attention computed here in position-ordered row blocks that each read only
the key prefix their last row can see.

The reference ('layer') executor calls the decoder layer once per block of targets over a gathered context with a
dense [N, C + N] bias, so each block runs its projections and MLP as a separate small GEMM and evaluates a full
rectangle of (query, key) pairs. Here the targets' fresh K/V are written into the working cache first
(:class:`InPlaceCache`), the readable keys are read back in position order (the prefix itself, no copy, with the
full causal context) and :class:`PrefixAttention` replaces the model's attention kernel through
:func:`kvrag.kv.hf_cache.capture_attention`. Only for attention that is plain softmax(q k^T * scale + mask) v.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvrag.kv import hf_cache
from kvrag.kv.window import layer_windows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def has_special_attention(module: torch.nn.Module) -> bool:
    """Attention that is not plain softmax(q k^T * scale + mask) v: soft-capping, sinks, sliding windows."""
    cfg = getattr(module, "config", None)
    return bool(getattr(cfg, "attn_logit_softcapping", None) or getattr(module, "sinks", None) is not None
                or getattr(module, "sliding_window", None))


class InPlaceCache:
    """Duck-typed cache for one decoder-layer call over ALL of a layer's targets: ``update`` writes the targets'
    fresh K/V into the working cache at their positions and hands back the readable keys in position order (the
    prefix ``[0, lim)`` itself when every position is readable, no copy; else the gathered readable positions)."""

    def __init__(self, k_layer: torch.Tensor, v_layer: torch.Tensor, tgt: torch.Tensor, kpos: torch.Tensor | None,
                 lim: int) -> None:
        self.k_layer, self.v_layer = k_layer, v_layer  # [H_kv, Tc, D] views of the working cache
        self.tgt, self.kpos, self.lim = tgt, kpos, lim

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.k_layer[:, self.tgt] = key_states[0].to(self.k_layer.dtype)
        self.v_layer[:, self.tgt] = value_states[0].to(self.v_layer.dtype)
        if self.kpos is None:
            return self.k_layer[None, :, : self.lim], self.v_layer[None, :, : self.lim]
        return self.k_layer[None][:, :, self.kpos], self.v_layer[None][:, :, self.kpos]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class PrefixAttention:
    """Attention of one layer's targets over position-ordered readable keys, in row blocks that each read only
    the key prefix their last row can see (so a block computes about its rows' own causal spans, not a dense
    [N, C + N] rectangle), grouped-query without repeating K/V. Installed with :func:`hf_cache.capture_attention`
    (``computes_attention``) for families whose attention is plain scaled dot-product + mask."""

    computes_attention = True

    def __init__(self, row_block: int) -> None:
        self.row_block = max(1, row_block)
        self.qpos = torch.zeros(0, dtype=torch.long)  # [N] target positions (CPU), set per layer
        self.kpos = torch.zeros(0, dtype=torch.long)  # [M] readable key positions in order (CPU)
        self.edges = self.computed = 0

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float | None,
                 value: torch.Tensor | None = None) -> Any:
        assert value is not None
        q = query[0]  # [H, N, D]
        h, n_rows, d = q.shape
        h_kv = key.shape[1]
        rep = h // h_kv
        scale = scaling if scaling is not None else d**-0.5
        dev = q.device
        ends = torch.searchsorted(self.kpos, self.qpos, right=True)  # [N] keys row i may read: kpos[:ends[i]]
        outs = []
        for r0 in range(0, n_rows, self.row_block):
            r1 = min(n_rows, r0 + self.row_block)
            n, m = r1 - r0, int(ends[r1 - 1])
            vis = self.kpos[None, :m] <= self.qpos[r0:r1, None]  # [n, m] causal over the readable keys
            self.edges += int(vis.sum())
            self.computed += n * m
            qb = q[:, r0:r1].reshape(h_kv, rep * n, d)  # query head j reads KV head j // rep (repeat_kv's layout)
            out = torch.nn.functional.scaled_dot_product_attention(
                qb[None], key[:, :, :m], value[:, :, :m], attn_mask=vis.to(dev).repeat(rep, 1)[None, None],
                scale=scale)  # [1, H_kv, rep*n, D]
            outs.append(out[0].reshape(h, n, d))
        return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0).contiguous(), None  # [1, N, H, D]


def plain_attention(model: PreTrainedModel) -> bool:
    """True when every decoder layer's attention is plain softmax(q k^T * scale + mask) v (see
    :func:`has_special_attention`) over every key of its causal prefix (no layer has an attention window), so
    :class:`PrefixAttention` may compute it."""
    if any(w is not None for _, w in layer_windows(model.config)):
        return False
    for layer in hf_cache.decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is None or has_special_attention(attn):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class LayerTargets:
    """One layer's step of a selective recompute, what either executor runs (:func:`run_targets_prefix`, or the
    reference one of :mod:`kvrag.fusion.recompute`).

    Attributes:
        model / layer: the model and the decoder layer's index.
        hidden: the layer's input hidden states of the targets.
        tgt: the sorted target positions (recomputed fresh).
        ctx: the readable context positions (None: every position).
        k_out / v_out: the working cache's keys and values of the layer, where the targets' fresh K/V are written.
    """

    model: PreTrainedModel
    layer: int
    hidden: torch.Tensor
    tgt: torch.Tensor
    ctx: torch.Tensor | None
    k_out: torch.Tensor
    v_out: torch.Tensor


def run_targets_prefix(step: LayerTargets, attn: PrefixAttention) -> tuple[torch.Tensor, int, int]:
    """One layer call for all sorted targets ``step.tgt``: projections and MLP as one GEMM each, attention by
    ``attn`` (inside :func:`hf_cache.capture_attention`). Same semantics as the reference executor of
    :func:`kvrag.fusion.recompute.selective_recompute`: target ``t`` reads the readable positions ``< t`` from the
    working cache and the targets ``<= t`` fresh.

    Returns (hidden out, useful pairs, computed pairs)."""
    model, layer, hidden, tgt, ctx = step.model, step.layer, step.hidden, step.tgt, step.ctx
    k_out, v_out = step.k_out, step.v_out
    dev = k_out.device
    lim = int(tgt[-1]) + 1
    if ctx is None:
        kpos, kpos_dev = torch.arange(lim), None
    else:
        readable = torch.zeros(lim, dtype=torch.bool)
        c = ctx.to("cpu", torch.long)
        readable[c[c < lim]] = True
        readable[tgt] = True
        kpos = torch.nonzero(readable).flatten()
        kpos_dev = kpos.to(dev)
    attn.qpos, attn.kpos = tgt, kpos
    e0, c0 = attn.edges, attn.computed
    tdev = tgt.to(dev)
    cache = InPlaceCache(k_out[layer], v_out[layer], tdev, kpos_dev, lim)
    out = hf_cache.call_layer(model, layer, hidden, tdev, cache, None)
    return out, attn.edges - e0, attn.computed - c0
