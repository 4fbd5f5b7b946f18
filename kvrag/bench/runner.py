"""The QA benchmark: every fusion method on the same multi-document QA requests, cache-ready.

For each request (one JSONL row: ``{"id", "source", "question", "answers", "contexts": [{"title", "text"}]}``,
each context passage one reusable chunk, in the given order):

1. the prompt is rendered with one fixed template (:mod:`kvrag.prompting`) and planned into
   prefix | chunk* | suffix;
2. every chunk cache (and the preamble's) is built **before** timing (cache-ready TTFT, as the papers measure);
3. the methods run interleaved on the request (the order rotates from request to request, so load noise and
   warm caches hit every method alike): prepare + greedy decode, timed by the engine (TTFT and its breakdown),
   with the peak memory of the call;
4. untimed fidelity: from each method's repaired cache, next-token logits teacher-forced along the full-prefill
   answer (<= ``kl_tokens`` tokens) give KL(full || method) and first-token agreement; the context K/V give the
   relative RMSE vs the full prefill by region (first chunk, the first ``boundary_tokens`` of each later chunk,
   the interior of later chunks).

One line per finished request is appended to ``results.jsonl`` (flushed and fsynced), so a rerun with the same
configuration skips finished requests. ``summary.json`` / ``summary.md`` and the Pareto plots are rewritten at
the end of every run (:mod:`kvrag.bench.aggregate`, :mod:`kvrag.bench.plots`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.bench import aggregate
from kvrag.bench.flops import ModelCost
from kvrag.bench.metrics import exact_match, extract_answer, f1_score, kl_divergence, kv_rel_rmse
from kvrag.config import EngineConfig, GenerationConfig
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import FusionMethod, available_methods, get_method, parse_method_spec
from kvrag.kv import hf_cache
from kvrag.prompting import RagTemplate, get_template, render_passage

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
RUN_INFO = "run.json"

_YES_NO = re.compile(r"^(yes|no)\b", re.IGNORECASE)
# a sentence end: ., ! or ? after 3 lower-case letters/digits (so "Dr. X", "St. Cloud", "U.S. Army" do not split)
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"']{3}[.!?])\s+(?=[A-Z\"'(])")


def extract_short(text: str) -> str:
    """``extract_answer``'s first line, then: a leading "Yes"/"No" alone, else only the first sentence.

    Small models answer "No, the film ... was released later." or "X is Y. It was ..."; SQuAD F1 rewards the
    span, so keep the part that can be the answer without guessing inside a sentence.
    """
    line = extract_answer(text)
    m = _YES_NO.match(line)
    if m:
        return m.group(1).lower()
    first = _SENTENCE_END.split(line, maxsplit=1)[0]
    return first.rstrip(".!? ").strip() or line


EXTRACTORS: dict[str, Callable[[str], str]] = {
    "line": extract_answer,
    "raw": lambda t: t.strip(),
    "short": extract_short,
}
"""Answer extraction by a template's ``answer_extraction`` mode (:data:`kvrag.prompting.ANSWER_EXTRACTIONS`)."""


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QARequest:
    """One benchmark request; ``contexts`` are (title, text) pairs, each a reusable chunk."""

    id: str
    question: str
    answers: tuple[str, ...]
    contexts: tuple[tuple[str, str], ...]
    source: str = ""

    def passages(self) -> list[str]:
        """The rendered chunk texts, in order (exactly the strings the prompt contains)."""
        return [render_passage(text, title) for title, text in self.contexts]


def load_requests(path: str | os.PathLike[str], limit: int | None = None, offset: int = 0) -> list[QARequest]:
    """Read and validate a QA JSONL file; rows ``offset .. offset+limit-1`` (file order).

    Raises:
        ConfigError: missing file, bad JSON or a row that does not follow the schema (the message names the line).
    """
    p = Path(path)
    if not p.is_file():
        msg = f"QA data file {str(p)!r} not found; expected a JSONL file with id/question/answers/contexts rows"
        raise ConfigError(msg)
    out: list[QARequest] = []
    seen: set[str] = set()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rid = str(row["id"])
                q = str(row["question"])
                answers = row["answers"]
                ctx = row["contexts"]
                if isinstance(answers, str) or not answers or not all(isinstance(a, str) for a in answers):
                    raise ValueError("'answers' must be a non-empty list of strings")
                if not isinstance(ctx, list) or not ctx:
                    raise ValueError("'contexts' must be a non-empty list of {title, text} objects")
                contexts = tuple((str(c.get("title") or ""), str(c["text"])) for c in ctx)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                msg = (f"{p}:{lineno}: bad QA row ({e}); expected "
                       '{"id", "question", "answers": [..], "contexts": [{"title", "text"}, ..]}')
                raise ConfigError(msg) from e
            if rid in seen:
                msg = f"{p}:{lineno}: duplicate request id {rid!r}"
                raise ConfigError(msg)
            seen.add(rid)
            out.append(QARequest(rid, q, tuple(answers), contexts, str(row.get("source", ""))))
    if offset < 0 or (limit is not None and limit < 0):
        msg = f"offset and limit must be >= 0, got offset={offset}, limit={limit}"
        raise ConfigError(msg)
    out = out[offset:]
    return out[:limit] if limit is not None else out


# ----------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BenchConfig:
    """Settings of one QA benchmark run.

    Attributes:
        data: QA JSONL path.
        out: output directory (results.jsonl, summary.json, summary.md, PNGs).
        methods: method specs as given (e.g. ``["full", "stale", "relaxkv:r=0.15"]``); unregistered methods are
            skipped with a warning, bad parameters of registered ones are errors.
        limit, offset: which rows of ``data`` (file order).
        model: HF id / path, or None for the embedded default.
        template: prompt template name (:data:`kvrag.prompting.TEMPLATES`), None for the default.
        max_new_tokens: greedy decode budget per answer.
        kl_tokens: teacher-forced positions for KL (the first tokens of the full-prefill answer).
        boundary_tokens: how many leading tokens of each later chunk count as its boundary region.
        seed: torch seed and bootstrap seed.
        bootstrap: bootstrap resamples for intervals (0 disables intervals).
        peer: optional peer runner (``"llamaindex-hf"``).
        store: KV store URL for the chunk caches.
        cache_budget_bytes: build every request's caches up front when they fit in this many bytes, else build
            each request's caches right before it (still untimed).
        chunk_prefix: engine ``chunk_prefix`` mode.
        warmup: requests run untimed first (not recorded).
        threads: torch intra-op threads (None: torch default).
        device, dtype: model placement (None: defaults).
        overwrite: discard existing results in ``out`` instead of resuming.
        plots: write the Pareto PNGs.
        progress: show progress bars.
    """

    data: str
    out: str
    methods: Sequence[str] = ("full", "stale")
    limit: int | None = None
    offset: int = 0
    model: str | None = None
    template: str | None = None
    max_new_tokens: int = 32
    kl_tokens: int = 32
    boundary_tokens: int = 8
    seed: int = 0
    bootstrap: int = 1000
    peer: str | None = None
    store: str = "memory://?max_bytes=4e9"
    cache_budget_bytes: int = 4_000_000_000
    chunk_prefix: str = "template"
    warmup: int = 1
    threads: int | None = None
    device: str | None = None
    dtype: str | None = None
    overwrite: bool = False
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):
            self.methods = split_method_specs(self.methods)
        self.methods = list(self.methods)
        if not self.methods:
            raise ConfigError("no methods given; pass e.g. --methods full,stale")
        for name, v, lo in (("max_new_tokens", self.max_new_tokens, 1), ("kl_tokens", self.kl_tokens, 1),
                            ("boundary_tokens", self.boundary_tokens, 1), ("bootstrap", self.bootstrap, 0),
                            ("warmup", self.warmup, 0)):
            if v < lo:
                msg = f"{name} must be >= {lo}, got {v}"
                raise ConfigError(msg)
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.peer not in (None, "", "llamaindex-hf"):
            msg = f"unknown peer {self.peer!r}; valid peers: llamaindex-hf"
            raise ConfigError(msg)
        get_template(self.template)  # validates the name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def split_method_specs(s: str) -> list[str]:
    """Split ``"full,relaxkv:r=0.15,k=2,stale"`` into ``["full", "relaxkv:r=0.15,k=2", "stale"]``.

    Commas separate methods and also parameters of one method; a token containing '=' continues the method
    before it.
    """
    out: list[str] = []
    for tok in (t.strip() for t in s.split(",")):
        if not tok:
            continue
        if "=" in tok and ":" not in tok and out:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def method_labels(specs: Sequence[str]) -> list[str]:
    """Labels for specs as given: the spec itself, ``spec#2``, ``spec#3`` ... for repeats."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        seen[s] = seen.get(s, 0) + 1
        out.append(s if seen[s] == 1 else f"{s}#{seen[s]}")
    return out


def resolve_methods(specs: Sequence[str]) -> tuple[dict[str, FusionMethod], list[str]]:
    """Build the registered methods; returns ({label: method}, [skipped specs]).

    A spec whose method name is not registered (a method still being written) is skipped; a registered method
    with bad parameters raises ConfigError.
    """
    registered = set(available_methods())
    methods: dict[str, FusionMethod] = {}
    skipped: list[str] = []
    for label, spec in zip(method_labels(specs), specs, strict=True):
        name, _ = parse_method_spec(spec)
        if name not in registered:
            log.warning("skipping method %r: %r is not a registered fusion method (registered: %s)",
                        spec, name, ", ".join(sorted(registered)))
            skipped.append(spec)
            continue
        methods[label] = get_method(spec)
    if not methods:
        msg = f"none of the methods {list(specs)} is registered; valid methods: {', '.join(sorted(registered))}"
        raise ConfigError(msg)
    return methods, skipped


def ensure_cached(engine: Any, plans: Sequence[Any], progress: bool = False) -> int:
    """Compute and store every cache ``plans`` reuse (preamble, chunks, text between chunks), untimed.

    Returns:
        How many caches were computed (the rest were already stored).
    """
    from tqdm.auto import tqdm

    todo = dict.fromkeys((seg.kind, seg.token_ids) for plan in plans for seg in plan.context)
    computed = 0
    for kind, ids in tqdm(list(todo), desc="caching chunks", unit="chunk", disable=not progress, leave=False):
        _, hit = engine.ensure_ids(ids, "prefix" if kind == "prefix" else "chunk")
        computed += not hit
    return computed


# ----------------------------------------------------------------------------------------------------------------
# Measurement helpers
# ----------------------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        return 0


def _trim_heap() -> None:
    """Return freed heap pages to the OS (glibc) so an RSS increase reflects the next call's own allocations.

    (No ``gc.collect()``: tensors are freed by reference counting, and a full collection costs ~0.5 s once
    transformers is imported.)
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory a block allocates beyond what was in use when it started.

    On CUDA: ``torch.cuda.max_memory_allocated`` (exact). On CPU: the process RSS sampled every ``interval_s``
    by a background thread after trimming the heap (a lower bound; sampling can miss short spikes).
    """

    def __init__(self, device: torch.device, interval_s: float = 0.005) -> None:
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda_allocated" if device.type == "cuda" else "cpu_rss_sampled"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base = 0
        self._max = 0

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._max = max(self._max, _rss_bytes())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _trim_heap()
            self._base = self._max = _rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self._max = max(self._max, _rss_bytes())
            self.peak_bytes = int(max(0, self._max - self._base))


def region_masks(plan: Any, boundary_tokens: int) -> dict[str, torch.Tensor]:
    """Bool masks [Tc] over context positions: ``first`` chunk, ``boundary`` / ``interior`` of later chunks, ``all``.

    Regions with no position are left out.
    """
    tc = plan.context_len
    chunks = [s for s in plan.context if s.kind == "chunk"]
    masks = {name: torch.zeros(tc, dtype=torch.bool) for name in ("first", "boundary", "interior", "all")}
    for i, s in enumerate(chunks):
        masks["all"][s.start : s.end] = True
        if i == 0:
            masks["first"][s.start : s.end] = True
        else:
            b = min(s.end, s.start + boundary_tokens)
            masks["boundary"][s.start : b] = True
            masks["interior"][b : s.end] = True
    return {k: m for k, m in masks.items() if bool(m.any())}


@dataclasses.dataclass
class MethodRun:
    """One method's timed answer plus what the untimed fidelity pass needs."""

    record: dict[str, Any]
    keys: torch.Tensor  # [L, H_kv, Tc+S, D] cache after the suffix prefill (RoPE applied)
    values: torch.Tensor
    last_logits: torch.Tensor  # [V]
    token_ids: list[int]


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------


class QABenchmark:
    """Runs the QA benchmark described in the module docstring.

    Args:
        config: the run settings.
        engine: an existing :class:`kvrag.engine.engine.KVRAGEngine` (tests pass a tiny one); None loads
            ``config.model`` with a ``config.store`` store.
        peer: an existing peer runner (object with ``name`` and ``run(prompt, max_new_tokens) -> dict``); None
            builds the one ``config.peer`` names.
    """

    def __init__(self, config: BenchConfig, engine: Any = None, peer: Any = None) -> None:
        self.cfg = config
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.template: RagTemplate = get_template(config.template)
        self.extract = EXTRACTORS[self.template.answer_extraction]
        self.methods, self.skipped = resolve_methods(config.methods)
        self.labels = list(self.methods)
        self.skip_reasons: dict[str, str] = {spec: "not a registered fusion method" for spec in self.skipped}
        self.out = Path(config.out)
        self._engine = engine
        self._peer = peer
        self.gen = GenerationConfig(max_new_tokens=config.max_new_tokens)

    # -------------------------------------------------------------- lazy heavy objects
    @property
    def engine(self) -> Any:
        if self._engine is None:
            from kvrag.engine.engine import KVRAGEngine
            from kvrag.models import load_model
            from kvrag.store.factory import store_from_url

            loaded = load_model(self.cfg.model, device=self.cfg.device, dtype=self.cfg.dtype)
            self._engine = KVRAGEngine(loaded, store_from_url(self.cfg.store), EngineConfig(chunk_prefix=self.cfg.chunk_prefix))
        return self._engine

    @property
    def peer(self) -> Any:
        if self._peer is None and self.cfg.peer:
            from kvrag.bench.peer import make_peer

            self._peer = make_peer(self.cfg.peer, self.engine)
        return self._peer

    @property
    def peer_names(self) -> list[str]:
        return [self.cfg.peer] if self.cfg.peer else []

    @functools.cached_property
    def cost(self) -> ModelCost:
        """Analytic FLOPs of the engine's model (the FLOP-share column)."""
        return ModelCost.from_config(self.engine.model.config)

    # -------------------------------------------------------------- resume bookkeeping
    def resume_key(self) -> dict[str, Any]:
        """Everything that changes a finished request's numbers (a mismatch forbids resuming)."""
        eng = self.engine
        return {
            "model": self.cfg.model or "default",
            "model_fingerprint": eng.loaded.fingerprint,
            "template": dataclasses.asdict(self.template),
            "max_new_tokens": self.cfg.max_new_tokens,
            "kl_tokens": self.cfg.kl_tokens,
            "boundary_tokens": self.cfg.boundary_tokens,
            "chunk_prefix": eng.config.chunk_prefix,
            "store_dtype": eng.spec.dtype,
        }

    def _prepare_out_dir(self) -> list[dict[str, Any]]:
        self.out.mkdir(parents=True, exist_ok=True)
        key = self.resume_key()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        info_path = self.out / RUN_INFO
        results = self.out / RESULTS
        if self.cfg.overwrite and results.exists():
            results.unlink()
        if results.exists() and info_path.exists():
            old = json.loads(info_path.read_text())
            if old.get("resume_digest") != digest:
                diff = sorted(k for k in key if old.get("resume_key", {}).get(k) != key[k])
                msg = (f"{self.out} holds results of a different configuration (differs in {diff}); "
                       "use another --out directory or pass --overwrite")
                raise ConfigError(msg)
        info = {"resume_key": key, "resume_digest": digest, "config": self.cfg.to_dict()}
        aggregate.write_text_atomic(info_path, json.dumps(aggregate.jsonable(info), indent=2) + "\n")
        rows = list({r.get("id"): r for r in aggregate.read_jsonl(results)}.values())  # a rerun row replaces the old
        # rewrite without a possibly truncated last line, so appends start on a clean line
        aggregate.write_text_atomic(results, "".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def _done(self, row: dict[str, Any]) -> bool:
        return all(lbl in row.get("methods", {}) for lbl in self.labels) and all(
            p in row.get("peers", {}) for p in self.peer_names)

    # -------------------------------------------------------------- planning and caching
    def plan(self, req: QARequest) -> tuple[Any, str]:
        """(plan, full prompt text) of a request."""
        prefix, passages, suffix = self.template.parts(self.engine.tokenizer, req.passages(), req.question)
        return self.engine.plan_parts(prefix, passages, suffix), prefix + "".join(passages) + suffix

    def _fits(self, plan: Any) -> bool:
        return plan.total_len + self.cfg.max_new_tokens < self.engine.max_context

    def ensure_cached(self, plans: Sequence[Any], progress: bool = False) -> int:
        """Compute and store every cache the plans reuse (untimed). Returns how many were computed."""
        return ensure_cached(self.engine, plans, progress)

    def _cache_bytes(self, plans: Sequence[Any]) -> int:
        segs = {(s.kind, s.token_ids): len(s.token_ids) for p in plans for s in p.context}
        return sum(segs.values()) * self.engine.spec.bytes_per_token

    # -------------------------------------------------------------- one method on one request
    def run_method(self, plan: Any, label: str, method: FusionMethod, req: QARequest,
                   gen: GenerationConfig | None = None) -> MethodRun:
        """Timed prepare + decode of one method; returns the record and the cache for the fidelity pass."""
        eng = self.engine
        with PeakMemory(eng.model.device) as mem:
            prep = eng.prepare(plan, method, reserve=(gen or self.gen).max_new_tokens)
            text = "".join(eng.stream(prep, gen or self.gen))
        tokens = list(prep.stats.pop("token_ids"))
        k, v = hf_cache.cache_to_tensors(prep.cache)  # [L, H_kv, T, D] incl. generated tokens
        t0 = plan.total_len
        k, v = k[:, :, :t0], v[:, :, :t0]
        answer = self.extract(text)
        stats = dict(prep.stats)
        record = {
            "method": repr(prep.method),
            "raw": text,
            "answer": answer,
            "f1": f1_score(answer, req.answers),
            "em": exact_match(answer, req.answers),
            "token_ids": tokens,
            "generated_tokens": len(tokens),
            "ttft_s": prep.timings["ttft_s"],
            "timings": dict(prep.timings),
            "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind,
            "kv_cache_bytes": int(k.numel() * k.element_size() + v.numel() * v.element_size()),
            "method_stats": stats.pop("method_stats", {}),
            "stats": stats,
        }
        record["flop_share"] = self.cost.share(record["method_stats"], plan.context_len, len(plan.suffix.token_ids),
                                               full=not prep.method.reads_cache)
        last = prep.last_logits.detach().float()
        del prep
        return MethodRun(record, k, v, last, tokens)

    def teacher_forced(self, run: MethodRun, target: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] along ``target`` from a method's repaired cache (row i predicts target[i]); n >= 1."""
        n = len(target)
        if n <= 1:
            return run.last_logits[None]
        cache = hf_cache.make_cache(run.keys, run.values, self.engine.model.config)
        ids = torch.tensor(list(target[:-1]), dtype=torch.long)
        logits, _ = hf_cache.forward(self.engine.model, ids, cache, start=run.keys.shape[2], logits_to_keep=n - 1)
        return torch.cat([run.last_logits[None].to(logits.device), logits[-(n - 1):]], dim=0)

    def fidelity(self, plan: Any, runs: dict[str, MethodRun], ref: MethodRun) -> None:
        """Fill KL, first-token agreement and KV relative RMSE of every run against the full-prefill ``ref``."""
        target = ref.token_ids[: self.cfg.kl_tokens]
        with torch.inference_mode():
            ref_logits = self.teacher_forced(ref, target)
            masks = region_masks(plan, self.cfg.boundary_tokens)
            tc = plan.context_len
            for run in runs.values():
                logits = ref_logits if run is ref else self.teacher_forced(run, target)
                kl = kl_divergence(ref_logits, logits)
                rec = run.record
                rec["kl"] = float(kl.mean())
                rec["kl_max"] = float(kl.max())
                rec["kl_positions"] = int(kl.numel())
                rec["first_token_agree"] = bool(int(logits[0].argmax()) == int(ref_logits[0].argmax()))
                rmse: dict[str, float | None] = {}
                if run.keys.shape == ref.keys.shape:
                    for tname, a, b in (("k", ref.keys, run.keys), ("v", ref.values, run.values)):
                        for region, m in masks.items():
                            rmse[f"{tname}_{region}"] = kv_rel_rmse(a[:, :, :tc], b[:, :, :tc], m)
                else:
                    log.warning("%s: cache shape %s differs from the full prefill's %s; no KV RMSE",
                                rec["method"], tuple(run.keys.shape), tuple(ref.keys.shape))
                rec["kv_rel_rmse"] = rmse

    def run_request(self, req: QARequest, index: int, gen: GenerationConfig | None = None) -> dict[str, Any]:
        """All methods (and the peer) on one request, interleaved; returns the results.jsonl row."""
        plan, prompt = self.plan(req)
        n = len(self.labels) + len(self.peer_names)
        order = [*self.labels, *(f"peer:{p}" for p in self.peer_names)]
        order = order[index % n:] + order[: index % n]  # rotate: no method always runs first
        runs: dict[str, MethodRun] = {}
        peers: dict[str, dict[str, Any]] = {}
        for label in order:
            if label.startswith("peer:"):
                out = self.peer.run(prompt, (gen or self.gen).max_new_tokens)
                ans = self.extract(out["text"])
                peers[label[5:]] = {**out, "raw": out["text"], "answer": ans,
                                    "f1": f1_score(ans, req.answers), "em": exact_match(ans, req.answers)}
                continue
            runs[label] = self.run_method(plan, label, self.methods[label], req, gen)
        refs = aggregate.reference_labels(self.labels)
        ref = runs[refs["full"]] if refs["full"] else self.run_method(plan, "full", get_method("full"), req, gen)
        self.fidelity(plan, runs, ref)
        return {
            "id": req.id,
            "source": req.source,
            "question": req.question,
            "answers": list(req.answers),
            "n_chunks": sum(s.kind == "chunk" for s in plan.context),
            "context_tokens": plan.context_len,
            "suffix_tokens": len(plan.suffix.token_ids),
            "reference_answer_tokens": len(ref.token_ids),
            "order": order,
            "methods": {lbl: runs[lbl].record for lbl in self.labels},
            "peers": peers,
        }

    # -------------------------------------------------------------- the whole run
    def run(self, requests: Sequence[QARequest] | None = None) -> dict[str, Any]:
        """Run (or resume) the benchmark and write every output; returns the summary dict."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        reqs = list(requests) if requests is not None else load_requests(cfg.data, cfg.limit, cfg.offset)
        rows = self._prepare_out_dir()
        self._probe_first(reqs)  # drops methods that cannot run, before deciding which requests are finished
        done = {r["id"] for r in rows if self._done(r)}
        todo, plans, too_long = [], {}, []
        for r in reqs:
            if r.id in done:
                continue
            try:
                plan, _ = self.plan(r)
            except ContextLengthError as e:
                too_long.append(r.id)
                log.warning("skipping request %s: %s", r.id, e)
                continue
            if not self._fits(plan):
                too_long.append(r.id)
                log.warning("skipping request %s: %d prompt tokens + %d new tokens exceed the context window %d",
                            r.id, plan.total_len, cfg.max_new_tokens, self.engine.max_context)
                continue
            todo.append(r)
            plans[r.id] = plan
        log.info("%d requests: %d finished earlier, %d to run, %d too long", len(reqs), len(done), len(todo), len(too_long))
        upfront = self._cache_bytes([plans[r.id] for r in todo]) <= cfg.cache_budget_bytes
        if todo and upfront:
            self.ensure_cached([plans[r.id] for r in todo], progress=cfg.progress)
        if todo:
            warm_gen = GenerationConfig(max_new_tokens=min(2, cfg.max_new_tokens))
            for r in todo[: cfg.warmup]:
                self.ensure_cached([plans[r.id]])
                self.run_request(r, 0, warm_gen)
        finished = [r for r in rows if r.get("id") not in {t.id for t in todo}]
        bar = tqdm(todo, desc="bench", unit="req", disable=not cfg.progress)
        with (self.out / RESULTS).open("a", encoding="utf-8") as f:
            for i, r in enumerate(bar):
                if not upfront:
                    self.ensure_cached([plans[r.id]])
                row = self.run_request(r, len(done) + i)
                f.write(json.dumps(aggregate.jsonable(row)) + "\n")
                f.flush()
                os.fsync(f.fileno())
                finished.append(row)
                bar.set_postfix(self._running_f1(finished))
        return self.finish(reqs, finished, too_long)

    def _probe_first(self, reqs: Sequence[QARequest]) -> None:
        for r in reqs:
            try:
                plan, _ = self.plan(r)
            except ContextLengthError:
                continue
            if self._fits(plan):
                self.probe_methods(plan)
                return

    def probe_methods(self, plan: Any) -> None:
        """Prepare ``plan`` once with every method (untimed); a method that fails with a configuration error
        (e.g. ``cacherepair`` without a checkpoint for this model) is dropped with a warning."""
        from kvrag.errors import KVRAGError

        ensure_cached(self.engine, [plan])
        for label in list(self.labels):
            try:
                self.engine.prepare(plan, self.methods[label])
            except KVRAGError as e:
                log.warning("skipping method %r: %s", label, e)
                self.labels.remove(label)
                self.skipped.append(label)
                self.skip_reasons[label] = str(e)
        if not self.labels:
            msg = f"every method failed on the first request: {self.skip_reasons}"
            raise ConfigError(msg)

    def _model_info(self) -> dict[str, Any]:
        eng = self.engine
        return {"name": str(eng.loaded.name), "fingerprint": eng.loaded.fingerprint, "dtype": str(eng.loaded.dtype),
                "device": str(eng.loaded.device), "max_context": eng.max_context, "chunk_prefix": eng.config.chunk_prefix,
                "kv_spec": eng.spec.to_dict()}

    def _running_f1(self, rows: Sequence[dict[str, Any]]) -> dict[str, str]:
        out = {}
        for lbl in self.labels[:4]:
            xs = [r["methods"][lbl]["f1"] for r in rows if lbl in r.get("methods", {})]
            if xs:
                out[lbl[:12]] = f"{sum(xs) / len(xs):.2f}"
        return out

    def finish(self, reqs: Sequence[QARequest], rows: Sequence[dict[str, Any]], too_long: Sequence[str] = ()) -> dict[str, Any]:
        """Aggregate the rows of ``reqs`` and write summary.json, summary.md and the plots."""
        ids = {r.id for r in reqs}
        mine = [r for r in rows if r.get("id") in ids]
        summary = aggregate.summarize(
            mine, self.labels, peers=self.peer_names, config=self.cfg.to_dict(), n_boot=self.cfg.bootstrap,
            seed=self.cfg.seed,
            extra={"skipped_methods": list(self.skipped), "skip_reasons": dict(self.skip_reasons), "skipped_requests_too_long": list(too_long),
                   "template": dataclasses.asdict(self.template), "model": self._model_info()},
        )
        summary["config"]["template"] = self.template.name
        aggregate.write_summary(self.out, summary)
        if self.cfg.plots and summary["methods"]:
            from kvrag.bench import plots

            plots.pareto_plots(summary, self.out)
        return summary


def run_benchmark(config: BenchConfig, engine: Any = None, peer: Any = None) -> dict[str, Any]:
    """Convenience: ``QABenchmark(config, engine, peer).run()``."""
    t = time.perf_counter()
    summary = QABenchmark(config, engine, peer).run()
    log.info("benchmark finished in %.1f s", time.perf_counter() - t)
    return summary
