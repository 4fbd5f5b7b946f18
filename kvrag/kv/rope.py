"""RoPE removal and re-application for canonical chunk keys, and kvrag's one RoPE support matrix.

Keys are stored *canonical*: ``c = R(-p) k_rot`` where ``k_rot`` is the key the model cached at position ``p``.
Placing a chunk at global position ``p'`` applies ``R(p')``. Both are pure rotations computed in fp32 from the
model's own frequencies (never recomputed from ``rope_theta``). transformers folds YaRN/LongRoPE attention
scaling into cos/sin, so ``k_rot = s * R(p) k``; the canonical key then carries ``s`` and the placement must
not apply it again, which a pure rotation guarantees.

Position handling beyond one RoPE (each layer's keys are re-rotated exactly as that layer's attention rotated
them): per-layer frequencies (Gemma 3's local and global layers: each layer with its own ``inv_freq``), layers
without RoPE (SmolLM3's ``no_rope_layers``: their keys are position-free and used as they are, a rotation by
zero; EXAONE 4's global layers), partial rotary dimensions (Phi-2, GPT-NeoX, StableLM, Phi-4-mini: only the first ``rotary_dim`` dimensions
of each head are rotated, the rest pass through), interleaved pairs (Cohere).

Support matrix (exact): default, linear, llama3, yarn, per layer or for all layers. Frequencies that depend on the
sequence length (dynamic NTK, LongRoPE) are fixed below the length where they switch, so they are served there
(:func:`length_regime_limit` caps the context) and a longer context is refused. Refused with
UnsupportedModelError: multimodal RoPE, unknown types, and models without RoPE. :func:`check_rope_support` is the
only place that decides; the loader calls it on the config before reading weights and on the model after, and
:meth:`Rope.from_model` calls it too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
"""RoPE variants kvrag re-rotates exactly (the last two below :data:`LENGTH_DEPENDENT` switch lengths)."""

LENGTH_DEPENDENT = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies once a sequence is longer than "
               "original_max_position_embeddings",
    "longrope": "LongRoPE switches from its short to its long frequency factors once a sequence is longer than "
                "original_max_position_embeddings",
}
"""RoPE variants whose frequencies are fixed only below a sequence length: served there (the short regime),
refused beyond it (:func:`length_regime_limit`)."""

GLOBAL_NOPE_MODEL_TYPES = frozenset({"exaone4"})
"""model_types whose global (full-attention) layers apply no RoPE when the model has sliding layers (EXAONE 4's
"global NoPE for hybrid attention"): their keys are position-free, like ``no_rope_layers``."""

INTERLEAVED_MODEL_TYPES = frozenset({"cohere", "cohere2", "gptj", "chameleon"})
"""model_types whose RoPE rotates interleaved pairs (2i, 2i+1) instead of transformers' rotate_half."""


def rope_parameters(config: PretrainedConfig) -> dict[str, Any] | None:
    """The config's RoPE parameters as one flat dict, or None when the config declares no RoPE at all.

    Handles transformers-5 ``rope_parameters`` (flat or nested per layer type) and older ``rope_scaling`` +
    ``rope_theta`` configs. Per-layer parameters that differ (e.g. Gemma 3's local and global bases) come back as
    ``{"rope_type": <their common type, else "per-layer">, "_per_layer": {layer type: parameters}}``; :class:`Rope`
    then rotates each layer with its own frequencies.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a multimodal model's LM
    params = getattr(text, "rope_parameters", None) or getattr(config, "rope_parameters", None)
    if not params:
        if getattr(text, "rope_theta", None) is not None or getattr(text, "rope_scaling", None):
            config = text
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
            per = {k: dict(v) for k, v in nested.items()}
            for v in per.values():
                v.setdefault("rope_type", v.get("type", "default"))
            kinds = {str(v["rope_type"]) for v in per.values()}
            return {"rope_type": kinds.pop() if len(kinds) == 1 else "per-layer", "_per_layer": per}
        params = dict(next(iter(nested.values())))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _model_label(config: PretrainedConfig, name: str | None) -> str:
    return name or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model"


def rope_pairing(config: PretrainedConfig) -> str:
    """'interleaved' for the families whose RoPE pairs dimensions (2i, 2i+1) (:data:`INTERLEAVED_MODEL_TYPES`),
    else 'half' (transformers' rotate_half, every other family)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return "interleaved" if getattr(text, "model_type", None) in INTERLEAVED_MODEL_TYPES else "half"


def _freq_names(module: torch.nn.Module) -> list[str]:
    """Names of the inverse-frequency tensors a rotary module owns: ``inv_freq``, or one ``<layer type>_inv_freq``
    per layer type (Gemma 3's per-layer-type rotary embedding)."""
    if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return ["inv_freq"]
    types = getattr(module, "layer_types", None) or ()
    return [f"{t}_inv_freq" for t in types if isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor)]


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary-embedding module (the one owning ``inv_freq``, or ``<layer type>_inv_freq`` per layer
    type), or None if it has none.

    Any module with such tensors counts (whatever its name); the shared ``model.rotary_emb`` is preferred. When
    several modules hold frequencies that differ (rotary embeddings owned by each attention layer), there is no one
    module to read them from and :class:`~kvrag.errors.UnsupportedModelError` is raised.
    """
    found = [(n, m) for n, m in model.named_modules() if _freq_names(m)]
    if not found:
        return None
    base = getattr(model, "model", model)
    shared = getattr(base, "rotary_emb", None)
    first = found[0][1]
    for _, m in found:
        if m is shared:
            first = m
    ref = [_buffer(first, k) for k in _freq_names(first)]
    for n, m in found:
        inv = [_buffer(m, k) for k in _freq_names(m)]
        if len(inv) != len(ref) or any(a.shape != b.shape or not torch.equal(a.to(b.device), b)
                                       for a, b in zip(inv, ref, strict=True)):
            msg = (f"{type(model).__name__} has rotary modules with different frequencies ({n!r} differs from the "
                   "shared one); kvrag reads each layer's frequencies from one rotary module and cannot serve "
                   "rotary embeddings owned by each attention layer")
            raise UnsupportedModelError(msg)
    return first


def layer_frequencies(model: PreTrainedModel, rot: torch.nn.Module | None = None) -> list[torch.Tensor | None]:
    """Per decoder layer, the inverse frequencies [R/2] its attention rotates keys with (None: a layer without RoPE).

    Read from the model's rotary module: its ``<layer type>_inv_freq`` for the layer's type where it has one per
    layer type (Gemma 3), else its one ``inv_freq``; for the length-dependent variants (:data:`LENGTH_DEPENDENT`)
    the frequencies of the short regime (``original_inv_freq``, which a long forward does not overwrite). Layers
    that SmolLM3-style ``no_rope_layers`` mark 0, and the global layers of :data:`GLOBAL_NOPE_MODEL_TYPES`, apply
    no RoPE.
    """
    config: PretrainedConfig = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rot = rot if rot is not None else find_rotary_module(model)
    if rot is None:
        return []
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    names = _freq_names(rot)
    params = rope_parameters(config) or {}
    per_type = params.get("_per_layer", {})
    types = list(getattr(text, "layer_types", None) or [])
    out: list[torch.Tensor | None] = []
    for i in range(n):
        name = "inv_freq"
        if names != ["inv_freq"]:
            if i >= len(types) or f"{types[i]}_inv_freq" not in names:
                msg = (f"{type(model).__name__}: layer {i} has no rotary frequencies of its own layer type "
                       f"({types[i] if i < len(types) else '?'!r}); kvrag cannot tell how it rotates its keys")
                raise UnsupportedModelError(msg)
            name = f"{types[i]}_inv_freq"
        kind = per_type.get(types[i], params).get("rope_type") if name != "inv_freq" else params.get("rope_type")
        orig = name.replace("inv_freq", "original_inv_freq")
        if kind in LENGTH_DEPENDENT and isinstance(getattr(rot, orig, None), torch.Tensor):
            name = orig
        out.append(_buffer(rot, name))
    nope = getattr(text, "no_rope_layers", None)
    if nope is not None:
        out = [f if i >= len(nope) or nope[i] else None for i, f in enumerate(out)]
    if getattr(text, "model_type", None) in GLOBAL_NOPE_MODEL_TYPES and getattr(text, "sliding_window", None):
        out = [None if i < len(types) and types[i] == "full_attention" else f for i, f in enumerate(out)]
    return out


def length_regime_limit(config: PretrainedConfig) -> tuple[int, str] | None:
    """For RoPE whose frequencies change with the sequence length (:data:`LENGTH_DEPENDENT`): the longest sequence
    whose frequencies are the fixed short-regime ones kvrag re-rotates with (``original_max_position_embeddings``),
    and why; None for every other RoPE."""
    params = rope_parameters(config)
    if params is None:
        return None
    variants = list(params["_per_layer"].values()) if "_per_layer" in params else [params]
    limits = []
    for v in variants:
        kind = str(v.get("rope_type", "default"))
        if kind in LENGTH_DEPENDENT:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            orig = v.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings",
                                                                       None) or text.max_position_embeddings
            limits.append((int(orig), kind))
    if not limits:
        return None
    n, kind = min(limits)
    return n, (f"RoPE type {kind!r}: {LENGTH_DEPENDENT[kind]} ({n}); kvrag re-rotates cached keys with the fixed "
               f"frequencies below that length and refuses longer prompts (the long regime)")


def check_rope_support(config_or_model: PretrainedConfig | PreTrainedModel, *, name: str | None = None) -> str:
    """Check that a model can serve position-independent KV caches and return its RoPE type.

    Supported: rotary position embeddings of the types in :data:`SUPPORTED_ROPE_TYPES`, one set of frequencies or
    one per layer type, over the whole head or its first ``rotary_dim`` dimensions, with layers without RoPE among
    them (the length-dependent types within their short regime, :func:`length_regime_limit`).

    Args:
        config_or_model: a transformers config, or a model (then its rotary module is checked too: it must exist
            and give every layer frequencies that fit its head dimension).
        name: the model's name for error messages (defaults to the config's ``name_or_path`` / ``model_type``).

    Returns:
        The RoPE type: one of :data:`SUPPORTED_ROPE_TYPES`, or 'per-layer' when layer types use different ones.

    Raises:
        UnsupportedModelError: no rotary embeddings (e.g. GPT-2's learned absolute positions), multimodal RoPE, an
            unknown rope type, or rotary dimensions that do not fit the head.
    """
    model: PreTrainedModel | None = None
    if isinstance(config_or_model, torch.nn.Module):
        model = config_or_model
        config = model.config
    else:
        config = config_or_model
    label = _model_label(config, name)
    model_type = getattr(config, "model_type", "?")
    params = rope_parameters(config)
    if params is None or getattr(config, "alibi", False):
        declares = ("uses ALiBi (alibi=True in its config)" if params is not None else
                    "declares no rope_parameters / rope_theta")
        msg = (
            f"{label} (model_type={model_type!r}) has no rotary position embeddings (its config {declares}); kvrag "
            "re-positions cached keys by re-rotating them, which needs RoPE. "
            "Use a RoPE model such as Llama, Qwen2/3, Mistral or the default 'smollm2-135m-instruct'"
        )
        raise UnsupportedModelError(msg)
    rope_type = str(params["rope_type"])
    variants = list(params["_per_layer"].items()) if "_per_layer" in params else [("", params)]
    for layer_type, v in variants:
        kind = str(v.get("rope_type", "default"))
        where = f" (layer type {layer_type!r})" if layer_type else ""
        why: str | None = None
        if kind not in SUPPORTED_ROPE_TYPES:
            why = f"this variant is not in kvrag's support matrix {list(SUPPORTED_ROPE_TYPES)}"
        elif v.get("mrope_section"):
            why = "multimodal RoPE (mrope_section) rotates by several position axes"
        if why is not None:
            msg = f"{label} (model_type={model_type!r}) uses RoPE type {kind!r}{where}: {why}"
            raise UnsupportedModelError(msg)
    if model is not None:
        rot = find_rotary_module(model)
        freqs = layer_frequencies(model, rot) if rot is not None else []
        if rot is None or not any(f is not None for f in freqs):
            msg = (
                f"{label} (model_type={model_type!r}) declares RoPE type {rope_type!r} but has no rotary-embedding "
                "module (a module with an `inv_freq` tensor, e.g. `rotary_emb`); kvrag takes the frequencies from "
                "that module and cannot serve this model"
            )
            raise UnsupportedModelError(msg)
        head_dim = _head_dim(config)
        dims = {2 * int(f.shape[-1]) for f in freqs if f is not None}
        if len(dims) > 1 or (head_dim is not None and max(dims) > head_dim):
            msg = (f"{label} (model_type={model_type!r}) rotates {sorted(dims)} of its {head_dim} head dimensions "
                   "in different layers; kvrag needs one rotary dimension (at most the head dimension)")
            raise UnsupportedModelError(msg)
        factor = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
        if head_dim is not None and dims != {int(head_dim * factor)}:
            msg = (f"{label} (model_type={model_type!r}) has a rotary module that rotates {dims.pop()} of its "
                   f"{head_dim} head dimensions but its config says {int(head_dim * factor)} (partial rotary "
                   f"factor {factor}); kvrag cannot tell which its attention applies")
            raise UnsupportedModelError(msg)
    return rope_type


def _buffer(module: torch.nn.Module, name: str) -> torch.Tensor:
    inv = getattr(module, name, None)
    assert isinstance(inv, torch.Tensor)  # only names _freq_names found get here
    return inv


def _head_dim(config: PretrainedConfig) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return int(hidden) // int(heads) if hidden and heads else None


BLOCK_BYTES = 512 * 1024
"""Float32 bytes of one leading-dimension block rotated at a time into an ``out`` tensor (:meth:`Rope.rotate`)."""


def _block_rows(x: torch.Tensor) -> int:
    """Leading-dimension rows per block of :meth:`Rope.rotate` into ``out`` (0: one block, e.g. for CUDA)."""
    if x.device.type != "cpu" or x.dim() < 3 or x.shape[0] <= 1:
        return 0
    return max(1, BLOCK_BYTES // max(1, 4 * x[0].numel()))


class Rope:
    """Pure RoPE rotations with a model's frequencies, one set for every layer or one per layer.

    Tensors rotated with per-layer frequencies have the layers first ([L, ..., T, D], as kvrag lays out KV).

    Args:
        inv_freq: [R/2] inverse frequencies for every layer, or [L, R/2] one row per layer (a row of zeros: a layer
            without RoPE, whose keys a zero rotation leaves exactly as they are). Cast to fp32.
        pairing: 'half' (rotate_half: pairs (i, i + R/2)) or 'interleaved' (pairs (2i, 2i+1)).
        head_dim: D, when only the first R = 2 * inv_freq.shape[-1] dimensions of a head are rotated (partial
            rotary embeddings; the other D - R pass through); default R.
    """

    def __init__(self, inv_freq: torch.Tensor, pairing: str = "half", head_dim: int | None = None) -> None:
        self.inv_freq = inv_freq.detach().float()
        self.pairing = pairing
        self.rotary_dim = int(self.inv_freq.shape[-1] * 2)
        self.head_dim = int(head_dim or self.rotary_dim)
        if self.rotary_dim > self.head_dim or self.inv_freq.dim() not in (1, 2):
            msg = f"inv_freq of shape {tuple(self.inv_freq.shape)} does not fit head dim {self.head_dim}"
            raise ValueError(msg)

    @classmethod
    def from_model(cls, model: PreTrainedModel, pairing: str | None = None) -> Rope:
        """Build from a loaded transformers model (each layer's frequencies, :func:`layer_frequencies`); refuses
        what :func:`check_rope_support` refuses. ``pairing`` defaults to the family's (:func:`rope_pairing`)."""
        check_rope_support(model)
        freqs = layer_frequencies(model)
        ref = next(f for f in freqs if f is not None).detach().float().cpu()
        same = all(f is not None and torch.equal(f.detach().float().cpu(), ref) for f in freqs)
        inv = ref if same else torch.stack([torch.zeros_like(ref) if f is None else f.detach().float().cpu()
                                            for f in freqs])
        return cls(inv, pairing=pairing or rope_pairing(model.config), head_dim=_head_dim(model.config))

    def layer(self, index: int) -> Rope:
        """The rotation of decoder layer ``index`` alone (for tensors of one layer, [..., T, D]); ``self`` when every
        layer shares the frequencies."""
        if not self.per_layer:
            return self
        return Rope(self.inv_freq[index], pairing=self.pairing, head_dim=self.head_dim)

    @property
    def per_layer(self) -> bool:
        """True when layers rotate with different frequencies (``inv_freq`` is [L, R/2])."""
        return self.inv_freq.dim() == 2

    def cos_sin(self, positions: torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin in fp32 (no attention scaling), laid out for ``self.pairing``: [T, R], or [L, T, R] per layer."""
        inv = self.inv_freq.to(device or positions.device)
        freqs = positions.to(inv.device)[..., None].float() * inv[..., None, :]  # [(L,) T, R/2], transformers' op order
        if self.pairing == "half":
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False,
               out: torch.Tensor | None = None,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate ``x`` [..., T, D] (per-layer frequencies: [L, ..., T, D]) by ``+positions`` (or ``-positions``
        when inverse); fp32 math. Only the first ``rotary_dim`` dimensions of each head turn.

        Returns x's dtype, or writes into ``out`` (same shape, any float dtype, must not overlap ``x``) and
        returns it: a float32 ``out`` is computed in place with no temporary (the zero-copy assembly path).
        ``cos_sin``: :meth:`cos_sin` of ``positions`` computed once by a caller that rotates many tensors at the
        same positions (``positions`` is then not read).
        """
        if x.shape[-1] != self.head_dim:
            msg = f"head dim {x.shape[-1]} does not match the RoPE's {self.head_dim}"
            raise ValueError(msg)
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, device=x.device)
        if self.per_layer and (x.dim() < 3 or x.shape[0] != int(self.inv_freq.shape[0])):
            msg = (f"per-layer RoPE rotates tensors [L={int(self.inv_freq.shape[0])}, ..., T, D], got shape "
                   f"{tuple(x.shape)}")
            raise ValueError(msg)
        step = _block_rows(x) if out is not None else 0
        if out is not None and 0 < step < x.shape[0]:
            # Into ``out`` block by block along the leading dimension (layers): the fp32 temporaries of a block stay
            # in the CPU's cache instead of streaming through memory. Element-wise ops on the same rows: same bits.
            for i in range(0, x.shape[0], step):
                j = min(i + step, x.shape[0])
                block = (cos[i:j], sin[i:j]) if self.per_layer else (cos, sin)
                self._rotate_rows(x[i:j], inverse, out[i:j], block)
            return out
        return self._rotate_rows(x, inverse, out, (cos, sin))

    def _rotate_rows(self, x: torch.Tensor, inverse: bool, out: torch.Tensor | None,
                     cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = cos_sin
        if self.per_layer:
            n = int(cos.shape[0])
            view = (n, *([1] * (x.dim() - 3)), *cos.shape[-2:])
            cos, sin = cos.reshape(view), sin.reshape(view)
        if inverse:
            sin = -sin
        r = self.rotary_dim
        if r < self.head_dim:  # partial rotary: rotate the first r dimensions, pass the rest through
            rot = self.rotate_part(x[..., :r].float(), cos, sin)
            if out is None:
                return torch.cat([rot, x[..., r:].float()], dim=-1).to(x.dtype)
            out[..., :r].copy_(rot)
            out[..., r:].copy_(x[..., r:])
            return out
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

    def rotate_part(self, xf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``xf * cos + rotate_pairs(xf) * sin`` for the rotary part ``xf`` [..., R] (fp32)."""
        res = xf * cos
        self._add_rotated(res, xf, sin)
        return res

    def _add_rotated(self, out: torch.Tensor, xf: torch.Tensor, sin: torch.Tensor) -> None:
        if self.pairing == "half":
            h = self.rotary_dim // 2
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
