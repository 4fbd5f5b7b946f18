"""KVCachePostprocessor and KVCacheTransform: make sure retrieved / ingested nodes have chunk caches.

The text a node contributes to a prompt is ``node.get_content(metadata_mode=MetadataMode.LLM)``: that is what the
response synthesizers put into the context (their repacking strips outer whitespace, so :func:`render_node` does
too). Its cache is computed for exactly that string; the chunk key is written to ``node.metadata`` under
:data:`kvrag.adapters.CHUNK_KEY_METADATA` and excluded from the LLM and embedding metadata, so tagging a node does
not change the text (nor the cache key, nor the embedding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TransformComponent

from kvrag import adapters
from kvrag.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_engine(engine: Any = None, llm: Any = None) -> Any:
    """The kvrag engine given directly or held by a ``KVCachedLLM``."""
    if engine is not None:
        return engine
    if llm is not None and getattr(llm, "engine", None) is not None:
        return llm.engine
    msg = "pass engine=KVRAGEngine(...) or llm=KVCachedLLM(...) so that caches go into the LLM's store"
    raise ValueError(msg)


class _SharesEngine:
    """Mixed into the components that hold an engine: a deep copy (``copy.deepcopy``, ``model_copy(deep=True)``)
    shares the loaded model and store instead of copying them (an engine refuses to be copied)."""

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        held = (getattr(self, "_engine", None), getattr(self, "_llm", None))
        return super().__deepcopy__(adapters.sharing(memo, *held))  # type: ignore[misc]


def cache_target(engine: Any) -> str:
    """The engine's chunk key space and store, as text: what a cached ingestion step must be keyed by. A store that
    lives only in this process (``memory://``) adds its identity: another instance is empty."""
    from kvrag.store.memory import MemoryStore

    store = engine.store
    own = f" @{id(store):x}" if isinstance(store, MemoryStore) else ""
    return f"{engine.key_space()} | {store!r}{own}"


def exclude_key(node: BaseNode, key_name: str = adapters.CHUNK_KEY_METADATA) -> None:
    """Hide the chunk-key metadata from the LLM and embedding renderings of ``node``."""
    if key_name not in node.excluded_llm_metadata_keys:
        node.excluded_llm_metadata_keys = [*node.excluded_llm_metadata_keys, key_name]
    if key_name not in node.excluded_embed_metadata_keys:
        node.excluded_embed_metadata_keys = [*node.excluded_embed_metadata_keys, key_name]


def render_node(node: BaseNode) -> str:
    """The exact text the response synthesizers put into the prompt for ``node``."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


def ensure_node_caches(engine: Any, nodes: Sequence[BaseNode], *, key_name: str = adapters.CHUNK_KEY_METADATA,
                       progress: bool = False, batch_size: int | None = None,
                       fetch: bool = False) -> list[adapters.RegisteredChunk]:
    """Cache every node's rendered text (computing only missing caches) and tag the node with its chunk key.

    One store round trip for all nodes (``KVRAGEngine.ensure``); missing caches are prefilled ``batch_size``
    chunks per forward (None: kvrag's default).

    Args:
        fetch: read the caches in that same round trip and hold them in the returned chunks, so that the LLM
            answering this request reads nothing more from the store.

    Returns:
        The registered chunks (text, key, token ids; with ``fetch`` their caches) of the nodes that have text.
    """
    for n in nodes:
        exclude_key(n, key_name)
    texts = [render_node(n) for n in nodes]
    out = []
    ensured = engine.ensure(texts, fetch=fetch, batch_size=batch_size, progress=progress)
    for n, (ref, _cached) in zip(nodes, ensured, strict=True):
        if ref is None:
            continue
        n.metadata[key_name] = ref.key
        out.append(ref)
    return out


class KVCachePostprocessor(_SharesEngine, BaseNodePostprocessor):
    """Ensures a cache for every retrieved node and registers the nodes as the request's chunks.

    Put it last in ``node_postprocessors`` (after rerankers / filters): the nodes it sees are the nodes the
    synthesizer renders. It leaves the node list unchanged.

    Args:
        engine: the :class:`kvrag.KVRAGEngine` whose store the LLM reads (or pass ``llm=KVCachedLLM``).
        register_request: set the request's chunks in :mod:`kvrag.adapters` (turn off to only warm the store).
    """

    metadata_key: str = Field(default=adapters.CHUNK_KEY_METADATA)
    register_request: bool = Field(default=True, description="Register the nodes as the current request's chunks.")

    _engine: Any = PrivateAttr(default=None)
    _llm: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, llm: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is None and llm is None:
            resolve_engine(engine, llm)  # raises with the fix
        self._engine = engine
        self._llm = llm

    @classmethod
    def class_name(cls) -> str:
        return "KVCachePostprocessor"

    @property
    def engine(self) -> Any:
        engine, llm = getattr(self, "_engine", None), getattr(self, "_llm", None)  # absent in a pickled copy
        if engine is None and llm is None:
            msg = ("this KVCachePostprocessor was copied out of its process (pickled) without its engine, whose "
                   "model and store do not travel; make it in the process that queries (KVCachePostprocessor("
                   "engine=...))")
            raise ValueError(msg)
        return resolve_engine(engine, llm)

    def _ensure(self, nodes: list[NodeWithScore]) -> list[adapters.RegisteredChunk]:
        # a registered request reads each cache here, once; the LLM then splices the held caches in
        return ensure_node_caches(self.engine, [n.node for n in nodes], key_name=self.metadata_key,
                                  fetch=self.register_request)

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        chunks = self._ensure(nodes)
        if self.register_request:
            adapters.register_chunks(chunks)
        return nodes

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        # compute in a worker thread, but register in THIS task's context (a thread's context copy is discarded)
        chunks = await adapters.to_thread(self._ensure, nodes)
        if self.register_request:
            adapters.register_chunks(chunks)
        return nodes


class KVCacheTransform(_SharesEngine, TransformComponent):
    """Ingestion step that computes and stores the chunk cache of every node (use it after the node parser).

    Works in ``IngestionPipeline(transformations=[splitter, KVCacheTransform(engine), embed_model])`` and in
    ``VectorStoreIndex.from_documents(docs, transformations=[splitter, KVCacheTransform(engine)])``. Nodes whose
    cache is already stored are only tagged.
    """

    metadata_key: str = Field(default=adapters.CHUNK_KEY_METADATA)
    show_progress: bool = Field(default=False, description="Show a progress bar.")
    batch_size: int | None = Field(default=None, ge=1, description="Chunks per prefill forward (None: kvrag's default).")
    target: str = Field(default="", description="Where the caches go: the engine's key space (model, tokenizer, dtype, "
                        "codec) and store. Set from the engine; part of what LlamaIndex's IngestionCache hashes, so "
                        "another model or store is not taken for already done.")

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, llm: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = resolve_engine(engine, llm)
        self.target = cache_target(self._engine)

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheTransform"

    @property
    def engine(self) -> Any:
        engine = getattr(self, "_engine", None)  # absent in a copy made by pickling: the engine does not travel
        if engine is None:
            msg = ("KVCacheTransform has no engine here: it was copied into another process (IngestionPipeline with "
                   "num_workers > 1 pickles its transformations), and the engine's model and store do not travel; "
                   "run the pipeline with num_workers=1 (the transform batches its prefills itself)")
            raise ConfigError(msg)
        return engine

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        progress = bool(kwargs.get("show_progress", self.show_progress))
        ensure_node_caches(self.engine, nodes, key_name=self.metadata_key, progress=progress,
                           batch_size=self.batch_size)
        return nodes
