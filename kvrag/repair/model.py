"""The CacheRepair network (CacheRepair §4.1) and its on-disk format.

The repairer reads the stale canonical KV of every document token (all layers, KV heads, K and V) together with
the frozen target token embedding and predicts a normalized residual ``z``; the repaired cache is
``stale + sigma_delta * z`` in canonical coordinates (K without RoPE, V as is).

The repairer reads its input in the packed KV feature layout of :mod:`kvrag.repair.config` (:func:`pack_kv`).

On disk a repairer is a directory holding ``repair_config.json`` (architecture, target model fingerprint, kvrag
version, training summary, checksum of the weights) and ``repair_model.safetensors`` (weights plus the
``sigma_stale`` / ``sigma_delta`` statistics as tensors).

Presets (Table 4 scaled to the target). Table 4 keeps d_b / B / d_seg fixed across targets of 3B-14B; only the
target-dependent parts (segment encoder, token projection, KV head ~ d_b * 2 L H_kv D) grow with the target. For the
default SmolLM2-135M (L=30, H_kv=3, D=64, hidden 576: D_KV = 11,520) the parameter counts are:

========  ====  ==  =====  ============  ==========================================================
preset    d_b   B   d_seg  SmolLM2-135M  use
========  ====  ==  =====  ============  ==========================================================
tiny      64    1   4      0.93M         unit tests
small     256   3   8      5.87M         CPU training (~1 h on 2 cores)
base      256   5   8      7.32M         = Table 4 "Small" (9.45M for Qwen2.5-3B, as in Table 12)
medium    512   6   16     25.7M         = Table 4 "Medium" (GPU)
large     704   6   24     45.6M         = Table 4 "Large" (GPU)
========  ====  ==  =====  ============  ==========================================================
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from kvrag.errors import CacheCorruptError, CheckpointMismatchError, ConfigError
from kvrag.repair.config import PRESETS, RepairConfig, pack_kv, unpack_kv
from kvrag.repair.layers import RepairBlock, StaleEncoder, _chunk_spans, _rope_cos_sin, block_causal_mask
from kvrag.repair.records import RepairerConfig, TrainingSummary

log = logging.getLogger(__name__)

CONFIG_NAME = "repair_config.json"
WEIGHTS_NAME = "repair_model.safetensors"
FORMAT_NAME = "kvrag-cacherepair"
FORMAT_VERSION = 1

class RepairModel(nn.Module):
    """CacheRepair network.

    Buffers ``sigma_stale`` and ``sigma_delta`` [L, 2, H_kv, D] are the fixed per-coordinate RMS scales of the stale
    KV and of the joint-minus-stale residual (CacheRepair §4.2); they travel with the weights.

    Args:
        cfg: architecture.
    """

    def __init__(self, cfg: RepairConfig) -> None:
        super().__init__()
        self.cfg = cfg
        S, D, d = cfg.num_segments, cfg.head_dim, cfg.d_b
        stats_shape = (cfg.num_layers, 2, cfg.num_kv_heads, D)
        self.register_buffer("sigma_stale", torch.ones(stats_shape))
        self.register_buffer("sigma_delta", torch.ones(stats_shape))
        self.encoder = StaleEncoder(S, D, cfg.d_seg, d)
        self.tok_proj = nn.Linear(cfg.embed_dim, d)  # P_tok
        self.fusion = nn.Linear(2 * d, d)  # F
        self.reinject = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.num_blocks))  # P_b
        self.blocks = nn.ModuleList(RepairBlock(cfg) for _ in range(cfg.num_blocks))
        self.ln_out = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.head = nn.Linear(d, S * D)  # KV residual head
        self.zero_head()

    # ----------------------------------------------------------------- helpers
    def zero_head(self) -> None:
        """Zero the residual head so the network returns the stale cache exactly (the initial state)."""
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def set_stats(self, sigma_stale: torch.Tensor, sigma_delta: torch.Tensor) -> None:
        """Install the normalization statistics [L, 2, H_kv, D] (any positive float tensors of that shape)."""
        for name, t in (("sigma_stale", sigma_stale), ("sigma_delta", sigma_delta)):
            buf = getattr(self, name)
            if tuple(t.shape) != tuple(buf.shape):
                msg = f"{name} must have shape {tuple(buf.shape)} [L, 2, H_kv, D], got {tuple(t.shape)}"
                raise ConfigError(msg)
            if not bool((t > 0).all()) or not bool(torch.isfinite(t).all()):
                msg = f"{name} must be finite and positive"
                raise ConfigError(msg)
            buf.copy_(t.to(buf.dtype))

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops(self, chunk_lengths: list[int]) -> float:
        """Analytic FLOPs of one :meth:`forward` over a document with these chunk lengths (multiply-add = 2):
        per token the segment encoder, token projection, fusion, every block's re-injection, attention projections
        and MLP, and the KV head; plus the block-causal attention pairs (chunk c attends to chunks 0..c)."""
        c = self.cfg
        S, D, d, B = c.num_segments, c.head_dim, c.d_b, c.num_blocks
        per_token = (2 * S * D * c.d_seg + 2 * S * c.d_seg * d + 2 * c.embed_dim * d + 2 * 2 * d * d
                     + B * (2 * d * d + 2 * 3 * d * d + 2 * d * d + 2 * 2 * c.mlp_ratio * d * d) + 2 * d * S * D)
        ends, pairs = 0, 0
        for n in chunk_lengths:
            ends += n
            pairs += n * ends
        return float(per_token * ends + B * pairs * 4 * d)

    def _sig(self, name: str) -> torch.Tensor:
        return getattr(self, name).reshape(self.cfg.num_segments, self.cfg.head_dim)  # [S, D]

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        stale: torch.Tensor,
        tok_emb: torch.Tensor,
        chunk_index: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the normalized residual.

        Args:
            stale: [B, N, S, D] (or [N, S, D]) stale canonical KV (raw, not normalized), packed by :func:`pack_kv`.
            tok_emb: [B, N, E] (or [N, E]) frozen target token embeddings E_M(x_t).
            chunk_index: [B, N] (or [N]) chunk ordinal per token (non-decreasing within a document; < 0 = padding).
            positions: [B, N] document positions for the repairer's RoPE (default 0..N-1).

        Returns:
            z [B, N, S, D] (or [N, S, D]) normalized residual; the repaired KV is ``stale + sigma_delta * z``.
        """
        z = self.head(self.features(stale, tok_emb, chunk_index, positions))
        return z.view(*z.shape[:-1], self.cfg.num_segments, self.cfg.head_dim)

    def features(
        self,
        stale: torch.Tensor,
        tok_emb: torch.Tensor,
        chunk_index: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The backbone's output before the residual head: [B, N, d_b] (or [N, d_b]); arguments as :meth:`forward`."""
        squeeze = stale.dim() == 3
        if squeeze:
            stale, tok_emb, chunk_index = stale[None], tok_emb[None], chunk_index[None]
            positions = positions[None] if positions is not None else None
        B, N, S, D = stale.shape
        if S != self.cfg.num_segments or D != self.cfg.head_dim:
            msg = f"stale KV has {S} segments of dim {D}; this repairer expects {self.cfg.num_segments} x {self.cfg.head_dim}"
            raise ConfigError(msg)
        if positions is None:
            positions = torch.arange(N, device=stale.device).expand(B, N)
        dt = self.head.weight.dtype  # the repairer's compute dtype
        # CacheRepair §4.1: the encoder reads KV^c_stale / sigma_stale (the scale is folded into its projection)
        s = self.encoder(stale.to(dt), (1.0 / self._sig("sigma_stale")).to(dt))  # [B, N, d_b]
        h = self._backbone(s, tok_emb, chunk_index, positions)
        return h[0] if squeeze else h

    def _backbone(self, s: torch.Tensor, tok_emb: torch.Tensor, chunk_index: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """Encoded stale KV s [B, N, d_b] + token embeddings -> the backbone's output [B, N, d_b]."""
        dt, B = s.dtype, s.shape[0]
        e = tok_emb.float()
        e = (e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-12)).to(dt)  # parameter-free RMS scaling of E_M(x)
        h = self.fusion(torch.cat([s, self.tok_proj(e)], dim=-1))  # h^0 = F([s; P_tok E_M(x)])
        spans = _chunk_spans(chunk_index[0]) if B == 1 and not self.training else None
        mask = None if spans is not None else block_causal_mask(chunk_index.to(s.device))
        head_dim = self.cfg.d_b // self.cfg.attn_heads
        cos, sin = _rope_cos_sin(positions.to(s.device), head_dim, self.cfg.rope_theta)
        cos, sin = cos.to(dt), sin.to(dt)
        for proj, block in zip(self.reinject, self.blocks, strict=True):
            h = block(h + proj(s), mask, cos, sin, spans)  # h^b = RepairBlock_b(h^{b-1} + P_b(s); A, p)
        return self.ln_out(h)

    def _folded_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual head with sigma_delta folded in, float32: weight [S * D, d_b], bias [S * D]."""
        sig = self._sig("sigma_delta").reshape(-1).float()  # [S * D]
        return self.head.weight.float() * sig[:, None], self.head.bias.float() * sig

    def _folded_head_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_folded_head` in ``dtype``, computed once per dtype while the head's weights stay unchanged (the
        serving path runs it on every request)."""
        watched = (self.head.weight, self.head.bias, self.get_buffer("sigma_delta"))
        version = tuple((t.data_ptr(), None if t.is_inference() else t._version)  # inference tensors: no counter
                        for t in watched)
        memo = self.__dict__.setdefault("_folded_memo", {})
        got = memo.get(dtype)
        if got is None or got[0] != version:
            w, b = self._folded_head()
            got = memo[dtype] = (version, w.to(dtype), b.to(dtype))
        return got[1], got[2]

    def residual(self, z: torch.Tensor) -> torch.Tensor:
        """sigma_delta * z: the predicted residual in KV units."""
        return z * self._sig("sigma_delta")

    @torch.inference_mode()
    def repair(
        self,
        stale: torch.Tensor,
        tok_emb: torch.Tensor,
        chunk_index: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        inplace: bool = False,
    ) -> torch.Tensor:
        """Repaired canonical KV ``stale + sigma_delta * z`` [.., N, S, D] in float32 (see :meth:`forward`).

        ``sigma_delta`` is folded into the residual head and the stale KV is the GEMM's accumulator
        (``addmm``), so the [N, S, D] output is written once instead of by a matmul, a scaling and an addition.

        Args:
            inplace: accumulate into ``stale`` itself (a contiguous float32 tensor the caller owns) and return it:
                no second [N, S, D] buffer (tens of MB, whose first touch costs page faults on every request).
        """
        h = self.features(stale, tok_emb, chunk_index, positions).float()
        w, b = self._folded_head()
        if inplace and not (stale.dtype == torch.float32 and stale.is_contiguous()):
            raise ValueError("repair(inplace=True) needs a contiguous float32 stale tensor")
        # [.., N, S * D]: stale itself with ``inplace``, else one float32 copy
        flat = stale.to(torch.float32, memory_format=torch.contiguous_format, copy=not inplace).view(
            *stale.shape[:-2], -1)
        if h.dim() == 2:
            flat.addmm_(h, w.t())
        else:
            flat.baddbmm_(h, w.t().expand(h.shape[0], -1, -1))
        return flat.add_(b).view(stale.shape)

    @torch.inference_mode()
    def repair_kv(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        tok_emb: torch.Tensor,
        chunk_index: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        skip: int = 0,
        canonical_keys: torch.Tensor | None = None,
        place: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`repair` of one document in the cache's own layout, in place: the serving path.

        Runs natively in the repairer's dtype (the model's compute dtype when ``cacherepair`` loads it): the encoder
        reads the caller's tensors where they lie (two batched GEMMs over the [L * H_kv, N, D] segments), the
        residual head (``sigma_delta`` folded in) runs one layer at a time, and each layer's residual is added
        straight into that layer's keys and values while it is small: no conversion, no packing, no
        [N, L * 2 * H_kv * D] temporary.

        Args:
            keys: [L, H_kv, N, D] stale keys as the cache holds them (any strides with a unit last one).
            values: [L, H_kv, N, D] stale values, e.g. a slice of the request's cache.
            skip: leading tokens that are read as context but not repaired (the exact lead).
            canonical_keys: the stale keys with RoPE removed, what the encoder reads (default: ``keys``, which are
                then canonical themselves).
            place: ``place(residual, layer)`` maps a layer's key residual [H_kv, N - skip, D] (canonical) to what is
                added to ``keys`` (e.g.
                RoPE at the tokens' global positions; rotation is linear, so a placed stale key plus the placed
                residual is the placed repaired key). Default: added as it is.

        Returns:
            ``keys[:, :, skip:]``, ``values[:, :, skip:]``, now ``stale + sigma_delta * z``: the same numbers as
            :meth:`repair` of ``pack_kv(canonical keys, values)`` (keys placed by ``place``).
        """
        L, H, N, D = keys.shape
        ck = keys if canonical_keys is None else canonical_keys
        if values.shape != keys.shape or ck.shape != keys.shape:
            msg = (f"keys {tuple(keys.shape)}, values {tuple(values.shape)} and canonical keys {tuple(ck.shape)} "
                   "must have one shape [L, H_kv, N, D]")
            raise ValueError(msg)
        if (L * 2 * H, D) != (self.cfg.num_segments, self.cfg.head_dim):
            msg = f"stale KV has {2 * L * H} segments of dim {D}; this repairer expects {self.cfg.num_segments} x {D}"
            raise ConfigError(msg)
        if positions is None:
            positions = torch.arange(N, device=keys.device)
        dt = self.head.weight.dtype
        s = self.encoder.forward_kv(ck.to(dt), values.to(dt), (1.0 / self._sig("sigma_stale")).to(dt))
        h = self._backbone(s[None], tok_emb[None], chunk_index[None], positions[None])[0, skip:].to(dt)
        w, b = self._folded_head_in(dt)
        w, b = w.view(L, 2 * H * D, -1), b.view(L, 2 * H * D)  # segments ordered (layer, K/V, head)
        out_k, out_v = keys[:, :, skip:], values[:, :, skip:]
        for layer in range(L):
            r = torch.addmm(b[layer], h, w[layer].t()).view(N - skip, 2, H, D)  # this layer's residual
            rk, rv = r[:, 0].transpose(0, 1), r[:, 1].transpose(0, 1)  # [H_kv, N - skip, D]
            out_v[layer].add_(rv)
            out_k[layer].add_(place(rk, layer) if place is not None else rk)
        return out_k, out_v

    # ----------------------------------------------------------------- persistence
    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        *,
        target_fingerprint: str,
        target_name: str = "",
        target_weights_fingerprint: str = "",
        training: TrainingSummary | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> Path:
        """Write ``repair_config.json`` + ``repair_model.safetensors`` into ``directory`` (atomic per file).

        Args:
            target_fingerprint: :func:`kvrag.models.model_fingerprint` of the target LLM the repairer was trained for.
            target_name: a human-readable name of the target.
            target_weights_fingerprint: :func:`kvrag.models.weights_fingerprint` of the target (dtype-independent;
                what loading checks when present, so one repairer serves every compute dtype of its model).
            training: a JSON-serializable training summary (data, steps, final metrics, ...).
            extra: further JSON-serializable metadata (e.g. chunk-conditioning prefix ids).

        Returns:
            The directory.
        """
        from safetensors.torch import save_file

        from kvrag import __version__

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.state_dict().items()}
        tmp_w = _tmp_path(out, WEIGHTS_NAME)
        mode = tmp_w.stat().st_mode & 0o777  # the umask's permissions; safetensors writes its file as 0600
        save_file(tensors, str(tmp_w), metadata={"format": FORMAT_NAME})
        os.chmod(tmp_w, mode)
        digest = _sha256(tmp_w)
        config = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kvrag_version": __version__,
            "architecture": self.cfg.to_dict(),
            "num_parameters": self.num_parameters,
            "target": {"model_fingerprint": target_fingerprint, "model_name": target_name,
                       **({"weights_fingerprint": target_weights_fingerprint} if target_weights_fingerprint else {})},
            "normalization": {
                "tensors": ["sigma_stale", "sigma_delta"],
                "layout": "[L, 2 (K, V), H_kv, D], RMS over training document tokens, canonical K / native V",
            },
            "weights": {"file": WEIGHTS_NAME, "sha256": digest, "dtype": "float32"},
            "training": training or {},
            **(extra or {}),
        }
        tmp_c = _tmp_path(out, CONFIG_NAME)
        tmp_c.write_text(json.dumps(config, indent=2, sort_keys=True))
        os.replace(tmp_w, out / WEIGHTS_NAME)
        os.replace(tmp_c, out / CONFIG_NAME)
        return out

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        expected_model_fingerprint: str | None = None,
        *,
        expected_weights_fingerprint: str | None = None,
        map_location: str | torch.device = "cpu",
    ) -> RepairModel:
        """Load a repairer written by :meth:`save_pretrained`.

        Args:
            expected_model_fingerprint: the fingerprint of the target model it will repair; a checkpoint trained for
                another model raises :class:`CheckpointMismatchError`. None skips the check.
            expected_weights_fingerprint: the target's dtype-independent weights identity; when both it and the
                checkpoint's recorded one are known, it is compared instead of ``expected_model_fingerprint`` (so a
                repairer trained in float32 serves the bfloat16 model too).
            map_location: device for the weights.

        Raises:
            ConfigError: the directory holds no repairer.
            CheckpointMismatchError: trained for another model.
            CacheCorruptError: the weights file does not match its recorded checksum.
        """
        from safetensors.torch import load_file

        d = Path(directory)
        meta = read_config(d)
        target = meta.get("target", {}).get("model_fingerprint", "")
        target_w = meta.get("target", {}).get("weights_fingerprint", "")
        if expected_weights_fingerprint and target_w:
            mismatch = target_w != expected_weights_fingerprint
            target, expected_model_fingerprint = target_w, expected_weights_fingerprint
        else:
            mismatch = expected_model_fingerprint is not None and target != expected_model_fingerprint
        if mismatch and expected_model_fingerprint is not None:
            msg = (
                f"the CacheRepair checkpoint in {d} was trained for model fingerprint {target[:16]}... "
                f"({meta.get('target', {}).get('model_name') or 'unnamed'}), but the model in use has fingerprint "
                f"{expected_model_fingerprint[:16]}...; train a repairer for this model with "
                "`kvrag train-repairer --data CORPUS.jsonl --out DIR` and pass `cacherepair:checkpoint=DIR`"
            )
            raise CheckpointMismatchError(msg)
        wpath = d / meta.get("weights", {}).get("file", WEIGHTS_NAME)
        if not wpath.is_file():
            msg = f"{wpath} is missing; the repairer directory {d} is incomplete"
            raise ConfigError(msg)
        want = meta.get("weights", {}).get("sha256")
        if want and _sha256(wpath) != want:
            msg = f"{wpath} does not match the sha256 recorded in {CONFIG_NAME}; the checkpoint is corrupt"
            raise CacheCorruptError(msg)
        cfg = RepairConfig.from_dict(meta["architecture"])
        model = cls(cfg)
        state = load_file(str(wpath), device=str(map_location))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            msg = f"{wpath}: missing tensors {sorted(missing)}, unexpected {sorted(unexpected)}"
            raise CacheCorruptError(msg)
        model.to(map_location)
        model.eval()
        model.meta = meta  # type: ignore[assignment]
        return model


def read_config(directory: str | os.PathLike[str]) -> RepairerConfig:
    """The parsed ``repair_config.json`` of a repairer directory (ConfigError if absent or not a repairer)."""
    path = Path(directory) / CONFIG_NAME
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError as e:
        msg = f"no CacheRepair checkpoint in {directory}: {CONFIG_NAME} not found"
        raise ConfigError(msg) from e
    except ValueError as e:
        msg = f"{path} is not valid JSON: {e}"
        raise CacheCorruptError(msg) from e
    if meta.get("format") != FORMAT_NAME or int(meta.get("format_version", 0)) > FORMAT_VERSION:
        msg = (f"{path} is not a {FORMAT_NAME} v<={FORMAT_VERSION} checkpoint (format {meta.get('format')!r} "
               f"v{meta.get('format_version')}); upgrade kvrag or retrain")
        raise ConfigError(msg)
    return meta


def _tmp_path(directory: Path, name: str) -> Path:
    """A new empty temp file next to the target, created with the umask's permissions (not mkstemp's 0600)."""
    tmp = directory / f".{name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp"
    with open(tmp, "xb"):
        pass
    return tmp


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


__all__ = [
    "CONFIG_NAME",
    "PRESETS",
    "WEIGHTS_NAME",
    "RepairConfig",
    "RepairModel",
    "block_causal_mask",
    "pack_kv",
    "read_config",
    "unpack_kv",
]
