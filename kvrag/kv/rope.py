"""RoPE removal and re-application for canonical chunk keys.

Keys are stored *canonical*: ``c = R(-p) k_rot`` where ``k_rot`` is the key the model cached at position ``p``.
Placing a chunk at global position ``p'`` applies ``R(p')``. Both are pure rotations computed in fp32 from the
model's own ``inv_freq`` (never recomputed from ``rope_theta``). transformers folds YaRN/LongRoPE attention
scaling into cos/sin, so ``k_rot = s * R(p) k``; the canonical key then carries ``s`` and the placement must
not apply it again, which a pure rotation guarantees.

Support matrix (exact): default, linear, llama3, yarn. Refused with UnsupportedModelError: dynamic NTK and
LongRoPE (frequencies depend on the sequence length), models without RoPE.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrag.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length",
    "longrope": "LongRoPE switches frequency sets with the sequence length",
}


def rope_type_of(config: Any) -> str:
    """The rope type named by a transformers config (v5 ``rope_parameters`` or legacy ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type parameters (e.g. {"full_attention": {...}}); require them to agree.
        types = {v.get("rope_type", v.get("type", "default")) for v in params.values()}
        if len(types) != 1:
            msg = f"per-layer RoPE types {sorted(types)} are not supported"
            raise UnsupportedModelError(msg)
        return types.pop()
    if isinstance(params, dict):
        return str(params.get("rope_type", params.get("type", "default")))
    return "default"


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model's rotary-embedding module (the one owning ``inv_freq``)."""
    base = getattr(model, "model", model)
    rot = getattr(base, "rotary_emb", None)
    if rot is not None and hasattr(rot, "inv_freq"):
        return rot
    for _, mod in model.named_modules():
        if hasattr(mod, "inv_freq") and isinstance(mod.inv_freq, torch.Tensor):
            return mod
    name = type(model).__name__
    msg = (
        f"{name} has no rotary position embedding (no module with `inv_freq`); kvrag stores keys "
        "position-independently by removing RoPE, so models without RoPE (absolute or ALiBi positions) "
        "cannot be served. Use a RoPE model (Llama, Qwen2, Qwen3, Mistral, ...)."
    )
    raise UnsupportedModelError(msg)


class Rope:
    """Pure RoPE rotations with a model's frequencies.

    Args:
        inv_freq: [D/2] inverse frequencies (cast to fp32).
        pairing: 'half' (rotate_half: pairs (i, i + D/2)) or 'interleaved' (pairs (2i, 2i+1)).
    """

    def __init__(self, inv_freq: torch.Tensor, pairing: str = "half") -> None:
        self.inv_freq = inv_freq.detach().float()
        self.pairing = pairing

    @classmethod
    def from_model(cls, model: torch.nn.Module, pairing: str = "half") -> Rope:
        """Build from a loaded transformers model; refuses unsupported RoPE variants."""
        rtype = rope_type_of(model.config)
        if rtype in REFUSED_ROPE_TYPES:
            msg = (
                f"RoPE type {rtype!r} of {type(model).__name__} is not supported: {REFUSED_ROPE_TYPES[rtype]}, so "
                f"a cached key cannot be moved exactly. Supported types: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
            raise UnsupportedModelError(msg)
        rot = find_rotary_module(model)
        inv_freq = rot.inv_freq
        assert isinstance(inv_freq, torch.Tensor)
        return cls(inv_freq, pairing=pairing)

    @property
    def head_dim(self) -> int:
        return int(self.inv_freq.shape[0] * 2)

    def cos_sin(self, positions: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, D] in fp32 (no attention scaling), laid out for ``self.pairing``."""
        inv = self.inv_freq.to(device or positions.device)
        freqs = positions.to(inv.device)[..., None].float() * inv  # [T, D/2], same op order as transformers
        if self.pairing == "half":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` [..., T, D] by ``+positions`` (or ``-positions`` when inverse); fp32 math.

        Returns x's dtype, or writes into ``out`` (same shape, any float dtype, must not overlap ``x``) and
        returns it: a float32 ``out`` is computed in place with no temporary (the zero-copy assembly path).
        """
        if x.shape[-1] != self.head_dim:
            msg = f"head dim {x.shape[-1]} does not match the RoPE's {self.head_dim}"
            raise ValueError(msg)
        cos, sin = self.cos_sin(positions, device=x.device)
        if inverse:
            sin = -sin
        xf = x.float()
        # res = xf * cos + rotate_pairs(xf) * sin, written in place: at most one [..., T, D] temporary
        # (assembling a long context moves tens of MB through here).
        direct = out is not None and out.dtype == torch.float32
        res = torch.mul(xf, cos, out=out) if direct else xf * cos
        self._add_rotated(res, xf, sin)
        if out is None:
            return res.to(x.dtype)
        if not direct:
            out.copy_(res)
        return out

    def _add_rotated(self, out: torch.Tensor, xf: torch.Tensor, sin: torch.Tensor) -> None:
        if self.pairing == "half":
            h = self.head_dim // 2
            out[..., :h].addcmul_(xf[..., h:], sin[..., :h], value=-1.0)
            out[..., h:].addcmul_(xf[..., :h], sin[..., h:])
        else:
            out[..., 0::2].addcmul_(xf[..., 1::2], sin[..., 0::2], value=-1.0)
            out[..., 1::2].addcmul_(xf[..., 0::2], sin[..., 1::2])

    def canonicalize(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Remove RoPE from keys [..., T, D] cached at ``positions`` [T]."""
        return self.rotate(keys, positions, inverse=True)

    def place(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Apply RoPE for global ``positions`` [T] to canonical keys [..., T, D] (into ``out`` when given)."""
        return self.rotate(keys, positions, out=out)
