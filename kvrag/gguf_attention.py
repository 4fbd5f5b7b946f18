"""A GGUF file's attention shape as llama.cpp reads it, where transformers' GGUF config reader leaves it out.

* The head size: llama.cpp takes ``{arch}.attention.key_length`` (``n_embd_head_k``) when the file has it, else
  hidden size / heads. transformers' reader maps that key for some architectures only (for Llama and Mistral it
  takes the RoPE dimension count, the same width there), so a Qwen3 file got its config class's default of 128
  whatever the file says.
* Gemma 2 / Gemma 3's query scaling: llama.cpp scales queries by 1 / sqrt(hidden size / heads) for the 27B models,
  which it recognizes by their layer count (46 for Gemma 2, 62 for Gemma 3), and by 1 / sqrt(head size) for every
  other size; transformers' config classes default ``query_pre_attn_scalar`` to 256, right only where the head size
  is 256.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.errors import UnsupportedModelError
from kvrag.gguf_reading import header_field

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The layer count by which llama.cpp recognizes a 27B Gemma (``llama_model.cpp``, ``LLM_TYPE_27B``)."""


def apply_attention_shape(reader: GGUFReader, config: PretrainedConfig, file_name: str) -> None:
    """Set ``config``'s head size and (Gemma 2 / 3) query scaling as llama.cpp reads them from the file's header.

    Raises:
        UnsupportedModelError: keys and values of different widths (no family kvrag serves has them).
    """
    arch = header_field(reader, "general.architecture")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a multimodal model's LM
    key = header_field(reader, f"{arch}.attention.key_length")
    value = header_field(reader, f"{arch}.attention.value_length")
    if isinstance(key, int) and isinstance(value, int) and key != value:
        msg = (f"GGUF file {file_name}: keys of {key} and values of {value} dimensions a head; kvrag serves models "
               "whose keys and values are one width")
        raise UnsupportedModelError(msg)
    if isinstance(key, int) and key > 0 and hasattr(text, "head_dim"):
        text.head_dim = key
    elif hasattr(text, "head_dim"):  # as llama.cpp: hidden size / heads (not the config class's default, Gemma's 256)
        text.head_dim = text.hidden_size // text.num_attention_heads
    layers = GEMMA_27B_LAYERS.get(str(arch))
    if layers is not None and hasattr(text, "query_pre_attn_scalar"):
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        wide = text.num_hidden_layers == layers
        text.query_pre_attn_scalar = text.hidden_size // text.num_attention_heads if wide else head


__all__ = ["GEMMA_27B_LAYERS", "apply_attention_shape"]
