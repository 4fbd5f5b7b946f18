"""KVRAGEngine: the facade that ingests chunks and answers prompts with reused, repaired KV."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.assemble import assemble, context_only_input
from kvrag.engine.generate import decode
from kvrag.engine.planner import Plan, PlannedSegment, TextPiece, plan_pieces, plan_prompt
from kvrag.engine.results import Prepared, Response, Stats, Timings
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import FusionMethod, get_method
from kvrag.kv import hf_cache
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.keys import ChunkKey
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec, text_config
from kvrag.kv.window import context_limit
from kvrag.prompting import chat_preamble, render_chat

log = logging.getLogger(__name__)


class KVRAGEngine:
    """Ingest chunk caches once; answer prompts by splicing them in and repairing the cross-chunk attention.

    Thread safety: one engine may serve many threads and asyncio tasks at once. Model forwards are serialized by
    an engine lock, which is held per step and never while a :meth:`stream` consumer runs between tokens, so a slow
    or abandoned stream does not block other requests. Each request has its own KV cache (no cross-talk).

    Store failures: with ``config.on_store_error="recompute"`` (default) the answering path reads and writes the
    store through a :class:`~kvrag.store.fallback.FallbackStore`: if the store fails, a warning is logged once,
    the needed caches are computed on demand, and the store is used again when it works. :meth:`ingest` always
    raises :class:`~kvrag.errors.StoreError`.

    Args:
        loaded: a :class:`kvrag.models.LoadedModel` (model, tokenizer, fingerprints).
        store: a :class:`kvrag.store.KVStore` holding canonical chunk caches.
        config: engine settings.

    Attributes:
        counters: ``chunks_computed`` / ``chunks_reused`` since creation (every path: ingest, ensure, answers).
    """

    def __init__(self, loaded: Any, store: Any, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store
        self.config = config or EngineConfig()
        from kvrag.store.fallback import with_fallback

        # The answering path's view of the store: degrades instead of failing when on_store_error="recompute".
        self.serving_store = with_fallback(store, self.config.on_store_error, retry_s=self.config.store_retry_s)
        self.counters: collections.Counter[str] = collections.Counter()
        self._counter_lock = threading.Lock()
        self.rope = Rope.from_model(self.model)
        text_cfg = text_config(self.model.config)
        mdtype = next(self.model.parameters()).dtype
        self.spec = KVSpec.from_model_config(self.model.config, dtype=self.config.store_dtype or mdtype,
                                             model_fingerprint=loaded.fingerprint)
        limit = int(self.config.max_context or getattr(text_cfg, "max_position_embeddings", None) or 2048)
        self.max_context = context_limit(self.model, limit)  # capped by a sliding/chunked attention window
        self.chunk_prefix_ids: tuple[int, ...] = self._chunk_prefix()
        self._lock = hf_cache.model_lock(self.model)  # shared by every engine on this model (forwards, probe)
        self._methods_lock = threading.Lock()
        self.default_method = get_method(self.config.method)
        self._methods: dict[str, FusionMethod] = {repr(self.default_method): self.default_method}

    @classmethod
    def from_pretrained(
        cls, model: Any = None, store: Any = "memory://", *, device: str | None = None, dtype: Any = None,
        **config: Any,
    ) -> KVRAGEngine:
        """Load a model (HF id or path; None: the embedded default; or an already loaded ``LoadedModel``) and open
        a store (URL or KVStore).

        With ``on_store_error="recompute"`` (default) a Redis URL whose server is down at start is accepted: a
        warning is logged and the store is used once the server is up.
        """
        from kvrag.models import LoadedModel, load_model
        from kvrag.store.fallback import FallbackStore, open_store

        cfg = EngineConfig(**config)
        start_error = None
        if isinstance(store, str):
            st, start_error = open_store(store, cfg.on_store_error)
        else:
            st = store
        loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, dtype=dtype)
        eng = cls(loaded, st, cfg)
        if start_error is not None and isinstance(eng.serving_store, FallbackStore):
            eng.serving_store.mark_down("connect", start_error)
        return eng

    # ----------------------------------------------------------------- identity
    def _chunk_prefix(self) -> tuple[int, ...]:
        if self.config.chunk_prefix == "none":
            return ()
        pre = self.template_preamble()
        return tuple(self.tokenize(pre)) if pre else ()

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

    def chunk_key(self, token_ids: Sequence[int], kind: str = "chunk") -> str:
        prefix = () if kind == "prefix" else self.chunk_prefix_ids
        return ChunkKey.make(
            token_ids,
            model_fingerprint=self.loaded.fingerprint,
            tokenizer_fingerprint=self.loaded.tokenizer_fingerprint,
            codec=self.spec.dtype,
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
        with self._lock:
            out = compute_chunk_kv(self.model, self.rope, self.spec, token_ids, prefix)
        self._count(chunks_computed=1)
        return out

    def _chunk_ids(self, text: str) -> list[int]:
        """Token ids of a chunk, or [] for an empty / whitespace-only one (never cached)."""
        return self.tokenize(text) if text.strip() else []

    def ensure(self, text: str, kind: str = "chunk") -> tuple[str, ChunkKV | None, bool]:
        """Make sure ``text``'s cache is stored. Returns (key, chunk if it was computed or fetched, hit).

        Raises:
            ConfigError: ``text`` is empty or whitespace-only.
            ContextLengthError: the chunk does not fit the context window.
        """
        ids = self._chunk_ids(text)
        if not ids:
            msg = f"cannot cache an empty or whitespace-only chunk (got {text!r}); drop empty chunks before caching"
            raise ConfigError(msg)
        self._check_len(len(ids), "chunk")
        key = self.chunk_key(ids, kind)
        got = self.serving_store.get(key)
        if got is not None:
            self._count(chunks_reused=1)
            return key, got, True
        ch = self.compute(ids, kind)
        self.serving_store.put(key, ch)
        return key, ch, False

    def ensure_ids(self, token_ids: Sequence[int], kind: str = "chunk") -> tuple[str, bool]:
        """Store the cache of ``token_ids`` unless it is stored already (not read back). Returns (key, was_cached).

        Goes through the serving store: with ``on_store_error="recompute"`` a failing store is skipped.
        """
        self._check_len(len(token_ids), "chunk")
        key = self.chunk_key(token_ids, kind)
        if self.serving_store.contains(key):
            self._count(chunks_reused=1)
            return key, True
        self.serving_store.put(key, self.compute(token_ids, kind))
        return key, False

    def ingest(self, texts: Sequence[str], progress: bool = False, batch_size: int | None = None) -> list[str]:
        """Compute and store caches for ``texts``, skipping those already stored (so an interrupted ingest resumes).

        Empty and whitespace-only texts are skipped with a warning. Missing caches are prefilled ``batch_size``
        chunks per forward (:func:`kvrag.engine.batch.compute_chunk_kvs`; the same K/V and keys as one at a time)
        and each batch is stored as soon as it is computed. Returns the keys of the non-empty texts.

        Args:
            texts: chunk texts, exactly as prompts will contain them.
            progress: show a progress bar.
            batch_size: chunks per forward (default :data:`kvrag.engine.batch.DEFAULT_BATCH_SIZE`; 1: one at a time,
                exactly :meth:`compute` per chunk).

        Raises:
            StoreError: the store failed (disk full, Redis down) -- also with ``on_store_error="recompute"``.
            ContextLengthError: a chunk does not fit the context window (checked first: nothing is ingested).
            ConfigError: ``batch_size`` < 1.
        """
        keys, _ = self._ensure_texts(texts, self.store, batch_size, progress, warn_empty=True)
        return [k for k in keys if k is not None]

    def ensure_many(self, texts: Sequence[str], batch_size: int | None = None,
                    progress: bool = False) -> list[tuple[str | None, bool]]:
        """Batched :meth:`ensure_ids` for many texts through the serving store (index builders use it).

        Returns:
            One ``(key, was_cached)`` per text; empty / whitespace-only texts give ``(None, False)`` (not cached).
            With ``on_store_error="recompute"`` a failing store is skipped, as in :meth:`ensure_ids`.
        """
        keys, cached = self._ensure_texts(texts, self.serving_store, batch_size, progress, warn_empty=False)
        return list(zip(keys, cached, strict=True))

    def _ensure_texts(self, texts: Sequence[str], store: Any, batch_size: int | None, progress: bool,
                      warn_empty: bool) -> tuple[list[str | None], list[bool]]:
        """Tokenize and key every text, then compute the caches ``store`` lacks in batches and store them."""
        from kvrag.engine.batch import DEFAULT_BATCH_SIZE

        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if not isinstance(bs, int) or bs < 1:
            msg = f"batch_size must be an int >= 1, got {batch_size!r}; use 1 to prefill one chunk at a time"
            raise ConfigError(msg)
        keys: list[str | None] = []
        ids_of: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            ids = self._chunk_ids(t)
            if not ids:
                if warn_empty:
                    log.warning("skipping empty or whitespace-only chunk #%d", i)
                keys.append(None)
                continue
            self._check_len(len(ids), f"chunk #{i}")
            key = self.chunk_key(ids)
            ids_of.setdefault(key, ids)
            keys.append(key)
        todo = {k: ids for k, ids in ids_of.items() if not store.contains(k)}  # resume: skip stored chunks
        seen: set[str] = set()
        cached = []
        for k in keys:  # a repeated text is computed once and counts as reused after its first occurrence
            cached.append(k is not None and (k not in todo or k in seen))
            if k is not None:
                seen.add(k)
        self._count(chunks_reused=sum(cached))
        self.store_batched(list(todo.items()), store, bs, progress=progress)
        return keys, cached

    def store_batched(self, items: Sequence[tuple[str, Sequence[int]]], store: Any = None,
                      batch_size: int | None = None, progress: bool = False) -> None:
        """Compute the caches of ``(key, token_ids)`` items, ``batch_size`` per forward, and put each batch into
        ``store`` (default: the engine's store) as soon as it is computed. Keys must be :meth:`chunk_key` of the ids.
        """
        from tqdm.auto import tqdm

        from kvrag.engine.batch import DEFAULT_BATCH_SIZE, compute_chunk_kvs, prefill_prefix

        store = self.store if store is None else store
        bs = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
        if not items:
            return
        bar = tqdm(total=len(items), desc="caching chunks", unit="chunk", disable=not progress)
        try:
            if bs == 1:  # one chunk per forward: exactly the single-chunk path (prefix + chunk prefilled together)
                for k, ids in items:
                    store.put(k, self.compute(ids))
                    bar.update(1)
                return
            with self._lock:
                prefix_kv = prefill_prefix(self.model, self.chunk_prefix_ids)  # shared by every batch
            order = sorted(range(len(items)), key=lambda i: -len(items[i][1]))  # similar lengths pad little
            for start in range(0, len(order), bs):
                part = [items[i] for i in order[start : start + bs]]
                with self._lock:  # per batch, so answering threads interleave with a long ingest
                    chunks = compute_chunk_kvs(self.model, self.rope, self.spec, [ids for _, ids in part],
                                               self.chunk_prefix_ids, bs, prefix_kv=prefix_kv)
                store.put_many([(k, ch) for (k, _), ch in zip(part, chunks, strict=True)])
                self._count(chunks_computed=len(part))
                bar.update(len(part))
        finally:
            bar.close()

    # ----------------------------------------------------------------- query
    def plan(self, prompt: str, chunks: Sequence[str]) -> Plan:
        """Split a rendered prompt around the registered chunk texts (exact substring search)."""
        return plan_prompt(prompt, chunks, self.tokenize, decode=self._decode, strict=self.config.strict_tokenization)

    def plan_parts(self, prefix: str, chunks: Sequence[str], suffix: str, separator: str = "") -> Plan:
        """Plan from explicit parts (no search): prefix, chunks in order (joined by ``separator``), suffix."""
        pieces = [TextPiece("prefix", prefix)]
        for i, c in enumerate(chunks):
            if i and separator:
                pieces.append(TextPiece("text", separator))
            pieces.append(TextPiece("chunk", c))
        pieces.append(TextPiece("suffix", suffix))
        whole = self.tokenize("".join(p.text for p in pieces))
        return plan_pieces(pieces, self.tokenize, registered=len(chunks), whole=whole, decode=self._decode,
                           strict=self.config.strict_tokenization)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _fetch(self, segs: Sequence[PlannedSegment], timings: Timings) -> tuple[list, dict[str, int], list[str]]:
        t = time.perf_counter()
        keys = [self.chunk_key(s.token_ids, s.kind) for s in segs]
        got = self.serving_store.get_many(keys)
        timings.fetch_s = time.perf_counter() - t
        t = time.perf_counter()
        counts = {"chunk_hits": 0, "chunk_misses": 0, "other_hits": 0, "other_misses": 0, "reused_tokens": 0}
        pieces = []
        for s, k, ch in zip(segs, keys, got, strict=True):
            tag = "chunk" if s.kind == "chunk" else "other"
            if ch is None:
                counts[f"{tag}_misses"] += 1
                ch = self.compute(s.token_ids, s.kind)
                self.serving_store.put(k, ch)
            else:
                counts[f"{tag}_hits"] += 1
                counts["reused_tokens"] += len(s.token_ids)
                self._count(chunks_reused=1)
            pieces.append((s.kind, ch, k))
        timings.compute_misses_s = time.perf_counter() - t
        return pieces, counts, keys

    def method(self, method: str | FusionMethod | None = None, **params: Any) -> FusionMethod:
        """The fusion method for a spec or instance (None: the configured default), one instance per canonical spec.

        Method instances carry state (a CacheRepair checkpoint resolved, hashed and loaded once per device), so
        every caller -- ``answer(method="...")``, the LlamaIndex and LangChain adapters, the benchmark -- gets the
        engine's instance for the same canonical spec (``repr``) instead of building a new one per request.
        """
        if method is None and not params:
            return self.default_method
        built = method if isinstance(method, FusionMethod) and not params else get_method(
            method if method is not None else self.config.method, **params)
        with self._methods_lock:
            return self._methods.setdefault(repr(built), built)

    @torch.inference_mode()
    def prepare(self, plan: Plan, method: str | FusionMethod | None = None, *, reserve: int = 64) -> Prepared:
        """Fetch, assemble, repair and prefill the suffix for ``plan``; returns the state to decode from.

        ``reserve``: decode positions to allocate in the request's KV buffer up front (it grows if needed).
        """
        m = self.method(method)
        if plan.total_len >= self.max_context:
            msg = (f"the prompt has {plan.total_len} tokens ({plan.context_len} context + {len(plan.suffix.token_ids)} "
                   f"suffix) but the model's context window is {self.max_context}; retrieve fewer or shorter chunks")
            raise ContextLengthError(msg)
        with self._lock:
            t0 = time.perf_counter()
            timings = Timings()
            keys: list[str] | list[None]
            if m.reads_cache:
                pieces, counts, keys = self._fetch(plan.context, timings)
                t = time.perf_counter()
                inp = assemble(self.model, self.rope, self.spec, pieces, plan.suffix.token_ids, reserve=reserve,
                               chunk_prefix_ids=self.chunk_prefix_ids)
                timings.assemble_s = time.perf_counter() - t
            else:  # e.g. full prefill: the stale KV is never read, so it is neither fetched nor assembled
                counts = dict.fromkeys(("chunk_hits", "chunk_misses", "other_hits", "other_misses", "reused_tokens"), 0)
                keys = [None] * len(plan.context)
                inp = context_only_input(self.model, self.rope, self.spec, plan.context, plan.suffix.token_ids,
                                         reserve=reserve)
            t = time.perf_counter()
            out = m.fuse(inp)
            timings.repair_s = time.perf_counter() - t
            t = time.perf_counter()
            if out.last_logits is None:
                logits, cache = hf_cache.forward(self.model, inp.suffix_ids, out.cache, start=inp.context_len)
                last = logits[-1]
            else:
                cache, last = out.cache, out.last_logits
            timings.suffix_prefill_s = time.perf_counter() - t
        found = plan.found
        stats = Stats(
            context_tokens=plan.context_len,
            suffix_tokens=len(plan.suffix.token_ids),
            chunk_tokens=plan.chunk_tokens,
            chunks_registered=plan.registered,
            chunks_found=found,
            inexact_chunks=plan.inexact_chunks,
            chunk_hits=counts["chunk_hits"],
            chunk_misses=counts["chunk_misses"],
            other_hits=counts["other_hits"],
            other_misses=counts["other_misses"],
            reused_tokens=0 if m.name == "full" else counts["reused_tokens"],
            hit_rate=(counts["chunk_hits"] / plan.registered) if plan.registered else 0.0,
            method_stats=out.stats,
        )
        chunk_keys = [k for s, k in zip(plan.context, keys, strict=True) if s.kind == "chunk" and k]
        return Prepared(plan, m, cache, last, timings, stats, chunk_keys, t0)

    def stream(self, prepared: Prepared, gen: GenerationConfig | None = None) -> Iterator[str]:
        """Decode from a prepared request, yielding text deltas; fills ``prepared.timings`` as it goes.

        The engine lock is taken for each decode step and released before a delta is yielded, so other requests
        proceed while the consumer handles it (or never resumes the generator). Each step may run in a different
        thread.
        """
        gen = gen or GenerationConfig()
        eos = self._eos_ids()
        timings = prepared.timings
        tokens = prepared.token_ids

        def first() -> None:
            timings.ttft_s = time.perf_counter() - prepared.t0

        t = time.perf_counter()
        steps = decode(self.model, self.tokenizer, prepared.cache, prepared.last_logits, gen, eos, first)
        try:
            while True:
                with self._lock:  # per step, NOT across the yield below
                    try:
                        tok, delta = next(steps)
                    except StopIteration:
                        break
                if tok >= 0:
                    tokens.append(tok)
                if delta:
                    yield delta
        finally:
            close = getattr(steps, "close", None)  # a generator: release its frame if the consumer stopped early
            if close is not None:
                close()
        if timings.ttft_s is None:
            timings.ttft_s = time.perf_counter() - prepared.t0
        timings.decode_s = time.perf_counter() - t
        timings.total_s = time.perf_counter() - prepared.t0
        prepared.stats.generated_tokens = len(tokens)

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(x) for x in src)
        return sorted(ids)

    def answer_plan(self, plan: Plan, method: str | FusionMethod | None = None, gen: GenerationConfig | None = None) -> Response:
        prep = self.prepare(plan, method, reserve=(gen or GenerationConfig()).max_new_tokens)
        text = "".join(self.stream(prep, gen))
        return Response(text, list(prep.token_ids), repr(prep.method), prep.timings, prep.stats, prep.chunk_keys)

    def answer(self, prompt: str, chunks: Sequence[str] = (), method: str | FusionMethod | None = None,
               gen: GenerationConfig | None = None, **gen_kwargs: Any) -> Response:
        """Answer a fully rendered prompt; ``chunks`` are the registered chunk texts to find and reuse."""
        if gen is None:
            gen = GenerationConfig(**gen_kwargs)
        return self.answer_plan(self.plan(prompt, chunks), method, gen)

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """Render one user turn with the tokenizer's chat template (plus the generation prompt)."""
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return render_chat(self.tokenizer, msgs)
