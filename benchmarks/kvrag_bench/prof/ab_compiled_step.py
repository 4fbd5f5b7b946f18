"""A/B: a plain decode step run eagerly (kvrag's direct loop) vs captured by ``torch.compile`` (kvrag.kv.compiled,
``compile_decode``), interleaved step by step on one loaded model, one thread, the same tokens fed to both; every
step's logits must be equal (the captured step computes the eager step's bits).

    python benchmarks/kvrag_bench/prof/ab_compiled_step.py int4 512,1536,3072 1,8 40   # weights, contexts, batches, steps

The context is synthetic token ids prefilled once. Each batch shape compiles on the capture's helper thread after its
first step (the wait printed: minutes the first time on a machine, seconds from torch's inductor cache after that);
prints the median step time of each side and their ratio per (context, batch).
"""
import statistics
import time

import torch

from kvrag.kv import batched, compiled, hf_cache
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import step_args


def main():
    quantize, contexts, batches, steps, lm = step_args("1536")
    model, win = lm.model, batched.windows(lm.model)
    print(f"{lm.name} {lm.dtype} quantize={quantize}, one thread", flush=True)
    for ctx in contexts:
        keys, values = hf_cache.prefill_kv(model, torch.tensor(list(range(1000, 1000 + ctx))))
        for b in batches:
            sides = [context_rows(keys, values, b, ctx + steps + 4, lm.dtype) for _ in range(2)]
            toks = [500 + i for i in range(b)]
            for side in (0, 1):  # the first steps: the direct loop's check; the capture compiles on its helper
                for _ in range(2):
                    batched.decode_step(model, sides[side], toks, win, compiled=bool(side))
                    for r in sides[side]:
                        r.length += 1
                if side:
                    t = time.perf_counter()
                    compiled.wait(model)
                    print(f"  waited {time.perf_counter() - t:.0f} s for the {b}-row step's compilation", flush=True)
            for side in (0, 1):  # the capture's first served step (checked against the eager one), both sides
                batched.decode_step(model, sides[side], toks, win, compiled=bool(side))
                for r in sides[side]:
                    r.length += 1
            print(f"  captured: {compiled.captured(model)}", flush=True)
            times = ([], [])
            for st in range(steps):
                out = [None, None]
                for side in ((0, 1) if st % 2 == 0 else (1, 0)):
                    t = time.perf_counter()
                    out[side] = batched.decode_step(model, sides[side], toks, win, compiled=bool(side))
                    times[side].append(time.perf_counter() - t)
                    for r in sides[side]:
                        r.length += 1
                assert torch.equal(out[0], out[1]), f"step {st}: the captured step's logits differ"
                toks = [int(t) for t in out[0].argmax(-1)]
            eager, capt = (1e3 * statistics.median(t) for t in times)
            print(f"context {ctx:5d} batch {b}: eager {eager:.1f} ms, compiled {capt:.1f} ms ({capt / eager:.3f}x), "
                  f"{steps} steps with equal logits", flush=True)


if __name__ == "__main__":
    main()
