"""A/B: question-suffix prefills of a burst, one request at a time vs packed into one forward
(kvrag.kv.batched.prefill_rows), on one loaded model, one thread, the same contexts and suffixes for each side.

    python benchmarks/kvrag_bench/prof/ab_packed_suffix.py int4 1200 25 8 5   # weights, context, suffix, rows, rounds
    python benchmarks/kvrag_bench/prof/ab_packed_suffix.py int4 1200 25 8 5 gemma-3-270m-it-Q4_K_M.gguf  # a model

Sides: the model's own forward per request over its cache (``hf_cache.forward``), ``prefill_rows`` per request,
and ``prefill_rows`` over all rows at once. The packed logits must equal the per-request ones bit for bit (each
row's products run alone). The contexts are synthetic token ids prefilled once; the suffixes distinct ids.
Prints the median time of each side for all rows.
"""
import statistics
import sys
import time

import torch

from kvrag.kv import batched, hf_cache
from kvrag.models import load_model
from kvrag_bench.decode_bench import context_rows


def main():
    torch.set_num_threads(1)
    quantize = sys.argv[1] if len(sys.argv) > 1 else "int4"
    given = sys.argv[2:6]
    ctx, n, rows_n, rounds = (int(a) for a in given + ["1200", "25", "8", "5"][len(given):])
    lm = load_model(sys.argv[6] if len(sys.argv) > 6 else None, quantize=None if quantize == "none" else quantize)
    model, win = lm.model, batched.windows(lm.model)
    keys, values = hf_cache.prefill_kv(model, torch.tensor(list(range(1000, 1000 + ctx))))
    suffixes = [[2000 + 13 * i + j for j in range(n)] for i in range(rows_n)]
    times = {"model forward, one by one": [], "prefill_rows, one by one": [], "prefill_rows, packed": []}
    for _ in range(rounds):
        rows = context_rows(keys, values, rows_n, ctx + n + 1, lm.dtype)
        t = time.perf_counter()
        for r, s in zip(rows, suffixes, strict=True):
            hf_cache.forward(model, torch.tensor(s), r.buffer.as_cache(r.length), start=r.length)
        times["model forward, one by one"].append(time.perf_counter() - t)
        rows = context_rows(keys, values, rows_n, ctx + n + 1, lm.dtype)
        t = time.perf_counter()
        alone = torch.stack([batched.prefill_rows(model, [r], [s], win)[0] for r, s in zip(rows, suffixes, strict=True)])
        times["prefill_rows, one by one"].append(time.perf_counter() - t)
        rows = context_rows(keys, values, rows_n, ctx + n + 1, lm.dtype)
        t = time.perf_counter()
        packed = batched.prefill_rows(model, rows, suffixes, win)
        times["prefill_rows, packed"].append(time.perf_counter() - t)
        assert torch.equal(packed, alone), "a packed row differs from the row alone"
    print(f"{lm.name} {lm.dtype} quantize={quantize}: {rows_n} suffixes of {n} tokens over {ctx} context tokens")
    base = statistics.median(times["model forward, one by one"][1:])
    for k, v in times.items():
        m = statistics.median(v[1:])
        print(f"{k:28s} {1e3 * m:7.1f} ms ({1e3 * m / rows_n:6.1f} ms a request, {m / base:.2f}x)")


if __name__ == "__main__":
    main()
