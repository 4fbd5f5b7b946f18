"""A process's first answers with and without the server's warm-up (kvrag.engine.warmup): load, warm up or not,
ingest two short passages, then three questions over them with ``stale``, 16 tokens each, one thread.

    python benchmarks/kvrag_bench/prof/first_answer.py default cold
    python benchmarks/kvrag_bench/prof/first_answer.py FILE.gguf warm

Prints the warm-up's seconds and each answer's TTFT and whole time; run ``cold`` and ``warm`` in fresh processes.
"""
import sys
import time

import torch

from kvrag import KVRAGEngine
from kvrag.engine.warmup import warm_up

DOCS = ["The ferry to the island leaves at 6 pm on weekdays and at 8 pm on weekends. " * 6,
        "The museum opens at 9 am and closes at 5 pm; on Mondays it is closed. " * 6]
QUESTIONS = ["When does the last ferry leave on weekends?", "When does the museum close?",
             "Is the museum open on Mondays?"]


def main() -> None:
    torch.set_num_threads(1)
    eng = KVRAGEngine.from_pretrained(None if sys.argv[1] == "default" else sys.argv[1])
    if sys.argv[2] == "warm":
        print(f"warm-up {warm_up(eng):.2f} s")
    eng.ingest(DOCS)
    for i, q in enumerate(QUESTIONS):
        prompt = eng.chat_prompt(f"{DOCS[0]}\n{DOCS[1]}\nQuestion: {q}")
        t = time.perf_counter()
        r = eng.answer(prompt, DOCS, method="stale", max_new_tokens=16)
        print(f"answer {i}: TTFT {r.timings.ttft_s * 1e3:.0f} ms, whole answer {(time.perf_counter() - t) * 1e3:.0f} ms, "
              f"{len(r.token_ids)} tokens")
    eng.close()


if __name__ == "__main__":
    main()
