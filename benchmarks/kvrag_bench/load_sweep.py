"""``kvrag bench load``: 1, 2, 4, 8 concurrent clients through a stock LlamaIndex query engine and an LCEL chain.

What it runs (one engine, shared by every client and both frameworks, as in a server):

* **LlamaIndex**: a ``VectorStoreIndex`` over the sample documents (``examples/data``) with every chunk's KV cache
  computed at indexing time, and ``index.as_query_engine(llm=KVCachedLLM(...),
  node_postprocessors=[KVCachePostprocessor(...)], streaming=True)`` -- the README's and the LlamaIndex
  quickstart's query engine.
* **LangChain**: the LCEL chain of ``examples/langchain_quickstart.py``: ``{"context": KVCacheRetriever(FAISS
  retriever) | format_docs, "question": RunnablePassthrough()} | prompt | ChatKVCached``, streamed.

For each framework the distinct questions are first answered one at a time (the reference; it also stores the
caches of chunks a retriever meets for the first time), then for each client count N, N client threads start
together and each asks ``--questions`` questions back to back (closed loop). ``--burst N`` then asks N different
questions at once, against the same N answered one by one right before and right after it (caches warm in both;
the mean of the two is the baseline). Every
level reports questions/s and generated tokens/s over its wall time, TTFT p50/p90 (from the call to the first
streamed text, retrieval included), decode ms/token (the engine's decode time per generated token, per request),
the batch sizes the engine's decode steps ran at, and the same-answer rate vs the reference. Concurrent callers
need nothing special: the engine batches whatever is in flight (:mod:`kvrag.engine.runner`).

Then the decode step itself: ms/token of the engine's batched step at batch 1 and batch 8 over one real prompt's
KV (``--context`` tokens), against the weight-read bound = weight bytes / measured copy bandwidth (a step must read
every weight once; at batch 8 those reads serve 8 tokens).

Writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` (matplotlib) to ``--out``. :func:`add_arguments` and
:func:`main` are the CLI's entry points (``kvrag bench load``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvrag_bench.roofline import copy_bandwidth, step_bytes

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
FRAMEWORKS = ("llamaindex", "langchain")
QUESTIONS = (
    "How much does a day pass cost?",
    "How often does tram line T2 run at peak times?",
    "When does the last boat leave Tamsin Isle?",
    "Which ferry route carries cars?",
    "How much does a single ticket for zone A cost?",
    "Which tram line is the oldest?",
    "Where does night bus N2 go after Brannock?",
    "How long is the ride on the Kestrel Hill cable car?",
    "How much does it cost to unlock a Spoke bike?",
    "How often does the F1 ferry depart in summer?",
    "When will the T3 extension to the airport open?",
    "What does an electric bike cost per minute?",
)
PROMPT = "Answer the question using only this context:\n\n{context}\n\nQuestion: {question}"


@dataclasses.dataclass
class SweepConfig:
    """Settings of the sweep (see :func:`add_arguments` for each one's meaning)."""

    clients: tuple[int, ...] = (1, 2, 4, 8)
    questions: int = 4
    frameworks: tuple[str, ...] = FRAMEWORKS
    method: str = "stale"
    max_new_tokens: int = 32
    top_k: int = 2
    docs: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    runner_threads: int | None = None
    max_batch_size: int = 8
    speculative_tokens: int | None = None
    kv_dtype: str = "auto"
    context: int = 1500
    step_repeats: int = 5
    burst: int = 0
    out: str = "runs/load_sweep"

    def __post_init__(self) -> None:
        from kvrag.errors import ConfigError

        if self.burst < 0:
            raise ConfigError(f"burst must be >= 0 questions (0: no burst), got {self.burst}")
        if not self.clients or min(self.clients) < 1 or self.questions < 1:
            raise ConfigError(f"clients and questions must be >= 1, got {self.clients}, {self.questions}")
        bad = [f for f in self.frameworks if f not in FRAMEWORKS]
        if bad or not self.frameworks:
            raise ConfigError(f"frameworks must be among {list(FRAMEWORKS)}, got {list(self.frameworks)}")


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (``q`` in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------------- the two clients
Ask = Callable[[str], dict[str, Any]]


def _sample(answer: str, t0: float, ttft: float | None, info: dict[str, Any], stamps: Sequence[float] = ()) -> dict[str, Any]:
    """One answer's record; ``stamps``: when each non-empty text delta arrived (for inter-token latency)."""
    total = time.perf_counter() - t0
    timings, tokens = info.get("timings") or {}, info.get("token_ids") or []
    decode = timings.get("decode_s")
    return {"answer": answer, "ttft_s": ttft if ttft is not None else total, "total_s": total, "tokens": len(tokens),
            "decode_ms_per_token": 1000 * decode / len(tokens) if decode and tokens else None,
            "itl_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


def llamaindex_client(engine: Any, cfg: SweepConfig, docs_dir: Path) -> Ask:
    """The stock streaming query engine; ``ask(question)`` -> answer, TTFT, tokens, decode ms/token."""
    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor, build_index

    from kvrag.default_model import default_embedder_path

    docs = SimpleDirectoryReader(str(docs_dir), file_metadata=lambda p: {"source": Path(p).name}).load_data()
    index = build_index(docs, engine=engine, embed_model=HuggingFaceEmbedding(model_name=str(default_embedder_path())),
                        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)])
    llm = KVCachedLLM(engine=engine, method=cfg.method, max_new_tokens=cfg.max_new_tokens)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                               similarity_top_k=cfg.top_k, streaming=True)

    def ask(question: str) -> dict[str, Any]:
        t0, ttft, parts, stamps = time.perf_counter(), None, [], []
        for delta in qe.query(question).response_gen:
            if delta:
                stamps.append(time.perf_counter())
                ttft = stamps[0] - t0
            parts.append(delta)
        info = llm.last_info or {}  # the record made in this thread's context
        return _sample("".join(parts), t0, ttft, info.get("raw", {}), stamps)

    return ask


def langchain_client(engine: Any, cfg: SweepConfig, docs_dir: Path) -> Ask:
    """The quickstart's LCEL chain, streamed; ``ask(question)`` as for :func:`llamaindex_client`."""
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_kvrag import ChatKVCached, KVCacheRetriever, format_docs
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from kvrag.default_model import default_embedder_path

    docs = [Document(page_content=p.read_text(encoding="utf-8"), metadata={"source": p.name})
            for p in sorted(docs_dir.glob("*.md"))]
    splits = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=0).split_documents(docs)
    store = FAISS.from_documents(splits, HuggingFaceEmbeddings(model_name=str(default_embedder_path())))
    retriever = KVCacheRetriever(retriever=store.as_retriever(search_kwargs={"k": cfg.top_k}), engine=engine)
    llm = ChatKVCached(engine=engine, method=cfg.method, max_tokens=cfg.max_new_tokens)
    chain = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
             | ChatPromptTemplate.from_template(PROMPT) | llm)

    def ask(question: str) -> dict[str, Any]:
        t0, ttft, parts, stamps = time.perf_counter(), None, [], []
        meta: dict[str, Any] = {}
        for chunk in chain.stream(question):
            if chunk.content:
                stamps.append(time.perf_counter())
                ttft = stamps[0] - t0
            parts.append(str(chunk.content))
            meta = chunk.response_metadata.get("kvrag") or meta  # the last chunk carries the request's record
        return _sample("".join(parts), t0, ttft, meta, stamps)

    return ask


# ------------------------------------------------------------------------------------------------- the sweep
def run_clients(ask: Callable[[str], dict[str, Any]], questions: Sequence[str], clients: int,
                per_client: int) -> tuple[list[dict[str, Any]], float]:
    """``clients`` threads start together, each asks ``per_client`` questions back to back: (one row per question,
    with ``error`` set where it failed; wall seconds from the common start to the last answer)."""
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        start.wait()
        for j in range(per_client):
            q = questions[(c * per_client + j) % len(questions)]
            try:
                row = {"question": q, **ask(q), "error": None}
            except Exception as e:  # noqa: BLE001 - recorded, counted as a failure
                log.exception("client %d failed", c)
                row = {"question": q, "error": f"{type(e).__name__}: {e}"}
            with lock:
                rows.append(row)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return rows, time.perf_counter() - t0


def run_level(ask: Ask, engine: Any, questions: Sequence[str], clients: int, per_client: int,
              reference: dict[str, str]) -> dict[str, Any]:
    """``clients`` threads start together, each asks ``per_client`` questions back to back."""
    before = engine.runner.stats()
    rows, wall = run_clients(ask, questions, clients, per_client)
    after = engine.runner.stats()
    ok = [r for r in rows if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok]
    itls = [x for r in ok for x in r["itl_s"]]
    per_token = [r["decode_ms_per_token"] for r in ok if r["decode_ms_per_token"] is not None]
    steps = after.get("steps", 0) - before.get("steps", 0)
    return {
        "clients": clients, "requests": len(rows), "errors": len(rows) - len(ok), "wall_s": wall,
        "questions_per_s": len(ok) / wall, "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "decode_ms_per_token": statistics.fmean(per_token) if per_token else None,
        "mean_batch": (after.get("rows_stepped", 0) - before.get("rows_stepped", 0)) / steps if steps else None,
        "same_answer_rate": sum(r["answer"] == reference[r["question"]] for r in ok) / len(ok) if ok else 0.0,
    }


def one_by_one(ask: Ask, questions: Sequence[str]) -> float:
    """Seconds to answer ``questions`` one after another, caches warm (the reference pass stored every chunk the
    questions retrieve, so this baseline pays what a burst pays: no chunk is computed in either)."""
    t = time.perf_counter()
    for q in questions:
        ask(q)
    return time.perf_counter() - t


def against_one_by_one(ask: Ask, questions: Sequence[str], burst: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``burst()`` (``questions`` asked at once; its level record) between two passes of the same questions asked
    one by one: the record with the passes' seconds, their mean and the burst's speed-up over it."""
    before = one_by_one(ask, questions)
    level = burst()
    after = one_by_one(ask, questions)
    level.update(sequential_runs_s=[before, after], sequential_s=(before + after) / 2,
                 speedup=(before + after) / 2 / level["wall_s"])
    return level


def decode_bound(engine: Any, docs_dir: Path, cfg: SweepConfig) -> dict[str, Any]:
    """ms/token of the engine's batched decode step at batch 1 and 8 over one real prompt's KV vs the weight-read
    bound (weight bytes / copy bandwidth)."""
    import torch

    from kvrag.kv import batched, hf_cache
    from kvrag.prompting import RagTemplate, render_passage

    passages, n = [], 0
    for p in sorted(docs_dir.glob("*.md")):
        for para in p.read_text(encoding="utf-8").split("\n\n"):
            if n >= cfg.context or not para.strip():
                continue
            passages.append(render_passage(para))
            n += len(engine.tokenize(passages[-1]))
    engine.ingest(passages)
    prep = engine.prepare(engine.plan_parts(*RagTemplate().parts(engine.tokenizer, passages, QUESTIONS[0])), "stale")
    buf, length = hf_cache.buffer_of(prep.cache)
    weights = step_bytes(engine.model, 1, 0)  # the weights one step reads, in their format (dense or quantized)
    bandwidth = copy_bandwidth()
    bound_ms = 1000 * weights / bandwidth
    out: dict[str, Any] = {"context_tokens": length, "weight_bytes": weights, "copy_bytes_per_s": bandwidth,
                           "weight_read_bound_ms": bound_ms}
    for b in (1, 8):
        rows = []
        for _ in range(b):
            layers, kv_heads, _, head_dim = buf.keys.shape
            copy = hf_cache.KVBuffer(layers, kv_heads, head_dim, length + cfg.step_repeats + 2, buf.keys.dtype,
                                     buf.keys.device)
            copy.keys[:, :, :length].copy_(buf.keys[:, :, :length])
            copy.values[:, :, :length].copy_(buf.values[:, :, :length])
            rows.append(batched.Row(copy, length))
        toks, times = [int(prep.last_logits.argmax())] * b, []
        for i in range(cfg.step_repeats + 1):
            with hf_cache.model_lock(engine.model):
                t = time.perf_counter()
                batched.decode_step(engine.model, rows, toks, batched.windows(engine.model))
                hf_cache.sync(engine.model.device)
                if i:  # the first step warms up
                    times.append(time.perf_counter() - t)
            for r in rows:
                r.length += 1
        step_ms = 1000 * statistics.median(times)
        out[f"batch{b}"] = {"step_ms": step_ms, "ms_per_token": step_ms / b, "x_bound": step_ms / b / bound_ms}
    out["torch_threads"] = torch.get_num_threads()
    return out


def command_line(cfg: SweepConfig) -> str:
    """The ``kvrag bench load`` command that reruns ``cfg`` (the options that differ from the defaults)."""
    defaults = SweepConfig()
    words = ["kvrag bench load"]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "out" or value == getattr(defaults, field.name):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        words.append(f"--{field.name.replace('_', '-')} {shown}")
    return " ".join(words)


def run_sweep(cfg: SweepConfig, engine: Any = None) -> dict[str, Any]:
    """The whole sweep (see the module docstring); writes sweep.json / .md / .png under ``cfg.out``."""
    import torch

    from kvrag.engine.engine import KVRAGEngine
    from kvrag_bench.provenance import environment_info

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    docs_dir = Path(cfg.docs) if cfg.docs else DATA
    if engine is None:
        spec: dict[str, Any] = {} if cfg.speculative_tokens is None else {"speculative_tokens": cfg.speculative_tokens}
        if cfg.runner_threads:  # the runner on its own threads, the clients (retrieval, embedding) on one each
            spec["runner_threads"] = cfg.runner_threads
            torch.set_num_threads(1)
        engine = KVRAGEngine.from_pretrained(cfg.model, "memory://", device=cfg.device, dtype=cfg.dtype,
                                             max_batch_size=cfg.max_batch_size, kv_dtype=cfg.kv_dtype, **spec)
    builders = {"llamaindex": llamaindex_client, "langchain": langchain_client}
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg), "model": engine.loaded.name,
                              "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
                              "frameworks": {}}
    questions = list(QUESTIONS)
    for fw in cfg.frameworks:
        ask = builders[fw](engine, cfg, docs_dir)
        needed = {questions[i % len(questions)] for i in range(max(max(cfg.clients) * cfg.questions, cfg.burst))}
        t = time.perf_counter()
        reference = {q: ask(q) for q in questions if q in needed}
        seq = {"wall_s": time.perf_counter() - t, "ttft_p50_s": percentile([r["ttft_s"] for r in reference.values()], 50)}
        answers = {q: r["answer"] for q, r in reference.items()}
        levels = [run_level(ask, engine, questions, n, cfg.questions, answers) for n in cfg.clients]
        result["frameworks"][fw] = {"sequential": seq, "levels": levels}
        if cfg.burst:  # N different questions at once, one each, against the same N answered one by one
            burst_questions = [questions[i % len(questions)] for i in range(cfg.burst)]
            burst = against_one_by_one(ask, burst_questions,
                                       functools.partial(run_level, ask, engine, questions, cfg.burst, 1, answers))
            result["frameworks"][fw]["burst"] = burst
            log.info("%s burst of %d: %.2fx the sequential speed, same answers %.0f%%", fw, cfg.burst,
                     burst["speedup"], 100 * burst["same_answer_rate"])
        for lv in levels:
            log.info("%s %d clients: %.2f q/s, TTFT p50 %.2f s, same answers %.0f%%", fw, lv["clients"],
                     lv["questions_per_s"], lv["ttft_p50_s"] or 0, 100 * lv["same_answer_rate"])
    result["decode"] = decode_bound(engine, docs_dir, cfg)
    result["command"] = command_line(cfg)
    result["environment"] = environment_info()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "sweep.md").write_text(markdown(result))
    plot(result, out / "sweep.png")
    result["path"] = str(out)
    return result


def markdown(result: dict[str, Any]) -> str:
    """The sweep as tables: one row per framework and client count, then the decode step vs its bound."""
    cfg = result["config"]
    lines = [f"# Load sweep: {result['model']} ({result['dtype']}), {cfg['method']}, {cfg['max_new_tokens']} new "
             f"tokens, {cfg['questions']} questions per client", "",
             "| framework | clients | q/s | tokens/s | TTFT p50 | TTFT p90 | decode ms/token | mean batch | same answer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for fw, data in result["frameworks"].items():
        for lv in data["levels"]:
            lines.append(f"| {fw} | {lv['clients']} | {lv['questions_per_s']:.2f} | {lv['tokens_per_s']:.1f} | "
                         f"{f(lv['ttft_p50_s'], '.2f')} s | {f(lv['ttft_p90_s'], '.2f')} s | "
                         f"{f(lv['decode_ms_per_token'], '.1f')} | {f(lv['mean_batch'], '.2f')} | "
                         f"{100 * lv['same_answer_rate']:.0f}% |")
    bursts = [(fw, data["burst"]) for fw, data in result["frameworks"].items() if data.get("burst")]
    if bursts:
        lines += ["", "| framework | burst | wall | one by one | speedup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | "
                  "same answer |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for fw, b in bursts:
            ms = lambda x: "-" if x is None else f"{1000 * x:.0f} ms"  # noqa: E731
            lines.append(f"| {fw} | {b['clients']} | {b['wall_s']:.2f} s | {b['sequential_s']:.2f} s | "
                         f"{b['speedup']:.2f}x | {f(b['ttft_p50_s'], '.2f')} s | {f(b['ttft_p99_s'], '.2f')} s | "
                         f"{ms(b['itl_p50_s'])} | {ms(b['itl_p99_s'])} | {100 * b['same_answer_rate']:.0f}% |")
    d = result["decode"]
    lines += ["", f"Decode step at {d['context_tokens']} context tokens ({d['torch_threads']} torch threads): weight "
              f"read bound {d['weight_read_bound_ms']:.1f} ms ({d['weight_bytes'] / 1e6:.0f} MB at "
              f"{d['copy_bytes_per_s'] / 1e9:.1f} GB/s); batch 1 {d['batch1']['ms_per_token']:.1f} ms/token "
              f"({d['batch1']['x_bound']:.1f}x), batch 8 {d['batch8']['ms_per_token']:.1f} ms/token "
              f"({d['batch8']['x_bound']:.1f}x)."]
    env = result.get("environment") or {}
    hw = env.get("hardware") or {}
    if result.get("command"):
        lines += ["", f"`{result['command']}` -- commit `{str(env.get('git_sha') or '?')[:7]}`, CPU {hw.get('cpu', '?')} "
                  f"(bf16: {hw.get('cpu_bf16') or 'none'}), {hw.get('cores', '?')} cores."]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Questions/s, TTFT p50/p90 and decode ms/token against clients, per framework; the decode step vs its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for fw, data in result["frameworks"].items():
        lv = data["levels"]
        n = [x["clients"] for x in lv]
        axes[0].plot(n, [x["questions_per_s"] for x in lv], "o-", label=fw)
        axes[1].plot(n, [x["ttft_p50_s"] for x in lv], "o-", label=f"{fw} p50")
        axes[1].plot(n, [x["ttft_p90_s"] for x in lv], "x--", label=f"{fw} p90")
        axes[2].plot(n, [x["decode_ms_per_token"] for x in lv], "o-", label=fw)
    for ax, title in zip(axes[:3], ("questions/s", "TTFT (s)", "decode ms/token"), strict=True):
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend(fontsize=7)
    d = result["decode"]
    axes[3].bar(["batch 1", "batch 8"], [d["batch1"]["ms_per_token"], d["batch8"]["ms_per_token"]])
    axes[3].axhline(d["weight_read_bound_ms"], color="k", ls="--", label="weight-read bound (batch 1)")
    axes[3].set_title("decode step, ms/token")
    axes[3].legend(fontsize=7)
    fig.suptitle(f"{result['model']} ({result['dtype']}), {result['config']['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options (``kvrag bench load``)."""
    d = SweepConfig()
    parser.add_argument("--clients", default=",".join(map(str, d.clients)),
                        help="comma-separated concurrent client counts (default 1,2,4,8)")
    parser.add_argument("--questions", type=int, default=d.questions, help="questions per client, back to back")
    parser.add_argument("--frameworks", default=",".join(d.frameworks), help="llamaindex and/or langchain")
    parser.add_argument("--method", default=d.method, help="fusion method spec")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--top-k", type=int, default=d.top_k, help="retrieved chunks per question")
    parser.add_argument("--docs", default=None, help="document folder (default: examples/data)")
    parser.add_argument("--model", default=None, help="model (default: the embedded default model)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the device's)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--runner-threads", type=int, default=None,
                        help="the engine runner's torch threads (EngineConfig.runner_threads), every other thread on "
                             "one, as `kvrag serve` runs (default: --threads for every thread)")
    parser.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="EngineConfig.max_batch_size")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="EngineConfig.speculative_tokens (default: the engine's; 0: plain decoding)")
    parser.add_argument("--kv-dtype", default=d.kv_dtype, help="EngineConfig.kv_dtype (auto, bfloat16, int8, ...)")
    parser.add_argument("--context", type=int, default=d.context, help="context tokens of the decode-step check")
    parser.add_argument("--burst", type=int, default=d.burst,
                        help="also N different questions at once (one each) vs the same N one by one: questions/s, "
                             "speedup, TTFT and inter-token latency p50/p99 (default 0: no burst)")
    parser.add_argument("--out", default=d.out, help="output folder")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(
        clients=tuple(int(x) for x in str(args.clients).split(",") if x.strip()), questions=args.questions,
        frameworks=tuple(x.strip() for x in str(args.frameworks).split(",") if x.strip()), method=args.method,
        max_new_tokens=args.max_new_tokens, top_k=args.top_k, docs=args.docs, model=args.model, dtype=args.dtype,
        device=args.device, threads=args.threads, runner_threads=getattr(args, "runner_threads", None),
        max_batch_size=args.max_batch_size,
        speculative_tokens=getattr(args, "speculative_tokens", None), kv_dtype=getattr(args, "kv_dtype", "auto"),
        context=args.context,
        burst=getattr(args, "burst", 0) or 0, out=args.out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep from command-line arguments; prints the markdown summary. Returns 0 when every answer equals
    the sequential one and no request failed, else 1."""
    parser = argparse.ArgumentParser(prog="kvrag bench load", description=__doc__.splitlines()[0])
    add_arguments(parser)
    result = run_sweep(config_from_args(parser.parse_args(argv)))
    print(markdown(result))
    print(f"written to {result['path']}")
    levels = [lv for fw in result["frameworks"].values() for lv in [*fw["levels"], *([fw["burst"]] if "burst" in fw else [])]]
    return 0 if all(lv["errors"] == 0 and lv["same_answer_rate"] == 1.0 for lv in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["SweepConfig", "add_arguments", "command_line", "config_from_args", "decode_bound", "main", "markdown", "plot",
           "run_sweep"]
