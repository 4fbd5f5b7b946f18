"""``kvrag bench big-model``: a real-size GGUF (Llama-3.1-8B's shapes, random weights) in kvrag beside llama.cpp.

No 8B file ships with kvrag and nothing is downloaded, so the benchmark writes one: Llama-3.1-8B's shapes (32
layers, hidden 4096, 32 query / 8 key-value heads, MLP 14336, vocabulary 128256, untied output head; RoPE base
500000 without its long-context scaling) with random float16 weights, written tensor by tensor with the ``gguf``
package (16 GB, never held in memory), then quantized to Q4_K_M by llama.cpp's own ``llama_model_quantize``
(llama-cpp-python) and the float16 file deleted. Its tokenizer is the embedded SmolLM2 file's byte-level BPE, its
vocabulary padded with reserved control tokens to 128256. Weights are random, so answers are meaningless; what is
measured is memory and time, which do not depend on the values. Files go under ``--work`` (reused when present;
never committed).

Three fresh processes, each on ``--threads`` threads:

* ingest (kvrag, not measured): the passages of the prompt are ingested into a :class:`~kvrag.store.DiskStore`
  under ``--work`` (kvrag's one-time cost, done ahead of the questions);
* answer (kvrag): load the file with kvrag's defaults, answer the question with ``--method`` (``stale``: the
  chunks' caches from the store) for ``--new-tokens`` greedy tokens; its TTFT, decode ms/token and the process's
  peak RSS (``VmHWM``), beside the file's size and the request's K/V bytes;
* llama.cpp: the same file prefills the same token ids (its TTFT) and decodes; its peak RSS.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvrag_bench.report import writing_main

log = logging.getLogger(__name__)

LLAMA_31_8B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "vocab": 128256,
               "context": 8192, "rope_theta": 500000.0, "rms_eps": 1e-5}
"""Llama-3.1-8B's shapes (its config.json), the context cut to 8192 (the benchmark's prompts are ~2K tokens)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", default="runs/big-model-files", help="folder for the written GGUF files and the store "
                                                                  "(reused; several GB)")
    p.add_argument("--layers", type=int, default=LLAMA_31_8B["layers"], help="layers (32: Llama-3.1-8B's)")
    p.add_argument("--data", default=None, help="QA JSONL whose first row's passages make the prompt (default: the "
                                                "sample documents)")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens, about")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--method", default="stale")
    p.add_argument("--peer", default="auto", choices=("auto", "llama.cpp", "none"))
    p.add_argument("--out", default="runs/big-model")


def _tokenizer_fields(vocab: int) -> dict[str, Any]:
    """The embedded SmolLM2 GGUF's tokenizer fields, the token list padded to ``vocab`` with control tokens."""
    from gguf import GGUFReader, TokenType

    from kvrag.default_model import default_gguf_path

    r = GGUFReader(default_gguf_path())

    def value(key: str) -> Any:
        return r.fields[key].contents()

    tokens = list(value("tokenizer.ggml.tokens"))
    types = list(value("tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [int(TokenType.CONTROL)] * pad
    return {"model": value("tokenizer.ggml.model"), "pre": value("tokenizer.ggml.pre"), "tokens": tokens,
            "types": types, "merges": list(value("tokenizer.ggml.merges")),
            "bos": value("tokenizer.ggml.bos_token_id"), "eos": value("tokenizer.ggml.eos_token_id"),
            "chat_template": value("tokenizer.chat_template")}


def _tensors(shape: dict[str, Any], layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, f, kv = shape["hidden"], shape["intermediate"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape["vocab"], h))]
    for i in range(layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (h,)), (f"{b}.attn_q.weight", (h, h)), (f"{b}.attn_k.weight", (kv, h)),
                (f"{b}.attn_v.weight", (kv, h)), (f"{b}.attn_output.weight", (h, h)), (f"{b}.ffn_norm.weight", (h,)),
                (f"{b}.ffn_gate.weight", (f, h)), (f"{b}.ffn_up.weight", (f, h)), (f"{b}.ffn_down.weight", (h, f))]
    return [*out, ("output_norm.weight", (h,)), ("output.weight", (shape["vocab"], h))]


def write_random_f16(path: Path, *, layers: int, shape: dict[str, Any] = LLAMA_31_8B, seed: int = 0) -> Path:
    """Write a Llama GGUF of ``shape`` with ``layers`` layers: random N(0, 0.02) float16 matrices, unit norms."""
    import gguf
    from tqdm.auto import tqdm

    tok = _tokenizer_fields(shape["vocab"])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-llama-3.1-8b-shape-{layers}l")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(shape["context"])
    w.add_block_count(layers)
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(shape["rms_eps"])
    w.add_vocab_size(shape["vocab"])
    w.add_tokenizer_model(tok["model"])
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(int(tok["bos"]))
    w.add_eos_token_id(int(tok["eos"]))
    w.add_add_bos_token(False)
    w.add_chat_template(tok["chat_template"])
    tensors = _tensors(shape, layers)
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims in tqdm(tensors, desc="kvrag bench: writing random F16 GGUF", unit="tensor"):
        if len(dims) == 1:
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        out = np.empty(dims, dtype=np.float16)
        for r in range(0, dims[0], 4096):  # a float32 temporary of at most 4096 rows
            block = rng.standard_normal((min(4096, dims[0] - r), dims[1]), dtype=np.float32)
            block *= 0.02
            out[r : r + block.shape[0]] = block
        w.write_tensor_data(out)
    w.close()
    return path


def quantize(src: Path, dst: Path, *, ftype: str = "Q4_K_M", threads: int = 2) -> Path:
    """``src`` quantized to ``ftype`` by llama.cpp's ``llama_model_quantize`` (llama-cpp-python)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    tmp = dst.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        msg = f"llama_model_quantize({src.name} -> {ftype}) returned {rc}"
        raise RuntimeError(msg)
    tmp.replace(dst)
    return dst


def build(work: Path, *, layers: int, threads: int = 2) -> Path:
    """The Q4_K_M file under ``work`` (written and quantized once; the F16 file is deleted after quantizing)."""
    work.mkdir(parents=True, exist_ok=True)
    q = work / f"random-llama-3.1-8b-shape-{layers}l.Q4_K_M.gguf"
    if q.exists():
        return q
    f16 = work / f"random-llama-3.1-8b-shape-{layers}l.F16.gguf"
    if not f16.exists():
        write_random_f16(f16.with_suffix(".part"), layers=layers).replace(f16)
    t = time.perf_counter()
    quantize(f16, q, threads=threads)
    log.info("quantized %s in %.0f s", q.name, time.perf_counter() - t)
    f16.unlink()
    return q


def child_ingest(gguf: str, store: str, data: str | None, context: int, threads: int) -> dict[str, Any]:
    """One process: the prompt's passages ingested into the disk store ``store``, then one ``stale`` answer of a
    token, which stores the template's text before the passages as a real first request would (the timed answer
    then finds every context segment in the store)."""
    import torch

    from kvrag.config import GenerationConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag.store import DiskStore
    from kvrag_bench.memory_bench import _passages

    torch.set_num_threads(threads)
    lm = load_model(gguf)
    eng = KVRAGEngine(lm, DiskStore(store))
    passages, question = _passages(data, lm.tokenizer, context)
    t = time.perf_counter()
    eng.ingest(passages, progress=False)
    ingest_s = time.perf_counter() - t
    prefix, passages, suffix = get_template(None).parts(lm.tokenizer, passages, question)
    first = eng.prepare(eng.plan_parts(prefix, passages, suffix), "stale", reserve=1)
    "".join(eng.stream(first, GenerationConfig(max_new_tokens=1)))
    return {"ingest_s": ingest_s, "first_request_misses": first.stats.chunk_misses + first.stats.other_misses}


def child_answer(gguf: str, store: str, data: str | None, context: int, new_tokens: int, threads: int,
                 method: str) -> dict[str, Any]:
    """One process: load, answer with ``method`` from the store's caches; TTFT, decode and peak RSS."""
    import torch

    from kvrag.config import GenerationConfig
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag.store import DiskStore
    from kvrag_bench.memory_bench import _passages, _peak_rss_mb, rss_parts_mb

    torch.set_num_threads(threads)
    t = time.perf_counter()
    lm = load_model(gguf)
    load_s = time.perf_counter() - t
    rss_loaded = _peak_rss_mb()
    eng = KVRAGEngine(lm, DiskStore(store))
    passages, question = _passages(data, lm.tokenizer, context)
    prefix, passages, suffix = get_template(None).parts(lm.tokenizer, passages, question)
    plan = eng.plan_parts(prefix, passages, suffix)
    prep = eng.prepare(plan, method, reserve=new_tokens)
    t = time.perf_counter()
    "".join(eng.stream(prep, GenerationConfig(max_new_tokens=new_tokens)))
    decode_s = time.perf_counter() - t
    tokens = prep.token_ids  # the answer's ids (the stream yields text pieces)
    # a second question over the same passages: warm (the first request's one-time work is behind it)
    again = eng.prepare(eng.plan_parts(prefix, passages, get_template(None).parts(
        lm.tokenizer, passages, _second_question(data))[2]), method, reserve=new_tokens)
    t = time.perf_counter()
    "".join(eng.stream(again, GenerationConfig(max_new_tokens=new_tokens)))
    second_decode_s = time.perf_counter() - t
    kv_bytes = eng.runner.budget.bytes_per_token * (len(plan.token_ids) + new_tokens)  # what the request leased
    return {"load_s": load_s, "ttft_s": prep.timings.ttft_s, "decode_ms": 1000 * decode_s / max(1, len(tokens) - 1),
            "peak_rss_mb": _peak_rss_mb(), "peak_rss_after_load_mb": rss_loaded, "kv_mb": kv_bytes / 2**20,
            **rss_parts_mb(), "timings": dict(prep.timings),
            "prompt_ids": list(plan.token_ids), "dtype": str(lm.dtype).replace("torch.", ""),
            "quantize": lm.quantize, "stats_method": method,
            "misses": {"chunks": prep.stats.chunk_misses, "other": prep.stats.other_misses},
            "second_ttft_s": again.timings.ttft_s, "second_timings": dict(again.timings),
            "second_decode_ms": 1000 * second_decode_s / max(1, len(again.token_ids) - 1)}


def _second_question(data: str | None) -> str:
    """The question of the data's second row (another question over the same passages), or a fixed one."""
    if data:
        from kvrag_bench.data import load_requests

        return load_requests(data, limit=2)[-1].question
    return "Which of these documents is the longest, and what is it about?"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvrag_bench.memory_bench import _llama, _llama_available, _spawn
    from kvrag_bench.provenance import machine_info

    threads = args.threads or 1
    work = Path(args.work).expanduser().resolve()
    t = time.perf_counter()
    path = build(work, layers=args.layers, threads=2)
    build_s = time.perf_counter() - t
    store = work / f"store-{path.stem}"
    common = {"gguf": str(path), "store": str(store), "data": args.data, "context": args.context,
              "threads": threads}
    ingest = _spawn("ingest", common, module="kvrag_bench.big_model")
    answer = _spawn("answer", {**common, "new_tokens": args.new_tokens, "method": args.method},
                        module="kvrag_bench.big_model")
    ids = answer.pop("prompt_ids")
    llama = None
    if _llama_available(args.peer):
        llama = _llama({"gguf": str(path), "ids": ids, "new_tokens": args.new_tokens, "threads": threads})
    file_mb = path.stat().st_size / 2**20
    return {"file": path.name, "file_mb": file_mb, "layers": args.layers, "prompt_tokens": len(ids),
            "threads": threads, "method": args.method, "new_tokens": args.new_tokens, "build_s": build_s,
            "ingest": ingest, "kvrag": answer, "llama.cpp": llama,
            "rss_budget_mb": file_mb + answer["kv_mb"] + 1536,
            "machine": machine_info("cpu", answer["dtype"])}


def markdown(r: dict[str, Any]) -> str:
    k, p = r["kvrag"], r["llama.cpp"]
    lines = [f"## {r['file']} ({r['file_mb']:.0f} MB, {r['layers']} layers, random weights): "
             f"{r['prompt_tokens']} prompt tokens, {r['threads']} thread(s)", "",
             "| system | peak RSS MB | file + K/V + 1.5 GiB MB | TTFT s | decode ms/token |", "|---|---:|---:|---:|---:|",
             f"| kvrag `{r['method']}` (chunks ingested beforehand: {r['ingest']['ingest_s']:.0f} s) | "
             f"{k['peak_rss_mb']:.0f} | {r['rss_budget_mb']:.0f} | {k['ttft_s']:.2f} | {k['decode_ms']:.0f} |"]
    if p:
        lines.append(f"| llama.cpp (full prefill of the same ids) | {p['peak_rss_mb']:.0f} | - | {p['ttft_s']:.2f} | "
                     f"{p['decode_ms']:.0f} |")
        lines += ["", f"kvrag `{r['method']}` TTFT / llama.cpp's: {k['ttft_s'] / p['ttft_s']:.3f}x"]
    lines += ["", f"kvrag: {k['dtype']} compute, quantize={k['quantize']}, K/V {k['kv_mb']:.0f} MB, peak RSS after "
                  f"load {k['peak_rss_after_load_mb']:.0f} MB, load {k['load_s']:.0f} s; after the answer "
                  f"{k.get('anon_rss_mb', 0):.0f} MB anonymous + {k.get('file_rss_mb', 0):.0f} MB of mapped file pages "
                  f"resident; `{r['method']}`'s TTFT: fetch {k['timings']['fetch_s']:.1f} s, assemble "
                  f"{k['timings']['assemble_s']:.1f} s, suffix prefill {k['timings']['suffix_prefill_s']:.1f} s."]
    if k.get("second_ttft_s") is not None:
        lines.append(f"A second question over the same passages in the same process (warm: the first request's one-time "
                     f"work behind it): TTFT {k['second_ttft_s']:.2f} s, suffix prefill "
                     f"{k['second_timings']['suffix_prefill_s']:.1f} s"
                     + (f", decode {k['second_decode_ms']:.0f} ms/token." if "second_decode_ms" in k else "."))
    missed = k.get("misses", {})
    if any(missed.values()):
        lines.append(f"The answer found {missed['chunks']} chunk(s) and {missed['other']} other segment(s) missing "
                     f"from the store and computed them ({k['timings']['compute_misses_s']:.1f} s of its TTFT).")
    return "\n".join(lines)


main = writing_main("big_model", run, markdown)


__all__ = ["LLAMA_31_8B", "add_arguments", "build", "child_answer", "child_ingest", "main", "markdown", "quantize",
           "run", "write_random_f16"]
