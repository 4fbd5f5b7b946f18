"""A/B/C: the selective-recompute hot path, on one dev request, variants interleaved, one thread.

  old          the 'layer' executor (one decoder-layer call per 256-target block over a gathered context, dense
               [N, C + N] bias) and the suffix prefilled afterwards in its own pass (kvrag before this change)
  prefix       the 'prefix' executor (one layer call per layer for all targets, attention in 32-row blocks that
               read only their key prefix), suffix prefilled afterwards
  prefix+fold  the 'prefix' executor with the suffix folded into the recompute's layer calls (the default now,
               for full-causal-context methods: hybrid, epic, prophetkv, relaxkv-fullctx)

    python benchmarks/kvrag_bench/prof/ab_recompute.py 5 "hybrid:r=0.05,relaxkv:r=0.15"     # repetitions, methods
(dev data from $KVRAG_DEV_QA, default ../shared/data/qa_dev.jsonl; row $ROW (default 0), cache-ready)

Prints median prepare() time per (method, variant), the recompute seconds the method reports, and the largest
next-token-logit difference against 'old'.
"""
import os
import statistics
import sys
import time

import torch

import kvrag.fusion.recompute as rc
from kvrag_bench.runner import BenchConfig, QABenchmark, load_requests


def main():
    torch.set_num_threads(1)
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    methods = (sys.argv[2] if len(sys.argv) > 2 else "hybrid:r=0.05,relaxkv:r=0.15").split(",")
    row = int(os.environ.get("ROW", "0"))
    cfg = BenchConfig(data=os.environ.get("KVRAG_DEV_QA", "../shared/data/qa_dev.jsonl"), out="/tmp/hotbench",
                      methods=methods, threads=1)
    r = QABenchmark(cfg)
    req = load_requests(cfg.data, limit=1, offset=row)[0]
    plan, _ = r.plan(req)
    r.ensure_cached([plan])
    eng = r.engine
    plain, head = rc.plain_attention, rc.hf_cache.logits_head

    def variant(name):
        rc.plain_attention = plain if name != "old" else (lambda model: False)
        rc.hf_cache.logits_head = head if name == "prefix+fold" else (lambda model: None)

    print("row", row, "context", plan.context_len, "suffix", len(plan.suffix.token_ids), "dtype", eng.spec.dtype)
    execs = ("old", "prefix", "prefix+fold")
    res = {(m, v): [] for m in methods for v in execs}
    logits = {}
    for k in range(reps + 1):
        for m in methods:
            for v in execs:
                variant(v)
                t = time.perf_counter()
                p = eng.prepare(plan, m)
                dt = time.perf_counter() - t
                logits[m, v] = p.last_logits
                if k:
                    ms = p.stats.method_stats
                    res[m, v].append((dt, ms.recompute_s or 0.0, ms.attention_computed_ratio or 0.0,
                                      ms.score_s or 0.0, p.timings.suffix_prefill_s))
    variant("prefix+fold")
    for m in methods:
        base = statistics.median(x[0] for x in res[m, "old"])
        for v in execs:
            xs = res[m, v]
            med = statistics.median(x[0] for x in xs)
            print(f"{m:18s} {v:11s} prepare {med*1000:7.1f} ms ({med/base:.3f}x)  recompute "
                  f"{statistics.median(x[1] for x in xs)*1000:7.1f} ms  scoring {statistics.median(x[3] for x in xs)*1000:6.1f}"
                  f" ms  suffix pass {statistics.median(x[4] for x in xs)*1000:6.1f} ms  computed pairs {xs[0][2]:.3f}"
                  " of full's")
        for v in execs[1:]:
            d = (logits[m, "old"] - logits[m, v]).abs().max().item()
            print(f"{m:18s} max |dlogit| old vs {v}: {d:.2e}")


if __name__ == "__main__":
    main()
