"""Prompt-template selection by full-prefill F1 (``kvrag bench templates``).

Small instruct models tend to answer in sentences, so the wording of the instruction, a one-shot example in the
cached preamble and the answer extraction change F1 a lot. This runs every candidate of
:data:`kvrag.prompting.TEMPLATES` with a plain full prefill (no cache reuse, so the choice does not favour any
fusion method) and greedy decoding, scores every answer-extraction mode on the same generations, and reports the
best (template, extraction) pair. Candidates run interleaved per request; ``templates.jsonl`` makes runs resumable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.config import GenerationConfig
from kvrag.engine.generate import decode
from kvrag.errors import ConfigError
from kvrag.kv import hf_cache
from kvrag.prompting import TEMPLATES, RagTemplate, get_template
from kvrag_bench import aggregate
from kvrag_bench.data import QARequest
from kvrag_bench.extract import EXTRACTORS
from kvrag_bench.metrics import bootstrap_ci, exact_match, f1_score

log = logging.getLogger(__name__)

RESULTS = "templates.jsonl"


@torch.inference_mode()
def full_prefill_answer(engine: Any, plan: Any, gen: GenerationConfig) -> tuple[str, list[int]]:
    """Greedy answer after one joint prefill of the plan's tokens (what the ``full`` method computes)."""
    ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
    logits, cache = hf_cache.forward(engine.model, torch.tensor(ids, dtype=torch.long), None, start=0)
    text, toks = [], []
    for tok, delta in decode(engine.model, engine.tokenizer, cache, logits[-1], gen, engine._eos_ids()):
        if tok >= 0:
            toks.append(tok)
        text.append(delta)
    return "".join(text), toks


def select_template(
    engine: Any,
    requests: Sequence[QARequest],
    out_dir: str | os.PathLike[str],
    candidates: Sequence[str] | None = None,
    *,
    max_new_tokens: int = 32,
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Score candidate templates; writes ``templates.jsonl``, ``templates.json`` and ``templates.md``.

    Returns:
        ``{"candidates": {"name/extraction": {"f1", "em", "f1_ci", "n"}}, "best": "name/extraction", ...}``.
    """
    from tqdm.auto import tqdm

    names = list(candidates or TEMPLATES)
    temps: dict[str, RagTemplate] = {n: get_template(n) for n in names}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    rows = {r["id"]: r for r in aggregate.read_jsonl(path)}
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    todo = [r for r in requests if not all(n in rows.get(r.id, {}).get("templates", {}) for n in names)]
    with path.open("a", encoding="utf-8") as f:
        for i, req in enumerate(tqdm(todo, desc="templates", unit="req", disable=not progress)):
            row = rows.get(req.id, {"id": req.id, "answers": list(req.answers), "templates": {}})
            order = names[i % len(names):] + names[: i % len(names)]
            for n in order:
                if n in row["templates"]:
                    continue
                t = temps[n]
                prefix, ps, suffix = t.parts(engine.tokenizer, req.passages(), req.question)
                plan = engine.plan_parts(prefix, ps, suffix)
                if plan.total_len + max_new_tokens >= engine.max_context:
                    row["templates"][n] = {"skipped": "too long"}
                    continue
                text, toks = full_prefill_answer(engine, plan, gen)
                row["templates"][n] = {"raw": text, "tokens": len(toks), "context_tokens": plan.context_len}
            rows[req.id] = row
            f.write(json.dumps(row) + "\n")
            f.flush()
    ids = {r.id for r in requests}
    used = [r for r in rows.values() if r["id"] in ids]
    result = score_templates(used, names, n_boot=n_boot, seed=seed)
    result["config"] = {"n_requests": len(used), "max_new_tokens": max_new_tokens, "candidates": names,
                        "templates": {n: dataclasses.asdict(t) for n, t in temps.items()}}
    result.update(aggregate.environment_info())
    aggregate.write_result(out, "templates", result, templates_markdown(result))
    return result


def score_templates(rows: Sequence[dict[str, Any]], names: Sequence[str], n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """F1/EM of every (template, extraction) pair over requests answered by every template."""
    usable = [r for r in rows if all("raw" in r["templates"].get(n, {}) for n in names)]
    if not usable:
        msg = "no request was answered by every candidate template; nothing to score"
        raise ConfigError(msg)
    cands: dict[str, Any] = {}
    for n in names:
        for ext, fn in EXTRACTORS.items():
            f1s = [f1_score(fn(r["templates"][n]["raw"]), r["answers"]) for r in usable]
            ems = [exact_match(fn(r["templates"][n]["raw"]), r["answers"]) for r in usable]
            _, lo, hi = bootstrap_ci(f1s, n=max(n_boot, 1), seed=seed)
            cands[f"{n}/{ext}"] = {
                "template": n, "extraction": ext, "n": len(f1s), "f1": sum(f1s) / len(f1s), "em": sum(ems) / len(ems),
                "f1_ci": [lo, hi],
                "mean_generated_tokens": sum(r["templates"][n]["tokens"] for r in usable) / len(usable),
            }
    best = max(cands, key=lambda k: (cands[k]["f1"], cands[k]["em"]))
    return {"candidates": cands, "best": best, "best_f1": cands[best]["f1"], "n_requests": len(usable)}


def templates_markdown(result: dict[str, Any]) -> str:
    lines = ["# Prompt template selection (full prefill, greedy)", "",
             f"{result['n_requests']} requests; best: `{result['best']}` (F1 {result['best_f1']:.3f}).", "",
             "| template / extraction | F1 [95% CI] | EM | generated tokens |", "|---|---|---:|---:|"]
    for k, c in sorted(result["candidates"].items(), key=lambda kv: -kv[1]["f1"]):
        lines.append(f"| `{k}` | {c['f1']:.3f} [{c['f1_ci'][0]:.3f}, {c['f1_ci'][1]:.3f}] | {c['em']:.3f} | "
                     f"{c['mean_generated_tokens']:.1f} |")
    return "\n".join(lines) + "\n"
