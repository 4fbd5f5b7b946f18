"""A/B: CacheRepair's fused, in-place repair vs the unfused one, on one dev request, interleaved, one thread.

    python benchmarks/kvrag_bench/prof/ab_repair.py 8      # repetitions
(dev data from $KVRAG_DEV_QA, default ../shared/data/qa_dev.jsonl; row 0, cache-ready, the shipped checkpoint)

"unfused" restores, in this process, what kvrag did before: the head's output scaled by sigma_delta and added to
the stale KV (three passes and a second [N, S, D] buffer) and pack_kv through torch.stack (two copies).
"""
import os
import statistics
import sys
import time

import torch

import kvrag.fusion.cacherepair as cr
from kvrag.repair.model import RepairModel
from kvrag_bench.runner import BenchConfig, QABenchmark, load_requests


def main():
    torch.set_num_threads(1)
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    cfg = BenchConfig(data=os.environ.get("KVRAG_DEV_QA", "../shared/data/qa_dev.jsonl"), out="/tmp/hotbench",
                      methods=["cacherepair"], threads=1)
    r = QABenchmark(cfg)
    req = load_requests(cfg.data, limit=1, offset=0)[0]
    plan, _ = r.plan(req)
    r.ensure_cached([plan])
    eng = r.engine
    fused_repair, fused_pack = RepairModel.repair, cr.pack_kv

    def unfused_repair(self, stale, tok_emb, chunk_index, positions=None, *, inplace=False):
        with torch.inference_mode():
            return self.residual(self.forward(stale, tok_emb, chunk_index, positions).float()).add_(stale)

    def unfused_pack(keys, values):
        L, H, N, D = keys.shape
        return torch.stack([keys, values], dim=1).permute(3, 0, 1, 2, 4).reshape(N, L * 2 * H, D)

    def variant(name):
        RepairModel.repair = fused_repair if name == "fused" else unfused_repair
        cr.pack_kv = fused_pack if name == "fused" else unfused_pack

    print("context", plan.context_len, "suffix", len(plan.suffix.token_ids))
    res = {v: [] for v in ("unfused", "fused")}
    rep_s = {v: [] for v in res}
    logits = {}
    for k in range(reps + 1):
        for v in res:
            variant(v)
            t = time.perf_counter()
            p = eng.prepare(plan, "cacherepair")
            dt = time.perf_counter() - t
            logits[v] = p.last_logits
            if k:
                res[v].append(dt)
                rep_s[v].append(p.timings["repair_s"])
    a, b = statistics.median(res["unfused"]), statistics.median(res["fused"])
    ra, rb = statistics.median(rep_s["unfused"]), statistics.median(rep_s["fused"])
    d = (logits["unfused"] - logits["fused"]).abs().max().item()
    print(f"cacherepair prepare: unfused {a*1000:7.1f} ms  fused {b*1000:7.1f} ms  ratio {b/a:.3f}; "
          f"repair step {ra*1000:.1f} -> {rb*1000:.1f} ms; max|dlogit| {d:.2e}")


if __name__ == "__main__":
    main()
