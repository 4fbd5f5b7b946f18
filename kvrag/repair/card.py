"""Publish a trained repairer: copy the deployable files, plot the learning curve and write a model card.

    python -m kvrag.repair.card RUN_DIR [--dest DIR] [--card-dest DIR] [--command "kvrag train-repairer ..."]
                                [--bench SUMMARY_JSON --bench-command "kvrag bench ..."]

``RUN_DIR`` is a ``kvrag train-repairer --out`` directory. ``--dest`` (the deployable files) defaults to the shipped
location for the target model (``kvrag/data/repairers/<model-name>/``), where ``method="cacherepair"`` finds it by
fingerprint. ``--card-dest`` (the card, ``curve.jsonl`` and the plot, which no runtime code reads) defaults to
``--dest``; for the shipped location, to ``docs/repairers/<model-name>/`` of the source checkout, so the wheel
ships only what ``cacherepair`` loads.
Everything in the card is read from the run's ``repair_config.json`` and ``curve.jsonl`` (and, with ``--bench``,
from a ``kvrag bench`` summary.json), never typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from kvrag.errors import ConfigError
from kvrag.jsontypes import JSONObject, as_object
from kvrag.repair.model import CONFIG_NAME
from kvrag.repair.records import CurveRow, InitFrom, RepairerConfig
from kvrag.repair.shipped import SHIPPED_DIR

log = logging.getLogger(__name__)

FILES = (CONFIG_NAME, "repair_model.safetensors", "stats.safetensors")
"""What ``cacherepair`` loads: the files a published repairer ships with."""
CURVE = "curve.jsonl"
CARD = "MODEL_CARD.md"
CURVE_PNG = "learning_curve.png"
DOCS_DIR = SHIPPED_DIR.parents[2] / "docs" / "repairers"
"""Where the cards of the shipped repairers live in a source checkout (beside the docs, not in the wheel)."""


def read_curve(path: Path) -> tuple[list[CurveRow], list[CurveRow]]:
    """(train rows, eval rows) of a ``curve.jsonl``."""
    rows: list[CurveRow] = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    return [r for r in rows if r.get("kind") == "train"], [r for r in rows if r.get("kind") == "eval"]


def plot_curve(curve: Path, out: Path) -> Path | None:
    """Training loss and held-out normalized KV MSE (repaired vs stale) against the step; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no learning curve in the model card: plotting needs matplotlib; install it with: "
                    "pip install 'kvrag[train]'")
        return None
    train, evals = read_curve(curve)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.7, label="train loss (normalized MSE)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["nmse"] for r in evals], "o-", label="held-out NMSE, repaired")
        ax.plot([r["step"] for r in evals], [r["nmse_stale"] for r in evals], "--", color="grey",
                label="held-out NMSE, stale (no repair)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("normalized residual MSE")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    else:  # a run that recorded no step yet: say so rather than draw an empty legend
        ax.text(0.5, 0.5, "no steps recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("CacheRepair learning curve")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _fmt(x: object, nd: int = 4) -> str:
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _at(step: object) -> str:
    return f" at step {step}" if step is not None else ""


def _init_chain(init: InitFrom | None) -> list[str]:
    """Card lines for the runs a continued training started from (newest first)."""
    lines = []
    while init:
        lines.append(f"- continued from `{init.get('directory')}` (weights sha256 {str(init.get('weights_sha256'))[:12]}"
                     f"..., {init.get('steps')} steps, {init.get('samples')} document samples, "
                     f"{(init.get('wall_s') or 0) / 60:.1f} min, last held-out NMSE {_fmt(init.get('final_eval_nmse'))}"
                     f"{_at(init.get('final_eval_step'))}) with a "
                     "fresh optimizer and schedule: the steps above come on top of those")
        init = init.get("init_from")
    return lines


def render_card(meta: RepairerConfig, *, command: str | None, bench: JSONObject | None,
                bench_command: str | None, has_plot: bool) -> str:
    """The model card text."""
    tr = meta.get("training", {})
    arch = meta.get("architecture", {})
    target = meta.get("target", {})
    ev = tr.get("final_eval") or {}
    lines = [
        f"# CacheRepair repairer for `{target.get('model_name', '?')}`",
        "",
        "A small learned network (CacheRepair §4.1) that predicts the residual between the stale KV of independently",
        "cached chunks and the jointly prefilled KV. Used by `method=\"cacherepair\"` when the engine's model has",
        (f"weights fingerprint `{target['weights_fingerprint']}` (dtype-independent, checked at load time; model "
         f"fingerprint `{target.get('model_fingerprint', '?')}` as trained)." if target.get("weights_fingerprint")
         else f"fingerprint `{target.get('model_fingerprint', '?')}` (checked at load time)."),
        "",
        "## Architecture",
        "",
        f"preset `{arch.get('preset')}`: d_b {arch.get('d_b')}, {arch.get('num_blocks')} repair blocks, d_seg "
        f"{arch.get('d_seg')}, {meta.get('num_parameters', 0) / 1e6:.2f} M parameters; target KV "
        f"[L={arch.get('num_layers')}, H_kv={arch.get('num_kv_heads')}, D={arch.get('head_dim')}].",
        "",
        "## Training",
        "",
        f"- data: `{Path(str(tr.get('data', '?'))).name}` ({tr.get('train_documents')} documents for training, "
        f"{tr.get('eval_documents')} held aside for evaluation)",
        f"- {tr.get('steps')} optimizer steps, {tr.get('samples')} document samples ({tr.get('epochs')} epochs), "
        f"{tr.get('tokens')} tokens, wall time {tr.get('wall_s', 0) / 60:.1f} min",
        *_init_chain(tr.get("init_from")),
        f"- chunk format `{json.dumps(meta.get('conditioning', {}).get('chunk_format'))}`, chunk prefix "
        f"`{meta.get('conditioning', {}).get('chunk_prefix')}`",
    ]
    cond = meta.get("conditioning", {})
    styles = cond.get("chunk_styles") or {}
    if styles:  # chunk_format 'per-lead': one rendering per prompt family
        fams: dict[tuple[str, str], list[str]] = {}
        for kind, st in styles.items():
            fams.setdefault((st.get("format", ""), st.get("separator", "")), []).append(kind)
        lines += ["- chunk styles (each document rendered as its lead's prompt family renders chunks): " + "; ".join(
            f"{json.dumps(fmt)} joined by {json.dumps(sep)} for " + ", ".join(f"`{k}`" for k in kinds)
            for (fmt, sep), kinds in fams.items())]
    if cond.get("lead_kinds"):
        lines += [
            f"- leads: every document's joint reference puts one of {len(cond['lead_kinds'])} real-prompt leads before "
            "chunk 1 (" + ", ".join(f"`{k}`" for k in cond["lead_kinds"]) + "); "
            + ("the lead is exact chunk 0 of each example (read, never repaired, no loss), and the engine reads the "
               "prompt's leading prefix the same way, so the first retrieved chunk is repaired too"
               if cond.get("exact_lead") else "the lead is not part of the examples"),
            f"- target compute dtype while training: `{cond.get('target_dtype', '?')}`; the repairer is tied to the "
            "weights (dtype-independent fingerprint) and serves every compute dtype, running in the model's dtype",
        ]
    if command:
        lines += ["", "Command:", "", "```bash", command, "```"]
    cfg = tr.get("config", {})
    if cfg:
        keep = {k: v for k, v in cfg.items() if k not in ("out", "pairs", "progress")}
        lines += ["", "<details><summary>full training config</summary>", "", "```json",
                  json.dumps(keep, indent=1, sort_keys=True), "```", "", "</details>"]
    if ev:
        lines += ["", f"## Held-out evaluation (step {ev.get('step')}, {ev.get('eval_docs')} documents)", "",
                  f"Normalized residual MSE: repaired **{_fmt(ev.get('nmse'))}** vs stale {_fmt(ev.get('nmse_stale'))}.",
                  "", "| K/V relative RMSE vs joint prefill | stale | repaired |", "|---|---:|---:|"]
        for region in ("first", "boundary", "interior"):
            for kv in ("K", "V"):
                s, r = ev.get(f"rel_rmse.{region}.{kv}.stale"), ev.get(f"rel_rmse.{region}.{kv}.repair")
                if s is not None:
                    lines.append(f"| {kv} {region} | {_fmt(s)} | {_fmt(r)} |")
        lines += ["", "Regions: `first` = the first repaired chunk (stale behind a real-prompt lead; exact when the lead "
                  "is only the conditioning prefix), `boundary` = the first tokens of each later chunk, "
                  "`interior` = the rest."]
    if has_plot:
        lines += ["", f"![learning curve]({CURVE_PNG})"]
    if bench:
        lines += ["", "## End to end (kvrag bench)", ""]
        hw, config = as_object(bench.get("hardware")), as_object(bench.get("config"))
        lines.append(f"{config.get('limit') or ''} requests from "
                     f"`{Path(str(config.get('data', '?'))).name}`; hardware: "
                     f"{hw.get('cpu', '?')} ({hw.get('cores', '?')} cores, torch threads {hw.get('torch_threads', '?')}).")
        lines += ["", "| method | n | F1 | KL(full‖m) | TTFT p50 s | TTFT / full |", "|---|---:|---:|---:|---:|---:|"]
        for name, entry in as_object(bench.get("methods")).items():
            m = as_object(entry)
            lines.append(f"| `{name}` | {m.get('n')} | {_fmt(m.get('f1'), 3)} | {_fmt(m.get('kl'))} | "
                         f"{_fmt(m.get('ttft_p50_s'), 3)} | {_fmt(m.get('ttft_ratio'), 2)} |")
        if bench_command:
            lines += ["", "```bash", bench_command, "```"]
    lines += ["", "## Limits", "",
              "Trained for this exact model (weights fingerprint), tokenizer and chunk conditioning; the engine refuses",
              "it for any other model. Trained on CPU in the background with the small preset, far fewer steps than",
              "the paper's GPU runs: it narrows the stale-vs-joint gap, it does not close it.", ""]
    return "\n".join(lines)


def publish(run_dir: str | Path, dest: str | Path | None = None, *, command: str | None = None,
            bench: str | Path | None = None, bench_command: str | None = None, replace: bool = False,
            card_dest: str | Path | None = None) -> Path:
    """Copy a trained repairer into ``dest`` and its curve, learning curve plot and model card into ``card_dest``
    (default: ``dest``; for the shipped location, ``docs/repairers/<model-name>/`` of the source checkout); returns
    ``dest``.

    Args:
        replace: overwrite another repairer already in ``dest`` (by default that is refused: the default ``dest``
            is the shipped location, and writing a card for a candidate must not silently ship it).
    """
    run = Path(run_dir)
    cfg_path = run / CONFIG_NAME
    if not cfg_path.is_file():
        msg = f"{run} has no {CONFIG_NAME}: pass the --out directory of a finished `kvrag train-repairer` run"
        raise FileNotFoundError(msg)
    meta = json.loads(cfg_path.read_text())
    if dest is None:
        dest = SHIPPED_DIR / str(meta.get("target", {}).get("model_name") or "model")
    out = Path(dest)
    if card_dest is None:
        shipped = out.resolve().parent == SHIPPED_DIR and DOCS_DIR.parent.is_dir()
        card_dest = DOCS_DIR / out.name if shipped else out
    cards = Path(card_dest)
    held = out / "repair_model.safetensors"
    if not replace and held.is_file() and held.read_bytes() != (run / "repair_model.safetensors").read_bytes():
        msg = (f"{out} already holds another repairer; pass replace=True (--replace) to overwrite it, or --dest "
               "another directory to publish a candidate without shipping it")
        raise ConfigError(msg)
    out.mkdir(parents=True, exist_ok=True)
    cards.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        if (run / f).is_file():
            shutil.copy2(run / f, out / f)
    if (run / CURVE).is_file():
        shutil.copy2(run / CURVE, cards / CURVE)
    has_plot = plot_curve(run / CURVE, cards / CURVE_PNG) is not None
    summary = json.loads(Path(bench).read_text()) if bench else None
    (cards / CARD).write_text(render_card(meta, command=command, bench=summary, bench_command=bench_command,
                                        has_plot=has_plot))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrag.repair.card", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--dest", type=Path, default=None)
    ap.add_argument("--command", default=None, help="the training command, shown verbatim in the card")
    ap.add_argument("--card-dest", type=Path, default=None,
                    help="where the card, curve.jsonl and plot go (default: --dest; docs/repairers/ for a shipped one)")
    ap.add_argument("--bench", type=Path, default=None, help="a kvrag bench summary.json to quote")
    ap.add_argument("--bench-command", default=None)
    ap.add_argument("--replace", action="store_true", help="overwrite another repairer already in the destination")
    args = ap.parse_args(argv)
    out = publish(args.run_dir, args.dest, command=args.command, bench=args.bench, bench_command=args.bench_command,
                  replace=args.replace, card_dest=args.card_dest)
    print(f"published {args.run_dir} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
