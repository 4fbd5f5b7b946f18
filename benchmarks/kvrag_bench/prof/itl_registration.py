"""A/B: a running stream's inter-token gaps while another caller caches a long chunk (a ``kvrag serve``
registration, a retriever's misses), the chunk's forward holding the model for its whole length (as before
``ChunkCaching._model_work``) against it running in the runner's turn, in pieces between decode steps (now).

    python benchmarks/kvrag_bench/prof/itl_registration.py qa_dev.jsonl 2000 5   # data, chunk tokens, rounds

One engine on the machine's default dtype, threads as ``kvrag serve`` sets them (the runner on the cores, every other
thread on one). A greedy stream (a prompt asking for a long list) runs; after its 8th token the chunk (the dev rows'
passages joined and cut to the given token count) is cached into an empty store, ``whole`` and ``pieces`` taking
turns each round, each also once with nobody decoding. Prints per setting the medians over rounds of: the caching
call's wall time alone and beside the stream, the stream's longest gap between two steps' tokens and its gap p90
during the call, its gap p50 before it; and whether the two settings computed the same K/V bit for bit.
"""
import json
import statistics
import sys
import time

import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.ingest_prefill import DEFAULT_BATCH_SIZE, compute_chunk_kvs, prefill_prefix
from kvrag.models import load_model
from kvrag.prompting import get_template
from kvrag.store import MemoryStore
from kvrag_bench.prof import BackgroundStream

CORES = torch.get_num_threads()


def chunk_text(tokenizer, data, tokens):
    parts = []
    with open(data) as f:
        for line in f:
            parts += [c["text"] for c in json.loads(line)["contexts"]]
            ids = tokenizer(" ".join(parts), add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                return tokenizer.decode(ids[:tokens])
    raise SystemExit(f"{data} holds fewer than {tokens} tokens of passages")


def whole(eng, text):
    """The chunk's forward as one call holding the model (the path before pieces)."""
    ref = eng.identify([text])[0]
    with eng._lock:
        prefix_kv = prefill_prefix(eng.model, eng.chunk_prefix_ids)
        return compute_chunk_kvs(eng.model, eng.rope, eng.spec, [list(ref.token_ids)], eng.chunk_prefix_ids,
                                 DEFAULT_BATCH_SIZE, prefix_kv=prefix_kv)[0]


def in_pieces(eng, text):
    """``KVRAGEngine.ensure`` into an empty store: the runner's turn (its threads), in pieces while others decode."""
    return eng.ensure([text], store=MemoryStore(), fetch=True)[0][0].kv


def one_round(eng, plan, text, cache):
    """``cache(eng, text)`` beside a stream: seconds, the stream's longest gap and gap p90 during it, its gap p50
    before it, the K/V."""
    with BackgroundStream(eng, plan) as stream:
        t0 = time.perf_counter()
        kv = cache(eng, text)
        t1 = time.perf_counter()
    before, during = stream.gaps(t0, t1)
    return t1 - t0, max(during), statistics.quantiles(during, n=10, method="inclusive")[-1], \
        statistics.median(before), kv


def main():
    data, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    loaded = load_model(None)
    eng = KVRAGEngine(loaded, MemoryStore(), EngineConfig(runner_threads=CORES))
    text = chunk_text(eng.tokenizer, data, tokens)
    template = get_template(None)
    plan = eng.plan(template.render(eng.tokenizer, [], "List the numbers from 1 to 1000, one per line."), [])
    ways = {"whole": whole, "pieces": in_pieces}
    one_round(eng, plan, text[:400], in_pieces)  # warm-up
    got, kvs = {k: [] for k in ways}, {}
    for r in range(rounds):
        for name in (("whole", "pieces") if r % 2 == 0 else ("pieces", "whole")):
            t = time.perf_counter()
            ways[name](eng, text)  # nobody decodes
            alone = time.perf_counter() - t
            *row, kv = one_round(eng, plan, text, ways[name])
            got[name].append([*row, alone])
            kvs[name] = kv
            print(f"round {r} {name:6}: alone {alone:.2f} s; beside the stream: call {row[0]:.2f} s, longest gap "
                  f"{row[1] * 1e3:.0f} ms, gap p90 {row[2] * 1e3:.0f} ms, steady gap {row[3] * 1e3:.0f} ms", flush=True)
    n = len(eng.identify([text])[0].token_ids)
    print(f"{loaded.name} {next(loaded.model.parameters()).dtype}, a chunk of {n} tokens, {rounds} rounds, "
          f"runner threads {CORES}, other threads 1")
    for name, rows in got.items():
        call, longest, p90, steady, alone = (statistics.median(x[k] for x in rows) for k in range(5))
        print(f"{name:6}: caching call alone {alone:.2f} s, beside the stream {call:.2f} s, the stream's longest gap "
              f"{longest * 1e3:.0f} ms, gap p90 {p90 * 1e3:.0f} ms (steady gap {steady * 1e3:.0f} ms)")
    same = torch.equal(kvs["whole"].keys, kvs["pieces"].keys) and torch.equal(kvs["whole"].values, kvs["pieces"].values)
    print(f"same K/V bit for bit: {same}")
    eng.close()


if __name__ == "__main__":
    main()
