"""Dev probe for answer-keeping repairs: every method's answer and first-step distribution per request, and the
``auto:agree`` threshold search over them.

``python -m kvrag_bench.fidelity_probe run --offset 0 --limit 25 --out runs/probe_dev --methods "full;stale;..."``
records, per request (methods interleaved, order rotating), each method's answer, tokens and TTFT, the top-1
probability of each of the first 8 steps of its own answer (``confs``; ``rows.jsonl``) and its first decode step's
log-probabilities (``lp_<row>.pt``). ``python -m kvrag_bench.fidelity_probe calibrate
runs/probe_dev --levels cacherepair,full`` then prints, per agreement target, the lowest top-1 probability threshold
(steps of 0.05) at which the ladder of those levels keeps ``full``'s normalized answer on at least that share of the
recorded requests, with the simulated cost (each level's TTFT added up; a ``hybrid`` after CacheRepair pays only its
recompute) -- how :data:`kvrag.fusion.escalate.AGREE_THRESHOLDS` was calibrated. ``python -m
kvrag_bench.fidelity_probe summarize RUN`` writes ``summary.json`` / ``summary.md`` of a ``kvrag bench --out``
directory from the requests it finished (a run stopped before its end), with this process's machine description.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvrag_bench.metrics import same_answer

LOOKAHEAD_TOKENS = 8
"""Steps of each method's own greedy answer whose top-1 probability the probe records (``confs``)."""


def run(args: argparse.Namespace) -> None:
    from kvrag.fusion import get_method
    from kvrag_bench.config import BenchConfig
    from kvrag_bench.data import load_requests
    from kvrag_bench.runner import QABenchmark

    methods = [m for m in args.methods.split(";") if m]
    cfg = BenchConfig(data=args.data, out=args.out, methods=methods, template=args.template, model=args.model,
                      max_new_tokens=args.max_new_tokens, threads=1, plots=False, progress=False)
    bench = QABenchmark(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {json.loads(x)["id"] for x in (out / "rows.jsonl").read_text().splitlines()} \
        if (out / "rows.jsonl").exists() else set()
    for i, req in enumerate(load_requests(cfg.data, args.limit, args.offset)):
        plan, _ = bench.plan(req)
        if req.id in done or not bench._fits(plan):
            continue
        bench.ensure_cached([plan])
        rec: dict[str, Any] = {"id": req.id, "row": args.offset + i, "answers": list(req.answers),
                               "tc": plan.context_len, "methods": {}}
        lp = {}
        for spec in methods[i % len(methods):] + methods[: i % len(methods)]:
            r = bench.run_method(plan, spec, get_method(spec), req)
            rec["methods"][spec] = {k: r.record[k] for k in ("answer", "raw", "f1", "token_ids", "ttft_s")}
            lp[spec] = torch.log_softmax(r.last_logits.float(), -1).half()
            with torch.inference_mode():  # how sure each step of the method's own answer is, from its cache
                own = bench.teacher_forced(r, r.token_ids[:LOOKAHEAD_TOKENS]) if r.token_ids else r.last_logits[None]
            rec["methods"][spec]["confs"] = torch.softmax(own.float(), -1).max(-1).values.tolist()
        torch.save(lp, out / f"lp_{args.offset + i}.pt")
        with (out / "rows.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")


def simulate(rows: Sequence[dict[str, Any]], conf: dict[int, dict[str, float]], levels: Sequence[str],
             tau: float) -> tuple[float, float, float]:
    """(same-answer share, median and mean TTFT / full's) of the ladder ``levels`` at threshold ``tau``."""
    same, cost = [], []
    for r in rows:
        m, spent = r["methods"], 0.0
        for i, s in enumerate(levels):
            t = m[s]["ttft_s"]
            if i > 0 and s.startswith("hybrid") and levels[0] == "cacherepair":
                t -= m["cacherepair"]["ttft_s"] - m["stale"]["ttft_s"]
            spent += t
            if i == len(levels) - 1 or conf[r["row"]][s] >= tau:
                same.append(same_answer(m[s]["answer"], m["full"]["answer"]))
                break
        cost.append(spent / m["full"]["ttft_s"])
    return float(np.mean(same)), float(np.median(cost)), float(np.mean(cost))


def calibrate(args: argparse.Namespace) -> None:
    out = Path(args.out)
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    rows = [r for r in rows if args.rows is None or r["row"] in range(*map(int, args.rows.split("-")))]
    conf = {r["row"]: {s: float(v.float().exp().max()) for s, v in torch.load(out / f"lp_{r['row']}.pt").items()}
            for r in rows}
    levels = args.levels.split(",")
    grid = [round(x, 2) for x in np.arange(0.0, 1.0, 0.05)] + [1.01]
    print(f"{len(rows)} requests, ladder {levels}")
    table = {}
    for agree in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
        tau = next((g for g in grid if simulate(rows, conf, levels, g)[0] >= agree), 1.01)
        same, p50, mean = simulate(rows, conf, levels, tau)
        print(f"agree {agree}: threshold {tau} same answer {same:.2f} TTFT/full p50 {p50:.2f} mean {mean:.2f}")
        table[str(agree)] = [1.01 if agree >= 1.0 else tau] * (len(levels) - 1)  # agree=1: always the last level
    if args.write:
        record = {"levels": levels, "requests": len(rows), "rows": args.rows, "thresholds": table}
        Path(args.write).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.write}: pass it as auto:agree=X,thresholds={args.write}")


def _signal(confs: Sequence[float], kind: str, k: int) -> float:
    """A first level's certainty from the top-1 probabilities of its own answer's first ``k + 1`` steps."""
    c = confs[: k + 1]
    if kind == "min":
        return min(c)
    return float(np.exp(np.mean(np.log(np.maximum(c, 1e-9))))) if kind == "gmean" else c[0]


def signals(args: argparse.Namespace) -> None:
    """Per agreement target, the cheapest two-level ladder (``--level`` then ``full``) over the recorded requests
    for each signal: the first step's top-1 probability, or the minimum / geometric mean over the first k + 1 steps of
    the level's own answer -- whether reading further into the answer keeps more answers than the first step."""
    out = Path(args.out)
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    levels = [args.level, "full"]
    confs = [r["methods"][args.level]["confs"] for r in rows]
    same, _, cost = simulate(rows, {r["row"]: {args.level: 1.0} for r in rows}, levels, 0.0)  # the level kept always
    print(f"{len(rows)} requests; {args.level} alone: same answer {same:.2f}, TTFT/full {cost:.2f}")
    for agree in (0.7, 0.8, 0.9):
        found = []
        for kind, ks in (("first", [0]), ("min", range(1, 8)), ("gmean", range(1, 8))):
            for k in ks:
                sig = [_signal(c, kind, k) for c in confs]
                conf = {r["row"]: {args.level: x} for r, x in zip(rows, sig, strict=True)}
                for tau in [*sorted(set(sig)), 1.01]:
                    got, _, cost = simulate(rows, conf, levels, tau)
                    if got >= agree:
                        found.append((cost, kind, k, tau, got, sum(x >= tau for x in sig)))
                        break
        found.sort()
        first = next(f for f in found if f[1] == "first")
        print(f"agree {agree}: first step: kept {first[5]}, mean TTFT/full {first[0]:.2f}; best: " + "; ".join(
            f"{kind} k={k} tau {tau:.3f} kept {kept} TTFT/full {cost:.2f}" for cost, kind, k, tau, _, kept in found[:3]))


def summarize(args: argparse.Namespace) -> None:
    from kvrag_bench import aggregate, provenance

    out = Path(args.out)
    meta = json.loads((out / "run.json").read_text())
    rows = aggregate.read_jsonl(out / "results.jsonl")
    cfg = {**meta["config"], "limit": len(rows)}
    key = meta.get("resume_key", {})
    dtype = torch.float32 if key.get("store_dtype") == "float32" else torch.bfloat16
    env = aggregate.environment_info()
    env["hardware"] = {**env.get("hardware", {}), "torch_threads": cfg.get("threads")}  # the run's, not this one's
    if args.git_sha:
        env["git_sha"] = args.git_sha
    summary = aggregate.summarize(rows, cfg["methods"], config=cfg, env=env, n_boot=int(cfg.get("bootstrap", 1000)),
                                  extra={"machine": provenance.machine_info(torch.device("cpu"), dtype),
                                         "model": {"name": key.get("model")},
                                         "finished_requests": [r["id"] for r in rows]})
    aggregate.write_summary(out, summary)
    print((out / "summary.md").read_text())


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvrag_bench.fidelity_probe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", default="../shared/data/qa_dev.jsonl")
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--limit", type=int, default=25)
    r.add_argument("--out", required=True)
    r.add_argument("--methods", default="full;stale;cacherepair;hybrid:r=0.015;hybrid:r=0.03;hybrid:r=0.06")
    r.add_argument("--template", default="oneshot-chat-answer-is")
    r.add_argument("--model", default=None, help="a GGUF path, HF id or folder (default: the embedded model)")
    r.add_argument("--max-new-tokens", type=int, default=24)
    r.set_defaults(func=run)
    c = sub.add_parser("calibrate")
    c.add_argument("out")
    c.add_argument("--levels", default="cacherepair,full")
    c.add_argument("--rows", default=None, help="a row range such as 0-25 (default: every recorded row)")
    c.add_argument("--write", default=None, help="write the thresholds to this JSON file (auto's thresholds=FILE)")
    c.set_defaults(func=calibrate)
    g = sub.add_parser("signals")
    g.add_argument("out")
    g.add_argument("--level", default="cacherepair", help="the ladder's first level (a recorded method)")
    g.set_defaults(func=signals)
    m = sub.add_parser("summarize")
    m.add_argument("out")
    m.add_argument("--git-sha", default=None, help="the commit the run started at (default: this checkout's)")
    m.set_defaults(func=summarize)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
