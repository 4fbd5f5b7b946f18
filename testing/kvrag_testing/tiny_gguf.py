"""Tiny GGUF files written in-process with the ``gguf`` library, for the tests of loading a model by GGUF path.

:func:`write_tiny_gguf` exports a :func:`kvrag_testing.tiny.tiny_model` Llama as llama.cpp's converter would:
tensors under llama.cpp's names with the query/key rows permuted the way llama.cpp stores them, the model shape
under ``llama.*`` keys and the byte-level BPE tokenizer under ``tokenizer.ggml.*`` (vocabulary, token types,
merges, special token ids, chat template). transformers' GGUF loader undoes all of it, so the file loads back into
exactly the tiny model (float32 tensors: bit-identical logits)::

    lm = tiny_model("llama")
    write_tiny_gguf("tiny.gguf", lm)
    engine = KVRAGEngine.from_pretrained("tiny.gguf", dtype="float32")

:func:`write_unsupported_gguf` writes the two kinds of file kvrag must refuse by name: an architecture transformers
cannot build, and a tensor type the ``gguf`` package cannot de-quantize.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvrag.extras import require

if TYPE_CHECKING:
    from kvrag.models import LoadedModel


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q_proj / k_proj (``LlamaModel.permute`` in its convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: Any, tokenizer: Any) -> None:
    """The tokenizer under ``tokenizer.ggml.*``: a byte-level BPE (``gpt2`` model), its merges and special ids."""
    import json

    from gguf import TokenType

    vocab = tokenizer.get_vocab()
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        msg = "the tokenizer's ids are not contiguous from 0; a GGUF token list cannot hold it"
        raise ValueError(msg)
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for token, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                       ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        token_id = getattr(tokenizer, f"{token}_token_id")
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_tiny_gguf(path: str | os.PathLike[str], lm: LoadedModel, *, name: str = "tiny-llama",
                    quantization: str = "F32", extra: dict[str, np.ndarray] | None = None,
                    header: dict[str, int | float | str] | None = None, head_size: bool = True) -> Path:
    """Write a Llama or Gemma 2 :class:`~kvrag.models.LoadedModel` (e.g. ``tiny_model("llama")``) as a GGUF file,
    as llama.cpp's converter does (Llama: q / k rows permuted; Gemma 2: RMSNorm weights stored as ``1 + w``, its
    window and soft-capping in the header).

    Args:
        path: the ``.gguf`` file to write.
        lm: a Llama- or Gemma 2-architecture model with a byte-level BPE tokenizer.
        name: ``general.name`` (transformers reads a name containing "mistral" as a Mistral model).
        quantization: the type of its 2D weights, quantized by the ``gguf`` package's own quantizer (``F32``,
            ``F16``, ``BF16``, ``Q4_0``, ``Q4_1``, ``Q8_0``); norms stay F32.
        extra: more float32 tensors by GGUF name (e.g. llama.cpp's ``rope_freqs.weight``).
        header: more header keys (int as uint16, float as float32, str), e.g. ``split.count`` or
            ``llama.rope.scaling.type``.
        head_size: write Gemma 2's ``attention.key_length`` / ``value_length`` (llama.cpp's converter does; a file
            without them has heads of hidden size / heads, as llama.cpp reads it).

    Returns:
        ``path``.
    """
    gguf = require("gguf", "gguf", "writing a GGUF file")
    config = lm.model.config
    arch = config.model_type
    if arch not in ("llama", "gemma2"):
        msg = f"write_tiny_gguf writes Llama and Gemma 2 models; got model_type {arch!r}"
        raise ValueError(msg)
    path = Path(path)
    n_layers, n_head, n_kv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    qtype = gguf.GGMLQuantizationType[quantization]
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quantization == "F32" else gguf.LlamaFileType[
        f"MOSTLY_{quantization}"])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(n_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma2" and head_size:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "gemma2":
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    _add_tokenizer(writer, lm.tokenizer)
    for key, value in (header or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint16(key, value)
    for hf_name, tensor in lm.model.state_dict().items():
        if arch == "gemma2" and hf_name == "lm_head.weight":
            if not torch.equal(tensor, lm.model.state_dict()["model.embed_tokens.weight"]):
                msg = "llama.cpp's Gemma 2 has no output tensor: tie lm_head to the token embeddings"
                raise ValueError(msg)
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            msg = f"no llama.cpp name for tensor {hf_name!r}"
            raise ValueError(msg)
        data = tensor.detach().float().cpu().numpy().copy()
        if arch == "gemma2" and base.endswith("norm"):
            data = data + 1  # llama.cpp's Gemma RMSNorm multiplies by the stored weight
        elif arch == "llama" and base.endswith("q_proj"):
            data = _llama_cpp_permute(data, n_head)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _llama_cpp_permute(data, n_kv)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(f"{gguf_name}.{suffix}", data)
    for gguf_name, data in (extra or {}).items():
        writer.add_tensor(gguf_name, np.asarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_unsupported_gguf(path: str | os.PathLike[str], *, architecture: str = "llama",
                           quantization: str = "F32") -> Path:
    """A header-only-sized GGUF file kvrag must refuse: ``architecture`` (e.g. ``"rwkv6"``) or one tensor of
    ``quantization`` (e.g. ``"Q8_1"``, which the ``gguf`` package cannot de-quantize), with random bytes.

    Returns:
        ``path``.
    """
    gguf = require("gguf", "gguf", "writing a GGUF file")
    path = Path(path)
    qtype = gguf.GGMLQuantizationType[quantization]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("unsupported")
    writer.add_block_count(1)
    rows, cols = 4, 64
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.zeros((rows, cols), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


__all__ = ["write_tiny_gguf", "write_unsupported_gguf"]
