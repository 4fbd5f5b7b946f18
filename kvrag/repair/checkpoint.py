"""Resumable CacheRepair training state: ``OUT/train_state`` (model, optimizer, scheduler, counters, RNG).

Nothing is pickled: tensors go to safetensors, everything else to JSON; the directory is replaced atomically. A
resumed run must keep the settings in :data:`RESUME_PINNED` and continues bit-for-bit.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import ConfigError
from kvrag.repair.run_state import TrainingRun

log = logging.getLogger(__name__)

STATE_DIR = "train_state"
CURVE_FILE = "curve.jsonl"

# Settings a resumed run must share with the run it continues (they change the data, model or schedule).
RESUME_PINNED = ("data", "preset", "d_b", "num_blocks", "d_seg", "steps", "batch_docs", "peak_lr", "final_lr",
                  "warmup_steps",
                  "weight_decay", "max_tokens", "max_chunks", "chunk_format", "chunk_prefix", "seed",
                  "max_train_docs", "eval_modulus", "sources", "stats_docs", "lead_kinds", "exact_lead", "init_from")


def save_state(trainer: TrainingRun) -> Path:
    """Write OUT/train_state atomically: model, optimizer, scheduler, step counters, RNG (no pickle)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {f"model.{k}": v.detach().cpu().contiguous()
                                        for k, v in trainer.model.state_dict().items()}
    osd = trainer.optimizer.state_dict()
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
        "step": trainer.step, "samples": trainer.samples, "tokens": trainer.tokens, "wall_s": trainer.wall_s,
        "config": trainer.cfg.to_dict(), "repair_config": trainer.rcfg.to_dict(),
        "model_fingerprint": trainer.spec.model_fingerprint,
        "optimizer": {"param_groups": osd["param_groups"], "scalars": opt_scalars},
        "scheduler": {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"},
        "python_random": _jsonable_random_state(random.getstate()),
    }
    tmp = trainer.out / f".{STATE_DIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    final = trainer.out / STATE_DIR
    if final.exists():
        trash = trainer.out / f".{STATE_DIR}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp, final)
    return final

def check_resume(trainer: TrainingRun, state_dir: Path) -> None:
    meta = json.loads((state_dir / "state.json").read_text())
    if meta.get("model_fingerprint") != trainer.spec.model_fingerprint:
        raise ConfigError(f"{state_dir} belongs to a run for another model; use another --out")
    old = meta.get("config", {})
    new = trainer.cfg.to_dict()
    changed = [k for k in RESUME_PINNED if old.get(k) != new.get(k)]
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ConfigError(f"cannot resume {state_dir} with changed settings ({detail}); "
                          "rerun with the original flags or start a fresh --out")

def load_state(trainer: TrainingRun, state_dir: Path) -> None:
    """Restore everything :meth:`save_state` wrote; training continues bit-for-bit."""
    from safetensors.torch import load_file

    meta = json.loads((state_dir / "state.json").read_text())
    t = load_file(str(state_dir / "state.safetensors"))
    trainer.model.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
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
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    sched = trainer.scheduler.state_dict()
    sched.update(meta["scheduler"])
    trainer.scheduler.load_state_dict(sched)
    trainer.step, trainer.samples, trainer.tokens = int(meta["step"]), int(meta["samples"]), int(meta["tokens"])
    trainer.wall_s = float(meta.get("wall_s", 0.0))
    torch.set_rng_state(t["rng.torch"])
    if torch.cuda.is_available():
        cuda = [t[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in t]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    if "python_random" in meta:
        random.setstate(_random_state_from_json(meta["python_random"]))
    curve = trainer.out / CURVE_FILE  # drop curve lines logged after this checkpoint (a crash in between)
    if curve.is_file():
        keep = [ln for ln in curve.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= trainer.step]
        curve.write_text("".join(ln + "\n" for ln in keep))
    log.info("resumed %s at step %d", state_dir, trainer.step)


def _jsonable_random_state(st: tuple[int, tuple[int, ...], float | None]) -> list[object]:
    version, internal, gauss = st
    return [version, list(internal), gauss]


def _random_state_from_json(obj: Any) -> Any:
    version, internal, gauss = obj
    return (version, tuple(internal), gauss)


__all__ = ["CURVE_FILE", "RESUME_PINNED", "STATE_DIR", "check_resume", "load_state", "save_state"]
