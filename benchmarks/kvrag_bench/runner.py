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

Its data (:mod:`kvrag_bench.data`), settings (:mod:`kvrag_bench.config`), answer extraction
(:mod:`kvrag_bench.extract`) and memory probe (:mod:`kvrag_bench.memory`) live in their own modules.

One line per finished request is appended to ``results.jsonl`` (flushed and fsynced), so a rerun with the same
configuration skips finished requests. ``summary.json`` / ``summary.md`` and the Pareto plots are rewritten at
the end of every run (:mod:`kvrag_bench.aggregate`, :mod:`kvrag_bench.plots`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import FusionMethod, get_method
from kvrag.fusion.cost import ModelCost
from kvrag.kv import hf_cache
from kvrag.prompting import RagTemplate, get_template
from kvrag_bench import aggregate, provenance
from kvrag_bench.config import BenchConfig, resolve_methods
from kvrag_bench.data import QARequest, load_requests
from kvrag_bench.extract import EXTRACTORS
from kvrag_bench.memory import PeakMemory
from kvrag_bench.metrics import exact_match, f1_score, kl_divergence, kv_rel_rmse

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
RUN_INFO = "run.json"


def ensure_cached(engine: Any, plans: Sequence[Any], progress: bool = False) -> int:
    """Compute and store every cache ``plans`` reuse (preamble, chunks, text between chunks), untimed.

    Returns:
        How many caches were computed (the rest were already stored).
    """
    todo = dict.fromkeys((seg.kind == "prefix", seg.token_ids) for plan in plans for seg in plan.context)
    computed = 0
    for is_prefix in (True, False):  # the segments' own ids (aligned to the prompt), keyed as the fetch keys them
        kind = "prefix" if is_prefix else "chunk"
        refs = [engine.chunk_ref(ids, kind) for p, ids in todo if p == is_prefix]
        computed += sum(not cached for _, cached in engine.ensure(refs, kind=kind, batch_size=1, progress=progress))
    return computed


def request_digest(req: QARequest) -> str:
    """What a finished row's numbers depend on in its data row: question, gold answers, passages (a resumed run
    reruns a request whose row changed in the data file since, instead of reporting the old scores)."""
    blob = json.dumps([req.question, list(req.answers), [list(c) for c in req.contexts]], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
        provenance.run_git_sha()  # pin the commit this run executes before it starts
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

            loaded = load_model(self.cfg.model, device=self.cfg.device, dtype=self.cfg.dtype,
                                quantize=self.cfg.quantize)
            self._engine = KVRAGEngine(loaded, store_from_url(self.cfg.store), EngineConfig(chunk_prefix=self.cfg.chunk_prefix))
        return self._engine

    @property
    def peer(self) -> Any:
        if self._peer is None and self.cfg.peer:
            from kvrag_bench.peer import make_peer

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
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            msg = f"cannot create the output directory {str(self.out)!r} ({e.strerror}); pass another --out"
            raise ConfigError(msg) from e
        key = self.resume_key()
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        info_path = self.out / RUN_INFO
        results = self.out / RESULTS
        if self.cfg.overwrite and results.exists():
            results.unlink()
        if results.exists() and info_path.exists():
            old = json.loads(info_path.read_text())
            if old.get("resume_digest") != digest:
                now = json.loads(json.dumps(key))  # as stored: tuples (the template's examples) become lists
                diff = sorted(k for k in now if old.get("resume_key", {}).get(k) != now[k])
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
        tokens = list(prep.token_ids)
        k, v = hf_cache.cache_to_tensors(prep.cache)  # [L, H_kv, T, D] incl. generated tokens
        # the prompt length this method prefilled: `full` prefills the prompt's own tokenization
        # (plan.as_prompt_tokenized()), which differs from the spliced plan when a chunk is inexact (e.g. an empty
        # passage); cutting at the spliced length would keep generated tokens in full's cache and corrupt the
        # teacher-forced reference of every method's KL
        t0 = prep.plan.total_len
        k, v = k[:, :, :t0], v[:, :, :t0]
        answer = self.extract(text)
        stats = prep.stats.to_dict()
        record = {
            "method": repr(prep.method),
            "raw": text,
            "answer": answer,
            "f1": f1_score(answer, req.answers),
            "em": exact_match(answer, req.answers),
            "token_ids": tokens,
            "generated_tokens": len(tokens),
            "ttft_s": prep.timings.ttft_s,
            "timings": prep.timings.to_dict(),
            "peak_mem_bytes": mem.peak_bytes,
            "peak_mem_kind": mem.kind,
            "kv_cache_bytes": int(k.numel() * k.element_size() + v.numel() * v.element_size()),
            "method_stats": stats.pop("method_stats", {}),
            "stats": stats,
        }
        record["flop_share"] = self.cost.share(prep.stats.method_stats, plan.context_len, len(plan.suffix.token_ids),
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
            "request_digest": request_digest(req),
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
        if not reqs:
            msg = (f"no QA requests selected from {cfg.data} (offset={cfg.offset}, limit={cfg.limit}): the file has no "
                   "rows or --offset is past its end")
            raise ConfigError(msg)
        rows = self._prepare_out_dir()
        self._probe_first(reqs)  # drops methods that cannot run, before deciding which requests are finished
        by_id = {r.id: r for r in reqs}
        changed = [r["id"] for r in rows if r.get("id") in by_id and not _same_request(r, by_id[r["id"]])]
        for rid in changed:
            log.warning("request %s changed in %s since %s/%s was written (question, answers or passages); "
                        "running it again", rid, cfg.data, self.out, RESULTS)
        done = {r["id"] for r in rows if self._done(r) and r["id"] not in changed}
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
        if not todo and not any(r.id in done for r in reqs):
            msg = (f"every selected request is too long for the model's context window {self.engine.max_context} "
                   f"with {cfg.max_new_tokens} new tokens: {too_long}; use shorter or fewer passages or a model "
                   "with a longer window")
            raise ConfigError(msg)
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
                "quantize": eng.loaded.quantize, "device": str(eng.loaded.device), "max_context": eng.max_context, "chunk_prefix": eng.config.chunk_prefix,
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
                   "template": dataclasses.asdict(self.template), "model": self._model_info(),
                   "machine": provenance.machine_info(self.engine.loaded.device, self.engine.loaded.dtype)},
        )
        summary["config"]["template"] = self.template.name
        aggregate.write_summary(self.out, summary)
        if self.cfg.plots and summary["methods"]:
            from kvrag_bench import plots

            plots.pareto_plots(summary, self.out)
        return summary



def _same_request(row: dict[str, Any], req: QARequest) -> bool:
    """Whether a results row was computed from this data row (rows written before the digest: question and
    answers, which they store)."""
    d = row.get("request_digest")
    if d is not None:
        return bool(d == request_digest(req))
    return bool(row.get("question") == req.question and row.get("answers") == list(req.answers))
