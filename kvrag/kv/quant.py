"""Quantized weights for decode-sized products: int4 (groupwise) and int8 (per channel) on the CPU.

A decode step reads every weight of the model once per token, so its time is bound by the bytes the weights take.
:func:`quantize_linears` gives each ``nn.Linear`` of a model a quantized copy of its weight and routes inputs of at
most :data:`MAX_ROWS` rows (decode steps, batched decode, short question suffixes) through torch's own CPU
weight-only kernels; larger inputs (prefill, ingest) keep the dense weight, where a GEMM is compute-bound and the
dense kernel is faster. Both routes live on the same module, so ``model.generate`` on the quantized model object
computes exactly what kvrag's ``full`` does.

The kernels, and why these and not a library's:

* ``int4``: asymmetric groups of :data:`GROUP` input columns, one (scale, zero) pair each,
  ``w = (q - 8) * scale + zero`` with ``q`` in 0..15, run by kvrag's own kernel (:mod:`kvrag.kv.int4_kernel`: AMX
  tiles or VDPBF16PS, each weight decoded once per call for all its rows) where the CPU has AMX or AVX512-BF16
  and a C compiler is at hand, else by ``torch._weight_int4pack_mm_for_cpu`` (the layout gpt-fast's ``quantize.py`` builds), which
  decodes the weights once per row. A GGUF ``Q4_1`` block is exactly such a group (``w = d * q + m``: scale ``d``,
  zero ``m + 8 d``) and the default model's dequantized weights re-quantize to the file's own ``q`` without
  error, so ``int4`` on the embedded default keeps the file's own 4-bit blocks.
* ``int8``: ``torch._weight_int8pack_mm`` -- symmetric, one scale per output channel.
* Both kernels are fast only with bfloat16 activations (with fp16 or fp32 activations they are slower than the
  dense fp32 product; docs/quantization.md), so the quantized route casts its input to bfloat16 and its output
  back to the model's dtype, and the scales are kept in bfloat16 (the kernel's requirement). That rounding is the
  route's only cost beyond the weights' own: for a Q4_1 weight, the bf16 scale leaves an RMS error of ~0.2% of the
  weights' RMS, the size of bfloat16's own rounding.
* torchao (0.18) wraps the same kernels, but its ``Int8WeightOnlyConfig`` feeds them the model's float32
  activations on the CPU (measured slower than dense, docs/quantization.md), its int4 default asks for a GPU kernel
  library and its CPU int4 layout sits in a prototype module; so kvrag calls the two torch ops itself, here.

On CUDA (tinygemm's layout differs) and on other devices :func:`quantize_linears` refuses with a clear error:
use ``dtype=bfloat16`` there.

Memory: the dense weights stay (prefill, state dicts, fingerprints, tied embeddings and training read them); the
quantized copies add ~0.56 bytes per weight in int4 and ~1 byte in int8, the output head ~1.1 bytes in both
(SmolLM2-135M: +102 MB int4, +142 MB int8, beside 538 MB of float32 weights).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvrag.errors import ConfigError
from kvrag.kv import int4_kernel
from kvrag.kv.routes import ROUTE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

Mode = Literal["int8", "int4"]
MODES: tuple[str, ...] = ("int8", "int4")
GROUP = 32
"""Input columns per int4 group (a GGUF Q4_0 / Q4_1 block)."""
REFINE_TOP = 64
"""The output head's largest logits per row that are recomputed from the dense weight rows (a [k, hidden] gather
and product, small next to the head's own product): greedy choices and the probable tokens' probabilities then carry
no quantization error at all, and the other logits keep the head's 8-bit error (bf16 outputs: ~0.03 at a logit of
16), where it moves almost no probability."""
MAX_ROWS = 16
"""Inputs of at most this many rows take the quantized weight; larger ones the dense weight: the int4 kernel
decodes its weights per row, so past a handful of rows the dense kernels catch up and then win (measured per M in
docs/quantization.md)."""


def parse_mode(mode: str | None) -> Mode | None:
    """Validate a ``quantize=`` value: None / "none" (dense), "int8" or "int4"."""
    if mode is None:
        return None
    m = str(mode).strip().lower()
    if m in ("", "none", "dense", "off"):
        return None
    if m not in MODES:
        msg = f"quantize={mode!r} is not a weight quantization; use 'int4', 'int8' or None (dense weights)"
        raise ConfigError(msg)
    return m  # type: ignore[return-value]


def kernels_available() -> str | None:
    """None when this torch build has the CPU weight-only kernels, else why not."""
    for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm"):
        if not hasattr(torch, op):
            return f"this torch ({torch.__version__}) has no torch.{op}"
    return None


def int4_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric groupwise int4 of a [N, K] weight: ``q`` [N, K] int32 in 0..15, ``scale`` and ``zero`` [N, K/g]
    (bfloat16, what the kernel reads), with ``w ~= (q - 8) * scale + zero``.

    Each group's scale is (max - min) / 15 and its zero min + 8 * scale, both rounded to bfloat16 first; ``q`` is
    then chosen against the rounded pair, so the rounding is not counted twice.
    """
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = ((w - zero.float()[..., None]) / scale.float()[..., None] + 8).round().clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scale, zero


int4_dequantize = int4_kernel.dequantize
"""float32 [N, K] weight of :func:`int4_groups`' output (what the kernels multiply by)."""


class _Int4:
    """A weight for an int4 kernel: kvrag's own (:mod:`kvrag.kv.int4_kernel`, where the CPU has AMX or
    AVX512-BF16 and a C compiler) in its packed layout, else torch's: packed ``q`` and [K/g, N, 2] bfloat16 (scale, zero)."""

    __slots__ = ("n", "packed", "scales_zeros")

    def __init__(self, weight: torch.Tensor) -> None:
        self._set(*int4_groups(weight))

    @classmethod
    def from_parts(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Int4:
        """From ``q`` [N, K] in 0..15 and bfloat16 ``scale`` / ``zero`` [N, K/g] (``w = (q - 8) scale + zero``)."""
        out = cls.__new__(cls)
        out._set(q, scale, zero)
        return out

    def _set(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        self.n = q.shape[0]
        if int4_kernel.path() is not None:
            self.packed, self.scales_zeros = int4_kernel.pack(q, scale, zero), None
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
            self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()

    @property
    def takes_float32(self) -> bool:
        """Whether :meth:`mm` takes float32 rows (kvrag's kernel converts them inside; torch's wants bfloat16)."""
        return self.scales_zeros is None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales_zeros is None:
            return int4_kernel.mm(x, self.packed, self.n)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    @property
    def nbytes(self) -> int:
        sz = 0 if self.scales_zeros is None else self.scales_zeros.numel() * 2
        return self.packed.numel() * self.packed.element_size() + sz


class _Int8Groups:
    """A weight in groupwise 8-bit (symmetric, one scale per :data:`GROUP` inputs: a GGUF ``Q8_0`` block) run as two
    int4 products: ``q = 16 * hi + lo`` with ``hi`` in -8..7 and ``lo`` in 0..15, so ``w = d q = (16 d) hi + d lo``
    is exactly two int4 weights of the kernel's form (scale 16 d, zero 0; scale d, zero 8 d) whose products add up.

    The output head gets this form in every mode: its errors go straight into the logits (embedded default, int4
    body, next-token KL vs dense on 8 dev prompts: 6e-2 with an int4 head, 3.3e-3 with per-channel int8, 1.35e-3
    with this form; its largest logits are then recomputed exactly, :data:`REFINE_TOP`), and two int4 products
    cost less than one product of torch's int8 kernel, which reads more bytes.
    """

    __slots__ = ("hi", "lo")

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        w = weight.detach().float().reshape(n, k // GROUP, GROUP)
        d = (w.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16).float()
        q = (w / d[..., None]).round().clamp(-127, 127).to(torch.int32)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)  # q = 16 hi + lo, hi in -8..7
        self.hi = _Int4.from_parts((hi + 8).reshape(n, k), (16 * d).to(torch.bfloat16), torch.zeros_like(d, dtype=torch.bfloat16))
        self.lo = _Int4.from_parts(lo.reshape(n, k), d.to(torch.bfloat16), (8 * d).to(torch.bfloat16))

    takes_float32 = False  # its sum is rounded to bfloat16, as it always was

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return (self.hi.mm(x).float() + self.lo.mm(x).float()).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes


class _Int8:
    """A weight as torch's CPU int8 kernel wants it: int8 [N, K] and one bfloat16 scale per output channel."""

    __slots__ = ("q", "scales")

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        self.q = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales

    takes_float32 = False

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 2


class _State:
    """A linear module's quantized weight, the dense forward it falls back to and the identity of the dense weight
    it was quantized from (a replaced or in-place-changed weight is never served from a stale copy)."""

    __slots__ = ("dense_forward", "mode", "ptr", "qweight", "version")

    def __init__(self, module: torch.nn.Linear, mode: Mode, head: bool = False) -> None:
        w = module.weight
        self.qweight: _Int4 | _Int8 | _Int8Groups = (_Int8Groups(w) if head and w.shape[1] % GROUP == 0
                                                     and w.shape[0] % 16 == 0 else
                                                     _Int4(w) if mode == "int4" else _Int8(w))
        self.mode = mode
        self.ptr, self.version = w.data_ptr(), w._version
        self.dense_forward = module.forward

    def valid_for(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.ptr and weight._version == self.version and weight.is_cpu


def _refine_top(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Recompute the :data:`REFINE_TOP` largest outputs of each row of ``y`` [R, N] exactly, from the dense weight
    rows and the unrounded input ``x`` [R, K] (in place)."""
    idx = y.topk(min(REFINE_TOP, y.shape[-1]), dim=-1).indices  # [R, k]
    exact = torch.einsum("rd,rkd->rk", x.to(weight.dtype), weight[idx])
    if bias is not None:
        exact = exact + bias[idx]
    return y.scatter_(-1, idx, exact.to(y.dtype))


def _forward(module: torch.nn.Linear, state: _State, x: torch.Tensor) -> torch.Tensor:
    # called for every product of every decode step: plain attribute reads, no-op conversions skipped (each
    # avoided tensor call's fixed cost is a noticeable share of a small decode-sized product)
    params: dict[str, torch.Tensor] = module._parameters  # type: ignore[assignment]
    w = params["weight"]
    shape = x.shape
    k = shape[-1]
    if (not x.is_cpu or x.numel() > MAX_ROWS * k or ROUTE.dense or not state.valid_for(w)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return state.dense_forward(x)
    flat = x.reshape(-1, k)
    qweight = state.qweight
    if flat.dtype == torch.float32 and qweight.takes_float32:  # converted inside the kernel, the same bits
        y = qweight.mm(flat if flat.is_contiguous() else flat.contiguous())
    else:
        rows = flat if flat.dtype == torch.bfloat16 else flat.to(torch.bfloat16)
        y = qweight.mm(rows if rows.is_contiguous() else rows.contiguous())  # the kernels want contiguous rows
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
    bias = params.get("bias")
    if isinstance(qweight, _Int8Groups):  # the output head: the likely next tokens' logits exactly
        y = _refine_top(y, flat, w, bias)
    elif bias is not None:
        y = y + bias
    return y.view(*shape[:-1], y.shape[-1])


def quantize_linears(model: PreTrainedModel, mode: str | None) -> int:
    """Give every 2D ``nn.Linear`` of ``model`` (the LM head included) a ``mode`` copy of its weight for inputs of at
    most :data:`MAX_ROWS` rows (see the module docstring). Idempotent per module; ``mode`` None does nothing.

    Returns:
        The number of modules quantized by this call.

    Raises:
        ConfigError: an unknown mode, a model not on the CPU, an input width not divisible into int4 groups, or a
            torch without the kernels.
    """
    m = parse_mode(mode)
    if m is None:
        return 0
    why = kernels_available()
    if why is not None:
        msg = f"quantize={m!r} needs torch's CPU weight-only kernels, but {why}; upgrade torch or pass quantize=None"
        raise ConfigError(msg)
    linears = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear) and mod.weight.dim() == 2]
    devices = {mod.weight.device.type for mod in linears}
    if devices - {"cpu"}:
        msg = (f"quantize={m!r} runs on the CPU only (the model is on {sorted(devices)}); on a GPU pass "
               "quantize=None and dtype='bfloat16'")
        raise ConfigError(msg)
    if m == "int4":  # the kernel's layout: groups of GROUP inputs, outputs in tiles of 16
        fits = [mod for mod in linears if mod.weight.shape[1] % GROUP == 0 and mod.weight.shape[0] % 16 == 0]
        if linears and not fits:
            msg = (f"quantize='int4' needs linear layers of a multiple of {GROUP} inputs and of 16 outputs; none of "
                   f"this model's are (e.g. {tuple(linears[0].weight.shape)}); use quantize='int8'")
            raise ConfigError(msg)
        if len(fits) < len(linears):
            log.info("int4: %d linear layers of other shapes keep dense weights", len(linears) - len(fits))
        linears = fits
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    n, nbytes = 0, 0
    for mod in linears:
        current = getattr(mod, "_kvrag_quant", None)
        if current is not None:
            continue
        state = _State(mod, m, head=mod is head)
        mod._kvrag_quant = state  # type: ignore[assignment]
        mod.forward = functools.partial(_forward, mod, state)  # type: ignore[method-assign]
        n += 1
        nbytes += state.qweight.nbytes
    if n:
        log.info("quantized %d linear weights to %s (%.1f MB beside the dense weights)", n, m, nbytes / 1e6)
    return n


class Fused:
    """Linear layers that read the same input (q / k / v, gate / up) as one int4 product: their kvrag-kernel weights
    side by side in one packed tensor, of which each layer's own weight becomes a view (no second copy). kvrag's
    kernel computes every output from its own weight tile and the row alone, so the product's columns are the bits
    of the layers' own products, and a bias is added as :func:`_forward` adds it."""

    __slots__ = ("_checks", "bias", "n", "packed")

    def __init__(self, packed: torch.Tensor, n: int, bias: torch.Tensor | None, checks: list[tuple[Any, ...]]) -> None:
        self.packed, self.n, self.bias, self._checks = packed, n, bias, checks

    def valid(self) -> bool:
        """Whether each layer still has the quantized state, int4 weight, weight and bias (same objects, unchanged)
        it had when fused; otherwise its own forward serves (:func:`_forward`'s checks)."""
        for mod, state, int4, w, wv, b, bv in self._checks:
            if (mod.__dict__.get("_kvrag_quant") is not state or _int4_of(mod) is not int4
                    or mod._parameters.get("weight") is not w or (w is not None and w._version != wv)
                    or mod._parameters.get("bias") is not b or (b is not None and b._version != bv)):
                return False
        return True

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, K] contiguous (float32 or bfloat16, at most :data:`MAX_ROWS` rows): [M, n] in its dtype."""
        y = int4_kernel.mm(x, self.packed, self.n)
        return y if self.bias is None else y + self.bias


def _int4_of(m: torch.nn.Module) -> _Int4 | None:
    """The kvrag-kernel int4 weight a module's decode-sized products use: its :func:`quantize_linears` state's (while
    valid for its weight), or a GGUF-resident layer's own (:class:`kvrag.kv.gguf_quant.GGUFLinear`); else None."""
    st = m.__dict__.get("_kvrag_quant")
    if st is not None:
        w = st.qweight
        ok = isinstance(w, _Int4) and w.takes_float32 and st.valid_for(m.weight)
        return w if ok else None
    w = m.__dict__.get("int4")
    return w if isinstance(w, _Int4) and w.takes_float32 else None


def fuse_int4(modules: Sequence[torch.nn.Module]) -> Fused | None:
    """One :class:`Fused` product for ``modules`` (which read the same input), or None unless each has an int4
    weight for kvrag's kernel (:func:`_int4_of`) of the same input width and all or none has a bias. The modules'
    packed weights become views of the fused one."""
    found = [_int4_of(m) for m in modules]
    weights = [w for w in found if w is not None]
    if not weights or len(weights) != len(found):
        return None
    ks = {int(m.weight.shape[1]) for m in modules}  # type: ignore[index]
    biases = [m.bias for m in modules]
    if len(ks) != 1 or len({b is None for b in biases}) != 1:
        return None
    parts = [w.packed for w in weights]
    packed = torch.cat(parts).contiguous()
    o = 0
    for w, part in zip(weights, parts, strict=True):
        w.packed = packed[o : o + part.shape[0]]
        o += part.shape[0]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # type: ignore[union-attr, operator]
    checks = []
    for m, w in zip(modules, weights, strict=True):
        p = m._parameters.get("weight")
        b = m._parameters.get("bias")
        checks.append((m, m.__dict__.get("_kvrag_quant"), w, p, None if p is None else p._version, b,
                       None if b is None else b._version))
    return Fused(packed, sum(w.n for w in weights), bias, checks)


def quant_tag(mode: str | None) -> str | None:
    """What a model fingerprint records of ``mode``: the mode and, when kvrag's own int4 kernel computes its int4
    products (the int4 body and the 8-bit output head of both modes), that kernel's path -- its outputs differ from
    torch's kernel's in the last bit now and then, so caches never cross kernels."""
    m = parse_mode(mode)
    if m is None:
        return None
    return m if int4_kernel.path() is None else f"{m}+{int4_kernel.tag()}"


def quantization_of(model: PreTrainedModel) -> Mode | None:
    """The mode :func:`quantize_linears` applied to ``model``'s linear layers, or None (dense)."""
    for mod in model.modules():
        state = getattr(mod, "_kvrag_quant", None)
        if state is not None:
            return state.mode  # type: ignore[no-any-return]
    return None


def quantized_bytes(model: PreTrainedModel) -> int:
    """Bytes the quantized copies of ``model``'s weights take (0 when dense)."""
    return sum(s.qweight.nbytes for mod in model.modules() if (s := getattr(mod, "_kvrag_quant", None)) is not None)


__all__ = ["GROUP", "MAX_ROWS", "MODES", "REFINE_TOP", "Fused", "fuse_int4", "int4_dequantize", "int4_groups",
           "kernels_available", "parse_mode", "quant_tag", "quantization_of", "quantize_linears", "quantized_bytes"]
