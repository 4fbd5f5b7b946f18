"""Distributed ingest on Ray: the driver tokenizes and keys the chunks, Ray workers prefill them and write straight
into the shared KV store.

::

    from kvrag import distributed
    report = distributed.ingest(texts, "redis+cluster://10.0.0.5:7000", workers=8)   # local Ray, 8 workers
    report = distributed.ingest(texts, "file:///shared/kv", address="auto", workers=16)  # a running Ray cluster

Flow: the driver (this process) tokenizes every text, computes its content-addressed key, skips the chunks the
store already holds (so a rerun resumes), sorts the rest by length and cuts them into tasks of a few batches. A pool
of Ray actors, each holding the model once (one torch thread each by default), computes each task's caches with the
batched prefill (:func:`kvrag.engine.ingest_prefill.compute_chunk_kvs`) and ``put``s them into the store; only keys, token
ids and small reports travel through Ray, never K/V tensors. The FAISS index and docstore are built by the caller
on the driver (``kvrag ingest --ray`` does).

Failure model: actors are created with ``max_restarts`` / ``max_task_retries``, so a worker process that dies
(OOM-killed, node lost) is restarted by Ray and its task retried. A retried task first skips the keys the store
already has, and stores write atomically under content-addressed keys, so a retry neither duplicates nor corrupts
entries. The store must be shared by the driver and every worker: Redis / Redis Cluster, or a file store on a
shared filesystem (a local Ray: any local directory). ``memory://`` is refused.

Ray is an optional dependency (``pip install 'kvrag[ray]'``); it is imported only when a function here runs, and
``import kvrag`` never imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from kvrag.config import names_default_model
from kvrag.errors import ConfigError, KVRAGError
from kvrag.extras import require

if TYPE_CHECKING:
    from types import ModuleType

    from kvrag.engine.engine import KVRAGEngine

log = logging.getLogger(__name__)

DEFAULT_TASK_BATCHES = 4
"""Batches per Ray task: large enough that scheduling overhead is small, small enough that a retried task redoes
little work and the last tasks balance across workers."""


def _import_ray() -> ModuleType:
    return require("ray", "ray", "distributed ingest")


class TaskReport(TypedDict):
    """What one worker task did: its process, chunks computed and skipped (already stored), seconds, peak RSS."""

    pid: int
    computed: int
    skipped: int
    seconds: float
    peak_rss_mb: float


class PoolReport(TypedDict):
    """What a pool's run did: chunks computed, tasks, seconds (wall and summed over tasks), each worker's peak RSS."""

    computed: int
    tasks: int
    compute_seconds: float
    seconds: float
    worker_peak_rss_mb: list[float]


class IngestRecord(TypedDict):
    """:meth:`IngestReport.to_dict`: the report's fields, ``keys`` counted, and the worker restarts."""

    keys: int
    computed: int
    already_stored: int
    duplicates: int
    skipped_empty: int
    tasks: int
    workers: int
    worker_pids: list[list[int]]
    worker_peak_rss_mb: list[float]
    seconds: float
    compute_seconds: float
    restarts: int


@dataclasses.dataclass
class IngestReport:
    """What a distributed ingest did.

    Attributes:
        keys: chunk keys of the non-empty texts, in input order (like :meth:`KVRAGEngine.ingest`).
        computed: caches computed and stored by the workers in this run.
        already_stored: unique chunks skipped because the store held them when the run started.
        duplicates: texts whose chunk repeats an earlier text in the same run (computed once).
        skipped_empty: empty / whitespace-only texts (not cached).
        tasks: Ray tasks run (each a few batches).
        workers: number of actors.
        worker_pids: process ids seen per actor slot, in order (more than one: Ray restarted that worker).
        worker_peak_rss_mb: peak resident memory per actor slot (MiB, max over its incarnations).
        seconds: wall time of the distributed part (from starting the workers to the last stored task).
        compute_seconds: seconds the workers spent computing and storing (summed over tasks).
    """

    keys: list[str]
    computed: int = 0
    already_stored: int = 0
    duplicates: int = 0
    skipped_empty: int = 0
    tasks: int = 0
    workers: int = 0
    worker_pids: list[list[int]] = dataclasses.field(default_factory=list)
    worker_peak_rss_mb: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    compute_seconds: float = 0.0

    @property
    def restarts(self) -> int:
        """Worker processes Ray had to restart (a died worker whose task was retried)."""
        return sum(max(0, len(p) - 1) for p in self.worker_pids)

    def to_dict(self) -> IngestRecord:
        return {"keys": len(self.keys), "computed": self.computed, "already_stored": self.already_stored,
                "duplicates": self.duplicates, "skipped_empty": self.skipped_empty, "tasks": self.tasks,
                "workers": self.workers, "worker_pids": [list(p) for p in self.worker_pids],
                "worker_peak_rss_mb": list(self.worker_peak_rss_mb), "seconds": self.seconds,
                "compute_seconds": self.compute_seconds, "restarts": self.restarts}


def shared_store_url(store: str) -> str:
    """``store`` as a URL every worker can open: a plain path becomes ``file:///abs/path``.

    Raises:
        ConfigError: ``memory://`` (private to one process) or not a string.
    """
    if not isinstance(store, str) or not store:
        msg = f"distributed ingest needs a store URL string, got {store!r}; e.g. redis://host:6379/0 or file:///shared/kv"
        raise ConfigError(msg)
    if store.lower().startswith("memory://"):
        msg = (f"store {store!r} is private to one process, so Ray workers cannot write into it; use a shared store: "
               "redis://host:6379/0, redis+cluster://host:7000 or file:///path/on/a/shared/filesystem")
        raise ConfigError(msg)
    if "://" not in store:
        return "file://" + str(Path(store).expanduser().resolve())
    return store


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class IngestWorker:
    """The Ray actor body: loads the model once and stores the caches of the tasks it is given.

    Args:
        model: model to load (HF id / path; None: the embedded default), the same the driver keys chunks with.
        store: shared store URL.
        chunk_prefix: ``EngineConfig.chunk_prefix`` (must match the driver's).
        dtype: compute dtype name (None: kvrag's default for the device).
        quantize: the driver's weight quantization ("int4" / "int8", None: dense), as it loaded its model.
        torch_threads: torch intra-op threads in this worker.
        expect_fingerprint: the driver's model fingerprint; a worker that loads different weights refuses to run.
        expect_prefix: the driver's ``chunk_prefix_ids``.
    """

    def __init__(self, model: str | None, store: str, chunk_prefix: str, dtype: str | None, quantize: str | None,
                 torch_threads: int, expect_fingerprint: str, expect_prefix: Sequence[int]) -> None:
        import torch

        torch.set_num_threads(max(1, torch_threads))
        from kvrag.engine.engine import KVRAGEngine

        self.engine = KVRAGEngine.from_pretrained(model, store, dtype=dtype, chunk_prefix=chunk_prefix,
                                                  quantize=quantize, on_store_error="raise")
        fp = self.engine.loaded.fingerprint
        if fp != expect_fingerprint or tuple(self.engine.chunk_prefix_ids) != tuple(expect_prefix):
            msg = (f"Ray worker loaded model {model!r} with fingerprint {fp[:16]} (prefix of "
                   f"{len(self.engine.chunk_prefix_ids)} tokens) but the driver keys chunks for "
                   f"{expect_fingerprint[:16]} ({len(expect_prefix)} tokens); give the workers the same model "
                   "path/id, dtype, quantization and chunk_prefix (a path must exist on every node)")
            raise ConfigError(msg)

    def pid(self) -> int:
        return os.getpid()

    def run(self, items: Sequence[tuple[str, Sequence[int]]], batch_size: int) -> TaskReport:
        """Compute and store the caches of ``(key, token_ids)`` items the store lacks; returns a small report."""
        t0 = time.perf_counter()
        eng = self.engine
        refs = [eng.chunk_ref(ids) for _, ids in items]
        if any(r.key != key for r, (key, _) in zip(refs, items, strict=True)):
            msg = "a task's key does not match its token ids under this worker's model; driver and worker differ"
            raise ConfigError(msg)
        # the engine's one ensure path on the raw store: a retried task skips what is stored (one EXISTS round trip)
        done = eng.ensure(refs, store=eng.store, batch_size=batch_size)
        todo = [r for r, cached in done if not cached]
        return {"pid": os.getpid(), "computed": len(todo), "skipped": len(items) - len(todo),
                "seconds": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb()}


def _worker_env(torch_threads: int) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    for k in ("KVRAG_HOME", "HF_HOME", "PYTHONPATH"):
        if k in os.environ:
            env[k] = os.environ[k]
    return env


def init_ray(address: str | None, workers: int, torch_threads: int = 1) -> bool:
    """Connect to Ray at ``address``, or start a local Ray with ``workers`` CPUs. Returns True if started here.

    An already initialized Ray (``ray.init`` called by the application) is used as it is.
    """
    ray = _import_ray()
    if ray.is_initialized():
        return False
    env = {"env_vars": _worker_env(torch_threads)}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
        return True
    ray.init(num_cpus=workers * torch_threads, include_dashboard=False, runtime_env=env, log_to_driver=False,
             object_store_memory=256 * 1024 * 1024)
    return True


class RayIngest:
    """A pool of :class:`IngestWorker` actors for one model and store (``ingest`` creates and closes one).

    Args:
        engine: the driver's engine (it tokenizes and keys chunks; its model name, dtype and chunk prefix are what
            the workers load).
        store: shared store URL the workers write to (the driver checks it for stored chunks).
        workers: number of actors (each loads the model once).
        model: what the workers load (default: ``engine.loaded.name``).
        torch_threads: torch threads per worker.
        max_retries: restarts per actor and retries per task after a worker dies.

    Raises:
        ConfigError: bad ``workers`` / ``torch_threads`` / ``max_retries`` or a non-shareable store.
        ImportError: Ray is not installed.
    """

    def __init__(self, engine: KVRAGEngine, store: str, workers: int = 2, *, model: str | None = None, torch_threads: int = 1,
                 max_retries: int = 3) -> None:
        for name, v, lo in (("workers", workers, 1), ("torch_threads", torch_threads, 1), ("max_retries", max_retries, 0)):
            if not isinstance(v, int) or v < lo:
                msg = f"{name} must be an int >= {lo}, got {v!r}"
                raise ConfigError(msg)
        self.ray = _import_ray()
        self.engine = engine
        self.store = shared_store_url(store)
        self.workers = workers
        name = engine.loaded.name if model is None else model
        self.model = None if names_default_model(name) else name
        if self.model is not None and Path(self.model).expanduser().is_dir():  # workers may run in another cwd
            self.model = str(Path(self.model).expanduser().resolve())
        from kvrag.kv.spec import dtype_name

        remote = self.ray.remote(num_cpus=torch_threads, max_restarts=max_retries, max_task_retries=max_retries)(IngestWorker)
        args = (self.model, self.store, engine.config.chunk_prefix, dtype_name(engine.loaded.dtype),
                engine.loaded.quantize, torch_threads, engine.loaded.fingerprint, tuple(engine.chunk_prefix_ids))
        self.actors = [remote.remote(*args) for _ in range(workers)]
        try:
            self.pids = [[int(p)] for p in self.ray.get([a.pid.remote() for a in self.actors])]
        except Exception as e:
            self.close()
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, KVRAGError):
                raise cause from e
            msg = f"the Ray workers failed to start: {cause}"
            raise KVRAGError(msg) from e

    def run(self, items: Sequence[tuple[str, Sequence[int]]], batch_size: int | None = None,
            task_chunks: int | None = None, progress: bool = False) -> PoolReport:
        """Compute and store ``(key, token_ids)`` items on the actors; returns task/worker statistics."""
        from tqdm.auto import tqdm

        from kvrag.engine.ingest_prefill import DEFAULT_BATCH_SIZE

        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if not isinstance(bs, int) or bs < 1:
            msg = f"batch_size must be an int >= 1, got {batch_size!r}"
            raise ConfigError(msg)
        # a few batches per task, but at least one task per worker
        per_task = task_chunks or max(1, min(bs * DEFAULT_TASK_BATCHES, -(-len(items) // self.workers)))
        order = sorted(items, key=lambda kv: -len(kv[1]))  # similar lengths share a task (and a batch)
        tasks = [[(k, list(ids)) for k, ids in order[i : i + per_task]] for i in range(0, len(order), per_task)]
        ray = self.ray
        peak = [0.0] * len(self.actors)
        stats: PoolReport = {"computed": 0, "tasks": len(tasks), "compute_seconds": 0.0, "seconds": 0.0,
                             "worker_peak_rss_mb": []}
        t0 = time.perf_counter()
        bar = tqdm(total=len(items), desc=f"caching chunks on {self.workers} Ray workers", unit="chunk",
                   disable=not progress)
        pending: dict[Any, tuple[int, int]] = {}
        nxt = 0
        try:
            # Two tasks in flight per actor: the next one is queued while the current one runs.
            while nxt < len(tasks) or pending:
                busy = [slot for slot, _ in pending.values()]
                while nxt < len(tasks):  # the least busy actor first, so work spreads over all of them
                    slot = min(range(len(self.actors)), key=busy.count)
                    if busy.count(slot) >= 2:
                        break
                    ref = self.actors[slot].run.remote(tasks[nxt], bs)
                    pending[ref] = (slot, nxt)
                    busy.append(slot)
                    nxt += 1
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    slot, ti = pending.pop(ref)
                    try:
                        r = ray.get(ref)
                    except Exception as e:
                        cause = getattr(e, "cause", None)
                        if isinstance(cause, KVRAGError):
                            raise cause from e
                        msg = (f"Ray task {ti} ({len(tasks[ti])} chunks) failed after its retries: {e}; the chunks "
                               "stored so far are kept -- rerun the same ingest to resume")
                        raise KVRAGError(msg) from e
                    if r["pid"] not in self.pids[slot]:
                        log.warning("Ray worker %d was restarted (pid %s -> %s); its task was retried",
                                    slot, self.pids[slot][-1], r["pid"])
                        self.pids[slot].append(int(r["pid"]))
                    peak[slot] = max(peak[slot], float(r["peak_rss_mb"]))
                    stats["computed"] += int(r["computed"])
                    stats["compute_seconds"] += float(r["seconds"])
                    bar.update(len(tasks[ti]))
        finally:
            bar.close()
        stats["seconds"] = time.perf_counter() - t0
        stats["worker_peak_rss_mb"] = peak
        return stats

    def close(self) -> None:
        """Stop the actors (their processes exit)."""
        for a in getattr(self, "actors", []):
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                log.debug("actor already gone", exc_info=True)
        self.actors = []


def plan_items(engine: KVRAGEngine, texts: Sequence[str]) -> tuple[list[str], list[tuple[str, list[int]]], dict[str, int]]:
    """Tokenize and key ``texts`` on the driver; returns (keys of non-empty texts, unique items to compute, counts).

    Raises:
        ContextLengthError: a chunk does not fit the model's context window (before any work is sent).
    """
    refs = engine.identify(texts)  # tokenized, length-checked and keyed as the engine does (no store access)
    keys: list[str] = []
    ids_of: dict[str, list[int]] = {}
    empty = 0
    for i, r in enumerate(refs):
        if r is None:
            log.warning("skipping empty or whitespace-only chunk #%d", i)
            empty += 1
            continue
        ids_of.setdefault(str(r.key), list(r.token_ids or ()))
        keys.append(str(r.key))
    stored = engine.store.contains_many(list(ids_of))  # one round trip for all
    todo = [(k, ids) for (k, ids), ok in zip(ids_of.items(), stored, strict=True) if not ok]
    counts = {"skipped_empty": empty, "duplicates": len(keys) - len(ids_of), "already_stored": len(ids_of) - len(todo)}
    return keys, todo, counts


def ingest(
    texts: Sequence[str],
    store: str,
    *,
    engine: KVRAGEngine | None = None,
    model: str | None = None,
    workers: int = 2,
    address: str | None = None,
    batch_size: int | None = None,
    chunk_prefix: str = "template",
    torch_threads: int = 1,
    max_retries: int = 3,
    task_chunks: int | None = None,
    progress: bool = False,
) -> IngestReport:
    """Compute and store the caches of ``texts`` on Ray workers (the distributed :meth:`KVRAGEngine.ingest`).

    Args:
        texts: chunk texts exactly as prompts will contain them (e.g. ``render_passage(chunk)``).
        store: shared store URL (``redis://``, ``redis+cluster://``, ``file:///shared/path`` or a path).
        engine: the driver's engine (tokenizes and keys; its model and chunk prefix are what workers load). Default:
            one is loaded from ``model`` with ``chunk_prefix``.
        model: HF id or local path the workers load (None: the engine's model / the embedded default); a path
            must exist on every node.
        workers: Ray actors; each loads the model once.
        address: a running Ray cluster (``auto``, ``ray://head:10001``); None starts a local Ray with ``workers``
            CPUs (stopped at the end). An already initialized Ray is used as it is.
        batch_size: chunks per prefill forward in a worker.
        chunk_prefix: ``EngineConfig.chunk_prefix`` when ``engine`` is None.
        torch_threads: torch threads per worker.
        max_retries: restarts of a died worker and retries of its task.
        task_chunks: chunks per Ray task (default ``batch_size * 4``).
        progress: show a progress bar.

    Returns:
        An :class:`IngestReport` (keys in input order, counts, per-worker pids and peak memory).

    Raises:
        ConfigError: a non-shareable store, bad numbers, or workers that load a different model.
        ContextLengthError: a chunk does not fit the context window (nothing is computed).
        KVRAGError: a task failed after its retries (what was stored is kept; rerun to resume).
    """
    url = shared_store_url(store)
    if engine is None:
        from kvrag.engine.engine import KVRAGEngine

        engine = KVRAGEngine.from_pretrained(model, url, chunk_prefix=chunk_prefix, on_store_error="raise")
    keys, todo, counts = plan_items(engine, texts)
    report = IngestReport(keys=keys, workers=workers, skipped_empty=counts["skipped_empty"],
                          duplicates=counts["duplicates"], already_stored=counts["already_stored"])
    if not todo:
        log.info("every chunk is stored already; nothing to compute")
        return report
    _import_ray()
    started = init_ray(address, workers, torch_threads)
    pool = None
    try:
        t0 = time.perf_counter()
        pool = RayIngest(engine, url, workers, model=model, torch_threads=torch_threads, max_retries=max_retries)
        st = pool.run(todo, batch_size, task_chunks, progress)
        report.seconds = time.perf_counter() - t0
        report.computed, report.tasks, report.compute_seconds = st["computed"], st["tasks"], st["compute_seconds"]
        report.worker_pids, report.worker_peak_rss_mb = pool.pids, st["worker_peak_rss_mb"]
    finally:
        if pool is not None:
            pool.close()
        if started:
            import ray

            ray.shutdown()
    engine._count(chunks_computed=report.computed, chunks_reused=len(keys) - report.computed)
    return report


__all__ = ["IngestReport", "IngestWorker", "RayIngest", "ingest", "init_ray", "plan_items", "shared_store_url"]
