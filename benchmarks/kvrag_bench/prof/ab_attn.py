"""A/B: transformers' sdpa vs kvrag_sdpa on one dev request, prepare() per method, interleaved, one thread.

    python benchmarks/kvrag_bench/prof/ab_attn.py stale,cacherepair,relaxkv:r=0.15 6      # methods, repetitions
(dev data from $KVRAG_DEV_QA, default ../shared/data/qa_dev.jsonl; row 0, cache-ready)
"""
import os
import statistics
import sys
import time

import torch
from transformers import PretrainedConfig

from kvrag_bench.runner import BenchConfig, QABenchmark, load_requests


def main():
    torch.set_num_threads(1)
    methods = sys.argv[1].split(",") if len(sys.argv) > 1 else ["stale", "cacherepair"]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    cfg = BenchConfig(data=os.environ.get("KVRAG_DEV_QA", "../shared/data/qa_dev.jsonl"), out="/tmp/hotbench", methods=methods, threads=1)
    r = QABenchmark(cfg)
    req = load_requests(cfg.data, limit=1, offset=0)[0]
    plan, _ = r.plan(req)
    r.ensure_cached([plan])
    eng = r.engine
    cfgs = [m.config for m in eng.model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]

    def impl(name):
        for c in cfgs:
            c._attn_implementation = name

    print("context", plan.context_len, "suffix", len(plan.suffix.token_ids))
    res = {(i, m): [] for i in ("sdpa", "kvrag_sdpa") for m in methods}
    logits = {}
    for k in range(reps + 1):
        for i in ("sdpa", "kvrag_sdpa"):
            impl(i)
            for m in methods:
                t = time.perf_counter()
                p = eng.prepare(plan, m)
                dt = time.perf_counter() - t
                logits[(i, m)] = p.last_logits
                if k:
                    res[(i, m)].append(dt)
    for m in methods:
        a, b = statistics.median(res[("sdpa", m)]), statistics.median(res[("kvrag_sdpa", m)])
        d = (logits[("sdpa", m)] - logits[("kvrag_sdpa", m)]).abs().max().item()
        print(f"{m:24s} sdpa {a*1000:7.1f} ms  kvrag_sdpa {b*1000:7.1f} ms  ratio {b/a:.3f}  max|dlogit| {d:.2e}")


if __name__ == "__main__":
    main()
