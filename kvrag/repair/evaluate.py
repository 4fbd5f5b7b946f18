"""Held-out evaluation of a repairer during training: normalized KV MSE and K/V relative RMSE by region."""

from __future__ import annotations

import math

import torch

from kvrag.repair.dataset import PairDataset
from kvrag.repair.pairs import region_masks
from kvrag.repair.run_state import TrainingRun


@torch.no_grad()
def evaluate(trainer: TrainingRun, dataset: PairDataset | None = None) -> dict[str, float]:
    """Normalized KV MSE (repair vs stale) and K/V relative RMSE on first chunk / boundaries / interiors.

    Relative RMSE pools squared errors and squared joint magnitudes over the region's tokens, all layers and
    heads (CacheRepair Table 16); K is in canonical coordinates.
    """
    ds = dataset if dataset is not None else trainer.eval_set
    if ds is None or len(ds) == 0:
        return {}
    was_training = trainer.model.training
    trainer.model.eval()
    H = trainer.rcfg.num_kv_heads
    is_k = (torch.arange(trainer.rcfg.num_segments, device=trainer.device) // H) % 2 == 0  # [S]
    sig = trainer.model._sig("sigma_delta")
    sums: dict[str, float] = {}

    def add(key: str, val: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0.0) + float(val)

    for i in range(len(ds)):
        ex = ds[i]
        stale, emb, ci, pos, delta = trainer._inputs(ex)
        z = trainer.model(stale, emb, ci, pos)
        ne = ex.num_exact
        target = delta / sig
        add("sq_repair", (z - target)[ne:].pow(2).sum())
        add("sq_stale", target[ne:].pow(2).sum())
        add("count", torch.tensor(target[ne:].numel()))
        err_repair = (z * sig - delta).pow(2).sum(-1)  # [N, S]
        err_stale = delta.pow(2).sum(-1)
        ref = (stale + delta).pow(2).sum(-1)
        for region, m in region_masks(ex.chunk_index, num_exact=ne).items():
            m = m.to(trainer.device)
            for comp, sel in (("K", is_k), ("V", ~is_k)):
                add(f"{region}.{comp}.repair", err_repair[m][:, sel].sum())
                add(f"{region}.{comp}.stale", err_stale[m][:, sel].sum())
                add(f"{region}.{comp}.ref", ref[m][:, sel].sum())
    if was_training:
        trainer.model.train()
    out: dict[str, float] = {"nmse": sums["sq_repair"] / sums["count"],
                             "nmse_stale": sums["sq_stale"] / sums["count"], "eval_docs": len(ds)}
    for region in ("first", "boundary", "interior"):
        for comp in ("K", "V"):
            total = sums.get(f"{region}.{comp}.ref", 0.0)
            for which in ("stale", "repair"):
                val = math.sqrt(sums.get(f"{region}.{comp}.{which}", 0.0) / total) if total > 0 else float("nan")
                out[f"rel_rmse.{region}.{comp}.{which}"] = val
    return out


__all__ = ["evaluate"]
