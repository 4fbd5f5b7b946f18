"""The query-time engine: planning, assembly of stale KV, repair, suffix prefill and decoding."""
