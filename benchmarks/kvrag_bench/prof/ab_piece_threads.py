"""A/B: a long prefill run in pieces (``kvrag.kv.pieces``) on the runner's own torch threads (now) against torch's
default for new threads (before: the piece helper thread ran at the process's count, one in ``kvrag serve``).

    python benchmarks/kvrag_bench/prof/ab_piece_threads.py qa_dev.jsonl 200 3 4   # data, offset, prompts, rounds

As ``kvrag serve`` runs: this thread and torch's default on one thread, the runner on the machine's cores
(``EngineConfig.runner_threads``). Each round, both settings taking turns, prepares each dev prompt with ``full``
(the bench's template over its passages) twice: alone, and while a greedy stream decodes (a prompt that asks for a
long list). Prints per setting the medians of the prefill's wall time alone and beside the stream, and the stream's
gap between two steps' tokens, p50 before the prefill and p50 / p90 during it; and whether both settings gave the same logits bit for bit.
"""
import contextlib
import statistics
import sys
import time

import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.kv import pieces
from kvrag.models import load_model
from kvrag.prompting import get_template
from kvrag.store import MemoryStore
from kvrag_bench.prof import BackgroundStream, dev_plans

CORES = torch.get_num_threads()
SETTING = {"helper threads": CORES}
_init = pieces._Parked.__init__


def _patched_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.threads = SETTING["helper threads"]


def one(eng, plan, stream_plan, with_stream):
    """``full``'s prepare of ``plan``: seconds, the stream's gaps (before p50, during p50, during p90) beside it or
    None, the logits."""
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(BackgroundStream(eng, stream_plan)) if with_stream else None
        t0 = time.perf_counter()
        prep = eng.prepare(plan, "full", reserve=8)
        t1 = time.perf_counter()
        logits = prep.last_logits.clone()
        del prep
    if stream is None:
        return t1 - t0, None, logits
    before, during = stream.gaps(t0, t1)
    return t1 - t0, (statistics.median(before), statistics.median(during),
                     statistics.quantiles(during, n=10, method="inclusive")[-1]), logits


def main():
    data, offset, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    pieces._Parked.__init__ = _patched_init
    loaded = load_model(None)
    eng = KVRAGEngine(loaded, MemoryStore(), EngineConfig(runner_threads=CORES))
    plans = dev_plans(eng, data, offset, n)
    stream_plan = eng.plan(get_template(None).render(eng.tokenizer, [], "List the numbers from 1 to 1000, one per line."), [])
    settings = {"runner's": CORES, "default": 1}
    one(eng, plans[0], stream_plan, True)  # warm-up
    got = {s: {"alone": [], "beside": [], "gaps": []} for s in settings}
    logits = {}
    for r in range(rounds):
        for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
            SETTING["helper threads"] = settings[name]
            for i, plan in enumerate(plans):
                alone, _, lg = one(eng, plan, stream_plan, False)
                beside, gaps, _ = one(eng, plan, stream_plan, True)
                got[name]["alone"].append(alone)
                got[name]["beside"].append(beside)
                got[name]["gaps"].append(gaps)
                logits.setdefault((name, i), lg)
                print(f"round {r} {name:8} prompt {i}: alone {alone:.2f} s, beside a stream {beside:.2f} s, stream gap "
                      f"before / during p50 / during p90 {' / '.join(f'{g * 1e3:.0f}' for g in gaps)} ms", flush=True)
    lens = [len(p.token_ids) for p in plans]
    print(f"{loaded.name} {next(loaded.model.parameters()).dtype}, {n} dev prompts from row {offset} ({min(lens)}-"
          f"{max(lens)} tokens), {rounds} rounds, runner threads {CORES}, other threads 1")
    for name, g in got.items():
        med = [statistics.median(x[k] for x in g["gaps"]) * 1e3 for k in range(3)]
        print(f"helper on {name:8} threads ({settings[name]}): full prefill alone {statistics.median(g['alone']):.2f} s, "
              f"beside a stream {statistics.median(g['beside']):.2f} s; stream gap before {med[0]:.0f} ms, during "
              f"p50 {med[1]:.0f} ms, p90 {med[2]:.0f} ms")
    same = all(torch.equal(logits[("runner's", i)], logits[("default", i)]) for i in range(n))
    print(f"same logits bit for bit: {same}")
    eng.close()


if __name__ == "__main__":
    main()
