"""Training CacheRepair: a plain PyTorch loop (CacheRepair §4.2, Appendix A "Optimization").

Objective: MSE between the predicted normalized residual ``z`` and ``(joint - stale) / sigma_delta`` over every
document token and KV coordinate, averaged per document, documents averaged per update. AdamW (0.9, 0.95), weight
decay 0.01 on matrices, gradient clipping at 1.0, linear warmup then cosine decay from ``lr`` to ``min_lr``.

Output directory ``OUT``::

    repair_config.json, repair_model.safetensors   the deployable repairer (rewritten at every checkpoint)
    stats.safetensors                              sigma_stale / sigma_delta, computed once
    curve.jsonl                                    learning curve: {"kind": "train" | "eval", "step", ...}
    train_state/                                   resumable state (model, optimizer, scheduler, step, RNG)
    pairs/                                         cache of paired stale/joint KV (default; see --pairs)

Nothing is pickled: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.errors import ConfigError
from kvrag.fingerprint import weights_fingerprint
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.repair.data import (
    DEFAULT_CHUNK_FORMAT,
    ChunkRenderer,
    CorpusIndex,
    PairBuilder,
    PairDataset,
    PairedExample,
    compute_stats,
    region_masks,
    template_prefix_ids,
)
from kvrag.repair.model import PRESETS, RepairConfig, RepairModel

log = logging.getLogger(__name__)

STATE_DIR = "train_state"
STATS_FILE = "stats.safetensors"
CURVE_FILE = "curve.jsonl"

PRESET_LR: dict[str, float] = {"tiny": 1e-3, "small": 1e-3, "base": 3e-4, "medium": 3e-4, "large": 3e-4}
"""Default peak LR per preset. The paper's 3e-4 (Appendix A) is for 100k updates; for the ~1k-update CPU runs of
``small`` a 1e-3 peak reached a lower held-out loss (dev sweep on SmolLM2-135M, 150 updates: normalized MSE 0.621
at 1e-3, 0.661 at 2e-3, 0.697 at 3e-4)."""

# Settings a resumed run must share with the run it continues (they change the data, model or schedule).
_RESUME_PINNED = ("data", "preset", "d_b", "num_blocks", "d_seg", "steps", "batch_docs", "peak_lr", "final_lr",
                  "warmup_steps",
                  "weight_decay", "max_tokens", "max_chunks", "chunk_format", "chunk_prefix", "seed",
                  "max_train_docs", "eval_modulus", "sources", "stats_docs", "lead_kinds", "exact_lead")


@dataclasses.dataclass
class TrainConfig:
    """Settings of one training run (the CLI maps its flags one to one).

    Attributes:
        data: passage-group JSONL.
        out: output directory.
        preset: repairer capacity (see :data:`kvrag.repair.model.PRESETS`); d_b / num_blocks / d_seg override it.
        steps: optimizer updates.
        batch_docs: documents per update (the paper's effective batch is 4).
        lr, min_lr: peak and final learning rate of the cosine schedule (None: :data:`PRESET_LR` and lr / 10).
        warmup: linear warmup updates (None: 2% of ``steps``, as 2,000 of 100,000 in the paper).
        weight_decay, clip: AdamW weight decay (matrices only) and gradient-norm clipping.
        max_tokens, max_chunks: document budget (chunk tokens) and chunks per document.
        chunk_format: ``str.format`` template of one chunk with {title} and {passage}.
        chunk_prefix: 'template' (chunks conditioned on the chat template's system header, as the engine does by
            default) or 'none'.
        max_train_docs: use a fixed pseudo-random subset of this many training groups (None: all).
        eval_docs: held-aside documents evaluated every ``eval_every`` updates.
        stats_docs: training documents pooled for sigma_stale / sigma_delta.
        pairs: pair-cache directory (None: OUT/pairs); cache_pairs=False disables caching.
        cache_dtype: 'float16' | 'float32' storage of cached pairs.
        sources: only groups with these ``source`` values (None: all).
        lead_kinds: the real-prompt leads drawn per document for the joint reference
            (:data:`kvrag.repair.leads.LEAD_KINDS`; None: all of them; []: the conditioning prefix only, as v1).
        exact_lead: the lead is part of each example as exact chunk 0 (read, never repaired) -- what
            ``cacherepair`` serves for a checkpoint trained this way.
    """

    data: str
    out: str
    preset: str = "small"
    d_b: int | None = None
    num_blocks: int | None = None
    d_seg: int | None = None
    steps: int = 1000
    batch_docs: int = 4
    lr: float | None = None
    min_lr: float | None = None
    warmup: int | None = None
    weight_decay: float = 0.01
    clip: float = 1.0
    max_tokens: int = 1024
    max_chunks: int = 20
    chunk_format: str = DEFAULT_CHUNK_FORMAT
    chunk_prefix: str = "template"
    max_train_docs: int | None = None
    eval_docs: int = 16
    eval_modulus: int = 50
    eval_every: int = 100
    save_every: int = 100
    log_every: int = 10
    stats_docs: int = 32
    pairs: str | None = None
    cache_pairs: bool = True
    cache_dtype: str = "float16"
    sources: list[str] | None = None
    lead_kinds: list[str] | None = None
    exact_lead: bool = True
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; valid presets: {', '.join(PRESETS)}")
        for name in ("steps", "batch_docs", "eval_every", "save_every", "log_every", "stats_docs", "max_tokens"):
            if getattr(self, name) < (0 if name == "steps" else 1):
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.final_lr <= self.peak_lr:
            raise ConfigError(f"need 0 < min_lr <= lr, got lr={self.peak_lr}, min_lr={self.final_lr}")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.chunk_prefix not in ("template", "none"):
            raise ConfigError(f"chunk_prefix must be 'template' or 'none', got {self.chunk_prefix!r}")
        if self.eval_docs < 0:
            raise ConfigError(f"eval_docs must be >= 0, got {self.eval_docs}")
        if self.lead_kinds is None:
            from kvrag.repair.leads import DEFAULT_LEAD_KINDS

            self.lead_kinds = list(DEFAULT_LEAD_KINDS)
        from kvrag.repair.leads import LEAD_KINDS

        unknown = [k for k in self.lead_kinds if k not in LEAD_KINDS]
        if unknown:
            raise ConfigError(f"unknown lead kinds {unknown}; valid kinds: {', '.join(LEAD_KINDS)}")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else PRESET_LR[self.preset]

    @property
    def final_lr(self) -> float:
        return self.min_lr if self.min_lr is not None else self.peak_lr / 10

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, round(0.02 * self.steps))

    @property
    def pairs_dir(self) -> Path | None:
        if not self.cache_pairs:
            return None
        return Path(self.pairs) if self.pairs else Path(self.out) / "pairs"

    def to_dict(self) -> dict[str, Any]:
        """The fields plus the resolved schedule (peak_lr, final_lr, warmup_steps)."""
        return {**dataclasses.asdict(self), "peak_lr": self.peak_lr, "final_lr": self.final_lr,
                "warmup_steps": self.warmup_steps}


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for update ``step`` (0-based): linear warmup, then cosine to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


@dataclasses.dataclass
class Datasets:
    """The target's RoPE/KV layout, the conditioning prefix, the pair builder and the train / eval datasets."""

    rope: Rope
    spec: KVSpec
    prefix_ids: tuple[int, ...]
    builder: PairBuilder
    train_set: PairDataset
    eval_set: PairDataset | None


def make_datasets(cfg: TrainConfig, loaded: Any) -> Datasets:
    """Build the pair datasets of a run for a loaded target model."""
    model, tok = loaded.model, loaded.tokenizer
    rope = Rope.from_model(model)
    spec = KVSpec.from_model_config(model.config, dtype=next(model.parameters()).dtype,
                                    model_fingerprint=loaded.fingerprint)
    prefix_ids = template_prefix_ids(tok, cfg.chunk_prefix)
    builder = PairBuilder(
        model=model, rope=rope, spec=spec,
        tokenize=lambda text: list(tok(text, add_special_tokens=False)["input_ids"]),
        prefix_ids=prefix_ids, renderer=ChunkRenderer(cfg.chunk_format),
        max_tokens=cfg.max_tokens, max_chunks=cfg.max_chunks,
        lead_kinds=tuple(cfg.lead_kinds or ()), exact_lead=cfg.exact_lead, tokenizer=tok,
    )
    pairs = cfg.pairs_dir
    train_set = PairDataset(
        CorpusIndex(cfg.data, "train", eval_modulus=cfg.eval_modulus, max_groups=cfg.max_train_docs,
                    sources=cfg.sources),
        builder, pairs, cfg.cache_dtype)
    eval_set = PairDataset(
        CorpusIndex(cfg.data, "eval", eval_modulus=cfg.eval_modulus, max_groups=cfg.eval_docs, sources=cfg.sources),
        builder, pairs, cfg.cache_dtype) if cfg.eval_docs else None
    return Datasets(rope, spec, prefix_ids, builder, train_set, eval_set)


def pregenerate(cfg: TrainConfig, loaded: Any, shard: int = 0, num_shards: int = 1) -> int:
    """Fill the pair cache with this shard of the eval and training documents; returns how many were built.

    Shards can run in parallel processes (``i/n`` builds every n-th document from i); training then only reads.
    """
    if cfg.pairs_dir is None:
        raise ConfigError("pregenerating pairs needs the pair cache (drop --no-pair-cache)")
    data = make_datasets(cfg, loaded)
    from tqdm.auto import tqdm

    built = 0
    for ds in (data.eval_set, data.train_set):
        if ds is None:
            continue
        todo = [i for i in range(len(ds)) if i % num_shards == shard and not ds.is_cached(i)]
        for i in tqdm(todo, desc=f"pairs {ds.index.split} {shard}/{num_shards}", unit="doc", disable=not cfg.progress):
            ds[i]
            built += 1
    return built


class Trainer:
    """One resumable training run for one target model.

    Args:
        cfg: the run's settings.
        loaded: a :class:`kvrag.models.LoadedModel` (model, tokenizer, fingerprint, name).
        resume: continue from ``OUT/train_state`` when it exists.
    """

    def __init__(self, cfg: TrainConfig, loaded: Any, *, resume: bool = False) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.target = loaded.model
        self.device = next(self.target.parameters()).device
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        data = make_datasets(cfg, loaded)
        self.rope, self.spec, self.prefix_ids = data.rope, data.spec, data.prefix_ids
        self.builder, self.train_set, self.eval_set = data.builder, data.train_set, data.eval_set
        if len(self.train_set) == 0:
            raise ConfigError(f"{cfg.data} has no training groups with >= 2 passages")
        overrides = {k: v for k, v in (("d_b", cfg.d_b), ("num_blocks", cfg.num_blocks), ("d_seg", cfg.d_seg))
                     if v is not None}
        embed_dim = int(self.target.get_input_embeddings().weight.shape[1])
        self.rcfg = RepairConfig.from_preset(cfg.preset, num_layers=self.spec.num_layers,
                                             num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim,
                                             embed_dim=embed_dim, **overrides)
        self.step = 0
        self.samples = 0
        self.tokens = 0
        self.wall_s = 0.0
        self._perm_cache: tuple[int, torch.Tensor] | None = None
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's global RNG
            torch.manual_seed(cfg.seed)
            self.model = RepairModel(self.rcfg).to(self.device)
        self.stats_meta: dict[str, Any] = {}
        state_dir = self.out / STATE_DIR
        resume = resume and state_dir.is_dir()
        if resume:
            self._check_resume(state_dir)
        elif state_dir.is_dir():
            log.warning("%s exists but --resume was not given: starting a fresh run that will overwrite it", state_dir)
        self._init_stats(reuse=resume)
        self.optimizer = self._make_optimizer()
        total, warm, ratio = cfg.steps, cfg.warmup_steps, cfg.final_lr / cfg.peak_lr
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, warm, ratio))
        if resume:
            self.load_state(state_dir)
        elif (self.out / CURVE_FILE).exists():
            (self.out / CURVE_FILE).unlink()  # a fresh run starts a fresh learning curve

    # ----------------------------------------------------------------- setup
    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.cfg.peak_lr, betas=(0.9, 0.95), foreach=False)

    def _init_stats(self, reuse: bool) -> None:
        """sigma_stale / sigma_delta: computed once per run from the first ``stats_docs`` training documents.

        A resumed run reuses the run's ``stats.safetensors``; a fresh run recomputes them (from the pair cache
        this costs seconds).
        """
        from safetensors.torch import load_file, save_file

        path = self.out / STATS_FILE
        if reuse and path.is_file():
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                self.stats_meta = json.loads((f.metadata() or {}).get("meta", "{}"))
            t = load_file(str(path))
            if self.stats_meta.get("model_fingerprint") != self.spec.model_fingerprint:
                raise ConfigError(f"{path} was computed for another model; delete it or use another --out")
            self.model.set_stats(t["sigma_stale"], t["sigma_delta"])
            return
        n = min(self.cfg.stats_docs, len(self.train_set))
        t0 = time.perf_counter()
        examples = (self.train_set[i] for i in self._progress(range(n), "normalization statistics", "doc"))
        st = compute_stats(examples, self.spec.num_layers, self.spec.num_kv_heads)
        self.stats_meta = {"tokens": st["tokens"], "documents": st["documents"],
                           "model_fingerprint": self.spec.model_fingerprint, "seconds": time.perf_counter() - t0}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"sigma_stale": st["sigma_stale"], "sigma_delta": st["sigma_delta"]}, str(tmp),
                  metadata={"meta": json.dumps(self.stats_meta)})
        os.replace(tmp, path)
        self.model.set_stats(st["sigma_stale"], st["sigma_delta"])
        log.info("normalization statistics from %d documents (%d tokens)", st["documents"], st["tokens"])

    def _progress(self, it: Any, desc: str, unit: str, **kw: Any) -> Any:
        from tqdm.auto import tqdm

        return tqdm(it, desc=desc, unit=unit, disable=not self.cfg.progress, **kw)

    # ----------------------------------------------------------------- data order
    def sample_index(self, k: int) -> int:
        """Dataset index of the k-th training sample: a fresh seeded permutation every epoch (resumable)."""
        n = len(self.train_set)
        epoch, pos = divmod(k, n)
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            self._perm_cache = (epoch, torch.randperm(n, generator=g))
        return int(self._perm_cache[1][pos])

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Frozen target token embeddings E_M(x) [N, E] (float32)."""
        return hf_cache.embed(self.target, token_ids)[0].detach().float()

    def _inputs(self, ex: PairedExample) -> tuple[torch.Tensor, ...]:
        dev = self.device
        return (ex.stale.to(dev), self.embed(ex.token_ids), ex.chunk_index.to(dev), ex.positions().to(dev),
                ex.delta.to(dev))

    # ----------------------------------------------------------------- training
    def train_step(self) -> dict[str, float]:
        """One optimizer update over ``batch_docs`` documents. Returns loss, tokens and data/compute seconds."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sig = self.model._sig("sigma_delta")
        loss_sum, toks, data_s, comp_s = 0.0, 0, 0.0, 0.0
        for _ in range(self.cfg.batch_docs):
            t0 = time.perf_counter()
            ex = self.train_set[self.sample_index(self.samples)]
            stale, emb, ci, pos, delta = self._inputs(ex)
            t1 = time.perf_counter()
            z = self.model(stale, emb, ci, pos)
            ne = ex.num_exact  # the exact lead is read, never repaired: no loss there
            loss = F.mse_loss(z[ne:], (delta / sig)[ne:])  # CacheRepair §4.2: MSE in normalized coordinates
            (loss / self.cfg.batch_docs).backward()
            comp_s += time.perf_counter() - t1
            data_s += t1 - t0
            loss_sum += float(loss.detach())
            toks += ex.num_tokens - ne
            self.samples += 1
        t1 = time.perf_counter()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        comp_s += time.perf_counter() - t1
        self.step += 1
        self.tokens += toks
        return {"loss": loss_sum / self.cfg.batch_docs, "tokens": toks, "lr": lr, "grad_norm": float(gnorm),
                "data_s": data_s, "compute_s": comp_s}

    def train(self) -> dict[str, Any]:
        """Run until ``cfg.steps`` updates, with periodic evaluation and checkpoints. Returns the summary."""
        cfg = self.cfg
        if self.eval_set is not None and len(self.eval_set) == 0:
            log.warning("no held-aside groups in %s (eval_modulus=%d); evaluation is skipped", cfg.data,
                        cfg.eval_modulus)
            self.eval_set = None
        if self.step == 0 and self.eval_set is not None:
            self._log({"kind": "eval", "step": 0, **self.evaluate()})
        bar = self._progress(range(self.step, cfg.steps), "training repairer", "step", initial=self.step,
                             total=cfg.steps)
        acc: dict[str, float] = dict.fromkeys(("loss", "tokens", "data_s", "compute_s", "n", "grad_norm"), 0.0)
        t_last = time.perf_counter()
        for _ in bar:
            r = self.train_step()
            for k in ("loss", "tokens", "data_s", "compute_s", "grad_norm"):
                acc[k] += r[k]
            acc["n"] += 1
            now = time.perf_counter()
            self.wall_s += now - t_last
            t_last = now
            bar.set_postfix(loss=f"{r['loss']:.4f}", lr=f"{r['lr']:.2e}",
                            tok_s=f"{r['tokens'] / max(1e-9, r['data_s'] + r['compute_s']):.0f}")
            last = self.step == cfg.steps
            if self.step % cfg.log_every == 0 or last:
                n = acc["n"]
                self._log({"kind": "train", "step": self.step, "lr": r["lr"], "loss": acc["loss"] / n,
                           "grad_norm": acc["grad_norm"] / n, "tokens": self.tokens, "samples": self.samples,
                           "epoch": self.samples / len(self.train_set), "wall_s": round(self.wall_s, 2),
                           "data_s": round(acc["data_s"], 3), "compute_s": round(acc["compute_s"], 3),
                           "train_tok_per_s": round(acc["tokens"] / max(1e-9, acc["compute_s"]), 1),
                           "docs_per_s": round(n * cfg.batch_docs / max(1e-9, acc["data_s"] + acc["compute_s"]), 3)})
                acc = dict.fromkeys(acc, 0.0)
            if self.eval_set is not None and (self.step % cfg.eval_every == 0 or last):
                self._log({"kind": "eval", "step": self.step, **self.evaluate()})
            if self.step % cfg.save_every == 0 or last:
                self.save_state()
                self.export()
            t_last = time.perf_counter()
        bar.close()
        if self.step == 0:
            self.export()  # --steps 0: the untrained repairer (returns stale exactly) with its statistics
        return self.summary()

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, dataset: PairDataset | None = None) -> dict[str, float]:
        """Normalized KV MSE (repair vs stale) and K/V relative RMSE on first chunk / boundaries / interiors.

        Relative RMSE pools squared errors and squared joint magnitudes over the region's tokens, all layers and
        heads (CacheRepair Table 16); K is in canonical coordinates.
        """
        ds = dataset if dataset is not None else self.eval_set
        if ds is None or len(ds) == 0:
            return {}
        was_training = self.model.training
        self.model.eval()
        H = self.rcfg.num_kv_heads
        is_k = (torch.arange(self.rcfg.num_segments, device=self.device) // H) % 2 == 0  # [S]
        sig = self.model._sig("sigma_delta")
        sums: dict[str, float] = {}

        def add(key: str, val: torch.Tensor) -> None:
            sums[key] = sums.get(key, 0.0) + float(val)

        for i in range(len(ds)):
            ex = ds[i]
            stale, emb, ci, pos, delta = self._inputs(ex)
            z = self.model(stale, emb, ci, pos)
            ne = ex.num_exact
            target = delta / sig
            add("sq_repair", (z - target)[ne:].pow(2).sum())
            add("sq_stale", target[ne:].pow(2).sum())
            add("count", torch.tensor(target[ne:].numel()))
            err_repair = (z * sig - delta).pow(2).sum(-1)  # [N, S]
            err_stale = delta.pow(2).sum(-1)
            ref = (stale + delta).pow(2).sum(-1)
            for region, m in region_masks(ex.chunk_index, num_exact=ne).items():
                m = m.to(self.device)
                for comp, sel in (("K", is_k), ("V", ~is_k)):
                    add(f"{region}.{comp}.repair", err_repair[m][:, sel].sum())
                    add(f"{region}.{comp}.stale", err_stale[m][:, sel].sum())
                    add(f"{region}.{comp}.ref", ref[m][:, sel].sum())
        if was_training:
            self.model.train()
        out: dict[str, float] = {"nmse": sums["sq_repair"] / sums["count"],
                                 "nmse_stale": sums["sq_stale"] / sums["count"], "eval_docs": len(ds)}
        for region in ("first", "boundary", "interior"):
            for comp in ("K", "V"):
                total = sums.get(f"{region}.{comp}.ref", 0.0)
                for which in ("stale", "repair"):
                    val = math.sqrt(sums.get(f"{region}.{comp}.{which}", 0.0) / total) if total > 0 else float("nan")
                    out[f"rel_rmse.{region}.{comp}.{which}"] = val
        return out

    # ----------------------------------------------------------------- output
    def _log(self, rec: dict[str, Any]) -> None:
        with (self.out / CURVE_FILE).open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log.info("%s", rec)

    def summary(self) -> dict[str, Any]:
        last_eval = None
        curve = self.out / CURVE_FILE
        if curve.is_file():
            for line in curve.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("kind") == "eval":
                    last_eval = rec
        return {
            "data": str(self.cfg.data),
            "train_documents": len(self.train_set),
            "eval_documents": len(self.eval_set) if self.eval_set is not None else 0,
            "steps": self.step,
            "samples": self.samples,
            "tokens": self.tokens,
            "epochs": round(self.samples / len(self.train_set), 3),
            "wall_s": round(self.wall_s, 1),
            "stats": self.stats_meta,
            "final_eval": last_eval,
            "config": self.cfg.to_dict(),
        }

    def export(self, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write the deployable repairer (default: OUT)."""
        return self.model.save_pretrained(
            directory or self.out,
            target_fingerprint=self.spec.model_fingerprint,
            target_name=str(getattr(self.loaded, "name", "")),
            target_weights_fingerprint=weights_fingerprint(self.target),
            training=self.summary(),
            extra={"conditioning": {"chunk_prefix": self.cfg.chunk_prefix, "chunk_prefix_ids": list(self.prefix_ids),
                                    "chunk_format": self.cfg.chunk_format,
                                    "lead_kinds": list(self.cfg.lead_kinds or ()),
                                    "exact_lead": self.cfg.exact_lead,
                                    "target_dtype": str(self.spec.dtype)}},
        )

    # ----------------------------------------------------------------- resumable state
    def save_state(self) -> Path:
        """Write OUT/train_state atomically: model, optimizer, scheduler, step counters, RNG (no pickle)."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {f"model.{k}": v.detach().cpu().contiguous()
                                            for k, v in self.model.state_dict().items()}
        osd = self.optimizer.state_dict()
        opt_scalars: dict[str, dict[str, Any]] = {}
        for pid, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"optim.{pid}.{k}"] = v.detach().cpu().contiguous()
                else:
                    opt_scalars.setdefault(str(pid), {})[k] = v
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{i}"] = s
        meta = {
            "step": self.step, "samples": self.samples, "tokens": self.tokens, "wall_s": self.wall_s,
            "config": self.cfg.to_dict(), "repair_config": self.rcfg.to_dict(),
            "model_fingerprint": self.spec.model_fingerprint,
            "optimizer": {"param_groups": osd["param_groups"], "scalars": opt_scalars},
            "scheduler": {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"},
            "python_random": _jsonable_random_state(random.getstate()),
        }
        tmp = self.out / f".{STATE_DIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_file(tensors, str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
        final = self.out / STATE_DIR
        if final.exists():
            trash = self.out / f".{STATE_DIR}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def _check_resume(self, state_dir: Path) -> None:
        meta = json.loads((state_dir / "state.json").read_text())
        if meta.get("model_fingerprint") != self.spec.model_fingerprint:
            raise ConfigError(f"{state_dir} belongs to a run for another model; use another --out")
        old = meta.get("config", {})
        new = self.cfg.to_dict()
        changed = [k for k in _RESUME_PINNED if old.get(k) != new.get(k)]
        if changed:
            detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
            raise ConfigError(f"cannot resume {state_dir} with changed settings ({detail}); "
                              "rerun with the original flags or start a fresh --out")

    def load_state(self, state_dir: Path) -> None:
        """Restore everything :meth:`save_state` wrote; training continues bit-for-bit."""
        from safetensors.torch import load_file

        meta = json.loads((state_dir / "state.json").read_text())
        t = load_file(str(state_dir / "state.safetensors"))
        self.model.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
        state: dict[int, dict[str, Any]] = {}
        for k, v in t.items():
            if k.startswith("optim."):
                _, pid, name = k.split(".", 2)
                state.setdefault(int(pid), {})[name] = v
        for pid, sc in meta["optimizer"]["scalars"].items():
            state.setdefault(int(pid), {}).update(sc)
        groups = meta["optimizer"]["param_groups"]
        for g in groups:
            g["betas"] = tuple(g["betas"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        sched = self.scheduler.state_dict()
        sched.update(meta["scheduler"])
        self.scheduler.load_state_dict(sched)
        self.step, self.samples, self.tokens = int(meta["step"]), int(meta["samples"]), int(meta["tokens"])
        self.wall_s = float(meta.get("wall_s", 0.0))
        torch.set_rng_state(t["rng.torch"])
        if torch.cuda.is_available():
            cuda = [t[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in t]
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
        if "python_random" in meta:
            random.setstate(_random_state_from_json(meta["python_random"]))
        curve = self.out / CURVE_FILE  # drop curve lines logged after this checkpoint (a crash in between)
        if curve.is_file():
            keep = [ln for ln in curve.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= self.step]
            curve.write_text("".join(ln + "\n" for ln in keep))
        log.info("resumed %s at step %d", state_dir, self.step)


def _jsonable_random_state(st: Any) -> Any:
    version, internal, gauss = st
    return [version, list(internal), gauss]


def _random_state_from_json(obj: Any) -> Any:
    version, internal, gauss = obj
    return (version, tuple(internal), gauss)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------


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
                   help="chunk template with {title} and {passage}; backslash escapes (\\n) are interpreted")
    p.add_argument("--chunk-prefix", default=d.chunk_prefix, choices=["template", "none"],
                   help="what chunk caches are conditioned on (must match the engine's chunk_prefix)")
    p.add_argument("--sources", nargs="*", default=None, help="only groups with these 'source' values")
    p.add_argument("--leads", nargs="*", default=None,
                   help="lead kinds drawn per document (default: all of kvrag.repair.leads.LEAD_KINDS; none: v1)")
    p.add_argument("--no-exact-lead", action="store_true",
                   help="v1 data: drop the lead from the examples (the first chunk is never repaired)")
    p.add_argument("--max-train-docs", type=int, default=None, help="use a fixed subset of this many groups")
    p.add_argument("--eval-docs", type=int, default=d.eval_docs, help="held-aside documents for evaluation")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--stats-docs", type=int, default=d.stats_docs, help="documents pooled for sigma statistics")
    p.add_argument("--pairs", default=None, help="pair-cache directory (default: OUT/pairs)")
    p.add_argument("--no-pair-cache", action="store_true", help="rebuild pairs every time (no disk use)")
    p.add_argument("--cache-dtype", default=d.cache_dtype, choices=["float16", "float32"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    p.add_argument("--pregenerate", action="store_true", help="only fill the pair cache, then exit")
    p.add_argument("--shard", default="0/1", help="with --pregenerate: i/n, build every n-th document from i")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    import codecs

    fmt = args.chunk_format
    if fmt != DEFAULT_CHUNK_FORMAT and "\\" in fmt:
        fmt = codecs.decode(fmt, "unicode_escape")
    return TrainConfig(
        data=args.data, out=args.out, preset=args.preset, d_b=args.d_b, num_blocks=args.num_blocks, d_seg=args.d_seg,
        steps=args.steps, batch_docs=args.batch_docs, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup,
        weight_decay=args.weight_decay, max_tokens=args.max_tokens, max_chunks=args.max_chunks, chunk_format=fmt,
        chunk_prefix=args.chunk_prefix, max_train_docs=args.max_train_docs, eval_docs=args.eval_docs,
        eval_every=args.eval_every, save_every=args.save_every, log_every=args.log_every, stats_docs=args.stats_docs,
        pairs=args.pairs, cache_pairs=not args.no_pair_cache, cache_dtype=args.cache_dtype, sources=args.sources,
        lead_kinds=args.leads, exact_lead=not args.no_exact_lead,
        seed=args.seed, progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kvrag train-repairer``. Returns the exit code."""
    from kvrag.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
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


__all__ = [
    "PRESET_LR",
    "Datasets",
    "TrainConfig",
    "Trainer",
    "add_arguments",
    "config_from_args",
    "lr_factor",
    "make_datasets",
    "pregenerate",
    "run",
    "train_main",
]


if __name__ == "__main__":  # python -m kvrag.repair.train --data ... --out ...
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raise SystemExit(train_main())
