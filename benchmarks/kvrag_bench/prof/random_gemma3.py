"""Write a Gemma-3-270M-shaped model with random weights (and kvrag's tiny test tokenizer) to a folder, for timing
decode steps of the real shape where the real weights are not at hand::

    python benchmarks/kvrag_bench/prof/random_gemma3.py /tmp/gemma3-270m-random
    kvrag bench decode --model /tmp/gemma3-270m-random --quantize int4 --step-backends fused,hf ...

The config is google/gemma-3-270m's (18 layers of 5 sliding : 1 global, hidden 640, 4 query heads over 1 KV head of
256, MLP 2048, vocabulary 262144, tied embeddings, local RoPE base 10K, global 1M, window 512); the tokenizer's ids
stay below 256, so the context is made of real text's byte-level tokens.
"""

from __future__ import annotations

import sys

import torch
import transformers

from kvrag_testing.tiny import tiny_tokenizer


def main(out: str) -> None:
    layers = 18
    cfg = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        bos_token_id=2, eos_token_id=4, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    print(out)  # noqa: T201


if __name__ == "__main__":
    main(sys.argv[1])
