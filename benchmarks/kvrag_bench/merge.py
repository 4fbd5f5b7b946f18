"""``kvrag bench merge``: one summary from bench runs that split one request list between processes.

On a machine with few cores a long run is faster as one process per core over disjoint row ranges (``--offset``
/ ``--limit``), started side by side so every request sees the same load. TTFT ratios, KL and F1 are computed per
request within a run, so the merged summary is the one a single run over all rows would report under that load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.errors import ConfigError
from kvrag_bench import aggregate, plots, provenance


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def merge_runs(out: str | os.PathLike[str], runs: Sequence[str | os.PathLike[str]], *, n_boot: int = 1000,
               seed: int = 0, make_plots: bool = True) -> dict[str, Any]:
    """Concatenate the request rows of ``runs`` (in order) and write ``out``/summary.{json,md} (+ Pareto plots).

    Raises:
        ConfigError: fewer than two runs, a run without run.json/results.jsonl, runs whose methods, resume key
            (model, template, token budgets) or commit differ, or a request that appears in two runs.

    The summary's provenance (git, versions, hardware incl. torch threads) is the first run's; every run's hardware
    line (load averages differ) is kept under ``merged_hardware``.
    """
    if len(runs) < 2:
        raise ConfigError("kvrag bench merge needs at least two run directories")
    paths = [Path(r) for r in runs]
    metas = []
    for p in paths:
        if not (p / "run.json").is_file() or not (p / "results.jsonl").is_file():
            raise ConfigError(f"{p} is not a kvrag bench --out directory (run.json and results.jsonl expected)")
        metas.append(json.loads((p / "run.json").read_text()))
    labels_of = [_run_labels(p, m) for p, m in zip(paths, metas, strict=True)]
    labels = labels_of[0]
    for p, lbls in zip(paths[1:], labels_of[1:], strict=True):
        if lbls != labels:
            raise ConfigError(f"{p} ran methods {lbls}, {paths[0]} ran {labels}; merge runs of one "
                              "method list")
    for p, m in zip(paths[1:], metas[1:], strict=True):
        a, b = metas[0].get("resume_key") or {}, m.get("resume_key") or {}
        if a != b:
            diff = "; ".join(f"{k}: {_short(a.get(k))} vs {_short(b.get(k))}"
                             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
            raise ConfigError(f"{p} ran with other settings than {paths[0]} ({diff}); such runs cannot be merged")
    # provenance is the runs' own (git, versions, hardware with their torch threads), never the merging process's
    envs = []
    for p in paths:
        sp = p / "summary.json"
        js = json.loads(sp.read_text()) if sp.is_file() else {}
        envs.append({k: js.get(k) for k in ("git_sha", "versions", "hardware", "machine")})
    shas = {e["git_sha"] for e in envs}
    if len(shas) > 1:
        raise ConfigError(f"the runs were made at different commits ({sorted(map(str, shas))}); merge runs of one commit")
    kinds = {provenance.machine_label(e) for e in envs}
    if len(kinds) > 1:
        raise ConfigError(f"the runs were made on different machine kinds / dtypes ({sorted(kinds)}); their TTFT "
                          "ratios are not comparable: merge runs of one machine kind and dtype")
    per_run = [aggregate.read_jsonl(p / "results.jsonl") for p in paths]
    rows = [row for run_rows in per_run for row in run_rows]
    seen: set[str] = set()
    for row in rows:
        if row["id"] in seen:
            raise ConfigError(f"request {row['id']!r} appears in more than one run; merge disjoint row ranges")
        seen.add(row["id"])
    parts = ", ".join(f"{p} (rows {m['config'].get('offset', 0)}+{len(r)})"
                      for p, m, r in zip(paths, metas, per_run, strict=True))
    cfg = {**metas[0]["config"], "out": str(out), "limit": len(rows),
           "offset": min(int(m["config"].get("offset", 0)) for m in metas)}
    summary = aggregate.summarize(rows, labels, config=cfg, env=envs[0], n_boot=n_boot, seed=seed,
                                  extra={"merged_from": parts, "merged_hardware": [e["hardware"] for e in envs],
                                         **({"machine": envs[0]["machine"]} if envs[0].get("machine") else {})})
    if not summary["n_requests"]:
        raise ConfigError(f"no request row of {[str(p) for p in paths]} holds every method {labels}; nothing to merge")
    Path(out).mkdir(parents=True, exist_ok=True)
    aggregate.write_summary(out, summary)
    if make_plots:
        plots.pareto_plots(summary, out)
    return summary


def _run_labels(path: Path, meta: dict[str, Any]) -> list[str]:
    """The method labels a run's rows hold: its specs as given (``method_labels``) less the ones it skipped
    (unregistered, or dropped by the first request's probe: listed in its summary.json)."""
    from kvrag_bench.config import method_labels

    sp = path / "summary.json"
    skipped = set(json.loads(sp.read_text()).get("skipped_methods") or []) if sp.is_file() else set()
    return [lbl for lbl in method_labels(meta["config"]["methods"]) if lbl not in skipped]
