"""LlamaIndex LLM integration for kvrag: reusable per-chunk KV caches for a local Hugging Face model."""

from llama_index.llms.kvrag.base import KVCachedLLM, PromptTooLongError

__all__ = ["KVCachedLLM", "PromptTooLongError"]
