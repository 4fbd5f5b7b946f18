"""A/B: a burst of N questions at once, with and without packing their question suffixes into one forward
(``EngineConfig.pack_suffixes``), on one loaded model and one chunk store, the two settings taking turns per round.

    python benchmarks/kvrag_bench/prof/ab_burst_pack.py qa_dev.jsonl 200 8 32 3   # data, offset, N, new tokens, rounds

Each burst starts N threads at once, each preparing (method ``stale``) and streaming one dev question (the bench's
default prompt template over its passages, caches ingested beforehand). Prints per setting the median over rounds of
the burst's wall time and its TTFT p50 / p99, and whether every answer equals the other setting's.
"""
import statistics
import sys
import threading
import time

import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.models import load_model
from kvrag.store import MemoryStore
from kvrag_bench.prof import dev_plans


def burst(eng, plans, gen):
    ttft, tokens = [0.0] * len(plans), [None] * len(plans)

    def one(i):
        prep = eng.prepare(plans[i], "stale", reserve=gen.max_new_tokens)
        for _ in eng.stream(prep, gen):
            if not ttft[i]:
                ttft[i] = time.perf_counter() - t  # as the caller sees it: from the burst's start
        tokens[i] = list(prep.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(plans))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    q = statistics.quantiles(ttft, n=100, method="inclusive")
    return wall, statistics.median(ttft), q[98], tokens


def main():
    torch.set_num_threads(1)
    data = sys.argv[1]
    offset, n, new, rounds = (int(a) for a in sys.argv[2:6])
    loaded = load_model(None)
    store = MemoryStore()
    engines = {pack: KVRAGEngine(loaded, store, EngineConfig(pack_suffixes=pack)) for pack in (True, False)}
    eng = engines[True]
    plans = dev_plans(eng, data, offset, n)
    gen = GenerationConfig(max_new_tokens=new)
    burst(engines[False], plans[:2], gen)  # warm-up
    got = {True: [], False: []}
    answers = {}
    for r in range(rounds):
        for pack in ((True, False) if r % 2 == 0 else (False, True)):
            wall, p50, p99, tokens = burst(engines[pack], plans, gen)
            got[pack].append((wall, p50, p99))
            answers.setdefault(pack, tokens)
            print(f"round {r} pack={pack}: wall {wall:.2f} s, TTFT p50 {p50:.2f} s p99 {p99:.2f} s", flush=True)
    lens = [len(p.token_ids) for p in plans]
    print(f"{loaded.name} {next(loaded.model.parameters()).dtype}, {n} dev questions from row {offset} "
          f"({min(lens)}-{max(lens)} prompt tokens), {new} new tokens, {rounds} rounds, one torch thread")
    for pack in (True, False):
        wall, p50, p99 = (statistics.median(x[k] for x in got[pack]) for k in range(3))
        print(f"pack_suffixes={pack!s:5}: burst wall {wall:.2f} s, TTFT p50 {p50:.2f} s, p99 {p99:.2f} s")
    print(f"same answers: {sum(a == b for a, b in zip(answers[True], answers[False], strict=True))}/{n}")


if __name__ == "__main__":
    main()
