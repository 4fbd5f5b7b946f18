"""Prepacked bf16 linear weights (kvrag.kv.linear): bit-identical to transformers' own forward, and never stale."""

from __future__ import annotations

import pytest
import torch

from kvrag.kv import linear
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.skipif(not linear.packing_available(), reason="this torch build has no oneDNN bf16 support")


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_model_is_bit_identical_to_the_plain_one(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(linear.ENV, "0")
    plain = tiny_model(family, dtype=torch.bfloat16, init_std=0.1)
    monkeypatch.delenv(linear.ENV)
    packed = tiny_model(family, dtype=torch.bfloat16, init_std=0.1)  # wrap_model packs
    assert all(getattr(m, "_kvrag_packed", None) is None for m in _linears(plain.model))
    assert all(getattr(m, "_kvrag_packed", None) is not None for m in _linears(packed.model))
    ids = torch.randint(5, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(plain.model, ids), _logits(packed.model, ids))  # prefill rows
    for n in (1, 3):  # decode-sized rows
        assert torch.equal(_logits(plain.model, ids[:, :n]), _logits(packed.model, ids[:, :n]))
    gen = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 1}
    assert torch.equal(plain.model.generate(ids, **gen), packed.model.generate(ids, **gen))
    assert plain.fingerprint == packed.fingerprint  # the dense weights are untouched


@pytest.mark.parametrize("threads", [1, 2])
def test_bit_identical_on_every_thread_count(threads: int) -> None:
    """Decode-sized inputs take the packed weight, prefill-sized ones F.linear: identical outputs either way, also
    where oneDNN splits a product over several threads."""
    lin = torch.nn.Linear(576, 576, bias=False).to(torch.bfloat16)
    ref = torch.nn.Linear(576, 576, bias=False).to(torch.bfloat16)
    ref.weight = lin.weight
    linear.pack_linears(lin)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 8, linear.MAX_ROWS, linear.MAX_ROWS + 1, 300):
            x = torch.randn(1, rows, 576, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rows))
            with torch.inference_mode():
                assert torch.equal(lin(x), ref(x)), rows
    finally:
        torch.set_num_threads(saved)


def test_packing_is_only_for_bf16_on_the_cpu_and_idempotent() -> None:
    assert all(getattr(m, "_kvrag_packed", None) is None for m in _linears(tiny_model("llama").model))  # fp32
    lm = tiny_model("llama", dtype=torch.bfloat16)
    assert linear.pack_linears(lm.model) == 0  # already packed by wrap_model


def test_a_changed_weight_is_never_served_from_a_stale_pack() -> None:
    lm = tiny_model("llama", dtype=torch.bfloat16, init_std=0.1)
    lin = _linears(lm.model)[0]
    x = torch.randn(2, lin.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        lin.weight.mul_(2)  # in place: the packed copy is now stale
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=0, atol=0)
    lin.weight = torch.nn.Parameter(torch.zeros_like(lin.weight))  # replaced
    with torch.inference_mode():
        assert torch.count_nonzero(lin(x)) == 0
    lm.model.float()  # another dtype
    with torch.inference_mode():
        assert lin(x.float()).dtype == torch.float32


def test_autograd_falls_back_to_the_plain_linear() -> None:
    lin = _linears(tiny_model("llama", dtype=torch.bfloat16).model)[0]
    x = torch.randn(2, lin.in_features, dtype=torch.bfloat16, requires_grad=True)
    lin(x).float().sum().backward()  # the packed op has no backward; the fallback does
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_row_has_the_same_bits_alone_and_among_others() -> None:
    """A real model's ``down_proj`` shape (K = 1536): oneDNN multiplies one bf16 row with another kernel than several,
    which sums over K in another order; one-row inputs go through the multi-row kernel, so a decode step's row, a
    verify step's positions and a batched step's rows all get the same bits."""
    lin = torch.nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.02, generator=torch.Generator().manual_seed(0))
    linear.pack_linears(lin)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(12):
            x = torch.randn(9, 1536, generator=gen) * torch.rand(1, generator=gen) * 3
            x[:, torch.rand(1536, generator=gen) < 0.3] = 0  # activations after SiLU-gating: many small or zero
            x = x.to(torch.bfloat16)
            together = lin(x[None])[0]
            for i in range(9):
                assert torch.equal(lin(x[i : i + 1][None])[0, 0], together[i]), i
