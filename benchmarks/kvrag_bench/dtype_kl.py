"""``kvrag bench dtype-kl``: how far a lower compute dtype moves full prefill, KL(float32 full || dtype full).

The same model is loaded twice (float32 and the compared dtype, default bfloat16); every dev request is rendered
with the benchmark template and prefilled in full by both, and the next-token distributions are compared: KL in
nats, top-1 agreement and the prefill time of each. This is the number behind the default-dtype choice (bf16 on
CUDA and on CPUs with AMX / AVX512-BF16): it says what bf16 costs in fidelity, whatever it gains in speed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from kvrag.errors import ConfigError


@dataclasses.dataclass
class DtypeKLConfig:
    """Settings of ``kvrag bench dtype-kl``."""

    data: str
    limit: int = 8
    offset: int = 0
    dtype: str = "bfloat16"
    model: str | None = None
    device: str | None = None
    template: str | None = None
    out: str = "runs/dtype-kl"
    progress: bool = True


def run_dtype_kl(cfg: DtypeKLConfig, command: str = "") -> dict[str, Any]:
    """Prefill every request in float32 and in ``cfg.dtype``; writes ``dtype_kl.json`` / ``.md`` to ``cfg.out``."""
    from tqdm.auto import tqdm

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag_bench import aggregate
    from kvrag_bench.data import load_requests
    from kvrag_bench.metrics import kl_divergence

    if cfg.dtype == "float32":
        msg = "dtype-kl compares float32 with another dtype; pass --dtype bfloat16 or float16"
        raise ConfigError(msg)
    requests = load_requests(cfg.data, limit=cfg.limit, offset=cfg.offset)
    template = get_template(cfg.template)
    from kvrag.store import MemoryStore

    engines = {dt: KVRAGEngine(load_model(cfg.model, dtype=dt, device=cfg.device), MemoryStore())
               for dt in ("float32", cfg.dtype)}
    rows = []
    for req in tqdm(requests, desc=f"float32 vs {cfg.dtype}", unit="req", disable=not cfg.progress):
        logits, secs = {}, {}
        for dt, eng in engines.items():
            prefix, passages, suffix = template.parts(eng.tokenizer, req.passages(), req.question)
            plan = eng.plan_parts(prefix, passages, suffix)
            t = time.perf_counter()
            logits[dt] = eng.prepare(plan, "full", reserve=1).last_logits.float()
            secs[dt] = time.perf_counter() - t
        ref, got = logits["float32"], logits[cfg.dtype]
        rows.append({"id": req.id, "context_tokens": plan.context_len, "kl": float(kl_divergence(ref, got)),
                     "top1": bool(int(ref.argmax()) == int(got.argmax())),
                     "seconds_float32": secs["float32"], f"seconds_{cfg.dtype}": secs[cfg.dtype]})
    kls = [r["kl"] for r in rows]
    summary = {"requests": len(rows), "kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls),
               "kl_max": max(kls), "top1_agreement": statistics.fmean(float(r["top1"]) for r in rows),
               "context_tokens_median": statistics.median(r["context_tokens"] for r in rows),
               "prefill_s_float32_median": statistics.median(r["seconds_float32"] for r in rows),
               f"prefill_s_{cfg.dtype}_median": statistics.median(r[f"seconds_{cfg.dtype}"] for r in rows)}
    result = {"config": dataclasses.asdict(cfg), "summary": summary, "rows": rows, "command": command,
              **aggregate.environment_info()}
    hw = result["hardware"]
    result["machine"] = f"{hw['cpu']}, {hw['cores']} cores, torch threads {hw['torch_threads']}"
    aggregate.write_result(cfg.out, "dtype_kl", result, markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    s, dt = result["summary"], result["config"]["dtype"]
    return "\n".join([
        f"KL(float32 full || {dt} full) of the next-token distribution, {s['requests']} dev requests "
        f"(median {s['context_tokens_median']:.0f} context tokens): mean **{s['kl_mean']:.4f}**, median "
        f"{s['kl_median']:.4f}, max {s['kl_max']:.4f} nats; top-1 agreement {s['top1_agreement']:.2f}; full prefill "
        f"p50 {s['prefill_s_float32_median']:.2f} s in float32 vs {s[f'prefill_s_{dt}_median']:.2f} s in {dt}.",
        "", f"Machine: {result['machine']}; command: `{result['command']}`.", ""])


__all__ = ["DtypeKLConfig", "markdown", "run_dtype_kl"]
