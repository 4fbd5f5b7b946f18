"""``kvrag bench speculate``: speculative decoding from the prompt on real QA answers, beside plain decoding and
llama.cpp on the same GGUF file and prompt ids.

Per request (the bench's prompt template over the request's passages, method ``--method``, greedy, ``--max-new-
tokens``), the settings of ``--speculate`` (``EngineConfig.speculative_tokens``; 0 = plain decoding) take turns on
one loaded model and one chunk store, so a busy machine slows them alike. Recorded per answer: decode time (after
the first token), generated tokens, decode forwards, drafted and accepted tokens, and whether the tokens equal the
first setting's. With ``llama-cpp-python`` installed (kvrag-bench's ``peers`` extra) and a GGUF model, llama.cpp
decodes the same number of tokens after prefilling the same prompt ids (its greedy tokens are its own: it runs
the file's weights in its own kernels).

Writes ``speculate.json`` and ``speculate.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from kvrag_bench.report import writing_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="QA JSONL (id, question, answers, contexts[{title, text}])")
    p.add_argument("--offset", type=int, default=0, help="skip the first N requests")
    p.add_argument("--limit", type=int, default=12, help="requests to answer")
    p.add_argument("--method", default="stale", help="fusion method spec of every answer")
    p.add_argument("--speculate", default="0,4", help="speculative_tokens settings to compare (0: plain decoding)")
    p.add_argument("--ngram", type=int, default=3, help="speculative_ngram: longest answer suffix looked up")
    p.add_argument("--min-ngram", type=int, default=2, help="speculative_min_ngram: shortest answer suffix looked up")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--template", default=None, help="prompt template name (default: the selected default)")
    p.add_argument("--peer", default="auto", choices=("auto", "llama.cpp", "none"),
                   help="llama.cpp on the same GGUF (auto: when llama-cpp-python is installed and the model is one)")
    p.add_argument("--out", default="runs/speculate")


def _peer(args: argparse.Namespace, n_ctx: int, threads: int) -> Any:
    if args.peer == "none":
        return None
    from kvrag_bench.decode_bench import LlamaCppPeer, _gguf_of

    gguf = _gguf_of(args.model)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if args.peer == "llama.cpp":
            raise SystemExit("--peer llama.cpp needs llama-cpp-python: pip install 'kvrag-bench[peers]'") from None
        return None
    if gguf is None:
        if args.peer == "llama.cpp":
            raise SystemExit("--peer llama.cpp needs a GGUF model (the embedded default or a .gguf path)")
        return None
    return LlamaCppPeer(gguf, n_ctx, threads)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvrag.config import EngineConfig, GenerationConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.kv.quant import quantization_of
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag.store import MemoryStore
    from kvrag_bench.data import load_requests
    from kvrag_bench.provenance import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [int(x) for x in str(args.speculate).split(",") if x.strip()]
    if not settings or min(settings) < 0:
        raise SystemExit(f"--speculate takes non-negative integers, got {args.speculate!r}")
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
    store = MemoryStore()
    engines = {k: KVRAGEngine(loaded, store, EngineConfig(speculative_tokens=k, speculative_ngram=args.ngram,
                                                           speculative_min_ngram=min(args.min_ngram, args.ngram)))
               for k in settings}
    template = get_template(args.template)
    requests = load_requests(args.data, limit=args.limit, offset=args.offset)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    first = engines[settings[0]]
    peer = _peer(args, n_ctx=4096, threads=torch.get_num_threads())
    rows: list[dict[str, Any]] = []
    for i, req in enumerate(requests):
        prefix, passages, suffix = template.parts(first.tokenizer, req.passages(), req.question)
        first.ingest(passages, progress=False)
        plan = first.plan_parts(prefix, passages, suffix)  # the engines share the model, tokenizer and store
        row: dict[str, Any] = {"id": req.id, "context_tokens": plan.total_len}
        base: list[int] | None = None
        for k in settings:  # the settings take turns on each request
            eng = engines[k]
            prep = eng.prepare(plan, args.method, reserve=gen.max_new_tokens)
            t = time.perf_counter()
            text = "".join(eng.stream(prep, gen))
            dt = time.perf_counter() - t
            s = prep.stats
            toks = list(prep.token_ids)
            base = toks if base is None else base
            row[str(k)] = {"decode_s": dt, "ttft_s": prep.timings.ttft_s, "tokens": len(toks),
                           "forwards": s.decode_forwards, "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
                           "same_tokens": toks == base, "text": text}
        if peer is not None and base:
            _, first_token = peer.prefill(list(plan.token_ids))
            times = peer.steps(first_token, max(1, len(base) - 1))
            row["llama.cpp"] = {"ms_per_token": 1000 * statistics.median(times)}
        rows.append(row)
        print(f"[{i + 1}/{len(requests)}] " + "  ".join(
            f"k={k}: {1000 * row[str(k)]['decode_s'] / max(1, row[str(k)]['tokens'] - 1):.1f} ms/tok "
            f"{row[str(k)]['tokens']}/{max(1, row[str(k)]['forwards'] or 0)} tok/fwd" for k in settings), flush=True)
    summary: dict[str, Any] = {}
    for k in settings:
        cells = [r[str(k)] for r in rows]
        dec = sum(c["decode_s"] for c in cells)
        after_first = sum(max(0, c["tokens"] - 1) for c in cells)
        fwd = sum(c["forwards"] or 0 for c in cells)
        summary[str(k)] = {
            "ms_per_token": 1000 * dec / max(1, after_first),
            "tokens_per_forward": after_first / max(1, fwd),
            "acceptance": sum(c["accepted"] or 0 for c in cells) / max(1, sum(c["drafted"] or 0 for c in cells)),
            "same_tokens": sum(bool(c["same_tokens"]) for c in cells),
            "answer_p50_s": statistics.median(c["decode_s"] + (c["ttft_s"] or 0.0) for c in cells),
        }
    if any("llama.cpp" in r for r in rows):
        summary["llama.cpp"] = {"ms_per_token": statistics.median(r["llama.cpp"]["ms_per_token"] for r in rows
                                                                  if "llama.cpp" in r)}
    dtype = next(loaded.model.parameters()).dtype
    return {"model": loaded.name, "dtype": str(dtype).replace("torch.", ""),
            "quantize": args.quantize, "method": args.method, "max_new_tokens": args.max_new_tokens,
            "requests": len(rows), "data": str(args.data), "offset": args.offset, "ngram": [args.min_ngram, args.ngram],
            "torch_threads": torch.get_num_threads(), "quantization": quantization_of(loaded.model) or "none",
            "machine": machine_info(loaded.device, dtype), "summary": summary, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"{result['model']}, {result['machine']['kind']}, {result['dtype']}, weights {result['quantization']}, method {result['method']}, "
             f"{result['requests']} requests of {result['data']} from row {result['offset']}, "
             f"{result['max_new_tokens']} new tokens, {result['torch_threads']} thread(s)", "",
             "| speculative_tokens | decode ms/token | tokens per forward | drafts accepted | same tokens as first | "
             "TTFT + answer p50 (s) |", "|---|---:|---:|---:|---:|---:|"]
    for k, c in s.items():
        if k == "llama.cpp":
            continue
        lines.append(f"| {k} | {c['ms_per_token']:.1f} | {c['tokens_per_forward']:.2f} | {c['acceptance']:.0%} | "
                     f"{c['same_tokens']}/{result['requests']} | {c['answer_p50_s']:.2f} |")
    if "llama.cpp" in s:
        lines.append(f"| llama.cpp (same GGUF, same prompt ids) | {s['llama.cpp']['ms_per_token']:.1f} | 1.00 | | | |")
    return "\n".join(lines)


main = writing_main("speculate", run, markdown)


__all__ = ["add_arguments", "main", "markdown", "run"]
