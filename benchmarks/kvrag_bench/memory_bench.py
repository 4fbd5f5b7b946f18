"""``kvrag bench memory``: peak memory and disk of a GGUF model in kvrag beside llama.cpp on the same file and ids.

For each ``--gguf`` file (default: the embedded SmolLM2 Q4_1), each system runs in a fresh process of its own, the
two taking turns ``--rounds`` times (a busy machine slows them alike):

* kvrag: ``load_model(file)`` with kvrag's defaults (weights resident in the file's blocks, :mod:`kvrag.gguf_load`),
  then one answer of ``--new-tokens`` greedy tokens with ``full`` on a QA prompt of the passages of ``--data``'s first
  row (or the sample documents), cut to about ``--context`` tokens. Peak RSS (the kernel's high-water mark,
  ``VmHWM``) is read right after that answer; then the passages are ingested, a one-passage ``stale`` request
  caches the template's prefix (as a server's first request does once), and the same prompt is answered with
  ``stale`` (its TTFT reported, every cache ready; ingest is not part of the peak). Also recorded: the resident
  memory before the model (the imports), once it is loaded, and the high-water mark of the load alone;
* llama.cpp (llama-cpp-python, when installed): the same file, the prompt's token ids from kvrag's plan prefilled
  (its TTFT), then greedy steps one token at a time; peak RSS the same way.

Disk besides the file: the bytes kvrag keeps in its prepared folder for the file (config, tokenizer, tensor table);
llama.cpp keeps none. Writes ``memory.json`` and ``memory.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvrag_bench.report import writing_main

log = logging.getLogger(__name__)

SAMPLE_DOCS = Path(__file__).resolve().parents[2] / "examples" / "data"
QUESTION = "Which ticket should a visitor buy for three days of trams and ferries?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", default="default",
                   help="comma-separated GGUF files ('default': the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--data", default=None, help="QA JSONL whose first row's passages make the prompt (default: the "
                                                "sample documents)")
    p.add_argument("--context", type=int, default=1536, help="prompt tokens, about (passages cut to fit)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens of the answer")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per system, taking turns")
    p.add_argument("--peer", default="auto", choices=("auto", "llama.cpp", "none"),
                   help="llama.cpp on the same file (auto: when llama-cpp-python is installed)")
    p.add_argument("--out", default="runs/memory")


def _status_mb(*keys: str) -> dict[str, float]:
    """Fields of ``/proc/self/status`` (kB there) in MB; empty where the file does not exist."""
    status = Path("/proc/self/status")
    out: dict[str, float] = {}
    for line in status.read_text().splitlines() if status.exists() else []:
        key, _, rest = line.partition(":")
        if key in keys:
            out[key] = int(rest.split()[0]) / 1024
    return out


def rss_parts_mb() -> dict[str, float]:
    """This process's resident memory now, in MB: anonymous (heap, tensors) and file-backed (mapped files, such as
    a GGUF's pages; clean, so the kernel can reclaim them under memory pressure)."""
    return {f"{k[3:].lower()}_rss_mb": v for k, v in _status_mb("RssAnon", "RssFile").items()}


def _peak_rss_mb() -> float:
    peak = _status_mb("VmHWM").get("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _passages(data: str | None, tokenizer: Any, budget: int) -> tuple[list[str], str]:
    if data:
        from kvrag_bench.data import load_requests

        req = load_requests(data, limit=1)[0]
        texts, question = req.passages(), req.question
    else:
        texts = [p.read_text(encoding="utf-8") + "\n\n" for p in sorted(SAMPLE_DOCS.glob("0*.md"))]
        question = QUESTION
    out: list[str] = []
    used = 0
    while used < budget and texts:
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            if used + len(ids) > budget:
                t = tokenizer.decode(ids[: max(0, budget - used)])
            out.append(t)
            used += len(ids)
            if used >= budget:
                break
    return out, question


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def child_kvrag(gguf: str, data: str | None, context: int, new_tokens: int, threads: int) -> dict[str, Any]:
    """One process: load, a short warm-up answer (the step backends' one-time checks), one ``full`` answer (peak RSS
    then; decode is its mean time a token), then ``stale`` after ingesting the passages and caching the prefix."""
    import torch

    from kvrag.config import GenerationConfig
    from kvrag.default_model import DEFAULT_MODEL, prepare_default_model, prepare_gguf
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.kv.gguf_quant import resident_bytes
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag.store import MemoryStore

    torch.set_num_threads(threads)
    t = time.perf_counter()
    default = gguf == "default"
    imports = _status_mb("VmRSS").get("VmRSS")
    lm = load_model(None if default else gguf)
    load_s = time.perf_counter() - t
    loaded, load_peak = _status_mb("VmRSS").get("VmRSS"), _peak_rss_mb()
    folder = prepare_default_model(progress=False) if default else prepare_gguf(gguf, progress=False)
    eng = KVRAGEngine(lm, MemoryStore())
    passages, question = _passages(data, lm.tokenizer, context)
    prefix, passages, suffix = get_template(None).parts(lm.tokenizer, passages, question)
    plan = eng.plan_parts(prefix, passages, suffix)
    gen = GenerationConfig(max_new_tokens=new_tokens)
    warm = eng.prepare(eng.plan_parts(prefix, passages[:1], suffix), "full", reserve=4)  # one-time step checks
    "".join(eng.stream(warm, GenerationConfig(max_new_tokens=4)))
    prep = eng.prepare(plan, "full", reserve=new_tokens)
    t = time.perf_counter()
    text = "".join(eng.stream(prep, gen))
    decode_s = time.perf_counter() - t
    tokens = len(prep.token_ids)
    peak = _peak_rss_mb()
    eng.ingest(passages, progress=False)
    first = eng.prepare(eng.plan_parts(prefix, passages[:1], suffix), "stale", reserve=1)  # caches the prefix
    "".join(eng.stream(first, GenerationConfig(max_new_tokens=1)))
    stale = eng.prepare(eng.plan_parts(prefix, passages, suffix), "stale", reserve=new_tokens)  # all cached now
    "".join(eng.stream(stale, GenerationConfig(max_new_tokens=1)))
    return {"system": "kvrag", "model": DEFAULT_MODEL if default else gguf, "load_s": load_s,
            "peak_rss_mb": peak, "disk_mb": _dir_bytes(folder) / 2**20, "prompt_ids": list(plan.token_ids),
            "ttft_s": prep.timings.ttft_s, "decode_ms": 1000 * decode_s / max(1, tokens - 1), "tokens": tokens,
            "stale_ttft_s": stale.timings.ttft_s, "text": text, "dtype": str(lm.dtype).replace("torch.", ""),
            "quantize": lm.quantize, "resident_mb": resident_bytes(lm.model) / 2**20,
            "imports_rss_mb": imports, "loaded_rss_mb": loaded, "load_peak_rss_mb": load_peak}


def child_llama(gguf: str, ids: list[int], new_tokens: int, threads: int, batch: int = 512) -> dict[str, Any]:
    """One process: llama.cpp loads the file, answers a short warm-up, prefills ``ids`` ``batch`` tokens per call
    (TTFT) and decodes greedily one token at a time (decode: the mean time a token, as kvrag's side)."""
    import llama_cpp
    import numpy as np

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_batch=batch,
                          n_ubatch=batch, n_ctx=len(ids) + new_tokens + 16, verbose=False)
    load_s = time.perf_counter() - t

    def greedy() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))

    llm.eval(ids[:64])  # a warm-up answer, as kvrag's side has
    for _ in range(3):
        llm.eval([greedy()])
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    token = greedy()
    ttft = time.perf_counter() - t
    times = []
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        llm.eval([token])
        token = greedy()
        times.append(time.perf_counter() - t)
    return {"system": "llama.cpp", "llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "load_s": load_s,
            "peak_rss_mb": _peak_rss_mb(), "disk_mb": 0.0, "ttft_s": ttft, "prefill_batch": batch,
            "decode_ms": 1000 * statistics.fmean(times), "tokens": new_tokens}


def _llama(payload: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's run; where its batched prefill crashes (a llama-cpp-python build whose batched CPU kernels
    fault), the prefill one token per call instead, flagged: its TTFT is then not comparable, its memory and decode
    still are."""
    try:
        return _spawn("llama", payload)
    except RuntimeError as e:
        log.warning("llama.cpp's batched prefill failed (%s); prefilling one token per call", str(e)[:200])
        got = _spawn("llama", {**payload, "batch": 1})
        got["ttft_s_note"] = "prefill one token per call: its batched prefill crashed in this build"
        return got


def _spawn(kind: str, payload: dict[str, Any], module: str = __name__) -> dict[str, Any]:
    """Run ``child_<kind>(**payload)`` of ``module`` in a fresh interpreter; its JSON result."""
    here = Path(__file__).resolve().parents[1]
    code = (f"import json, sys; from {module} import child_{kind} as f; "
            "r = f(**json.loads(sys.argv[1])); print('\\nRESULT ' + json.dumps(r))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], capture_output=True, text=True, env=env,
                          check=False, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        msg = f"the {kind} process failed ({proc.returncode}): {proc.stderr[-2000:]}"
        raise RuntimeError(msg)
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


def _gguf_path(name: str) -> str:
    if name != "default":
        return str(Path(name).expanduser().resolve())
    from kvrag.default_model import default_gguf_path

    return str(default_gguf_path())


def _llama_available(peer: str) -> bool:
    if peer == "none":
        return False
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if peer == "llama.cpp":
            raise SystemExit("--peer llama.cpp needs llama-cpp-python: pip install 'kvrag-bench[peers]'") from None
        return False
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvrag_bench.provenance import machine_info

    threads = args.threads or 1
    peer = _llama_available(args.peer)
    files: list[dict[str, Any]] = []
    for name in [g.strip() for g in str(args.gguf).split(",") if g.strip()]:
        path = _gguf_path(name)
        runs: dict[str, list[dict[str, Any]]] = {"kvrag": [], "llama.cpp": []}
        for r in range(args.rounds):
            got = _spawn("kvrag", {"gguf": name, "data": args.data, "context": args.context,
                                   "new_tokens": args.new_tokens, "threads": threads})
            runs["kvrag"].append(got)
            if peer:
                runs["llama.cpp"].append(_llama({"gguf": path, "ids": got["prompt_ids"],
                                                 "new_tokens": args.new_tokens, "threads": threads}))
            print(f"{Path(path).name} round {r + 1}: " + "; ".join(
                f"{k} {v[-1]['peak_rss_mb']:.0f} MB, TTFT {v[-1]['ttft_s']:.2f} s, {v[-1]['decode_ms']:.1f} ms/tok"
                for k, v in runs.items() if v), flush=True)
        summary = {k: _summarize(v) for k, v in runs.items() if v}
        for v in runs["kvrag"]:
            v.pop("prompt_ids", None)
        files.append({"file": path, "file_mb": Path(path).stat().st_size / 2**20,
                      "prompt_tokens": summary["kvrag"]["prompt_tokens"], "summary": summary, "runs": runs})
    return {"threads": threads, "context": args.context, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "data": args.data, "files": files,
            "machine": machine_info("cpu", files[0]["runs"]["kvrag"][0]["dtype"] if files else "float32")}


def _summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {k: med(k) for k in ("peak_rss_mb", "disk_mb", "ttft_s", "decode_ms", "stale_ttft_s", "load_s",
                               "imports_rss_mb", "loaded_rss_mb", "load_peak_rss_mb")}
    out["prompt_tokens"] = len(runs[0].get("prompt_ids", [])) or None
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"## Memory, disk and speed of a GGUF file: kvrag vs llama.cpp ({result['threads']} thread(s), "
             f"{result['rounds']} fresh processes each, medians)", "",
             "| file | system | peak RSS MB | disk besides the file MB | `full` TTFT s | decode ms/token | "
             "`stale` TTFT s |", "|---|---|---:|---:|---:|---:|---:|"]
    for f in result["files"]:
        s = f["summary"]
        for system, v in s.items():
            def cell(key: str, fmt: str, v: dict[str, Any] = v) -> str:
                return "-" if v.get(key) is None else format(v[key], fmt)

            lines.append(f"| {Path(f['file']).name} ({f['file_mb']:.0f} MB, {f['prompt_tokens']} prompt tokens) | "
                         f"{system} | {cell('peak_rss_mb', '.0f')} | {cell('disk_mb', '.1f')} | {cell('ttft_s', '.2f')}"
                         f" | {cell('decode_ms', '.1f')} | {cell('stale_ttft_s', '.2f')} |")
        if "llama.cpp" in s:
            k, p = s["kvrag"], s["llama.cpp"]
            if any(r.get("prefill_batch") == 1 for r in f["runs"]["llama.cpp"]):
                lines.append("| | | llama.cpp's TTFT: prefill one token per call (its batched prefill crashed in "
                             "this llama-cpp-python build); not comparable | | | | |")
            lines.append(f"| | kvrag / llama.cpp | {k['peak_rss_mb'] / p['peak_rss_mb']:.2f}x | "
                         f"{k['disk_mb'] / f['file_mb']:.1%} of the file | {k['ttft_s'] / p['ttft_s']:.2f}x | "
                         f"{k['decode_ms'] / p['decode_ms']:.2f}x | {k['stale_ttft_s'] / p['ttft_s']:.2f}x |")
    lines += ["", "Each process answers a short warm-up request first; decode ms/token is the mean over the timed answer's "
              "tokens (kvrag: speculative steps included)."]
    for f in result["files"]:
        k = f["summary"].get("kvrag", {})
        if k.get("loaded_rss_mb") is not None:
            lines.append(f"{Path(f['file']).name}, kvrag's resident memory: {k['imports_rss_mb']:.0f} MB before the model "
                         f"(Python, torch, transformers, kvrag), {k['loaded_rss_mb']:.0f} MB loaded ({k['load_peak_rss_mb']:.0f}"
                         f" MB at the load's peak), {k['peak_rss_mb']:.0f} MB at the peak with the answer.")
    return "\n".join(lines)


main = writing_main("memory", run, markdown)


__all__ = ["add_arguments", "child_kvrag", "child_llama", "main", "markdown", "run"]
