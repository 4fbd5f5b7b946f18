"""A decode or verify step in fewer calls: each layer's q/k/v and gate/up products fused, and RoPE, the fresh K/V's
write and every query's attention in one call of kvrag's kernel.

A decode step of a small model is mostly calls: :mod:`kvrag.kv.direct` runs ~85 tensor operations a layer around
its seven products and one attention call (norms, three projections, views and transposes, RoPE's slices,
negations, concatenations, products and sums, each row's K/V written by two slice copies, the attention's entries
built in Python), and each is a dispatch whose fixed cost adds up. This step runs a layer as

* the input norm (transformers' RMS norm in fewer dispatches, :func:`_rms_norm`; other norms their own forward);
* one product for q, k and v (:class:`kvrag.kv.quant.Fused`: kvrag's int4 weights side by side; without them,
  the three modules' own products, concatenated);
* one call of ``kvrag_rope_attend`` (``row_attention.c``): per query, transformers' ``q * cos + rotate_half(q) *
  sin`` on q and k -- each product and the sum rounded as torch's operations round them, never contracted into a
  fused multiply-add --, k and v written at the query's position of its row's buffer, then the query's attention
  over its row's keys, computed as :func:`kvrag.kv.row_attention.attend` computes it (all writes first, so a verify
  step's positions see the keys of the row's earlier positions);
* ``o_proj``, the residual, the second norm, one product for gate and up, ``down(act(gate) * up)``, the residual;

then the final norm and the output head. The per-query addresses for every layer are built once a step.

Which models: the decoder layouts of :mod:`kvrag.kv.step_layout` -- Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3,
Granite, SmolLM3, Phi-3, OLMo 2, EXAONE 4, Cohere, StableLM and Phi: their norms where the family puts them (Gemma 3's
four per layer, OLMo 2's after attention and the MLP, Cohere's one before both in parallel), q / k norms per head
or over the whole projection run on the fused product's columns in place before the kernel call, each layer's RoPE
tables (Gemma 3's per layer type; none for the RoPE-free layers of SmolLM3 and EXAONE 4, whose q and k the kernel
takes as they are; Cohere's interleaved pairs; Cohere's and OLMo 2's bfloat16 heads rotated in float32; partial
rotary, the rest of each head passed as it is: StableLM, Phi-4-mini; :func:`rope_mode`), Granite's multipliers and
the logit scaling or soft-capping -- in float32 or bfloat16 where kvrag's row attention serves the dtype; a float32
model's rows may hold bfloat16 K/V (the fresh k and v rounded as they are written). It is one backend of :mod:`kvrag.kv.step_backend`, which checks its first step of each model against the model's forward
(logits and written K/V, bit for bit) before it serves that model.
"""

from __future__ import annotations

import array
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvrag.kv import int8kv, native, quant, row_attention, step_layout
from kvrag.kv.window import first_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvrag.kv.hf_cache import KVBuffer


class StepRow(Protocol):
    """What a step reads of a request's row (a :class:`kvrag.kv.batched.Row`; batched imports the step's modules):
    the K/V buffer it reads and writes, and how many positions of it are filled."""

    @property
    def buffer(self) -> KVBuffer: ...

    @property
    def length(self) -> int: ...


_plans: weakref.WeakKeyDictionary[PreTrainedModel, _Plan] = weakref.WeakKeyDictionary()


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "GraniteRMSNorm", "SmolLM3RMSNorm",
             "Phi3RMSNorm", "Exaone4RMSNorm")
"""Norm classes whose forward :func:`_rms_norm` computes (transformers' ``weight * (x * rsqrt(mean(x^2) + eps))``,
in float32, the result cast back before the weight)."""

GEMMA_NORMS = ("GemmaRMSNorm", "Gemma3RMSNorm")
"""Norm classes whose forward :func:`_rms_norm` computes as Gemma's: ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` in
float32, the product cast back."""


def _rms_norm(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward in fewer dispatches than transformers' RMS norm: torch's CPU ``mean`` is its ``sum``
    divided by the count (both kept here, the count and eps as float32 tensors, so no scalar is wrapped each call),
    the two no-op casts of a float32 model are skipped and Gemma's ``1 + w`` is computed again only when the
    weight changed. Other norm classes: their own forward."""
    name = type(module).__name__
    gemma = name in GEMMA_NORMS and isinstance(getattr(module, "eps", None), float)
    if not gemma and (name not in RMS_NORMS or not isinstance(getattr(module, "variance_epsilon", None), float)):
        return module.forward  # type: ignore[no-any-return]
    w = module.weight
    count = torch.tensor(float(w.shape[-1]))
    eps = torch.tensor(module.eps if gemma else module.variance_epsilon, dtype=torch.float32)

    if gemma:
        scale: list[Any] = [None, None]  # (the weight's identity and version, 1 + w in float32)

        def forward_gemma(h: torch.Tensor) -> torch.Tensor:
            wt = module.weight
            key = (id(wt), wt.data_ptr(), wt._version)
            if scale[0] != key:
                scale[0], scale[1] = key, 1.0 + wt.float()
            f = h if h.dtype == torch.float32 else h.float()
            y = f * f.pow(2).sum(-1, keepdim=True).div_(count).add_(eps).rsqrt_() * scale[1]
            return y if h.dtype == torch.float32 else y.to(h.dtype)

        return forward_gemma

    def forward(h: torch.Tensor) -> torch.Tensor:
        f = h if h.dtype == torch.float32 else h.float()
        y = f * f.pow(2).sum(-1, keepdim=True).div_(count).add_(eps).rsqrt_()
        return module.weight * (y if h.dtype == torch.float32 else y.to(h.dtype))

    return forward


class _Layer:
    __slots__ = ("act", "down", "gu", "gu_mods", "inter", "k_norm", "mlp", "norm1", "norm2", "norm3", "norm4",
                 "o_proj", "q_norm", "qkv", "qkv_mods", "rope", "scaling")

    def __init__(self, model: PreTrainedModel, i: int, order: str, d: int) -> None:
        layer = model.model.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        norms = {"pre": ("input_layernorm", "post_attention_layernorm", None, None),
                 "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                              "post_feedforward_layernorm"),
                 "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
                 "parallel": ("input_layernorm", None, None, None)}[order]
        self.norm1, self.norm2, self.norm3, self.norm4 = (None if n is None else _rms_norm(getattr(layer, n))
                                                          for n in norms)
        self.qkv_mods = (a.qkv_proj,) if hasattr(a, "qkv_proj") else (a.q_proj, a.k_proj, a.v_proj)
        self.qkv = quant.fuse_int4(self.qkv_mods) if len(self.qkv_mods) > 1 else None
        self.o_proj, self.mlp = a.o_proj if hasattr(a, "o_proj") else a.dense, mlp
        self.down = getattr(mlp, "down_proj", None)
        if not hasattr(mlp, "gate_proj"):  # Phi-3's gate and up as one module, Phi's fc1 / fc2: the MLP's forward
            self.gu_mods: tuple[Any, ...] = ()
            self.gu, self.act, self.inter = None, None, 0
        else:
            self.gu_mods = (mlp.gate_proj, mlp.up_proj)
            self.gu = quant.fuse_int4(self.gu_mods)
            self.act = mlp.act_fn.forward if isinstance(mlp.act_fn, torch.nn.Module) else mlp.act_fn
            self.inter = int(mlp.gate_proj.weight.shape[0])
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)  # q / k norms (per head or whole)
        self.q_norm = None if qn is None else _rms_norm(qn)
        self.k_norm = None if kn is None else _rms_norm(kn)
        self.scaling = float(a.scaling) if a.scaling is not None else d**-0.5
        self.rope = step_layout.rope_key(model, i)


class _Plan:
    __slots__ = ("d", "dtype", "fam", "head_norm", "heads", "kv_heads", "layers", "lib", "order", "residual",
                 "rope_mode", "ropes")

    def __init__(self, model: PreTrainedModel, lib: row_attention._Lib) -> None:
        cfg = model.config
        a = model.model.layers[0].self_attn
        self.d = int(a.head_dim)
        self.heads, self.kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.dtype = model.dtype
        self.lib = lib
        self.fam = step_layout.FAMILIES[type(model).__name__]
        self.head_norm = self.fam.qk_norm != "full"
        self.rope_mode = rope_mode(self.fam, self.dtype, step_layout.rotary_dim(model), self.d)
        self.order = step_layout.order(model)
        self.layers: list[_Layer] = []
        for i in range(cfg.num_hidden_layers):  # a layer's own layouts are freed as its fused ones are made: their
            self.layers.append(_Layer(model, i, self.order, self.d))
            native.trim_heap()  # pages handed back one layer at a time, not kept in the heap beside the fused ones
        self.ropes = {layer.rope for layer in self.layers}
        self.residual = float(model.model.layers[0].residual_multiplier) if self.fam.multipliers else None
        widths = (self.heads * self.d, self.kv_heads * self.d, self.kv_heads * self.d)
        for layer in self.layers:  # kvrag_rope_attend reads each row of the q/k/v product at these offsets
            outs = tuple(int(m.weight.shape[0]) for m in layer.qkv_mods)
            if outs != widths and outs != (sum(widths),):
                msg = f"q / k / v projections of {list(outs)} outputs, not {widths}"
                raise ValueError(msg)


ROPE_PAIRS, ROPE_WIDE, ROPE_DIMS = 1, 2, 256
"""``kvrag_rope_attend``'s RoPE mode bits (``row_attention.c``): interleaved pairs; rotated in float32; the rotated
dimensions (partial rotary) times ``ROPE_DIMS`` (0: the whole head)."""


def rope_mode(fam: step_layout.Family, dtype: torch.dtype, rot: int, d: int) -> int:
    """``kvrag_rope_attend``'s RoPE mode for a family's heads of ``d`` in ``dtype``, ``rot`` of them rotated (float32
    heads: rotated in float32 anyway)."""
    return ((ROPE_PAIRS if fam.rope_pairs else 0) | (ROPE_WIDE if fam.rope_wide and dtype != torch.float32 else 0)
            | (rot * ROPE_DIMS if rot != d else 0))


def _table_dtype(fam: step_layout.Family, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if fam.rope_wide and dtype != torch.float32 else dtype


def why_not(model: PreTrainedModel) -> str | None:
    """None when :func:`forward` can run ``model``'s decode and verify steps, else why not."""
    why = step_layout.why_not(model)
    if why is not None:
        return why
    cfg = model.config
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        return f"{model.dtype} on {model.device.type} (it runs float32 or bfloat16 on the CPU)"
    d = int(model.model.layers[0].self_attn.head_dim)
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    rot = step_layout.rotary_dim(model)
    if heads % kv_heads or d % 8 or rot % 2 or not 0 < rot <= d:
        return f"a head layout kvrag's kernel does not take ({heads} / {kv_heads} heads of {d}, {rot} rotated)"
    if not row_attention.serves(torch.empty(1, 1, 1, d, dtype=model.dtype)):
        return f"kvrag's row attention does not serve {model.dtype} here: {row_attention.why_not(model.dtype)}"
    keys = {step_layout.rope_key(model, i) for i in range(cfg.num_hidden_layers)}
    fam = step_layout.FAMILIES[type(model).__name__]
    with torch.inference_mode():
        h = torch.zeros(1, 1, int(cfg.hidden_size), dtype=model.dtype)
        for k, t in step_layout.rope_tables(model, keys, h, torch.zeros(1, 1, dtype=torch.long)).items():
            if t is not None and ((t[0].dtype != model.dtype and _table_dtype(fam, model.dtype) == model.dtype)
                                  or t[0].shape[-1] != rot):
                return (f"RoPE tables of {t[0].shape[-1]} {t[0].dtype} for heads of {d} {model.dtype} (the model "
                        f"rotates in another dtype{'' if not k else ' in ' + k + ' layers'})")
    return None


def _plan(model: PreTrainedModel) -> _Plan:
    plan = _plans.get(model)
    if plan is None:
        plan = _plans[model] = _Plan(model, row_attention.library(model.dtype))
    return plan


def _kv_dtype(plan: _Plan, rows: Sequence[StepRow]) -> torch.dtype:
    """The K/V dtype of a step's rows: the model's, bfloat16 under a float32 model, or int8 (every row alike)."""
    kinds = {r.buffer.keys.dtype for r in rows}
    kv = kinds.pop() if len(kinds) == 1 else None
    if kv is None or (kv not in (plan.dtype, torch.int8) and (plan.dtype, kv) != (torch.float32, torch.bfloat16)):
        msg = f"rows' K/V buffers of {sorted(map(str, kinds | {kv}))} under a {plan.dtype} model"
        raise ValueError(msg)
    if kv != plan.dtype:
        row_attention.library(plan.dtype, kv)  # RuntimeError where that path does not serve here
    return kv


def _products(fused: quant.Fused | None, mods: Sequence[torch.nn.Linear], x: torch.Tensor, n_q: int) -> torch.Tensor:
    """The products of ``mods`` on ``x`` [B, S, hidden] side by side: [B * S, sum of outputs], contiguous."""
    if fused is not None and n_q <= quant.MAX_ROWS and fused.valid():
        return fused.mm(x.view(n_q, -1))
    if len(mods) == 1:
        return mods[0].forward(x).reshape(n_q, -1).contiguous()
    return torch.cat([m.forward(x) for m in mods], -1).view(n_q, -1)


def _mlp(layer: _Layer, x: torch.Tensor, b: int, s: int, n_q: int) -> torch.Tensor:
    """The layer's MLP on ``x`` [B, S, hidden]: one product for gate and up, ``down(act(gate) * up)`` (Phi-3's
    fused gate / up and Phi's fc1 / fc2: the module's own forward)."""
    if layer.act is None:
        return layer.mlp.forward(x)  # type: ignore[no-any-return]
    gu = _products(layer.gu, layer.gu_mods, x, n_q).view(b, s, -1)
    return layer.down.forward(layer.act(gu[..., : layer.inter]) * gu[..., layer.inter :])  # type: ignore[union-attr]


def _entries(plan: _Plan, rows: Sequence[StepRow], counts: Sequence[int],
             windows: Sequence[tuple[str, int | None]], kv_dtype: torch.dtype) -> array.array:
    """int64 [layers, queries, 5]: each query's keys / values address of the layer, K/V head stride, position and
    first attended position (``kvrag_rope_attend``'s entries)."""
    el = torch.empty((), dtype=kv_dtype).element_size()
    pd = int8kv.width(plan.d, kv_dtype)  # elements a position takes
    per_query = []
    for r, q in zip(rows, counts, strict=True):
        k, v = r.buffer.keys, r.buffer.values
        if (k.dtype != kv_dtype or v.dtype != kv_dtype or k.stride() != v.stride() or k.stride()[2:] != (pd, 1)
                or k.shape != v.shape or k.shape[0] < len(plan.layers)
                or k.shape[1] != plan.kv_heads or k.shape[3] != pd or not k.is_cpu):
            msg = (f"a row's K/V buffer ({k.dtype}, {tuple(k.shape)}, strides {k.stride()}) is not the step's "
                   f"dtype or layout ({kv_dtype}, [{len(plan.layers)}, {plan.kv_heads}, T, {pd}])")
            raise ValueError(msg)
        if r.length + q > k.shape[2]:
            msg = f"a row of {r.length} positions has no room for {q} more (capacity {k.shape[2]})"
            raise ValueError(msg)
        kp, vp, ls, hs = k.data_ptr(), v.data_ptr(), k.stride(0) * el, k.stride(1)
        per_query += [(kp, vp, ls, hs, p) for p in range(r.length, r.length + q)]
    if len(windows) != len(plan.layers):
        msg = f"{len(windows)} layer windows for {len(plan.layers)} layers"
        raise ValueError(msg)
    out = array.array("q")
    for i, (kind, size) in enumerate(windows):
        for kp, vp, ls, hs, p in per_query:
            out.extend((kp + i * ls, vp + i * ls, hs, p, first_key(kind, size, p)))
    return out


def _norm_heads(norm: Callable[[torch.Tensor], torch.Tensor], part: torch.Tensor, n_q: int, d: int) -> None:
    """``part`` [Q, heads * d] (columns of the q/k/v product) normed per head in place: ``norm`` runs on the heads
    laid out contiguously, [Q, heads, d], as in the model's forward."""
    part.copy_(norm(part.contiguous().view(n_q, -1, d)).view(n_q, -1))


@torch.inference_mode()
def forward(model: PreTrainedModel, ids: torch.Tensor, pos: torch.Tensor, keep: int | torch.Tensor, rows: Sequence[StepRow],
            counts: Sequence[int], windows: Sequence[tuple[str, int | None]]) -> torch.Tensor:
    """A step feeding ``counts[i]`` tokens to row ``rows[i]`` (``ids`` / ``pos``: [B, 1] with one token per row, or
    [1, T] packed row after row), writing their K/V into the rows' buffers: logits [B, keep, V] as the model's
    forward returns them."""
    plan = _plan(model)
    b, s = ids.shape
    n_q, d, heads = b * s, plan.d, plan.heads
    if n_q != sum(counts):
        msg = f"{n_q} tokens for rows feeding {sum(counts)}"
        raise ValueError(msg)
    kv_dtype = _kv_dtype(plan, rows)
    ent = _entries(plan, rows, counts, windows, kv_dtype)
    h = step_layout.embed(model, ids)
    tables = step_layout.rope_tables(model, plan.ropes, h, pos)
    tdt = torch.float32 if plan.rope_mode & ROPE_WIDE else plan.dtype
    for k, t in tables.items():
        if t is not None and plan.rope_mode & ROPE_WIDE:
            t = tables[k] = (t[0].float(), t[1].float())  # widened exactly, as the model's float32 products read them
        if t is not None and (t[0].shape[-1] != (plan.rope_mode // ROPE_DIMS or d) or t[0].dtype != tdt):
            msg = f"RoPE tables of {t[0].shape[-1]} {t[0].dtype} for heads of {d} {plan.dtype}"
            raise ValueError(msg)
    qbuf = torch.empty((n_q, heads, d), dtype=plan.dtype)
    o = torch.empty((b, s, heads * d), dtype=plan.dtype)
    kv_mode, addr, stride = row_attention.mode(plan.dtype, kv_dtype), ent.buffer_info()[0], n_q * 5 * 8
    qp, op = qbuf.data_ptr(), o.data_ptr()
    ptrs = {k: (0, 0) if t is None else (t[0].data_ptr(), t[1].data_ptr()) for k, t in tables.items()}
    threads = torch.get_num_threads()
    fn, rm, mode, cw = plan.lib.rope_attend, plan.residual, plan.rope_mode, plan.rope_mode // ROPE_DIMS or d
    for i, layer in enumerate(plan.layers):
        residual = h
        x = h if layer.norm1 is None else layer.norm1(h)
        qkv = _products(layer.qkv, layer.qkv_mods, x, n_q)
        if layer.q_norm is not None and layer.k_norm is not None:  # q and k normed in place
            qs, ks = qkv[:, : heads * d], qkv[:, heads * d : (heads + plan.kv_heads) * d]
            if plan.head_norm:
                _norm_heads(layer.q_norm, qs, n_q, d)
                _norm_heads(layer.k_norm, ks, n_q, d)
            else:
                qs.copy_(layer.q_norm(qs.contiguous()))
                ks.copy_(layer.k_norm(ks.contiguous()))
        cp, sp = ptrs[layer.rope]
        if fn(kv_mode, addr + i * stride, n_q, qkv.data_ptr(), qkv.shape[1], cp, sp, cw, heads, plan.kv_heads, d,
              layer.scaling, qp, op, threads, mode):
            raise MemoryError("kvrag's row attention: no memory for the scores")
        a = layer.o_proj.forward(o)
        if plan.order == "parallel":  # Cohere, StableLM: h + attn(x) + mlp(x), both from the one norm's x
            m = _mlp(layer, x, b, s, n_q)
            h = a + m + residual if plan.fam.residual_last else residual + a + m  # Phi: attn + mlp + h
            continue
        if plan.order != "pre":
            a = layer.norm2(a)  # type: ignore[misc]
        h = residual + (a if rm is None else a * rm)
        residual = h
        if plan.order == "pre":
            x = layer.norm2(h)  # type: ignore[misc]
        else:
            x = h if layer.norm3 is None else layer.norm3(h)
        m = _mlp(layer, x, b, s, n_q)
        if layer.norm4 is not None:
            m = layer.norm4(m)
        h = residual + (m if rm is None else m * rm)
    return step_layout.head(model, h, keep)


__all__ = ["StepRow", "forward", "why_not"]
