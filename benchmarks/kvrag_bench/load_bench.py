"""``kvrag bench load``: N concurrent clients x M questions through a stock LlamaIndex query engine.

It needs the LlamaIndex distributions (``llama-index-llms-kvrag``, ``llama-index-postprocessor-kvrag``,
``llama-index-embeddings-huggingface``). The query engine is built the way ``examples/demo.py`` and
``examples/llamaindex_quickstart.py`` build it: a FAISS
``VectorStoreIndex`` over the sample documents (``examples/data``) with every chunk's KV cache computed at indexing
time, and ``index.as_query_engine(llm=KVCachedLLM(...), node_postprocessors=[KVCachePostprocessor(...)],
streaming=True)``. One engine, one LLM and one query engine are shared by all clients, as in a server.

1. Reference: every distinct question is answered once, single-threaded (greedy decoding).
2. Load: ``clients`` threads start together; each asks ``questions`` questions back to back.
3. Checks: no request raised, and every answer equals the single-threaded answer to the same question
   (concurrent requests must not see each other's chunks or KV: no cross-talk).

Reported: throughput (questions/s over the load phase's wall time), TTFT (from ``query()`` to the first streamed
token, retrieval included) and total latency percentiles, the LLM-side TTFT and the cache hit rate. The JSON goes
to ``--out`` (a ``.json`` path, or a directory that receives ``load.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.errors import ConfigError

log = logging.getLogger(__name__)

#: Questions about the sample documents (examples/data); clients cycle through them from different offsets.
QUESTIONS = (
    "How much does a day pass cost?",
    "How often does tram line T2 run at peak times?",
    "When does the last boat leave Tamsin Isle?",
    "Which ferry route carries cars?",
    "How much does a single ticket for zone A cost?",
    "When was MRT created?",
    "Which tram line is the oldest?",
    "Where does night bus N2 go after Brannock?",
    "Which tram stops are not step-free?",
    "How long is the ride on the Kestrel Hill cable car?",
    "How much does it cost to unlock a Spoke bike?",
    "How often does the F1 ferry depart in summer?",
    "Where is the MRT head office?",
    "When will the T3 extension to the airport open?",
    "How many stops does the tram network have?",
    "What does an electric bike cost per minute?",
)


@dataclasses.dataclass
class LoadConfig:
    """Settings of ``kvrag bench load``.

    Attributes:
        clients: concurrent client threads (N).
        questions: questions asked by each client, back to back (M).
        method: fusion method spec used by ``KVCachedLLM``.
        max_new_tokens: answer length cap (greedy decoding).
        top_k: retrieved chunks per question.
        chunk_size: ``SentenceSplitter`` chunk size (tokens of the embedder's tokenizer, as in the demo).
        docs: document folder (default: the repository's ``examples/data``).
        store: KV store URL for the chunk caches.
        pool: question pool (default :data:`QUESTIONS`).
    """

    clients: int = 4
    questions: int = 10
    method: str = "stale"
    max_new_tokens: int = 16
    top_k: int = 2
    chunk_size: int = 256
    docs: str | None = None
    store: str = "memory://"
    out: str = "runs/load"
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    pool: Sequence[str] = QUESTIONS
    progress: bool = True

    def __post_init__(self) -> None:
        if self.clients < 1 or self.questions < 1:
            msg = f"clients and questions must be >= 1, got clients={self.clients}, questions={self.questions}"
            raise ConfigError(msg)
        if self.max_new_tokens < 1 or self.top_k < 1:
            msg = f"max_new_tokens and top_k must be >= 1, got {self.max_new_tokens}, {self.top_k}"
            raise ConfigError(msg)
        if not self.pool or not all(isinstance(q, str) and q.strip() for q in self.pool):
            raise ConfigError("the question pool must hold at least one non-empty question")


def default_docs_dir() -> Path:
    """The sample collection ``examples/data`` of the kvrag repository (searched above this file, then the cwd)."""
    for base in (*Path(__file__).resolve().parents, Path.cwd()):
        d = base / "examples" / "data"
        if d.is_dir():
            return d
    msg = "no documents: pass --docs DIR (the sample collection lives in the repository's examples/data)"
    raise ConfigError(msg)


def schedule(cfg: LoadConfig) -> list[list[str]]:
    """The questions of each client: client c starts at offset c*M in the pool and cycles through it."""
    pool = list(cfg.pool)
    return [[pool[(c * cfg.questions + j) % len(pool)] for j in range(cfg.questions)] for c in range(cfg.clients)]


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (``q`` in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def build_query_engine(engine: Any, embed_model: Any, cfg: LoadConfig) -> tuple[Any, Any, int]:
    """Index the documents (caching every chunk) and return (query engine, its KVCachedLLM, number of nodes)."""
    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor, build_index

    docs_dir = Path(cfg.docs) if cfg.docs else default_docs_dir()
    docs = SimpleDirectoryReader(str(docs_dir), file_metadata=lambda p: {"source": Path(p).name}).load_data()
    index = build_index(docs, engine=engine, embed_model=embed_model, show_progress=cfg.progress,
                        transformations=[SentenceSplitter(chunk_size=cfg.chunk_size, chunk_overlap=0)])
    llm = KVCachedLLM(engine=engine, method=cfg.method, max_new_tokens=cfg.max_new_tokens)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                               similarity_top_k=cfg.top_k, streaming=True)
    return qe, llm, len(index.docstore.docs)


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


def timed_query(qe: Any, llm: Any, question: str) -> dict[str, Any]:
    """One streaming query: answer, TTFT (call -> first non-empty token), total time, LLM-side stats."""
    answer, ttft, total = streamed_query(qe, question)
    info = llm.last_info or {}  # the record made in THIS thread's context
    kw = info.get("additional_kwargs", {})
    return {"answer": answer, "ttft_s": ttft, "total_s": total,
            "llm_ttft_s": kw.get("ttft_s"), "hit_rate": kw.get("hit_rate"), "chunks_found": kw.get("chunks_found"),
            "chunk_keys": info.get("raw", {}).get("chunk_keys", [])}


def _summary(xs: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p95": percentile(xs, 95), "mean": statistics.fmean(xs) if xs else None,
            "max": max(xs) if xs else None}


def run_load(cfg: LoadConfig, *, engine: Any = None, embed_model: Any = None) -> dict[str, Any]:
    """Run the load test; writes the JSON report (see the module docstring) and returns it.

    Args:
        engine: a :class:`~kvrag.engine.engine.KVRAGEngine` to use (default: ``cfg.model`` over ``cfg.store``).
        embed_model: a LlamaIndex embedding model (default: the embedded MiniLM via ``HuggingFaceEmbedding``).
    """
    from tqdm.auto import tqdm

    from kvrag_bench import aggregate

    t_setup = time.perf_counter()
    if engine is None:
        from kvrag.engine.engine import KVRAGEngine

        engine = KVRAGEngine.from_pretrained(cfg.model, cfg.store, device=cfg.device, dtype=cfg.dtype)
    if embed_model is None:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        from kvrag.default_model import default_embedder_path

        embed_model = HuggingFaceEmbedding(model_name=str(default_embedder_path()))
    qe, llm, n_nodes = build_query_engine(engine, embed_model, cfg)
    plan = schedule(cfg)
    distinct = list(dict.fromkeys(q for qs in plan for q in qs))
    setup_s = time.perf_counter() - t_setup

    # 1. single-threaded reference answers (the first also warms up one-time costs)
    t = time.perf_counter()
    reference = {q: timed_query(qe, llm, q) for q in tqdm(distinct, desc="reference", disable=not cfg.progress)}
    reference_s = time.perf_counter() - t

    # 2. the load phase
    rows: list[dict[str, Any]] = []
    rows_lock = threading.Lock()
    start = threading.Barrier(cfg.clients + 1)
    bar = tqdm(total=cfg.clients * cfg.questions, desc="load", disable=not cfg.progress)

    def client(c: int) -> None:
        start.wait()
        for j, q in enumerate(plan[c]):
            row: dict[str, Any] = {"client": c, "index": j, "question": q}
            try:
                row.update(timed_query(qe, llm, q))
                row["error"] = None
            except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the run
                log.exception("client %d question %d failed", c, j)
                row["error"] = f"{type(e).__name__}: {e}"
            row["matches_reference"] = row.get("answer") == reference[q]["answer"]
            with rows_lock:
                rows.append(row)
            bar.update(1)

    threads = [threading.Thread(target=client, args=(c,), name=f"load-client-{c}") for c in range(cfg.clients)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    bar.close()

    rows.sort(key=lambda r: (r["client"], r["index"]))
    ok = [r for r in rows if r["error"] is None]
    errors = [r for r in rows if r["error"] is not None]
    mismatches = [r for r in ok if not r["matches_reference"]]
    hits = [r["hit_rate"] for r in ok if r.get("hit_rate") is not None]
    result = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
        **aggregate.environment_info(),
        "model": engine.loaded.name,
        "model_fingerprint": engine.loaded.fingerprint,
        "store": repr(engine.store),
        "nodes": n_nodes,
        "requests": len(rows),
        "errors": len(errors),
        "mismatches": len(mismatches),
        "ok": not errors and not mismatches and len(rows) == cfg.clients * cfg.questions,
        "wall_s": wall,
        "throughput_qps": len(rows) / wall if wall > 0 else None,
        "ttft_s": _summary([r["ttft_s"] for r in ok]),
        "llm_ttft_s": _summary([r["llm_ttft_s"] for r in ok if r.get("llm_ttft_s") is not None]),
        "latency_s": _summary([r["total_s"] for r in ok]),
        "hit_rate_mean": statistics.fmean(hits) if hits else None,
        "single_threaded": {
            "questions": len(distinct),
            "wall_s": reference_s,
            "ttft_s": _summary([r["ttft_s"] for r in reference.values()]),
            "latency_s": _summary([r["total_s"] for r in reference.values()]),
        },
        "setup_s": setup_s,
        "reference_answers": {q: r["answer"] for q, r in reference.items()},
        "error_samples": [{k: r[k] for k in ("client", "index", "question", "error")} for r in errors[:10]],
        "mismatch_samples": [{"question": r["question"], "answer": r["answer"],
                              "reference": reference[r["question"]]["answer"]} for r in mismatches[:10]],
        "rows": [{k: v for k, v in r.items() if k != "chunk_keys"} for r in rows],
    }
    result = aggregate.jsonable(result)
    out = Path(cfg.out)
    path = out if out.suffix == ".json" else out / "load.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    aggregate.write_text_atomic(path, json.dumps(result, indent=2) + "\n")
    result["path"] = str(path)
    return result


def load_markdown(result: dict[str, Any]) -> str:
    """A short human summary of a :func:`run_load` result."""
    cfg = result["config"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f} ms"

    single = result["single_threaded"]
    lines = [
        f"# Load test: {cfg['clients']} clients x {cfg['questions']} questions ({cfg['method']}, "
        f"{cfg['max_new_tokens']} new tokens, top-{cfg['top_k']})",
        "",
        f"- requests {result['requests']}, errors {result['errors']}, answers differing from single-threaded "
        f"{result['mismatches']} -> {'OK' if result['ok'] else 'FAILED'}",
        f"- throughput {result['throughput_qps']:.2f} questions/s over {result['wall_s']:.1f} s",
        f"- TTFT p50 {ms(result['ttft_s']['p50'])}, p95 {ms(result['ttft_s']['p95'])} (query() to first token); "
        f"LLM-side p50 {ms(result['llm_ttft_s']['p50'])}, p95 {ms(result['llm_ttft_s']['p95'])}",
        f"- latency p50 {ms(result['latency_s']['p50'])}, p95 {ms(result['latency_s']['p95'])}; "
        f"mean hit rate {result['hit_rate_mean']}",
        f"- single-threaded: {single['questions']} questions in {single['wall_s']:.1f} s, TTFT p50 "
        f"{ms(single['ttft_s']['p50'])}",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["QUESTIONS", "LoadConfig", "build_query_engine", "load_markdown", "percentile", "run_load", "schedule"]
