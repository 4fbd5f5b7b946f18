"""``FusionMethodTests``: the standard pytest suite every fusion method passes (docs/architecture.md#tests).

Subclass it in a test module and set the method under test::

    class TestRelaxKV(FusionMethodTests):
        method_spec = "relaxkv:r=0.3"
        recompute_all_spec = "relaxkv:r=1.0"   # None when the method has no recompute-everything setting

Every test runs on a tiny random model of each family in :data:`kvrag_testing.tiny.FAMILIES` (:data:`SUITE_LAYERS`
layers, weights of std :data:`SUITE_INIT_STD`) with a context of a leading exact 'prefix' span, three stored chunks
and one 'text' span, then a question suffix. Checked: registry
round trip, output shapes / dtype / device, determinism, no mutation of the input KV nor of the stored chunk
tensors, JSON-serializable stats, and (with ``recompute_all_spec``) equality with the exact prefill: KV allclose and
the same greedy tokens over a few decode steps as one plain transformers forward of the whole prompt (eager
attention, :func:`kvrag_testing.equivalence.hf_reference`) -- an oracle independent of kvrag's ``full``, so the
suite of ``full`` itself (``recompute_all_spec = "full"``) compares it with transformers, not with itself. Requires pytest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, ClassVar

import pytest
import torch

from kvrag.engine.assemble import assemble
from kvrag.fusion import FusionInput, FusionOutput, MethodStats, get_method
from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag_bench.ablations import register_ablations
from kvrag_testing.equivalence import hf_reference
from kvrag_testing.tiny import FAMILIES, tiny_model

#: lengths of the context pieces: (kind, length)
LAYOUT: tuple[tuple[str, int], ...] = (("prefix", 6), ("chunk", 9), ("text", 4), ("chunk", 13), ("chunk", 11))
SUFFIX_LEN = 7
SUITE_LAYERS = 4
"""Decoder layers of the suite's models: enough for every method's selective phase to run (CacheBlend selects at
layer 1 and recomputes only the selected tokens at layers 2-3; RelaxKV's targets shrink layer by layer)."""
SUITE_INIT_STD = 0.1
"""Weight std of the suite's models: at transformers' default 0.02 attention is nearly uniform and a stale cache
is almost exact, so a wrong repair could pass unnoticed; at 0.1 stale and full KV differ by O(1) at 4 layers, while
a recompute-everything setting still equals ``full`` to ~3e-6 in fp32 (see kvrag_testing.tiny.INIT_STD)."""


RECOMPUTE_ALL_ATOL = 1.5e-5
"""Max |K - K_ref|, |V - V_ref| a recompute-everything setting may have against the suite's oracle (one eager
transformers forward) in float32: measured up to 2.9e-6 for every method and variant on the four families, on the
assembled and the zero-copy input (fp32 rounding of kvrag's attention and layer-by-layer recompute); ~5x that. A
stale cache is off by O(1) here (:data:`SUITE_INIT_STD`)."""


@dataclasses.dataclass
class FusionCase:
    """A tiny model and a multi-chunk context to fuse.

    Attributes:
        family: model family.
        model, rope, spec: the tiny model, its RoPE and KV spec.
        pieces: (kind, ChunkKV, key) as :func:`kvrag.engine.assemble.assemble` takes them.
        suffix_ids: [S] question suffix.
        full_keys, full_values: [L, H_kv, Tc, D] the exact context KV: one plain transformers forward of context +
            suffix under eager attention (:func:`kvrag_testing.equivalence.hf_reference`), computed by none of
            kvrag's prefill or attention code, so that ``full`` itself is checked against it too.
        full_tokens: the greedy tokens transformers decodes after that forward.
    """

    family: str
    model: Any
    rope: Rope
    spec: KVSpec
    pieces: list[tuple[str, ChunkKV, str | None]]
    suffix_ids: torch.Tensor
    full_keys: torch.Tensor
    full_values: torch.Tensor
    full_tokens: list[int]

    def fusion_input(self, *, zero_copy: bool = False) -> FusionInput:
        """A freshly assembled stale input (new tensors each call). ``zero_copy``: as the engine serves it (the
        input owns its buffer, so methods repair it in place); else a plain input methods must not modify."""
        inp = assemble(self.model, self.rope, self.spec, self.pieces, self.suffix_ids)
        return inp if zero_copy else dataclasses.replace(inp, buffer=None)


def greedy_tokens(inp: FusionInput, out: FusionOutput, steps: int) -> list[int]:
    """Greedy tokens decoded from a fusion output: prefill the suffix over ``out.cache`` unless the method already
    did (``out.last_logits``), then ``steps`` argmax steps. Extends ``out.cache`` in place."""
    model, tc = inp.model, inp.context_len
    cache = out.cache
    if out.last_logits is None:
        logits, cache = hf_cache.forward(model, inp.suffix_ids, cache, start=tc)
        last = logits[-1]
    else:
        last = out.last_logits
    pos = tc + int(inp.suffix_ids.shape[0])
    toks: list[int] = []
    for _ in range(steps):
        tok = int(torch.argmax(last))
        toks.append(tok)
        logits, cache = hf_cache.forward(model, torch.tensor([tok]), cache, start=pos)
        last, pos = logits[-1], pos + 1
    return toks


def context_kv(out: FusionOutput, tc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context part [L, H_kv, Tc, D] of a fusion output's cache (``full`` also caches the suffix)."""
    k, v = hf_cache.cache_to_tensors(out.cache)
    return k[:, :, :tc], v[:, :, :tc]


def check_suffix_fold(case: FusionCase, spec: str) -> None:
    """A full-context method on the engine's zero-copy input prefills the suffix inside its recompute
    (``stats.suffix_folded``, ``last_logits`` set): its cache (context + suffix) and next-token logits equal
    repairing the same input with the fold off (no logits head) and prefilling the suffix afterwards, and its
    stats count the context only."""
    method = get_method(spec)
    inp = case.fusion_input(zero_copy=True)
    out = method.fuse(inp)
    assert out.stats.suffix_folded and out.last_logits is not None, spec
    tc, s = inp.context_len, int(inp.suffix_ids.shape[0])
    k, v = hf_cache.cache_to_tensors(out.cache)
    assert k.shape[2] == tc + s
    ref_inp = case.fusion_input(zero_copy=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_cache, "logits_head", lambda model: None)  # the fold off: repair, then the suffix pass
        ref = method.fuse(ref_inp)
    assert not ref.stats.suffix_folded and ref.last_logits is None
    logits, cache = hf_cache.forward(ref_inp.model, ref_inp.suffix_ids, ref.cache, start=tc)
    rk, rv = hf_cache.cache_to_tensors(cache)
    torch.testing.assert_close(k, rk, atol=2e-5, rtol=0)
    torch.testing.assert_close(v, rv, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.last_logits, logits[-1], atol=1e-4, rtol=0)
    assert out.stats.recomputed_per_layer == ref.stats.recomputed_per_layer  # the suffix is not counted
    assert out.stats.recomputed_fraction == ref.stats.recomputed_fraction
    assert out.stats.attention_edges_ratio == pytest.approx(ref.stats.attention_edges_ratio)


@functools.lru_cache(maxsize=16)
def fusion_case(
    family: str,
    num_layers: int = SUITE_LAYERS,
    seed: int = 0,
    decode_steps: int = 4,
    init_std: float = SUITE_INIT_STD,
) -> FusionCase:
    """Build (once per process) the standard case for ``family``."""
    lm = tiny_model(family, num_layers=num_layers, seed=seed, init_std=init_std)
    model, spec = lm.model, lm.kv_spec()
    rope = Rope.from_model(model)
    g = torch.Generator().manual_seed(1234 + seed)
    pieces: list[tuple[str, ChunkKV, str | None]] = []
    for i, (kind, n) in enumerate(LAYOUT):
        ids = torch.randint(5, spec_vocab(model), (n,), generator=g).tolist()
        pieces.append((kind, compute_chunk_kv(model, rope, spec, ids), f"{kind}{i}" if kind == "chunk" else None))
    suffix = torch.randint(5, spec_vocab(model), (SUFFIX_LEN,), generator=g)
    inp = assemble(model, rope, spec, pieces, suffix)
    ref = hf_reference(model, torch.cat([inp.token_ids, suffix]), decode_steps)  # not kvrag's `full`: transformers'
    tc = inp.context_len
    return FusionCase(family, model, rope, spec, pieces, suffix, ref.keys[:, :, :tc].clone(),
                      ref.values[:, :, :tc].clone(), ref.tokens)


def spec_vocab(model: Any) -> int:
    return int(model.config.vocab_size)


@dataclasses.dataclass
class FusionRun:
    """One fuse of the method under test, with snapshots taken before it (shared by the suite's checks)."""

    inp: FusionInput
    out: FusionOutput
    tokens: list[int]
    inputs_before: list[torch.Tensor]
    stored_before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class FusionMethodTests:
    """Base class of the standard fusion-method suite. Subclasses set ``method_spec`` (and usually
    ``recompute_all_spec``); ``num_layers``, ``init_std``, ``decode_steps`` and ``atol`` may be overridden, and
    ``case`` too (e.g. to restrict the families)."""

    method_spec: ClassVar[str] = ""
    recompute_all_spec: ClassVar[str | None] = None
    num_layers: ClassVar[int] = SUITE_LAYERS
    init_std: ClassVar[float] = SUITE_INIT_STD
    decode_steps: ClassVar[int] = 4
    atol: ClassVar[float] = RECOMPUTE_ALL_ATOL

    @pytest.fixture(params=FAMILIES, scope="class")
    def case(self, request: Any) -> FusionCase:
        return fusion_case(request.param, self.num_layers, 0, self.decode_steps, self.init_std)

    @pytest.fixture(scope="class")
    def run(self, case: FusionCase) -> FusionRun:
        inp = case.fusion_input()
        before = [t.clone() for t in (inp.keys, inp.values, inp.token_ids, inp.suffix_ids)]
        stored = [(c.keys.clone(), c.values.clone(), c.token_ids.clone()) for _, c, _ in case.pieces]
        out = get_method(self.method_spec).fuse(inp)
        k, v = hf_cache.cache_to_tensors(out.cache)
        fused_kv = (k.clone(), v.clone())  # decoding below extends out.cache; keep the fused state
        tokens = greedy_tokens(inp, out, 2)  # decoding must not write through to the input either
        out.cache = hf_cache.make_cache(*fused_kv, case.model.config)
        return FusionRun(inp, out, tokens, before, stored)

    def test_registered_and_repr_round_trips(self) -> None:
        m = get_method(self.method_spec)
        again = get_method(repr(m))
        assert type(again) is type(m)
        assert again.config == m.config

    def test_output_shapes_dtype_device(self, case: FusionCase, run: FusionRun) -> None:
        inp, out = run.inp, run.out
        assert isinstance(out, FusionOutput)
        k, v = hf_cache.cache_to_tensors(out.cache)
        n_layers, h_kv, tc, d = inp.keys.shape
        extra = 0 if out.last_logits is None else int(inp.suffix_ids.shape[0])
        assert tuple(k.shape) == (n_layers, h_kv, tc + extra, d)
        assert tuple(v.shape) == tuple(k.shape)
        assert k.dtype == inp.keys.dtype and v.dtype == inp.values.dtype
        assert k.device == inp.keys.device and v.device == inp.values.device
        if out.last_logits is not None:
            assert tuple(out.last_logits.shape) == (int(case.model.config.vocab_size),)

    def test_deterministic(self, case: FusionCase, run: FusionRun) -> None:
        inp = case.fusion_input()
        again = get_method(self.method_spec).fuse(inp)
        for x, y in zip(hf_cache.cache_to_tensors(run.out.cache), hf_cache.cache_to_tensors(again.cache), strict=True):
            assert torch.equal(x, y)
        assert set(run.out.stats.to_dict()) == set(again.stats.to_dict())
        assert greedy_tokens(inp, again, 2) == run.tokens

    def test_zero_copy_path_matches(self, case: FusionCase, run: FusionRun) -> None:
        """On a buffer-owning input (the engine's path) the method repairs in place and returns the same KV."""
        inp = case.fusion_input(zero_copy=True)
        out = get_method(self.method_spec).fuse(inp)
        k, v = context_kv(out, inp.context_len)
        rk, rv = context_kv(run.out, inp.context_len)
        torch.testing.assert_close(k, rk, atol=self.atol, rtol=0)
        torch.testing.assert_close(v, rv, atol=self.atol, rtol=0)
        assert inp.buffer is not None
        if out.last_logits is None:  # the cache the suffix is prefilled against is the request's buffer
            assert hf_cache.cache_to_tensors(out.cache)[0].data_ptr() == inp.buffer.keys.data_ptr()
        for (k0, v0, ids), (_, c, _) in zip(run.stored_before, case.pieces, strict=True):
            assert torch.equal(k0, c.keys) and torch.equal(v0, c.values) and torch.equal(ids, c.token_ids)

    def test_does_not_mutate_inputs(self, case: FusionCase, run: FusionRun) -> None:
        inp = run.inp
        for old, new in zip(run.inputs_before, (inp.keys, inp.values, inp.token_ids, inp.suffix_ids), strict=True):
            assert torch.equal(old, new)
        for (k, v, ids), (_, c, _) in zip(run.stored_before, case.pieces, strict=True):
            assert torch.equal(k, c.keys) and torch.equal(v, c.values) and torch.equal(ids, c.token_ids)

    def test_stats(self, run: FusionRun) -> None:
        as_dict = run.out.stats.to_dict()
        json.dumps(as_dict)
        assert MethodStats.from_dict(as_dict) == run.out.stats  # results read back as they were written
        frac = run.out.stats.recomputed_fraction
        assert 0.0 <= frac <= 1.0

    def test_recompute_all_equals_full(self, case: FusionCase) -> None:
        if self.recompute_all_spec is None:
            pytest.skip(f"{self.method_spec} has no recompute-everything setting")
        inp = case.fusion_input()
        out = get_method(self.recompute_all_spec).fuse(inp)
        k, v = context_kv(out, inp.context_len)
        torch.testing.assert_close(k, case.full_keys, atol=self.atol, rtol=0)
        torch.testing.assert_close(v, case.full_values, atol=self.atol, rtol=0)
        assert greedy_tokens(inp, out, self.decode_steps) == case.full_tokens


register_ablations()  # relaxkv-fullctx below is an ablation control, not in the user registry
RECOMPUTE_ALL_SPECS = ("relaxkv:r=1.0", "relaxkv-fullctx:r=1.0", "prophetkv:r=1.0", "cacheblend:r=1.0",
                       "epic:k=100000")
"""Every selective method at its recompute-everything setting (each must reproduce ``full``)."""

__all__ = ["LAYOUT", "RECOMPUTE_ALL_ATOL", "RECOMPUTE_ALL_SPECS", "SUITE_INIT_STD", "SUITE_LAYERS", "FusionCase", "FusionMethodTests",
           "FusionRun", "check_suffix_fold", "context_kv", "fusion_case", "greedy_tokens"]
