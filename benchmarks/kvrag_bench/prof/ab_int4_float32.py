"""A/B: a float32 model's int4 products with the rows converted inside kvrag's kernel (the default) vs converted
by torch around it (``x.to(bfloat16)`` before, ``.to(float32)`` after: two tensor operations per product), one
model, interleaved step by step, one thread, the same tokens fed to both sides.

    KVRAG_DTYPE=float32 python benchmarks/kvrag_bench/prof/ab_int4_float32.py int4 512,1536,3072 1,8 40

Needs kvrag's int4 kernel (an AVX512-BF16 or AMX CPU) and a float32 model (the default on CPUs without AMX). The
two sides compute the same bits (tests/unit/test_int4_kernel.py), so their greedy tokens agree.
"""
from unittest import mock

import torch

from kvrag.kv import batched, int4_kernel, quant
from kvrag_bench.prof import one_model_ab, step_args


def _side(model, windows, inside: bool):
    def step(rows, tokens):
        if inside:
            return batched.decode_step(model, rows, tokens, windows)
        with mock.patch.object(quant._Int4, "takes_float32", False):  # the rows cast by torch, as before
            return batched.decode_step(model, rows, tokens, windows)

    return step


def main():
    weights, contexts, batches, steps, lm = step_args()
    assert lm.dtype == torch.float32, f"a float32 model is needed (KVRAG_DTYPE=float32), got {lm.dtype}"
    assert int4_kernel.path() is not None, f"kvrag's int4 kernel is not loaded: {int4_kernel.why_not()}"
    print(f"{lm.name} float32 {weights}, kernel {int4_kernel.path()}: casts by torch vs inside the kernel, one thread")
    win = batched.windows(lm.model)
    one_model_ab(lm, [_side(lm.model, win, False), _side(lm.model, win, True)], ("torch casts", "in the kernel"),
                 contexts, batches, steps)


if __name__ == "__main__":
    main()
