"""A GGUF file's RoPE scaling (``rope_freqs.weight``, the ``{arch}.rope.scaling.*`` header keys) as the model
config's.

llama.cpp's converter writes Llama 3.1 / 3.2 / 3.3's ``llama3`` RoPE scaling not as header keys but as a tensor of
per-frequency divisors, ``rope_freqs.weight`` (``convert_hf_to_gguf.py``, ``LlamaModel.generate_extra_tensors``).
transformers' GGUF config reader ignores it, so such a file loaded as a plain-RoPE model: another model, whose
positions differ from the published one's at every position. :func:`apply_rope_freqs` recovers the ``llama3``
parameters that give exactly those divisors and sets them on the config, or refuses the file naming the tensor.
The header's linear and YaRN scalings (Gemma 3 4B-27B, long-context Qwen2.5), which that reader reads for few
architectures, likewise (:func:`apply_rope_scaling`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvrag.errors import UnsupportedModelError
from kvrag.gguf_reading import header_field

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

ROPE_FREQS = "rope_freqs.weight"
LLAMA3_DEFAULTS: dict[str, float] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
"""The ``llama3`` parameters every Llama 3.x release uses besides its ``factor`` (8 for 3.1, 32 for 3.2)."""


def llama3_divisors(base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes for these ``llama3`` parameters (its own loop, in float32 as it
    computes the frequencies)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs.astype(np.float64):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def apply_rope_freqs(reader: GGUFReader, config: PretrainedConfig, file_name: str) -> bool:
    """Set ``config``'s RoPE to the ``llama3`` scaling the file's ``rope_freqs.weight`` stands for. Returns whether
    the file has such a tensor with any divisor other than 1.

    Raises:
        UnsupportedModelError: the divisors are not a ``llama3`` scaling of the config's base and head size.
    """
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return False
    got = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if np.all(got == 1.0):
        return False
    params = dict(getattr(config, "rope_parameters", None) or {})
    base = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if params.get("rope_type", "default") == "default" and got.size == dim // 2:
        factor = float(got.max())
        d = LLAMA3_DEFAULTS
        want = llama3_divisors(base, dim, factor, d["low_freq_factor"], d["high_freq_factor"],
                               int(d["original_max_position_embeddings"]))
        if np.allclose(got, want, rtol=1e-5, atol=0.0):
            config.rope_parameters = {"rope_type": "llama3", "rope_theta": base, "factor": factor, **LLAMA3_DEFAULTS}
            return True
    msg = (f"GGUF file {file_name}: its {ROPE_FREQS} ({got.size} RoPE frequency divisors, {got.min():g} to "
           f"{got.max():g}) is not a Llama 3 RoPE scaling of its config (base {base:g}, head size {dim}, RoPE "
           f"{params.get('rope_type', 'default')!r}); kvrag would position its keys unlike llama.cpp. Use the "
           "model's Hugging Face checkpoint folder")
    raise UnsupportedModelError(msg)


def apply_rope_scaling(reader: GGUFReader, config: PretrainedConfig, file_name: str) -> bool:
    """Set ``config``'s RoPE scaling from the header's ``{arch}.rope.scaling.*`` keys (linear, as Gemma 3 4B-27B;
    YaRN, as long-context Qwen2.5), which transformers' GGUF reader reads for few architectures. A model with
    sliding-window layers (per-layer-type RoPE) scales its full-attention layers only, as llama.cpp does. Returns
    whether it set one.

    Raises:
        UnsupportedModelError: a scaling type or parameters kvrag cannot map.
    """
    arch = header_field(reader, "general.architecture")
    kind = header_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return False
    params = dict(getattr(config, "rope_parameters", None) or {})
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    flat = params if not nested else nested.get("full_attention")
    if flat is None or flat.get("rope_type", "default") != "default":
        if flat is not None:
            return False  # transformers already read the scaling (gpt-oss)
        msg = f"GGUF file {file_name}: RoPE scaling {kind!r} on a model without full-attention layers kvrag can scale"
        raise UnsupportedModelError(msg)
    factor = header_field(reader, f"{arch}.rope.scaling.factor")
    original = header_field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and isinstance(factor, float) and factor > 0:
        scaled = {**flat, "rope_type": "linear", "factor": factor}
    elif kind == "yarn" and isinstance(factor, float) and factor > 0 and isinstance(original, int) and original > 0:
        scaled = {**flat, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    else:
        msg = (f"GGUF file {file_name}: its RoPE scaling ({arch}.rope.scaling.type={kind!r}, factor {factor!r}, "
               f"original context {original!r}) is not one kvrag reads (linear, yarn); it would position keys unlike "
               "llama.cpp. Use the model's Hugging Face checkpoint folder")
        raise UnsupportedModelError(msg)
    config.rope_parameters = {**params, "full_attention": scaled} if nested else scaled
    return True


__all__ = ["LLAMA3_DEFAULTS", "ROPE_FREQS", "apply_rope_freqs", "apply_rope_scaling", "llama3_divisors"]
