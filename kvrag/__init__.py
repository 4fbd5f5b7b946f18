"""kvrag: fast RAG with reusable per-chunk KV caches for local Hugging Face models."""

from __future__ import annotations

__version__ = "0.1.0"
