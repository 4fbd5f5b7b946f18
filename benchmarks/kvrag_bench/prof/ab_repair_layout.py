"""A/B: CacheRepair repairing in the cache's own layout (repair_kv) vs packing the stale KV into [N, S, D] and back
(repair, the path before), on dev requests, interleaved, one thread, cache-ready, the shipped checkpoint.

    python benchmarks/kvrag_bench/prof/ab_repair_layout.py 6 0,1,2     # repetitions, dev rows
(dev data from $KVRAG_DEV_QA, default ../shared/data/qa_dev.jsonl)
"""
import os
import statistics
import sys
import time

import torch

from kvrag.repair.config import pack_kv, unpack_kv
from kvrag.repair.model import RepairModel
from kvrag_bench.runner import BenchConfig, QABenchmark, load_requests


def main():
    torch.set_num_threads(1)
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    rows = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "0").split(",")]
    cfg = BenchConfig(data=os.environ.get("KVRAG_DEV_QA", "../shared/data/qa_dev.jsonl"), out="/tmp/hotbench",
                      methods=["cacherepair"], threads=1)
    r = QABenchmark(cfg)
    layout = RepairModel.repair_kv

    def packed(self, keys, values, tok_emb, chunk_index, positions=None, *, skip=0):
        """The previous path: pack [L, H, N, D] -> [N, S, D], one head GEMM over it, unpack, copy the values back."""
        L, H = keys.shape[:2]
        rk, rv = unpack_kv(self.repair(pack_kv(keys, values), tok_emb, chunk_index, positions, inplace=True)[skip:], L, H)
        values[:, :, skip:].copy_(rv)
        return rk, values[:, :, skip:]

    for row in rows:
        req = load_requests(cfg.data, limit=1, offset=row)[0]
        plan, _ = r.plan(req)
        r.ensure_cached([plan])
        res = {v: [] for v in ("packed", "layout")}
        rep_s = {v: [] for v in res}
        logits = {}
        for k in range(reps + 1):
            for v in res:
                RepairModel.repair_kv = packed if v == "packed" else layout
                t = time.perf_counter()
                p = r.engine.prepare(plan, "cacherepair")
                dt = time.perf_counter() - t
                logits[v] = p.last_logits
                if k:
                    res[v].append(dt)
                    rep_s[v].append(p.timings["repair_s"])
        a, b = statistics.median(res["packed"]), statistics.median(res["layout"])
        ra, rb = statistics.median(rep_s["packed"]), statistics.median(rep_s["layout"])
        d = (logits["packed"] - logits["layout"]).abs().max().item()
        print(f"row {row} context {plan.context_len}: prepare packed {a*1000:7.1f} ms  layout {b*1000:7.1f} ms  "
              f"ratio {b/a:.3f}; repair step {ra*1000:.1f} -> {rb*1000:.1f} ms; max|dlogit| {d:.2e}", flush=True)


if __name__ == "__main__":
    main()
