"""The layer every framework adapter shares; the adapters themselves only translate types.

The LlamaIndex LLM and postprocessor (``integrations/llama-index-*-kvrag``) and the LangChain chat model and
retriever (``integrations/langchain-kvrag``) all call this module for the behaviour they have in common:

* **Request chunks** (see docs/architecture.md#data-flow: chunk identity travels explicitly). Framework
  retrievers/postprocessors find the chunks of a request; the LLM adapter renders the final prompt. The two only
  meet here:

  - *request scope* (``contextvars``): :func:`register_chunks` replaces the current context's request chunks and
    :func:`current_chunks` reads them. Each thread and each asyncio task has its own context, so concurrent
    requests never see each other's chunks. LlamaIndex query/chat engines retrieve, postprocess and synthesize in
    one context, so this is all they need. A registration outlives its query in the thread until a call whose
    prompt holds none of its chunks forgets it (:func:`resolve_chunks`): an unrelated call after a query (or after
    a ``retrieve()`` shown as sources) is not counted against chunks it never asked for, and its texts are found by
    content from then on;
  - *recent chunks* (process-wide, bounded LRU): every registration is also remembered here.
    :meth:`RecentChunks.found_in` returns the remembered texts that occur verbatim in a prompt. LangChain's LCEL
    runs each step of a chain in a *copy* of the caller's context (``RunnableParallel`` even in worker threads),
    so a retriever's context-local registration is not visible to the chat model later in the same chain; the
    chat model adapter therefore also looks up recent chunks by content. This cannot mix up requests: a chunk is
    used only where its exact text is in the prompt, and caches are content-addressed, so the cache is the same
    whichever request registered it. A chunk found by content alone is reused only when it is passage-sized
    (:data:`MIN_FOUND_TOKENS`, :func:`passages_found`): a short retrieved text ("Hello", a template line) that
    happens to occur in an unrelated prompt is left to the prompt;
  - *explicit passing*: adapters accept the chunk texts as an argument; explicit chunks win over both scopes.

  The planner still decides everything: registered texts that are not found verbatim are simply prefilled as
  normal text and lower the reported hit rate. :func:`ensure_chunks` makes sure the chunks have stored caches.
* **Engine handles**: :func:`shared_engine`, one loaded engine per (model, store, config) per process.
* **Prompts and generation**: :func:`render_chat` (the one chat-template renderer, :mod:`kvrag.prompting`) and
  :func:`generation_config` (framework sampling fields -> :class:`~kvrag.config.GenerationConfig`).
* **Response metadata**: :func:`response_summary`, :func:`response_details` and :func:`token_usage` turn an
  engine request's timings and stats into what the adapters attach to framework responses.
* **Async bridge** (:mod:`kvrag.async_bridge`, re-exported): :func:`to_thread` and :func:`aiter_in_thread` run a
  blocking request or token stream from asyncio in a worker thread of its own, cancellable with the awaiting task.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvrag.async_bridge import MAX_WORKER_THREADS, aiter_in_thread, to_thread
from kvrag.chunk_table import ChunkLike, RecentChunks
from kvrag.chunk_table import normalize as _normalize
from kvrag.config import GenerationConfig
from kvrag.engine.chunks import RegisteredChunk, texts_not_one_str
from kvrag.errors import ConfigError
from kvrag.jsontypes import JSONObject
from kvrag.prompting import ROLE_ALIASES, render_chat

if TYPE_CHECKING:
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.planner import Plan
    from kvrag.engine.results import Prepared
    from kvrag.store.base import KVStore

CHUNK_KEY_METADATA = "kvrag_chunk_key"
"""Metadata field that carries a node's / document's chunk key (excluded from what the LLM and embedder see)."""


@dataclasses.dataclass(eq=False)
class _Registration:
    """One :func:`register_chunks` call's chunks (shared by the context copies a request's worker threads run in)."""

    chunks: tuple[RegisteredChunk, ...]


_REQUEST: contextvars.ContextVar[_Registration | None] = contextvars.ContextVar("kvrag_request_chunks", default=None)


recent = RecentChunks()
"""The process-wide table every :func:`register_chunks` call feeds."""


def register_chunks(chunks: Iterable[ChunkLike], *, replace: bool = True) -> contextvars.Token:
    """Set (``replace=True``) or extend the current context's request chunks; also remember them in :data:`recent`.

    Returns:
        A token for :func:`reset_chunks` (``chunk_scope`` does this for you).
    """
    new = _normalize(chunks)
    recent.add(new)
    if not replace:
        new = _normalize((*current_chunks(), *new))
    return _REQUEST.set(_Registration(new))


def reset_chunks(token: contextvars.Token) -> None:
    """Undo a :func:`register_chunks` call (in the same context)."""
    _REQUEST.reset(token)


def clear_chunks() -> None:
    """Forget the current context's request chunks (``recent`` is kept)."""
    _REQUEST.set(None)


def release_caches(prompt: str) -> None:
    """Let the current context stop holding the caches of its request chunks that occur in ``prompt``: the request
    being made of it took them (it holds them while it runs), so the context keeps only their identities and a
    finished query leaves no cache behind in its thread. Chunks not in the prompt keep theirs for the query's later
    calls (a refine step per chunk)."""
    reg = _REQUEST.get()
    if reg is not None and any(c.kv is not None and c.text in prompt for c in reg.chunks):
        reg.chunks = tuple(c.identity() if c.text in prompt else c for c in reg.chunks)


def current_chunks() -> tuple[RegisteredChunk, ...]:
    """The request chunks registered in the current context (empty when none)."""
    reg = _REQUEST.get()
    return reg.chunks if reg is not None else ()


MIN_FOUND_TOKENS = 12
"""Fewest tokens a chunk found in a prompt by content alone (:data:`recent`, not named by the current context's
registration) needs to be reused there: a passage, not a phrase that other prompts contain as well."""


def passages_found(chunks: Iterable[RegisteredChunk], count_tokens: Callable[[str], int], *,
                   scoped: bool = True) -> tuple[RegisteredChunk, ...]:
    """``chunks`` less those found by content alone that are shorter than :data:`MIN_FOUND_TOKENS`
    (``count_tokens``: the model's token count of a text, for chunks not derived yet). ``scoped=False``: the
    context's registration does not delimit a request (LangChain: a retriever called on its own registers in the
    caller's thread), so its chunks are held to the same length."""
    mine = {c.text for c in current_chunks()} if scoped else set()

    def tokens(c: RegisteredChunk) -> int:
        return len(c.token_ids) if c.token_ids is not None else count_tokens(c.text)

    return tuple(c for c in chunks if c.text in mine or tokens(c) >= MIN_FOUND_TOKENS)


@contextlib.contextmanager
def chunk_scope(chunks: Iterable[ChunkLike] = ()) -> Iterator[None]:
    """Register ``chunks`` for the duration of the block, restoring the previous request chunks afterwards."""
    token = register_chunks(chunks)
    try:
        yield
    finally:
        _REQUEST.reset(token)


def resolve_chunks(
    prompt: str,
    explicit: Iterable[ChunkLike] | None = None,
    *,
    use_context: bool = True,
    use_recent: bool = False,
    only_found: bool = False,
) -> tuple[RegisteredChunk, ...]:
    """The chunks an LLM adapter offers the planner for ``prompt``.

    Explicit chunks (when not None) are used alone. Otherwise the context's request chunks, plus, with
    ``use_recent``, the recently registered chunks that occur verbatim in the prompt. ``only_found`` drops
    context chunks that are not in the prompt: for frameworks whose context does not delimit a request (LangChain,
    where a context registration may be left over from an earlier call in the same thread), so that they do not
    count as registered-but-missing in the hit rate. A prompt holding none of the context's chunks forgets its
    registration: that call is not the registering query's (its texts are then found by content alone).
    """
    if explicit is not None:
        return _normalize(explicit)
    out: list[RegisteredChunk] = []
    reg = _REQUEST.get() if use_context else None
    if reg is not None:
        here = [c for c in reg.chunks if c.text in prompt]
        if not here:
            _REQUEST.set(None)  # not this query's call: forgotten, with its held caches (found by content from now on)
        else:
            out = here if only_found else list(reg.chunks)
    if use_recent:
        out.extend(recent.found_in(prompt))
    return _normalize(out)


def history_segments(messages: Sequence[Mapping[str, object]]) -> list[str]:
    """The earlier turns of a chat as reusable segments: the content of every user and assistant message before
    the last user message (``messages``: ``{"role", "content"}`` dicts).

    Offered to the planner with the request's chunks (:func:`with_history`), each is cached like a chunk
    (content-addressed: computed once, then read from the store), placed at its position in this turn's prompt
    and repaired by the request's method. A chat whose retrieved chunks change every turn then does not prefill
    its whole history again; while the chunks stay the same, the kept conversation
    (:mod:`kvrag.engine.conversation`) already covers the history exactly and these segments change nothing.
    """
    roles = [ROLE_ALIASES.get(str(m["role"]), str(m["role"])) for m in messages]
    last = max((i for i, r in enumerate(roles) if r == "user"), default=0)
    return [c for m, r in zip(messages[:last], roles[:last], strict=False)
            if r in ("user", "assistant") and isinstance(c := m["content"], str) and c.strip()]


def with_history(chunks: Iterable[ChunkLike], messages: Sequence[Mapping[str, object]]) -> tuple[RegisteredChunk, ...]:
    """``chunks`` and the chat's earlier turns (:func:`history_segments`) as the request's reusable segments."""
    return _normalize([*chunks, *history_segments(messages)])


# ------------------------------------------------------------------------------------------------- engine handles
_ENGINES: dict[tuple[str, str | int, tuple[tuple[str, object], ...]], KVRAGEngine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(model: str | None = None, store: str | KVStore = "memory://", **config: Any) -> KVRAGEngine:
    """A process-wide :class:`~kvrag.engine.engine.KVRAGEngine` per (model, store URL, config), loaded once.

    Framework objects are often constructed many times with the same settings (LangChain's standard tests, chains
    rebuilt per request); they share one loaded model and store through this function. A ``KVStore`` instance as
    ``store`` is keyed by identity.
    """
    from kvrag.default_model import DEFAULT_MODEL
    from kvrag.engine.engine import KVRAGEngine

    name = DEFAULT_MODEL if model is None else str(model)
    key = (name, store if isinstance(store, str) else id(store), tuple(sorted(config.items())))
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            eng = KVRAGEngine.from_pretrained(model, store=store, **config)
            _ENGINES[key] = eng
        return eng


def is_shared_engine(engine: object) -> bool:
    """Whether ``engine`` is one :func:`shared_engine` loaded: an adapter holding it may be pickled without it,
    since the process that unpickles the adapter loads the same one by model and store."""
    with _ENGINES_LOCK:
        return any(e is engine for e in _ENGINES.values())


def sharing(memo: dict[int, Any] | None, *held: object) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo under which an adapter's copy shares ``held`` (a loaded engine and its model and
    store, which are never what a copy of a chat model or retriever means; an engine refuses to be copied)."""
    memo = {} if memo is None else memo
    memo.update({id(h): h for h in held if h is not None})
    return memo


def unpicklable_engine(owner: str, instead: str | None = None) -> TypeError:
    """The error for pickling an adapter that holds an engine it was given (weights, a store, open files)."""
    instead = instead or f"a {owner} made without engine= (model= and store= name what the unpickling process loads)"
    return TypeError(f"{owner}(engine=...) holds a loaded KVRAGEngine (model weights, its store), which cannot be "
                     f"pickled; pickle {instead}, or build it in each process")


def ensure_chunks(engine: KVRAGEngine, texts: Sequence[str | RegisteredChunk], *, fetch: bool = False,
                  progress: bool = False, batch_size: int | None = None) -> list[tuple[RegisteredChunk | None, bool]]:
    """Make sure every text has a stored cache (:meth:`KVRAGEngine.ensure` on the engine's serving store); a
    :class:`RegisteredChunk` from :meth:`KVRAGEngine.identify` is not tokenized again.

    One store round trip for all texts; missing caches are prefilled in batches. With ``fetch`` the returned chunks
    hold their caches, so that a request answered in the same scope reads nothing more from the store.

    Returns:
        One ``(chunk, was_cached)`` per text (``chunk`` carries text, key and token ids); whitespace-only texts give
        ``(None, False)`` and are not cached.
    """
    return engine.ensure(texts, fetch=fetch, batch_size=batch_size, progress=progress)


def chunk_texts(chunks: Sequence[RegisteredChunk]) -> list[str]:
    """The texts of registered chunks (what request records show)."""
    return [c.text for c in chunks]


# ------------------------------------------------------------------------------------------------- generation
def generation_config(*, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                      seed: int | None = None, stop: Sequence[str] | None = ()) -> GenerationConfig:
    """Framework sampling fields -> :class:`~kvrag.config.GenerationConfig`; ``temperature`` 0 means greedy.

    ``stop`` may be one string (OpenAI's API and many callers pass ``stop="\\n"``): it is one stop string, not a
    sequence of one-character stop strings.
    """
    temperature = _number("temperature", temperature)
    if not temperature >= 0:
        msg = f"temperature must be >= 0 (0 is greedy), got {temperature}"
        raise ConfigError(msg)
    return GenerationConfig(
        max_new_tokens=_whole_number("max_new_tokens", max_new_tokens),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=_number("top_p", top_p),
        top_k=_whole_number("top_k", top_k),
        seed=None if seed is None else _whole_number("seed", seed),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),  # one str is one stop string
    )


def _number(name: str, value: object) -> float:
    """A framework's number (a float, an int, a numeric string from a config file) as a float; ConfigError naming
    ``name`` for anything else (a bool included)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


def _whole_number(name: str, value: object) -> int:
    """:func:`_number` that must be whole (``6``, ``6.0``, ``"6"``); ConfigError naming ``name`` otherwise."""
    number = _number(name, value)
    if not number.is_integer():
        raise ConfigError(f"{name} must be a whole number, got {value!r}")
    return int(number)


# ------------------------------------------------------------------------------------------------- metadata
def _stats(prep: Prepared) -> JSONObject:
    return prep.stats.to_dict()


def fit_to_window(engine: KVRAGEngine, plan: Plan, gen: GenerationConfig) -> GenerationConfig:
    """``gen`` with ``max_new_tokens`` cut to what the model's positions leave after ``plan``'s prompt, as ``kvrag
    serve`` cuts ``max_tokens`` (the answer then ends with ``finish_reason="length"``); a prompt that leaves no room
    is left to the engine's :class:`~kvrag.errors.ContextLengthError`."""
    room = int(engine.max_positions) - int(plan.positions)
    return dataclasses.replace(gen, max_new_tokens=room) if 1 <= room < gen.max_new_tokens else gen


def response_summary(prep: Prepared) -> JSONObject:
    """The per-response summary every adapter exposes (LlamaIndex ``additional_kwargs``, LangChain
    ``response_metadata["kvrag"]``): method, TTFT, hit rate, chunk counts, reused tokens (those of an earlier
    turn of the conversation too), method stats.

    Args:
        prep: the engine's :class:`~kvrag.engine.engine.Prepared` request (after or while streaming).
    """
    st = prep.stats
    return {
        "method": repr(prep.method),
        "ttft_s": prep.timings.ttft_s,
        "hit_rate": st.hit_rate,
        "chunks_registered": st.chunks_registered,
        "chunks_found": st.chunks_found,
        "chunk_hits": st.chunk_hits,
        "chunk_misses": st.chunk_misses,
        "reused_tokens": st.reused_tokens,
        "conversation_tokens": st.conversation_tokens,
        "method_stats": st.method_stats.to_dict(),
    }


def response_details(prep: Prepared) -> JSONObject:
    """Everything else about a finished request: all timings and stats, the chunk keys and generated ids."""
    return {
        "timings": prep.timings.to_dict(),
        "stats": _stats(prep),
        "chunk_keys": list(prep.chunk_keys),
        "token_ids": list(prep.token_ids),
        "method": repr(prep.method),
    }


def token_usage(prep: Prepared) -> tuple[int, int | None]:
    """(prompt tokens, generated tokens) of a request; generated is None until its stream has ended."""
    generated = prep.stats.generated_tokens
    return int(prep.plan.total_len), None if generated is None else int(generated)


def finish_reason(prep: Prepared, max_new_tokens: int) -> str:
    """OpenAI's ``finish_reason`` of an answered request: ``"stop"`` when EOS or a stop string ended it (also at its
    last allowed token), ``"length"`` when ``max_new_tokens`` did -- the decoder's own record
    (``Stats.finish_reason``); a token count alone cannot tell a stop string completed by the last allowed token
    from a cut-off answer."""
    if prep.stats.finish_reason is not None:
        return prep.stats.finish_reason
    generated = prep.stats.generated_tokens or len(prep.token_ids)
    return "length" if generated >= max_new_tokens else "stop"


__all__ = [
    "CHUNK_KEY_METADATA",
    "MAX_WORKER_THREADS",
    "MIN_FOUND_TOKENS",
    "RecentChunks",
    "RegisteredChunk",
    "aiter_in_thread",
    "chunk_scope",
    "chunk_texts",
    "clear_chunks",
    "current_chunks",
    "ensure_chunks",
    "finish_reason",
    "fit_to_window",
    "generation_config",
    "history_segments",
    "is_shared_engine",
    "passages_found",
    "recent",
    "release_caches",
    "register_chunks",
    "render_chat",
    "reset_chunks",
    "resolve_chunks",
    "texts_not_one_str",
    "to_thread",
    "unpicklable_engine",
    "with_history",
    "response_details",
    "response_summary",
    "shared_engine",
    "sharing",
    "token_usage",
]
