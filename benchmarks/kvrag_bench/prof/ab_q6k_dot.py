"""A/B: a decode-sized Q6_K product inside the file's blocks -- float32 inputs (``kvrag_dequant_dot``) against
bfloat16 inputs (``kvrag_dequant_dot_bf16``, AVX512-BF16) -- on one random Q6_K weight larger than the CPU's cache
(an 8B model's ``ffn_down``: 4096 x 14336 by default), the two taking turns, one thread.

    python benchmarks/kvrag_bench/prof/ab_q6k_dot.py                 # rows 1, 2, 8; 4096 x 14336
    python benchmarks/kvrag_bench/prof/ab_q6k_dot.py 1,4 1024 4096  # rows, outputs, inputs

Prints the median milliseconds of each side per row count, the weights a second, and each side's largest error
against the float64 product (relative to the largest output).
"""
import statistics
import sys

import torch

from kvrag.kv import gguf_blocks
from kvrag_bench.prof import median_ms


def main() -> None:
    rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2,8").split(",")]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    cols = int(sys.argv[3]) if len(sys.argv) > 3 else 14336
    torch.set_num_threads(1)
    f32, bf16 = gguf_blocks.native_dot(), gguf_blocks.native_dot_bf16()
    if f32 is None or bf16 is None:
        sys.exit("needs ggml_dequant.c built and an AVX512-BF16 CPU")
    size = gguf_blocks.TYPES["Q6_K"][1]
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, cols // 256 * size), dtype=torch.uint8, generator=gen)
    raw.view(n, cols // 256, size)[..., size - 1] &= 0x3F  # finite half-precision scales
    weight = gguf_blocks.dequantize(raw, "Q6_K", cols).double()
    print(f"Q6_K {n} x {cols}, one thread: ms float32 | ms bfloat16 | bfloat16 / float32 | G weights/s (bf16) | "
          "max error float32 | bfloat16")
    for r in rows:
        x = torch.randn(r, cols, generator=gen).to(torch.bfloat16)  # exact in float32: the same inputs for both
        sides = {"f32": lambda x=x: gguf_blocks.dot(f32, raw, "Q6_K", x),
                 "bf16": lambda x=x: gguf_blocks.dot(bf16, raw, "Q6_K", x, bf16=True)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(3):  # interleaved rounds
            for k, f in sides.items():
                times[k].append(median_ms(f, 5, warm=1))
        ms = {k: statistics.median(v) for k, v in times.items()}
        want = x.double() @ weight.T
        err = {k: float((f().double() - want).abs().max() / want.abs().max()) for k, f in sides.items()}
        print(f"rows {r}: {ms['f32']:.2f} | {ms['bf16']:.2f} | {ms['bf16'] / ms['f32']:.2f} | "
              f"{n * cols / ms['bf16'] / 1e6:.1f} | {err['f32']:.1e} | {err['bf16']:.1e}")


if __name__ == "__main__":
    main()
