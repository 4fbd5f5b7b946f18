"""Where in the depth the stale cache's error matters: ``full``'s exact K/V given to the stale cache in its bottom or
top k decoder layers, the rest left stale, against ``stale`` and ``cacherepair``.

``python benchmarks/kvrag_bench/prof/layer_mix.py qa_dev.jsonl OFFSET LIMIT K[,K...] OUT.jsonl`` (one thread, the
benchmark's default template, 24 greedy tokens). Per request: ``full``, ``stale`` and ``cacherepair`` prepared by the
engine; then, from each cache (the prompt's context; every variant decoded alike, by the model's own forward over the
same question suffix), the greedy answer, whether it is ``full``'s (normalized answer, tokens, first token) and the
first answer step's KL(full || variant). ``bottomK`` takes layers 0..K-1 from ``full``, ``topK`` the last K.

A layer-wise repair (recompute some layers jointly, reuse the rest) can do no better than its layers' exact K/V, so
these variants bound it from above: if ``full``'s own K/V in half the layers leaves most answers changed, recomputing
those layers cannot keep them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from kvrag.fusion import get_method
from kvrag.kv import hf_cache
from kvrag_bench.config import BenchConfig
from kvrag_bench.data import load_requests
from kvrag_bench.metrics import same_answer
from kvrag_bench.runner import QABenchmark

ANSWER_TOKENS = 24


@torch.inference_mode()
def decode(model: Any, stop: set[int], keys: torch.Tensor, values: torch.Tensor,
           suffix: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy answer tokens after the context K/V [L, H, T, D] and the suffix, and the first step's log-probs."""
    start = keys.shape[2]
    cache = hf_cache.make_cache(keys, values, model.config)
    logits, _ = hf_cache.forward(model, torch.tensor(suffix), cache, start=start)
    first = torch.log_softmax(logits[-1].float(), -1)
    tokens: list[int] = []
    nxt, pos = int(first.argmax()), start + len(suffix)
    while len(tokens) < ANSWER_TOKENS and nxt not in stop:
        tokens.append(nxt)
        logits, _ = hf_cache.forward(model, torch.tensor([nxt]), cache, start=pos)
        nxt, pos = int(logits[-1].argmax()), pos + 1
    return tokens, first


def main(data: str, offset: int, limit: int, ks: list[int], out: Path) -> None:
    torch.set_num_threads(1)
    bench = QABenchmark(BenchConfig(data=data, out=str(out.parent / "layer_mix_run"), methods=["full", "stale"],
                                    max_new_tokens=ANSWER_TOKENS, threads=1, plots=False, progress=False))
    model, tok = bench.engine.model, bench.engine.tokenizer
    eos = model.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    layers = len(hf_cache.decoder_layers(model))
    rows: list[dict[str, Any]] = []
    for i, req in enumerate(load_requests(data, limit, offset)):
        plan, _ = bench.plan(req)
        if not bench._fits(plan):
            continue
        bench.ensure_cached([plan])
        t = plan.context_len
        caches = {}
        for spec in ("full", "stale", "cacherepair"):
            r = bench.run_method(plan, spec, get_method(spec), req)
            caches[spec] = (r.keys[:, :, :t].contiguous(), r.values[:, :, :t].contiguous())
        (kf, vf), (ks_, vs) = caches["full"], caches["stale"]
        for k in ks:
            for name, part in ((f"bottom{k}", slice(0, k)), (f"top{k}", slice(layers - k, layers))):
                kk, vv = ks_.clone(), vs.clone()
                kk[part], vv[part] = kf[part], vf[part]
                caches[name] = (kk, vv)
        suffix = list(plan.suffix.token_ids)
        ref_tokens, ref_lp = decode(model, stop, *caches.pop("full"), suffix)
        ref_answer = bench.extract(tok.decode(ref_tokens, skip_special_tokens=True))
        row: dict[str, Any] = {"row": offset + i, "context_tokens": t}
        for name, (kk, vv) in caches.items():
            tokens, lp = decode(model, stop, kk, vv, suffix)
            answer = bench.extract(tok.decode(tokens, skip_special_tokens=True))
            row[name] = {"same_answer": bool(same_answer(answer, ref_answer)), "same_tokens": tokens == ref_tokens,
                         "first_token": tokens[:1] == ref_tokens[:1],
                         "kl_first": float((ref_lp.exp() * (ref_lp - lp)).sum())}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    n = len(rows)
    for name in [k for k in rows[0] if isinstance(rows[0][k], dict)] if rows else []:
        got = [r[name] for r in rows]
        print(f"{name:12s} same answer {sum(g['same_answer'] for g in got)}/{n}  same tokens "
              f"{sum(g['same_tokens'] for g in got)}  first token {sum(g['first_token'] for g in got)}  "
              f"first-step KL {sum(g['kl_first'] for g in got) / n:.3f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(k) for k in sys.argv[4].split(",")], Path(sys.argv[5]))
