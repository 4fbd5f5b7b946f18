"""Shared machinery of the selective-recomputation fusion methods (RelaxKV, CacheBlend, EPIC, ProphetKV).

The executor and a few pure helpers:

* :func:`selective_recompute` runs the model's own decoder layers for per-layer *target* positions over an
  explicit *context* (the full causal prefix, or a position set ``U``), writing fresh K/V over the stale cache
  (docs/methods.md#selective-recomputation; RelaxKV §3.3-§3.4); its fast 'prefix' executor lives in
  :mod:`kvrag.fusion.prefix_attention`.
  :func:`recompute_input` runs it over a request's own buffer and folds the question suffix into it when it can.
* :func:`kvrag.fusion.scoring.query_attention_scores` is the scoring pass the query-guided methods rank with.
* :func:`budget` / :func:`top_positions` turn ratios and scores into position sets, deterministically.

Shapes: L layers, H query heads, H_kv KV heads, Tc context positions, S suffix tokens, N targets, D head dim.
Position ``p`` of the context is index ``p`` of every tensor (the context starts at global position 0).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionOutput
from kvrag.fusion.prefix_attention import LayerTargets, PrefixAttention, plain_attention, run_targets_prefix
from kvrag.fusion.stats import MethodStats
from kvrag.kv import hf_cache, pieces
from kvrag.kv.window import layer_windows, window_mask

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel


def check_ratio(method: str, name: str, value: float, what: str = "a fraction of the context") -> None:
    """Raise ConfigError unless ``0 < value <= 1`` (``what``: what the value is, for the message)."""
    if not (0.0 < value <= 1.0) or math.isnan(value):
        msg = f"method {method!r}: {name} must be in (0, 1] ({what}), got {value}"
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


LayerHook = Callable[["PreTrainedModel", LayerState], "torch.Tensor | None"]
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
        computed_edges: attention pairs the kernels evaluated (masked pairs in a block included), summed over
            layers.
        suffix_hidden: with ``suffix_ids``, the suffix's last-layer hidden states [1, S, hidden]; else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    targets: list[torch.Tensor]
    states: int
    edges: int
    seconds: float
    computed_edges: int = 0
    suffix_hidden: torch.Tensor | None = None


def _is_subset(sub: torch.Tensor, sup: torch.Tensor) -> bool:
    return bool(torch.isin(sub, sup).all()) if sub.numel() else True


@torch.inference_mode()
def selective_recompute(model: PreTrainedModel, token_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        targets: Sequence[torch.Tensor],
                        context: torch.Tensor | None | Sequence[torch.Tensor | None] = None, *,
                        hook: LayerHook | None = None, block_size: int | None = None, inplace: bool = False,
                        executor: str = "auto", suffix_ids: torch.Tensor | None = None) -> RecomputeResult:
    """:func:`selective_recompute_pieces` in one piece (the documentation is there)."""
    return pieces.run_whole(selective_recompute_pieces(  # type: ignore[no-any-return]
        model, token_ids, keys, values, targets, context, hook=hook, block_size=block_size, inplace=inplace,
        executor=executor, suffix_ids=suffix_ids))


@torch.inference_mode()
def selective_recompute_pieces(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    targets: Sequence[torch.Tensor],
    context: torch.Tensor | None | Sequence[torch.Tensor | None] = None,
    *,
    hook: LayerHook | None = None,
    block_size: int | None = None,
    inplace: bool = False,
    executor: str = "auto",
    suffix_ids: torch.Tensor | None = None,
    pace: pieces.Pace = pieces.WHOLE,
) -> Generator[None, None, RecomputeResult]:
    """Layer-by-layer selective recomputation over a stale cache. docs/methods.md#selective-recomputation;
    RelaxKV §3.3-§3.4, §A.2.

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
        block_size: rows per attention block (default 32 with the 'prefix' executor on a CPU, 128 on an
            accelerator; 256 with 'layer'). 'prefix'
            runs each layer ONCE for all its targets (projections and MLP as one GEMM each) and splits only the
            attention into position-ordered row blocks, each reading the key prefix its last row can see; 'layer'
            runs the decoder layer once per block of targets over the gathered context (later blocks read earlier
            blocks' fresh K/V from the working cache). The result does not depend on it (up to float rounding);
            smaller blocks compute fewer masked pairs (about half a block's span per row) at the price of more
            kernel calls.
        inplace: write into ``keys``/``values`` (the caller owns them, e.g. :meth:`FusionInput.working_kv`)
            instead of copies.
        executor: 'auto' ('prefix' when every layer's attention is plain softmax attention, else 'layer'),
            'prefix' or 'layer' (the reference; any attention the family implements).
        suffix_ids: [S] question suffix ids to prefill in the same layer calls (the "suffix fold"): they join
            every layer's targets at positions Tc..Tc+S-1 with their full causal prefix, exactly as the suffix
            prefill after the repair would compute them, and ``keys``/``values`` must then hold Tc + S positions
            (their K/V land there). Needs ``context`` None and no ``hook``. The result's states, edges and
            targets count the context only; ``suffix_hidden`` holds the suffix's last-layer states.
        pace: where to end a piece (:mod:`kvrag.kv.pieces`): before a linear layer or attention kernel, when due
            (:func:`kvrag.kv.pieces.call_pieces`). The layers run exactly as in one piece; the attention probe is
            uninstalled while other requests step.

    Returns:
        RecomputeResult (a generator's value: ``yield from``); ``seconds`` leaves out the time between pieces.
    """
    n_layers, _, tc, _ = keys.shape
    s_len = 0 if suffix_ids is None else int(suffix_ids.shape[0])
    if s_len:
        if context is not None or hook is not None:
            raise ValueError("suffix_ids needs the full causal context (context=None) and no hook")
        tc -= s_len
        if tc != int(token_ids.shape[0]):
            msg = (f"with suffix_ids, keys/values must hold the {int(token_ids.shape[0])} context + {s_len} suffix "
                   "positions")
            raise ValueError(msg)
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
    check_choice("selective_recompute", "executor", executor, ("auto", "prefix", "layer"))
    if executor == "auto":
        executor = "prefix" if plain_attention(model) else "layer"
    elif executor == "prefix" and not plain_attention(model):
        msg = "executor='prefix' needs plain softmax attention (no soft-capping, sinks or sliding windows); use 'layer'"
        raise ValueError(msg)
    # 32-row attention blocks waste few masked pairs and cost little per call on a CPU; an accelerator would
    # rather launch fewer, larger kernels
    small = 32 if keys.device.type == "cpu" else 128
    rows = block_size if block_size is not None else (small if executor == "prefix" else 256)
    attn = PrefixAttention(rows) if executor == "prefix" else None
    ids = token_ids
    if s_len:
        assert suffix_ids is not None
        sfx = torch.arange(tc, tc + s_len)
        plan = [torch.cat([t, sfx]) for t in plan]
        ids = torch.cat([token_ids.to("cpu", torch.long), suffix_ids.to("cpu", torch.long)])
    hf_cache.sync(keys.device)
    t0 = time.perf_counter()
    paused = pace.paused_s
    res, last_hidden = yield from pieces.call_pieces(
        lambda: _recompute_layers(model, ids, keys, values, plan, ctx_list, hook, rows, inplace, attn), pace,
        None if attn is None else lambda: hf_cache.capture_attention(model, attn))
    paused = pace.paused_s - paused
    hf_cache.sync(keys.device)
    if s_len:  # report the context's repair only: the suffix rows are the prefill every method pays
        sfx_edges = n_layers * (s_len * tc + s_len * (s_len + 1) // 2)
        res = dataclasses.replace(
            res, targets=[t[t < tc] for t in res.targets], states=res.states - n_layers * s_len,
            edges=res.edges - sfx_edges, computed_edges=res.computed_edges - sfx_edges,
            suffix_hidden=last_hidden[:, -s_len:])  # the suffix positions are the highest targets of every layer
    return dataclasses.replace(res, seconds=time.perf_counter() - t0 - paused)


def _recompute_layers(
    model: PreTrainedModel,
    token_ids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: list[torch.Tensor],
    ctx_list: list[torch.Tensor | None],
    hook: LayerHook | None,
    rows: int,
    inplace: bool,
    attn: PrefixAttention | None,
) -> tuple[RecomputeResult, torch.Tensor]:
    """The layer loop of :func:`selective_recompute` (its arguments, validated); returns the result (``seconds``
    and ``suffix_hidden`` left to the caller) and the last layer's output hidden states [1, N_last, hidden]."""
    n_layers = keys.shape[0]
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
        step = LayerTargets(model, layer, hidden, tgt, ctx_list[layer], k_out, v_out)
        hidden, e, c = run_targets_prefix(step, attn) if attn is not None else _run_targets(step, rows)
        edges += e
        computed += c
        states += int(tgt.numel())
        done.append(tgt)
        prev = tgt
    return RecomputeResult(k_out, v_out, done, states + extra, edges, 0.0, computed), hidden


def _run_targets(step: LayerTargets, block_size: int) -> tuple[torch.Tensor, int, int]:
    """Run one layer for the sorted targets ``step.tgt`` (blocks in position order); write their fresh K/V.

    The reference executor: one layer call per block of ``block_size`` targets, each over the gathered readable
    context plus the block's own fresh rows (dense [N, C + N] bias). :class:`PrefixAttention` gives the same result
    with one layer call for all targets; this path remains for attention that is not plain softmax (soft-capping,
    sinks, sliding windows), whose kernel we must not replace.

    Returns (hidden out, useful pairs, computed pairs)."""
    model, layer, hidden, tgt, ctx = step.model, step.layer, step.hidden, step.tgt, step.ctx
    k_out, v_out = step.k_out, step.v_out
    tc = k_out.shape[2]
    dev = k_out.device
    kind, size = layer_windows(model.config)[layer]
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
        if size is not None:  # a sliding / chunked layer sees only its window (kvrag.kv.window)
            mask &= window_mask(kind, size, blk, torch.cat([cpos, blk]))
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


def recompute_input(
    inp: FusionInput, targets: Sequence[torch.Tensor], context: torch.Tensor | None = None
) -> tuple[RecomputeResult, Cache, torch.Tensor | None]:
    """:func:`recompute_input_pieces` in one piece."""
    return pieces.run_whole(recompute_input_pieces(inp, targets, context))  # type: ignore[no-any-return]


def recompute_input_pieces(
    inp: FusionInput, targets: Sequence[torch.Tensor], context: torch.Tensor | None = None,
    pace: pieces.Pace = pieces.WHOLE,
) -> Generator[None, None, tuple[RecomputeResult, Cache, torch.Tensor | None]]:
    """:func:`selective_recompute_pieces` of ``targets`` over the input's working KV (in place), with the question
    suffix folded into the same layer calls when it can be: full causal context (``context`` None), the request's
    own buffer, and a family whose logits :func:`hf_cache.logits_head` computes. The suffix then costs a few more
    rows in GEMMs the repair runs anyway instead of a second pass over every layer's weights.

    Returns:
        (result, cache, last_logits): with the fold, the buffer's cache over context + suffix and the next-token
        logits [V] (the engine then skips its suffix prefill); else the cache over the repaired context and None.
    """
    head = hf_cache.logits_head(inp.model)
    s_len = int(inp.suffix_ids.shape[0])
    if context is None and inp.buffer is not None and head is not None and s_len:
        tc = inp.context_len
        keys, values = inp.buffer.context(tc + s_len)  # the views to use: reserve() may have moved the buffer
        res = yield from selective_recompute_pieces(inp.model, inp.token_ids, keys, values, targets, None,
                                                    inplace=True, suffix_ids=inp.suffix_ids, pace=pace)
        assert res.suffix_hidden is not None
        return res, inp.buffer.as_cache(tc + s_len), head(res.suffix_hidden[:, -1:])[-1]
    res = yield from selective_recompute_pieces(inp.model, inp.token_ids, *inp.working_kv(), targets, context,
                                                inplace=True, pace=pace)
    return res, inp.cache_over(res.keys, res.values), None


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
    cache: Cache | None = None,
    last_logits: torch.Tensor | None = None,
    **fields: Any,
) -> FusionOutput:
    """Wrap a recompute result with the statistics every selective method reports.

    See docs/methods.md#method-statistics.

    Stats: ``recomputed_fraction`` (recomputed (layer, token) states / (L * Tc)), ``context_fraction`` (|U| / Tc;
    1.0 for full-causal-prefix methods), ``attention_edges_ratio`` (useful recompute pairs / pairs of a full
    prefill of the context), ``attention_computed_ratio`` (pairs the kernels evaluated, masked ones included,
    same denominator), ``score_edges_ratio`` (pairs the scoring pass computed, same denominator), ``score_s``,
    ``recompute_s`` (the suffix's rows included when folded), ``suffix_folded`` (the suffix was prefilled inside
    the recompute, :func:`recompute_input`), plus ``fields`` (other :class:`MethodStats` fields, e.g.
    ``selected``). ``cache`` / ``last_logits``: what :func:`recompute_input` returned (default: the cache over
    ``res``'s context KV, no logits).
    """
    n_layers, _, tc, _ = inp.keys.shape
    full_edges = max(1, full_prefill_edges(n_layers, tc))
    stats = MethodStats(
        recomputed_fraction=res.states / max(1, n_layers * tc),
        context_fraction=float(context_fraction),
        attention_edges_ratio=res.edges / full_edges,
        attention_computed_ratio=res.computed_edges / full_edges,
        score_edges_ratio=score_edges / full_edges,
        score_s=float(score_s),
        recompute_s=float(res.seconds),
        recomputed_per_layer=[int(t.numel()) for t in res.targets],
        suffix_folded=last_logits is not None,
        **fields,
    )
    if cache is None:
        cache = inp.cache_over(res.keys, res.values)
    return FusionOutput(cache=cache, last_logits=last_logits, stats=stats)


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
