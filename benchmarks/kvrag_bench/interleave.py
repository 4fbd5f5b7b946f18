"""``kvrag bench load --interleave full,relaxkv``: inter-token latency of running streams while long prepares arrive.

``--streams`` N ``stale`` streams decode in one engine's batch (short prompts over the sample documents,
``examples/data``; EOS ignored, so every stream runs the whole phase). Three phases, each with N fresh streams:

* **steady**: the streams alone for ``--steady-tokens`` tokens each: the steady-state step (ITL p50);
* **pieces**: meanwhile one client prepares a long prompt (``--context`` tokens of the same documents, every chunk
  cache in the store) ``--prepares`` times with each method in ``--interleave``, one after another, as the engine
  runs them by default: in pieces between the decode steps (:mod:`kvrag.kv.pieces`);
* **whole**: the same prepares, each in one piece (the runner's piece budget switched off), for comparison.

Per phase: the streams' inter-token latency p50 / p99 over the tokens that arrived during the prepares (client
side, one item per token), p99 / steady p50 (issue #27's criterion: <= 2 while ``full`` and ``relaxkv`` prepares
arrive), and each method's mean prepare seconds (what the pieces cost the preparing request). Writes
``interleave.json`` and ``interleave.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvrag_bench.http_load import paragraphs, retrieve
from kvrag_bench.load_sweep import DATA, QUESTIONS, percentile


class _Stream:
    """One running ``stale`` stream whose consumer thread stamps every token."""

    def __init__(self, engine: Any, plan: Any, tokens: int) -> None:
        from kvrag.config import GenerationConfig

        self.engine = engine
        self.stamps: list[float] = []
        prep = engine.prepare(plan, "stale", reserve=tokens)
        self.req = engine.runner.submit(prep, GenerationConfig(max_new_tokens=tokens), [])  # no EOS: runs on
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            for _ in self.engine.runner.iterate(self.req):
                self.stamps.append(time.perf_counter())
        except Exception:  # noqa: BLE001 - cancelled at the end of its phase
            pass

    def stop(self) -> None:
        self.engine.runner.cancel(self.req)
        self.thread.join(60)


def _gaps(streams: Sequence[_Stream], start: float, end: float) -> list[float]:
    """Inter-token gaps whose both tokens arrived in [start, end]."""
    out = []
    for s in streams:
        ts = [t for t in s.stamps if start <= t <= end]
        out += [b - a for a, b in zip(ts, ts[1:], strict=False)]
    return out


def _wait(cond: Callable[[], bool], timeout: float = 600.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)


def _phase(engine: Any, stream_plans: Sequence[Any], tokens: int, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """N fresh streams; once each has its first tokens (all in the batch), ``work()`` runs; the streams' gaps
    during it are the phase's."""
    streams = [_Stream(engine, p, tokens) for p in stream_plans]
    _wait(lambda: all(len(s.stamps) >= 3 for s in streams))
    before = engine.runner.stats()
    start = time.perf_counter()
    info = work()
    end = time.perf_counter()
    after = engine.runner.stats()
    short = sum(len(s.stamps) >= tokens for s in streams)
    for s in streams:
        s.stop()
    gaps = _gaps(streams, start, end)
    return {"wall_s": end - start, "tokens": len(gaps), "itl_p50_ms": 1000 * (percentile(gaps, 50) or 0.0),
            "itl_p99_ms": 1000 * (percentile(gaps, 99) or 0.0), "itl_max_ms": 1000 * max(gaps, default=0.0),
            "steps": after["steps"] - before["steps"], "prepare_pieces": after["prepare_pieces"] - before["prepare_pieces"],
            "streams_that_ran_out": short, **info}


def run(args: argparse.Namespace, engine: Any = None) -> dict[str, Any]:
    """The three phases (see the module docstring); writes interleave.json / .md under ``args.out``. ``engine``:
    one to use (default: ``--model``'s)."""
    import torch

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.prompting import RagTemplate

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in str(args.interleave).split(",") if m.strip()]
    own = engine is None
    if engine is None:
        engine = KVRAGEngine.from_pretrained(args.model, "memory://", dtype=args.dtype, device=args.device,
                                             max_batch_size=max(args.max_batch_size, args.streams))
    paras = paragraphs(Path(args.docs) if args.docs else DATA)
    long_ctx, n = [], 0
    for p in paras * 8:  # the sample documents, repeated if they are short of --context tokens
        if n >= args.context:
            break
        long_ctx.append(p + "\n\n")
        n += len(engine.tokenize(long_ctx[-1]))
    for p in dict.fromkeys(long_ctx + [p + "\n\n" for p in paras]):
        engine.ingest([p])
    tpl = RagTemplate()
    long_plan = engine.plan_parts(*tpl.parts(engine.tokenizer, long_ctx, QUESTIONS[0]))
    stream_plans = [engine.plan_parts(*tpl.parts(engine.tokenizer, [p + "\n\n" for p in retrieve(q, paras, 2)], q))
                    for q in QUESTIONS[1 : 1 + args.streams]]
    stream_plans = (stream_plans * args.streams)[: args.streams]
    for m in methods:  # warm up (and load) every method once
        engine.prepare(long_plan, m, reserve=1)

    def prepares() -> dict[str, Any]:
        secs: dict[str, list[float]] = {m: [] for m in methods}
        for m in methods:
            for _ in range(args.prepares):
                t = time.perf_counter()
                engine.prepare(long_plan, m, reserve=1)
                secs[m].append(time.perf_counter() - t)
        return {"prepare_s": {m: statistics.fmean(v) for m, v in secs.items()}}

    def steady_steps() -> dict[str, Any]:
        steps0 = engine.runner.stats()["steps"]
        _wait(lambda: engine.runner.stats()["steps"] >= steps0 + args.steady_tokens)
        return {}

    budget = engine.runner.piece_budget_s
    tokens = 2048  # per stream and phase: more than a phase lasts
    steady = _phase(engine, stream_plans, tokens, steady_steps)
    pieces = _phase(engine, stream_plans, tokens, prepares)
    engine.runner.piece_budget_s = lambda: None  # type: ignore[method-assign]  # every prepare in one piece
    try:
        whole = _phase(engine, stream_plans, tokens, prepares)
    finally:
        engine.runner.piece_budget_s = budget  # type: ignore[method-assign]
    base = steady["itl_p50_ms"] or float("nan")
    for ph in (steady, pieces, whole):
        ph["p99_over_steady_step"] = ph["itl_p99_ms"] / base
    result = {"config": {k: getattr(args, k) for k in ("interleave", "streams", "prepares", "context", "steady_tokens",
                                                        "threads", "model", "dtype", "device")},
              "model": engine.loaded.name, "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
              "context_tokens": long_plan.total_len, "torch_threads": torch.get_num_threads(),
              "phases": {"steady": steady, "pieces": pieces, "whole": whole}}
    if own:
        engine.close(cancel=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interleave.json").write_text(json.dumps(result, indent=2))
    (out / "interleave.md").write_text(markdown(result))
    result["path"] = str(out / "interleave.json")
    return result


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"`kvrag bench load --interleave {cfg['interleave']}`: {cfg['streams']} running `stale` streams while "
             f"{cfg['prepares']} prepares of each method arrive ({result['context_tokens']}-token prompt), "
             f"{result['model']} {result['dtype']}, {result['torch_threads']} torch thread(s)", "",
             "| phase | ITL p50 ms | ITL p99 ms | ITL max ms | p99 / steady step | steps | prepare pieces | "
             "prepare s (mean) |", "|---|---|---|---|---|---|---|---|"]
    for name, ph in result["phases"].items():
        prep = ", ".join(f"{m} {s:.2f}" for m, s in ph.get("prepare_s", {}).items()) or "-"
        lines.append(f"| {name} | {ph['itl_p50_ms']:.1f} | {ph['itl_p99_ms']:.1f} | {ph['itl_max_ms']:.1f} | "
                     f"{ph['p99_over_steady_step']:.2f} | {ph['steps']} | {ph['prepare_pieces']} | {prep} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--interleave``'s own options (``--context``, ``--threads``, ``--model``, ``--out`` ... are ``kvrag bench
    load``'s)."""
    parser.add_argument("--interleave", default=None, metavar="METHODS",
                        help="instead of the client sweep: ITL of --streams running stale streams while prepares of "
                             "these methods (e.g. full,relaxkv) arrive, in pieces and whole, vs the steady step")
    parser.add_argument("--streams", type=int, default=4, help="running streams (with --interleave)")
    parser.add_argument("--prepares", type=int, default=2, help="prepares per method (with --interleave)")
    parser.add_argument("--steady-tokens", type=int, default=40, help="steps of the steady phase (with --interleave)")


__all__ = ["add_arguments", "markdown", "run"]
