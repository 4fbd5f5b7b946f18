"""A/B: the default model's decode step with torch's int4 kernel vs kvrag's (kvrag.kv.int4_kernel), two copies of
the model loaded in one process, interleaved step by step, one thread, the same tokens fed to both.

    python benchmarks/kvrag_bench/prof/ab_int4_kernel.py amx 512,1536,3072 1,4,8 40   # kernel path, contexts, batches, steps

The kernel path is ``amx`` or ``avx512bf16`` (what this CPU has). The context is synthetic token ids prefilled once.
Prints the median step time of each side and their ratio per (context, batch), and how often the two sides' greedy
tokens agree (their logits differ in the last bf16 bit of some products, so they need not be equal).
"""
import functools
import os
import sys

import torch

from kvrag.kv import batched, hf_cache, int4_kernel
from kvrag.models import load_model
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import interleaved_steps


def _step(model, windows, rows, tokens):
    return batched.decode_step(model, rows, tokens, windows)


def _load(kernel):
    os.environ["KVRAG_INT4_KERNEL"] = kernel
    int4_kernel._load.cache_clear()
    lm = load_model(None, quantize="int4")
    got = int4_kernel.path() or "torch"
    assert got == kernel, f"asked for the {kernel} kernel, got {got} ({int4_kernel.why_not()})"
    return lm


def main():
    torch.set_num_threads(1)
    argv = sys.argv[1:] + [None] * 4
    kernel = argv[0] or "amx"
    contexts = [int(c) for c in (argv[1] or "1536").split(",")]
    batches = [int(b) for b in (argv[2] or "1,8").split(",")]
    steps = int(argv[3] or 40)
    sides = [_load("torch"), _load(kernel)]
    names = ("torch", kernel)
    print(f"{sides[0].name} {sides[0].dtype} int4, torch's kernel vs kvrag's {kernel}, one thread", flush=True)
    for ctx in contexts:
        kv = [hf_cache.prefill_kv(lm.model, torch.tensor(list(range(1000, 1000 + ctx)))) for lm in sides]
        for b in batches:
            rows = [context_rows(*kv[s], b, ctx + steps + 4, sides[s].dtype) for s in (0, 1)]
            wins = [batched.windows(lm.model) for lm in sides]
            fns = [functools.partial(_step, lm.model, w) for lm, w in zip(sides, wins, strict=True)]
            (ref, new), agree = interleaved_steps(fns, rows, [500 + i for i in range(b)], steps)
            ref, new = 1e3 * ref, 1e3 * new
            print(f"context {ctx:5d} batch {b}: {names[0]} {ref:.1f} ms, {names[1]} {new:.1f} ms ({new / ref:.3f}x); "
                  f"greedy tokens agree {agree}/{steps * b}", flush=True)


if __name__ == "__main__":
    main()
