"""Profiling and A/B scripts, each run as a file (``python benchmarks/kvrag_bench/prof/NAME.py ...``; see its
docstring). They drive the benchmark runner on dev data outside the repository."""

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def median_ms(f: Callable[[], object], n: int = 15, warm: int = 3) -> float:
    """The median milliseconds of ``n`` calls of ``f`` after ``warm`` untimed ones."""
    for _ in range(warm):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def step_args(contexts: str = "1536") -> tuple[str, list[int], list[int], int, Any]:
    """The decode-step A/B scripts' arguments from ``sys.argv`` -- weights (``int4`` / ``int8`` / ``none``), contexts
    and batches (comma-separated), steps -- with torch on one thread and the default model loaded with those weights.

    Returns:
        (weights, contexts, batches, steps, the loaded model as :func:`kvrag.models.load_model` returns it).
    """
    import torch

    from kvrag.models import load_model

    torch.set_num_threads(1)
    argv = sys.argv[1:] + [None] * 4
    quantize = argv[0] or "int4"
    ctxs = [int(c) for c in (argv[1] or contexts).split(",")]
    batches = [int(b) for b in (argv[2] or "1,8").split(",")]
    steps = int(argv[3] or 40)
    return quantize, ctxs, batches, steps, load_model(None, quantize=None if quantize == "none" else quantize)


def interleaved_steps(sides: list[Any], rows: list[list[Any]], tokens: list[int], steps: int) -> tuple[list[float], int]:
    """Decode steps of two sides taking turns (the order alternating each step), the same tokens fed to both.

    Args:
        sides: two callables ``side(rows) -> logits [B, V]`` (one decode step over the given rows; the caller's
            setup, e.g. a kernel switch, inside); rows: each side's own rows (advanced after each step here);
        tokens: the first step's tokens (afterwards side 0's greedy choice).

    Returns:
        (median seconds of a step per side, how many row-steps' greedy tokens agreed). The first two steps of each
        side (the direct loop's check) are not timed.
    """
    import statistics
    import time

    def step(s: int) -> Any:
        out = sides[s](rows[s], tokens)
        for r in rows[s]:
            r.length += 1
        return out

    for s in (0, 1):
        step(s)
        step(s)
    times: tuple[list[float], list[float]] = ([], [])
    agree = 0
    for st in range(steps):
        out: list[Any] = [None, None]
        for s in ((0, 1) if st % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            out[s] = step(s)
            times[s].append(time.perf_counter() - t)
        a, k = out[0].argmax(-1), out[1].argmax(-1)
        agree += int((a == k).sum())
        tokens = [int(t) for t in a]
    return [statistics.median(t) for t in times], agree


def one_model_ab(lm: Any, sides: list[Any], names: tuple[str, str], contexts: list[int], batches: list[int],
                 steps: int) -> None:
    """Print, per (context, batch), the median decode step of two sides of one loaded model (``sides``: as
    :func:`interleaved_steps` takes them; each its own rows over the same synthetic context, prefilled once), their
    ratio and how often their greedy tokens agree."""
    import torch

    from kvrag.kv import hf_cache
    from kvrag_bench.decode_bench import context_rows

    for ctx in contexts:
        kv = hf_cache.prefill_kv(lm.model, torch.tensor(list(range(1000, 1000 + ctx))))
        for b in batches:
            rows = [context_rows(*kv, b, ctx + steps + 4, lm.dtype) for _ in (0, 1)]
            (ref, new), agree = interleaved_steps(sides, rows, [500 + i for i in range(b)], steps)
            print(f"context {ctx:5d} batch {b}: {names[0]} {1e3 * ref:.1f} ms, {names[1]} {1e3 * new:.1f} ms "
                  f"({new / ref:.3f}x); greedy tokens agree {agree}/{steps * b}", flush=True)


STEP_MIN_S = 5e-4
"""Token gaps shorter than this are tokens of one decode step (prompt-lookup speculation accepts several a step)."""


class BackgroundStream:
    """A greedy stream (``"stale"``) decoding ``plan`` in a thread while the caller times other work:
    ``with BackgroundStream(eng, plan) as s:`` starts it and returns after its 8th token; after the block (the stream
    stopped), ``s.gaps(t0, t1)`` gives the gaps between two steps' tokens before ``t0`` and those overlapping
    ``[t0, t1]``. The plan must ask for an answer longer than the work lasts."""

    def __init__(self, eng: Any, plan: Any, max_new_tokens: int = 1500) -> None:
        import threading

        self.eng, self.plan, self.max_new_tokens = eng, plan, max_new_tokens
        self.times: list[float] = []
        self._started, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        from kvrag.config import GenerationConfig

        gen = GenerationConfig(max_new_tokens=self.max_new_tokens)
        it = self.eng.stream(self.eng.prepare(self.plan, "stale", reserve=gen.max_new_tokens), gen)
        for _ in it:
            self.times.append(time.perf_counter())
            if len(self.times) == 8:
                self._started.set()
            if self._stop.is_set():
                break
        it.close()
        self._started.set()

    def __enter__(self) -> "BackgroundStream":
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # the gap spanning the timed work's end lands
        self._stop.set()
        self._thread.join()

    def gaps(self, t0: float, t1: float) -> tuple[list[float], list[float]]:
        steps = [(a, b) for a, b in zip(self.times, self.times[1:], strict=False) if b - a > STEP_MIN_S]
        during = [b - a for a, b in steps if b > t0 and a < t1]
        if len(during) < 2:
            raise SystemExit(f"the stream ended early ({len(self.times)} tokens): its prompt must ask for a longer "
                             "answer")
        return [b - a for a, b in steps if b <= t0], during


def dev_plans(eng: Any, data: str, offset: int, n: int) -> list[Any]:
    """Plans of ``n`` dev questions from row ``offset`` (the bench's default template over their passages), the
    passages' caches ingested."""
    from kvrag.prompting import get_template
    from kvrag_bench.data import load_requests

    template = get_template(None)
    plans = []
    for req in load_requests(data, limit=n, offset=offset):
        prefix, passages, suffix = template.parts(eng.tokenizer, req.passages(), req.question)
        eng.ingest(passages, progress=False)
        plans.append(eng.plan_parts(prefix, passages, suffix))
    return plans
