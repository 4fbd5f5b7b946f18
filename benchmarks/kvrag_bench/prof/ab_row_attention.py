"""A/B: the default model's decode step with torch's SDPA vs kvrag's one-token attention (kvrag.kv.row_attention)
for the rows' attention, one model in one process, interleaved step by step, one thread, the same tokens fed to both.

    python benchmarks/kvrag_bench/prof/ab_row_attention.py int4 512,1536,3072 1,4,8 40   # weights, contexts, batches, steps

Weights are int4, int8 or none (dense); the dtype is the machine's default (``KVRAG_DTYPE`` overrides). The context
is synthetic token ids prefilled once. Prints the median step time of each side and their ratio per (context,
batch), and how often the two sides' greedy tokens agree (the kernels round differently, so they need not be equal).
"""
from unittest import mock

from kvrag.kv import batched, row_attention
from kvrag_bench.prof import one_model_ab, step_args


def _side(model, windows, kernel: bool):
    def step(rows, tokens):
        if kernel:
            return batched.decode_step(model, rows, tokens, windows)
        with mock.patch.object(row_attention, "_load", lambda dtype: (None, "A/B: torch's SDPA")):
            return batched.decode_step(model, rows, tokens, windows)

    return step


def main():
    weights, contexts, batches, steps, lm = step_args()
    assert row_attention.why_not(lm.dtype) is None, row_attention.why_not(lm.dtype)
    print(f"{lm.name} {lm.dtype} {weights}, torch's SDPA vs kvrag's row attention, one thread", flush=True)
    win = batched.windows(lm.model)
    one_model_ab(lm, [_side(lm.model, win, False), _side(lm.model, win, True)], ("sdpa", "kvrag"), contexts, batches,
                 steps)


if __name__ == "__main__":
    main()
