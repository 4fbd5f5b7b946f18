"""Canonical (position-independent) chunk KV: specs, RoPE handling, keys and the transformers cache bridge."""
