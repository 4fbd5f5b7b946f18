"""``kvrag bench ingest``: chunks/s of one-at-a-time, batched and Ray-distributed ingest, measured side by side.

Chunks are passages of a corpus JSONL (rows with ``passages`` [+ ``titles``], or ``text``), rendered as prompts
contain them (:func:`kvrag.prompting.render_passage`). Every mode ingests the same chunks into a store of its own
(a fresh directory, or a fresh key prefix on Redis), so none reuses another's caches. The chunks are cut into
``rounds`` slices and, per slice, every mode runs in a rotating order, so a machine whose load changes over the run
(a shared CPU) slows every mode alike; a mode's chunks/s is its chunks over the sum of its slice times. Ray worker
start-up (model loading) is timed apart from ingest.

After the runs every mode's store is read back: each chunk must be served (decoded, right token ids), and
``answers`` prompts of 4 stored chunks each are answered with ``stale`` reuse, whose hit rate must be 1.0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import resource
import shlex
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.errors import ConfigError
from kvrag_bench import aggregate

log = logging.getLogger(__name__)


@dataclasses.dataclass
class IngestBenchConfig:
    """Settings of ``kvrag bench ingest``.

    Attributes:
        data: corpus JSONL.
        limit: chunks ingested by every mode.
        modes: ``serial`` (one chunk per forward), ``batched`` (``batch_size`` per forward), ``ray:N`` (N Ray
            workers, each batching).
        batch_size: chunks per forward of ``batched`` and ``ray:N``.
        rounds: slices the chunks are cut into (modes interleave per slice).
        store: base store URL (``file:///dir`` / ``redis://`` / ``redis+cluster://``); None: a temporary directory.
            ``redis-cluster`` starts a local 3-master Redis Cluster for the run.
        answers: stale-reuse prompts answered per mode afterwards (hit rate check).
        codec: storage codec of every mode's store (``native`` keeps the compute dtype; ``float16`` halves what
            1,000 fp32 chunks occupy in Redis).
    """

    data: str
    limit: int = 1000
    modes: Sequence[str] = ("serial", "batched")
    batch_size: int | None = None
    rounds: int = 4
    store: str | None = None
    answers: int = 10
    codec: str = "native"
    out: str = "runs/ingest"
    model: str | None = None
    threads: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for m in self.modes:
            if m not in ("serial", "batched") and not (m.startswith("ray:") and m[4:].isdigit() and int(m[4:]) >= 1):
                msg = f"unknown ingest bench mode {m!r}; expected serial, batched or ray:N (N >= 1 workers)"
                raise ConfigError(msg)
        if min(self.limit, self.rounds, self.threads) < 1 or self.answers < 0:
            raise ConfigError("limit, rounds and threads must be >= 1 and answers >= 0")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")


def read_chunks(path: str, limit: int) -> list[str]:
    """The first ``limit`` passages of a corpus JSONL, rendered as prompts contain them."""
    from kvrag.prompting import render_passage

    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            passages = row.get("passages") or ([row["text"]] if "text" in row else [])
            titles = row.get("titles") or [None] * len(passages)
            for p, t in zip(passages, titles, strict=False):
                if p and p.strip():
                    out.append(render_passage(p, t) if t else render_passage(p))
            if len(out) >= limit:
                return out[:limit]
    if len(out) < limit:
        log.warning("%s holds only %d passages (asked for %d)", path, len(out), limit)
    return out


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _mode_store(base: str, mode: str, tmp: Path, codec: str = "native") -> str:
    tag = mode.replace(":", "")
    opt = "" if codec == "native" else f"codec={codec}"
    if base.startswith("file://") or "://" not in base:
        root = Path(base.removeprefix("file://")) if base else tmp
        return f"file://{root / f'{tag}-{uuid.uuid4().hex[:8]}'}" + (f"?{opt}" if opt else "")
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}prefix=kvrag-bench-{tag}-{uuid.uuid4().hex[:8]}:" + (f"&{opt}" if opt else "")


def run_ingest_bench(cfg: IngestBenchConfig) -> dict[str, Any]:
    """Run the benchmark; writes ``ingest.json`` / ``ingest.md`` into ``cfg.out`` and returns the result."""
    import torch

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.ingest_prefill import DEFAULT_BATCH_SIZE
    from kvrag.store.factory import store_from_url

    torch.set_num_threads(cfg.threads)
    bs = cfg.batch_size or DEFAULT_BATCH_SIZE
    texts = read_chunks(cfg.data, cfg.limit)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    cluster = None
    tmpdir = tempfile.TemporaryDirectory(prefix="kvrag-ingest-bench-")
    pools: dict[str, Any] = {}
    ray_started = False
    try:
        base = cfg.store or ""
        if base == "redis-cluster":
            from kvrag_testing.redis_server import RedisCluster

            cluster = RedisCluster(masters=3).start()
            base = cluster.url
        eng = KVRAGEngine.from_pretrained(cfg.model, "memory://", on_store_error="raise")
        ids = [eng.tokenize(t) for t in texts]
        tokens = [len(i) for i in ids]
        urls = {m: _mode_store(base, m, Path(tmpdir.name), cfg.codec) for m in cfg.modes}
        stores = {m: store_from_url(u) for m, u in urls.items()}
        # one engine per mode's store: it keys the chunks as that store's codec asks (Ray workers check the keys)
        engines = {m: KVRAGEngine(eng.loaded, stores[m], eng.config) for m in cfg.modes}
        startup: dict[str, float] = {}
        ray_modes = [m for m in cfg.modes if m.startswith("ray:")]
        if ray_modes:
            from kvrag import distributed

            ray_started = distributed.init_ray(None, sum(int(m[4:]) for m in ray_modes), cfg.threads)
            for m in ray_modes:
                t = time.perf_counter()
                pools[m] = distributed.RayIngest(engines[m], urls[m], int(m[4:]), model=cfg.model,
                                                 torch_threads=cfg.threads)
                startup[m] = time.perf_counter() - t
        # warm-up (untimed): one small batch per in-process mode, so first-call costs do not land on one mode
        warm = KVRAGEngine(eng.loaded, store_from_url("memory://"), eng.config)
        warm.ingest(texts[:2], batch_size=1)
        warm.ingest(texts[2:6], batch_size=bs)
        n = len(texts)
        slices = [list(range(n))[i * n // cfg.rounds : (i + 1) * n // cfg.rounds] for i in range(cfg.rounds)]
        seconds = dict.fromkeys(cfg.modes, 0.0)
        per_round: list[dict[str, float]] = []
        worker_peak: dict[str, list[float]] = {}
        restarts: dict[str, int] = dict.fromkeys(cfg.modes, 0)
        from tqdm.auto import tqdm

        bar = tqdm(total=n * len(cfg.modes), desc="ingest bench", unit="chunk", disable=not cfg.progress)
        for r, sl in enumerate(slices):
            order = list(cfg.modes[r % len(cfg.modes):]) + list(cfg.modes[: r % len(cfg.modes)])
            row = {}
            for m in order:
                part = [texts[i] for i in sl]
                t = time.perf_counter()
                if m == "serial":
                    engines[m].ingest(part, batch_size=1)
                elif m == "batched":
                    engines[m].ingest(part, batch_size=bs)
                else:
                    items = [(engines[m].chunk_key(ids[i]), ids[i]) for i in sl]
                    st = pools[m].run(items, bs)
                    worker_peak[m] = [max(a, b) for a, b in zip(worker_peak.get(m, [0.0] * len(st["worker_peak_rss_mb"])),
                                                                 st["worker_peak_rss_mb"], strict=True)]
                dt = time.perf_counter() - t
                seconds[m] += dt
                row[m] = len(sl) / dt
                bar.update(len(sl))
            per_round.append(row)
        bar.close()
        driver_peak = _peak_rss_mb()  # before the read-back below
        for m in ray_modes:
            restarts[m] = sum(max(0, len(p) - 1) for p in pools[m].pids)
        # read back: every chunk served, and stale answers over stored chunks hit every cache
        checks: dict[str, dict[str, Any]] = {}
        rng = random.Random(cfg.seed)
        from kvrag.prompting import RagTemplate

        for m in cfg.modes:
            served, keys = 0, [engines[m].chunk_key(i) for i in ids]
            for start in range(0, n, 64):  # in slices: 1,000 chunks at once would hold GBs
                got = stores[m].get_many(keys[start : start + 64])
                served += sum(1 for g, i in zip(got, ids[start : start + 64], strict=True)
                              if g is not None and g.token_ids.tolist() == i)
            reader = KVRAGEngine(eng.loaded, stores[m], eng.config)
            hit = []
            for _ in range(cfg.answers):
                ps = rng.sample(texts, 4)
                prompt = RagTemplate().render(reader.tokenizer, ps, "What is this about?")
                hit.append(reader.answer(prompt, ps, "stale", max_new_tokens=1).stats.hit_rate)
            checks[m] = {"served": served, "missing_or_bad": n - served, "entries": stores[m].stats().get("entries"),
                         "answer_hit_rate_min": min(hit) if hit else None, "answers": len(hit)}
        modes = {}
        ref = cfg.modes[0]
        for m in cfg.modes:
            modes[m] = {
                "chunks_per_s": n / seconds[m], "seconds": seconds[m], "vs_" + ref: seconds[ref] / seconds[m],
                "startup_s": startup.get(m, 0.0), "restarts": restarts[m],
                "peak_rss_mb_per_worker": worker_peak.get(m, [driver_peak]),
                "per_round_chunks_per_s": [row[m] for row in per_round], **checks[m],
            }
        result = {
            "config": dataclasses.asdict(cfg), "command": " ".join(shlex.quote(a) for a in sys.argv),
            **aggregate.environment_info(),
            "batch_size": bs, "chunks": n, "tokens_mean": sum(tokens) / n, "tokens_max": max(tokens),
            "prefix_tokens": len(eng.chunk_prefix_ids), "store": "redis-cluster (3 masters, local)" if cluster else base or "file (temp dir)",
            "modes": modes,
            "note": "serial/batched: peak RSS of the bench process during ingest (model, tokens, every in-process mode); "
                    "ray:N: peak RSS of each worker",
        }
    finally:
        for p in pools.values():
            p.close()
        if ray_started:
            import ray

            ray.shutdown()
        if cluster is not None:
            cluster.stop()
        tmpdir.cleanup()
    result = aggregate.jsonable(result)
    aggregate.write_result(out, "ingest", result, ingest_markdown(result))
    return result


def ingest_markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown table."""
    modes = result["modes"]
    ref = next(iter(modes))
    lines = [
        f"{result['chunks']} chunks (mean {result['tokens_mean']:.0f} tokens, max {result['tokens_max']}, + "
        f"{result['prefix_tokens']}-token shared prefix), batch size {result['batch_size']}, store: {result['store']}",
        "",
        f"| mode | chunks/s | vs {ref} | worker start s | peak RSS MiB per worker | served | answer hit rate (min) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for m, d in modes.items():
        rss = ", ".join(f"{x:.0f}" for x in d["peak_rss_mb_per_worker"])
        hr = "-" if d["answer_hit_rate_min"] is None else f"{d['answer_hit_rate_min']:.2f}"
        lines.append(f"| {m} | {d['chunks_per_s']:.2f} | {d['vs_' + ref]:.2f}x | {d['startup_s']:.1f} | {rss} | "
                     f"{d['served']}/{result['chunks']} | {hr} |")
    lines += ["", f"command: `{result['command']}`", ""]
    return "\n".join(lines)


__all__ = ["IngestBenchConfig", "ingest_markdown", "read_chunks", "run_ingest_bench"]
