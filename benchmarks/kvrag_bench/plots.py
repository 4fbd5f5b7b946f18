"""Benchmark plots (matplotlib, Agg backend, PNG): quality-vs-TTFT Pareto charts and the TTFT sweeps."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - matplotlib is a kvrag-bench dependency
        msg = "plots need matplotlib (a dependency of kvrag-bench); install it with `pip install -e benchmarks`"
        raise ImportError(msg) from e
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the Pareto-optimal points (lower x is better; y higher or lower is better), sorted by x.

    A point is on the front when no other point has x <= its x and a y at least as good, with one of them strictly
    better.
    """
    idx = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1] if higher_is_better else points[i][1]))
    front: list[int] = []
    best: float | None = None
    for i in idx:
        y = points[i][1]
        if best is None or (y > best if higher_is_better else y < best):
            front.append(i)
            best = y
    return front


def _scatter(ax: Any, pts: list[tuple[str, float, float, Any]], higher: bool, marker: str = "o") -> None:
    for label, x, y, err in pts:
        kw = {"yerr": err} if err is not None else {}
        ax.errorbar([x], [y], fmt=marker, capsize=3, markersize=7, **kw)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    if len(pts) > 1:
        front = pareto_front([(p[1], p[2]) for p in pts], higher)
        ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], "--", color="gray", lw=1, label="Pareto front")
        ax.legend(loc="best", fontsize=8)


def pareto_plots(summary: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``pareto_f1_ttft.png`` (F1 vs p50 TTFT, 95% CI bars) and ``pareto_kl_ttft.png`` (KL vs p50 TTFT).

    Peers (if any) appear in the F1 chart with square markers. Returns the written paths.
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    methods = summary.get("methods", {})
    n = summary.get("n_requests", 0)
    model = (summary.get("model") or {}).get("name") or summary.get("config", {}).get("model") or "default model"
    paths = []

    f1_pts, kl_pts = [], []
    for lbl, m in methods.items():
        x = m.get("ttft_p50_s")
        if x is None:
            continue
        if m.get("f1") is not None:
            ci = m.get("f1_ci")
            err = [[m["f1"] - ci[0]], [ci[1] - m["f1"]]] if ci else None
            f1_pts.append((lbl, x, m["f1"], err))
        if m.get("kl") is not None:
            ci = m.get("kl_ci")
            err = [[max(0.0, m["kl"] - ci[0])], [max(0.0, ci[1] - m["kl"])]] if ci else None
            kl_pts.append((lbl, x, m["kl"], err))
    peer_pts = [(f"peer:{p}", v["ttft_p50_s"], v["f1"], None) for p, v in summary.get("peers", {}).items()
                if v.get("ttft_p50_s") is not None and v.get("f1") is not None]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _scatter(ax, f1_pts, higher=True)
    for label, x, y, _ in peer_pts:
        ax.plot([x], [y], "s", markersize=7)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.set_xlabel("TTFT p50 (s), cache-ready")
    ax.set_ylabel("F1 (mean, 95% CI)")
    ax.set_title(f"F1 vs TTFT — {model}, {n} requests")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "pareto_f1_ttft.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _scatter(ax, kl_pts, higher=False)
    ax.set_xlabel("TTFT p50 (s), cache-ready")
    ax.set_ylabel("KL(full ‖ method), nats per token")
    pos = [p[2] for p in kl_pts if p[2] > 0]
    if pos and max(pos) / min(pos) > 10:  # spread over decades: symlog keeps full's 0 on the chart
        ax.set_yscale("symlog", linthresh=10 ** math.floor(math.log10(min(pos))))
    ax.set_title(f"KL vs TTFT — {model}, {n} requests")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "pareto_kl_ttft.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


def sweep_plots(points: Sequence[dict[str, Any]], out_dir: str | os.PathLike[str], title: str = "") -> list[Path]:
    """Log-log TTFT charts from sweep points: ``sweep_length.png`` (vs context tokens) and ``sweep_chunks.png``
    (vs chunk count); plus ``sweep_memory.png`` (peak memory vs context tokens) when memory was measured.

    Args:
        points: dicts with ``sweep`` ('length' | 'chunks'), ``method``, ``context_tokens``, ``n_chunks``,
            ``ttft_s`` and optionally ``peak_mem_bytes``.
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    specs = [
        ("length", "context_tokens", "ttft_s", "context length (tokens)", "TTFT (s)", "sweep_length.png", 1.0),
        ("chunks", "n_chunks", "ttft_s", "chunks (fixed content)", "TTFT (s)", "sweep_chunks.png", 1.0),
        ("length", "context_tokens", "peak_mem_bytes", "context length (tokens)", "peak memory (MiB)",
         "sweep_memory.png", 1 / 2**20),
    ]
    for sweep, xkey, ykey, xlabel, ylabel, fname, scale in specs:
        pts = [p for p in points if p.get("sweep") == sweep and p.get(ykey)]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method in dict.fromkeys(p["method"] for p in pts):
            mp = sorted((p for p in pts if p["method"] == method), key=lambda p: p[xkey])
            ax.plot([p[xkey] for p in mp], [p[ykey] * scale for p in mp], "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(' (')[0]} vs {xlabel.split(' (')[0]}" + (f" — {title}" if title else ""))
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def combined_pareto(summaries: Sequence[tuple[str, dict[str, Any]]], out_path: str | os.PathLike[str],
                    metric: str = "kl") -> Path:
    """One KL (or F1) vs TTFT/TTFT_full chart over several ``kvrag bench`` runs.

    Each run's TTFT is divided by the p50 TTFT of ``full`` *in that run* (its ``ttft_ratio``), so runs made at
    different times on the same machine share the x axis without mixing absolute timings. A method that appears
    in several runs is drawn once per run (labels carry the run name). The dashed line is the Pareto front over
    every point.

    Args:
        summaries: (run name, summary.json dict) pairs.
        metric: 'kl' (lower is better, symlog axis) or 'f1' (higher is better).
    """
    if metric not in ("kl", "f1"):
        raise ValueError(f"metric must be 'kl' or 'f1', got {metric!r}")
    plt = _pyplot()
    markers = "osD^vP*X"
    fig, ax = plt.subplots(figsize=(8, 5))
    pts: list[tuple[float, float]] = []
    for i, (run, summary) in enumerate(summaries):
        legend: str | None = run  # the run's first drawn point carries its legend entry
        for lbl, m in summary.get("methods", {}).items():
            x, y = m.get("ttft_ratio"), m.get(metric)
            if x is None or y is None:
                continue
            ax.plot([x], [y], markers[i % len(markers)], color=f"C{i % 10}", markersize=7, label=legend)
            legend = None
            ax.annotate(lbl, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
            pts.append((x, y))
    if len(pts) > 1:
        front = pareto_front(pts, higher_is_better=metric == "f1")
        ax.plot([pts[j][0] for j in front], [pts[j][1] for j in front], "--", color="gray", lw=1, label="Pareto front")
    ax.set_xlabel("TTFT / TTFT(full), p50 in the same run")
    ax.set_ylabel("KL(full ‖ method), nats per token" if metric == "kl" else "F1")
    if metric == "kl":
        pos = [y for _, y in pts if y > 0]
        if pos and max(pos) / min(pos) > 10:
            ax.set_yscale("symlog", linthresh=10 ** math.floor(math.log10(min(pos))))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{'KL' if metric == 'kl' else 'F1'} vs relative TTFT, every method")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
