"""LangChain integration for kvrag: reusable per-chunk KV caches for a local Hugging Face chat model."""

from langchain_kvrag.chat_models import ChatKVCached, messages_to_dicts
from langchain_kvrag.retrievers import KVCacheRetriever, format_docs, render_document

__all__ = ["ChatKVCached", "KVCacheRetriever", "format_docs", "messages_to_dicts", "render_document"]
