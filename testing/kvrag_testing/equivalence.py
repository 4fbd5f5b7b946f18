"""The equivalence contract in every compute dtype kvrag may pick: which dtype a test runs in, and what "equal" means.

**float32** is the oracle: a method at its recompute-everything setting reproduces ``full`` to rounding (logits
within ~1e-3 on the real model, KV within 1e-4), and ``full`` generates exactly what ``model.generate`` does.

**bfloat16** rounds every GEMM output to 8 bits of mantissa, and the rounding depends on how a kernel blocks the
sum, i.e. on sequence length and call shape. Two computations of the same function in bf16 (a whole-prompt prefill
and a layer-by-layer recompute) therefore differ by about as much as either differs from float32. The tolerance
is derived from that measured **noise floor**, per prompt, instead of a fixed epsilon:

* ``floor = KL(p_fp32_full || p_bf16_full)``: how far bf16 moves ``full``'s own next-token distribution;
* a bf16 computation ``m`` of the same function passes when ``KL(p_fp32_full || p_bf16_m) <= 2 * floor + 1e-4``
  (:func:`bf16_kl_bound`): it may be as far from the float32 reference as ``full`` in bf16 is, twice over for the
  reordering, plus a small absolute slack for prompts where the floor itself is ~0;
* and it generates the same greedy tokens on the test prompts as ``full`` in bf16.

KV tensors compared directly in bf16 use :data:`BF16_REL` after a few layers (``max|a - b| <= BF16_REL * max|b|``,
two bf16 rounding steps of the largest element) and :data:`BF16_STACK_REL` after a whole model's stack of layers
(a relative norm, :func:`assert_close_in_dtype`).

The dtype of the dtype-generic tests (the ``default_model`` fixture) is float32 unless ``KVRAG_TEST_DTYPE`` says
otherwise (:func:`test_dtype`): ``KVRAG_TEST_DTYPE=bfloat16 make test`` runs the suite with a bf16 default model,
``KVRAG_TEST_DTYPE=default`` with the dtype kvrag picks on this machine. Tests that assert float32-exact results
pin float32 themselves; the bf16 equivalence subset runs in both dtypes on every machine regardless.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

ENV = "KVRAG_TEST_DTYPE"
BF16_REL = 2.0**-6
"""Relative bound for bf16 KV comparisons: ``max|a - b| <= BF16_REL * max|b|`` (two rounding steps at 2^-8 of the
largest element, with headroom for one more accumulated through a layer)."""
BF16_STACK_REL = 2.0**-4
"""Relative bound ``||a - b|| / ||b||`` for bf16 K/V compared after a whole model (every layer's rounding feeds the
next): on SmolLM2-135M (30 layers) the exact leading prefix of a prompt differs by 0.009 (K) / 0.025 (V) between a
whole-prompt prefill and the prefix computed alone in bf16, and by 0 in float32; the stale chunks after it differ
by 0.17 / 0.31 in both dtypes, so the bound still tells exact from stale."""
KL_SLACK = 1e-4
"""Absolute slack of :func:`bf16_kl_bound` (prompts where bf16 barely moves ``full``)."""


def test_dtype() -> torch.dtype:
    """The dtype dtype-generic tests run in: ``$KVRAG_TEST_DTYPE`` ('float32' | 'bfloat16' | 'float16' |
    'default' = what kvrag picks on this machine), float32 when unset.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    raw = os.environ.get(ENV, "").strip() or "float32"
    if raw == "default":
        from kvrag.models import resolve_device, resolve_dtype

        return resolve_dtype(None, resolve_device(None))
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if raw.removeprefix("torch.") not in names:
        msg = f"{ENV}={raw!r} is not a dtype kvrag runs in; use one of {sorted(names)} or 'default'"
        raise ValueError(msg)
    return names[raw.removeprefix("torch.")]


test_dtype.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test pytest should collect


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats between the next-token distributions of two logit vectors [V] (computed in float64)."""
    lp = torch.log_softmax(p_logits.detach().double().flatten(), -1)
    lq = torch.log_softmax(q_logits.detach().double().flatten(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def bf16_kl_bound(floor: float) -> float:
    """The largest KL(fp32 full || bf16 m) a bf16 computation ``m`` of ``full`` may have, given the measured floor
    KL(fp32 full || bf16 full) on the same prompt (see the module docstring)."""
    return 2.0 * floor + KL_SLACK


def assert_close_in_dtype(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, fp32_atol: float) -> None:
    """``got`` equals ``ref`` as two computations of the same function through a whole model: within ``fp32_atol``
    (max abs) in float32; in bf16/fp16 a relative difference ``||got - ref|| / ||ref||`` of at most
    :data:`BF16_STACK_REL` (rounding compounds over a deep stack, see there)."""
    g, r = got.detach().float(), ref.detach().float()
    if dtype == torch.float32:
        diff = (g - r).abs().max().item() if g.numel() else 0.0
        assert diff <= fp32_atol, f"max |got - ref| = {diff:.3g} exceeds {fp32_atol:.3g} (float32)"
        return
    rel = ((g - r).norm() / r.norm().clamp_min(1e-12)).item()
    assert rel <= BF16_STACK_REL, f"||got - ref|| / ||ref|| = {rel:.3g} exceeds {BF16_STACK_REL:.3g} ({dtype})"


@contextlib.contextmanager
def eager_attention(model: Any) -> Iterator[None]:
    """Run ``model`` with transformers' own ``eager`` attention (not kvrag's ``kvrag_sdpa`` nor its kernels) for the
    duration: a reference none of kvrag's attention code computes. Restores every config's implementation."""
    from transformers import PretrainedConfig

    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if isinstance(c, PretrainedConfig)}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = "eager"
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


@dataclasses.dataclass
class Reference:
    """What transformers alone computes for a prompt: keys, values [L, H_kv, T, D] of every prompt position,
    the last position's logits [V] (float32) and the greedy tokens decoded after it (EOS not special)."""

    keys: torch.Tensor
    values: torch.Tensor
    last_logits: torch.Tensor
    tokens: list[int]


@torch.inference_mode()
def hf_reference(model: Any, ids: list[int] | torch.Tensor, steps: int) -> Reference:
    """The independent oracle of ``full``: one plain transformers forward of ``ids`` from position 0 into a
    transformers ``DynamicCache`` under eager attention, then ``steps`` greedy one-token forwards -- no kvrag
    prefill, cache, attention or decoding code on the path (what ``model.generate(do_sample=False)`` computes,
    without its EOS stop)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    x = torch.as_tensor(ids, dtype=torch.long, device=dev).view(1, -1)
    cache = DynamicCache(config=model.config)
    with eager_attention(model):
        out = model(input_ids=x, cache=cache, use_cache=True)
        layers: list[Any] = list(cache.layers)
        keys = torch.stack([layer.keys[0] for layer in layers]).clone()
        values = torch.stack([layer.values[0] for layer in layers]).clone()
        last = out.logits[0, -1].float()
        tokens: list[int] = []
        logits = last
        for _ in range(steps):
            tokens.append(int(torch.argmax(logits)))
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=dev), cache=cache, use_cache=True)
            logits = out.logits[0, -1].float()
    return Reference(keys, values, last, tokens)


__all__ = ["BF16_REL", "BF16_STACK_REL", "ENV", "KL_SLACK", "Reference", "assert_close_in_dtype", "bf16_kl_bound", "eager_attention",
           "hf_reference", "kl", "test_dtype"]
