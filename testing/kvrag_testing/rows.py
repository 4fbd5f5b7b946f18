"""Prepared requests as rows of the batched decode step, each twice over separate copies of its KV: what the tests of
kvrag's own step loops (the direct loop, the fused step) compare against the model's forward."""

from __future__ import annotations

from typing import Any

from kvrag.kv import batched, hf_cache
from kvrag.prompting import RagTemplate, render_passage

DOCS = [
    render_passage("Paris is the capital of France. The city has many museums.", "Paris"),
    render_passage("Berlin is the capital of Germany. It is a large city.", "Berlin"),
    render_passage("The quick brown fox jumps over the lazy dog.", "Fox"),
]
"""Passages to ingest before :func:`paired_rows`."""
REQUESTS = [([0, 1, 2], "What is the capital of France?"), ([2], "Who jumps?"), ([1, 0], "Where is Berlin?")]
"""(indices into :data:`DOCS`, question) per request."""


def paired_rows(eng: Any, extra: int) -> tuple[list[batched.Row], list[batched.Row], list[int]]:
    """:data:`REQUESTS` prepared by ``eng`` (which has ingested :data:`DOCS`; alternately ``full`` and ``stale``),
    each as two rows over separate copies of its KV with room for ``extra`` more positions, and each request's first
    greedy token."""
    a, b, toks = [], [], []
    for i, (idx, q) in enumerate(REQUESTS):
        passages = [DOCS[j] for j in idx]
        prep = eng.prepare(eng.plan(RagTemplate().render(eng.tokenizer, passages, q), passages),
                           "stale" if i % 2 else "full")
        buf, n = hf_cache.buffer_of(prep.cache)
        buf.reserve(n + extra)
        copy = hf_cache.KVBuffer.wrap(buf.keys.clone(), buf.values.clone())
        a.append(batched.Row(buf, n))
        b.append(batched.Row(copy, n))
        toks.append(int(prep.last_logits.argmax()))
    return a, b, toks


def narrowed(rows: list[batched.Row], dtype: Any) -> list[batched.Row]:
    """``rows`` converted as the engine converts a request's K/V for decode in ``dtype`` (``Row.for_decode``)."""
    return [batched.Row.for_decode(r.buffer, r.length, r.buffer.capacity, dtype) for r in rows]


def assert_fused_is_the_models_forward(model: Any, a: list[batched.Row], b: list[batched.Row],
                                       toks: list[int], steps: int = 4) -> None:
    """Plain steps, then a verify step, of rows ``a`` through the fused step and of their copies ``b`` through the
    model's own forward: the same logits and the same K/V written, bit for bit (the rows' positions advance)."""
    import torch

    from kvrag.kv import step_backend

    wins = batched.windows(model)

    def same_kv(counts: list[int]) -> None:
        for ra, rb, q in zip(a, b, counts, strict=True):
            n = ra.length + q
            assert ra.buffer.keys.dtype == rb.buffer.keys.dtype
            assert torch.equal(ra.buffer.keys[:, :, :n], rb.buffer.keys[:, :, :n])
            assert torch.equal(ra.buffer.values[:, :, :n], rb.buffer.values[:, :, :n])

    try:
        for _ in range(steps):
            step_backend.choose(model, "decode", "fused")
            got = batched.decode_step(model, a, toks, wins)
            step_backend.choose(model, "decode", "hf")
            ref = batched.decode_step(model, b, toks, wins)
            assert torch.equal(got, ref)
            same_kv([1] * len(a))
            for ra, rb in zip(a, b, strict=True):
                ra.length += 1
                rb.length += 1
            toks = [int(t) for t in ref.argmax(-1)]
        feeds = [[t, 7, 9][: i + 1] for i, t in enumerate(toks)]
        step_backend.choose(model, "decode", "fused")
        got = batched.verify_step(model, a, feeds, wins)
        step_backend.choose(model, "decode", "hf")
        assert torch.equal(got, batched.verify_step(model, b, feeds, wins))
        same_kv([len(f) for f in feeds])
    finally:
        step_backend.choose(model, "decode", None)


def drift(model: Any, a: list[batched.Row], b: list[batched.Row], toks: list[int],
          steps: int = 8) -> tuple[float, float, bool]:
    """The same greedy tokens (``a``'s) fed to rows ``a`` and ``b`` for ``steps`` steps: (largest |logit|
    difference, largest next-token KL(a || b), whether every step's logits were identical)."""
    worst, kl, same = 0.0, 0.0, True
    wins = batched.windows(model)
    for _ in range(steps):
        ref = batched.decode_step(model, a, toks, wins)
        got = batched.decode_step(model, b, toks, wins)
        worst = max(worst, (got - ref).abs().max().item())
        lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
        kl = max(kl, (lp.exp() * (lp - lq)).sum(-1).max().item())
        same = same and bool((got == ref).all())
        for r in a + b:
            r.length += 1
        toks = [int(t) for t in ref.argmax(-1)]
    return worst, kl, same


__all__ = ["DOCS", "REQUESTS", "assert_fused_is_the_models_forward", "drift", "narrowed", "paired_rows"]
