"""``kvrag bench load --http URL``: concurrent streaming clients against ``kvrag serve`` (SSE over HTTP).

The workload: the paragraphs of the sample documents (``examples/data``) are registered with the server
(``POST /v1/kvrag/chunks``); each question's context is its ``--top-k`` paragraphs by word overlap (a fixed lexical
retriever, so that no embedder runs in the client), put into ``load_sweep.PROMPT`` as one user message. For each
client count N, N client threads start together and each streams ``--questions`` chat completions back to back
(closed loop, ``stream=true`` with ``include_usage``). Per level: questions/s and generated tokens/s over the
level's wall time, client-side TTFT p50/p90 (request sent -> first content delta), 429 and other errors, the chunk
hit rate (the server's ``/metrics``), and the same-answer rate against each question answered alone first.
``--burst N`` then streams N different questions at once (one each) against the same N asked one by one before and
after it: the burst's wall time, speed-up and TTFT p50 / p99.

``--http local`` starts the server in this process (:class:`kvrag.serve.LiveServer` over an engine of ``--model``,
built as ``kvrag serve`` builds it: ``--threads`` torch threads for the engine's runner, default torch's count, and
one for every other thread)
and also runs each level **in process** on the same engine -- the same prompts and chunks through
``engine.prepare`` / ``engine.stream`` from N threads, what the framework adapters do -- so that the HTTP
throughput is reported as a fraction of the in-process burst. With a URL only the HTTP side is measured.
Writes ``http_load.json`` and ``http_load.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvrag_bench.load_sweep import DATA, PROMPT, QUESTIONS, against_one_by_one, percentile, run_clients

_WORD = re.compile(r"[a-z0-9]+")


def paragraphs(docs_dir: Path) -> list[str]:
    """The body paragraphs of every .md/.txt document (headings dropped), in file order."""
    out = []
    for p in sorted(docs_dir.glob("*")):
        if p.suffix in (".md", ".txt"):
            out += [x.strip() for x in p.read_text().split("\n\n") if x.strip() and not x.lstrip().startswith("#")]
    return out


def retrieve(question: str, paras: Sequence[str], k: int) -> list[str]:
    """The ``k`` paragraphs sharing the most words with the question (ties: document order)."""
    q = set(_WORD.findall(question.lower()))
    scored = sorted(range(len(paras)), key=lambda i: (-len(q & set(_WORD.findall(paras[i].lower()))), i))
    return [paras[i] for i in sorted(scored[:k])]


def _message(question: str, passages: Sequence[str]) -> str:
    return PROMPT.format(context="\n\n".join(passages), question=question)


def stream_chat(client: Any, model: str, content: str, max_tokens: int, method: str | None) -> dict[str, Any]:
    """One streamed chat completion: its text, client-side TTFT and total time, usage."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if method:
        body["kvrag"] = {"method": method}
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", ()):
                delta = ch.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(delta)
            usage = ev.get("usage") or usage
    total = time.perf_counter() - t0
    return {"answer": "".join(parts), "ttft_s": ttft if ttft is not None else total, "total_s": total,
            "tokens": int(usage.get("completion_tokens", 0)),
            "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))}


def run_level(ask: Callable[[str], dict[str, Any]], questions: Sequence[str], clients: int, per_client: int,
              reference: dict[str, str]) -> dict[str, Any]:
    """``clients`` threads start together, each asks ``per_client`` questions back to back."""
    rows, wall = run_clients(ask, questions, clients, per_client)
    ok = [r for r in rows if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok]
    return {
        "clients": clients, "requests": len(rows), "errors": len(rows) - len(ok),
        "rejected_429": sum("HTTP 429" in (r["error"] or "") for r in rows), "wall_s": wall,
        "questions_per_s": len(ok) / wall, "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "same_answer_rate": sum(r["answer"] == reference.get(r["question"]) for r in ok) / len(ok) if ok else 0.0,
    }


def _metric(client: Any, name: str) -> float:
    for ln in client.get("/metrics").text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.rsplit(" ", 1)[1])
    return 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    docs = Path(args.docs) if args.docs else DATA
    paras = paragraphs(docs)
    questions = list(QUESTIONS)
    ctx = {q: retrieve(q, paras, args.top_k) for q in questions}
    clients = [int(x) for x in str(args.clients).split(",") if x.strip()]
    engine, server = None, None
    url = args.http
    if url == "local":
        from kvrag.serve import LiveServer, ServeConfig, create_app
        from kvrag.serve.cli import serving_engine

        # as `kvrag serve` builds it: --threads for the runner, this process's other threads on one
        engine = serving_engine(args.threads, args.model, "memory://", dtype=args.dtype, device=args.device,
                                method=args.method, max_batch_size=args.max_batch_size)
        server = LiveServer(create_app(engine, ServeConfig(max_queue=max(64, 2 * max(clients))))).start()
        url = server.url
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            c.post("/v1/kvrag/chunks", json={"texts": paras}).raise_for_status()
            method = args.method if engine is None else None  # the local server's default is --method already
            local = threading.local()

            def ask_http(q: str) -> dict[str, Any]:
                if not hasattr(local, "c"):
                    local.c = httpx.Client(base_url=url, timeout=600)
                return stream_chat(local.c, model, _message(q, ctx[q]), args.max_new_tokens, method)

            reference = {q: ask_http(q)["answer"] for q in questions}  # alone, also warms every cache
            result: dict[str, Any] = {"url": args.http, "model": model, "method": args.method, "top_k": args.top_k,
                                      "max_new_tokens": args.max_new_tokens, "questions_per_client": args.questions,
                                      "levels": []}
            for n in clients:
                hits0, reg0 = _metric(c, "kvrag_chunk_hits_total"), _metric(c, "kvrag_chunks_registered_total")
                lv = run_level(ask_http, questions, n, args.questions, reference)
                reg = _metric(c, "kvrag_chunks_registered_total") - reg0
                lv["hit_rate"] = (_metric(c, "kvrag_chunk_hits_total") - hits0) / reg if reg else None
                if engine is not None:
                    lv["in_process"] = run_level(_in_process(engine, ctx, args.max_new_tokens), questions, n,
                                                 args.questions, reference)
                    lv["http_over_in_process"] = lv["tokens_per_s"] / lv["in_process"]["tokens_per_s"]
                result["levels"].append(lv)
            if getattr(args, "burst", 0):
                qs = [questions[i % len(questions)] for i in range(args.burst)]
                result["burst"] = against_one_by_one(ask_http, qs,
                                                     functools.partial(run_level, ask_http, qs, len(qs), 1, reference))
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_load.json").write_text(json.dumps(result, indent=2))
    (out / "http_load.md").write_text(markdown(result))
    result["path"] = str(out)
    return result


def _in_process(engine: Any, ctx: dict[str, list[str]], max_new_tokens: int) -> Callable[[str], dict[str, Any]]:
    from kvrag.adapters import render_chat
    from kvrag.config import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens)

    def ask(q: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        prompt = render_chat(engine.tokenizer, [{"role": "user", "content": _message(q, ctx[q])}])
        prep = engine.prepare(engine.plan(prompt, ctx[q]), reserve=max_new_tokens)
        ttft, parts = None, []
        for delta in engine.stream(prep, gen):
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(delta)
        total = time.perf_counter() - t0
        return {"answer": "".join(parts), "ttft_s": ttft if ttft is not None else total, "total_s": total,
                "tokens": len(prep.token_ids), "cached_tokens": prep.stats.reused_tokens}

    return ask


def markdown(result: dict[str, Any]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    head = ("| clients | questions/s | tokens/s | TTFT p50 (s) | TTFT p90 (s) | errors (429) | hit rate | same answer "
            "| in-process tokens/s | HTTP / in-process |")
    lines = [f"`kvrag bench load --http` {result['url']}: model {result['model']}, method {result['method']}, "
             f"top-k {result['top_k']}, {result['max_new_tokens']} new tokens, {result['questions_per_client']} "
             "questions per client", "", head, "|" + "---:|" * 10]
    for lv in result["levels"]:
        ip = lv.get("in_process") or {}
        lines.append(f"| {lv['clients']} | {lv['questions_per_s']:.2f} | {lv['tokens_per_s']:.1f} | "
                     f"{f(lv['ttft_p50_s'], '.2f')} | {f(lv['ttft_p90_s'], '.2f')} | {lv['errors']} "
                     f"({lv['rejected_429']}) | {f(lv['hit_rate'], '.2f')} | {lv['same_answer_rate']:.2f} | "
                     f"{f(ip.get('tokens_per_s'), '.1f')} | {f(lv.get('http_over_in_process'), '.2f')} |")
    b = result.get("burst")
    if b:
        lines += ["", "| burst | wall | one by one | speedup | TTFT p50 | TTFT p99 | errors | same answer |",
                  "|" + "---:|" * 8,
                  f"| {b['clients']} | {b['wall_s']:.2f} s | {b['sequential_s']:.2f} s | {b['speedup']:.2f}x | "
                  f"{f(b['ttft_p50_s'], '.2f')} s | {f(b['ttft_p99_s'], '.2f')} s | {b['errors']} | "
                  f"{b['same_answer_rate']:.2f} |"]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--http``'s own options (the others are ``kvrag bench load``'s)."""
    parser.add_argument("--http", default=None, metavar="URL",
                        help="measure a kvrag serve endpoint over HTTP instead (e.g. http://127.0.0.1:8000); "
                             "'local' starts one in this process and compares with the in-process engine")


__all__ = ["add_arguments", "markdown", "paragraphs", "retrieve", "run", "run_level", "stream_chat"]
