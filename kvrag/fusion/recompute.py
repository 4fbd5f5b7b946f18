"""Shared machinery of the selective-recomputation fusion methods (RelaxKV, CacheBlend, EPIC, ProphetKV).

Two executors and a few pure helpers:

* :func:`selective_recompute` runs the model's own decoder layers for per-layer *target* positions over an
  explicit *context* (the full causal prefix, or a position set ``U``), writing fresh K/V over the stale cache
  (baselines.md §0.1; RelaxKV §3.3-§3.4).
* :func:`query_attention_scores` is the scoring pass: the question suffix attends over the stale cache and each
  layer's attention to every context position is reduced to one score (baselines.md §0.2; RelaxKV §3.2).
* :func:`budget` / :func:`top_positions` turn ratios and scores into position sets, deterministically.

Shapes: L layers, H query heads, H_kv KV heads, Tc context positions, S suffix tokens, N targets, D head dim.
Position ``p`` of the context is index ``p`` of every tensor (the context starts at global position 0).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionOutput
from kvrag.kv import hf_cache


def check_ratio(method: str, name: str, value: float) -> None:
    """Raise ConfigError unless ``0 < value <= 1``."""
    if not (0.0 < value <= 1.0) or math.isnan(value):
        msg = f"method {method!r}: {name} must be in (0, 1] (a fraction of the context), got {value}"
        raise ConfigError(msg)


def check_choice(method: str, name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        msg = f"method {method!r}: {name} must be one of {list(choices)}, got {value!r}"
        raise ConfigError(msg)


def budget(r: float, n: int) -> int:
    """``k = max(1, round_half_up(r * n))``, capped at ``n`` (0 when ``n == 0``). RelaxKV §3.2.

    Half-up rounding (``floor(x + 0.5)``), not Python's banker's ``round``; the product is rounded to 9 decimals
    first so that e.g. ``0.15 * 10`` (1.5000000000000002) and ``0.35 * 10`` (3.4999999999999996) both round up.
    """
    if n <= 0:
        return 0
    return min(n, max(1, math.floor(round(r * n, 9) + 0.5)))


def top_positions(scores: torch.Tensor, k: int, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` highest-scoring candidate positions, sorted ascending.

    Args:
        scores: [T] scores (any float dtype).
        k: how many to pick (capped at the number of candidates).
        candidates: [T] bool, positions allowed to be picked (None: all).

    Returns:
        [k'] int64 positions on the CPU. Ties are broken by lower position (stable sort), so runs reproduce.
    """
    s = scores.detach().float().cpu().clone()
    if candidates is not None:
        s[~candidates.cpu()] = -math.inf
        k = min(k, int(candidates.sum()))
    k = max(0, min(k, int(s.shape[0])))
    order = torch.sort(s, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """[T] bool -> sorted int64 positions (CPU)."""
    return torch.nonzero(mask.cpu(), as_tuple=False).flatten()


def sync(device: torch.device | str) -> None:
    """Wait for queued kernels so wall-clock timings are honest on accelerators."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclasses.dataclass
class LayerState:
    """What a per-layer hook sees right before layer ``layer`` runs (see :func:`selective_recompute`).

    Attributes:
        layer: the layer about to run.
        targets: [N] sorted int64 positions planned at this layer.
        hidden: [1, N, hidden] their input hidden states (output of layer-1, or embeddings at layer 0).
        keys: [L, H_kv, Tc, D] the working cache (stale except what was already rewritten); hooks may write it.
        values: [L, H_kv, Tc, D] likewise.
        extra_states: hooks add the number of (layer, token) K/V states they rewrote themselves.
    """

    layer: int
    targets: torch.Tensor
    hidden: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    extra_states: int = 0


LayerHook = Callable[[Any, LayerState], "torch.Tensor | None"]
"""``hook(model, state)``: return None to keep ``state.targets``, or a subset of them; the subset replaces the
targets at this layer and every deeper layer's plan is intersected with it (keeps the schedule monotone)."""


@dataclasses.dataclass
class RecomputeResult:
    """Output of :func:`selective_recompute`.

    Attributes:
        keys: [L, H_kv, Tc, D] repaired keys (fresh at recomputed (layer, position) pairs, stale elsewhere).
        values: [L, H_kv, Tc, D] repaired values.
        targets: per layer, the [N_l] positions actually recomputed.
        states: recomputed (layer, token) K/V states, hooks' extra states included.
        edges: useful attention (query, key) pairs (the unmasked ones), summed over layers.
        seconds: wall time.
        computed_edges: attention pairs the kernels evaluated (each block's dense [N, C + N] mask, masked pairs
            included), summed over layers.
    """

    keys: torch.Tensor
    values: torch.Tensor
    targets: list[torch.Tensor]
    states: int
    edges: int
    seconds: float
    computed_edges: int = 0


def _is_subset(sub: torch.Tensor, sup: torch.Tensor) -> bool:
    return bool(torch.isin(sub, sup).all()) if sub.numel() else True


@torch.inference_mode()
def selective_recompute(
    model: Any,
    token_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    targets: Sequence[torch.Tensor],
    context: torch.Tensor | None | Sequence[torch.Tensor | None] = None,
    *,
    hook: LayerHook | None = None,
    block_size: int = 256,
    inplace: bool = False,
) -> RecomputeResult:
    """Layer-by-layer selective recomputation over a stale cache. baselines.md §0.1; RelaxKV §3.3-§3.4, §A.2.

    At layer ``l`` each target ``t`` in ``targets[l]`` runs the model's own decoder layer on its hidden state from
    layer ``l-1`` (embeddings at layer 0) at its original global position, attending to

    * the context positions ``c < t``: every position (``context`` None, the full causal prefix) or only those
      in the position set ``U`` (RelaxKV's sparse context), read from the working cache, i.e. stale unless
      rewritten at this layer, plus
    * the targets ``t' <= t`` of this layer with their FRESH K/V (itself included),

    and its fresh K/V overwrite the cache at layer ``l``. Targets must be nested (``targets[l+1] ⊆ targets[l]``),
    because a token needs a fresh hidden state from the previous layer. ``keys``/``values`` are modified in place
    with ``inplace`` (the caller owns them, e.g. :meth:`FusionInput.working_kv`), else never.

    Args:
        model: the causal LM.
        token_ids: [Tc] context token ids.
        keys, values: [L, H_kv, Tc, D] stale cache (RoPE applied at global positions).
        targets: L tensors of int64 positions (any order; sorted internally).
        context: None (full causal prefix at every layer), one [|U|] position tensor for every layer, or a
            per-layer list of those.
        hook: called before every layer that has targets (CacheBlend selects inside it), see :data:`LayerHook`.
        block_size: targets are processed in position-ordered blocks of this many rows; later blocks read earlier
            blocks' fresh K/V from the working cache, so the result does not depend on it (up to float rounding).
            Smaller blocks compute fewer masked pairs (a block's context stops at its last target, so the waste is
            about half a block's span per row) at the price of more layer calls.
        inplace: write into ``keys``/``values`` (the caller owns them, e.g. :meth:`FusionInput.working_kv`)
            instead of copies.

    Returns:
        RecomputeResult.
    """
    n_layers, _, tc, _ = keys.shape
    if len(targets) != n_layers:
        msg = f"targets must list one position set per layer ({n_layers}), got {len(targets)}"
        raise ValueError(msg)
    ctx_list: list[torch.Tensor | None] = (
        list(context) if isinstance(context, list | tuple) else [context] * n_layers  # type: ignore[list-item]
    )
    if len(ctx_list) != n_layers:
        msg = f"context must be None, one position set or {n_layers} of them, got {len(ctx_list)}"
        raise ValueError(msg)
    plan = [torch.unique(t.detach().to("cpu", torch.long)) for t in targets]  # unique() sorts
    for layer, t in enumerate(plan):
        if t.numel() and (int(t[0]) < 0 or int(t[-1]) >= tc):
            msg = f"target positions must lie in [0, {tc}), got {int(t[0])}..{int(t[-1])}"
            raise ValueError(msg)
        if layer and not _is_subset(t, plan[layer - 1]):
            msg = f"targets must be nested: layer {layer} has positions not recomputed at layer {layer - 1}"
            raise ValueError(msg)
    sync(keys.device)
    t0 = time.perf_counter()
    k_out, v_out = (keys, values) if inplace else (keys.clone(), values.clone())
    done: list[torch.Tensor] = []
    states = edges = computed = extra = 0
    prev = plan[0]
    hidden = hf_cache.embed(model, token_ids[prev])  # [1, N_0, hidden]
    for layer in range(n_layers):
        tgt = plan[layer]
        if tgt.numel() == 0:
            done.extend(torch.zeros(0, dtype=torch.long) for _ in range(n_layers - layer))
            break
        hidden = hidden[:, torch.searchsorted(prev, tgt).to(hidden.device)]
        if hook is not None:
            state = LayerState(layer, tgt, hidden, k_out, v_out)
            sel = hook(model, state)
            extra += state.extra_states
            if sel is not None:
                sel = torch.unique(sel.detach().to("cpu", torch.long))
                if not _is_subset(sel, tgt):
                    raise ValueError(f"hook at layer {layer} returned positions that are not targets")
                hidden = hidden[:, torch.searchsorted(tgt, sel).to(hidden.device)]
                tgt = sel
                plan[layer + 1 :] = [p[torch.isin(p, sel)] for p in plan[layer + 1 :]]
                if tgt.numel() == 0:
                    done.extend(torch.zeros(0, dtype=torch.long) for _ in range(n_layers - layer))
                    break
        hidden, e, c = _run_targets(model, layer, hidden, tgt, ctx_list[layer], k_out, v_out, block_size)
        edges += e
        computed += c
        states += int(tgt.numel())
        done.append(tgt)
        prev = tgt
    sync(keys.device)
    return RecomputeResult(k_out, v_out, done, states + extra, edges, time.perf_counter() - t0, computed)


def _run_targets(
    model: Any,
    layer: int,
    hidden: torch.Tensor,
    tgt: torch.Tensor,
    ctx: torch.Tensor | None,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, int, int]:
    """Run one layer for the sorted targets ``tgt`` (blocks in position order); write their fresh K/V.

    Returns (hidden out, useful pairs, computed pairs)."""
    tc = k_out.shape[2]
    dev = k_out.device
    readable = torch.ones(tc, dtype=torch.bool) if ctx is None else torch.zeros(tc, dtype=torch.bool)
    if ctx is not None:
        readable[ctx.to("cpu", torch.long)] = True
    readable[tgt] = True  # earlier targets are always visible (fresh, written by earlier blocks)
    outs, edges, computed = [], 0, 0
    for b0 in range(0, int(tgt.numel()), max(1, block_size)):
        blk = tgt[b0 : b0 + block_size]  # [N] sorted
        lim = int(blk[-1])
        avail = readable[:lim].clone()
        avail[blk[blk < lim]] = False  # this block's own rows come as fresh targets, not from the cache
        cpos = positions_of(avail)  # [C]
        mask = torch.cat([cpos[None, :] < blk[:, None], blk[None, :] <= blk[:, None]], dim=1)  # [N, C + N]
        edges += int(mask.sum())
        computed += int(mask.numel())
        cdev, bdev = cpos.to(dev), blk.to(dev)
        h, fk, fv = hf_cache.run_layer(
            model,
            layer,
            hidden[:, b0 : b0 + block_size],
            bdev,
            k_out[layer][:, cdev],  # [H_kv, C, D]
            v_out[layer][:, cdev],
            mask.to(dev),
        )
        k_out[layer][:, bdev] = fk.to(k_out.dtype)
        v_out[layer][:, bdev] = fv.to(v_out.dtype)
        outs.append(h)
    return torch.cat(outs, dim=1), edges, computed


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
        plain = value is not None and not _has_special_attention(module)
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


def _has_special_attention(module: Any) -> bool:
    """Attention that is not plain softmax(q k^T * scale + mask) v: soft-capping, sinks, sliding windows."""
    cfg = getattr(module, "config", None)
    return bool(getattr(cfg, "attn_logit_softcapping", None) or getattr(module, "sinks", None) is not None
                or getattr(module, "sliding_window", None))


@torch.inference_mode()
def query_attention_scores(
    inp: FusionInput, *, heads: str = "mean", kind: str = "prob", max_elems: int = 1 << 24
) -> tuple[torch.Tensor, int, float]:
    """Scoring pass: the suffix attends over the stale cache; one score per (layer, context position).

    baselines.md §0.2, ProphetKV Stage I, RelaxKV §3.2. The suffix runs through the model's own layers at global
    positions ``Tc..Tc+S-1`` over the stale K/V (never modified); at each layer the post-RoPE (post q-norm) queries
    are compared with the stale context keys:

    * ``kind='prob'``: ``softmax over the Tc context keys of q·k / sqrt(D)`` (ProphetKV's denominator: the
      suffix keys are left out), averaged over the S suffix rows (rank-equivalent to the sum);
    * ``kind='logit'``: the scaled logits themselves, averaged over the rows;

    then reduced over the H query heads by ``heads='mean'`` (rank-equivalent to ProphetKV's sum) or ``'max'``.

    Only what ranking needs is computed: the attention logits once per layer (they give both the scores and the
    layer's attention output, :class:`_ScoringProbe`), no logits, and the last layer stops after its attention
    (its output projection, MLP and the final norm would only feed the LM head).

    Returns:
        (scores [L, Tc] float32 on the CPU, attention pairs computed by the pass, seconds).
    """
    model, tc = inp.model, inp.context_len
    n_layers = inp.keys.shape[0]
    suffix = inp.suffix_ids
    s_len = int(suffix.shape[0])
    scores = torch.zeros(n_layers, tc, dtype=torch.float32)
    if tc == 0 or s_len == 0:
        return scores, 0, 0.0
    dev = inp.keys.device
    sync(dev)
    t0 = time.perf_counter()
    probe = _ScoringProbe(scores, tc, heads, kind, max_elems)
    hidden = hf_cache.embed(model, suffix)  # [1, S, hidden]
    pos = torch.arange(tc, tc + s_len, device=dev)
    mask = torch.ones(s_len, tc + s_len, dtype=torch.bool)
    mask[:, tc:] = torch.tril(torch.ones(s_len, s_len, dtype=torch.bool))
    mask = mask.to(dev)
    probe.stop_at = n_layers - 1
    with hf_cache.capture_attention(model, probe):
        for layer in range(n_layers):
            try:
                hidden, _, _ = hf_cache.run_layer(model, layer, hidden, pos, inp.keys[layer], inp.values[layer], mask)
            except _ScoresDone:
                break
    sync(dev)
    edges = n_layers * s_len * (tc + s_len)  # the dense [S, Tc + S] logits of every layer
    return scores, edges, time.perf_counter() - t0


def full_prefill_edges(n_layers: int, tc: int) -> int:
    """Attention (query, key) pairs of a causal prefill of the Tc context positions at every layer."""
    return n_layers * tc * (tc + 1) // 2


def fusion_output(
    inp: FusionInput,
    res: RecomputeResult,
    *,
    context_fraction: float = 1.0,
    score_s: float = 0.0,
    score_edges: int = 0,
    **extra: Any,
) -> FusionOutput:
    """Wrap a recompute result with the statistics every selective method reports (baselines.md §0.3).

    Stats: ``recomputed_fraction`` (recomputed (layer, token) states / (L * Tc)), ``context_fraction`` (|U| / Tc;
    1.0 for full-causal-prefix methods), ``attention_edges_ratio`` (useful recompute pairs / pairs of a full
    prefill of the context), ``attention_computed_ratio`` (pairs the kernels evaluated, masked ones included,
    same denominator), ``score_edges_ratio`` (pairs the scoring pass computed, same denominator), ``score_s``,
    ``recompute_s``, plus ``extra``.
    """
    n_layers, _, tc, _ = inp.keys.shape
    full_edges = max(1, full_prefill_edges(n_layers, tc))
    stats: dict[str, Any] = {
        "recomputed_fraction": res.states / max(1, n_layers * tc),
        "context_fraction": float(context_fraction),
        "attention_edges_ratio": res.edges / full_edges,
        "attention_computed_ratio": res.computed_edges / full_edges,
        "score_edges_ratio": score_edges / full_edges,
        "score_s": float(score_s),
        "recompute_s": float(res.seconds),
        "recomputed_per_layer": [int(t.numel()) for t in res.targets],
    }
    stats.update(extra)
    cache = inp.cache_over(res.keys, res.values)
    return FusionOutput(cache=cache, stats=stats)


def exact_mask(inp: FusionInput, *, first_chunk: bool = False) -> torch.Tensor:
    """[Tc] bool, True at positions treated as exact (never repair targets): 'prefix' spans and, with
    ``first_chunk``, the first non-prefix span too (it has no preceding chunk when the prefix is empty or the chunk
    was conditioned on it)."""
    m = ~inp.reusable_mask
    if first_chunk:
        for s in inp.spans:
            if s.kind != "prefix":
                m[s.start : s.end] = True
                break
    return m
