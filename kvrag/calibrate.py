"""``kvrag calibrate``: time the model on this machine, per compute dtype, and write what ``auto`` and the dtype
policy need (:mod:`kvrag.calibration`).

On a small built-in workload (:func:`builtin_workload`: synthetic RAG prompts of about 1.1K, 1.5K and 1.9K tokens
built from the fictional passages in ``kvrag/data/calibration/passages.json``, chunk caches stored first, as a
warm store would hold them) it times ``full`` and every candidate of the base cost model (the shipped one by
default), methods interleaved request by request so that a drift of the machine's load hits every method alike,
with one torch thread by default. Per dtype it records:

* ``auto``'s cost model for this machine kind and dtype: per candidate its mean stats, FLOP share, TTFT ratio to
  ``full`` (of the median TTFTs), median and p90 overhead, and the absolute speed of a full prefill (seconds per
  FLOP). Each candidate keeps the KL of the base cost model: the KL measures what a method's repair changes in
  the model's next-token distributions, which is a property of the method and the model, not of the machine, and
  measuring it needs the benchmark's held-out data and many requests, which a one-minute calibration cannot;
* the model's prefill speed (tokens/s of a full prefill at ~1.5K tokens) and decode speed (ms per token at ~1.5K
  tokens of context);
* every method's median TTFT and its end-to-end time TTFT + 32 decode steps (:data:`kvrag.calibration.ANSWER_TOKENS`);
* where kvrag's row attention reads narrower K/V (bfloat16 under float32; int8 under float32 or bfloat16): each K/V
  dtype's decode speed with :data:`kvrag.calibration.KV_BATCH` rows at once (the dtypes interleaved), and each
  narrower one's next-token KL against the compute dtype's K/V along a greedy answer, which name the K/V dtype to
  set (``EngineConfig.kv_dtype``; the report prints it, :meth:`kvrag.calibration.DtypeCalibration.preferred_kv_dtype`).

It runs the default model for real, so it takes a while; run it once per machine kind.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from kvrag.calibration import (
    ANSWER_TOKENS,
    KV_BATCH,
    Calibration,
    DtypeCalibration,
    MachineDescription,
    cpu_flags,
    machine_kind,
    save_calibration,
    variant_key,
)
from kvrag.errors import ConfigError
from kvrag.fusion import MethodStats, shared_method
from kvrag.fusion.auto import dtype_label
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.cost_model import Candidate, CostModel, load_cost_model
from kvrag.kv import hf_cache
from kvrag.prompting import RagTemplate, render_passage
from kvrag.threads import set_torch_threads

if TYPE_CHECKING:
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.planner import Plan
    from kvrag.engine.results import Prepared
    from kvrag.models import LoadedModel

log = logging.getLogger(__name__)

WORKLOAD_FILE = Path(__file__).resolve().parent / "data" / "calibration" / "passages.json"
REQUEST_SIZES = (7, 9, 11)
"""Passages per built-in request: about 1.1K, 1.5K and 1.9K prompt tokens with the default model's tokenizer."""
TARGET_TOKENS = 1536
"""Prompt length at which the prefill and decode speeds are reported (the request closest to it)."""


@dataclasses.dataclass(frozen=True)
class CalibrationRequest:
    """One request of the workload: rendered passages (each a chunk) and a question."""

    passages: tuple[str, ...]
    question: str


def builtin_workload(sizes: Sequence[int] = REQUEST_SIZES) -> list[CalibrationRequest]:
    """Requests of ``sizes[i]`` passages each, from the packaged passages (rotated, so each request has its own
    chunk set and order)."""
    data = json.loads(WORKLOAD_FILE.read_text())
    ps = [render_passage(p["text"], p["title"]) for p in data["passages"]]
    qs = data["questions"]
    return [CalibrationRequest(tuple(ps[(3 * i + j) % len(ps)] for j in range(n)), qs[i % len(qs)])
            for i, n in enumerate(sizes)]


@dataclasses.dataclass
class _Runs:
    """One method's measurements over the workload (one entry per request)."""

    spec: str
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    stats: list[MethodStats] = dataclasses.field(default_factory=list)


def _ttft(prep: Prepared) -> float:
    t = prep.timings
    return float(t.fetch_s + t.assemble_s + t.repair_s + t.suffix_prefill_s)


def _mean(xs: Sequence[float | int | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _usable(specs: Sequence[str]) -> list[str]:
    """The specs whose method can be built for this process (e.g. CacheRepair needs a checkpoint for the model,
    checked when it first runs; a spec that fails there is dropped by :func:`measure_dtype`)."""
    out = []
    for spec in specs:
        try:
            shared_method(spec)
        except ConfigError as e:
            log.warning("calibrate: skipping %s (%s)", spec, e)
            continue
        out.append(spec)
    return out


def measure_dtype(
    loaded: LoadedModel,
    base: CostModel,
    *,
    workload: Sequence[CalibrationRequest] | None = None,
    methods: Sequence[str] | None = None,
    decode_steps: int = 8,
    progress: bool = True,
) -> DtypeCalibration:
    """Time ``full`` and the candidates on ``loaded`` (a :class:`kvrag.models.LoadedModel`) in its dtype.

    Args:
        loaded: the model, in the dtype to calibrate.
        base: the cost model whose candidates are timed and whose KLs are kept.
        workload: the requests (default: :func:`builtin_workload`).
        methods: a subset of the base's candidates to time (default: all of them); ``full`` is always timed.
        decode_steps: decode steps timed for the decode speed.
        progress: show a progress bar.
    """
    from tqdm.auto import tqdm

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store import MemoryStore

    reqs = list(workload or builtin_workload())
    wanted = [s for s in (methods or base.candidates) if not s.startswith("auto")]
    unknown = [s for s in wanted if s not in base.candidates and s != "full"]
    if unknown:
        msg = f"calibrate: {unknown} are not candidates of the base cost model ({sorted(base.candidates)})"
        raise ConfigError(msg)
    specs = _usable(["full", *[s for s in wanted if s != "full"]])
    engine = KVRAGEngine(loaded, MemoryStore())
    template = RagTemplate()
    plans = [engine.plan_parts(*template.parts(engine.tokenizer, r.passages, r.question)) for r in reqs]
    engine.ingest(sorted({p for r in reqs for p in r.passages}))
    warm = engine.plan_parts(*template.parts(engine.tokenizer, reqs[0].passages[:2], reqs[0].question))
    runs = {s: _Runs(s) for s in specs}
    bar = tqdm(total=len(specs) * (len(plans) + 1), desc=f"calibrate {dtype_label(loaded.dtype)}", unit="run",
               disable=not progress)
    for spec in list(specs):  # warm-up: one-time costs (a repairer checkpoint loading) are not timed
        try:
            engine.prepare(warm, spec)
        except ConfigError as e:
            log.warning("calibrate: skipping %s (%s)", spec, e)
            specs.remove(spec)
            runs.pop(spec)
        bar.update(1)
    for i, plan in enumerate(plans):
        for spec in specs[i % len(specs):] + specs[: i % len(specs)]:  # interleaved, rotated per request
            prep = engine.prepare(plan, spec)
            runs[spec].ttft_s.append(_ttft(prep))
            runs[spec].stats.append(prep.stats.method_stats)
            del prep
            bar.update(1)
    bar.close()
    near = min(range(len(plans)), key=lambda i: abs(plans[i].total_len - TARGET_TOKENS))
    prefill_tps = plans[near].total_len / runs["full"].ttft_s[near]
    decode_ms = _decode_ms(engine, plans[near], decode_steps)
    kv_ms, kv_kl = _kv_precision(engine, plans[near], decode_steps)
    cost_model = _fit(loaded, base, runs, plans)
    ttft = {s: statistics.median(r.ttft_s) for s, r in runs.items()}
    return DtypeCalibration(
        dtype=dtype_label(loaded.dtype), prefill_tokens_per_s=prefill_tps, decode_ms_per_token=decode_ms,
        ttft_s=ttft, e2e_s={s: t + ANSWER_TOKENS * decode_ms / 1000 for s, t in ttft.items()},
        cost_model=cost_model.to_dict(), kv_decode_ms_per_token=kv_ms, kv_kl=kv_kl,
    )


def next_token_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two next-token log-distributions, renormalized and summed in float64 (a float32 log-softmax
    is normalized only to ~1e-7, which alone can make a tiny KL negative)."""
    lp, lq = p.double().log_softmax(-1), q.double().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


def _kv_precision(engine: KVRAGEngine, plan: Plan, steps: int,
                  rounds: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """({K/V dtype: ms per token of KV_BATCH rows}, {narrower K/V dtype: mean next-token KL}) after ``plan``'s
    prompt, for the K/V dtypes the engine's decode reads in the model's dtype (empty where only its own serves)."""
    from kvrag.kv import batched, row_attention
    from kvrag.kv.attention import IMPL

    model = engine.model
    if batched.batchable(model, IMPL) is not None:
        return {}, {}

    def measured(k: torch.dtype) -> bool:  # the engine would decode over it, and kvrag's kernel reads it
        try:
            batched.decode_kv_dtype(model, dtype_label(k), None, engine.spec.head_dim)
        except ConfigError:
            return False
        return row_attention.why_not(model.dtype, k) is None

    kvs = [model.dtype] + [k for k in (torch.bfloat16, torch.int8) if k != model.dtype and measured(k)]
    if len(kvs) == 1:
        return {}, {}
    prep = engine.prepare(plan, "stale", reserve=steps + 2)
    buf, n = hf_cache.buffer_of(prep.cache)
    tokens, wins = [int(prep.last_logits.argmax())], batched.windows(model)

    def rows(k: torch.dtype, count: int) -> list[batched.Row]:  # copies: the prompt's K/V stay as prepared
        return [batched.Row.for_decode(hf_cache.KVBuffer.wrap(buf.keys[:, :, :n], buf.values[:, :, :n]), n,
                                       n + steps + 2, k) if k != model.dtype else
                batched.Row(hf_cache.KVBuffer.wrap(buf.keys.clone(), buf.values.clone()), n) for _ in range(count)]

    with hf_cache.model_lock(model), torch.inference_mode():
        one = {k: rows(k, 1)[0] for k in kvs}
        logs: dict[torch.dtype, list[torch.Tensor]] = {k: [] for k in kvs}
        for _ in range(steps):  # every K/V dtype fed the float32 K/V's greedy tokens
            for k in kvs:
                logs[k].append(batched.decode_step(model, [one[k]], [tokens[-1]], wins)[0].log_softmax(-1))
                one[k].length += 1
            tokens.append(int(logs[model.dtype][-1].argmax()))
        kl = {dtype_label(k): statistics.fmean(next_token_kl(p, q) for p, q in zip(logs[model.dtype], logs[k], strict=True))
              for k in kvs if k != model.dtype}
        times: dict[torch.dtype, list[float]] = {k: [] for k in kvs}
        for _ in range(rounds):  # interleaved: a drift of the machine's load hits each dtype alike
            for k in kvs:
                batch = rows(k, KV_BATCH)
                for i in range(steps + 1):
                    t0 = time.perf_counter()
                    batched.decode_step(model, batch, tokens[:1] * KV_BATCH, wins)
                    if i:  # the first step warms up
                        times[k].append(time.perf_counter() - t0)
                    for r in batch:
                        r.length += 1
    del prep
    return {dtype_label(k): 1000 * statistics.median(t) / KV_BATCH for k, t in times.items()}, kl


def _decode_ms(engine: KVRAGEngine, plan: Plan, steps: int) -> float:
    """Milliseconds per greedy decode step after ``plan``'s prompt (after ``stale``: decode costs the same after
    every method, the cache has the same shape)."""
    prep = engine.prepare(plan, "stale", reserve=steps + 2)
    cache, logits = prep.cache, prep.last_logits[None]
    with torch.inference_mode():
        for i in range(steps + 1):
            if i == 1:  # the first step warms up the decode shapes
                t0 = time.perf_counter()
            logits, cache = hf_cache.forward(engine.model, torch.tensor([int(logits[-1].argmax())]), cache)
    return (time.perf_counter() - t0) / steps * 1000


def _fit(loaded: LoadedModel, base: CostModel, runs: dict[str, _Runs], plans: Sequence[Plan]) -> CostModel:
    """This machine's cost model from the timings (see the module docstring)."""
    cost = ModelCost.from_config(loaded.model.config)
    shapes = [(p.context_len, len(p.suffix.token_ids)) for p in plans]
    full_t = runs["full"].ttft_s
    cands = {}
    for spec, r in runs.items():
        is_full = spec == "full"
        shares = [cost.share(st, tc, s, full=is_full) for st, (tc, s) in zip(r.stats, shapes, strict=True)]
        per_req = [t / ft / sh for t, ft, sh in zip(r.ttft_s, full_t, shares, strict=True)]
        ratio = statistics.median(r.ttft_s) / statistics.median(full_t)
        share = statistics.fmean(shares)
        mean = MethodStats(
            recomputed_fraction=_mean([st.recomputed_fraction for st in r.stats]) or 0.0,
            attention_edges_ratio=_mean([st.attention_edges_ratio for st in r.stats]),
            attention_computed_ratio=_mean([st.attention_computed_ratio for st in r.stats]),
            score_edges_ratio=_mean([st.score_edges_ratio for st in r.stats]),
        )
        per_token = _mean([st.repairer_flops / tc if st.repairer_flops else None
                           for st, (tc, _) in zip(r.stats, shapes, strict=True)])
        kl = 0.0 if is_full else base.candidates[spec].kl
        cands[spec] = Candidate(spec=spec, kl=kl, ttft_ratio=ratio, flop_share=share, overhead=ratio / share,
                                overhead_p90=float(np.percentile(per_req, 90)), stats=mean,
                                repairer_flops_per_token=per_token)
    spf = statistics.median(t / cost.full_prefill(tc, s) for t, (tc, s) in zip(full_t, shapes, strict=True))
    return CostModel(cands, machine_kind=machine_kind(loaded.device), dtype=dtype_label(loaded.dtype),
                     seconds_per_flop=spf, torch_threads=torch.get_num_threads(), model_cost=cost,
                     source=f"kvrag calibrate ({len(plans)} built-in requests; KL from {base.path or 'the base'})",
                     info={"model": loaded.name, "n_requests": len(plans)})


def describe_machine(device: torch.device) -> MachineDescription:
    """CPU model, logical cores, bf16 units and the GPU name (if any), for the calibration file."""
    cpu = None
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), None)
    except OSError:
        pass
    flags = cpu_flags()
    return {"cpu": cpu, "cores": os.cpu_count(), "bf16_units": [f for f in ("amx_bf16", "avx512_bf16") if f in flags],
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def run_calibration(
    model: str | os.PathLike[str] | LoadedModel | None = None,
    *,
    dtypes: Sequence[str | None] = (None,),
    quantizes: Sequence[str | None] = ("default",),
    device: str | None = None,
    threads: int | None = 1,
    costs: str | None = None,
    out: str | Path | None = None,
    workload: Sequence[CalibrationRequest] | None = None,
    methods: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[Calibration, Path]:
    """Calibrate a model in each of ``dtypes`` and write the result (merged into the kind's existing file).

    Args:
        model: a model name or path (None: the embedded default), or an already loaded
            :class:`kvrag.models.LoadedModel` (then ``dtypes`` must be its dtype only).
        dtypes: dtype names to time (None: the model's default dtype on this device).
        quantizes: weight quantizations to time in each dtype ("none", "int4", "int8"; "default": the model's
            default on this machine); with two or more, the faster one becomes the default (``preferred_quantize``).
        device: the device (default: cuda when available, else cpu).
        threads: torch threads while timing (None: leave as set).
        costs: the base cost model (default: the shipped one).
        out: file to write (default: ``$KVRAG_HOME/calibration/<machine kind>.json``).
        workload, methods, progress: see :func:`measure_dtype`.

    Returns:
        (the calibration written, merged with the other dtypes already in the file; its path).
    """
    from kvrag.models import LoadedModel, load_model

    base = load_cost_model(costs)
    saved = torch.get_num_threads()
    set_torch_threads(threads, "threads")
    try:
        results: dict[str, DtypeCalibration] = {}
        loaded = cast("LoadedModel", model)  # a name is loaded below before it is read
        for dt, quant in itertools.product(dtypes, quantizes):
            if isinstance(model, LoadedModel):
                if dt is not None and dtype_label(model.dtype) != str(dt).removeprefix("torch."):
                    msg = (f"calibrate: the model is loaded in {dtype_label(model.dtype)}; pass a model name to "
                           f"calibrate {dt}")
                    raise ConfigError(msg)
            else:
                loaded = load_model(model, device=device, dtype=dt, quantize=quant)
            res = measure_dtype(loaded, base, workload=workload, methods=methods, progress=progress)
            results[variant_key(res.dtype, loaded.quantize)] = res
        cal = Calibration(machine_kind=machine_kind(loaded.device), model=loaded.name,
                          torch_threads=torch.get_num_threads(), dtypes=results,
                          hardware=describe_machine(loaded.device))
        cal = save_calibration(cal, out)
    finally:
        torch.set_num_threads(saved)
    return cal, Path(str(cal.path))


def format_report(cal: Calibration, path: Path) -> str:
    """A short text report of a calibration (what ``kvrag calibrate`` prints)."""
    lines = [f"{cal.machine_kind}: {cal.model}, {cal.torch_threads} torch thread(s)"]
    for key, d in cal.dtypes.items():
        lines.append(f"  {key}: prefill {d.prefill_tokens_per_s:.0f} tokens/s, decode {d.decode_ms_per_token:.1f} "
                     f"ms/token (at ~{TARGET_TOKENS} tokens)")
        cm = CostModel.from_dict(d.cost_model) if d.cost_model else None
        for spec, t in sorted(d.ttft_s.items(), key=lambda kv: kv[1]):
            ratio = f"{cm.candidates[spec].ttft_ratio:.3f}x full" if cm and spec in cm.candidates else ""
            lines.append(f"    {spec:18s} TTFT {t * 1000:8.1f} ms  {ratio:>12s}  TTFT + {ANSWER_TOKENS} tokens "
                         f"{d.e2e_s[spec]:.2f} s")
        for kv, ms in d.kv_decode_ms_per_token.items():
            kl = f", next-token KL {d.kv_kl[kv]:.1e} vs {d.dtype} K/V" if kv in d.kv_kl else ""
            lines.append(f"    K/V {kv}: decode {ms:.1f} ms/token with {KV_BATCH} rows{kl}")
        if d.preferred_kv_dtype() is not None:
            lines.append(f"    preferred K/V in {key}: kv_dtype={d.preferred_kv_dtype()!r}")
    if cal.preferred_dtype:
        lines.append(f"preferred dtype (stale, TTFT + {ANSWER_TOKENS} tokens): {cal.preferred_dtype}")
        quant = cal.preferred_quantize(cal.preferred_dtype)
        if quant is not None:
            lines.append(f"preferred weights in {cal.preferred_dtype}: {quant}")
    lines.append(f"written to {path}")
    return "\n".join(lines)


__all__ = ["CalibrationRequest", "builtin_workload", "format_report", "measure_dtype", "run_calibration"]
