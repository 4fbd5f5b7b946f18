"""KVCachedLLM: a LlamaIndex ``CustomLLM`` that answers with reused per-chunk KV caches (kvrag).

A thin adapter: it translates LlamaIndex messages and responses; rendering (:func:`kvrag.adapters.render_chat`),
the request's registered chunk texts (the ``KVCachePostprocessor`` registers them), generation settings and
response metadata come from :mod:`kvrag.adapters`. Prompt + chunks go to
:class:`kvrag.engine.engine.KVRAGEngine`, which finds the chunks verbatim in the prompt, splices their caches,
repairs them with the configured fusion method and prefills only the rest. Without registered chunks it is a plain
local Hugging Face LLM (the whole prompt is prefilled).
"""

from __future__ import annotations

import collections
import contextvars
import difflib
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from kvrag import adapters
from kvrag.default_model import DEFAULT_MODEL
from kvrag.errors import ContextLengthError, KVRAGError

log = logging.getLogger(__name__)

_LAST: contextvars.ContextVar[tuple[int, dict[str, Any]] | None] = contextvars.ContextVar(
    "kvrag_llamaindex_last", default=None)
"""(the id of the KVCachedLLM that made it, the latest request record in this context): one variable for every
instance, so a record says whose it is."""
_GEN_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class _OwnTemplate:
    """A :class:`KVCachedLLM`'s default ``messages_to_prompt`` / ``completion_to_prompt``: its own chat template,
    reached through a weak reference. Not the bound method itself: pydantic shows a field's value in the model's
    repr, and a bound method's repr is its object's, so ``repr(llm)`` recursed forever; LlamaIndex's ``__getstate__``
    then deleted fields of the live object while pickling it. A copy or an unpickled LLM is bound to itself
    (:meth:`KVCachedLLM._own_templates`)."""

    def __init__(self, llm: Any, name: str) -> None:
        self.owner = weakref.ref(llm)
        self.name = name

    def __call__(self, arg: Any) -> str:
        llm = self.owner()
        if llm is None:
            msg = f"this default {self.name} belongs to a KVCachedLLM that no longer exists; use the LLM's own"
            raise RuntimeError(msg)
        return str(getattr(llm, self.name)(arg))

    def __repr__(self) -> str:
        return f"<KVCachedLLM's own {self.name.strip('_')}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (type(None), ())  # pickled as None; the unpickled LLM binds its own (KVCachedLLM.__setstate__)

    def __deepcopy__(self, memo: dict[int, Any]) -> _OwnTemplate:
        return self  # the copy binds its own (KVCachedLLM.model_copy)


_TEMPLATES = (("messages_to_prompt", "_chat_template"), ("completion_to_prompt", "_completion_template"))


_MEDIA_BLOCKS = frozenset({"ImageBlock", "AudioBlock", "VideoBlock", "DocumentBlock"})
"""Content blocks a text-only model cannot see (``ChatMessage.content`` leaves them out)."""


class PromptTooLongError(KVRAGError, RuntimeError):
    """A prompt LlamaIndex packed does not fit the model's context window.

    LlamaIndex counts a prompt's tokens with ``Settings.tokenizer`` (tiktoken unless set), which makes fewer tokens
    of the same text than most local models' tokenizers (SmolLM2: ~1.1x for English, ~1.6x for Japanese), so its
    response synthesizers can pack past the window. Not a ``ValueError``: the synthesizers catch those and answer
    "Empty Response" or drop chunks without a word. The engine's :class:`~kvrag.errors.ContextLengthError` is the
    cause."""


def _chat_response(r: CompletionResponse) -> ChatResponse:
    """A completion as a chat response, its statistics on the response and on the message alike (LlamaIndex's own
    converters put them on the message only, and the async stream had them on the response only)."""
    return ChatResponse(message=ChatMessage(role="assistant", content=r.text, additional_kwargs=r.additional_kwargs),
                        delta=r.delta, raw=r.raw, additional_kwargs=r.additional_kwargs)


class KVCachedLLM(CustomLLM):
    """Local Hugging Face causal LM with reusable chunk KV caches.

    Args:
        engine: a :class:`kvrag.KVRAGEngine` to use (shares its model and store); when omitted, one is loaded
            lazily from ``model_name`` and ``store`` (shared process-wide via :func:`kvrag.adapters.shared_engine`).
        method: fusion method name (``kvrag.fusion.available_methods()``), e.g. ``"stale"``, ``"full"`` (default: the
            engine's, ``EngineConfig.method``).
        method_params: the method's parameters, e.g. ``{"r": 0.15}``.

    Per call, ``complete``/``chat`` accept ``chunks=[...]`` (explicit chunk texts, replacing the registered ones),
    ``method=``, ``method_params=`` and generation overrides (``max_new_tokens``, ``temperature``, ``top_p``,
    ``top_k``, ``seed``, ``stop``).

    Every response carries ``additional_kwargs`` (``ttft_s``, ``hit_rate``, ``chunks_registered``,
    ``chunks_found``, ``chunk_hits``, ``method``, ``method_stats``, token counts) and ``raw`` (all timings and
    stats, the chunk keys). :attr:`last_info` returns the latest record made in the caller's context.
    """

    model_name: str = Field(default=DEFAULT_MODEL, description="Model alias, HF id or local path.")
    store: str = Field(default="memory://", description="KV store URL used when no engine is passed.")
    method: str | None = Field(default=None, description="Fusion method (name or 'name:k=v' spec); None: the engine's.")
    method_params: dict[str, Any] = Field(default_factory=dict, description="Fusion method parameters.")
    context_window: int | None = Field(default=None, description="Context window (default: the model's).")
    max_new_tokens: int = Field(default=256, gt=0, description="Maximum number of generated tokens.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k filtering.")
    seed: int | None = Field(default=None, description="Sampling seed.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not returned).")
    is_chat_model: bool = Field(
        default=True,
        description="Let LlamaIndex send chat messages (rendered with the tokenizer's chat template).",
    )
    use_recent_chunks: bool | None = Field(
        default=None,
        description="Also reuse recently registered chunks found verbatim in the prompt (see kvrag.adapters): True "
                    "always, False never, None (default) when no chunks are registered in the caller's context (a "
                    "workflow's next step, a stream read in another thread).",
    )
    history_size: int = Field(default=32, ge=0, description="How many per-request records to keep in .history.")
    reuse_history: bool = Field(
        default=False,
        description="Offer a chat's earlier user / assistant messages as reusable segments, cached and placed like "
                    "chunks and repaired by the method (kvrag.adapters.history_segments): for chat engines whose "
                    "retrieved chunks change every turn.",
    )

    _engine: Any = PrivateAttr(default=None)
    _engine_left: bool = PrivateAttr(default=False)  # unpickled without the engine it was given
    _history: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if "max_tokens" in kwargs:  # the name most LlamaIndex LLMs (OpenAI, Anthropic, ...) use
            kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        unknown = sorted(k for k in kwargs if k not in type(self).model_fields)
        if unknown:  # pydantic's default would drop them silently: KVCachedLLM(max_tokns=16) generating 256 tokens
            hints = {k: difflib.get_close_matches(k, type(self).model_fields, n=1) for k in unknown}
            msg = "KVCachedLLM got unknown arguments " + ", ".join(
                f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            raise TypeError(msg)
        if engine is not None:
            kwargs.setdefault("model_name", engine.loaded.name)
        kwargs.setdefault("messages_to_prompt", None)
        kwargs.setdefault("completion_to_prompt", None)
        super().__init__(**kwargs)
        for field, name in _TEMPLATES:
            if kwargs.get(field) is None:
                setattr(self, field, _OwnTemplate(self, name))
        self._engine = engine
        self._history = collections.deque(maxlen=self.history_size or None)
        from kvrag.fusion import get_method

        if self.method is not None:
            get_method(self.method, **self.method_params)  # validate early: unknown names list the valid ones

    @classmethod
    def class_name(cls) -> str:
        return "KVCachedLLM"

    # ------------------------------------------------------------------------------------------- handles
    @property
    def engine(self) -> Any:
        """The :class:`kvrag.KVRAGEngine` (loaded on first use when none was passed)."""
        if self._engine is None:
            if self._engine_left:  # model_name over an empty store would drop every cache without a word
                msg = ("this KVCachedLLM was pickled without the KVRAGEngine it was given; pass engine= again "
                       "(KVCachedLLM(engine=...)), or make it without engine= (model_name and store name what it loads)")
                raise TypeError(msg)
            self._engine = adapters.shared_engine(self.model_name, self.store)
        return self._engine

    async def _aload(self) -> None:
        """Load the engine (first use) off the event loop: seconds the loop's other tasks must not wait."""
        if self._engine is None:
            await adapters.to_thread(lambda: self.engine)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self.engine.max_context
        return LLMMetadata(
            context_window=window,
            # what LlamaIndex's prompt packing leaves for the answer: at most half the window (a max_new_tokens past
            # the window made every query engine fail, "available context size -91911"; generation cuts it anyway)
            num_output=min(self.max_new_tokens, window // 2),
            is_chat_model=self.is_chat_model,
            model_name=self.model_name,
        )

    @property
    def history(self) -> list[dict[str, Any]]:
        """Recent per-request records (prompt, chunks, stats, timings), oldest first."""
        return list(self._history)

    @property
    def last_info(self) -> dict[str, Any] | None:
        """The latest request record made in the caller's context (thread / task), else the latest overall."""
        mine = _LAST.get()
        if mine is not None and mine[0] == id(self):
            return mine[1]
        return self._history[-1] if self._history else None

    # ------------------------------------------------------------------------------------------- templates
    def _chat_template(self, messages: Sequence[ChatMessage]) -> str:
        for m in messages:
            other = [type(b).__name__ for b in getattr(m, "blocks", ()) if type(b).__name__ in _MEDIA_BLOCKS]
            if other:  # m.content is the text blocks alone: an image would be dropped without a word
                msg = (f"KVCachedLLM accepts text content only; got {', '.join(sorted(set(other)))} in a "
                       f"{getattr(m.role, 'value', m.role)} message (images, audio and documents are not supported)")
                raise ValueError(msg)
        msgs = [{"role": getattr(m.role, "value", str(m.role)), "content": m.content or ""} for m in messages]
        return adapters.render_chat(self.tokenizer, msgs)

    def _completion_template(self, completion: str) -> str:
        msgs = [ChatMessage(role="user", content=completion)]
        if self.system_prompt:
            msgs.insert(0, ChatMessage(role="system", content=self.system_prompt))
        return self._chat_template(msgs)

    def _own_templates(self) -> None:
        """Bind the default prompt functions to this LLM (a copy or an unpickled LLM held the original's, or none)."""
        for field, name in _TEMPLATES:
            f = getattr(self, field, None)
            if f is None or (isinstance(f, _OwnTemplate) and f.owner() is not self):
                setattr(self, field, _OwnTemplate(self, name))

    def model_copy(self, *, update: Any = None, deep: bool = False) -> KVCachedLLM:
        copy = super().model_copy(update=update, deep=deep)
        copy._own_templates()
        return copy

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)  # LlamaIndex's: __init__ from the fields (private attributes are not restored)
        self._own_templates()
        self._engine_left = bool((state.get("__pydantic_private__") or {}).get("_engine_left"))

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()  # LlamaIndex leaves out what does not pickle: the engine
        if self._engine is not None:
            private = {**(state.get("__pydantic_private__") or {}), "_engine": None}
            private["_engine_left"] = not adapters.is_shared_engine(self._engine)  # a shared one: loaded by name
            state = {**state, "__pydantic_private__": private}
        return state

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> KVCachedLLM:
        copy = super().__deepcopy__(adapters.sharing(memo, self._engine))
        copy._own_templates()
        return copy

    # ------------------------------------------------------------------------------------------- requests
    def _gen_config(self, kw: dict[str, Any]) -> Any:
        if kw.get("max_new_tokens") is None and "max_tokens" in kw:  # per-call alias, as in the constructor
            kw["max_new_tokens"] = kw.pop("max_tokens")
        # a call's None is the model's own setting (max_tokens=args.max_tokens with a None default)
        return adapters.generation_config(**{k: v if (v := kw.pop(k, None)) is not None else getattr(self, k)
                                             for k in _GEN_KEYS})

    def _method(self, kw: dict[str, Any]) -> Any:
        return self.engine.method(kw.pop("method", self.method), **kw.pop("method_params", self.method_params))

    def _new_request(self, prompt: str, formatted: bool, kw: dict[str, Any]) -> dict[str, Any]:
        """Resolve everything a request needs NOW (in the caller's context), before any lazy generation."""
        kw = dict(kw)
        full = prompt if formatted else self.completion_to_prompt(prompt)
        explicit = kw.pop("chunks", None)
        # with nothing registered in this context (a workflow's next step, a stream read in another thread), the
        # chunks registered elsewhere that this prompt holds, as LangChain's adapter finds them
        use_recent = kw.pop("use_recent_chunks", self.use_recent_chunks)
        if use_recent is None:  # the context's registration reaches this call only when its prompt holds some of it
            use_recent = not any(c.text in full for c in adapters.current_chunks())
        chunks = adapters.resolve_chunks(full, explicit, use_recent=use_recent)
        if explicit is None:  # a short text found by content alone is a phrase of this prompt, not a passage
            chunks = adapters.passages_found(chunks, lambda t: len(self.engine.tokenize(t)))
        req = {"prompt": full, "chunks": adapters.chunk_texts(chunks), "refs": chunks, "method": self._method(kw),
               "gen": self._gen_config(kw)}
        if explicit is None:
            adapters.release_caches(full)  # the request holds them now; the caller's thread keeps none after it
        kw.pop("formatted", None)
        if kw:  # frameworks pass extra keywords through; say so where a user can see it
            log.warning("KVCachedLLM ignores unknown keyword arguments %s (generation options: %s, max_tokens)",
                        sorted(kw), ", ".join(_GEN_KEYS))
        return req

    def _chat_request(self, messages: Sequence[ChatMessage], kw: dict[str, Any]) -> dict[str, Any]:
        kw = dict(kw)
        history = bool(kw.pop("reuse_history", self.reuse_history))
        req = self._new_request(self.messages_to_prompt(messages), True, kw)
        if history:
            dicts = [{"role": m.role.value, "content": m.content or ""} for m in messages]
            req["refs"] = adapters.with_history(req["refs"], dicts)
            req["chunks"] = adapters.chunk_texts(req["refs"])
        return req

    def _plan(self, req: dict[str, Any]) -> Any:
        if "parts" in req:
            prefix, chunks, suffix, sep = req["parts"]
            return self.engine.plan_parts(prefix, chunks, suffix, sep)
        return self.engine.plan(req["prompt"], req["refs"])  # keys, ids and held caches travel with the chunks

    def _prepare(self, req: dict[str, Any]) -> Any:
        try:
            plan = self._plan(req)
            req["gen"] = adapters.fit_to_window(self.engine, plan, req["gen"])  # as kvrag serve cuts max_tokens
            return self.engine.prepare(plan, req["method"], reserve=req["gen"].max_new_tokens)
        except ContextLengthError as e:
            msg = (f"{e}. If a LlamaIndex response synthesizer packed this prompt: it counts tokens with "
                   "Settings.tokenizer, not this model's tokenizer; set Settings.tokenizer = llm.tokenizer.encode, or "
                   "retrieve fewer or shorter chunks")
            raise PromptTooLongError(msg) from e

    @staticmethod
    def _extra(prep: Any) -> dict[str, Any]:
        """A response's ``additional_kwargs``: the summary and token usage (cheap: computed for every delta)."""
        prompt_tokens, completion_tokens = adapters.token_usage(prep)
        return {**adapters.response_summary(prep), "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}

    def _info(self, req: dict[str, Any], prep: Any, text: str | None) -> dict[str, Any]:
        extra = self._extra(prep)
        usage = {"prompt_tokens": extra["prompt_tokens"], "completion_tokens": extra["completion_tokens"] or 0}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {
            "additional_kwargs": extra,
            # "usage" as OpenAI's responses carry it: LlamaIndex's TokenCountingHandler reads it from raw
            "raw": {**adapters.response_details(prep), "usage": usage},
            "prompt": req["prompt"],
            "chunks": list(req["chunks"]),
            "text": text,
        }

    def _record(self, info: dict[str, Any], req: dict[str, Any] | None = None) -> None:
        self._history.append(info)
        _LAST.set((id(self), info))
        if req is not None:  # for an async caller, whose context the worker thread's copy does not reach
            req["info"] = info

    def _adopt(self, req: dict[str, Any]) -> None:
        """Make the record of ``req`` (run in a worker thread) the caller's :attr:`last_info`."""
        if "info" in req:
            _LAST.set((id(self), req["info"]))

    async def _astream(self, req: dict[str, Any]) -> CompletionResponseAsyncGen:
        async for r in adapters.aiter_in_thread(lambda: self._run_stream(req)):
            yield r
        self._adopt(req)

    def _run(self, req: dict[str, Any]) -> CompletionResponse:
        prep = self._prepare(req)
        text = "".join(self.engine.stream(prep, req["gen"]))
        info = self._info(req, prep, text)
        self._record(info, req)
        return CompletionResponse(text=text, raw=info["raw"], additional_kwargs=info["additional_kwargs"])

    def _run_stream(self, req: dict[str, Any]) -> CompletionResponseGen:
        prep = self._prepare(req)
        text = ""
        for delta in self.engine.stream(prep, req["gen"]):
            text += delta
            yield CompletionResponse(text=text, delta=delta, additional_kwargs=self._extra(prep))
        info = self._info(req, prep, text)
        self._record(info, req)
        # a final empty delta carries the complete timings and stats
        yield CompletionResponse(text=text, delta="", raw=info["raw"], additional_kwargs=info["additional_kwargs"])

    # ------------------------------------------------------------------------------------------- explicit parts
    def _parts_request(self, prefix: str, chunks: Sequence[str | adapters.RegisteredChunk], suffix: str,
                       separator: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        adapters.texts_not_one_str(chunks, "chunks")
        refs = list(chunks)
        texts = [c.text if isinstance(c, adapters.RegisteredChunk) else c for c in refs]
        req = self._new_request(prefix + separator.join(texts) + suffix, True, {**kwargs, "chunks": refs})
        req["parts"] = (prefix, refs, suffix, separator)
        return req

    def complete_parts(self, prefix: str, chunks: Sequence[str | adapters.RegisteredChunk], suffix: str,
                       separator: str = "", **kwargs: Any) -> CompletionResponse:
        """Answer ``prefix + separator.join(chunks) + suffix`` with the chunks passed explicitly (no search).

        ``chunks`` are texts or the :class:`~kvrag.adapters.RegisteredChunk` objects ``ensure`` returned (their
        ids, keys and held caches are used as they are).
        """
        return self._run(self._parts_request(prefix, chunks, suffix, separator, kwargs))

    def stream_complete_parts(self, prefix: str, chunks: Sequence[str | adapters.RegisteredChunk], suffix: str,
                              separator: str = "", **kwargs: Any) -> CompletionResponseGen:
        """Streaming form of :meth:`complete_parts`."""
        return self._run_stream(self._parts_request(prefix, chunks, suffix, separator, kwargs))

    # ------------------------------------------------------------------------------------------- LlamaIndex API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._run(self._new_request(prompt, formatted, kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        # resolve the request's chunks now: the generator may be consumed in another thread (chat engines do)
        return self._run_stream(self._new_request(prompt, formatted, kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req = self._chat_request(messages, kwargs)
        return _chat_response(self._run(req))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req = self._chat_request(messages, kwargs)
        return (_chat_response(r) for r in self._run_stream(req))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        await self._aload()
        req = self._new_request(prompt, formatted, kwargs)
        r = await adapters.to_thread(self._run, req)
        self._adopt(req)
        return r

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        await self._aload()
        req = self._new_request(prompt, formatted, kwargs)
        return self._astream(req)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        await self._aload()
        req = self._chat_request(messages, kwargs)
        r = await adapters.to_thread(self._run, req)
        self._adopt(req)
        return _chat_response(r)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        await self._aload()
        req = self._chat_request(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            async for r in self._astream(req):
                yield _chat_response(r)

        return gen()

