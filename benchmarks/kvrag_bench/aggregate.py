"""Benchmark reporting: per-method aggregates and the summary files (provenance: :mod:`kvrag_bench.provenance`).

``summary.json`` layout::

    {"config": {...}, "git_sha": "...", "versions": {...}, "hardware": {... "cpu_bf16": "amx_bf16" | ...},
     "machine": {"kind": "cpu-amx" | "cpu-avx512bf16" | "cpu-avx2" | "cuda-<gpu>" ..., "device", "dtype", "cpu_bf16"},
     "n_requests": N, "reference": {"full": label, "stale": label}, "quality_ceiling_f1": F1 of full,
     "context_tokens": {"mean", "p50", "min", "max"},
     "methods": {spec: {"n", "same_answer", "same_answer_ci", "same_tokens", "same_tokens_ci",
                        "first_token_agreement", "first_token_agreement_ci", "f1", "em", "kl", "ttft_p50_s", "ttft_p90_s", "ttft_ratio",
                        "f1_gap_recovery", "kl_gap_recovery", "f1_ci", "vs_full", "vs_stale", ...}},
     "peers": {name: {...}}}

``same_answer`` is the share of requests whose answer equals ``full``'s after the F1 code's normalization,
``same_tokens`` the share whose generated tokens are identical to ``full``'s: what a user sees. KL stays the finer
figure. Keys of ``methods`` are the method specs exactly as given on the command line (a repeated spec gets ``#2``,
``#3`` ...). Intervals are percentile bootstrap 95% intervals; differences are paired (same requests resampled).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvrag.fusion.stats import MethodStats
from kvrag_bench.metrics import bootstrap_ci, gap_recovery, paired_bootstrap, same_answer, same_tokens
from kvrag_bench.provenance import environment_info, machine_label  # environment_info: re-exported for result writers

log = logging.getLogger(__name__)

TIMING_KEYS = ("fetch_s", "compute_misses_s", "assemble_s", "repair_s", "suffix_prefill_s", "ttft_s", "decode_s", "total_s")
KV_REGIONS = ("first", "boundary", "interior", "all")


# ----------------------------------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Parse a JSONL file, skipping a truncated or corrupt line (e.g. from an interrupted run) with a warning."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d is not valid JSON (interrupted write?); ignoring it", p, i)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def jsonable(x: Any) -> Any:
    """Convert tensors / numpy values (and nested containers of them) into JSON types; NaN/inf become None."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return jsonable(x.detach().cpu().tolist())
    except ImportError:  # pragma: no cover
        pass
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        return jsonable(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, str | int | float | bool) or x is None:
        return x
    return str(x)


# ----------------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, int | float) and math.isfinite(float(x)):
        return float(x)
    return None


def _values(rows: Sequence[dict[str, Any]], label: str, key: str, section: str = "methods") -> list[float | None]:
    out: list[float | None] = []
    for r in rows:
        m = r.get(section, {}).get(label)
        out.append(_num(m.get(key)) if m else None)
    return out


def _timing_values(rows: Sequence[dict[str, Any]], label: str, key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in rows:
        m = r.get("methods", {}).get(label)
        out.append(_num((m.get("timings") or {}).get(key)) if m else None)
    return out


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.mean(v)) if v else None


def _pct(xs: Iterable[float | None], q: float) -> float | None:
    v = [x for x in xs if x is not None]
    return float(np.percentile(v, q)) if v else None


def _ci(xs: Sequence[float | None], n_boot: int, seed: int) -> list[float] | None:
    v = [x for x in xs if x is not None]
    if not v or n_boot < 1:
        return None
    _, lo, hi = bootstrap_ci(v, n=n_boot, seed=seed)
    return [lo, hi]


def _paired(a: Sequence[float | None], b: Sequence[float | None], n_boot: int, seed: int) -> dict[str, Any] | None:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    if not pairs or n_boot < 1:
        return None
    xa = [x for x, _ in pairs]
    xb = [y for _, y in pairs]
    mean, lo, hi = paired_bootstrap(xa, xb, n=n_boot, seed=seed)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(pairs)}


def _nested_means(rows: Sequence[dict[str, Any]], label: str, key: str) -> dict[str, float]:
    """Mean of every numeric leaf of ``methods[label][key]`` (one level of nesting flattened with '.')."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        d = (r.get("methods", {}).get(label) or {}).get(key) or {}
        for k, v in d.items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    if (x := _num(v2)) is not None:
                        acc.setdefault(f"{k}.{k2}", []).append(x)
            elif (x := _num(v)) is not None:
                acc.setdefault(k, []).append(x)
    return {k: float(np.mean(v)) for k, v in acc.items()}


def agreement_values(rows: Sequence[dict[str, Any]], label: str,
                     full: str | None) -> tuple[list[float | None], list[float | None]]:
    """Per request, 1.0/0.0 whether ``label``'s answer is ``full``'s (normalized answer; identical tokens), None
    where either record lacks it."""
    ans: list[float | None] = []
    tok: list[float | None] = []
    for r in rows:
        ms = r.get("methods", {})
        m, f = ms.get(label) or {}, (ms.get(full) or {}) if full else {}
        both = m and f
        ans.append(float(same_answer(m["answer"], f["answer"])) if both and "answer" in m and "answer" in f else None)
        tok.append(float(same_tokens(m["token_ids"], f["token_ids"]))
                   if both and "token_ids" in m and "token_ids" in f else None)
    return ans, tok


def reference_labels(labels: Sequence[str]) -> dict[str, str | None]:
    """The first label whose method is ``full`` / ``stale`` (labels are specs, maybe with a ``#n`` suffix)."""

    def name(lbl: str) -> str:
        return lbl.split("#", 1)[0].split(":", 1)[0].strip()

    return {
        "full": next((lbl for lbl in labels if name(lbl) == "full"), None),
        "stale": next((lbl for lbl in labels if name(lbl) == "stale"), None),
    }


def summarize_method(
    rows: Sequence[dict[str, Any]], label: str, refs: dict[str, str | None], n_boot: int, seed: int
) -> dict[str, Any]:
    """Aggregate one method over aligned requests (every row holds every label)."""
    f1, em, kl = (_values(rows, label, k) for k in ("f1", "em", "kl"))
    ftok = _values(rows, label, "first_token_agree")
    shares = _values(rows, label, "flop_share")
    ttft = _values(rows, label, "ttft_s")
    full, stale = refs.get("full"), refs.get("stale")
    ttft_full = _values(rows, full, "ttft_s") if full else None
    p50 = _pct(ttft, 50)
    p50_full = _pct(ttft_full, 50) if ttft_full else None
    per_req_ratio = (
        [t / tf if t is not None and tf else None for t, tf in zip(ttft, ttft_full, strict=True)] if ttft_full else []
    )
    answer = _timing_values(rows, label, "total_s")  # prepare + the whole answer's decode: what a user waits for
    answer_full = _timing_values(rows, full, "total_s") if full else None
    answer_p50 = _pct(answer, 50)
    answer_p50_full = _pct(answer_full, 50) if answer_full else None
    same_ans, same_tok = agreement_values(rows, label, full)
    m: dict[str, Any] = {
        "n": sum(x is not None for x in f1),
        "same_answer": _mean(same_ans),
        "same_answer_ci": _ci(same_ans, n_boot, seed),
        "same_tokens": _mean(same_tok),
        "same_tokens_ci": _ci(same_tok, n_boot, seed),
        "first_token_agreement_ci": _ci(ftok, n_boot, seed),
        "answer_p50_s": answer_p50,
        "answer_ratio": (answer_p50 / answer_p50_full) if answer_p50 is not None and answer_p50_full else None,
        "f1": _mean(f1),
        "em": _mean(em),
        "kl": _mean(kl),
        "first_token_agreement": _mean(ftok),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": p50,
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_ratio": (p50 / p50_full) if p50 is not None and p50_full else None,
        "ttft_ratio_p50": _pct(per_req_ratio, 50),
        "ttft_ratio_p90": _pct(per_req_ratio, 90),
        "ttft_ratio_mean": _mean(per_req_ratio),
        "f1_ci": _ci(f1, n_boot, seed),
        "em_ci": _ci(em, n_boot, seed),
        "kl_ci": _ci(kl, n_boot, seed),
        "f1_gap_recovery": None,
        "kl_gap_recovery": None,
        "em_gap_recovery": None,
        "vs_full": {},
        "vs_stale": {},
        "timings_mean_s": _nested_means(rows, label, "timings"),
        "kv_rel_rmse": _nested_means(rows, label, "kv_rel_rmse"),
        "peak_mem_bytes_mean": _mean(_values(rows, label, "peak_mem_bytes")),
        "peak_mem_bytes_max": max((x for x in _values(rows, label, "peak_mem_bytes") if x is not None), default=None),
        "kv_cache_bytes_mean": _mean(_values(rows, label, "kv_cache_bytes")),
        "method_stats_mean": _nested_means(rows, label, "method_stats"),
        "generated_tokens_mean": _mean(_values(rows, label, "generated_tokens")),
        "flop_share": _mean(shares),
    }
    # overhead: the measured TTFT ratio over the analytic FLOP share (1.0 = the method runs at full prefill's
    # FLOP efficiency; see kvrag.fusion.cost)
    fs = m["flop_share"]
    m["overhead"] = m["ttft_ratio"] / fs if m["ttft_ratio"] is not None and fs else None
    # its spread over requests: the p90 of each request's TTFT ratio over its own FLOP share (auto's margin)
    per_req_over = ([r / sh if r is not None and sh else None for r, sh in zip(per_req_ratio, shares, strict=True)]
                    if per_req_ratio else [])
    m["overhead_p90"] = _pct(per_req_over, 90)
    for ref_name, ref in (("vs_full", full), ("vs_stale", stale)):
        if ref is None:
            continue
        for key, xs in (("f1", f1), ("em", em), ("kl", kl), ("ttft_s", ttft)):
            m[ref_name][key] = _paired(_values(rows, ref, key), xs, n_boot, seed)
    if full and stale:
        for key in ("f1", "em", "kl"):
            ref_f = _mean(_values(rows, full, key))
            ref_s = _mean(_values(rows, stale, key))
            if m[key] is not None and ref_f is not None and ref_s is not None:
                m[f"{key}_gap_recovery"] = gap_recovery(m[key], ref_s, ref_f)
    return m


def summarize_peer(rows: Sequence[dict[str, Any]], name: str, full: str | None, n_boot: int, seed: int) -> dict[str, Any]:
    f1, em, ttft = (_values(rows, name, k, "peers") for k in ("f1", "em", "ttft_s"))
    ftt = _values(rows, name, "first_token_s", "peers")
    p50 = _pct(ttft, 50)
    p50_full = _pct(_values(rows, full, "ttft_s"), 50) if full else None
    same = None
    if full:
        pairs = [(r["peers"][name].get("answer"), r["methods"][full].get("answer")) for r in rows
                 if name in r.get("peers", {}) and full in r.get("methods", {})]
        same = float(np.mean([same_answer(a or '', b or '') for a, b in pairs])) if pairs else None
    return {
        "n": sum(x is not None for x in f1),
        "f1": _mean(f1),
        "em": _mean(em),
        "f1_ci": _ci(f1, n_boot, seed),
        "ttft_p50_s": p50,
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_ratio": (p50 / p50_full) if p50 is not None and p50_full else None,
        "first_token_p50_s": _pct(ftt, 50),
        "total_mean_s": _mean(_values(rows, name, "total_s", "peers")),
        "same_answer_as_full": same,
        "vs_full": {"f1": _paired(_values(rows, full, "f1"), f1, n_boot, seed)} if full else {},
    }


def summarize(
    rows: Sequence[dict[str, Any]],
    labels: Sequence[str],
    *,
    peers: Sequence[str] = (),
    config: dict[str, Any] | None = None,
    env: dict[str, Any] | None = None,
    n_boot: int = 1000,
    seed: int = 0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the summary dict from per-request rows (only rows holding every label and peer are used)."""
    env = env if env is not None else environment_info()
    used = [r for r in rows if all(lbl in r.get("methods", {}) for lbl in labels)
            and all(p in r.get("peers", {}) for p in peers)]
    refs = reference_labels(labels)
    ctx = [float(r["context_tokens"]) for r in used if isinstance(r.get("context_tokens"), int | float)]
    methods = {lbl: summarize_method(used, lbl, refs, n_boot, seed) for lbl in labels} if used else {}
    summary: dict[str, Any] = {
        "config": config or {},
        "git_sha": env.get("git_sha", "unknown"),
        "versions": env.get("versions", {}),
        "hardware": env.get("hardware", {}),
        "n_requests": len(used),
        "reference": refs,
        "quality_ceiling_f1": methods.get(refs["full"] or "", {}).get("f1"),
        "context_tokens": {
            "mean": _mean(ctx), "p50": _pct(ctx, 50), "min": min(ctx, default=None), "max": max(ctx, default=None),
        },
        "n_chunks_mean": _mean([_num(r.get("n_chunks")) for r in used]),
        "methods": methods,
        "peers": {p: summarize_peer(used, p, refs["full"], n_boot, seed) for p in peers} if used else {},
    }
    if extra:
        summary.update(extra)
    return jsonable(summary)


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None else f"{round(x, nd) + 0.0:.{nd}f}"  # + 0.0: no "-0.000"


def _ms(x: Any) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _share(m: dict[str, Any], key: str) -> str:
    """'0.75 [0.61, 0.86]': a share with its interval."""
    ci = m.get(f"{key}_ci")
    return _f(m.get(key), 2) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _pm(d: dict[str, Any] | None, nd: int = 3) -> str:
    if not d:
        return "–"
    return f"{d['mean']:+.{nd}f} [{d['lo']:+.{nd}f}, {d['hi']:+.{nd}f}]"


def summary_markdown(summary: dict[str, Any]) -> str:
    """The ``summary.md`` text: a main table, a KV-fidelity table, a TTFT breakdown and the provenance."""
    machine = summary.get("machine") or {}
    hw = summary.get("hardware", {})
    lines = [f"# kvrag QA benchmark: {machine_label(summary)}", ""]
    cfg = summary.get("config", {})
    ctx = summary.get("context_tokens", {})
    lines += [
        f"Machine `{machine.get('kind', '?')}` ({hw.get('cpu', '?')}; CPU native bf16: {hw.get('cpu_bf16') or 'none'}; "
        f"GPU {hw.get('gpu') or 'none'}), device `{machine.get('device', '?')}`, compute dtype "
        f"`{machine.get('dtype', '?')}`, torch threads {hw.get('torch_threads', '?')}. Compare TTFT ratios only "
        "within one machine kind and dtype.",
        "",
        f"{summary.get('n_requests', 0)} requests from `{cfg.get('data', '?')}`; model `{(summary.get('model') or {}).get('name') or cfg.get('model') or 'default'}`; "
        f"template `{cfg.get('template', '?')}`; context tokens mean {_f(ctx.get('mean'), 0)} "
        f"(min {_f(ctx.get('min'), 0)}, max {_f(ctx.get('max'), 0)}), {_f(summary.get('n_chunks_mean'), 1)} chunks a request. "
        f"Quality ceiling (full-prefill F1): {_f(summary.get('quality_ceiling_f1'))}.",
        "",
        "Intervals: paired bootstrap 95% (differences are method − reference on the same requests). "
        "TTFT is cache-ready (chunk caches built before timing). Gap recovery = (method − stale) / (full − stale).",
        "",
    ]
    full_lbl = (summary.get("reference") or {}).get("full")
    gap = ((summary.get("methods", {}).get(full_lbl or "") or {}).get("vs_stale") or {})
    for key, name in (("f1", "F1"), ("kl", "KL")):
        g = gap.get(key)
        if g:
            unsure = g["lo"] <= 0.0 <= g["hi"]
            lines.append(f"{name} gap full − stale: {_pm(g)}" + (" — the interval includes 0, so this gap recovery is "
                                                                  "not meaningful on these requests." if unsure else "."))
    lines += [
        "",
        "Same answer: the answer equals `full`'s after the F1 code's normalization; same tokens: identical "
        "generated tokens; 1st-token agree: the same first token (95% bootstrap intervals).",
        "",
        "| method | n | same answer as full | same tokens | 1st-token agree | F1 [95% CI] | EM | ΔF1 vs full | "
        "ΔF1 vs stale | KL(full‖m) | TTFT p50 ms | TTFT p90 ms | TTFT/full | TTFT/full mean | answer p50 ms | "
        "answer/full | F1 gap rec. | KL gap rec. | recomputed |",
        "|---|---:|---|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lbl, m in summary.get("methods", {}).items():
        ci = m.get("f1_ci")
        f1 = f"{_f(m.get('f1'))}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        rec = MethodStats.from_dict(m.get("method_stats_mean")).recomputed_fraction if m.get("method_stats_mean") \
            else None
        lines.append(
            f"| `{lbl}` | {m.get('n')} | {_share(m, 'same_answer')} | {_share(m, 'same_tokens')} | "
            f"{_share(m, 'first_token_agreement')} | {f1} | {_f(m.get('em'))} | {_pm(m.get('vs_full', {}).get('f1'))} | "
            f"{_pm(m.get('vs_stale', {}).get('f1'))} | {_f(m.get('kl'), 4)} | "
            f"{_ms(m.get('ttft_p50_s'))} | {_ms(m.get('ttft_p90_s'))} | {_f(m.get('ttft_ratio'), 2)} | "
            f"{_f(m.get('ttft_ratio_mean'), 2)} | "
            f"{_ms(m.get('answer_p50_s'))} | {_f(m.get('answer_ratio'), 2)} | "
            f"{_f(m.get('f1_gap_recovery'), 2)} | {_f(m.get('kl_gap_recovery'), 2)} | {_f(rec, 3)} |"
        )
    if summary.get("peers"):
        lines += ["", "## Peers (same model, same prompt text)", "",
                  "| peer | n | F1 [95% CI] | EM | same answer as full | TTFT p50 ms (first text) | first token p50 ms | TTFT/full |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        for name, p in summary["peers"].items():
            ci = p.get("f1_ci")
            f1 = f"{_f(p.get('f1'))}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            lines.append(f"| `{name}` | {p.get('n')} | {f1} | {_f(p.get('em'))} | {_f(p.get('same_answer_as_full'), 2)} | "
                         f"{_ms(p.get('ttft_p50_s'))} | {_ms(p.get('first_token_p50_s'))} | {_f(p.get('ttft_ratio'), 2)} |")
    lines += ["", "## KV fidelity: relative RMSE vs the full prefill (mean over requests)", "",
              "Regions: `first` = the first chunk, `boundary` = the first tokens of each later chunk, "
              "`interior` = the rest of the later chunks.", "",
              "| method | K first | K boundary | K interior | K all | V first | V boundary | V interior | V all |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lbl, m in summary.get("methods", {}).items():
        kv = m.get("kv_rel_rmse", {})
        cells = [_f(kv.get(f"{t}_{r}"), 4) for t in ("k", "v") for r in KV_REGIONS]
        lines.append(f"| `{lbl}` | " + " | ".join(cells) + " |")
    lines += ["", "## TTFT breakdown (mean ms), FLOP share and overhead, memory", "",
              "FLOP share = the method's analytic FLOPs / a full prefill's on the same request (kvrag.fusion.cost: "
              "projections, MLP, attention pairs computed, scoring pass, repairer); overhead = TTFT/full (p50 ratio) / "
              "FLOP share.", "",
              "| method | fetch | misses | assemble | repair | suffix prefill | TTFT | decode | FLOP share | TTFT/full "
              "| overhead | peak mem MiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lbl, m in summary.get("methods", {}).items():
        t = m.get("timings_mean_s", {})
        mem = m.get("peak_mem_bytes_mean")
        lines.append(f"| `{lbl}` | " + " | ".join(_ms(t.get(k)) for k in TIMING_KEYS[:-1])
                     + f" | {_f(m.get('flop_share'), 3)} | {_f(m.get('ttft_ratio'), 3)} | {_f(m.get('overhead'), 2)}"
                     + f" | {_f(mem / 2**20 if mem is not None else None, 1)} |")
    ver = summary.get("versions", {})
    lines += ["", "## Provenance", "",
              f"- git: `{summary.get('git_sha')}`",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
              f"- machine: {machine.get('kind', '?')}, device {machine.get('device', '?')}, dtype "
              f"{machine.get('dtype', '?')}, CPU native bf16 {hw.get('cpu_bf16') or 'none'}",
              f"- hardware: {hw.get('cpu')} ({hw.get('cores')} cores, torch threads {hw.get('torch_threads')}, "
              f"RAM {_f((hw.get('ram_bytes') or 0) / 2**30, 1)} GiB, GPU {hw.get('gpu') or 'none'}, load avg {hw.get('load_avg')})",
              ""]
    reasons = summary.get("skip_reasons") or {s: "not registered" for s in summary.get("skipped_methods") or []}
    for spec, why in reasons.items():
        lines.append(f"- skipped `{spec}`: {why}")
    too_long = summary.get("skipped_requests_too_long") or []
    if too_long:
        lines.append(f"- skipped {len(too_long)} request(s) longer than the context window: "
                     + ", ".join(f"`{i}`" for i in too_long))
    if reasons or too_long:
        lines.append("")
    return "\n".join(lines)


def write_summary(out_dir: str | os.PathLike[str], summary: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.md`` into ``out_dir`` (atomically); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pj, pm = out / "summary.json", out / "summary.md"
    write_text_atomic(pj, json.dumps(summary, indent=2, sort_keys=False, allow_nan=False) + "\n")
    write_text_atomic(pm, summary_markdown(summary))
    return pj, pm


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_result(out_dir: str | os.PathLike[str], stem: str, result: dict[str, Any], markdown: str) -> Path:
    """Write a benchmark's ``<stem>.json`` (JSON types only, see :func:`jsonable`) and ``<stem>.md`` atomically.

    Returns:
        The path of the JSON file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{stem}.json", json.dumps(jsonable(result), indent=2) + "\n")
    write_text_atomic(out / f"{stem}.md", markdown)
    return out / f"{stem}.json"

