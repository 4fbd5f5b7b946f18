"""``kvrag bench sweep``: cache-ready TTFT (and peak memory) of every method as the context grows.

Two sweeps over synthetic RAG prompts (the real template, text cut from real passages or a built-in filler):

* ``length``: total context tokens in ``lengths`` (default 1K, 2K, 4K, 8K) at a fixed chunk count;
* ``chunks``: chunk count in ``chunk_counts`` at a fixed total (the same text cut into more, shorter chunks).

Each point builds its chunk caches untimed, then times ``prepare`` + the first token (``max_new_tokens=1``) for
every method, ``repeats`` times, methods interleaved; the median TTFT is reported. A length that does not fit the
model's context window (prompt + suffix) is clamped to the largest that does, and the actual context length is
recorded. Points are appended to ``sweep.jsonl`` as they finish, so a rerun skips finished points.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.errors import ConfigError
from kvrag.prompting import get_template, render_passage
from kvrag_bench import aggregate, provenance
from kvrag_bench.config import resolve_methods
from kvrag_bench.data import load_requests
from kvrag_bench.memory import PeakMemory
from kvrag_bench.runner import ensure_cached

log = logging.getLogger(__name__)

RESULTS = "sweep.jsonl"
QUESTION = "Which places, people and dates do these documents mention?"

_FILLER = (
    "The river town grew around a stone bridge built in the eighteenth century. Merchants carried wool, grain and "
    "timber across it, and a market was held every Thursday in the square beside the church. In 1851 a railway "
    "station opened north of the town, and the old coaching inns slowly closed. A library, a school of engineering "
    "and a small museum of local history were founded by the council in the following decades. "
)


@dataclasses.dataclass
class SweepConfig:
    """Settings of ``kvrag bench sweep`` (see the module docstring)."""

    methods: Sequence[str] = ("full", "stale")
    data: str | None = None
    lengths: Sequence[int] = (1024, 2048, 4096, 8192)
    chunks: int = 8
    chunk_counts: Sequence[int] = (1, 2, 4, 8, 16, 32)
    content_tokens: int = 2048
    repeats: int = 3
    out: str = "runs/sweep"
    model: str | None = None
    template: str | None = None
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    seed: int = 0
    warmup: bool = True
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.chunks < 1 or self.content_tokens < 1:
            msg = f"repeats, chunks and content_tokens must be >= 1, got {self.repeats}, {self.chunks}, {self.content_tokens}"
            raise ConfigError(msg)
        if not self.lengths and not self.chunk_counts:
            raise ConfigError("nothing to sweep: give --lengths and/or --chunk-counts")
        self.methods = list(self.methods)
        self.lengths = list(self.lengths)
        self.chunk_counts = list(self.chunk_counts)


def source_text(data: str | None, min_chars: int) -> str:
    """Text to cut chunks from: the passages of a QA JSONL (in file order) or the built-in filler, >= ``min_chars``."""
    parts: list[str] = []
    n = 0
    if data:
        for req in load_requests(data):
            for p in req.passages():
                parts.append(p)
                n += len(p)
                if n >= min_chars:
                    return "".join(parts)
    while n < min_chars:
        parts.append(_FILLER)
        n += len(_FILLER)
    return "".join(parts)


class Sweep:
    """Runs the sweeps on one engine (``engine`` None: load ``config.model`` with an in-memory store)."""

    def __init__(self, config: SweepConfig, engine: Any = None) -> None:
        self.cfg = config
        provenance.run_git_sha()  # pin the commit this run executes before it starts
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.methods, self.skipped = resolve_methods(config.methods)
        self.template = get_template(config.template)
        if engine is None:
            from kvrag.engine.engine import KVRAGEngine
            from kvrag.models import load_model
            from kvrag.store.memory import MemoryStore

            engine = KVRAGEngine(load_model(config.model, device=config.device, dtype=config.dtype), MemoryStore(),
                                 EngineConfig())
        self.engine = engine
        need = max([*config.lengths, config.content_tokens]) if config.lengths else config.content_tokens
        # ~4 characters per token in English; tokenize once and cut by tokens
        self.ids = engine.tokenize(source_text(config.data, need * 6))
        if len(self.ids) < need:
            self.ids = (self.ids * (need // max(1, len(self.ids)) + 1))[: need + 1]

    def _overhead(self, n_chunks: int) -> int:
        prefix, _, suffix = self.template.parts(self.engine.tokenizer, ["x"] * n_chunks, QUESTION)
        return len(self.engine.tokenize(prefix)) + len(self.engine.tokenize(suffix)) + 4 * n_chunks + 8

    def build(self, total: int, n_chunks: int, offset: int = 0) -> tuple[Any, list[str], bool]:
        """Plan a prompt of ~``total`` context tokens in ``n_chunks`` chunks; returns (plan, chunk texts, clamped).

        Chunk texts are decoded token slices, re-tokenized by the engine, so lengths are approximate; a prompt
        that does not fit the context window (with one token to generate) is shrunk until it does.
        """
        budget = self.engine.max_context - self._overhead(n_chunks)
        clamped = total > budget
        total = min(total, budget)
        tok = self.engine.tokenizer
        for _ in range(8):
            size = max(1, total // n_chunks)
            texts = []
            for i in range(n_chunks):
                a = (offset + i * size) % max(1, len(self.ids) - size)
                texts.append(render_passage(tok.decode(self.ids[a : a + size]), f"Document {i + 1}"))
            prefix, ps, suffix = self.template.parts(tok, texts, QUESTION)
            plan = self.engine.plan_parts(prefix, ps, suffix)
            over = plan.total_len + 2 - self.engine.max_context
            if over <= 0:
                return plan, ps, clamped
            total -= over + 2 * n_chunks
            clamped = True
        msg = f"could not fit {n_chunks} chunks into the context window of {self.engine.max_context} tokens"
        raise ConfigError(msg)

    def points(self) -> list[tuple[str, int, int]]:
        """(sweep, target tokens, chunk count) of every point."""
        pts = [("length", t, self.cfg.chunks) for t in self.cfg.lengths]
        pts += [("chunks", self.cfg.content_tokens, n) for n in self.cfg.chunk_counts]
        return pts

    def measure(self, plan: Any, label: str) -> dict[str, Any]:
        with PeakMemory(self.engine.model.device) as mem:
            resp = self.engine.answer_plan(plan, self.methods[label], GenerationConfig(max_new_tokens=1))
        return {"timings": resp.timings.to_dict(), "peak_mem_bytes": mem.peak_bytes, "misses": resp.stats.chunk_misses,
                "method_stats": resp.stats.method_stats.to_dict()}

    def run(self) -> dict[str, Any]:
        """Run (or resume) the sweeps and write sweep.jsonl, sweep.json, sweep.md and the log-log plots."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / RESULTS
        key = {"model": cfg.model or "default", "fingerprint": self.engine.loaded.fingerprint,
               "repeats": cfg.repeats, "template": self.template.name, "data": cfg.data}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        info = out / "sweep_run.json"
        if cfg.overwrite and path.exists():
            path.unlink()
        if path.exists() and info.exists() and json.loads(info.read_text()).get("digest") != digest:
            msg = f"{out} holds sweep results of a different configuration; use another --out or --overwrite"
            raise ConfigError(msg)
        aggregate.write_text_atomic(info, json.dumps({"key": key, "digest": digest}, indent=2) + "\n")
        rows = aggregate.read_jsonl(path)
        done = {(r["sweep"], r["method"], r["target_tokens"], r["n_chunks"]) for r in rows}
        labels = list(self.methods)
        todo = [(p, lbl) for p in self.points() for lbl in labels if (p[0], lbl, p[1], p[2]) not in done]
        if todo and cfg.warmup:
            plan, _, _ = self.build(min(256, todo[0][0][1]), 2)
            ensure_cached(self.engine, [plan])
            for lbl in labels:
                self.measure(plan, lbl)
        bar = tqdm(total=len(todo) * cfg.repeats, desc="sweep", unit="run", disable=not cfg.progress)
        pending_points = list(dict.fromkeys(p for p, _ in todo))
        with path.open("a", encoding="utf-8") as f:
            for j, (sweep, target, n_chunks) in enumerate(pending_points):
                plan, texts, clamped = self.build(target, n_chunks, offset=97 * j)
                ensure_cached(self.engine, [plan])  # cache-ready: built before timing
                mine = [lbl for p, lbl in todo if p == (sweep, target, n_chunks)]
                runs: dict[str, list[dict[str, Any]]] = {lbl: [] for lbl in mine}
                for r in range(cfg.repeats):
                    order = mine[r % len(mine):] + mine[: r % len(mine)]
                    for lbl in order:
                        runs[lbl].append(self.measure(plan, lbl))
                        bar.update()
                for lbl in mine:
                    row = self._row(sweep, target, n_chunks, plan, lbl, runs[lbl], clamped)
                    f.write(json.dumps(aggregate.jsonable(row)) + "\n")
                    f.flush()
                    rows.append(row)
        bar.close()
        wanted = {(p[0], lbl, p[1], p[2]) for p in self.points() for lbl in labels}
        pts = [r for r in rows if (r["sweep"], r["method"], r["target_tokens"], r["n_chunks"]) in wanted]
        result = {"config": dataclasses.asdict(cfg), **aggregate.environment_info(), "skipped_methods": self.skipped,
                  "machine": provenance.machine_info(self.engine.loaded.device, self.engine.loaded.dtype),
                  "points": pts}
        result = aggregate.jsonable(result)
        aggregate.write_result(out, "sweep", result, sweep_markdown(result))
        from kvrag_bench import plots

        plots.sweep_plots(pts, out, title=str(getattr(self.engine.loaded, "name", cfg.model or "default model")))
        return result

    @staticmethod
    def _row(sweep: str, target: int, n_chunks: int, plan: Any, label: str, runs: list[dict[str, Any]],
             clamped: bool) -> dict[str, Any]:
        keys = runs[0]["timings"].keys()
        med = {k: statistics.median(r["timings"][k] for r in runs) for k in keys}
        return {
            "sweep": sweep, "method": label, "target_tokens": target, "n_chunks": n_chunks,
            "context_tokens": plan.context_len, "suffix_tokens": len(plan.suffix.token_ids), "clamped": clamped,
            "ttft_s": med["ttft_s"], "ttft_all_s": [r["timings"]["ttft_s"] for r in runs], "timings_median_s": med,
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in runs),
            "cache_misses": sum(r["misses"] or 0 for r in runs), "method_stats": runs[-1]["method_stats"],
        }


def run_sweep(config: SweepConfig, engine: Any = None) -> dict[str, Any]:
    """Convenience: ``Sweep(config, engine).run()``."""
    return Sweep(config, engine).run()


def sweep_markdown(result: dict[str, Any]) -> str:
    """Tables of median TTFT (ms) per point and method, and the TTFT ratio to ``full``."""
    pts = result.get("points", [])
    lines = [f"# TTFT sweep (cache-ready, median of repeats): {provenance.machine_label(result)}", ""]
    for sweep, title, col in (("length", "vs context length", "context tokens"), ("chunks", "vs chunk count", "chunks")):
        sp = [p for p in pts if p["sweep"] == sweep]
        if not sp:
            continue
        methods = list(dict.fromkeys(p["method"] for p in sp))
        xs = sorted({(p["target_tokens"], p["n_chunks"]) for p in sp})
        lines += [f"## TTFT (ms) {title}", "", f"| {col} | " + " | ".join(f"`{m}`" for m in methods) + " | peak MiB (per method) |",
                  "|---:|" + "---:|" * len(methods) + "---|"]
        for tgt, nch in xs:
            row = {p["method"]: p for p in sp if p["target_tokens"] == tgt and p["n_chunks"] == nch}
            any_p = next(iter(row.values()))
            x = f"{any_p['context_tokens']}" + (" (clamped)" if any_p.get("clamped") else "") if sweep == "length" else f"{nch}"
            cells = [f"{1000 * row[m]['ttft_s']:.0f}" if m in row else "–" for m in methods]
            mem = ", ".join(f"{row[m]['peak_mem_bytes'] / 2**20:.0f}" if m in row else "–" for m in methods)
            lines.append(f"| {x} | " + " | ".join(cells) + f" | {mem} |")
        lines.append("")
    hw = result.get("hardware", {})
    lines += [f"git `{result.get('git_sha')}`; {hw.get('cpu')} (CPU native bf16 {hw.get('cpu_bf16') or 'none'}, "
              f"{hw.get('cores')} cores, torch threads "
              f"{hw.get('torch_threads')}, GPU {hw.get('gpu') or 'none'}, load avg {hw.get('load_avg')})", ""]
    return "\n".join(lines)


__all__ = ["Sweep", "SweepConfig", "run_sweep", "sweep_markdown"]
