"""``kvrag bench llamaindex-kl``: next-token KL(full || method) on the prompts a stock LlamaIndex query engine sends.

The question it answers: how close is each method to full prefill on the prompts users actually send, i.e. with
LlamaIndex's *default* prompts (text-QA for ``compact``, refine, tree-summarize) and their own lead text before the
first chunk, rather than kvrag's benchmark template.

1. A FAISS ``VectorStoreIndex`` over the passages of the selected dev rows (one node per passage, its title in the
   metadata, so LlamaIndex renders ``title: ...`` above the text as it would for any document), built with
   :func:`~llama_index.postprocessor.kvrag.build_index` (every chunk cached at indexing time).
2. For each row's question and each response mode: ``index.as_query_engine(llm=KVCachedLLM(...),
   node_postprocessors=[KVCachePostprocessor(...)], response_mode=...)``; every LLM call the synthesizer makes is
   recorded (its prompt and registered chunks; one new token, ``stale``, so recording is cheap).
3. Each recorded call is prepared again with ``full`` and with every method on the same plan, and the next-token
   distributions are compared: KL(full || method) in nats and top-1 agreement with full.

It needs the LlamaIndex distributions (``llama-index-llms-kvrag``, ``llama-index-postprocessor-kvrag``,
``llama-index-embeddings-huggingface``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvrag.errors import ConfigError


@dataclasses.dataclass
class PromptKLConfig:
    """Settings of ``kvrag bench llamaindex-kl``.

    Attributes:
        data: dev QA JSONL (the benchmark's format: question, answers, contexts with titles).
        rows: how many rows (questions); their passages together form the index.
        offset: first row.
        methods: method specs compared with ``full``.
        response_modes: LlamaIndex response modes (``compact`` uses the default text-QA prompt; ``refine`` and
            ``tree_summarize`` their own defaults).
        top_k: nodes retrieved per question.
        out: output directory (gets ``llamaindex_kl.json`` and ``llamaindex_kl.md``).
    """

    data: str
    rows: int = 20
    offset: int = 0
    methods: Sequence[str] = ("stale", "cacherepair")
    response_modes: Sequence[str] = ("compact", "refine")
    top_k: int = 5
    out: str = "runs/llamaindex-kl"
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    progress: bool = True


def _nodes(requests: Sequence[Any]) -> list[Any]:
    from llama_index.core.schema import TextNode

    seen: dict[tuple[str, str], Any] = {}
    for r in requests:
        for title, text in r.contexts:
            seen.setdefault((title, text), TextNode(text=text, metadata={"title": title}))
    return list(seen.values())


def record_calls(engine: Any, embed_model: Any, cfg: PromptKLConfig, requests: Sequence[Any]) -> list[dict[str, Any]]:
    """Run every question through a stock query engine per response mode; returns the LLM calls made."""
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor, build_index
    from tqdm.auto import tqdm

    index = build_index(nodes=_nodes(requests), engine=engine, embed_model=embed_model, show_progress=cfg.progress)
    llm = KVCachedLLM(engine=engine, method="stale", max_new_tokens=1, history_size=256)
    calls: list[dict[str, Any]] = []
    todo = [(mode, r) for mode in cfg.response_modes for r in requests]
    for mode, r in tqdm(todo, desc="llamaindex queries", unit="query", disable=not cfg.progress):
        qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                                   similarity_top_k=cfg.top_k, response_mode=mode)
        before = len(llm.history)
        qe.query(r.question)
        for i, rec in enumerate(llm.history[before:]):
            calls.append({"row": r.id, "mode": mode, "call": i, "prompt": rec["prompt"], "chunks": rec["chunks"]})
    return calls


def compare(engine: Any, calls: Sequence[dict[str, Any]], methods: Sequence[str], progress: bool = True) -> list[dict[str, Any]]:
    """KL(full || method) and top-1 agreement of the next-token distribution for every recorded call."""
    from tqdm.auto import tqdm

    from kvrag_bench.metrics import kl_divergence

    rows = []
    for c in tqdm(calls, desc="compare", unit="call", disable=not progress):
        plan = engine.plan(c["prompt"], c["chunks"])
        t = time.perf_counter()
        ref = engine.prepare(plan, "full", reserve=1)
        row: dict[str, Any] = {k: c[k] for k in ("row", "mode", "call")}
        row.update(context_tokens=plan.context_len, chunks=plan.found, registered=plan.registered,
                   full_ttft_s=time.perf_counter() - t)
        for m in methods:
            t = time.perf_counter()
            got = engine.prepare(plan, m, reserve=1)  # prepare = time to the first token's logits
            row[m] = {"kl": float(kl_divergence(ref.last_logits, got.last_logits)),
                      "top1": bool(int(ref.last_logits.argmax()) == int(got.last_logits.argmax())),
                      "ttft_s": time.perf_counter() - t, "hit_rate": got.stats.hit_rate}
        rows.append(row)
    return rows


def summarize(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    modes = sorted({r["mode"] for r in rows})
    for mode in [*modes, "all"]:
        sel = [r for r in rows if mode in ("all", r["mode"])]
        if not sel:
            continue
        per: dict[str, Any] = {}
        stale_kl = statistics.fmean(r["stale"]["kl"] for r in sel) if "stale" in methods else None
        for m in methods:
            kls = [r[m]["kl"] for r in sel]
            mean = statistics.fmean(kls)
            per[m] = {"calls": len(sel), "kl_mean": mean, "kl_median": statistics.median(kls),
                      "kl_vs_stale": (mean / stale_kl) if stale_kl else None,
                      "top1_agreement": statistics.fmean(float(r[m]["top1"]) for r in sel),
                      "ttft_vs_full": statistics.median(r[m]["ttft_s"] / r["full_ttft_s"] for r in sel)}
        out[mode] = {"methods": per, "context_tokens_median": statistics.median(r["context_tokens"] for r in sel),
                     "chunks_found_mean": statistics.fmean(r["chunks"] for r in sel)}
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Next-token KL(full || method) on the prompts a stock LlamaIndex query engine sends "
             f"(default prompts; {result['config']['rows']} dev questions from row {result['config']['offset']}, "
             f"top_k {result['config']['top_k']}).", "",
             "| response mode | method | LLM calls | context tokens (median) | KL mean | KL median | KL / stale | "
             "top-1 = full | TTFT / full |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, s in result["summary"].items():
        for m, v in s["methods"].items():
            ratio = "" if v["kl_vs_stale"] is None else f"{v['kl_vs_stale']:.2f}"
            lines.append(f"| {mode} | `{m}` | {v['calls']} | {s['context_tokens_median']:.0f} | {v['kl_mean']:.4f} | "
                         f"{v['kl_median']:.4f} | {ratio} | {v['top1_agreement']:.2f} | {v['ttft_vs_full']:.3f} |")
    lines += ["", f"Machine: {result['machine']}; command: `{result['command']}`."]
    return "\n".join(lines) + "\n"


def run_prompt_kl(cfg: PromptKLConfig, *, engine: Any = None, embed_model: Any = None,
                  command: str = "") -> dict[str, Any]:
    """Record the calls, compare the methods, write ``llamaindex_kl.json`` / ``.md`` under ``cfg.out``."""
    from kvrag_bench import aggregate
    from kvrag_bench.data import load_requests

    if cfg.rows < 1:
        msg = f"rows must be >= 1, got {cfg.rows}"
        raise ConfigError(msg)
    if "stale" not in cfg.methods:
        cfg.methods = ("stale", *cfg.methods)  # the yardstick every ratio is against
    if engine is None:
        from kvrag.engine.engine import KVRAGEngine

        engine = KVRAGEngine.from_pretrained(cfg.model, store="memory://", device=cfg.device, dtype=cfg.dtype)
    if embed_model is None:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        from kvrag.default_model import default_embedder_path

        embed_model = HuggingFaceEmbedding(model_name=str(default_embedder_path()))
    for m in cfg.methods:
        engine.method(m)  # resolve every spec before the long part (a bad spec or a missing checkpoint fails now)
    requests = load_requests(cfg.data, limit=cfg.rows, offset=cfg.offset)
    t0 = time.perf_counter()
    calls = record_calls(engine, embed_model, cfg, requests)
    rows = compare(engine, calls, list(cfg.methods), cfg.progress)
    result = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        "summary": summarize(rows, list(cfg.methods)),
        "rows": rows,
        **aggregate.environment_info(),
        "command": command,
        "seconds": time.perf_counter() - t0,
    }
    hw = result["hardware"]
    result["machine"] = f"{hw['cpu']}, {hw['cores']} cores, {engine.spec.dtype}, torch threads {hw['torch_threads']}"
    result["path"] = str(aggregate.write_result(cfg.out, "llamaindex_kl", result, markdown(result)))
    return result


__all__ = ["PromptKLConfig", "compare", "markdown", "record_calls", "run_prompt_kl", "summarize"]
