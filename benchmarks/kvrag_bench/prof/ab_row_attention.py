"""A/B: the default model's decode step with torch's SDPA vs kvrag's one-token attention (kvrag.kv.row_attention)
for the rows' attention, one model in one process, interleaved step by step, one thread, the same tokens fed to both.

    python benchmarks/kvrag_bench/prof/ab_row_attention.py int4 512,1536,3072 1,4,8 40   # quantize, contexts, batches, steps

``quantize`` is int4, int8 or none (dense weights); the dtype is the machine's default (``KVRAG_DTYPE`` overrides).
The context is synthetic token ids prefilled once. Prints the median step time of each side and their ratio per
(context, batch), and how often the two sides' greedy tokens agree (the kernels round differently, so they need not
be equal).
"""
import statistics
import sys
import time

import torch

from kvrag.kv import batched, hf_cache, row_attention
from kvrag.models import load_model
from kvrag_bench.decode_bench import context_rows

_kernel = row_attention._load


def _use(kernel: bool) -> None:
    row_attention._load = _kernel if kernel else (lambda dtype: (None, "A/B: torch's SDPA"))


def main():
    torch.set_num_threads(1)
    argv = sys.argv[1:] + [None] * 4
    quantize = None if (argv[0] or "int4") == "none" else (argv[0] or "int4")
    contexts = [int(c) for c in (argv[1] or "1536").split(",")]
    batches = [int(b) for b in (argv[2] or "1,8").split(",")]
    steps = int(argv[3] or 40)
    lm = load_model(None, quantize=quantize)
    assert row_attention.why_not(lm.dtype) is None, row_attention.why_not(lm.dtype)
    print(f"{lm.name} {lm.dtype} {quantize or 'dense'}, torch's SDPA vs kvrag's row attention, one thread", flush=True)
    win = batched.windows(lm.model)
    for ctx in contexts:
        kv = hf_cache.prefill_kv(lm.model, torch.tensor(list(range(1000, 1000 + ctx))))
        for b in batches:
            rows = [context_rows(*kv, b, ctx + steps + 4, lm.dtype) for _ in (0, 1)]
            toks = [500 + i for i in range(b)]
            for s in (0, 1):  # the first steps: the direct loop's check
                _use(bool(s))
                for _ in range(2):
                    batched.decode_step(lm.model, rows[s], toks, win)
                    for r in rows[s]:
                        r.length += 1
            times, agree = ([], []), 0
            for st in range(steps):
                out = [None, None]
                for s in ((0, 1) if st % 2 == 0 else (1, 0)):
                    _use(bool(s))
                    t = time.perf_counter()
                    out[s] = batched.decode_step(lm.model, rows[s], toks, win)
                    times[s].append(time.perf_counter() - t)
                    for r in rows[s]:
                        r.length += 1
                a, k = out[0].argmax(-1), out[1].argmax(-1)
                agree += int((a == k).sum())
                toks = [int(t) for t in a]
            ref, new = (1e3 * statistics.median(t) for t in times)
            print(f"context {ctx:5d} batch {b}: sdpa {ref:.1f} ms, kvrag {new:.1f} ms ({new / ref:.3f}x); "
                  f"greedy tokens agree {agree}/{steps * b}", flush=True)
    _use(True)


if __name__ == "__main__":
    main()
