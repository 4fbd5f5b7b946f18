"""``kvrag bench decode``: ms per generated token vs context length and batch, per weight format, beside the
bytes-read bound and llama.cpp on the same GGUF file and token ids.

What it runs, on one model loaded once per weight format (``--quantize``, e.g. ``none,int8,int4``; the same dtype):

* the context: real text (the passages of ``--data``'s QA rows, or the sample documents) tokenized once and cut to
  each ``--contexts`` length; its KV is computed once by a full prefill (dense products, so every format decodes
  over the same cache) and copied into one KV buffer per row;
* for every (context, batch) cell, the formats take turns (interleaved ``--rounds`` times, so a busy machine slows
  them alike): ``--steps`` batched decode steps (:func:`kvrag.kv.batched.decode_step`, the engine's own step),
  median ms per step and per token;
* the bytes-read bound of each format: the bytes one step must read (the linear weights in the format's encoding,
  one embedding row per token, the norms, and the rows' KV) divided by the copy bandwidth measured in the same run;
* with ``--kv-dtypes`` (e.g. ``float32,bfloat16``), each format also decoding over rows of that K/V dtype
  (``EngineConfig.kv_dtype``: bfloat16 K/V under a float32 model, int8), named ``<format> kv=<dtype>``;
* with ``--step-backends`` (e.g. ``fused,direct,hf``), each format also as ``<format> <backend>``: the same model's
  steps through that backend of :mod:`kvrag.kv.step_backend` (each computes the same bits), where it serves the
  model;
* with ``llama-cpp-python`` installed (kvrag-bench's ``peers`` extra) and a GGUF model (the embedded default),
  llama.cpp on the same file: the same token ids prefilled, then greedy steps one token at a time (``n_threads`` =
  torch's threads), interleaved with kvrag's formats at batch 1.

Writes ``decode.json``, ``decode.md`` and ``decode.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from kvrag_bench.roofline import copy_bandwidth, step_bytes

log = logging.getLogger(__name__)

SAMPLE_DOCS = Path(__file__).resolve().parents[2] / "examples" / "data"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None, help="QA JSONL whose passages make the context (default: the sample docs)")
    p.add_argument("--contexts", default="512,1024,1536,2048,4096", help="context lengths in tokens")
    p.add_argument("--batches", default="1,2,4,8", help="rows decoded together")
    p.add_argument("--quantize", default="none,int8,int4", help="weight formats: none (dense), int8, int4")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per cell and round")
    p.add_argument("--rounds", type=int, default=2, help="times the formats take turns in each cell")
    p.add_argument("--peer", default="auto", choices=("auto", "llama.cpp", "none"),
                   help="llama.cpp on the same GGUF (auto: when llama-cpp-python is installed and the model is one)")
    p.add_argument("--step-backends", default="",
                   help="also time each format's steps through these step backends (fused, direct, hf: the same "
                        "logits), where they serve the model")
    p.add_argument("--kv-dtypes", default="",
                   help="also time each format over rows of these K/V dtypes (e.g. float32,bfloat16: "
                        "EngineConfig.kv_dtype), interleaved with the others")
    p.add_argument("--out", default="runs/decode")


def _context_ids(tokenizer: Any, data: str | None, n: int) -> list[int]:
    texts: list[str] = []
    if data:
        from kvrag_bench.data import load_requests

        for r in load_requests(data):
            texts += r.passages()
            if sum(map(len, texts)) > 8 * n:
                break
    else:
        texts = [p.read_text(encoding="utf-8") for p in sorted(SAMPLE_DOCS.glob("*.md"))]
    ids: list[int] = []
    while len(ids) < n:  # the sample documents are short: repeat them for the longest contexts
        ids += tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return ids[:n]


def context_rows(keys: Any, values: Any, batch: int, capacity: int, dtype: Any) -> list[Any]:
    """``batch`` rows of a batched step (:class:`kvrag.kv.batched.Row`), each its own buffer of ``capacity``
    positions holding a copy of one prefilled context (``keys`` / ``values`` [layers, kv_heads, length, head_dim],
    as ``hf_cache.prefill_kv`` returns), in ``dtype`` as the engine converts it (:meth:`KVBuffer.put`)."""
    from kvrag.kv import batched, hf_cache

    rows, src = [], hf_cache.KVBuffer.wrap(keys, values)
    for _ in range(batch):
        buf = hf_cache.KVBuffer(keys.shape[0], keys.shape[1], keys.shape[3], capacity, dtype, keys.device)
        buf.put(src, keys.shape[2])
        rows.append(batched.Row(buf, keys.shape[2]))
    return rows


def _backend_variants(models: dict[str, Any], names: list[str]) -> list[tuple[str, str | None]]:
    """(format, step backend) per timed column: each format as the engine runs it (None: the backend its first step
    chose), then as each of ``names`` (:mod:`kvrag.kv.step_backend`) that serves its model."""
    from kvrag.kv import step_backend

    out: list[tuple[str, str | None]] = [(f, None) for f in models]
    for name in names:
        if name not in step_backend.BY_NAME:
            raise SystemExit(f"--step-backends: no backend {name!r} ({', '.join(step_backend.BY_NAME)})")
        for f, lm in models.items():
            why = step_backend.BY_NAME[name].why_not(lm.model)
            if why is None:
                out.append((f, name))
            else:
                log.warning("%s: no %s column: %s", lm.name, name, why)
    return out


class LlamaCppPeer:
    """llama.cpp (``llama-cpp-python``) on a GGUF file: prefill token ids, then greedy steps one token at a time."""

    def __init__(self, gguf: str, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_batch=512,
                                   n_ctx=n_ctx, verbose=False)
        self.version = getattr(llama_cpp, "__version__", "?")

    def _next(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1),
                                       shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t, self._next()

    def steps(self, token: int, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            self.llm.eval([token])
            times.append(time.perf_counter() - t)
            token = self._next()
        return times


def _gguf_of(model_name: str | None) -> str | None:
    if model_name not in (None, "default", "smollm2-135m-instruct"):
        return str(model_name) if str(model_name).endswith(".gguf") else None
    from kvrag.default_model import default_gguf_path

    return str(default_gguf_path())


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvrag.kv import batched, hf_cache, int8kv
    from kvrag.models import load_model
    from kvrag_bench.provenance import environment_info

    contexts = sorted(int(c) for c in args.contexts.split(",") if c.strip())
    batches = sorted(int(b) for b in args.batches.split(",") if b.strip())
    formats = [q.strip() for q in args.quantize.split(",") if q.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {f: load_model(args.model, dtype=args.dtype, device=args.device, quantize=f) for f in formats}
    first = next(iter(models.values()))
    max_pos = int(getattr(first.config, "max_position_embeddings", 8192))
    contexts = [c for c in contexts if c + args.steps * args.rounds + 8 <= max_pos]
    ids = _context_ids(first.tokenizer, args.data, max(contexts))
    peer = None
    gguf = _gguf_of(args.model) if args.peer != "none" else None
    if gguf is not None:
        try:
            peer = LlamaCppPeer(gguf, max(contexts) + args.steps * args.rounds + 16, torch.get_num_threads())
        except ImportError:
            if args.peer == "llama.cpp":
                raise
            log.warning("llama-cpp-python is not installed: no llama.cpp column (pip install 'kvrag-bench[peers]')")
    from kvrag.kv import step_backend

    base = _backend_variants(models, [n for n in args.step_backends.split(",") if n])
    kv_dtypes = [getattr(torch, k) for k in args.kv_dtypes.split(",") if k]
    variants = [(f, comp, None) for f, comp in base] + [(f, comp, kv) for kv in kv_dtypes for f, comp in base
                                                         if kv != models[f].dtype]
    names = {v: " ".join([v[0]] + ([v[1]] if v[1] else []) + ([f"kv={str(v[2]).removeprefix('torch.')}"] if v[2]
                                                                 else [])) for v in variants}
    chosen: dict[tuple[str, str | None], str | None] = {}
    bandwidth = copy_bandwidth()
    cells: list[dict[str, Any]] = []
    for ctx in contexts:
        keys, values = hf_cache.prefill_kv(first.model, torch.tensor(ids[:ctx]))
        peer_ms: list[float] = []
        if peer is not None:
            peer_prefill_s, tok = peer.prefill(ids[:ctx])
        for b in batches:
            times: dict[tuple[str, str | None, Any], list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for f, comp, kv in variants:
                    lm = models[f]
                    rows = context_rows(keys, values, b, ctx + args.steps + 2, kv or lm.dtype)
                    win = batched.windows(lm.model)
                    if comp is not None or (f, None) in chosen:  # a backend of its own, or the engine's choice
                        step_backend.choose(lm.model, "decode", comp or chosen[f, None])
                    for i in range(args.steps + 1):
                        t = time.perf_counter()
                        batched.decode_step(lm.model, rows, [ids[ctx - 1]] * b, win)
                        if comp is None:
                            chosen[f, None] = step_backend.chosen(lm.model, "decode")
                        hf_cache.sync(lm.device)
                        if i:  # the first step warms up
                            times[f, comp, kv].append(time.perf_counter() - t)
                        for r in rows:
                            r.length += 1
                if peer is not None and b == 1:
                    peer_ms += [1000 * t for t in peer.steps(tok, args.steps)]
                    peer.llm.n_tokens = ctx  # roll back to the prefilled context for the next round
            for f, comp, kv in variants:
                lm = models[f]
                step_ms = 1000 * statistics.median(times[f, comp, kv])
                per_el = None if kv is None else int8kv.width(keys.shape[-1], kv) * kv.itemsize / keys.shape[-1]
                nbytes = step_bytes(lm.model, b, ctx, per_el)
                bound_ms = 1000 * nbytes / bandwidth
                cells.append({"context": ctx, "batch": b, "format": names[f, comp, kv], "step_ms": step_ms,
                              "ms_per_token": step_ms / b,
                              "bytes_per_step": nbytes, "bound_ms_per_step": bound_ms, "x_bound": step_ms / bound_ms})
            if peer is not None and b == 1 and peer_ms:
                cells.append({"context": ctx, "batch": 1, "format": "llama.cpp", "step_ms": statistics.median(peer_ms),
                              "ms_per_token": statistics.median(peer_ms), "prefill_s": peer_prefill_s})
    return {"bench": "decode", "model": first.name, "dtype": str(first.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(), "copy_bytes_per_s": bandwidth,
            "formats": [names[v] for v in variants],
            "backends": {names[v]: v[1] or chosen.get(v[:2]) for v in variants},
            "peer": None if peer is None else {"name": "llama.cpp", "llama_cpp_python": peer.version, "gguf": gguf},
            "cells": cells, "environment": environment_info(),
            "command": "kvrag bench decode " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                       if k in ("contexts", "batches", "quantize", "steps", "rounds",
                                                                "dtype", "threads", "data") and v is not None)
                       + (f" --step-backends {args.step_backends}" if args.step_backends else "")
                       + (f" --kv-dtypes {args.kv_dtypes}" if args.kv_dtypes else "")}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}` -- {result['model']}, {result['dtype']}, {result['torch_threads']} thread(s), "
             f"copy bandwidth {result['copy_bytes_per_s'] / 1e9:.1f} GB/s; step backends: "
             + ", ".join(f"{f}: {b}" for f, b in result.get("backends", {}).items()),
             "", "| context | batch | format | ms / token | ms / step | bytes-read bound (ms / step) | x bound |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for c in result["cells"]:
        bound = f"{c['bound_ms_per_step']:.1f}" if "bound_ms_per_step" in c else ""
        xb = f"{c['x_bound']:.2f}" if "x_bound" in c else ""
        lines.append(f"| {c['context']} | {c['batch']} | {c['format']} | {c['ms_per_token']:.1f} | {c['step_ms']:.1f} "
                     f"| {bound} | {xb} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c["batch"] for c in result["cells"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.6), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        for f in [*result["formats"], "llama.cpp"]:
            pts = sorted((c["context"], c["ms_per_token"]) for c in result["cells"] if c["batch"] == b
                         and c["format"] == f)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f)
        for f in result["formats"]:
            pts = sorted((c["context"], c["bound_ms_per_step"] / b) for c in result["cells"] if c["batch"] == b
                         and c["format"] == f)
            if pts:
                ax.plot(*zip(*pts, strict=True), ls=":", color="gray")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context tokens")
    axes[0][0].set_ylabel("ms per generated token (dotted: bytes-read bound)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{result['model']} decode, {result['dtype']}, {result['torch_threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    from kvrag_bench.report import write_result

    result = run(args)
    plot(result, write_result(args.out, "decode", result, markdown) / "decode.png")
    return 0


__all__ = ["LlamaCppPeer", "add_arguments", "main", "markdown", "plot", "run"]
