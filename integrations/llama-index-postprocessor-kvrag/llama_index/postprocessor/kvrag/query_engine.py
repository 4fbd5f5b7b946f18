"""KVQueryEngine: the explicit path — retrieved chunks are handed to the LLM as parts, no substring search.

The prompt is the one LlamaIndex's default ``compact`` synthesizer builds when everything fits (same QA template,
same chat template, chunks joined by a blank line), but nothing is repacked or truncated: each chunk appears whole,
so every chunk is a cache hit. Chunks that do not fit the context window raise ``ContextLengthError`` (retrieve
fewer) instead of being split across several LLM calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.postprocessor.kvrag.base import KVCachePostprocessor, ensure_node_caches

from kvrag import adapters

_MARK = "\u2063KVRAG_CONTEXT\u2063"


class KVQueryEngine(CustomQueryEngine):
    """Retrieve -> postprocess -> ensure caches -> answer with the chunks passed explicitly to ``KVCachedLLM``.

    The response's ``metadata["kvrag"]`` holds the LLM's ``additional_kwargs`` (ttft_s, hit_rate, ...); for
    streaming responses it is filled when the stream ends.
    """

    retriever: BaseRetriever
    llm: Any = Field(description="A KVCachedLLM.")
    node_postprocessors: list[BaseNodePostprocessor] = Field(default_factory=list)
    text_qa_template: BasePromptTemplate = Field(default=DEFAULT_TEXT_QA_PROMPT_SEL)
    separator: str = Field(default="\n\n", description="Text between chunks (the synthesizers use a blank line).")
    streaming: bool = False
    llm_kwargs: dict[str, Any] = Field(default_factory=dict, description="Per-call LLM options (method, ...).")

    @classmethod
    def from_index(cls, index: Any, llm: Any, similarity_top_k: int = 2, **kwargs: Any) -> KVQueryEngine:
        return cls(retriever=index.as_retriever(similarity_top_k=similarity_top_k), llm=llm, **kwargs)

    def _frame(self, query: str) -> tuple[str, str]:
        llm = self.llm
        if llm.metadata.is_chat_model:
            msgs = self.text_qa_template.format_messages(llm=llm, context_str=_MARK, query_str=query)
            prompt = llm.messages_to_prompt(llm._extend_messages(msgs))
        else:
            # as LLM.predict formats it (LLM._get_prompt): the LLM's completion_to_prompt wraps the template
            prompt = llm._extend_prompt(self.text_qa_template.format(
                llm=llm, messages_to_prompt=llm.messages_to_prompt, completion_to_prompt=llm.completion_to_prompt,
                context_str=_MARK, query_str=query))
        prefix, suffix = prompt.split(_MARK, 1)
        return prefix, suffix

    def _nodes(self, query: str) -> list[NodeWithScore]:
        nodes = self.retriever.retrieve(query)
        for p in self.node_postprocessors:
            if not isinstance(p, KVCachePostprocessor):
                nodes = p.postprocess_nodes(nodes, QueryBundle(query))
        return nodes

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        nodes = self._nodes(query_str)
        chunks = ensure_node_caches(self.llm.engine, [n.node for n in nodes], fetch=True)  # one read per chunk
        if not chunks:
            return Response("Empty Response", source_nodes=nodes)
        prefix, suffix = self._frame(query_str)
        meta: dict[str, Any] = {"kvrag": {}, "chunk_keys": [c.key for c in chunks]}
        if not self.streaming:
            r = self.llm.complete_parts(prefix, chunks, suffix, self.separator, **self.llm_kwargs)
            meta["kvrag"] = r.additional_kwargs
            return Response(r.text, source_nodes=nodes, metadata=meta)
        gen = self.llm.stream_complete_parts(prefix, chunks, suffix, self.separator, **self.llm_kwargs)

        def deltas() -> Iterator[str]:
            for r in gen:
                meta["kvrag"] = r.additional_kwargs
                if r.delta:
                    yield r.delta

        return StreamingResponse(response_gen=deltas(), source_nodes=nodes, metadata=meta)

    async def acustom_query(self, query_str: str) -> Response | StreamingResponse:
        """:meth:`custom_query` in a worker thread (LlamaIndex's fallback ran it on the event loop, blocking every
        other task); concurrent ``aquery`` calls are in flight at once and decode in the engine's shared batch, and
        cancelling the awaiting task cancels the engine request."""
        return await adapters.to_thread(self.custom_query, query_str)
