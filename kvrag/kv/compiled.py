"""A plain decode step captured by ``torch.compile`` that computes the eager step's bits (``compile_decode``).

A decode step of a small model on the CPU is ~100 small operations a layer (norms, RoPE, casts, views, residual
adds, the gated MLP's activation) around a few kernels, and each costs a dispatch (2-5 us on a 2-core VM) whatever
its size. Inductor fuses them into a few generated loops. By default its logits need not be the model's bits,
for three reasons, and each is removed here:

* a fused group keeps its intermediates in float32 where eager rounds each operation's result to the model's
  dtype: compiled with ``emulate_precision_casts`` (inductor rounds where eager does);
* inductor writes its own reductions, which sum in another order (RMSNorm's mean of squares differs in the last
  float32 bit on ~40% of SmolLM2's hidden states, and in the bfloat16 output on ~1 in 2,000): while this graph
  compiles, ``sum`` lowers to torch's own kernel and ``mean`` to what torch's CPU ``mean`` computes, that kernel's
  sum divided by the element count (the division generated, so it fuses with what follows);
* RoPE's ``cos`` / ``sin`` of large angles round differently in generated code (1 position of 8,192 for SmolLM2):
  they are computed eagerly, by the model's rotary embedding, and passed in.

What stays outside the generated code: every linear layer runs the kernel its eager forward runs (torch's int4 /
int8 weight-only kernels, ``F.linear``), each row's attention is :func:`kvrag.kv.batched.attention` behind an
opaque custom op (rows are ragged: each buffer its own length), and the output head (with its exact top-logit
refinement) runs eagerly on the captured graph's last hidden state. The rest is element-wise arithmetic, in the
order and dtype eager uses, with floating-point contraction off (inductor's default), so the outputs are the same
numbers. Because a later torch could change how a kernel is generated, the first compiled step of each model and
batch shape (one row, several rows) is checked against the eager step, logits and written K/V bit for bit; on any
difference, or if capture fails, kvrag logs it and keeps the eager step for that model. kvrag's packed bfloat16
weights (:mod:`kvrag.kv.linear`, dense bf16 on CPUs with oneDNN bf16) are not captured (inductor takes such
weights only from frozen graphs): those models keep the eager step.

Which steps: plain decode steps (one token per row) of the layouts :mod:`kvrag.kv.direct` writes out, with at most
:data:`kvrag.kv.quant.MAX_ROWS` rows (so each linear layer keeps the route it takes eagerly). Verify steps
(speculation) and suffix prefills stay eager.

When it compiles: the first step of each batch shape runs eagerly and starts a helper thread
(``kvrag-compile-decode``, one shape at a time) that runs a step of that shape over throwaway rows
(:func:`kvrag.kv.batched._rehearse`): the capture compiles there and is checked against the eager step; the served
steps run eagerly meanwhile, and the first served captured step of the shape is checked again. The generated code
is called from C++ (inductor's ``cpp_wrapper``) and kept in inductor's FX graph cache under a key that carries this
module's lowerings (:func:`_options`): compiling the default model's step took 295 s (one row) and 381 s (eight
rows) of one core on a 2-core VM the first time, and 4 s from the cache in later processes with the same torch
thread count (the generated code is specific to it, and the cache key has it). :func:`kvrag.kv.batched.precompile`
(``kvrag pull --compile-decode``) compiles both shapes ahead, in the calling thread.

Measured (``benchmarks/kvrag_bench/prof/ab_compiled_step.py int4 512,1536,3072 1,8 40``: SmolLM2-135M, bfloat16
+ int4, one thread, 2-core Xeon with AMX, the two steps interleaved, every step's logits equal): the captured step
takes 0.825-0.843x the eager step's time at batch 1 and 0.86-0.94x at batch 8 (512 / 1.5K / 3K tokens; eager 33 /
53 / 63 ms at batch 1). What it cannot fuse away: the 211 weight products, 30 row attentions and 61 reductions a
step stay kernel calls, as in the eager step. (With inductor's Python wrapper the same capture took 0.92-1.00x
after ~1 minute of compilation per shape.) ``compile_decode`` stays off by default: the first process on a
machine spends ~5-6 minutes of a core per batch shape compiling, and the gain was ~15% a token against the direct
loop. Decode and verify steps of Llama / Mistral / Qwen2 / Qwen3 models run the fused step
(:mod:`kvrag.kv.fused_step`), which the capture does not trace: against it the captured step is slower (float32 +
int4, AVX512-BF16 CPU, 1.5K tokens: 21.0 vs 18.3 ms at batch 1, 10.1 vs 9.5 ms a token at batch 8; ``kvrag bench
decode --quantize int4 --contexts 1536 --batches 1,8 --steps 16 --rounds 3 --compile-decode``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.kv import direct, fused_step, int4_kernel, quant

log = logging.getLogger(__name__)

@functools.cache
def _options() -> dict[str, Any]:
    """Inductor options of the captured step: rounding where eager rounds (``emulate_precision_casts``), the
    generated code called from C++ (``cpp_wrapper``: the kernels' calls cost less than from a Python wrapper), and
    the FX graph cache on, keyed by the lowerings :func:`_install_dispatch` installs.

    Inductor's FX graph cache keys a compiled graph by the graph, its inputs' shapes, torch and the inductor config
    -- not by the lowerings installed while it compiled. The post-grad pass set here leaves the graph as it is; set
    exactly when those lowerings apply, its ``uuid`` (a hash of the code that chooses them) makes every captured
    step's key differ from any other compile's, and change with those lowerings. So the cache can stay on: the
    first process on a machine compiles (minutes for a 30-layer model), later ones load the compiled step from
    torch's inductor cache directory in seconds. (Imported here, not with the module: ``torch._inductor`` takes ~1.3 s to import.)"""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class LoweringsKey(CustomGraphPass):
        def __call__(self, graph: torch.fx.graph.Graph) -> None:
            return None

        def uuid(self) -> str:
            try:
                code = "".join(inspect.getsource(f) for f in (_fallbacks, _install_dispatch))
            except OSError:  # no source next to the bytecode: this whole module
                return get_hash_for_files((__file__,), extra="kvrag.kv.compiled").hex()
            return hashlib.sha256(code.encode()).hexdigest()

    return {"emulate_precision_casts": True, "cpp_wrapper": True, "fx_graph_cache": True,
            "post_grad_custom_post_pass": LoweringsKey()}


_state: weakref.WeakKeyDictionary[Any, _Compiled | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_compile_lock = threading.Lock()  # one batch shape compiles at a time, on a helper thread


def _forget() -> None:
    """In a forked child: no helper thread came along, and the locks may have been held by one."""
    global _lock, _compile_lock
    _state.clear()
    _lock, _compile_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forget)

_compiling = threading.local()
_dispatch_installed = False


def _fallbacks() -> list[Any]:
    """Ops the captured step runs as torch's own kernels: the reductions (inductor's sum adds in another order)."""
    return [torch.ops.aten.sum.dim_IntList]


def _install_dispatch() -> None:
    """While this module's step compiles (a flag of the compiling thread), make inductor lower :func:`_fallbacks`
    to torch's kernels and ``mean`` to what torch's CPU ``mean`` computes -- its ``sum`` kernel, then a division by
    the element count (generated, so it fuses with what follows) -- and every other graph as before. Installed once
    per process (building a fallback lowering takes ~40 ms, too much for every step)."""
    global _dispatch_installed
    from torch._inductor import lowering

    if _dispatch_installed:
        return

    def chooser(original: Any, replacement: Any) -> Any:
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            return (replacement if getattr(_compiling, "on", False) else original)(*args, **kwargs)

        return dispatch

    fallbacks = {}
    for op in _fallbacks():
        original = lowering.lowerings.get(op)
        with lowering.force_fallback(op):
            fallbacks[op] = lowering.lowerings[op]
        lowering.lowerings[op] = chooser(original, fallbacks[op]) if original is not None else fallbacks[op]
    aten = torch.ops.aten
    div, eager_sum = lowering.lowerings[aten.div.Tensor], fallbacks[aten.sum.dim_IntList]

    def mean_as_torch_does(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
        # ATen's CPU mean of a floating tensor: sum_out(...).div_(number of elements reduced)
        size = x.get_size()
        dims = range(len(size)) if not dim else [d % len(size) for d in dim]
        count = 1
        for d in dims:
            count *= size[d]
        if getattr(count, "is_number", True):
            count = int(count)
        return div(eager_sum(x, dim, keepdim, dtype=dtype), count)

    lowering.lowerings[aten.mean.dim] = chooser(lowering.lowerings[aten.mean.dim], mean_as_torch_does)
    # with the C++ wrapper, inductor warns for every call of torch's sum that it goes through its proxy executor:
    # it does, on purpose; say nothing while this module's step compiles
    logging.getLogger("torch._inductor.ir").addFilter(
        lambda record: not (getattr(_compiling, "on", False) and "c-shim" in record.getMessage()))
    _dispatch_installed = True


@contextlib.contextmanager
def _eager_kernels() -> Iterator[None]:
    """Around every call of the captured step (a call may compile): :func:`_install_dispatch`'s lowerings apply."""
    _compiling.on = True
    try:
        yield
    finally:
        _compiling.on = False


_library: list[Any] = []
_int4_library: list[Any] = []


def _register_int4() -> Callable[..., torch.Tensor]:
    """``kvrag::int4_mm``: kvrag's int4 kernel (:func:`kvrag.kv.int4_kernel.mm`) as an opaque op."""
    if not _int4_library:
        lib = torch.library.Library("kvrag", "FRAGMENT")
        lib.define("int4_mm(Tensor rows, Tensor packed, int n) -> Tensor")

        def fake(rows: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
            return rows.new_empty((rows.shape[0], n))

        lib.impl("int4_mm", int4_kernel.mm, "CompositeExplicitAutograd")
        torch.library.register_fake("kvrag::int4_mm", fake, lib=lib)
        _int4_library.append(lib)
    return torch.ops.kvrag.int4_mm  # type: ignore[no-any-return]


def _register_attention(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``kvrag::row_attention``: ``attend(layer, query, key, value, scaling)`` (the batched step's row attention,
    which reads the step's rows from the thread that runs it) as an opaque op: inductor does not trace into it.
    Registered once per process, through ``torch.library.Library`` (``torch.library.custom_op``'s Python wrapper
    costs ~45 us a call, 30 calls a step)."""
    if not _library:
        lib = torch.library.Library("kvrag", "FRAGMENT")
        lib.define("row_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling) -> Tensor")

        def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                          scaling: float) -> torch.Tensor:
            return attend(layer, query, key, value, scaling)

        def fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                 scaling: float) -> torch.Tensor:
            return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[-1]))

        lib.impl("row_attention", row_attention, "CompositeExplicitAutograd")
        torch.library.register_fake("kvrag::row_attention", fake, lib=lib)
        _library.append(lib)
    return torch.ops.kvrag.row_attention  # type: ignore[no-any-return]


def _linear(mod: torch.nn.Linear) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], bool]]:
    """The product ``mod``'s eager forward runs for a decode step's rows, as a traceable function (the kernels as
    graph calls), and a check that the weight it captured is still the module's."""
    w, bias = mod.weight, mod.bias
    q = getattr(mod, "_kvrag_quant", None)
    if q is not None:
        qw = q.qweight
        if isinstance(qw, quant._Int4):
            packed, sz, n = qw.packed, qw.scales_zeros, qw.n
            if sz is None:  # kvrag's own int4 kernel, as an opaque op
                op = _register_int4()

                def kernel(rows: torch.Tensor) -> torch.Tensor:
                    return op(rows, packed, n)  # type: ignore[no-any-return]
            else:
                def kernel(rows: torch.Tensor) -> torch.Tensor:
                    return torch._weight_int4pack_mm_for_cpu(rows, packed, quant.GROUP, sz)
        elif isinstance(qw, quant._Int8):
            q8, scales = qw.q, qw.scales

            def kernel(rows: torch.Tensor) -> torch.Tensor:
                return torch._weight_int8pack_mm(rows, q8, scales)
        else:
            msg = f"{type(qw).__name__} weights are not captured"
            raise NotImplementedError(msg)

        def fn(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(-1, x.shape[-1])
            y = kernel(flat.to(torch.bfloat16).contiguous()).to(x.dtype)
            if bias is not None:
                y = y + bias
            return y.view(*x.shape[:-1], y.shape[-1])

        return fn, functools.partial(_quant_valid, mod._parameters, q)
    if getattr(mod, "_kvrag_packed", None) is not None:
        msg = ("kvrag's packed bfloat16 weights (kvrag.kv.linear) are not captured: inductor takes such weights only "
               "from frozen graphs")
        raise NotImplementedError(msg)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, bias)

    return plain, functools.partial(_same, mod._parameters, w)


def _quant_valid(params: dict[str, Any], state: Any) -> bool:
    return bool(state.valid_for(params["weight"]))


def _same(params: dict[str, Any], weight: torch.Tensor) -> bool:
    return params["weight"] is weight


class _Compiled:
    """One model's captured step: the compiled body, the validity checks of its captured weights, and per batch
    shape (one row: False, several rows: True) where it stands: compiling on the helper thread (``warming``),
    compiled and checked over throwaway rows (``compiled``), checked against the eager step of a served step
    (``checked``: True equal, False differed or failed -- not used)."""

    def __init__(self, model: Any, attend: Callable[..., torch.Tensor]) -> None:
        inner = model.model
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.rotary = inner.rotary_emb
        self.head = model.lm_head
        self.dtype = inner.embed_tokens.weight.dtype
        self.checked: dict[bool, bool] = {}
        self.warming: set[bool] = set()
        self.compiled: set[bool] = set()
        self.failed = False
        rope = sys.modules[type(self.layers[0].self_attn).__module__].apply_rotary_pos_emb
        attention = _register_attention(attend)
        _install_dispatch()
        checks: list[Callable[[], bool]] = []

        def lin(mod: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
            fn, ok = _linear(mod)
            checks.append(ok)
            return fn

        layers = [(layer, layer.self_attn, layer.mlp, float(layer.self_attn.scaling), int(layer.self_attn.layer_idx),
                   [lin(m) for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                     layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                     layer.mlp.down_proj)]) for layer in self.layers]
        self.checks = checks
        embed, norm = inner.embed_tokens, inner.norm

        def body(ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            # kvrag.kv.direct.forward's layer loop for [B, 1] ids, with the products and the attention as above
            h = embed(ids)
            b, s = ids.shape
            for layer, a, mlp, scaling, idx, (qp, kp, vp, op, gp, up, dp) in layers:
                shape = (b, s, -1, a.head_dim)
                residual = h
                x = layer.input_layernorm(h)
                q, k = qp(x).view(shape), kp(x).view(shape)
                q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
                if q_norm is not None and k_norm is not None:
                    q, k = q_norm(q), k_norm(k)
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                v = vp(x).view(shape).transpose(1, 2)
                q, k = rope(q, k, cos, sin)
                o = attention(q, k, v, idx, scaling)
                h = residual + op(o.reshape(b, s, -1).contiguous())
                residual = h
                x = layer.post_attention_layernorm(h)
                h = residual + dp(mlp.act_fn(gp(x)) * up(x))
            return norm(h)

        # a code object of this model's own: dynamo keeps its compiled entries per code object, so models sharing
        # `body`'s would share one list of them -- its recompile limit (8) reached after a few models and batch
        # shapes in one process, and each entry keeping its model's closure alive
        own = types.FunctionType(body.__code__.replace(), body.__globals__, body.__name__, body.__defaults__,
                                 body.__closure__)
        self.body = torch.compile(own, fullgraph=True, options=_options())

    def valid(self) -> bool:
        """The captured weights are still the modules' (none replaced or changed in place)."""
        return all(ok() for ok in self.checks)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the plain step over ``ids`` / ``pos`` [B, 1] (the rows' attention from the step running
        in this thread)."""
        cos, sin = self.rotary.forward(torch.empty(0, dtype=self.dtype, device=ids.device), position_ids=pos)
        if ids.shape[0] > 1:  # one graph for every batch of several rows, the one its first step was checked with
            for t in (ids, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        with _eager_kernels():
            h = self.body(ids, cos, sin)
        return self.head.forward(h)[:, -1]  # type: ignore[no-any-return]


def why_not(model: Any, rows: int) -> str | None:
    """None when a step of ``rows`` rows of ``model`` can run captured, else why not."""
    why = direct.why_not(model)
    if why is not None:
        return why
    if rows > quant.MAX_ROWS:
        return f"{rows} rows (captured steps have at most {quant.MAX_ROWS}, where each product keeps its route)"
    return None


def _loop_serves(model: Any) -> bool:
    """Whether the layer loop the capture traces serves ``model``: no module has hooks, and the direct loop's first
    step was checked equal to the model's forward -- or, where decode steps have run the fused step instead and the
    direct loop is not checked yet, the fused step's first step was (the same layers, in the same order)."""
    served = direct.served(model)
    if served is None:
        served = fused_step.served(model)
    return bool(served) and not direct.hooked(model)


def runner(model: Any, rows: Sequence[Any], eager: Callable[[], torch.Tensor], ids: torch.Tensor, pos: torch.Tensor,
           attend: Callable[..., torch.Tensor], rehearse: Callable[[int], None] | None = None) -> torch.Tensor:
    """Run a plain step captured where that serves ``model``, else ``eager`` (the step through
    :func:`kvrag.kv.direct.forward`). Returns logits [B, V].

    A batch shape's first captured step is checked against ``eager`` bit for bit. With ``rehearse``, compiling
    happens off this thread: the first step of a shape starts a helper thread that runs ``rehearse(rows)`` (a plain
    step of that many rows over throwaway buffers, calling this function without ``rehearse``: it compiles and
    checks there), and this step and the ones after it run eagerly until that is done.

    Args:
        attend: the batched step's row attention, ``attend(layer, query, key, value, scaling)``
            (:func:`kvrag.kv.batched._attend`), called from the captured graph.
    """
    if len(rows) > quant.MAX_ROWS or not _loop_serves(model):
        return eager()
    with _lock:
        if model not in _state:
            try:
                _state[model] = _Compiled(model, attend)
            except NotImplementedError as e:  # weights the capture does not take: the eager step
                log.warning("%s: the decode step is not captured (%s); steps run eagerly", type(model).__name__, e)
                _state[model] = None
            except Exception:  # noqa: BLE001 -- a layout the capture does not handle: the eager step
                log.warning("%s: the decode step cannot be captured; steps run eagerly", type(model).__name__,
                            exc_info=True)
                _state[model] = None
        comp = _state[model]
    if comp is None or comp.failed or not comp.valid():
        return eager()
    shape = len(rows) > 1
    ok = comp.checked.get(shape)
    if ok is None and rehearse is not None and shape not in comp.compiled:
        _warm(model, comp, shape, rehearse)
        return eager()
    if ok is None:
        return _first(model, comp, shape, rows, eager, ids, pos)
    return comp.forward(ids, pos) if ok else eager()


def _warm(model: Any, comp: _Compiled, shape: bool, rehearse: Callable[[int], None]) -> None:
    """Compile and check ``shape`` on a helper thread (once; one shape at a time in the process)."""
    with _lock:
        if shape in comp.warming:
            return
        comp.warming.add(shape)
    name = type(model).__name__

    def work() -> None:
        t0 = time.perf_counter()
        try:
            with _compile_lock:
                rehearse(2 if shape else 1)
        except Exception:  # noqa: BLE001 -- the served steps stay eager
            log.warning("%s: compiling the decode step failed; steps run eagerly", name, exc_info=True)
            comp.failed = True
        with _lock:
            same = comp.checked.pop(shape, None)  # set by the rehearsal's check; a served step is checked too
            if same:
                comp.compiled.add(shape)
            elif same is False:
                comp.checked[shape] = False
            comp.warming.discard(shape)
        log.info("%s: decode step of %s %s after %.0f s", name, "several rows" if shape else "one row",
                 "compiled" if same else "not captured", time.perf_counter() - t0)

    threading.Thread(target=work, name="kvrag-compile-decode", daemon=True).start()


def wait(model: Any, timeout: float | None = None) -> dict[str, bool]:
    """Wait until no batch shape of ``model`` is compiling on the helper thread (at most ``timeout`` seconds), then
    :func:`captured`. For benchmarks and tests; serving never waits (steps run eagerly meanwhile)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        comp = _state.get(model)
        if comp is None or not comp.warming or (deadline is not None and time.monotonic() > deadline):
            return captured(model)
        time.sleep(0.05)


def _first(model: Any, comp: _Compiled, shape: bool, rows: Sequence[Any], eager: Callable[[], torch.Tensor],
           ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    try:
        got = comp.forward(ids, pos)
    except Exception:  # noqa: BLE001 -- capture or compilation failed: keep the eager step
        log.warning("%s: compiling the decode step failed; steps run eagerly", type(model).__name__, exc_info=True)
        comp.failed = True
        return eager()
    ref, same = direct.same_as(got, eager, rows, [1] * len(rows))  # what stays is the eager step's
    if not same:
        log.warning("%s: the compiled decode step differs from the eager step with this torch; steps of %s run "
                    "eagerly", type(model).__name__, "several rows" if shape else "one row")
    comp.checked[shape] = same
    return ref


def captured(model: Any) -> dict[str, bool]:
    """Which batch shapes of ``model`` run captured so far: {"one row": ..., "several rows": ...}, True where compiled
    and checked equal to the eager step (over throwaway rows on the helper thread, then on its first served step),
    False where it differed or failed (those steps run eagerly)."""
    comp = _state.get(model)
    if comp is None:
        return {}
    out = dict.fromkeys(comp.compiled, True) | comp.checked
    return {("several rows" if k else "one row"): v for k, v in out.items()}


__all__ = ["captured", "runner", "wait", "why_not"]
