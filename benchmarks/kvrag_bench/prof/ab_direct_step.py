"""A/B: a batched decode step through the model's own forward vs kvrag's direct loop (kvrag.kv.direct), interleaved
step by step on one loaded model, one thread, the same tokens fed to both (their logits must be equal).

    python benchmarks/kvrag_bench/prof/ab_direct_step.py int4 512,1536,3072 1,4,8 40   # weights, contexts, batches, steps

The context is synthetic token ids prefilled once (what a step costs depends on its length, not its content).
Prints the median step time of each and their ratio per (context, batch).
"""
import statistics
import time

import torch

from kvrag.kv import batched, direct, hf_cache, step_backend
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import step_args


def main():
    quantize, contexts, batches, steps, lm = step_args("1536")
    model, win = lm.model, batched.windows(lm.model)
    print(f"{lm.name} {lm.dtype} quantize={quantize}; direct loop serves it: {direct.why_not(model) is None}")
    for ctx in contexts:
        keys, values = hf_cache.prefill_kv(model, torch.tensor(list(range(1000, 1000 + ctx))))
        for b in batches:
            sides = [context_rows(keys, values, b, ctx + steps + 1, lm.dtype) for _ in range(2)]
            toks, times = [500 + i for i in range(b)], ([], [])
            for _ in range(steps):
                out = []
                for side, served in enumerate((False, True)):
                    step_backend.choose(model, "decode", "direct" if served else "hf")
                    t = time.perf_counter()
                    out.append(batched.decode_step(model, sides[side], toks, win))
                    times[side].append(time.perf_counter() - t)
                    for r in sides[side]:
                        r.length += 1
                assert torch.equal(out[0], out[1]), "the direct loop changed the logits"
                toks = [int(t) for t in out[0].argmax(-1)]
            a, d = (1e3 * statistics.median(t[3:]) for t in times)
            print(f"context {ctx:5d} batch {b}: model forward {a:6.1f} ms, direct {d:6.1f} ms ({d / a:.3f}x)")


if __name__ == "__main__":
    main()
