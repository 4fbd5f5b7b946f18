"""ChatKVCached: a LangChain chat model that answers with reused per-chunk KV caches (kvrag).

A thin adapter: it translates LangChain messages and results; :mod:`kvrag.adapters` renders the prompt
(:func:`kvrag.adapters.render_chat`), maps the sampling fields and builds the response metadata. The chunk texts the
request may reuse come from ``chunks=[...]`` (explicit), the current context's registration, or — because LCEL
runs the steps of a chain in separate contexts — the recently registered chunks found verbatim in the prompt (see
:mod:`kvrag.adapters`). :class:`kvrag.engine.engine.KVRAGEngine` does the planning, splicing, repair and decoding.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage, HumanMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr

from kvrag import adapters
from kvrag.default_model import DEFAULT_MODEL

# by class, so that streamed pieces (AIMessageChunk, ...) and their sums are the messages they stand for
_ROLES = ((HumanMessage, "user"), (AIMessage, "assistant"), (SystemMessage, "system"))


def _text_content(msg: BaseMessage) -> str:
    content = msg.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            msg_ = f"ChatKVCached accepts text content only; got a {kind!r} content block (images, audio and files are not supported)"
            raise ValueError(msg_)
    return "".join(parts)


def messages_to_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> chat-template dicts (system / user / assistant)."""
    out = []
    for m in messages:
        role = next((r for cls, r in _ROLES if isinstance(m, cls)), None)
        if role is None and isinstance(m, ChatMessage):
            role = m.role
        if role is None:
            msg = (f"ChatKVCached does not support {m.type!r} messages (tool calling is not supported); "
                   "use system, human and ai messages")
            raise ValueError(msg)
        out.append({"role": role, "content": _text_content(m)})
    return out


class ChatKVCached(BaseChatModel):
    """Local Hugging Face chat model with reusable chunk KV caches.

    Args:
        engine: a :class:`kvrag.KVRAGEngine` (shares its model and store). When omitted, one is loaded lazily from
            ``model`` and ``store`` and shared process-wide (:func:`kvrag.adapters.shared_engine`).
        method / method_params: fusion method (``kvrag.fusion.available_methods()``) and its parameters.
        temperature: 0 (default) is greedy decoding.
        max_tokens: most generated tokens.

    Per call, ``invoke(..., chunks=[...])`` passes chunk texts explicitly; ``method=`` overrides the method.
    ``response_metadata["kvrag"]`` holds ttft_s, hit_rate, chunk counts, method stats and timings;
    ``usage_metadata`` the token counts. ``timeout`` and ``max_retries`` are accepted for compatibility (local
    inference neither times out nor retries).
    """

    # extra="forbid": a misspelled keyword (``max_tokns=...``) is an error, not a silently ignored setting
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    model_name: str = Field(default=DEFAULT_MODEL, alias="model")
    store: str = Field(default="memory://", description="KV store URL used when no engine is passed.")
    method: str | None = Field(default=None, description="None: the engine's method (EngineConfig.method).")
    method_params: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int = Field(default=256, gt=0, alias="max_new_tokens")
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] | str | None = Field(default=None, alias="stop_sequences")  # one str: one stop, as ChatOpenAI
    timeout: float | None = None
    max_retries: int = 0
    streaming: bool = False
    use_recent_chunks: bool = Field(
        default=True, description="Reuse recently registered chunks found verbatim in the prompt (LCEL needs it)."
    )
    reuse_history: bool = Field(
        default=False,
        description="Offer the earlier user / assistant messages as reusable segments, cached and placed like chunks "
                    "and repaired by the method (kvrag.adapters.history_segments): for chains whose retrieved chunks "
                    "change every turn.",
    )

    # a field, not a private attribute: LangChain rebuilds the model from its fields (configurable_fields,
    # with_config(configurable=...)), and a private engine was lost there, so a second model was loaded silently
    # with an empty memory:// store
    kv_engine: Any = Field(default=None, exclude=True, repr=False, description="The KVRAGEngine passed as engine=.")
    _history: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None:
            kwargs["kv_engine"] = engine
        if kwargs.get("kv_engine") is not None and "model" not in kwargs and "model_name" not in kwargs:
            kwargs["model"] = kwargs["kv_engine"].loaded.name  # (setdefault("model") clashed with model_name=)
        super().__init__(**kwargs)
        self._history = collections.deque(maxlen=32)
        from kvrag.fusion import get_method

        if self.method is not None:
            get_method(self.method, **self.method_params)  # unknown names raise listing the valid ones

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> ChatKVCached:
        return super().__deepcopy__(adapters.sharing(memo, self.kv_engine))

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        if self.kv_engine is not None:
            if not adapters.is_shared_engine(self.kv_engine):
                raise adapters.unpicklable_engine(type(self).__name__)
            state = {**state, "__dict__": {**state["__dict__"], "kv_engine": None}}  # loaded again by name
        return state

    @property
    def engine(self) -> Any:
        """The :class:`kvrag.KVRAGEngine` (loaded on first use when none was passed)."""
        if self.kv_engine is None:
            self.kv_engine = adapters.shared_engine(self.model_name, self.store)
        return self.kv_engine

    async def _aload(self) -> None:
        """Load the engine (first use) off the event loop: seconds the loop's other tasks must not wait."""
        if self.kv_engine is None:
            await adapters.to_thread(lambda: self.engine)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The latest requests (prompt, chunk texts, response metadata, usage), oldest first (at most 32)."""
        return list(self._history)

    @property
    def _llm_type(self) -> str:
        return "kvrag-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "method": self.method,
            "method_params": self.method_params,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_sequences": self.stop,  # the field ("stop" is the call's, set by LangChain over it)
            "use_recent_chunks": self.use_recent_chunks,
            "reuse_history": self.reuse_history,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvrag"
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else self.model_name
        return params

    # ------------------------------------------------------------------------------------------- token counting
    def get_token_ids(self, text: str) -> list[int]:
        """The model's own token ids (LangChain's fallback is GPT-2's tokenizer, which offline counts 0 tokens)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(self.engine.tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of the prompt the model sees for ``messages`` (chat template and generation prompt included)."""
        if tools:
            msg = "ChatKVCached does not support tools"
            raise NotImplementedError(msg)
        if not messages:  # no conversation, no prompt (trim_messages counts [] too)
            return 0
        return len(self.get_token_ids(self.render(messages)))

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        """Not supported: kvrag runs a plain local chat model without a tool-calling protocol."""
        msg = ("ChatKVCached does not support tool calling (bind_tools / agents); for structured answers put the "
               "format in the prompt and parse the text, e.g. PydanticOutputParser or JsonOutputParser")
        raise NotImplementedError(msg)

    # ------------------------------------------------------------------------------------------- requests
    def render(self, messages: Sequence[BaseMessage]) -> str:
        """The prompt string the model sees (chat template with the generation prompt)."""
        return adapters.render_chat(self.engine.tokenizer, messages_to_dicts(messages))

    def _request(self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:

        kw = dict(kwargs)
        prompt = self.render(messages)
        use_recent = bool(kw.pop("use_recent_chunks", self.use_recent_chunks))
        explicit = kw.pop("chunks", None)
        if explicit is not None:  # one text, or the Documents a retriever returned
            from langchain_kvrag.retrievers import render_document

            explicit = [explicit] if isinstance(explicit, str) else \
                [render_document(c) if isinstance(c, Document) else c for c in explicit]
        # LCEL gives no request-scoped context: count only registered chunks that this prompt contains
        chunks = adapters.resolve_chunks(prompt, explicit, use_recent=use_recent, only_found=use_recent)
        if explicit is None:  # a short text found by content alone is a phrase of this prompt, not a passage
            # (a retriever invoked on its own registers in this thread, which delimits no request: held alike)
            chunks = adapters.passages_found(chunks, lambda t: len(self.engine.tokenize(t)), scoped=False)
        if kw.pop("reuse_history", self.reuse_history):
            chunks = adapters.with_history(chunks, messages_to_dicts(messages))

        def field(name: str, *aliases: str) -> Any:  # a call's None is the model's own setting, as elsewhere
            given = [v for a in (name, *aliases) if (v := kw.pop(a, None)) is not None]
            return given[0] if given else getattr(self, name)

        gen = adapters.generation_config(
            max_new_tokens=field("max_tokens", "max_new_tokens", "max_completion_tokens"),
            temperature=field("temperature"),
            top_p=field("top_p"),
            top_k=field("top_k"),
            seed=field("seed"),
            stop=stop if stop is not None else self.stop,
        )
        method = self.engine.method(kw.pop("method", self.method), **kw.pop("method_params", self.method_params))
        if kw:  # a misspelled per-call option must not pass silently (the constructor forbids extra fields)
            warnings.warn(f"ChatKVCached ignores unknown call options {sorted(kw)}", stacklevel=4)
        return {"prompt": prompt, "chunks": adapters.chunk_texts(chunks), "refs": chunks, "gen": gen, "method": method}

    def _prepare(self, req: dict[str, Any]) -> Any:
        plan = self.engine.plan(req["prompt"], req["refs"])
        req["gen"] = adapters.fit_to_window(self.engine, plan, req["gen"])  # as kvrag serve cuts max_tokens
        return self.engine.prepare(plan, req["method"], reserve=req["gen"].max_new_tokens)

    def _metadata(self, req: dict[str, Any], prep: Any) -> tuple[dict[str, Any], dict[str, int]]:
        prompt_tokens, generated_or_none = adapters.token_usage(prep)
        generated = generated_or_none or 0
        details = adapters.response_details(prep)
        info = {**adapters.response_summary(prep), "timings": details["timings"], "chunk_keys": details["chunk_keys"],
                "token_ids": details["token_ids"]}
        meta = {
            "model_name": self.model_name,
            "finish_reason": adapters.finish_reason(prep, req["gen"].max_new_tokens),
            "kvrag": info,
        }
        usage = {"input_tokens": prompt_tokens, "output_tokens": generated, "total_tokens": prompt_tokens + generated,
                 "input_token_details": {"cache_read": int(prep.stats.reused_tokens)}}
        self._history.append({"prompt": req["prompt"], "chunks": list(req["chunks"]), "response_metadata": meta,
                              "usage_metadata": usage})
        return meta, usage

    # ------------------------------------------------------------------------------------------- LangChain API
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return self._run(self._request(messages, stop, kwargs))

    def _run(self, req: dict[str, Any]) -> ChatResult:
        prep = self._prepare(req)
        text = "".join(self.engine.stream(prep, req["gen"]))
        meta, usage = self._metadata(req, prep)
        msg = AIMessage(content=text, response_metadata=meta, usage_metadata=usage)  # type: ignore[arg-type]
        return ChatResult(generations=[ChatGeneration(message=msg)], llm_output={"model_name": self.model_name})

    def _stream_request(self, req: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        prep = self._prepare(req)
        for delta in self.engine.stream(prep, req["gen"]):
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        meta, usage = self._metadata(req, prep)
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", response_metadata=meta, usage_metadata=usage, chunk_position="last")  # type: ignore[arg-type]
        )

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        req = self._request(messages, stop, kwargs)
        for chunk in self._stream_request(req):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        await self._aload()
        req = self._request(messages, stop, kwargs)  # resolve chunks in this task's context
        return await adapters.to_thread(self._run, req)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        await self._aload()
        req = self._request(messages, stop, kwargs)
        async for chunk in adapters.aiter_in_thread(lambda: self._stream_request(req)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
