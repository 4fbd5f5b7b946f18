"""The scoring pass: the question suffix attends over the (stale or repaired) cache and each layer's attention to
every context position is reduced to one score (docs/methods.md#scoring-pass; ProphetKV Stage I; RelaxKV §3.2)."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch

from kvrag.fusion.base import FusionInput
from kvrag.fusion.prefix_attention import has_special_attention
from kvrag.kv import hf_cache, pieces
from kvrag.kv.window import layer_windows, window_mask


class _ScoringProbe:
    """The scoring pass's attention: computes the suffix's attention once (eager math in the compute dtype, the
    softmax in float32 as transformers' eager path does) and records the per-layer context scores from the same
    logits. Only for families whose attention is plain scaled dot-product + additive mask (no logit soft-capping,
    no sinks); others keep the model's kernel and the probe only reads q and k."""

    computes_attention = True

    def __init__(self, scores: torch.Tensor, tc: int, heads: str, kind: str, max_elems: int) -> None:
        self.scores, self.tc, self.heads, self.kind, self.max_elems = scores, tc, heads, kind, max_elems
        self.stop_at = -1  # the layer after whose scores nothing more is needed (the last one)

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, scaling: float | None,
                 value: torch.Tensor | None = None) -> Any:
        q = query[0]  # [H, S, D]
        h, s, d = q.shape
        h_kv = key.shape[1]
        rep = h // h_kv
        scale = scaling if scaling is not None else d**-0.5
        plain = value is not None and not has_special_attention(module)
        tc = self.tc
        ckeys = key[0] if plain else key[0, :, :tc]  # [H_kv, C, D]
        rows = max(1, self.max_elems // max(1, h * int(ckeys.shape[1])))  # bound the [H, rows, C] block
        per_head = torch.zeros(h, tc, dtype=torch.float32, device=q.device)
        outs = []
        for r0 in range(0, s, rows):
            qb = q[:, r0 : r0 + rows]  # [H, n, D]
            n = qb.shape[1]
            # query head h reads KV head h // (H / H_kv), as transformers' repeat_kv lays them out
            logit = torch.matmul(qb.reshape(h_kv, rep * n, d), ckeys.transpose(1, 2)).float() * scale  # [H_kv, rep*n, C]
            ctx = logit[..., :tc]
            # ProphetKV's denominator: softmax over the context keys only (the suffix keys are left out)
            a = torch.softmax(ctx, dim=-1) if self.kind == "prob" else ctx
            per_head += a.reshape(h, n, tc).sum(dim=1)
            if plain:
                assert value is not None
                if mask is not None:
                    logit = logit + mask[0, 0, r0 : r0 + n].float().repeat(rep, 1)  # [rep*n, C] -> heads share it
                probs = torch.softmax(logit, dim=-1).to(value.dtype)  # eager: softmax in fp32, then the dtype
                outs.append(torch.matmul(probs, value[0]).reshape(h, n, d))  # [H, n, D]
        per_head /= s
        red = per_head.mean(dim=0) if self.heads == "mean" else per_head.max(dim=0).values
        self.scores[module.layer_idx] = red.cpu()
        if module.layer_idx == self.stop_at:
            raise _ScoresDone
        if not plain:
            return None
        return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0).contiguous(), None  # [1, S, H, D]


class _ScoresDone(Exception):
    """Leaves the last layer right after its scores: its output projection and MLP would only feed the LM head."""


@torch.inference_mode()
def query_attention_scores(
    inp: FusionInput, *, heads: str = "mean", kind: str = "prob", max_elems: int = 1 << 24
) -> tuple[torch.Tensor, int, float]:
    """:func:`query_attention_scores_pieces` in one piece."""
    return pieces.run_whole(  # type: ignore[no-any-return]
        query_attention_scores_pieces(inp, heads=heads, kind=kind, max_elems=max_elems))


@torch.inference_mode()
def query_attention_scores_pieces(
    inp: FusionInput, *, heads: str = "mean", kind: str = "prob", max_elems: int = 1 << 24,
    pace: pieces.Pace = pieces.WHOLE,
) -> Generator[None, None, tuple[torch.Tensor, int, float]]:
    """Scoring pass: the suffix attends over the stale cache; one score per (layer, context position).

    docs/methods.md#scoring-pass, ProphetKV Stage I, RelaxKV §3.2. The suffix runs through the model's own layers at
    global positions ``Tc..Tc+S-1`` over the stale K/V (never modified); at each layer the post-RoPE (post q-norm)
    queries are compared with the stale context keys:

    * ``kind='prob'``: ``softmax over the Tc context keys of q·k / sqrt(D)`` (ProphetKV's denominator: the
      suffix keys are left out), averaged over the S suffix rows (rank-equivalent to the sum);
    * ``kind='logit'``: the scaled logits themselves, averaged over the rows;

    then reduced over the H query heads by ``heads='mean'`` (rank-equivalent to ProphetKV's sum) or ``'max'``.

    Only what ranking needs is computed: the attention logits once per layer (they give both the scores and the
    layer's attention output, :class:`_ScoringProbe`), no logits, and the last layer stops after its attention
    (its output projection, MLP and the final norm would only feed the LM head).

    ``pace``: where to end a piece (:func:`kvrag.kv.pieces.call_pieces`); the probe is uninstalled between pieces.

    Returns:
        (scores [L, Tc] float32 on the CPU, attention pairs computed by the pass, seconds without the time between
        pieces).
    """
    model, tc = inp.model, inp.context_len
    n_layers = inp.keys.shape[0]
    suffix = inp.suffix_ids
    s_len = int(suffix.shape[0])
    scores = torch.zeros(n_layers, tc, dtype=torch.float32)
    if tc == 0 or s_len == 0:
        return scores, 0, 0.0
    dev = inp.keys.device
    hf_cache.sync(dev)
    t0 = time.perf_counter()
    probe = _ScoringProbe(scores, tc, heads, kind, max_elems)
    hidden = hf_cache.embed(model, suffix)  # [1, S, hidden]
    pos = torch.arange(tc, tc + s_len, device=dev)
    mask = torch.ones(s_len, tc + s_len, dtype=torch.bool)
    mask[:, tc:] = torch.tril(torch.ones(s_len, s_len, dtype=torch.bool))
    windows = layer_windows(model.config)
    q_pos, k_pos = torch.arange(tc, tc + s_len), torch.arange(tc + s_len)
    masks = {(kind, size): (mask if size is None else mask & window_mask(kind, size, q_pos, k_pos)).to(dev)
             for kind, size in set(windows)}  # a sliding / chunked layer sees only its window (kvrag.kv.window)
    probe.stop_at = n_layers - 1

    def layers() -> None:
        h = hidden
        for layer in range(n_layers):
            try:
                h, _, _ = hf_cache.run_layer(model, layer, h, pos, inp.keys[layer], inp.values[layer],
                                             masks[windows[layer]])
            except _ScoresDone:
                break

    paused = pace.paused_s
    yield from pieces.call_pieces(layers, pace, lambda: hf_cache.capture_attention(model, probe))
    paused = pace.paused_s - paused
    hf_cache.sync(dev)
    edges = n_layers * s_len * (tc + s_len)  # the dense [S, Tc + S] logits of every layer
    return scores, edges, time.perf_counter() - t0 - paused
