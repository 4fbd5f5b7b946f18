"""One decode step for many requests: the model's own layers on [B, 1, hidden], attention per request.

A batched decode step feeds one new token of each of B requests through the model's own forward at once, so the
projections, the MLP and the LM head run as [B, hidden] GEMMs (one read of the weights for B tokens), while each
request keeps its own KV in its own :class:`~kvrag.kv.hf_cache.KVBuffer` (repaired caches stay zero-copy: nothing is
stacked or padded into a shared batch cache). Per layer, the attention writes each row's fresh K/V at its position
in its buffer and attends every row's query over its own buffer in one call of kvrag's one-token kernel
(:mod:`kvrag.kv.row_attention`) -- the kernel the model's own one-token forward runs under ``kvrag_sdpa``, each
entry computed alone -- or, where that kernel does not serve (another device or dtype), with
``scaled_dot_product_attention(..., enable_gqa=True)`` per row over that buffer's views, exactly the call
transformers' ``sdpa`` makes for a one-token batch-1 step. Either way a batch of one is bit-identical to the model's
own decode step (tested) and a row's attention output is the one it would get alone;
the batched GEMMs may reorder sums
(float32: logits within 1e-4 of a batch-1 step, ~3e-6 on the tiny test models; bfloat16: a batched GEMM rounds its
bf16 outputs after summing in another order, an error of the kind and size of bf16's own rounding, so logits stay
within one and a half times the bf16 noise floor -- the largest |bf16 - fp32| logit of the same requests decoded
alone -- and the
greedy answers of the test prompts are unchanged; SmolLM2-135M on a CPU with AMX, 4 requests x 6 steps: identical
logits, the floor being 0.62. Both are tested).

How it runs (:mod:`kvrag.kv.step_backend`): through the backend chosen per model and step kind on its first step,
checked bit for bit against the model's own forward (the oracle) -- the fused step (:mod:`kvrag.kv.fused_step`:
fused products and one kernel call per layer for RoPE, the K/V write and the attention; every family of
``docs/models.md`` it lays out), the direct loop (:mod:`kvrag.kv.direct`: the model's modules in a loop of kvrag's;
Llama, Mistral, Qwen2, Qwen3, Gemma 3), or the model's own forward with

* a pass-through cache (``update`` hands the fresh K/V back unchanged) and an explicit 4D attention mask, which
  transformers' mask builders return as it is (no [B, 1, 1, T] masks are built for the ragged rows);
* a thread-local "batched step is active" record of the rows, which ``gqa_sdpa_attention`` (the registered
  ``kvrag_sdpa`` implementation, :mod:`kvrag.kv.attention`) checks first and hands to :func:`attention`.

Attention windows (:mod:`kvrag.kv.window`): a sliding layer attends to the last ``W`` keys (``k > q - W``), a
chunked layer to its own aligned chunk of ``W`` keys, as transformers' mask overlays define them.

:func:`batchable` says when a model can run this step (the ``kvrag_sdpa`` implementation, no logit soft-capping or
attention sinks); other models are decoded one row at a time by the caller.

Where a step's time goes (same setting, bf16, eager): at batch 1 the GEMMs dominate (weight reads); at batch 8 the
per-row attention over 1.5K keys each is the largest part (8 rows x 30 layers), which kvrag's one-token kernel
takes in 30 calls.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from transformers.cache_utils import Cache

from kvrag.kv import direct, int8kv, row_attention, step_backend
from kvrag.kv.aligned import aligned_attention
from kvrag.kv.hf_cache import KVBuffer
from kvrag.kv.window import first_key, layer_windows

if TYPE_CHECKING:
    from transformers import PreTrainedModel



@dataclasses.dataclass
class Row:
    """One request in a batched step: its buffer and how many positions it holds before the step (= the position of
    the token it feeds)."""

    buffer: KVBuffer
    length: int

    @classmethod
    def for_decode(cls, buf: KVBuffer, length: int, capacity: int, dtype: torch.dtype | None = None) -> Row:
        """The row a request decodes in: room for ``capacity`` positions, the first ``length`` those of ``buf``, its
        K/V in ``dtype`` (None: ``buf``'s) -- ``buf`` itself (grown where short) in its own dtype, else a new buffer
        holding those positions rounded (or quantized) to ``dtype``: the prompt's K/V are computed (and chunk caches
        repaired) in the model's dtype, and only decode reads the narrower copy."""
        if dtype is None or dtype == buf.keys.dtype:
            buf.reserve(capacity)
            return cls(buf, length)
        layers, heads = buf.keys.shape[:2]
        new = KVBuffer(layers, heads, buf.head_dim, max(capacity, length), dtype, buf.keys.device)
        new.put(buf, length)
        return cls(new, length)

    def cache(self, dtype: torch.dtype) -> Cache:
        """The row's K/V as a transformers cache in ``dtype`` (the row's buffer itself in its own dtype, else a
        copy)."""
        return Row.for_decode(self.buffer, self.length, self.length, dtype).buffer.as_cache(self.length)


class _Active:
    """The rows of the batched step running in this thread, each layer's attention window and, for a verify step
    (:func:`verify_step`) or a suffix prefill (:func:`prefill_rows`), how many tokens each row feeds (None: one
    each, laid out as [B, 1]). ``prefill``: each row's tokens attend together, masked, as a prefill's do (see
    :func:`_attend_prefill`)."""

    __slots__ = ("check", "counts", "masks", "prefill", "rows", "windows")

    def __init__(self, rows: Sequence[Row], windows: Sequence[tuple[str, int | None]],
                 counts: Sequence[int] | None = None, prefill: bool = False, check: bool = True) -> None:
        self.rows = rows
        self.windows = windows
        self.counts = counts
        self.prefill = prefill
        self.check = check  # False: before the model's backends are checked, run the reference forward unchecked
        self.masks: dict[tuple[int, str, int | None], torch.Tensor] = {}

    def fed(self) -> Sequence[int]:
        """How many tokens each row feeds in this step."""
        return [1] * len(self.rows) if self.counts is None else self.counts

    def mask(self, i: int, kind: str, size: int | None, n: int, q: int, like: torch.Tensor) -> torch.Tensor:
        """Row ``i``'s bool [1, 1, q, n + q] mask over its buffer's positions ``0 .. n + q - 1`` for its ``q`` tokens
        at ``n ..``, built once per window kind and step: causal, within the layer's window."""
        key = (i, kind, size)
        got = self.masks.get(key)
        if got is None:
            qp = torch.arange(n, n + q, device=like.device).view(-1, 1)
            kp = torch.arange(0, n + q, device=like.device).view(1, -1)
            allowed = kp <= qp
            if size is not None:
                allowed &= kp >= (qp // size) * size if kind == "chunked_attention" else kp > qp - size
            got = self.masks[key] = allowed.view(1, 1, q, n + q)
        return got


_local = threading.local()


def active() -> bool:
    """True while a batched step runs in this thread (its attention calls belong to :func:`attention`)."""
    return getattr(_local, "step", None) is not None


def _write_fresh(row: Row, layer: int, key: torch.Tensor, value: torch.Tensor, o: int,
                 q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a row's ``q`` fresh K/V (at ``o ..`` of the packed [1, H_kv, T, D] ``key`` / ``value``) into its
    buffer at its positions ``row.length ..``; returns the buffer's [H_kv, capacity, D] keys and values of
    ``layer``."""
    n = row.length
    kb, vb = row.buffer.keys[layer], row.buffer.values[layer]
    if row.buffer.quantized:  # each fresh position quantized once, as the fused step's kernel writes it
        kb[:, n : n + q].copy_(int8kv.quantize(key[0, :, o : o + q]))
        vb[:, n : n + q].copy_(int8kv.quantize(value[0, :, o : o + q]))
        return kb, vb
    kb[:, n : n + q].copy_(key[0, :, o : o + q])
    vb[:, n : n + q].copy_(value[0, :, o : o + q])
    return kb, vb


def _attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """Write each row's fresh K/V into its buffer and attend each row to its own buffer.

    A plain step feeds one token per row, batched as [B, H, 1, D] (returns [B, 1, H, D]); a verify step
    (:func:`verify_step`) packs ``counts[i]`` tokens of row ``i`` along one sequence, [1, H, T, D] (returns
    [1, T, H, D]). A plain step is read as the packed layout with one token per row (a transposed view: each row's
    query is then the same tensor, strides included, as a slice of the batch), so both run one loop.

    Each query attends alone over its own buffer up to its position -- all queries of the layer in one call of
    kvrag's one-token kernel where it serves (:func:`kvrag.kv.row_attention.serves`), else with the call
    transformers' sdpa makes for a one-token, mask-free batch-1 step: a batch of one is bit-identical to the
    model's own step (whose one-token attention takes the same path), and a verified position to a plain step's.
    A masked multi-query call would read the context once but sums in another order
    (bfloat16 attention outputs differ by ~2e-4, float32 by ~1e-7), and through bf16 roundings -- the model's, or
    the quantized products' bf16 activations -- that moves logits by up to 0.4 (SmolLM2-135M, int4, float32 or
    bfloat16), enough to flip greedy choices in near-ties. With per-query calls a verified position's logits are
    bit-identical to a plain step's wherever the model's products compute each row alone (int4 / int8 weights,
    packed bf16 linears: tested); dense float32 GEMMs differ by ~1e-5 across row counts, as batched decoding's do.
    """
    step: _Active = _local.step
    if step.prefill:
        return _attend_prefill(step, layer, query, key, value, scaling)
    plain = step.counts is None
    if plain:  # [B, H, 1, D] -> [1, H, B, D]: row i's one token at i
        query, key, value = query.transpose(0, 2), key.transpose(0, 2), value.transpose(0, 2)
    counts = step.fed()
    out = torch.empty((1, query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype, device=query.device)
    kind, size = step.windows[layer]
    keys = []  # per query: its row's K / V and the positions it attends to
    o = 0
    for row, q in zip(step.rows, counts, strict=True):
        kb, vb = _write_fresh(row, layer, key, value, o, q)
        keys += [(kb, vb, first_key(kind, size, p), p + 1) for p in range(row.length, row.length + q)]
        o += q
    kv_dtype = keys[0][0].dtype  # the rows' buffers: the model's dtype, or narrower (KVBuffer.for_decode)
    if row_attention.serves(query, kv_dtype):  # every query of the layer in one call of kvrag's kernel
        row_attention.attend(query, keys, out, scaling)
    else:  # K/V narrower than the query widened (int8: de-quantized) to its dtype first
        d = query.shape[-1]
        wide = (lambda x: int8kv.dequantize(x, d)) if kv_dtype == torch.int8 else (lambda x: x)
        for i, (kb, vb, s0, end) in enumerate(keys):
            a = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, i : i + 1], wide(kb[None, :, s0:end]).to(query.dtype),
                wide(vb[None, :, s0:end]).to(query.dtype), scale=scaling, enable_gqa=True)
            out[0, i].copy_(a[0, :, 0])
    return out.view(len(step.rows), 1, *out.shape[2:]) if plain else out


def _attend_prefill(step: _Active, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """:func:`_attend` for :func:`prefill_rows`: the packed [1, H, T, D] tokens of each row written into its buffer,
    then attending per row -- all of the row's queries over its buffer up to its last token, masked causally (and to
    the layer's window) -- through :func:`kvrag.kv.aligned.aligned_attention`, as the model's own prefill does: a
    row's bits are those of a prefill of its whole prompt. The row's result depends on its own tokens and buffer
    only, never on the rows packed beside it."""
    counts = step.fed()
    if any(row.buffer.quantized for row in step.rows):
        raise ValueError("a suffix prefill computes a prompt's K/V in the model's dtype, not into int8 K/V")
    out = torch.empty((1, query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype, device=query.device)
    kind, size = step.windows[layer]
    o = 0
    for i, (row, q) in enumerate(zip(step.rows, counts, strict=True)):
        n = row.length
        kb, vb = _write_fresh(row, layer, key, value, o, q)
        mask = step.mask(i, kind, size, n, q, query)
        out[0, o : o + q].copy_(aligned_attention(query[:, :, o : o + q], kb[None, :, : n + q], vb[None, :, : n + q],
                                                  mask, scaling)[0])
        o += q
    return out


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: float | None) -> tuple[torch.Tensor, None]:
    """The attention of a batched step (called by ``gqa_sdpa_attention`` while :func:`active`).

    Args:
        query: [B, H, 1, D] (RoPE applied); key, value: [B, H_kv, 1, D] the rows' fresh K/V (a verify step:
            [1, H, T, D] and [1, H_kv, T, D], the rows' tokens packed).

    Returns:
        (attn_output [B, 1, H, D] or [1, T, H, D], None), the layout transformers' attention functions return.
    """
    return _attend(int(cast("int", module.layer_idx)), query, key, value, scaling), None


def batchable(model: PreTrainedModel, impl: str) -> str | None:
    """None when :func:`decode_step` can serve ``model``, else why not (it runs attention implementation
    ``impl``, the registered ``kvrag_sdpa``, with no logit soft-capping or sinks)."""
    from transformers import PretrainedConfig

    configs = [c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)]
    impls = {getattr(c, "_attn_implementation", None) for c in configs}
    if impls != {impl}:
        return f"attention implementation {sorted(map(str, impls))} (batched decoding needs {impl!r})"
    for c in configs:
        if getattr(c, "attn_logit_softcapping", None) or getattr(c, "use_sink", False):
            return "attention logit soft-capping / sinks"
    return None


def decode_kv_dtype(model: PreTrainedModel, setting: str, unbatchable: str | None,
                    head_dim: int | None = None) -> torch.dtype:
    """The dtype of the K/V buffer a request of ``model`` decodes over, for ``EngineConfig.kv_dtype`` ``setting``
    ("auto": the model's dtype); ConfigError where the steps cannot read it: batched steps read float32 or bfloat16
    K/V under a float32 model, the model's dtype otherwise, and int8 K/V (:mod:`kvrag.kv.int8kv`) under a float32
    or bfloat16 model where kvrag's row attention serves them (``unbatchable``: why rows are stepped alone, through
    the model's own forward, which reads its own dtype)."""
    from kvrag.errors import ConfigError

    mdtype = model.dtype
    want: torch.dtype = mdtype if setting == "auto" else getattr(torch, setting)
    if want == mdtype:
        return want
    if want == torch.int8:
        why = (f"float32 and bfloat16 models only, not {mdtype}" if mdtype not in (torch.float32, torch.bfloat16)
               else f"heads of {head_dim}, not a multiple of 16" if head_dim is not None and head_dim % 16
               else row_attention.why_not(mdtype, torch.int8))
        if why is not None:
            msg = (f"kv_dtype='int8': kvrag's row attention does not read int8 K/V here ({why}); use "
                   "kv_dtype='auto'")
            raise ConfigError(msg)
    elif (mdtype, want) != (torch.float32, torch.bfloat16):
        msg = (f"kv_dtype={setting!r} under a {mdtype} model: decode K/V are the model's dtype, bfloat16 under a "
               "float32 model, or int8; use kv_dtype='auto'")
        raise ConfigError(msg)
    if unbatchable is not None:
        msg = (f"kv_dtype={setting!r}: this model's rows decode through its own forward ({unbatchable}), which reads "
               "K/V in its own dtype; use kv_dtype='auto'")
        raise ConfigError(msg)
    return want


def windows(model: PreTrainedModel) -> list[tuple[str, int | None]]:
    """Per decoder layer, (layer type, window or None) as :func:`decode_step` applies them."""
    return layer_windows(model.config)


def _forward(model: PreTrainedModel, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
             keep: int | torch.Tensor = 1) -> torch.Tensor:
    """The step of the rows active in this thread through the backend :mod:`kvrag.kv.step_backend` chose for the
    model: logits [B, V] (``keep`` 1) or, for one packed row, [T, V] (``keep`` 0) or the rows of the positions in a
    1D tensor ``keep``."""
    step: _Active = _local.step
    kind = "prefill" if step.prefill else "decode"
    s = step_backend.Step(model, ids, pos, mask, keep, step.rows, step.fed(), step.windows, attention)
    if not step.check and step_backend.chosen(model, kind) is None:
        logits = step_backend.ORACLE.run(s)
    else:
        logits = step_backend.run(s, kind)
    return logits[:, -1] if isinstance(keep, int) and keep == 1 else logits[0]


@torch.inference_mode()
def decode_step(model: PreTrainedModel, rows: Sequence[Row], tokens: Sequence[int],
                layer_windows_: Sequence[tuple[str, int | None]]) -> torch.Tensor:
    """Feed ``tokens[i]`` to request ``rows[i]`` at position ``rows[i].length``, all rows in one forward.

    Each row's buffer must have room for one more position (the caller reserves it); its fresh K/V are written
    there, and the caller advances ``length``. The caller holds the model's lock.

    Returns:
        logits [B, V] (float32) of the next token of each row (the last position only).
    """
    dev = model.device
    ids = torch.tensor(list(tokens), dtype=torch.long, device=dev).view(-1, 1)
    pos = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev).view(-1, 1)
    mask = torch.ones((len(rows), 1, 1, 1), dtype=torch.bool, device=dev)  # 4D: the mask builders pass it through
    _local.step = _Active(rows, layer_windows_)
    try:
        return _forward(model, ids, pos, mask).float()
    finally:
        _local.step = None


def _packed(model: PreTrainedModel, rows: Sequence[Row], tokens: Sequence[Sequence[int]],
            what: str) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several tokens per row packed along one sequence: (tokens per row, ids [1, T], positions [1, T] -- row
    ``i``'s from ``rows[i].length`` on --, the 4D all-true mask transformers' mask builders pass through)."""
    dev = model.device
    counts = [len(t) for t in tokens]
    if not counts or min(counts) < 1:
        raise ValueError(f"{what}: every row feeds at least one token")
    flat = [int(t) for ts in tokens for t in ts]
    ids = torch.tensor(flat, dtype=torch.long, device=dev).view(1, -1)
    pos = torch.tensor([r.length + j for r, q in zip(rows, counts, strict=True) for j in range(q)], dtype=torch.long,
                       device=dev).view(1, -1)
    return counts, ids, pos, torch.ones((1, 1, len(flat), 1), dtype=torch.bool, device=dev)


@torch.inference_mode()
def verify_step(model: PreTrainedModel, rows: Sequence[Row], tokens: Sequence[Sequence[int]],
                layer_windows_: Sequence[tuple[str, int | None]]) -> torch.Tensor:
    """Feed each row several tokens in one forward: ``tokens[i]`` (its next input and the draft after it) at
    positions ``rows[i].length ..``, packed along one sequence, every row attending causally to its own buffer.

    What speculative decoding verifies with (:mod:`kvrag.engine.speculate`): the logits at each fed position are the
    ones plain steps would compute after the same tokens, so a draft is checked against greedy choices in one
    forward. Each row's buffer needs room for its tokens; the caller advances ``length`` past the accepted ones only
    (K/V written past that are overwritten by later steps: the roll-back costs nothing).

    Returns:
        logits [sum(len(t) for t in tokens), V] (float32), row after row.
    """
    counts, ids, pos, mask = _packed(model, rows, tokens, "verify_step")
    _local.step = _Active(rows, layer_windows_, counts)
    try:
        return _forward(model, ids, pos, mask, keep=0).float()
    finally:
        _local.step = None


@torch.inference_mode()
def prefill_rows(model: PreTrainedModel, rows: Sequence[Row], tokens: Sequence[Sequence[int]],
                 layer_windows_: Sequence[tuple[str, int | None]], *, check: bool = False) -> torch.Tensor:
    """Prefill several requests' question suffixes: ``tokens[i]`` at positions ``rows[i].length ..`` after the
    context in row ``i``'s buffer (its repaired cache), each row's tokens attending causally to its own buffer in
    one masked call.

    Where the direct loop serves the model's prefills (:func:`kvrag.kv.step_backend.serves`) the rows go in one
    forward, packed along one sequence, every linear layer running one row's tokens at a time (``segments``): each
    row computes exactly what it computes alone -- the same bits, the same weight route (quantized for short
    suffixes) -- while the per-call overhead of the forward is paid once and each weight is read from memory once
    for all rows. Only the output head runs over the rows' last positions together, as in a decode step (a dense
    float32 head sums a B-row product in another order than a 1-row one, ~1e-6, as batched decoding's does). Other
    models run one forward per row. The caller holds the model's lock and advances each row's length.

    The prefill backends are checked against the model's forward (:mod:`kvrag.kv.step_backend`) on the first row
    of the first prefill of several rows, where packing pays; until then a lone row runs the model's own forward
    unchecked (``check``: check now), which is as fast for one row, so a process's first answer does not pay the
    check (a second forward: seconds on an 8B model).

    Returns:
        logits [B, V] (float32) of the next token after each row's last fed token.
    """
    if len(rows) > 1 and step_backend.chosen(model, "prefill") is None:  # the first row alone: the first check
        return torch.cat([prefill_rows(model, rows[:1], tokens[:1], layer_windows_, check=True),
                          prefill_rows(model, rows[1:], tokens[1:], layer_windows_)])
    if len(rows) > 1 and not step_backend.serves(model, "prefill", "direct"):
        return torch.cat([prefill_rows(model, [r], [t], layer_windows_) for r, t in zip(rows, tokens, strict=True)])
    counts, ids, pos, mask = _packed(model, rows, tokens, "prefill_rows")
    for r, q in zip(rows, counts, strict=True):
        if r.length + q > r.buffer.capacity:
            raise ValueError(f"prefill_rows: a row of {r.length} positions has no room for {q} more "
                             f"(capacity {r.buffer.capacity})")
    last = torch.tensor(counts, device=model.device).cumsum(0) - 1
    _local.step = _Active(rows, layer_windows_, counts, prefill=True, check=check or len(rows) > 1)
    try:
        if len(rows) > 1:
            return direct.forward(model, ids, pos, last, attention, counts)[0].float()
        return _forward(model, ids, pos, mask, keep=last).float()
    finally:
        _local.step = None


__all__ = ["Row", "active", "attention", "batchable", "decode_kv_dtype", "decode_step", "prefill_rows",
           "verify_step", "windows"]
