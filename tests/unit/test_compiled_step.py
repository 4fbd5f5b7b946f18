"""The captured decode step (``compile_decode``, :mod:`kvrag.kv.compiled`) computes the eager step's bits."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.kv import batched, compiled, hf_cache
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.slow  # each batch shape compiles (~10-30 s on two cores)


def _rows(model: torch.nn.Module, contexts: list[list[int]], extra: int) -> list[batched.Row]:
    rows = []
    for ids in contexts:
        keys, values = hf_cache.prefill_kv(model, torch.tensor(ids))
        buf = hf_cache.KVBuffer(keys.shape[0], keys.shape[1], keys.shape[3], keys.shape[2] + extra, keys.dtype,
                                keys.device)
        buf.keys[:, :, : keys.shape[2]].copy_(keys)
        buf.values[:, :, : keys.shape[2]].copy_(values)
        rows.append(batched.Row(buf, keys.shape[2]))
    return rows


@pytest.mark.parametrize(("family", "dtype", "quantize"), [("llama", torch.bfloat16, "int4"),
                                                            ("qwen3", torch.float32, None),
                                                            ("qwen2", torch.float32, "int8")])
def test_captured_step_writes_and_returns_the_eager_steps_bits(family: str, dtype: torch.dtype,
                                                                quantize: str | None) -> None:
    model = tiny_model(family, init_std=0.1, dtype=dtype, quantize=quantize).model
    win = batched.windows(model)
    contexts = [[(7 * i + 3 * j) % 200 + 10 for j in range(n)] for i, n in enumerate((37, 90, 61))]
    for batch in (1, 3, 2):  # the several-rows graph, checked at 3 rows, also serves 2
        eager, captured = (_rows(model, contexts[:batch], 12) for _ in range(2))
        toks = [5 + i for i in range(batch)]
        for step in range(6):
            with hf_cache.model_lock(model):
                a = batched.decode_step(model, eager, toks, win)
                b = batched.decode_step(model, captured, toks, win, compiled=True)
            assert torch.equal(a, b), f"batch {batch}, step {step}: the captured step's logits differ"
            if step == 0:  # the shape's first step ran eagerly and started its compilation on the helper thread
                compiled.wait(model, timeout=900)
            for r, s in zip(eager, captured, strict=True):
                assert torch.equal(r.buffer.keys[:, :, r.length], s.buffer.keys[:, :, s.length])
                assert torch.equal(r.buffer.values[:, :, r.length], s.buffer.values[:, :, s.length])
                r.length += 1
                s.length += 1
            toks = [int(t) for t in a.argmax(-1)]
    # both shapes ran captured (their first steps checked bit for bit against the eager step), not the fallback
    assert compiled.captured(model) == {"one row": True, "several rows": True}


def test_a_batch_shape_compiles_on_a_helper_thread_while_steps_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.utils import counters

    model = tiny_model("llama", init_std=0.1, dtype=torch.float32).model
    win = batched.windows(model)
    entered, release, rehearsed = threading.Event(), threading.Event(), []
    real = batched._rehearse

    def held(*args: object) -> None:
        rehearsed.append(threading.current_thread().name)
        entered.set()
        assert release.wait(60)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(batched, "_rehearse", held)
    eager, captured = (_rows(model, [[(3 * j) % 200 + 10 for j in range(30)]], 8) for _ in range(2))
    for step in range(4):
        with hf_cache.model_lock(model):
            a = batched.decode_step(model, eager, [9 + step], win)
            b = batched.decode_step(model, captured, [9 + step], win, compiled=True)
        assert torch.equal(a, b), f"step {step}"
        for r in eager + captured:
            r.length += 1
        if step == 1:  # two steps served eagerly while the compilation waits; then let it go
            assert entered.wait(60) and compiled.captured(model) == {}
            assert rehearsed == ["kvrag-compile-decode"]
            release.set()
            assert compiled.wait(model, timeout=900) == {"one row": True}
            graphs = counters["stats"]["unique_graphs"]
    assert compiled.captured(model) == {"one row": True}  # its first served step checked equal too
    assert counters["stats"]["unique_graphs"] == graphs  # the served steps ran what the helper compiled


def test_a_step_of_more_rows_than_the_quantized_route_stays_eager() -> None:
    assert compiled.why_not(tiny_model("llama").model, 17) is not None
    assert compiled.why_not(tiny_model("llama").model, 16) is None


def test_packed_bfloat16_weights_keep_the_eager_step() -> None:
    model = tiny_model("llama", init_std=0.1, dtype=torch.bfloat16).model
    packed = any(getattr(m, "_kvrag_packed", None) is not None for m in model.modules())
    win = batched.windows(model)
    eager, captured = (_rows(model, [[(5 * j) % 200 + 10 for j in range(40)]], 4) for _ in range(2))
    for step in range(3):
        with hf_cache.model_lock(model):
            a = batched.decode_step(model, eager, [9], win)
            b = batched.decode_step(model, captured, [9], win, compiled=True)
        assert torch.equal(a, b), f"step {step}"
        for r in eager + captured:
            r.length += 1
    if packed:  # this CPU packs bf16 weights (oneDNN bf16): the step stays eager
        assert compiled.captured(model) == {}
    else:  # dense bf16 products: captured, and its first step checked against the eager one (equal steps above)
        assert "one row" in compiled.captured(model)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def test_the_graph_cache_keeps_the_captures_lowerings_apart(tmp_path: Path) -> None:
    """Inductor's FX graph cache stays on for the capture: a graph compiled with the same options but without kvrag's
    lowerings is never served to it, and a capture compiled again (a later process, a later engine) loads from the
    cache."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import clear_caches, fresh_cache

    compiled._install_dispatch()
    x = torch.randn(64, 576, dtype=torch.bfloat16)
    without_key = {k: v for k, v in compiled._options().items() if k != "post_grad_custom_post_pass"}

    def compile_once(options: dict[str, Any], ours: bool) -> torch.Tensor:
        torch._dynamo.reset()
        fn = torch.compile(_rms, fullgraph=True, options=options)
        if not ours:
            return fn(x)  # type: ignore[no-any-return]
        with compiled._eager_kernels():
            return fn(x)  # type: ignore[no-any-return]

    counters.clear()
    try:
        with fresh_cache(dir=str(tmp_path)):
            compile_once(without_key, ours=False)
            assert counters["inductor"]["fxgraph_cache_miss"] == 1
            got = compile_once(compiled._options(), ours=True)
            assert counters["inductor"]["fxgraph_cache_hit"] == 0, "served a graph compiled without kvrag's lowerings"
            assert counters["inductor"]["fxgraph_cache_miss"] == 2
            assert torch.equal(got, _rms(x))
            again = compile_once(compiled._options(), ours=True)
            assert counters["inductor"]["fxgraph_cache_hit"] == 1
            assert torch.equal(again, got)
    finally:
        torch._dynamo.reset()
        clear_caches()  # nothing keeps pointing at the removed directory


def test_precompile_compiles_both_shapes_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``kvrag pull --compile-decode`` (``batched.precompile``): both batch shapes compiled and checked in the calling
    thread, so a deploy step can fill the cache before a server starts."""
    from kvrag.cli import main

    lm = tiny_model("qwen2", init_std=0.1)
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("KVRAG_DTYPE", "float32")  # dense fp32 products: captured on every CPU kind
    assert main(["pull", str(tmp_path / "m"), "--compile-decode"]) == 0
    assert "one row: compiled, several rows: compiled" in capsys.readouterr().out


def test_each_model_compiles_a_code_object_of_its_own() -> None:
    """Dynamo keeps compiled entries per code object: models sharing one would share its recompile limit (8 entries:
    a few models and batch shapes in one process, then 'recompile limit exceeded' and eager steps) and keep each
    other's closures alive."""
    bodies = []
    for _ in range(2):
        model = tiny_model("llama", init_std=0.1, dtype=torch.float32).model
        comp = compiled._Compiled(model, batched._attend)
        bodies.append(comp.body._torchdynamo_orig_callable)  # type: ignore[attr-defined]
    assert bodies[0].__code__ is not bodies[1].__code__
    assert bodies[0].__code__.co_code == bodies[1].__code__.co_code  # the same loop
