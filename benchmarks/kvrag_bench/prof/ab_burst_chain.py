"""A/B through the README's chains: a burst of 8 questions and 8 steady clients (2 questions each) under settings
that change between rounds on one engine -- packed question suffixes (``EngineConfig.pack_suffixes``) and the
batch size above which nobody drafts (``EngineConfig.speculative_max_batch``; 0: speculation off) -- each round
asking the 8 questions one by one first (the burst's baseline), the settings taking turns in alternating order.

    python benchmarks/kvrag_bench/prof/ab_burst_chain.py langchain 4 pack=0:spec=2 pack=1:spec=2 pack=1:spec=8

(framework, rounds, settings). `stale` over the sample documents, 32 new tokens, the runner on two threads and
every other thread on one, as ``kvrag bench load --runner-threads 2`` runs. Prints per setting the medians over
rounds: one by one, the burst's wall time and speed-up, its TTFT p50, and 8 clients' questions/s against one by
one's; every answer under load must equal the sequential one (asserted).
"""
import dataclasses
import statistics
import sys
import time

import torch

from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.speculate import SpeculationConfig
from kvrag_bench import load_sweep


def _setting(text: str) -> tuple[bool, int]:
    kv = dict(part.split("=") for part in text.split(":"))
    return kv["pack"] == "1", int(kv["spec"])


def main() -> None:
    fw, rounds, settings = sys.argv[1], int(sys.argv[2]), [_setting(s) for s in sys.argv[3:]]
    torch.set_num_threads(1)
    engine = KVRAGEngine.from_pretrained(None, "memory://", max_batch_size=8, runner_threads=2)
    cfg = load_sweep.SweepConfig(clients=(1,), questions=1, frameworks=(fw,), method="stale", max_new_tokens=32)
    ask = {"llamaindex": load_sweep.llamaindex_client, "langchain": load_sweep.langchain_client}[fw](
        engine, cfg, load_sweep.DATA)
    questions = list(load_sweep.QUESTIONS)
    reference = {q: ask(q)["answer"] for q in questions}
    runner, drafting = engine.runner, engine.runner.speculation

    def use(pack: bool, limit: int) -> None:
        runner.pack_suffixes, runner.scheduler.max_parked = pack, runner.max_batch_size if pack else 1
        spec = (SpeculationConfig(max_draft=0) if limit == 0 else
                dataclasses.replace(drafting, max_draft=drafting.max_draft or 3, max_batch=limit))
        runner.speculation = runner.forwards.speculation = spec

    got: dict[tuple[bool, int], dict[str, list[float]]] = {s: {"seq": [], "burst": [], "ttft": [], "load": []}
                                                           for s in settings}
    for r in range(rounds):
        for s in settings if r % 2 == 0 else settings[::-1]:
            use(*s)
            t = time.perf_counter()
            for q in questions[:8]:
                ask(q)
            got[s]["seq"].append(time.perf_counter() - t)
            burst = load_sweep.run_level(ask, engine, questions[:8], 8, 1, reference)
            load = load_sweep.run_level(ask, engine, questions, 8, 2, reference)
            assert burst["same_answer_rate"] == load["same_answer_rate"] == 1.0, (burst, load)
            got[s]["burst"].append(burst["wall_s"])
            got[s]["ttft"].append(burst["ttft_p50_s"])
            got[s]["load"].append(load["questions_per_s"])
    print(f"{fw}, {engine.loaded.name} {next(engine.model.parameters()).dtype}, stale, 32 new tokens, {rounds} rounds")
    for (pack, limit), v in got.items():
        seq, wall, qps = (statistics.median(v[k]) for k in ("seq", "burst", "load"))
        print(f"pack_suffixes={pack!s:5} speculative_max_batch={limit or 'off'}: one by one {seq:.2f} s, burst "
              f"{wall:.2f} s ({seq / wall:.2f}x), TTFT p50 {statistics.median(v['ttft']):.2f} s; 8 clients "
              f"{qps:.2f} q/s ({qps * seq / 8:.2f}x one by one)", flush=True)


if __name__ == "__main__":
    main()
