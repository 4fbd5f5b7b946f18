"""``cacherepair``: a small learned network predicts the joint-minus-stale KV residual (CacheRepair §4.1).

The repairer reads the stale canonical KV of every non-prefix context token (chunks and in-between text, each span
one "chunk" of the block-causal mask) plus the frozen target token embeddings, adds ``sigma_delta * z`` to the
stale cache in canonical coordinates and re-places the keys at their global positions. The leading prefix span is
exact and left as it is.

Parameter ``checkpoint``: a directory written by ``kvrag train-repairer`` / ``RepairModel.save_pretrained``, or a
directory of such directories (the one trained for the model in use is picked by fingerprint, else by name). By
default the shipped checkpoints in ``kvrag/data/repairers/`` are searched that way.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import CheckpointMismatchError, ConfigError
from kvrag.fingerprint import weights_fingerprint
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register
from kvrag.fusion.stats import MethodStats
from kvrag.kv import hf_cache
from kvrag.repair.model import CONFIG_NAME, RepairModel
from kvrag.repair.shipped import SHIPPED_DIR

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


def _train_hint(model: PreTrainedModel) -> str:
    """How to train a repairer for ``model`` (its own name in ``--model``: without it the command trains one for the
    embedded default model)."""
    from kvrag.gguf_marker import read_marker

    name = str(getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "MODEL")
    marker = read_marker(Path(name)) if Path(name).is_dir() else None  # a GGUF's prepared folder: name the file
    if marker is not None and marker.get("gguf_path"):
        name = str(marker["gguf_path"])
    return (f"train one with `kvrag train-repairer --model {shlex.quote(name)} --data CORPUS.jsonl --out DIR "
            '--preset small` (CORPUS: one {"titles": [...], "passages": [...]} object a line) and use '
            "`cacherepair:checkpoint=DIR`")


def model_dir_name(model: PreTrainedModel) -> str:
    """The directory name a shipped repairer of ``model`` uses: its name (last path part), '/' -> '--'."""
    name = str(getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    if not name:
        return ""
    p = Path(name)
    base = p.name if p.is_absolute() or p.exists() else name.replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-").lower()


def find_shipped_checkpoint(model: PreTrainedModel, fingerprint: str, root: Path = SHIPPED_DIR,
                            weights_fingerprint: str = "") -> Path | None:
    """A shipped repairer for the model: one whose recorded target (weights or model) fingerprint matches, else
    one named after it."""
    if not root.is_dir():
        return None
    if fingerprint or weights_fingerprint:
        for cfg in sorted(root.glob(f"*/{CONFIG_NAME}")):
            try:
                meta = json.loads(cfg.read_text())
            except (OSError, ValueError):
                continue
            target = meta.get("target", {})
            if (weights_fingerprint and target.get("weights_fingerprint") == weights_fingerprint) or (
                    fingerprint and target.get("model_fingerprint") == fingerprint):
                return cfg.parent
    name = model_dir_name(model)
    if name and (root / name / CONFIG_NAME).is_file():
        return root / name
    return None


_LOAD_LOCK = threading.Lock()


@register
class CacheRepair(FusionMethod):
    """Learned residual repair of the stale KV (CacheRepair, §4.1).

    A checkpoint trained with an exact lead (``conditioning.exact_lead``, kvrag >= v2 data) reads the prompt's
    leading prefix span as chunk 0 (exact context, never written back), so the first retrieved chunk is repaired
    like any later one; an older checkpoint sees only the stale spans, as it was trained.
    """

    name = "cacherepair"
    reads_canonical_keys = True
    params = {"checkpoint": (str, None)}
    checkpoint: str | None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._repairers: dict[tuple[str, str, str], RepairModel] = {}
        self._paths: dict[tuple[str, str], Path] = {}
        self._warned: set[tuple[str, tuple[int, ...]]] = set()

    def checkpoint_for(self, inp: FusionInput) -> Path:
        """The repairer checkpoint this method uses for ``inp``'s model.

        Raises:
            KVRAGError: none fits the model (no shipped repairer; a given one trained for other weights)."""
        return self._resolve(inp)

    def _resolve(self, inp: FusionInput) -> Path:
        """The checkpoint directory for ``inp``'s model (resolved once per model identity)."""
        wfp = weights_fingerprint(inp.model)
        memo = (inp.spec.model_fingerprint, wfp)
        got = self._paths.get(memo)
        if got is None:
            got = self._find(inp, wfp)
            self._paths[memo] = got
        return got

    def _find(self, inp: FusionInput, wfp: str) -> Path:
        fp = inp.spec.model_fingerprint
        if self.checkpoint:
            path = Path(self.checkpoint).expanduser()
            if (path / CONFIG_NAME).is_file():
                return path
            found = find_shipped_checkpoint(inp.model, fp, root=path, weights_fingerprint=wfp)
            if found is None:
                msg = (f"cacherepair: no repairer in {path} ({CONFIG_NAME} not found there nor in a subdirectory for "
                       f"this model); {_train_hint(inp.model)}")
                raise ConfigError(msg)
            return found
        found = find_shipped_checkpoint(inp.model, fp, weights_fingerprint=wfp)
        if found is None:
            msg = (f"cacherepair: no repairer for this model (fingerprint {fp[:16] or '?'}) ships with kvrag "
                   f"({SHIPPED_DIR} holds the embedded default model's); {_train_hint(inp.model)}")
            raise ConfigError(msg)
        return found

    def repairer(self, inp: FusionInput) -> RepairModel:
        """The loaded repairer for ``inp``'s model (cached per checkpoint and device)."""
        path = self._resolve(inp)
        device, dtype = inp.keys.device, inp.keys.dtype
        key = (str(path.resolve()), str(device), str(dtype))
        with _LOAD_LOCK:
            rep = self._repairers.get(key)
            if rep is None:
                fp = inp.spec.model_fingerprint or None
                if fp is None:
                    log.warning("cacherepair: the KV spec carries no model fingerprint; checking shapes only")
                rep = RepairModel.from_pretrained(path, fp, expected_weights_fingerprint=weights_fingerprint(inp.model),
                                                  map_location=device)
                rep.to(dtype)  # runs in the model's compute dtype (weights are stored in float32)
                self._repairers[key] = rep
        self._check_conditioning(path, rep, inp)
        c, s = rep.cfg, inp.spec
        if (c.num_layers, c.num_kv_heads, c.head_dim) != (s.num_layers, s.num_kv_heads, s.head_dim):
            msg = (f"the repairer in {path} expects KV [L={c.num_layers}, H_kv={c.num_kv_heads}, D={c.head_dim}], "
                   f"the model has [L={s.num_layers}, H_kv={s.num_kv_heads}, D={s.head_dim}]; "
                   f"{_train_hint(inp.model)}")
            raise CheckpointMismatchError(msg)
        return rep

    def _check_conditioning(self, path: Path, rep: RepairModel, inp: FusionInput) -> None:
        """Warn once per checkpoint and engine conditioning when the chunk caches are conditioned differently from
        the caches the repairer was trained on (it then repairs a stale KV it never saw)."""
        cond = (getattr(rep, "meta", {}) or {}).get("conditioning") or {}
        if "chunk_prefix_ids" not in cond:
            return
        trained = tuple(cond["chunk_prefix_ids"])
        memo = (str(path), inp.chunk_prefix_ids)
        if trained == inp.chunk_prefix_ids or memo in self._warned:
            return
        self._warned.add(memo)
        log.warning(
            "cacherepair: the repairer in %s was trained on chunk caches conditioned on %d prefix tokens "
            "(chunk_prefix=%r), but this engine conditions chunks on %d tokens; repairs will be less accurate. "
            "Use the engine's chunk_prefix=%r or retrain with `kvrag train-repairer --chunk-prefix ...`",
            path, len(trained), cond.get("chunk_prefix"), len(inp.chunk_prefix_ids), cond.get("chunk_prefix"))

    @staticmethod
    def reads_exact_lead(rep: RepairModel) -> bool:
        """Whether the checkpoint was trained with the exact lead as chunk 0 (v2 data)."""
        meta = getattr(rep, "meta", {}) or {}
        return bool(meta.get("conditioning", {}).get("exact_lead", False))

    @torch.inference_mode()
    def fuse(self, inp: FusionInput) -> FusionOutput:
        t0 = time.perf_counter()
        # the repairer predicts alone -> in-context residuals: K/V computed in context ('kept') are left as they are
        spans = [sp for sp in inp.spans if sp.kind not in ("prefix", "kept") and sp.length > 0]
        keys, values = inp.working_kv()
        if not spans:  # nothing is stale
            return FusionOutput(cache=inp.cache_over(keys, values),
                                stats=MethodStats(recomputed_fraction=0.0, repaired_tokens=0))
        rep = self.repairer(inp)
        dev = keys.device
        # CacheRepair v2: the exact leading prefix is read as chunk 0 (context for the repair, never written back)
        lead = [sp for sp in inp.spans if sp.kind == "prefix" and sp.length > 0 and sp.start == 0][:1]
        read = (lead if self.reads_exact_lead(rep) else []) + spans
        num_exact = read[0].length if lead and read[0] is lead[0] else 0
        lo, hi = read[0].start, read[-1].end
        contiguous = all(a.end == b.start for a, b in zip(read, read[1:], strict=False))
        idx = (torch.arange(lo, hi) if contiguous else torch.cat([torch.arange(sp.start, sp.end) for sp in read])
               ).to(dev)  # [N] global positions
        chunk_index = torch.cat([torch.full((sp.length,), i, dtype=torch.long) for i, sp in enumerate(read)]).to(dev)
        out_idx = idx[num_exact:]
        emb = hf_cache.embed(inp.model, inp.token_ids[idx.cpu()])[0]  # [N, E] frozen E_M(x)
        positions = idx - idx[0]  # document positions (the repairer's RoPE is relative anyway)
        # global RoPE after repair (CacheRepair §4.1): the keys lie placed in the cache, and rotation is linear, so
        # each layer's canonical key residual is placed at the tokens' global positions and added there
        cos, sin = inp.rope.cos_sin(out_idx)  # [N, R], or [L, N, R] with per-layer frequencies

        def place(rk: torch.Tensor, layer: int) -> torch.Tensor:
            cs = (cos[layer], sin[layer]) if inp.rope.per_layer else (cos, sin)
            return inp.rope.layer(layer).place(rk, out_idx, cos_sin=cs)

        t1 = time.perf_counter()
        # repaired where it lies when contiguous (the request's own cache, or the copies working_kv made); else
        # gathered, repaired and scattered back
        where: slice | torch.Tensor = slice(lo, hi) if contiguous else idx
        sel_k, sel_v = keys[:, :, where], values[:, :, where]  # [L, H_kv, N, D]
        ck = inp.canonical_keys[:, :, where] if inp.canonical_keys is not None else inp.rope.canonicalize(sel_k, idx)
        rk, rv = rep.repair_kv(sel_k, sel_v, emb, chunk_index, positions, skip=num_exact, canonical_keys=ck,
                               place=place)
        if not contiguous:
            keys[:, :, out_idx], values[:, :, out_idx] = rk, rv
        t2 = time.perf_counter()
        n = int(out_idx.shape[0])
        return FusionOutput(
            cache=inp.cache_over(keys, values),
            stats=MethodStats(
                recomputed_fraction=0.0,
                repaired_tokens=n,
                repaired_fraction=n / max(1, inp.context_len),
                exact_lead_tokens=num_exact,
                repair_s=t2 - t1,
                fusion_s=time.perf_counter() - t0,
                repairer_parameters=rep.num_parameters,
                repairer_flops=float(rep.flops([sp.length for sp in read])),
            ),
        )
