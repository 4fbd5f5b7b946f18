"""A/B: a float32 model's int4 products with the rows converted inside kvrag's kernel (the default) vs converted
by torch around it (``x.to(bfloat16)`` before, ``.to(float32)`` after: two tensor operations per product), one
model, interleaved step by step, one thread, the same tokens fed to both sides.

    KVRAG_DTYPE=float32 python benchmarks/kvrag_bench/prof/ab_int4_float32.py int4 512,1536,3072 1,8 40

Needs kvrag's int4 kernel (an AVX512-BF16 or AMX CPU) and a float32 model (the default on CPUs without AMX). The
two sides compute the same bits (tests/unit/test_int4_kernel.py), so their greedy tokens agree.
"""
import functools

import torch

from kvrag.kv import batched, hf_cache, int4_kernel, quant
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import interleaved_steps, step_args


def _step(model, windows, inside: bool, rows, tokens):
    quant._Int4.takes_float32 = property(lambda self: inside and self.scales_zeros is None)  # type: ignore[assignment]
    return batched.decode_step(model, rows, tokens, windows)


def main():
    weights, contexts, batches, steps, lm = step_args()
    assert lm.dtype == torch.float32, f"a float32 model is needed (KVRAG_DTYPE=float32), got {lm.dtype}"
    assert int4_kernel.path() is not None, f"kvrag's int4 kernel is not loaded: {int4_kernel.why_not()}"
    print(f"{lm.name} float32 {weights}, kernel {int4_kernel.path()}: casts by torch vs inside the kernel, one thread")
    wins = batched.windows(lm.model)
    for ctx in contexts:
        kv = hf_cache.prefill_kv(lm.model, torch.tensor(list(range(1000, 1000 + ctx))))
        for b in batches:
            rows = [context_rows(*kv, b, ctx + steps + 4, lm.dtype) for _ in (0, 1)]
            fns = [functools.partial(_step, lm.model, wins, inside) for inside in (False, True)]
            (ref, new), agree = interleaved_steps(fns, rows, [500 + i for i in range(b)], steps)
            ref, new = 1e3 * ref, 1e3 * new
            print(f"context {ctx:5d} batch {b}: torch casts {ref:.1f} ms, in the kernel {new:.1f} ms "
                  f"({new / ref:.3f}x); greedy tokens agree {agree}/{steps * b}", flush=True)


if __name__ == "__main__":
    main()
