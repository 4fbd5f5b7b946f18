"""``make demo``: a LlamaIndex query engine over the sample documents, answered with several fusion methods.

Builds (once) a FAISS ``VectorStoreIndex`` over ``examples/data`` with every chunk's KV cache computed at indexing
time and persisted beside it, then asks three questions through a stock streaming query engine with
``KVCachedLLM`` and ``KVCachePostprocessor`` for each method (``full``, ``stale``, the engine's default method and
the repair methods that are registered), and prints the answers with the end-to-end time to first token, the cache
hit rate and how many answers are the one ``full`` gives.

The model is the embedded default, SmolLM2-135M-Instruct (135M parameters, from a 4-bit Q4_1 GGUF): small enough
to run anywhere in seconds, so its answers show speed and agreement with ``full``, not answer quality. ``--model``
runs the same demo on your own model (a ``.gguf`` file or a Hugging Face checkpoint folder)::

    python examples/demo.py [--model path/to/model.gguf] [--methods full,stale,relaxkv] [--hf-baseline] [--docs DIR]

``make demo`` runs it (``make demo MODEL=path/to/model.gguf`` passes ``--model``). It needs the kvrag core and the
two LlamaIndex distributions (``llama-index-llms-kvrag``, ``llama-index-postprocessor-kvrag``) with
``llama-index-embeddings-huggingface``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

QUESTIONS = (
    "How much does a day pass cost?",
    "How often does tram line T2 run at peak times?",
    "When does the last boat leave Tamsin Isle?",
)
REPAIR_METHODS = ("relaxkv", "cacherepair")
RERUN_WITH_YOUR_MODEL = "make demo MODEL=path/to/model.gguf"
"""The one command that reruns the demo on another model (a .gguf file or a Hugging Face checkpoint folder)."""
SAME_AS_FULL_NOTE = ("same answer as full: answers word for word equal to full's (exact prefill); it measures "
                     "agreement with full, not whether an answer is right")


def default_docs_dir() -> Path | None:
    """The sample collection ``examples/data`` of the kvrag repository (searched above this file, then the cwd)."""
    for base in (*Path(__file__).resolve().parents, Path.cwd()):
        d = base / "examples" / "data"
        if d.is_dir():
            return d
    return None


def pick_methods(requested: str | None) -> tuple[list[str], list[str]]:
    """(methods to run, notes about skipped ones)."""
    from kvrag.config import DEFAULT_METHOD
    from kvrag.errors import KVRAGError
    from kvrag.fusion import available_methods, get_method

    if requested:
        return [m.strip() for m in requested.split(",") if m.strip()], []
    methods, notes = ["full", "stale", DEFAULT_METHOD], []
    for m in REPAIR_METHODS:
        if m not in available_methods():
            notes.append(f"{m}: not registered")
            continue
        try:
            get_method(m)
        except (KVRAGError, OSError, ImportError) as e:  # e.g. a learned method without trained weights
            notes.append(f"{m}: skipped ({e})")
            continue
        methods.append(m)
    return methods, notes


def streamed_query(query_engine: Any, question: str) -> tuple[str, float, float]:
    """Run a streaming query: (answer, seconds from the call to the first non-empty token, total seconds)."""
    t0 = time.perf_counter()
    resp = query_engine.query(question)
    ttft, parts = None, []
    for delta in resp.response_gen:
        if delta and ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(delta)
    total = time.perf_counter() - t0
    return "".join(parts), ttft if ttft is not None else total, total


def first_token_query(query_engine: Any, question: str) -> tuple[str, float]:
    """Run a streaming query; returns (answer, seconds from the call to the first non-empty token)."""
    answer, ttft, _ = streamed_query(query_engine, question)
    return answer.strip(), ttft


def model_line(model: str | None) -> str:
    """What the demo runs on, in one line: the default model says that its answers are a small model's."""
    if model is None:
        from kvrag.default_model import DEFAULT_MODEL_DESCRIPTION

        return (f"model: {DEFAULT_MODEL_DESCRIPTION}, the embedded default; its answers show speed and agreement "
                "with full, not answer quality")
    return f"model: {model}"


def persist_dir_for(model: str | None) -> Path:
    """KVRAG_HOME/demo/llamaindex for the default model, a sibling per other model (its own caches)."""
    from kvrag.paths import kvrag_home

    base = kvrag_home() / "demo"
    if model is None:
        return base / "llamaindex"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name or model).strip("._") or "model"
    return base / f"llamaindex-{slug}"


def build_or_load(docs_dir: Path, persist: Path, rebuild: bool, model: str | None = None) -> tuple[Any, Any]:
    import shutil

    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.postprocessor.kvrag import build_index, load_index, open_engine

    from kvrag.default_model import default_embedder_path

    if rebuild and persist.exists():
        shutil.rmtree(persist)
    engine = open_engine(persist, model=model)
    embed_model = HuggingFaceEmbedding(model_name=str(default_embedder_path()))
    if (persist / "docstore.json").exists():
        index = load_index(persist, embed_model=embed_model)
        print(f"reloaded the index and {engine.store.stats()['entries']} cached entries from {persist}")
    else:
        t = time.perf_counter()
        docs = SimpleDirectoryReader(str(docs_dir), file_metadata=lambda p: {"source": Path(p).name}).load_data()
        index = build_index(docs, engine=engine, embed_model=embed_model, persist_dir=persist, show_progress=True,
                            transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)])
        print(f"indexed {len(docs)} documents into {len(index.docstore.docs)} chunks and cached them in "
              f"{time.perf_counter() - t:.1f} s ({persist})")
    return engine, index


def _short(text: str, n: int = 90) -> str:
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "\u2026"


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Per method: mean TTFTs, TTFT relative to ``full`` (same questions, same run), hit rate, answers equal to
    ``full``'s."""
    ref = {r["question"]: r for r in rows if r["method"] == "full"}
    ref_ttft = sum(r["ttft_s"] for r in ref.values()) / len(ref) if ref else None
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        llm = [r["engine_ttft_s"] for r in rs if r["engine_ttft_s"] is not None]
        hits = [r["hit_rate"] for r in rs if r["hit_rate"] is not None]
        mean = sum(r["ttft_s"] for r in rs) / len(rs)
        same = [r["answer"].strip() == ref[r["question"]]["answer"].strip() for r in rs if r["question"] in ref]
        out.append({
            "method": method,
            "ttft": f"{1000 * mean:.0f} ms",
            "ttft_vs_full": f"{mean / ref_ttft:.2f}" if ref_ttft else "-",
            "engine_ttft": f"{1000 * sum(llm) / len(llm):.0f} ms" if llm else "-",
            "hit_rate": f"{sum(hits) / len(hits):.2f}" if hits else "-",
            "same_as_full": f"{sum(same)}/{len(same)}" if same else "-",
        })
    return out


def print_tables(rows: Sequence[dict[str, Any]]) -> None:
    summary = summarize(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in rows:
            print(f"{r['method']:<18} {r['ttft_s'] * 1000:>7.0f} ms  {_short(r['question'], 40):<40} {_short(r['answer'])}")
        print()
        for m in summary:
            print(f"{m['method']:<18} TTFT e2e {m['ttft']:>9} ({m['ttft_vs_full']} x full)  TTFT LLM "
                  f"{m['engine_ttft']:>9}  hit rate {m['hit_rate']}  same answer as full {m['same_as_full']}")
        print(SAME_AS_FULL_NOTE)
        return
    console = Console(width=None if sys.stdout.isatty() else 150)
    answers = Table(title="Answers (stock LlamaIndex streaming query engine, top-k chunks from the KV store)")
    for col in ("method", "question", "answer", "TTFT e2e"):
        answers.add_column(col, justify="right" if col == "TTFT e2e" else "left", overflow="fold")
    for r in rows:
        answers.add_row(r["method"], r["question"], _short(r["answer"]), f"{r['ttft_s'] * 1000:.0f} ms")
    console.print(answers)
    table = Table(title="Per method (means over the questions)")
    for col in ("method", "TTFT e2e", "vs full", "TTFT LLM", "hit rate", "same answer as full"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for m in summary:
        table.add_row(m["method"], m["ttft"], m["ttft_vs_full"], m["engine_ttft"], m["hit_rate"], m["same_as_full"])
    console.print(table)
    print(SAME_AS_FULL_NOTE)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(prog="python examples/demo.py",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a .gguf file, a Hugging Face checkpoint folder or a cached Hub id (default: the embedded "
                         "SmolLM2-135M-Instruct)")
    ap.add_argument("--docs", type=Path, default=default_docs_dir(), help="folder of .md/.txt documents")
    ap.add_argument("--persist", type=Path, default=None,
                    help="index + cache folder (default: KVRAG_HOME/demo/llamaindex, one per --model)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated methods (default: full, stale, the engine's default method + repair methods)")
    ap.add_argument("--question", action="append", help="question(s) (default: three about the sample documents)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hf-baseline", action="store_true", help="also time llama-index's HuggingFaceLLM (same model)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the index and caches from scratch")
    args = ap.parse_args(argv)
    if args.docs is None or not args.docs.is_dir():
        ap.error("no documents: pass --docs DIR (the sample collection lives in the repository's examples/data)")
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor

    print(model_line(args.model))
    persist = args.persist or persist_dir_for(args.model)
    engine, index = build_or_load(args.docs, persist, args.rebuild, args.model)
    methods, notes = pick_methods(args.methods)
    questions = args.question or list(QUESTIONS)

    def engine_for(llm: Any) -> Any:
        return index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                                     similarity_top_k=args.top_k, streaming=True)

    # one warm-up query so that one-time costs (first forward, allocator) are not charged to the first method
    first_token_query(engine_for(KVCachedLLM(engine=engine, method="stale", max_new_tokens=2)), questions[0])

    from kvrag.errors import KVRAGError

    engines: dict[str, tuple[Any, Any]] = {}
    for method in methods:
        llm = KVCachedLLM(engine=engine, method=method, max_new_tokens=args.max_new_tokens)
        engines[method] = (llm, engine_for(llm))
    if args.hf_baseline:
        from llama_index.llms.huggingface import HuggingFaceLLM

        hf = HuggingFaceLLM(model=engine.model, tokenizer=engine.tokenizer, is_chat_model=True,
                            max_new_tokens=args.max_new_tokens, generate_kwargs={"do_sample": False},
                            tokenizer_outputs_to_remove=["token_type_ids"], context_window=engine.max_context)
        engines["HuggingFaceLLM"] = (None, engine_for(hf))
    # question by question, every method in a rotating order: load drift on a shared machine hits all alike
    rows, skipped = [], set()
    names = list(engines)
    for i, q in enumerate(questions):
        for method in names[i % len(names):] + names[: i % len(names)]:
            if method in skipped:
                continue
            llm, qe = engines[method]
            try:
                answer, ttft = first_token_query(qe, q)
            except KVRAGError as e:  # e.g. a learned method without a trained repairer for this model
                notes.append(f"{method}: skipped ({e})")
                skipped.add(method)
                continue
            kw = llm.last_info["additional_kwargs"] if llm is not None else {}
            rows.append({"question": q, "method": method, "answer": answer, "ttft_s": ttft,
                         "engine_ttft_s": kw.get("ttft_s"), "hit_rate": kw.get("hit_rate")})
    order = {m: k for k, m in enumerate(names)}
    rows.sort(key=lambda r: order[r["method"]])
    print_tables(rows)
    for n in notes:
        print("note:", n)
    print("TTFT e2e: from query() to the first streamed token (retrieval included); TTFT LLM: inside KVCachedLLM.")
    print(model_line(args.model))
    print(f"Rerun with your own model (a .gguf file or a Hugging Face checkpoint folder): {RERUN_WITH_YOUR_MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
