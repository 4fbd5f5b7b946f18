"""KVCacheRetriever: wraps any retriever; ensures and registers the caches of the documents it returns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr

from kvrag import adapters


def render_document(doc: Document) -> str:
    """The exact text a document contributes to a prompt (what :func:`format_docs` writes): its ``page_content``
    without leading and trailing whitespace. Loaders leave a file's final newline (or a page's blank lines) on the
    text; kept, it runs into the separator (``"\n" + "\n\n"`` tokenizes as one newline token and another), so the
    document's cached token ids would not be the prompt's, and the prompt never reused its cache."""
    return doc.page_content.strip()


def format_docs(docs: Sequence[Document], separator: str = "\n\n") -> str:
    """Join documents for a prompt so that each one appears verbatim (and is found as a cached chunk)."""
    return separator.join(render_document(d) for d in docs)


class KVCacheRetriever(BaseRetriever):
    """Any retriever, plus: every returned document has a stored chunk cache and is registered for the request.

    The chunk key is added to a copy of each document's metadata (``kvrag_chunk_key``); ``page_content`` is
    unchanged. The cached text is ``page_content`` without leading and trailing whitespace (:func:`render_document`);
    use :func:`format_docs` in the prompt, or write ``page_content`` some other way that keeps that text whole.

    Args:
        retriever: the wrapped retriever (e.g. ``FAISS(...).as_retriever()``).
        engine: the :class:`kvrag.KVRAGEngine` whose store the chat model reads (or ``llm=ChatKVCached``).
        k: number of documents (passed to the wrapped retriever when it accepts ``k``, and enforced).
    """

    # a misspelled keyword (``metdata_key=...``) is an error, not a silently ignored setting
    model_config = ConfigDict(extra="forbid")

    retriever: BaseRetriever
    k: int | None = Field(default=None, ge=1)
    metadata_key: str = adapters.CHUNK_KEY_METADATA
    register_request: bool = True

    _engine: Any = PrivateAttr(default=None)
    _llm: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, llm: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is None and llm is None:
            msg = "pass engine=KVRAGEngine(...) or llm=ChatKVCached(...) so that caches go into the model's store"
            raise ValueError(msg)
        self._engine = engine
        self._llm = llm

    @classmethod
    def from_vectorstore(cls, vectorstore: Any, engine: Any = None, llm: Any = None, k: int = 4,
                         search_type: str = "similarity", **search_kwargs: Any) -> KVCacheRetriever:
        """``vectorstore.as_retriever(search_type=..., search_kwargs={"k": k, **search_kwargs})`` wrapped
        (``search_type``: ``"similarity"``, ``"mmr"`` or ``"similarity_score_threshold"``, whose
        ``score_threshold`` goes in ``search_kwargs`` as in LangChain)."""
        inner = vectorstore.as_retriever(search_type=search_type, search_kwargs={"k": k, **search_kwargs})
        return cls(retriever=inner, engine=engine, llm=llm, k=k)

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> KVCacheRetriever:
        return super().__deepcopy__(adapters.sharing(memo, self._engine))

    def __getstate__(self) -> dict[Any, Any]:
        if self._engine is not None:  # a retriever made with llm= pickles as that chat model does
            raise adapters.unpicklable_engine(type(self).__name__, "KVCacheRetriever(llm=ChatKVCached(model=...))")
        return super().__getstate__()

    @property
    def engine(self) -> Any:
        return self._engine if self._engine is not None else self._llm.engine

    def _inner_kwargs(self, kwargs: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        kw = dict(kwargs)
        k = kw.pop("k", self.k)
        if k is not None and getattr(self.retriever, "_expects_other_args", False):
            kw["k"] = k
        return k, kw

    def _cache(self, docs: list[Document], k: int | None) -> tuple[list[Document], list[adapters.RegisteredChunk]]:
        docs = docs[:k] if k is not None else docs
        texts = [render_document(d) for d in docs]
        out, chunks = [], []
        # contains only (no cache read): LCEL runs the chat model in another context, which finds these chunks by
        # content in adapters.recent (identity only) and reads each cache once, by key
        for d, (ref, _cached) in zip(docs, adapters.ensure_chunks(self.engine, texts), strict=True):
            if ref is None:
                out.append(d)
                continue
            out.append(d.model_copy(update={"metadata": {**d.metadata, self.metadata_key: ref.key}}))
            chunks.append(ref)
        return out, chunks

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        k, kw = self._inner_kwargs(kwargs)
        docs = self.retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kw)
        out, chunks = self._cache(docs, k)
        if self.register_request:
            adapters.register_chunks(chunks)
        return out

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[Document]:
        k, kw = self._inner_kwargs(kwargs)
        docs = await self.retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kw)
        out, chunks = await adapters.to_thread(self._cache, docs, k)
        if self.register_request:  # in this task's context, not the worker thread's copy
            adapters.register_chunks(chunks)
        return out
