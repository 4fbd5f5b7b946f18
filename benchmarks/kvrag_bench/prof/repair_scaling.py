"""Would a burst's CacheRepair passes gain from one packed forward? The shipped repairer's serving pass
(``RepairModel.repair_kv``) timed per document length, and its backbone on two documents at once ([2, N], the
block-causal mask a packed batch needs) against the same two one after another ([1, N] each), in the model's
compute dtype, on random stale K/V in the default model's shape (retrieved chunks of 128 tokens).

    python benchmarks/kvrag_bench/prof/repair_scaling.py                   # one thread, bfloat16
    python benchmarks/kvrag_bench/prof/repair_scaling.py 2 float32         # two threads, float32

Packing pays where a pass has a fixed cost to share (weight reads, per-call overhead): then microseconds per token
fall as documents lengthen. A pass whose time grows with its tokens from the shortest document on has nothing to
share, and one forward over two documents costs what two do.
"""
import sys

import torch

from kvrag.repair.model import RepairModel
from kvrag.repair.shipped import SHIPPED_DIR
from kvrag_bench.prof import median_ms

CHUNK = 128
LENGTHS = (250, 500, 1000, 2000, 4000)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
    path = next(p.parent for p in sorted(SHIPPED_DIR.glob("*/repair_config.json")))
    rep = RepairModel.from_pretrained(path).to(dtype).eval()
    c = rep.cfg
    L, H, D, E = c.num_layers, c.num_kv_heads, c.head_dim, c.embed_dim
    print(f"repairer {path.name} ({rep.num_parameters:,} parameters), {dtype}, {torch.get_num_threads()} thread(s)")
    torch.manual_seed(0)
    print("repair_kv, one document:")
    for n in LENGTHS:
        k, v = torch.randn(L, H, n, D, dtype=dtype), torch.randn(L, H, n, D, dtype=dtype)
        emb, chunk = torch.randn(n, E, dtype=dtype), torch.arange(n) // CHUNK
        lens = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
        ms = median_ms(lambda: rep.repair_kv(k.clone(), v.clone(), emb, chunk), n=5, warm=1)  # noqa: B023
        print(f"  N={n:5d}  {ms:8.1f} ms  {1e3 * ms / n:6.1f} us/token  {rep.flops(lens) / ms / 1e6:6.1f} GFLOP/s")
    print("backbone, two documents: one [2, N] forward vs two [1, N] forwards")
    for n in (500, 1000, 2000):
        stale = torch.randn(2, n, c.num_segments, D, dtype=dtype)
        emb, chunk = torch.randn(2, n, E, dtype=dtype), (torch.arange(n) // CHUNK).expand(2, n)
        with torch.inference_mode():
            packed = median_ms(lambda: rep.features(stale, emb, chunk), n=5, warm=1)  # noqa: B023
            apart = median_ms(lambda: [rep.features(stale[i:i + 1], emb[i:i + 1], chunk[i:i + 1])  # noqa: B023
                                       for i in range(2)], n=5, warm=1)
        print(f"  N={n:5d}  packed {packed:8.1f} ms  apart {apart:8.1f} ms  packed/apart {packed / apart:.2f}")


if __name__ == "__main__":
    main()
