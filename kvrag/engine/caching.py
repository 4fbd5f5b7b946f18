"""Chunk identity and caching: tokenize and key chunks, make sure their caches are stored (ingest).

:class:`ChunkCaching` is the part of :class:`~kvrag.engine.engine.KVRAGEngine` that owns a chunk's identity
(:meth:`~ChunkCaching.identify`, :meth:`~ChunkCaching.chunk_key`, :meth:`~ChunkCaching.key_space`) and the one
path that fills the store (:meth:`~ChunkCaching.ensure`; :meth:`~ChunkCaching.ingest` is ``ensure`` on the raw
store). The answering half lives in :mod:`kvrag.engine.engine`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from kvrag.config import EngineConfig
from kvrag.engine.chunks import RegisteredChunk, texts_not_one_str
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.keys import ChunkKey
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.prompting import chat_preamble

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvrag.engine.lease import Lease
    from kvrag.engine.runner import Runner
    from kvrag.models import LoadedModel
    from kvrag.store.base import KVStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class InFlight:
    """The chunk keys some thread is computing now, so that a concurrent :meth:`ChunkCaching.ensure` of the same
    text waits for that cache instead of computing it again (single flight: a burst of clients registering or
    retrieving the same new passages computes each once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def claim(self, keys: Iterable[str]) -> tuple[list[str], dict[str, threading.Event]]:
        """``(mine, theirs)``: the keys this caller now computes, and for the keys another thread computes, the
        event set when it is done (stored, failed or cancelled alike: the waiter checks the store after)."""
        mine: list[str] = []
        theirs: dict[str, threading.Event] = {}
        with self._lock:
            for k in keys:
                ev = self._events.get(k)
                if ev is None:
                    self._events[k] = threading.Event()
                    mine.append(k)
                else:
                    theirs[k] = ev
        return mine, theirs

    def release(self, keys: Iterable[str]) -> None:
        """The caller's claimed ``keys`` are done: wake whoever waits on them."""
        with self._lock:
            for k in keys:
                ev = self._events.pop(k, None)
                if ev is not None:
                    ev.set()


class ChunkCaching:
    """Chunk identity and the store-filling path of an engine (mixed into ``KVRAGEngine``, which sets the fields)."""

    loaded: LoadedModel
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    store: KVStore
    serving_store: KVStore
    config: EngineConfig
    counters: collections.Counter[str]
    rope: Rope
    spec: KVSpec
    max_context: int
    chunk_prefix_ids: tuple[int, ...]
    _spaces: dict[str, str]
    _lock: threading.RLock
    _counter_lock: threading.Lock
    _computing: InFlight
    runner: Runner
    store_gate: Callable[[int], bool] | None = None
    """Asked before a request's computed misses are stored (their bytes): False keeps them out of the store (the
    request still uses them). ``kvrag serve --max-store-bytes`` sets it; None stores every miss."""

    def __getstate__(self) -> object:
        # at once, not after pickling part of the weights: frameworks try to pickle what they hold (LlamaIndex
        # drops what does not pickle), and a copy of a loaded model and its store is never what was meant
        msg = ("a KVRAGEngine cannot be pickled (model weights, threads, its store): open one in each process "
               "(KVRAGEngine.from_pretrained) on a shared store")
        raise TypeError(msg)

    def store_computed(self, computed: Sequence[tuple[str, ChunkKV]]) -> None:
        """Store a request's computed misses (after its model turn), unless :attr:`store_gate` refuses them."""
        gate = self.store_gate
        if gate is not None and computed and not gate(sum(ch.nbytes for _, ch in computed)):
            self._count(misses_not_stored=len(computed))
            return
        for k, ch in computed:
            self.serving_store.put(k, ch)

    # ----------------------------------------------------------------- identity
    def _chunk_prefix(self) -> tuple[int, ...]:
        if self.config.chunk_prefix == "none":
            return ()
        # chunks are computed after the template's header: :meth:`chunk_key` refuses keys once the template changed
        self._prefix_template = (getattr(self.tokenizer, "chat_template", None),)
        pre = self.template_preamble()
        return tuple(self.tokenize(pre)) if pre else ()

    def _check_template(self) -> None:
        """ConfigError when the tokenizer's chat template changed after this engine computed its chunk prefix (its
        caches would be conditioned on the old template's header, and spliced after the new one)."""
        built = getattr(self, "_prefix_template", None)
        now = getattr(self.tokenizer, "chat_template", None)
        if built is not None and now is not built[0] and now != built[0]:
            msg = ("the tokenizer's chat template changed after this engine was built: its chunk caches are computed "
                   "after the old template's header; set tokenizer.chat_template before building the engine, or "
                   "build a new one now (KVRAGEngine.from_pretrained(loaded, store=...))")
            raise ConfigError(msg)

    def template_preamble(self) -> str:
        """The chat template's fixed text before a user message (system header), see :func:`chat_preamble`."""
        return chat_preamble(self.tokenizer)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` alone, without special tokens being added.

        Raises:
            ConfigError: ``text`` is not a str, or holds code points that are not valid Unicode text (lone
                surrogates, e.g. from ``bytes.decode(errors="surrogateescape")``). Control characters are
                ordinary text and go to the tokenizer as they are.
        """
        if not isinstance(text, str):
            msg = (f"expected text as str, got {type(text).__name__}; decode bytes first, e.g. "
                   "data.decode('utf-8', errors='replace')")
            raise ConfigError(msg)
        try:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        except (TypeError, ValueError, UnicodeError) as e:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as ue:
                msg = (f"text holds a code point that is not valid Unicode ({text[ue.start]!r} at index {ue.start}, "
                       "a lone surrogate); decode the source bytes with errors='replace' instead of "
                       "'surrogateescape'")
                raise ConfigError(msg) from e
            raise

    def entry_for(self, key: str, token_ids: Sequence[int], *found: ChunkKV | None) -> ChunkKV | None:
        """The first of ``found`` (a held cache, the store's entry) that holds ``token_ids`` in a codec this engine's
        keys name; None when none does. An entry under ``key`` with other tokens (copied or written there by
        something else), or rounded by a codec the keys do not name (an ``int8`` entry under an exact key: written by
        a kvrag whose keys did not name the codec, or copied), is never served: it is logged and counted
        (``entries_mismatched``), and the recomputed cache is written over it."""
        for ch in found:
            if ch is None:
                continue
            if not (ch.token_ids.shape[0] == len(token_ids) and ch.token_ids.tolist() == list(token_ids)):
                why = "other tokens than its key names (written under another key?)"
            elif ch.codec not in (None, ch.spec.dtype) and ch.codec not in self.keyed_codecs:
                why = f"{ch.codec}-rounded K/V under a key for {self.key_codec} entries"
            else:
                return ch
            log.warning("store entry %s holds %s: not served; computed again and written over it", key[:16], why)
            self._count(entries_mismatched=1)
        return None

    @functools.cached_property
    def keyed_codecs(self) -> frozenset[str]:
        """The store's codecs other than ``native`` (:meth:`KVStore.keyed_codecs`), read once: the store is fixed."""
        return self.store.keyed_codecs()

    @functools.cached_property
    def key_codec(self) -> str:
        """The keys' storage part: the KV dtype, and :attr:`keyed_codecs` (an ``int8`` store's entries are rounded:
        keyed apart, a reader of exact entries on the same store recomputes instead)."""
        return "+".join([self.spec.dtype, *sorted(self.keyed_codecs)])

    def chunk_key(self, token_ids: Sequence[int], kind: str = "chunk") -> str:
        self._check_template()
        prefix = () if kind == "prefix" else self.chunk_prefix_ids
        return ChunkKey.make(
            token_ids,
            model_fingerprint=self.loaded.fingerprint,
            tokenizer_fingerprint=self.loaded.tokenizer_fingerprint,
            codec=self.key_codec,
            prefix_ids=prefix,
        ).digest

    # ----------------------------------------------------------------- ingest
    def _check_len(self, n: int, what: str) -> None:
        if n + len(self.chunk_prefix_ids) > self.max_context:
            msg = (f"{what} has {n} tokens (+{len(self.chunk_prefix_ids)} conditioning prefix) but the model's context "
                   f"window is {self.max_context}; split it into smaller chunks")
            raise ContextLengthError(msg)

    def _count(self, **kw: int) -> None:
        with self._counter_lock:
            self.counters.update(kw)

    def compute(self, token_ids: Sequence[int], kind: str = "chunk") -> ChunkKV:
        """Compute a chunk's canonical cache (no store access)."""
        prefix = () if kind == "prefix" else self.chunk_prefix_ids
        out = self._model_work(lambda: compute_chunk_kv(self.model, self.rope, self.spec, token_ids, prefix))
        self._count(chunks_computed=1)
        return out

    def _model_work(self, fn: Callable[[], T]) -> T:
        """``fn()``, model work outside a request (caching chunks: ingest, a registration, a retriever's misses),
        in a turn of the runner's like a request's prepare: on the runner's threads (``EngineConfig.runner_threads``:
        ``kvrag serve`` gives the runner the cores and a request's thread one), in pieces between running requests'
        decode steps (:func:`kvrag.kv.pieces.call_pieces`: the same computation as one call), so that a long text
        does not stall running streams for its whole forward, and stopping at the next checkpoint when its caller's
        :class:`~kvrag.engine.cancel.CancelToken` is cancelled. Called inside a prepare (holding the model) it runs
        here."""
        if hf_cache.held_here(self._lock):
            with self._lock:
                return fn()
        from kvrag.kv.pieces import Pace, call_pieces

        runner = self.runner
        pace = Pace(runner.piece_budget_s, self.model.device, runner.scheduler.preparing_cancelled)
        leases = []

        def job(lease: Lease) -> Generator[None, None, T]:
            leases.append(lease)  # one position: the turn is what this work needs, not KV
            return call_pieces(fn, pace)

        try:
            return runner.prepare(0, job)
        finally:
            for lease in leases:
                lease.release()

    def _chunk_ids(self, text: str) -> list[int]:
        """Token ids of a chunk, or [] for an empty / whitespace-only one (never cached)."""
        if isinstance(text, str) and not text.strip():
            return []
        return self.tokenize(text)  # a non-str gets its clear ConfigError there

    def key_space(self, kind: str = "chunk") -> str:
        """What every key of ``kind`` mixes in besides the token ids (model, tokenizer, codec, conditioning).

        A :class:`RegisteredChunk` whose ``space`` equals it was derived by an engine that computes the same keys.
        """
        return self._spaces["prefix" if kind == "prefix" else "chunk"]

    def chunk_ref(self, token_ids: Sequence[int], kind: str = "chunk", text: str = "") -> RegisteredChunk:
        """The identity of a chunk given by its token ids (e.g. a planned segment), keyed in this engine's space."""
        self._check_len(len(token_ids), "chunk")
        ids = tuple(int(t) for t in token_ids)
        return RegisteredChunk(text, self.chunk_key(ids, kind), ids, self.key_space(kind))

    def identify(self, chunks: Iterable[str | RegisteredChunk], kind: str = "chunk") -> list[RegisteredChunk | None]:
        """Token ids and cache key of every chunk, without touching the store; None for empty / whitespace-only text.

        A :class:`RegisteredChunk` derived in this engine's :meth:`key_space` is used as it is (not re-tokenized,
        not re-hashed); any other is derived again from its text (and a cache it holds is dropped: it may be another
        model's).

        Raises:
            ConfigError: a chunk is neither a str nor a RegisteredChunk, or holds text that is not valid Unicode;
                ``chunks`` is one str (a sequence of its characters) rather than a list of texts.
            ContextLengthError: a chunk does not fit the context window (all are checked before any is returned).
        """
        texts_not_one_str(chunks, "chunks")
        space = self.key_space(kind)
        out: list[RegisteredChunk | None] = []
        for i, c in enumerate(chunks):
            if isinstance(c, RegisteredChunk):
                if c.derived_by(space):
                    out.append(c)
                    continue
                text = c.text
            else:
                text = c
            ids = self._chunk_ids(text)
            if not ids:
                out.append(None)
                continue
            self._check_len(len(ids), f"chunk #{i}")
            out.append(RegisteredChunk(text, self.chunk_key(ids, kind), tuple(ids), space))
        return out

    def ensure(self, chunks: Iterable[str | RegisteredChunk], *, kind: str = "chunk", fetch: bool = False,
               store: KVStore | None = None, batch_size: int | None = None,
               progress: bool = False) -> list[tuple[RegisteredChunk | None, bool]]:
        """Make sure every chunk's cache is stored -- the one path ingest, index builders and adapters go through.

        The store is asked once for all chunks (``contains_many``; ``get_many`` with ``fetch``); the missing caches
        are prefilled ``batch_size`` chunks per forward (:func:`kvrag.engine.ingest_prefill.compute_chunk_kvs`, the same K/V
        and keys as one at a time) and each batch is stored as soon as it is computed.

        Args:
            chunks: texts exactly as prompts will contain them, or :class:`RegisteredChunk` objects.
            kind: ``"chunk"`` (conditioned on the chunk prefix) or ``"prefix"`` (a prompt's leading text).
            fetch: also return each chunk's cache (``RegisteredChunk.kv``), read in the same round trip, so that
                answering the request needs no further store access. Held caches are read-only (an in-memory
                store hands out its own tensors, see ``KVStore.get_many(shared=True)``).
            store: where to look and put (default: the serving store, which degrades with
                ``on_store_error="recompute"``; :meth:`ingest` passes the raw store so failures raise).
            batch_size: chunks per forward (default :data:`kvrag.engine.ingest_prefill.DEFAULT_BATCH_SIZE`; 1: exactly
                :meth:`compute` per chunk).
            progress: show a progress bar while computing.

        Returns:
            One ``(chunk, was_cached)`` per input; ``(None, False)`` for empty / whitespace-only texts (never
            cached). A text repeated in ``chunks`` is computed once and counts as cached after its first occurrence;
            a text another thread is computing at the same time is waited for and counts as cached (each cache is
            computed once however many callers ask for it).

        Raises:
            ContextLengthError: a chunk does not fit the context window (checked first: nothing is computed).
            ConfigError: ``batch_size`` < 1, or a chunk that is not text.
            StoreError: the store failed and ``store`` does not degrade.
        """
        from kvrag.engine.ingest_prefill import DEFAULT_BATCH_SIZE

        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            msg = f"batch_size must be an int >= 1, got {batch_size!r}; use 1 to prefill one chunk at a time"
            raise ConfigError(msg)
        refs = self.identify(chunks, kind)
        store = self.serving_store if store is None else store
        first: dict[str, RegisteredChunk] = {}
        for r in refs:
            if r is not None:
                first.setdefault(r.key, r)  # type: ignore[arg-type]
        held = {k: r.kv for k, r in first.items() if fetch and r.kv is not None}
        ask = [k for k in first if k not in held]
        if fetch:
            got = {k: v for k, v in zip(ask, store.get_many(ask, shared=True), strict=True) if v is not None}
            have = set(got) | set(held)
        else:
            got = {}
            have = {k for k, ok in zip(ask, store.contains_many(ask), strict=True) if ok}
        missing = [k for k in first if k not in have]
        mine: list[str]
        theirs: dict[str, threading.Event]
        if hf_cache.held_here(self._lock):  # inside a prepare: never wait on a caller it blocks
            mine, theirs = [], {}
            todo = [(k, first[k].token_ids or ()) for k in missing]
        else:
            mine, theirs = self._computing.claim(missing)
            todo = [(k, first[k].token_ids or ()) for k in mine]
        try:
            computed = self.store_batched(todo, store, bs, progress=progress, kind=kind, keep=fetch)
        finally:
            self._computing.release(mine)
        if theirs:  # computed by another thread meanwhile: read once it is done, computed here only if it failed
            for ev in theirs.values():
                ev.wait()
            waited = list(theirs)
            if fetch:
                got.update((k, v) for k, v in zip(waited, store.get_many(waited, shared=True), strict=True)
                           if v is not None)
                found = [k for k in waited if k in got]
            else:
                found = [k for k, ok in zip(waited, store.contains_many(waited), strict=True) if ok]
            have.update(found)
            again = [(k, first[k].token_ids or ()) for k in waited if k not in have]
            computed.update(self.store_batched(again, store, bs, progress=progress, kind=kind, keep=fetch))
        out: list[tuple[RegisteredChunk | None, bool]] = []
        seen: set[str] = set()
        for r in refs:
            if r is None:
                out.append((None, False))
                continue
            k = str(r.key)
            cached = k in have or k in seen
            seen.add(k)
            if fetch:
                kv = held.get(k, got.get(k, computed.get(k)))
                r = r if r.kv is kv else dataclasses.replace(r, kv=kv)
            out.append((r, cached))
        self._count(chunks_reused=sum(c for _, c in out))
        return out

    def ingest(self, texts: Sequence[str], progress: bool = False, batch_size: int | None = None) -> list[str]:
        """Compute and store caches for ``texts``, skipping those already stored (so an interrupted ingest resumes).

        :meth:`ensure` on the engine's own store (a store failure raises :class:`~kvrag.errors.StoreError`, also
        with ``on_store_error="recompute"``). Empty and whitespace-only texts are skipped with a warning.

        Returns:
            The keys of the non-empty texts, in order.

        Raises:
            StoreError: the store failed (disk full, Redis down).
            ContextLengthError: a chunk does not fit the context window (checked first: nothing is ingested).
            ConfigError: ``batch_size`` < 1.
        """
        keys = []
        for i, (r, _) in enumerate(self.ensure(texts, store=self.store, batch_size=batch_size, progress=progress)):
            if r is None:
                log.warning("skipping empty or whitespace-only chunk #%d", i)
            else:
                keys.append(str(r.key))
        return keys

    def store_batched(self, items: Sequence[tuple[str, Sequence[int]]], store: KVStore | None = None,
                      batch_size: int | None = None, progress: bool = False, *, kind: str = "chunk",
                      keep: bool = False) -> dict[str, ChunkKV]:
        """Compute the caches of ``(key, token_ids)`` items, ``batch_size`` per forward, and put each batch into
        ``store`` (default: the engine's store) as soon as it is computed. Keys must be :meth:`chunk_key` of the ids.

        Returns:
            The computed caches by key when ``keep`` (else empty: a long ingest holds no caches).
        """
        from tqdm.auto import tqdm

        from kvrag.engine.ingest_prefill import DEFAULT_BATCH_SIZE, compute_chunk_kvs, prefill_prefix

        store = self.store if store is None else store
        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        kept: dict[str, ChunkKV] = {}
        if not items:
            return kept
        bar = tqdm(total=len(items), desc="caching chunks", unit="chunk", disable=not progress)
        try:
            if bs == 1 or kind == "prefix":  # one per forward: exactly the single-chunk path (prefix + chunk together)
                for k, ids in items:
                    ch = self.compute(ids, kind)
                    store.put(k, ch)
                    if keep:
                        kept[k] = ch
                    bar.update(1)
                return kept
            with self._lock:
                prefix_kv = prefill_prefix(self.model, self.chunk_prefix_ids)  # shared by every batch
            order = sorted(range(len(items)), key=lambda i: -len(items[i][1]))  # similar lengths pad little
            for start in range(0, len(order), bs):
                part = [items[i] for i in order[start : start + bs]]
                # per batch (and in pieces while requests decode): answering threads interleave with a long ingest
                chunks = self._model_work(functools.partial(
                    compute_chunk_kvs, self.model, self.rope, self.spec, [ids for _, ids in part],
                    self.chunk_prefix_ids, bs, prefix_kv=prefix_kv))
                done = [(k, ch) for (k, _), ch in zip(part, chunks, strict=True)]
                store.put_many(done)
                if keep:
                    kept.update(done)
                self._count(chunks_computed=len(part))
                bar.update(len(part))
        finally:
            bar.close()
        return kept


__all__ = ["ChunkCaching"]
