"""``kvrag bench`` command line: the QA benchmark and its ``sweep``, ``store``, ``load`` and ``templates`` subcommands.

Mounted into the ``kvrag`` console script through the ``kvrag.cli_plugins`` entry point ``bench``
(:func:`add_bench_arguments`); also runnable alone as ``python -m kvrag_bench.cli bench ...``. Options of a
subcommand go after its name (``kvrag bench sweep --lengths 1024,2048``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import sys
from typing import Any

from kvrag.errors import ConfigError, KVRAGError

log = logging.getLogger(__name__)

DEFAULT_METHODS = "full,stale"


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(float(x)) for x in s.split(",") if x.strip()]
    except ValueError as e:
        msg = f"expected a comma-separated list of integers, got {s!r}"
        raise argparse.ArgumentTypeError(msg) from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model id or path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: kvrag's for this machine, docs/dtype.md)")
    if "--quantize" not in p._option_string_actions:  # `decode` takes a list of formats instead
        p.add_argument("--quantize", default="default",
                       help="weights of the decode-sized products: none, int8, int4 (default: kvrag's choice)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; use 1 on a shared, oversubscribed CPU)")
    p.add_argument("--seed", type=int, default=0, help="torch and bootstrap seed")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_qa_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, help="QA JSONL (id, question, answers, contexts[{title, text}])")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests (after --offset)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N requests of the file")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated method specs, e.g. full,stale,relaxkv:r=0.15,cacheblend:r=0.15,epic:k=16 "
                        "(parameters of one method are separated by ',' too: a token with '=' belongs to the "
                        "method before it)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    from kvrag.prompting import DEFAULT_TEMPLATE, TEMPLATES

    p.add_argument("--template", default=None,
                   help=f"prompt template name: {', '.join(TEMPLATES)} (default: {DEFAULT_TEMPLATE})")
    p.add_argument("--out", default="runs/bench", help="output directory (resumable)")
    p.add_argument("--peer", default=None, choices=["llamaindex-hf"], help="also run a peer stack on the same prompts")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (0: no intervals)")
    p.add_argument("--kl-tokens", type=int, default=32, help="teacher-forced positions for KL")
    p.add_argument("--store", default="memory://?max_bytes=4e9", help="KV store URL for the chunk caches")
    p.add_argument("--chunk-prefix", choices=["none", "template"], default="template")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests")
    p.add_argument("--overwrite", action="store_true", help="discard earlier results in --out instead of resuming")
    p.add_argument("--no-plots", action="store_true")
    _add_model_args(p)


def _pinned(func: Any) -> Any:
    """``func`` with the commit it runs pinned first (:func:`kvrag_bench.provenance.run_git_sha`), so a result file
    written at the end of a long run names the commit the run started on, not one made while it ran."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> Any:
        from kvrag_bench.provenance import run_git_sha

        run_git_sha()
        return func(args)

    return run


def _module_command(sub: Any, name: str, module: Any, help_: str, description: str) -> None:
    """A ``kvrag bench`` subcommand whose module brings its options (``add_arguments``) and runner (``main``),
    with the model options every command shares."""
    p = sub.add_parser(name, help=help_, description=description)
    module.add_arguments(p)
    _add_model_args(p)
    p.set_defaults(func=_pinned(module.main))


def add_bench_arguments(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` (with ``sweep``, ``store``, ``load``, ``templates``) to a top-level ``add_subparsers()`` object.

    Every parser sets ``func`` (``func(args) -> int``).
    """
    p = subparsers.add_parser(
        "bench", help="QA benchmark of the fusion methods (and sweep / store / templates subcommands)",
        description="Benchmark fusion methods on multi-document QA: F1/EM, KL vs full, KV error, cache-ready TTFT.",
    )
    _add_qa_args(p)
    p.set_defaults(func=_pinned(run_bench))
    sub = p.add_subparsers(dest="bench_command", metavar="{sweep,store,load,chat,decode,memory,big-model,speculate,quant-kl,kv-kl,llamaindex-kl,dtype-kl,ingest,templates,plot,fit-auto,merge}")

    s = sub.add_parser("sweep", help="TTFT and memory vs context length and vs chunk count, every method")
    s.add_argument("--data", default=None, help="QA JSONL whose passages supply the text (default: built-in text)")
    s.add_argument("--methods", default=DEFAULT_METHODS)
    s.add_argument("--lengths", type=_int_list, default=[1024, 2048, 4096, 8192],
                   help="chunk text tokens at a fixed chunk count (the template's own tokens, ~240, come on top)")
    s.add_argument("--chunks", type=int, default=8, help="chunk count of the length sweep")
    s.add_argument("--chunk-counts", type=_int_list, default=[1, 2, 4, 8, 16, 32],
                   help="chunk counts of the fixed-content sweep")
    s.add_argument("--content-tokens", type=int, default=2048, help="chunk text tokens of the chunk-count sweep")
    s.add_argument("--repeats", type=int, default=3, help="timed repeats per point (the median is reported)")
    s.add_argument("--out", default="runs/sweep")
    s.add_argument("--overwrite", action="store_true")
    _add_model_args(s)
    s.set_defaults(func=_pinned(run_sweep))

    st = sub.add_parser("store", help="read/write throughput of each store backend and bytes per token per codec")
    st.add_argument("--backends", default="memory,file", help="comma-separated: memory,file,tiered,redis")
    st.add_argument("--codecs", default="native,float16,bfloat16,int8")
    st.add_argument("--redis-url", default=None, help="redis URL for the redis / tiered backends")
    st.add_argument("--dir", default=None, help="directory for the file backend (default: a temp dir under --out)")
    st.add_argument("--chunks", type=int, default=32, help="chunks written and read per backend and codec")
    st.add_argument("--chunk-tokens", type=int, default=256)
    st.add_argument("--repeats", type=int, default=3)
    st.add_argument("--out", default="runs/store")
    _add_model_args(st)
    st.set_defaults(func=_pinned(run_store))

    ld = sub.add_parser("load", help="1, 2, 4, 8 concurrent clients through a LlamaIndex query engine and an LCEL chain",
                        description="Concurrent clients through a stock LlamaIndex streaming query engine and a stock "
                                    "LangChain LCEL chain over the sample documents, one engine batching them: "
                                    "questions/s, tokens/s, TTFT p50/p90, decode ms/token, same-answer rate vs "
                                    "sequential, and the batched decode step at batch 1 and 8 vs the weight-read "
                                    "bound; JSON, markdown and a plot.")
    from kvrag_bench import load_sweep

    load_sweep.add_arguments(ld)
    from kvrag_bench import http_load, interleave

    http_load.add_arguments(ld)
    interleave.add_arguments(ld)
    ld.set_defaults(func=_pinned(run_load))

    from kvrag_bench import big_model, chat_bench, decode_bench, kv_kl, memory_bench, quant_kl, spec_bench

    _module_command(sub, "chat", chat_bench, "a 10-turn chat over dev passages: TTFT per turn, reused vs recomputed history",
                    "Ask dev questions one turn after another (fixed or changing passages in the system message), each "
                    "prompt answered with the answered turns' KV reused and with the history recomputed: TTFT per "
                    "turn, tokens reused, same answers.")

    _module_command(sub, "decode", decode_bench,
                    "ms per generated token vs context and batch: dense, int8, int4, llama.cpp",
                    "The engine's batched decode step at each context length and batch in each weight format "
                    "(interleaved), beside the bytes-read bound (bytes one step reads / copy bandwidth, measured in "
                    "the same run) and llama.cpp on the same GGUF file and token ids when llama-cpp-python is "
                    "installed (the `peers` extra).")
    _module_command(sub, "memory", memory_bench,
                    "peak RSS, disk besides the file, TTFT and decode of a GGUF file: kvrag vs llama.cpp",
                    "Each system in fresh processes taking turns: load the GGUF file and answer one QA prompt "
                    "(peak RSS then), kvrag with its defaults (weights resident in the file's blocks) and llama.cpp "
                    "on the same token ids when llama-cpp-python is installed; plus the bytes kvrag keeps beside "
                    "the file and `stale`'s TTFT.")
    _module_command(sub, "big-model", big_model,
                    "an 8B-shaped Q4_K_M GGUF (random weights, built here): peak RSS and stale TTFT vs llama.cpp",
                    "Write Llama-3.1-8B's shapes with random float16 weights (gguf), quantize them to Q4_K_M "
                    "(llama.cpp's llama_model_quantize), ingest a ~2K-token prompt's passages in one process, then "
                    "load and answer with `stale` in a fresh one (peak RSS, TTFT) beside llama.cpp's full prefill "
                    "of the same ids. Needs ~25 GB of disk while building (the float16 file is deleted after).")
    _module_command(sub, "quant-kl", quant_kl,
                    "KL(dense || quantized) of the next token along the dense answer, on dev data",
                    "Prefill and greedily decode each request with dense weights, then teacher-force each variant "
                    "(int4, int8, or another dtype) along that answer: next-token KL at every answer position and "
                    "whether the variant's own greedy answer is the same.")
    _module_command(sub, "kv-kl", kv_kl,
                    "KL(compute-dtype K/V || narrower K/V) of the next token along the answer, on dev data",
                    "Prefill each request once, decode it greedily over K/V in the compute dtype, and teacher-force "
                    "rows over each narrower K/V dtype (EngineConfig.kv_dtype) along that answer: next-token KL at "
                    "every answer position and whether the narrower row's own greedy answer is the same.")
    _module_command(sub, "speculate", spec_bench,
                    "speculative decoding from the prompt on QA answers vs plain and llama.cpp",
                    "Answer QA requests with each speculative_tokens setting in turn (0: plain decoding): decode "
                    "ms/token, tokens per forward, drafts accepted, same tokens as plain decoding; llama.cpp on the "
                    "same GGUF and prompt ids when installed.")

    lk = sub.add_parser("llamaindex-kl", help="next-token KL vs full on the prompts a stock LlamaIndex query engine sends",
                        description="Record the LLM calls of a stock LlamaIndex query engine (default prompts; "
                                    "compact / refine / tree_summarize) over an index of dev passages, then compare "
                                    "each method's next-token distribution with full prefill on the same prompts.")
    lk.add_argument("--data", required=True, help="dev QA JSONL")
    lk.add_argument("--rows", type=int, default=20, help="questions (their passages form the index)")
    lk.add_argument("--offset", type=int, default=0)
    lk.add_argument("--methods", default="stale,cacherepair", help="comma-separated method specs (vs full)")
    lk.add_argument("--response-modes", default="compact,refine", help="LlamaIndex response modes")
    lk.add_argument("--top-k", type=int, default=5)
    lk.add_argument("--out", default="runs/llamaindex-kl")
    _add_model_args(lk)
    lk.set_defaults(func=_pinned(run_llamaindex_kl))

    dk = sub.add_parser("dtype-kl", help="KL(float32 full || bf16 full) of the next token on dev data",
                        description="Load the model in float32 and in --dtype, prefill every request in full with "
                                    "both, compare the next-token distributions (KL, top-1) and the prefill time.")
    dk.add_argument("--data", required=True, help="dev QA JSONL")
    dk.add_argument("--limit", type=int, default=8)
    dk.add_argument("--offset", type=int, default=0)
    dk.add_argument("--out", default="runs/dtype-kl")
    _add_model_args(dk)
    dk.set_defaults(func=_pinned(run_dtype_kl), dtype="bfloat16")

    t = sub.add_parser("templates", help="choose the prompt template by full-prefill F1 on dev data")
    t.add_argument("--data", required=True)
    t.add_argument("--limit", type=int, default=60)
    t.add_argument("--offset", type=int, default=0)
    t.add_argument("--candidates", default="all", help="comma-separated template names or 'all'")
    t.add_argument("--max-new-tokens", type=int, default=32)
    t.add_argument("--bootstrap", type=int, default=1000)
    t.add_argument("--out", default="runs/templates")
    _add_model_args(t)
    t.set_defaults(func=_pinned(run_templates))

    ig = sub.add_parser("ingest", help="chunks/s of one-at-a-time vs batched vs Ray-distributed ingest",
                        description="Ingest the same corpus chunks in every mode (interleaved per slice), then check "
                                    "every chunk is served and stale answers hit every cache.")
    ig.add_argument("--data", required=True, help="corpus JSONL (rows with passages [+ titles], or text)")
    ig.add_argument("--limit", type=int, default=1000, help="chunks ingested by every mode")
    ig.add_argument("--modes", default="serial,batched", help="comma-separated: serial, batched, ray:N")
    ig.add_argument("--batch-size", type=int, default=None, help="chunks per forward (default: kvrag's default)")
    ig.add_argument("--rounds", type=int, default=4, help="slices; the modes alternate per slice")
    ig.add_argument("--store", default=None,
                    help="base store URL (each mode gets a fresh dir / key prefix); 'redis-cluster' starts a local "
                         "3-master Redis Cluster; default: a temporary directory")
    ig.add_argument("--answers", type=int, default=10, help="stale answers per mode for the hit-rate check")
    ig.add_argument("--codec", default="native", help="storage codec of every mode's store (native, float16, int8 ...)")
    ig.add_argument("--out", default="runs/ingest")
    _add_model_args(ig)
    ig.set_defaults(func=_pinned(run_ingest))

    pl = sub.add_parser("plot", help="one KL (or F1) vs TTFT/TTFT_full chart over several runs' summary.json")
    pl.add_argument("runs", nargs="+", help="NAME=PATH/summary.json (or a run directory) per run")
    pl.add_argument("--metric", choices=["kl", "f1"], default="kl")
    pl.add_argument("--out", required=True, help="PNG path")
    pl.set_defaults(func=_pinned(run_plot))

    fa = sub.add_parser("fit-auto", help="fit the cost model of the `auto` method from a finished run's summary.json")
    fa.add_argument("summary", help="a kvrag bench --out directory or its summary.json")
    fa.add_argument("--out", required=True, help="cost-model JSON to write (kvrag/data/auto_cost.json ships)")
    fa.add_argument("--machine-kind", default=None,
                    help="machine kind the run was measured on (default: the summary's hardware.machine_kind)")
    fa.add_argument("--dtype", default=None, help="compute dtype of the run (default: the summary's dtype)")
    fa.set_defaults(func=_pinned(run_fit_auto))

    mg = sub.add_parser("merge", help="one summary from runs that split one request list between processes "
                        "(e.g. one per core, side by side)")
    mg.add_argument("runs", nargs="+", help="kvrag bench --out directories (same methods and template)")
    mg.add_argument("--out", required=True, help="directory for the merged summary.json / summary.md / plots")
    mg.add_argument("--bootstrap", type=int, default=1000)
    mg.set_defaults(func=_pinned(run_merge))
    return p


def run_merge(args: argparse.Namespace) -> int:
    """``kvrag bench merge``: concatenate disjoint runs' request rows into one summary (no model is loaded)."""
    from kvrag_bench.merge import merge_runs

    s = merge_runs(args.out, args.runs, n_boot=args.bootstrap)
    print(f"{s['n_requests']} requests from {len(args.runs)} runs -> {args.out}/summary.md")
    return 0


def run_fit_auto(args: argparse.Namespace) -> int:
    """``kvrag bench fit-auto``: per-method stats, overhead and KL from a run, for ``auto`` (no model loaded)."""
    import json
    from pathlib import Path

    from kvrag.fusion.auto import fit_cost_model

    p = Path(args.summary)
    if p.is_dir():
        p = p / "summary.json"
    if not p.is_file():
        raise ConfigError(f"{p} not found: pass a kvrag bench --out directory or its summary.json")
    model = fit_cost_model(json.loads(p.read_text()), source=str(p), machine_kind=args.machine_kind,
                           dtype=args.dtype)
    Path(args.out).write_text(json.dumps(model, indent=2, sort_keys=True) + "\n")
    for spec, m in sorted(model["methods"].items(), key=lambda kv: kv[1]["ttft_ratio"]):
        print(f"{spec:24s} TTFT/full {m['ttft_ratio']:.3f}  FLOP share {m['flop_share']:.3f}  "
              f"overhead {m['overhead']:.2f} (p90 {m['overhead_p90']:.2f})  KL {m['kl']:.4f}")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """``kvrag bench plot``: a combined Pareto chart from finished runs (no model is loaded)."""
    import json
    from pathlib import Path

    from kvrag_bench.plots import combined_pareto

    runs = []
    for spec in args.runs:
        name, eq, path = spec.partition("=")
        p = Path(path if eq else name)
        if p.is_dir():
            p = p / "summary.json"
        if not p.is_file():
            raise ConfigError(f"{p} not found: pass NAME=PATH where PATH is a kvrag bench --out directory or its summary.json")
        runs.append((name if eq else p.parent.name, json.loads(p.read_text())))
    print(combined_pareto(runs, args.out, metric=args.metric))
    return 0


def _setup(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kvrag.threads import set_torch_threads

    set_torch_threads(getattr(args, "threads", None))


def run_bench(args: argparse.Namespace) -> int:
    """``kvrag bench``: the QA benchmark."""
    from kvrag_bench.aggregate import summary_markdown
    from kvrag_bench.config import BenchConfig, split_method_specs
    from kvrag_bench.runner import QABenchmark

    if not args.data:
        print("error: kvrag bench needs --data QA.jsonl (one request a line: id, question, answers, "
              "contexts[{title, text}]); a small sample is benchmarks/data/qa_tiny.jsonl of the kvrag repository",
              file=sys.stderr)
        return 2
    _setup(args)
    if args.peer:
        from kvrag_bench.peer import peer_available

        if not peer_available(args.peer):
            print(f"error: peer {args.peer} needs `pip install llama-index-core llama-index-llms-huggingface`",
                  file=sys.stderr)
            return 2
    cfg = BenchConfig(
        data=args.data, out=args.out, methods=split_method_specs(args.methods), limit=args.limit, offset=args.offset,
        model=args.model, template=args.template, max_new_tokens=args.max_new_tokens, kl_tokens=args.kl_tokens,
        seed=args.seed, bootstrap=args.bootstrap, peer=args.peer, store=args.store, chunk_prefix=args.chunk_prefix,
        warmup=args.warmup, threads=args.threads, device=args.device, dtype=args.dtype, quantize=args.quantize,
        overwrite=args.overwrite, plots=not args.no_plots, progress=not args.no_progress,
    )
    bench = QABenchmark(cfg)
    for spec in bench.skipped:
        print(f"warning: skipping method {spec!r}: not a registered fusion method", file=sys.stderr)
    try:
        summary = bench.run()
    finally:  # join the engine's runner thread (also on Ctrl-C): a daemon thread still inside a torch kernel at
        # interpreter exit aborts the process ("terminate called without an active exception", exit 134)
        if bench._engine is not None:
            bench._engine.close(cancel=True, timeout=30)
    for spec, why in bench.skip_reasons.items():
        if why != "not a registered fusion method":
            print(f"warning: skipped method {spec!r}: {why}", file=sys.stderr)
    print(summary_markdown(summary))
    plots = "" if getattr(args, "no_plots", False) else ", pareto_*.png"
    print(f"results in {args.out}/ (results.jsonl, summary.json, summary.md{plots})", file=sys.stderr)
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    """``kvrag bench sweep``."""
    from kvrag_bench.config import split_method_specs
    from kvrag_bench.sweep import SweepConfig
    from kvrag_bench.sweep import run_sweep as _run

    _setup(args)
    cfg = SweepConfig(
        methods=split_method_specs(args.methods), data=args.data, lengths=args.lengths, chunks=args.chunks,
        chunk_counts=args.chunk_counts, content_tokens=args.content_tokens, repeats=args.repeats, out=args.out,
        model=args.model, device=args.device, dtype=args.dtype, threads=args.threads, seed=args.seed,
        overwrite=args.overwrite, progress=not args.no_progress,
    )
    result = _run(cfg)
    from kvrag_bench.sweep import sweep_markdown

    print(sweep_markdown(result))
    print(f"results in {args.out}/ (sweep.jsonl, sweep.json, sweep.md, sweep_*.png)", file=sys.stderr)
    return 0


def run_store(args: argparse.Namespace) -> int:
    """``kvrag bench store``."""
    from kvrag_bench.store_bench import StoreBenchConfig, run_store_bench, store_markdown

    _setup(args)
    cfg = StoreBenchConfig(
        backends=[b.strip() for b in args.backends.split(",") if b.strip()],
        codecs=[c.strip() for c in args.codecs.split(",") if c.strip()],
        redis_url=args.redis_url, dir=args.dir, chunks=args.chunks, chunk_tokens=args.chunk_tokens,
        repeats=args.repeats, out=args.out, model=args.model, seed=args.seed, progress=not args.no_progress,
    )
    result = run_store_bench(cfg)
    print(store_markdown(result))
    print(f"results in {args.out}/ (store.json, store.md)", file=sys.stderr)
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    """``kvrag bench ingest``."""
    from kvrag_bench.ingest_bench import IngestBenchConfig, ingest_markdown, run_ingest_bench

    _setup(args)
    cfg = IngestBenchConfig(
        data=args.data, limit=args.limit, modes=[m.strip() for m in args.modes.split(",") if m.strip()],
        batch_size=args.batch_size, rounds=args.rounds, store=args.store, answers=args.answers, codec=args.codec,
        out=args.out,
        model=args.model, threads=args.threads or 1, seed=args.seed, progress=not args.no_progress,
    )
    result = run_ingest_bench(cfg)
    print(ingest_markdown(result))
    print(f"results in {args.out}/ (ingest.json, ingest.md)", file=sys.stderr)
    return 0


def _llamaindex_harness(command: str, module: str) -> Any:
    """A harness module that drives a LlamaIndex query engine, or a clear error naming what to install."""
    import importlib

    try:
        importlib.import_module("llama_index.llms.kvrag")
        importlib.import_module("llama_index.postprocessor.kvrag")
        importlib.import_module("llama_index.embeddings.huggingface")
    except ImportError as e:
        msg = (f"`kvrag bench {command}` needs the LlamaIndex integrations: pip install "
               "-e integrations/llama-index-llms-kvrag -e integrations/llama-index-postprocessor-kvrag "
               "llama-index-embeddings-huggingface (or `make bench`); " + str(e))
        raise ImportError(msg) from e
    return importlib.import_module(f"kvrag_bench.{module}")


def run_load(args: argparse.Namespace) -> int:
    """``kvrag bench load``; exit status 1 when a request failed or an answer differed from the sequential one."""
    if getattr(args, "http", None):  # against kvrag serve (kvrag_bench.http_load)
        from kvrag_bench import http_load

        res = http_load.run(args)
        print(http_load.markdown(res))
        print(f"results in {res['path']}", file=sys.stderr)
        return 0 if all(lv["errors"] == 0 and lv["same_answer_rate"] == 1.0 for lv in res["levels"]) else 1
    if getattr(args, "interleave", None):  # running streams' ITL while long prepares arrive (kvrag_bench.interleave)
        from kvrag_bench import interleave

        res = interleave.run(args)
        print(interleave.markdown(res))
        print(f"results in {res['path']}", file=sys.stderr)
        return 0
    h = _llamaindex_harness("load", "load_sweep")
    result = h.run_sweep(h.config_from_args(args))
    print(h.markdown(result))
    print(f"results in {result['path']}", file=sys.stderr)
    levels = [lv for fw in result["frameworks"].values() for lv in [*fw["levels"], *([fw["burst"]] if "burst" in fw else [])]]
    return 0 if all(lv["errors"] == 0 and lv["same_answer_rate"] == 1.0 for lv in levels) else 1


def run_llamaindex_kl(args: argparse.Namespace) -> int:
    """``kvrag bench llamaindex-kl``."""
    h = _llamaindex_harness("llamaindex-kl", "prompt_kl")
    PromptKLConfig, markdown, run_prompt_kl = h.PromptKLConfig, h.markdown, h.run_prompt_kl  # noqa: N806

    from kvrag_bench.config import split_method_specs

    _setup(args)
    cfg = PromptKLConfig(
        data=args.data, rows=args.rows, offset=args.offset, methods=split_method_specs(args.methods),
        response_modes=[m.strip() for m in args.response_modes.split(",") if m.strip()], top_k=args.top_k,
        out=args.out, model=args.model, device=args.device, dtype=args.dtype, threads=args.threads,
        progress=not args.no_progress,
    )
    result = run_prompt_kl(cfg, command="kvrag " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    print(markdown(result))
    print(f"results in {result['path']}", file=sys.stderr)
    return 0


def run_dtype_kl(args: argparse.Namespace) -> int:
    """``kvrag bench dtype-kl``."""
    from kvrag_bench.dtype_kl import DtypeKLConfig, markdown
    from kvrag_bench.dtype_kl import run_dtype_kl as _run

    _setup(args)
    cfg = DtypeKLConfig(data=args.data, limit=args.limit, offset=args.offset, dtype=args.dtype or "bfloat16",
                        model=args.model, device=args.device, out=args.out, progress=not args.no_progress)
    print(markdown(_run(cfg, command="kvrag " + " ".join(shlex.quote(a) for a in sys.argv[1:]))))
    return 0


def run_templates(args: argparse.Namespace) -> int:
    """``kvrag bench templates``."""
    from kvrag.config import EngineConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.models import load_model
    from kvrag.prompting import TEMPLATES
    from kvrag.store.memory import MemoryStore
    from kvrag_bench.data import load_requests
    from kvrag_bench.templates import select_template, templates_markdown

    _setup(args)
    names = list(TEMPLATES) if args.candidates in ("all", "") else [c.strip() for c in args.candidates.split(",")]
    reqs = load_requests(args.data, args.limit, args.offset)
    eng = KVRAGEngine(load_model(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize),
                      MemoryStore(), EngineConfig())
    result = select_template(eng, reqs, args.out, names, max_new_tokens=args.max_new_tokens, n_boot=args.bootstrap,
                             seed=args.seed, progress=not args.no_progress)
    print(templates_markdown(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m kvrag_bench.cli bench ...``."""
    parser = argparse.ArgumentParser(prog="kvrag")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_arguments(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (KVRAGError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
