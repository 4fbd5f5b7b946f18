"""KL vs TTFT/full for the methods of two bench runs over the same requests (each ratio against its own run's full).

    python benchmarks/kvrag_bench/prof/pareto_two_runs.py RUN_A/summary.json RUN_B/summary.json OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main():
    a, b, out = sys.argv[1:4]
    pts = {}
    for path, tag in ((a, "A"), (b, "B")):
        s = json.load(open(path))
        for lbl, m in s["methods"].items():
            if lbl == "full" or m.get("kl") is None:
                continue
            name = lbl.replace("checkpoint=runs/repairer-", "").replace("-shipped", "")
            if lbl == "cacherepair":
                name = "cacherepair (v4)"
            if lbl == "stale" and "stale" in pts:
                continue
            pts[name] = (m["ttft_ratio_p50"], m["kl"], tag, s["n_requests"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, (x, y, tag, _n) in pts.items():
        ax.plot([x], [y], "o" if tag == "B" else "s", markersize=7)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ns = sorted({v[3] for v in pts.values()})
    ax.set_xlabel("TTFT / full (p50 of per-request ratios, each run against its own full)")
    ax.set_ylabel("KL(full || method), mean")
    ax.set_title(f"KL vs TTFT, dev rows, {'/'.join(map(str, ns))} requests (squares: run A, circles: run B)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
