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


__all__ = ["DOCS", "REQUESTS", "paired_rows"]
