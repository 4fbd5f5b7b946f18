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

Nothing is pickled: tensors go to safetensors, everything else to JSON. The run's settings live in
:mod:`kvrag.repair.train_config`, its resumable state in :mod:`kvrag.repair.checkpoint`, its evaluation in
:mod:`kvrag.repair.evaluate` and its command line in :mod:`kvrag.repair.train_cli`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrag.errors import ConfigError
from kvrag.fingerprint import weights_fingerprint
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.repair.checkpoint import CURVE_FILE, STATE_DIR, check_resume, load_state, save_state
from kvrag.repair.config import RepairConfig
from kvrag.repair.dataset import CorpusIndex, PairDataset
from kvrag.repair.documents import DEFAULT_CHUNK_FORMAT, PER_LEAD, ChunkRenderer, template_prefix_ids
from kvrag.repair.evaluate import evaluate
from kvrag.repair.leads import chunk_style_table
from kvrag.repair.model import RepairModel
from kvrag.repair.pairs import PairBuilder, PairedExample, compute_stats
from kvrag.repair.records import Conditioning, InitFrom, StatsMeta, TrainingSummary
from kvrag.repair.train_config import TrainConfig, lr_factor

if TYPE_CHECKING:
    from tqdm import tqdm

    from kvrag.models import LoadedModel

log = logging.getLogger(__name__)

STATS_FILE = "stats.safetensors"


@dataclasses.dataclass
class Datasets:
    """The target's RoPE/KV layout, the conditioning prefix, the pair builder and the train / eval datasets."""

    rope: Rope
    spec: KVSpec
    prefix_ids: tuple[int, ...]
    builder: PairBuilder
    train_set: PairDataset
    eval_set: PairDataset | None


def make_datasets(cfg: TrainConfig, loaded: LoadedModel) -> Datasets:
    """Build the pair datasets of a run for a loaded target model."""
    model, tok = loaded.model, loaded.tokenizer
    rope = Rope.from_model(model)
    spec = KVSpec.from_model_config(model.config, dtype=next(model.parameters()).dtype,
                                    model_fingerprint=loaded.fingerprint)
    prefix_ids = template_prefix_ids(tok, cfg.chunk_prefix)
    builder = PairBuilder(
        model=model, rope=rope, spec=spec,
        tokenize=lambda text: list(tok(text, add_special_tokens=False)["input_ids"]),
        prefix_ids=prefix_ids, per_lead_style=cfg.chunk_format == PER_LEAD,
        renderer=ChunkRenderer(DEFAULT_CHUNK_FORMAT if cfg.chunk_format == PER_LEAD else cfg.chunk_format),
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


def pregenerate(cfg: TrainConfig, loaded: LoadedModel, shard: int = 0, num_shards: int = 1) -> int:
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

    def __init__(self, cfg: TrainConfig, loaded: LoadedModel, *, resume: bool = False) -> None:
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
        embedding = self.target.get_input_embeddings().weight
        assert isinstance(embedding, torch.Tensor)
        embed_dim = int(embedding.shape[1])
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
        self.stats_meta: StatsMeta = {}
        self.init_meta: InitFrom | None = None
        state_dir = self.out / STATE_DIR
        resume = resume and state_dir.is_dir()
        if resume:
            self._check_resume(state_dir)
        elif state_dir.is_dir():
            log.warning("%s exists but --resume was not given: starting a fresh run that will overwrite it", state_dir)
        if cfg.init_from:
            self._init_from(Path(cfg.init_from), load_weights=not resume)
        self._init_stats(reuse=resume or bool(cfg.init_from))
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

    def _init_from(self, directory: Path, *, load_weights: bool) -> None:
        """Start from a trained repairer: same architecture, target and conditioning, or ConfigError.

        Its statistics are the run's (the weights are only meaningful with them); a resumed run takes its weights
        from ``train_state`` instead and only records where it started.
        """
        from kvrag.repair.model import RepairModel

        init = RepairModel.from_pretrained(directory, self.spec.model_fingerprint,
                                           expected_weights_fingerprint=weights_fingerprint(self.target))
        if init.cfg != self.rcfg:
            raise ConfigError(f"--init-from {directory}: its architecture {init.cfg.to_dict()} differs from this "
                              f"run's {self.rcfg.to_dict()}; pass the same --preset/--d-b/--blocks/--d-seg")
        meta = getattr(init, "meta", {})
        have, want = meta.get("conditioning", {}), self.conditioning()
        diff = [k for k in ("chunk_prefix", "chunk_prefix_ids", "chunk_format", "lead_kinds", "exact_lead")
                if have.get(k) != want.get(k)]
        if diff:
            detail = ", ".join(f"{k}: {have.get(k)!r} -> {want.get(k)!r}" for k in diff)
            raise ConfigError(f"--init-from {directory} was trained with other conditioning ({detail}); continue it "
                              "with its own --chunk-prefix/--chunk-format/--leads/--no-exact-lead settings")
        tr = meta.get("training", {})
        self.init_meta = {"directory": str(directory), "steps": tr.get("steps"), "samples": tr.get("samples"),
                          "tokens": tr.get("tokens"), "wall_s": tr.get("wall_s"),
                          "weights_sha256": meta.get("weights", {}).get("sha256"),
                          "final_eval_nmse": (tr.get("final_eval") or {}).get("nmse"),
                          "final_eval_step": (tr.get("final_eval") or {}).get("step"),
                          **({"init_from": tr["init_from"]} if tr.get("init_from") else {})}  # the chain
        if load_weights:
            state = init.state_dict()
            self.model.load_state_dict(state)
            self.stats_meta = {**(tr.get("stats") or {}), "model_fingerprint": self.spec.model_fingerprint,
                               "from": str(directory)}
            self._save_stats(state["sigma_stale"], state["sigma_delta"])
            log.info("continuing %s (%s steps): weights and statistics loaded", directory, tr.get("steps"))

    def _init_stats(self, reuse: bool) -> None:
        """sigma_stale / sigma_delta: computed once per run from the first ``stats_docs`` training documents.

        A resumed run reuses the run's ``stats.safetensors``; a fresh run recomputes them (from the pair cache
        this costs seconds).
        """
        from safetensors.torch import load_file

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
        self._save_stats(st["sigma_stale"], st["sigma_delta"])
        self.model.set_stats(st["sigma_stale"], st["sigma_delta"])
        log.info("normalization statistics from %d documents (%d tokens)", st["documents"], st["tokens"])

    def _save_stats(self, sigma_stale: torch.Tensor, sigma_delta: torch.Tensor) -> None:
        """Write OUT/stats.safetensors atomically, with ``stats_meta`` as its metadata."""
        from safetensors.torch import save_file

        path = self.out / STATS_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({"sigma_stale": sigma_stale.contiguous(), "sigma_delta": sigma_delta.contiguous()}, str(tmp),
                  metadata={"meta": json.dumps(self.stats_meta)})
        os.replace(tmp, path)

    def _progress(self, it: Iterable[int], desc: str, unit: str, **kw: int) -> tqdm[int]:
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

    def train(self) -> TrainingSummary:
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
    def evaluate(self, dataset: PairDataset | None = None) -> dict[str, float]:
        """Normalized KV MSE (repair vs stale) and K/V relative RMSE by region: :func:`kvrag.repair.evaluate.evaluate`."""
        return evaluate(self, dataset)

    # ----------------------------------------------------------------- output
    def _log(self, rec: Mapping[str, object]) -> None:
        with (self.out / CURVE_FILE).open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log.info("%s", rec)

    def summary(self) -> TrainingSummary:
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
            **({"init_from": self.init_meta} if self.init_meta else {}),
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
            extra={"conditioning": self.conditioning()},
        )

    def conditioning(self) -> Conditioning:
        """What the repairer is trained with, as recorded in its ``repair_config.json`` (checked at load)."""
        return {"chunk_prefix": self.cfg.chunk_prefix, "chunk_prefix_ids": list(self.prefix_ids),
                "chunk_format": self.cfg.chunk_format,
                **({"chunk_styles": chunk_style_table(self.cfg.lead_kinds or ())}
                   if self.cfg.chunk_format == PER_LEAD else {}),
                "lead_kinds": list(self.cfg.lead_kinds or ()),
                "exact_lead": self.cfg.exact_lead,
                "target_dtype": str(self.spec.dtype)}

    # ----------------------------------------------------------------- resumable state
    def save_state(self) -> Path:
        """Write OUT/train_state atomically (:func:`kvrag.repair.checkpoint.save_state`)."""
        return save_state(self)

    def _check_resume(self, state_dir: Path) -> None:
        check_resume(self, state_dir)

    def load_state(self, state_dir: Path) -> None:
        """Restore everything :meth:`save_state` wrote; training continues bit-for-bit."""
        load_state(self, state_dir)


__all__ = ["Datasets", "Trainer", "make_datasets", "pregenerate"]
