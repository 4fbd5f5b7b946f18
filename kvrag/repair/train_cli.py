"""``kvrag train-repairer``: the command-line flags of a CacheRepair training run (mapped one to one onto
:class:`~kvrag.repair.train_config.TrainConfig`) and its entry point.

    python -m kvrag.repair.train_cli --data corpus.jsonl --out repairer/
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from kvrag.errors import ConfigError
from kvrag.repair.config import PRESETS
from kvrag.repair.documents import DEFAULT_CHUNK_FORMAT, PER_LEAD
from kvrag.repair.train_config import TrainConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvrag train-repairer``."""
    d = TrainConfig(data="", out="")
    p = parser
    p.add_argument("--data", required=True, help="passage-group JSONL ({'titles': [...], 'passages': [...]} a line)")
    p.add_argument("--out", required=True, help="output directory (repairer, curve, checkpoints, pair cache)")
    p.add_argument("--model", default=None, help="target model id/path (default: the embedded default model)")
    p.add_argument("--device", default=None, help="cpu | cuda[:i] (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="target compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (e.g. 1 for background runs)")
    p.add_argument("--preset", default=d.preset, choices=list(PRESETS), help="repairer capacity")
    p.add_argument("--d-b", dest="d_b", type=int, default=None, help="override the preset's backbone width")
    p.add_argument("--blocks", dest="num_blocks", type=int, default=None, help="override the preset's block count")
    p.add_argument("--d-seg", dest="d_seg", type=int, default=None, help="override the preset's segment width")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer updates")
    p.add_argument("--batch-docs", type=int, default=d.batch_docs, help="documents per update")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-3 for tiny/small, 3e-4 for base/medium/large)")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine decay (default lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="warmup updates (default: 2%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="document budget in chunk tokens")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks)
    p.add_argument("--chunk-format", default=d.chunk_format,
                   help="chunk template with {title} and {passage} (backslash escapes such as \\n are interpreted), "
                        "or 'per-lead' (default): each document rendered as its lead's prompt family renders chunks")
    p.add_argument("--chunk-prefix", default=d.chunk_prefix, choices=["template", "none"],
                   help="what chunk caches are conditioned on (must match the engine's chunk_prefix)")
    p.add_argument("--sources", nargs="*", default=None, help="only groups with these 'source' values")
    p.add_argument("--leads", nargs="*", default=None,
                   help="lead kinds drawn per document (default: all of kvrag.repair.leads.LEAD_KINDS; none: v1)")
    p.add_argument("--no-exact-lead", action="store_true",
                   help="v1 data: drop the lead from the examples (the first chunk is never repaired)")
    p.add_argument("--max-train-docs", type=int, default=None, help="use a fixed subset of this many groups")
    p.add_argument("--eval-docs", type=int, default=d.eval_docs,
                   help="most held-aside groups evaluated (the held-aside set is about 1 in 50 of the corpus's "
                        "groups, chosen by a hash of each group's id: a corpus of fewer than ~50 groups may hold none)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--stats-docs", type=int, default=d.stats_docs, help="documents pooled for sigma statistics")
    p.add_argument("--pairs", default=None, help="pair-cache directory (default: OUT/pairs)")
    p.add_argument("--no-pair-cache", action="store_true", help="rebuild pairs every time (no disk use)")
    p.add_argument("--cache-dtype", default=d.cache_dtype, choices=["float16", "float32"])
    p.add_argument("--init-from", dest="init_from", default=None,
                   help="continue training this repairer directory (its weights and statistics; fresh optimizer)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    p.add_argument("--pregenerate", action="store_true", help="only fill the pair cache, then exit")
    p.add_argument("--shard", default="0/1", help="with --pregenerate: i/n, build every n-th document from i")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import codecs

    fmt = args.chunk_format
    if fmt not in (DEFAULT_CHUNK_FORMAT, PER_LEAD) and "\\" in fmt:
        fmt = codecs.decode(fmt, "unicode_escape")
    return TrainConfig(
        data=args.data, out=args.out, preset=args.preset, d_b=args.d_b, num_blocks=args.num_blocks, d_seg=args.d_seg,
        steps=args.steps, batch_docs=args.batch_docs, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup,
        weight_decay=args.weight_decay, max_tokens=args.max_tokens, max_chunks=args.max_chunks, chunk_format=fmt,
        chunk_prefix=args.chunk_prefix, max_train_docs=args.max_train_docs, eval_docs=args.eval_docs,
        eval_every=args.eval_every, save_every=args.save_every, log_every=args.log_every, stats_docs=args.stats_docs,
        pairs=args.pairs, cache_pairs=not args.no_pair_cache, cache_dtype=args.cache_dtype, sources=args.sources,
        lead_kinds=args.leads, exact_lead=not args.no_exact_lead, init_from=args.init_from,
        seed=args.seed, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvrag train-repairer``. Returns the exit code."""

    from kvrag.models import load_model
    from kvrag.repair.dataset import CorpusIndex
    from kvrag.repair.train import Trainer, pregenerate
    from kvrag.threads import set_torch_threads

    set_torch_threads(args.threads)
    cfg = config_from_args(args)
    CorpusIndex(args.data, "all")  # a missing or malformed corpus is an error before the (slow) model load
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.pregenerate:
        try:
            shard, num = (int(x) for x in args.shard.split("/"))
        except ValueError as e:
            raise ConfigError(f"--shard must look like i/n, got {args.shard!r}") from e
        if not 0 <= shard < num:
            raise ConfigError(f"--shard i/n needs 0 <= i < n, got {args.shard!r}")
        n = pregenerate(cfg, loaded, shard, num)
        log.info("built %d paired documents", n)
        return 0
    trainer = Trainer(cfg, loaded, resume=args.resume)
    summary = trainer.train()
    fe = summary.get("final_eval") or {}
    log.info("done: %d steps, eval nmse %.4f (stale %.4f)", summary["steps"], fe.get("nmse", float("nan")),
             fe.get("nmse_stale", float("nan")))
    return 0


def train_main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``run`` for an argparse Namespace, or parse ``argv``-style strings first."""
    if args is None or not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="kvrag train-repairer", description="Train a CacheRepair repairer.")
        add_arguments(parser)
        args = parser.parse_args(None if args is None else list(args))
    return run(args)


__all__ = ["add_arguments", "config_from_args", "run", "train_main"]


if __name__ == "__main__":  # python -m kvrag.repair.train_cli --data ... --out ...
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raise SystemExit(train_main())
