"""RoPE removal and re-application for canonical chunk keys, and kvrag's one RoPE support matrix.

Keys are stored *canonical*: ``c = R(-p) k_rot`` where ``k_rot`` is the key the model cached at position ``p``.
Placing a chunk at global position ``p'`` applies ``R(p')``. Both are pure rotations computed in fp32 from the
model's own ``inv_freq`` (never recomputed from ``rope_theta``). transformers folds YaRN/LongRoPE attention
scaling into cos/sin, so ``k_rot = s * R(p) k``; the canonical key then carries ``s`` and the placement must
not apply it again, which a pure rotation guarantees.

Support matrix (exact): default, linear, llama3, yarn, over the full head dimension, one set of frequencies for
every layer. Refused with UnsupportedModelError: dynamic NTK and LongRoPE (frequencies depend on the sequence
length), per-layer RoPE whose parameters differ, multimodal RoPE, partial rotary dimensions, unknown types, and
models without RoPE. :func:`check_rope_support` is the only place that decides; the loader calls it on the
config before reading weights and on the model after, and :meth:`Rope.from_model` calls it too.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from kvrag.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies do not depend on the sequence length, so a key can be re-rotated exactly."""

REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the current sequence length",
    "longrope": "LongRoPE switches between short and long frequency factors depending on the sequence length",
}


def rope_parameters(config: Any) -> dict[str, Any] | None:
    """The config's RoPE parameters as one flat dict, or None when the config declares no RoPE at all.

    Handles transformers-5 ``rope_parameters`` (flat or nested per layer type) and older ``rope_scaling`` +
    ``rope_theta`` configs. Per-layer parameters are accepted only when every layer type has the *same*
    parameters (compared as whole dicts, not only by type: two layer types with the same type but another
    ``rope_theta`` rotate by different frequencies, which one :class:`Rope` cannot do); otherwise the result is
    ``{"rope_type": "per-layer", "_variants": [...]}``.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        if not scaling and theta is None:
            return None
        params = dict(scaling or {})
        if theta is not None:
            params.setdefault("rope_theta", theta)
    params = dict(params)
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if nested:  # per-layer-type RoPE (e.g. sliding vs full attention): supported only when all layers agree
        variants = {json.dumps(v, sort_keys=True, default=str) for v in nested.values()}
        if len(variants) > 1:
            return {"rope_type": "per-layer", "_variants": sorted(nested)}
        params = dict(next(iter(nested.values())))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _model_label(config: Any, name: str | None) -> str:
    return name or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model"


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary-embedding module (the one owning an ``inv_freq`` tensor), or None if it has none.

    Any module with an ``inv_freq`` tensor counts (whatever its name); the shared ``model.rotary_emb`` is
    preferred. When several modules hold frequencies that differ (per-layer rotary embeddings), there is no one
    set of frequencies to re-rotate with and :class:`~kvrag.errors.UnsupportedModelError` is raised.
    """
    found = [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        return None
    base = getattr(model, "model", model)
    shared = getattr(base, "rotary_emb", None)
    first = found[0][1]
    for _, m in found:
        if m is shared:
            first = m
    ref = _inv_freq(first)
    for n, m in found:
        inv = _inv_freq(m)
        if inv.shape != ref.shape or not torch.equal(inv.to(ref.device), ref):
            msg = (f"{type(model).__name__} has rotary modules with different frequencies ({n!r} differs from the "
                   "shared one); kvrag re-rotates every layer's keys with one set of frequencies and cannot serve "
                   "per-layer rotary embeddings")
            raise UnsupportedModelError(msg)
    return first


def check_rope_support(config_or_model: Any, *, name: str | None = None) -> str:
    """Check that a model can serve position-independent KV caches and return its RoPE type.

    Supported: rotary position embeddings whose frequencies depend only on the config
    (:data:`SUPPORTED_ROPE_TYPES`), applied to the full head dimension, the same for every layer.

    Args:
        config_or_model: a transformers config, or a model (then its rotary module is checked too: it must exist,
            agree across layers and cover the full head dimension).
        name: the model's name for error messages (defaults to the config's ``name_or_path`` / ``model_type``).

    Returns:
        The RoPE type, one of :data:`SUPPORTED_ROPE_TYPES`.

    Raises:
        UnsupportedModelError: no rotary embeddings (e.g. GPT-2's learned absolute positions), a
            sequence-length-dependent variant ('dynamic', 'longrope'), per-layer or multimodal RoPE, partial
            rotary dimensions, or an unknown rope type.
    """
    model: torch.nn.Module | None = None
    if isinstance(config_or_model, torch.nn.Module):
        model = config_or_model
        config = model.config
    else:
        config = config_or_model
    label = _model_label(config, name)
    model_type = getattr(config, "model_type", "?")
    params = rope_parameters(config)
    if params is None:
        msg = (
            f"{label} (model_type={model_type!r}) has no rotary position embeddings (its config declares no "
            f"rope_parameters / rope_theta); kvrag re-positions cached keys by re-rotating them, which needs RoPE. "
            "Use a RoPE model such as Llama, Qwen2/3, Mistral or the default 'smollm2-135m-instruct'"
        )
        raise UnsupportedModelError(msg)
    rope_type = str(params["rope_type"])
    why: str | None = None
    if rope_type in REFUSED_ROPE_TYPES:
        why = f"{REFUSED_ROPE_TYPES[rope_type]}, so a cached key cannot be re-rotated exactly"
    elif rope_type == "per-layer":
        why = f"layer types {params['_variants']} use different RoPE parameters, which kvrag does not support yet"
    elif rope_type not in SUPPORTED_ROPE_TYPES:
        why = f"this variant is not in kvrag's support matrix {list(SUPPORTED_ROPE_TYPES)}"
    elif params.get("mrope_section"):
        why = "multimodal RoPE (mrope_section) rotates by several position axes"
    elif float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        why = f"partial rotary embeddings (partial_rotary_factor={params['partial_rotary_factor']}) are not supported"
    if why is not None:
        msg = f"{label} (model_type={model_type!r}) uses RoPE type {rope_type!r}: {why}"
        raise UnsupportedModelError(msg)
    if model is not None:
        rot = find_rotary_module(model)
        if rot is None:
            msg = (
                f"{label} (model_type={model_type!r}) declares RoPE type {rope_type!r} but has no rotary-embedding "
                "module (a module with an `inv_freq` tensor, e.g. `rotary_emb`); kvrag takes the frequencies from "
                "that module and cannot serve this model"
            )
            raise UnsupportedModelError(msg)
        head_dim, rotated = _head_dim(config), 2 * int(_inv_freq(rot).shape[-1])
        if head_dim is not None and rotated != head_dim:
            msg = (f"{label} (model_type={model_type!r}) rotates {rotated} of {head_dim} head dimensions (partial "
                   "rotary embeddings), which kvrag does not support")
            raise UnsupportedModelError(msg)
    return rope_type


def _inv_freq(module: torch.nn.Module) -> torch.Tensor:
    inv = getattr(module, "inv_freq", None)
    assert isinstance(inv, torch.Tensor)  # only modules found by find_rotary_module get here
    return inv


def _head_dim(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


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
        """Build from a loaded transformers model; refuses what :func:`check_rope_support` refuses."""
        check_rope_support(model)
        rot = find_rotary_module(model)
        assert rot is not None  # check_rope_support guarantees it
        return cls(_inv_freq(rot), pairing=pairing)

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
               out: torch.Tensor | None = None,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate ``x`` [..., T, D] by ``+positions`` (or ``-positions`` when inverse); fp32 math.

        Returns x's dtype, or writes into ``out`` (same shape, any float dtype, must not overlap ``x``) and
        returns it: a float32 ``out`` is computed in place with no temporary (the zero-copy assembly path).
        ``cos_sin``: :meth:`cos_sin` of ``positions`` computed once by a caller that rotates many tensors at the
        same positions (``positions`` is then not read).
        """
        if x.shape[-1] != self.head_dim:
            msg = f"head dim {x.shape[-1]} does not match the RoPE's {self.head_dim}"
            raise ValueError(msg)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, device=x.device)
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

    def place(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None,
              cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Apply RoPE for global ``positions`` [T] to canonical keys [..., T, D] (into ``out`` when given)."""
        return self.rotate(keys, positions, out=out, cos_sin=cos_sin)
