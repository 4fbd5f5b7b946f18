"""KVRAGEngine: the facade that ingests chunks and answers prompts with reused, repaired KV."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from kvrag.config import EngineConfig, GenerationConfig
from kvrag.engine.admission import default_kv_bytes
from kvrag.engine.assemble import assemble, context_only_input
from kvrag.engine.caching import ChunkCaching, InFlight
from kvrag.engine.chunks import RegisteredChunk, texts_not_one_str
from kvrag.engine.conversation import ConversationCache, keep_answered, prepare_hit
from kvrag.engine.lease import KVBudget, Lease
from kvrag.engine.planner import Plan, TextPiece, plan_pieces, plan_prompt
from kvrag.engine.relocate import moved_plan
from kvrag.engine.results import Prepared, Response, Stats, Timings
from kvrag.engine.runner import Runner, current_token
from kvrag.engine.speculate import SpeculationConfig
from kvrag.errors import ConfigError, ContextLengthError
from kvrag.fusion import FusionMethod, Observation, shared_method
from kvrag.kv import batched, hf_cache
from kvrag.kv.attention import IMPL
from kvrag.kv.chunk import ChunkKV
from kvrag.kv.pieces import Pace, PrepareJob, SuffixPrefill, forward_pieces
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec, text_config
from kvrag.kv.window import context_limit
from kvrag.prompting import render_chat

if TYPE_CHECKING:
    import os

    import torch

    from kvrag.models import LoadedModel
    from kvrag.store.base import KVStore

log = logging.getLogger(__name__)


class KVRAGEngine(ChunkCaching):
    """Ingest chunk caches once; answer prompts by splicing them in and repairing the cross-chunk attention.

    Thread safety and batching: one engine may serve many threads and asyncio tasks at once. Its runner thread
    (:attr:`runner`, :mod:`kvrag.engine.runner`) executes the plans of a pure scheduler
    (:mod:`kvrag.engine.scheduler`): :meth:`prepare` puts a request in line, sized once (prompt + ``reserve``
    new tokens) against ``config.kv_memory_bytes`` and admitted in arrival order (or refused with
    :class:`~kvrag.errors.EngineBusyError` after ``config.admission_timeout_s``); prepares take turns with the
    decode steps (at most one between two steps); every :meth:`stream` joins the running batch, where one forward
    per step gives every decoding request its next token (at most ``config.max_batch_size`` at once). No lock is
    held while a consumer handles a token, so a slow or abandoned stream does not block other requests; a stream
    that is closed or garbage-collected, or whose :class:`~kvrag.engine.runner.CancelToken` is cancelled, leaves
    the batch before the next step and gives its memory back. Each request has its own KV buffer (no cross-talk).
    :meth:`close` drains (or cancels) and joins the runner.

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
        runner: the request runner (:class:`~kvrag.engine.runner.Runner`; ``runner.stats()``); ``batcher`` is
            the same object under its earlier name.
    """

    def __init__(self, loaded: LoadedModel, store: KVStore, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.store = store
        self.config = config or EngineConfig()
        from kvrag.store.fallback import with_fallback

        # The answering path's view of the store: degrades instead of failing when on_store_error="recompute".
        self.serving_store = with_fallback(store, self.config.on_store_error, retry_s=self.config.store_retry_s)
        self.counters: collections.Counter[str] = collections.Counter()
        self._counter_lock, self._computing = threading.Lock(), InFlight()
        self.rope = Rope.from_model(self.model)
        text_cfg = text_config(self.model.config)
        mdtype = next(self.model.parameters()).dtype
        self.spec = KVSpec.from_model_config(self.model.config, dtype=self.config.store_dtype or mdtype,
                                             model_fingerprint=loaded.fingerprint)
        limit = int(self.config.max_context or getattr(text_cfg, "max_position_embeddings", None) or 2048)
        self.max_context = context_limit(self.model, limit)  # capped by a sliding/chunked attention window
        self.max_positions = limit  # prompt + generated tokens (decoding may run past an attention window)
        self.chunk_prefix_ids: tuple[int, ...] = self._chunk_prefix()
        self._spaces = {kind: self.chunk_key((), kind) for kind in ("chunk", "prefix")}
        self._lock = hf_cache.model_lock(self.model)  # shared by every engine on this model (forwards, probe)
        self.default_method = shared_method(self.config.method)
        kv_dtype = batched.decode_kv_dtype(self.model, self.config.kv_dtype, batched.batchable(self.model, IMPL),
                                           self.spec.head_dim)
        spec = self.spec  # what a request decodes over:
        per_token = hf_cache.KVBuffer.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype)
        kv_bytes = self.config.kv_memory_bytes or default_kv_bytes(per_token, int(self.max_context),
                                                                   self.config.max_batch_size, self.model.device)
        self.runner = Runner(self.model, self.tokenizer, KVBudget(kv_bytes, per_token, kv_dtype),
                             max_batch_size=self.config.max_batch_size,
                             admission_timeout_s=self.config.admission_timeout_s,
                             pack_suffixes=self.config.pack_suffixes, threads=self.config.runner_threads,
                             speculation=SpeculationConfig(max_draft=self.config.speculative_tokens,
                                                           max_ngram=self.config.speculative_ngram,
                                                           max_batch=self.config.speculative_max_batch,
                                                           min_ngram=min(self.config.speculative_min_ngram,
                                                                         self.config.speculative_ngram)))
        self.batcher = self.runner  # the earlier name
        conv = 0 if kv_dtype not in (None, self.model.dtype) else self.config.conversation_cache_bytes  # see config
        self.conversations = ConversationCache(lambda: self.runner.budget, kv_bytes // 4 if conv is None else conv,
                                               self.config.conversation_cache_entries)

    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike[str] | LoadedModel | None = None, store: str | KVStore = "memory://", *,
        device: str | None = None, dtype: torch.dtype | str | None = None,
        quantize: str | None = "default", **config: Any,
    ) -> KVRAGEngine:
        """Load a model (HF id, local checkpoint folder, path of a ``.gguf`` file (converted once, see
        :func:`kvrag.default_model.prepare_gguf`); None: the embedded default; or an already loaded ``LoadedModel``)
        and open a store (URL or KVStore).

        ``quantize``: "int4" / "int8" weights for decode-sized products, None for dense weights, "default" for
        kvrag's choice for this model on this machine (:func:`kvrag.models.default_quantize`).

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
        loaded = (model if isinstance(model, LoadedModel)
                  else load_model(model, device=device, dtype=dtype, quantize=quantize))
        eng = cls(loaded, st, cfg)
        if start_error is not None and isinstance(eng.serving_store, FallbackStore):
            eng.serving_store.mark_down("connect", start_error)
        return eng

    # ----------------------------------------------------------------- query
    def plan(self, prompt: str, chunks: Sequence[str | RegisteredChunk], *, exact: Collection[str] = ()) -> Plan:
        """Split a rendered prompt around the registered chunks (exact substring search of their text).

        Chunks given as :class:`RegisteredChunk` (from :meth:`ensure` / :meth:`identify`) keep their identity (stored
        ids spliced in, key fetched, a held cache used as it is); ``exact``: chunk texts held to the strict rule of
        ``EngineConfig.strict_tokenization`` whatever it says."""
        if not isinstance(prompt, str):
            raise ConfigError(f"prompt must be a str (a rendered prompt), got {type(prompt).__name__}")
        texts, ids_of, derived = self._registered(chunks)
        plan = plan_prompt(prompt, texts, self.tokenize, ids_of, decode=self._decode,
                           strict=self.config.strict_tokenization, exact=frozenset(exact))
        return self._with_identity(plan, derived)

    def plan_parts(self, prefix: str, chunks: Sequence[str | RegisteredChunk], suffix: str,
                   separator: str = "") -> Plan:
        """Plan from explicit parts (no search): prefix, chunks in order (joined by ``separator``), suffix."""
        texts, ids_of, derived = self._registered(chunks)
        pieces = [TextPiece("prefix", prefix)]
        for i, c in enumerate(texts):
            if i and separator:
                pieces.append(TextPiece("text", separator))
            pieces.append(TextPiece("chunk" if prefix or i else "prefix", c))  # position 0: see split_prompt
        pieces.append(TextPiece("suffix", suffix))
        whole = self.tokenize("".join(p.text for p in pieces))
        plan = plan_pieces(pieces, self.tokenize, ids_of, registered=len(texts), whole=whole, decode=self._decode,
                           strict=self.config.strict_tokenization)
        return self._with_identity(plan, derived)

    def _registered(self, given: Iterable[str | RegisteredChunk]) -> tuple[list[str], Callable[[str], Sequence[int]],
                                                                          dict[str, RegisteredChunk]]:
        texts_not_one_str(given, "chunks")
        chunks = list(given)  # any iterable
        texts = [c.text if isinstance(c, RegisteredChunk) else c for c in chunks]
        for c, t in zip(chunks, texts, strict=True):
            if not isinstance(t, str):
                msg = f"a chunk must be a str or a RegisteredChunk, got {type(c).__name__}"
                raise ConfigError(msg)
        space = self.key_space()
        derived = {c.text: c for c in chunks if isinstance(c, RegisteredChunk) and c.derived_by(space)}

        def ids_of(text: str) -> Sequence[int]:
            ref = derived.get(text)
            return ref.token_ids if ref is not None and ref.token_ids is not None else self.tokenize(text)

        return texts, ids_of, derived

    @staticmethod
    def _with_identity(plan: Plan, derived: dict[str, RegisteredChunk]) -> Plan:
        """Attach the registered chunks' keys (and held caches) to the chunk segments spliced with their ids."""
        if not derived:
            return plan
        context, held = [], {}
        for s in plan.context:
            ref = derived.get(s.text) if s.kind == "chunk" else None
            if ref is not None and ref.token_ids == s.token_ids:
                s = dataclasses.replace(s, key=ref.key)
                if ref.kv is not None:
                    held[str(ref.key)] = ref.kv
            context.append(s)
        return dataclasses.replace(plan, context=tuple(context), held=held)

    def _decode(self, ids: Sequence[int]) -> str:
        return cast("str", self.tokenizer.decode(list(ids), skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False))

    def _fetch_stored(self, plan: Plan) -> tuple[list[str], dict[str, ChunkKV | None], float]:
        """The store's part of the plan's context caches, in one round trip (no model: runs outside the model's
        turn, in the caller's thread); returns the keys, what the store had, and the seconds it took."""
        t = time.perf_counter()
        keys = [s.key or self.chunk_key(s.token_ids, s.kind) for s in plan.context]
        ask = [k for k in dict.fromkeys(keys) if k not in plan.held]
        # shared: the chunks are only read (rotated into the request buffer), so a memory store need not copy them
        got: dict[str, ChunkKV | None] = dict(zip(ask, self.serving_store.get_many(ask, shared=True), strict=True))
        return keys, got, time.perf_counter() - t

    def _complete(self, plan: Plan, keys: list[str], got: dict[str, ChunkKV | None], timings: Timings,
                  pace: Pace) -> Generator[None, None, tuple[list, dict[str, int], list[tuple[str, ChunkKV]]]]:
        """The plan's context caches: held ones as they are, fetched ones, misses computed (the model). Returns the
        pieces, the hit/miss counts and the computed caches (which the caller stores after the model's turn).
        May yield after each computed miss (when ``pace`` is due): a piece boundary, where decoding requests step."""
        timings.compute_misses_s = 0.0
        counts = {"chunk_hits": 0, "chunk_misses": 0, "other_hits": 0, "other_misses": 0, "reused_tokens": 0}
        pieces, computed = [], []
        got = dict(got)
        for s, k in zip(plan.context, keys, strict=True):
            tag = "chunk" if s.kind == "chunk" else "other"
            ch = self.entry_for(k, s.token_ids, plan.held.get(k), got.get(k))
            if ch is None:
                counts[f"{tag}_misses"] += 1
                t = time.perf_counter()
                ch = self.compute(s.token_ids, s.kind)
                timings.compute_misses_s += time.perf_counter() - t
                computed.append((k, ch))
                got[k] = ch  # a repeated segment is computed once
                yield from pace.boundary()
            else:
                counts[f"{tag}_hits"] += 1
                counts["reused_tokens"] += len(s.token_ids)
                self._count(chunks_reused=1)
            pieces.append((s.kind, ch, k))
        return pieces, counts, computed

    def method(self, method: str | FusionMethod | None = None, **params: Any) -> FusionMethod:
        """The fusion method for a spec or instance (None: the configured default), one instance per canonical spec.

        Method instances carry state (a CacheRepair checkpoint resolved, hashed and loaded once per device), so
        every caller -- ``answer(method="...")``, the LlamaIndex and LangChain adapters, the benchmark, ``hybrid``
        and ``auto`` -- gets the process's instance for the same canonical spec (``repr``,
        :func:`kvrag.fusion.shared_method`) instead of building a new one per request.
        """
        if method is None and not params:
            return self.default_method
        return shared_method(method if method is not None else self.config.method, **params)

    def prepare(self, plan: Plan, method: str | FusionMethod | None = None, *, reserve: int | None = None) -> Prepared:
        """Fetch, assemble, repair and prefill the suffix for ``plan``; returns the state to decode from.

        ``reserve``: the most new tokens the request will be streamed for (default: ``GenerationConfig``'s
        ``max_new_tokens``). The request's KV is sized once from it (prompt + ``reserve`` positions), leased from
        the engine's bound at admission, and its buffer never grows (:mod:`kvrag.engine.lease`); a stream asking for
        more is refused. The request waits in arrival order while the bound is spent (at most
        ``config.admission_timeout_s``), then runs in the runner thread between two decode steps.

        Raises:
            ContextLengthError: the prompt does not fit the context window, or prompt + ``reserve`` exceeds the
                model's positions (before any work).
            EngineBusyError: not admitted within ``config.admission_timeout_s``.
            RequestCancelledError: the :class:`~kvrag.engine.runner.CancelToken` in effect was cancelled.
            EngineClosedError: the engine is closed.
        """
        m = self.method(method)
        if not m.reads_cache:  # e.g. full: the prompt's own tokenization, never a chunk's spliced ids
            plan = plan.as_prompt_tokenized()
        reserve = GenerationConfig().max_new_tokens if reserve is None else int(reserve)
        if reserve < 0:
            raise ConfigError(f"reserve must be >= 0 new tokens, got {reserve}")
        if plan.positions >= self.max_context:
            msg = (f"the prompt has {plan.positions} tokens ({plan.context_len} context + {len(plan.suffix.token_ids)} "
                   f"suffix) but the model's context window is {self.max_context}; fewer or shorter chunks or turns")
            raise ContextLengthError(msg)
        if plan.positions + reserve > self.max_positions:
            msg = (f"the prompt has {plan.positions} tokens and {reserve} new tokens are asked for, but the model "
                   f"handles {self.max_positions} positions (EngineConfig.max_context or the model's "
                   f"max_position_embeddings); fewer or shorter chunks or turns, or ask for at most "
                   f"{max(0, self.max_positions - plan.positions)} new tokens")
            raise ContextLengthError(msg)
        hit = self.conversations.match(plan.token_ids, repr(m), plan.context_len if m.reads_cache else 0,
                                       count=not (plan.inexact_chunks and m.reads_cache))
        spliced = None
        if hit is None and plan.inexact_chunks and m.reads_cache:  # a kept turn that recomputed the whole prompt
            whole = plan.as_prompt_tokenized()
            hit = self.conversations.match(whole.token_ids, repr(m), whole.context_len)
            plan, spliced = (whole, plan) if hit is not None else (plan, None)
        if hit is not None:  # the next turn of a kept conversation: only the new text is prefilled
            return self.runner.prepare(plan.positions + reserve,
                                       lambda lease: prepare_hit(self, plan, m, lease, hit, spliced))
        moved = (self.conversations.match_moved(plan.token_ids, plan.context_len, repr(m))
                 if m.reads_cache and self.config.move_history else None)
        if moved is not None:  # a kept history behind new passages: held as context, repaired with them
            plan = moved_plan(plan, moved, self.rope, self.spec)
        timings = Timings()
        fetched = None
        if m.reads_cache:  # store I/O before the request's turn: running requests keep decoding meanwhile
            keys, got, timings.fetch_s = self._fetch_stored(plan)
            fetched = (keys, got)
        computed: list[tuple[str, ChunkKV]] = []
        prep = self.runner.prepare(plan.positions + reserve,  # the one sizing: the lease holds these positions
                                   lambda lease: self._prepare(plan, m, lease, timings, fetched, computed))
        self.store_computed(computed)  # misses computed in the turn are stored after it
        if moved is not None:
            prep.moved_from = moved.entry
            if prep.stats.reused_tokens:  # counted as the chunk caches are (not when the prompt was recomputed over
                prep.stats.conversation_tokens = moved.length  # its own ids)
        return prep

    def _prepare(self, plan: Plan, m: FusionMethod, lease: Lease, timings: Timings,
                 fetched: tuple[list[str], dict[str, ChunkKV | None]] | None,
                 computed: list[tuple[str, ChunkKV]]) -> PrepareJob[Prepared]:
        """The prepare itself (in the runner thread, in the request's turn, holding the model): compute missing
        chunk caches, assemble, repair, prefill the suffix. While other requests decode it runs in pieces of about
        the runner's budget (:meth:`Runner.piece_budget_s`), ending one after a computed chunk cache or inside a
        repair that recomputes context (:meth:`FusionMethod.fuse_pieces`, :mod:`kvrag.kv.pieces`) and the suffix
        prefill after it; else in one piece (a cancelled prepare still stops at the next checkpoint of a long
        forward: :meth:`Scheduler.preparing_cancelled`). After a short repair (``stale``, ``cacherepair``, ...) it
        parks at the suffix prefill (yields a :class:`~kvrag.kv.pieces.SuffixPrefill`): the runner prefills it --
        alone, or with ``EngineConfig.pack_suffixes`` with other arrivals' -- and sends back the logits.
        Timings leave out the decode steps between pieces; a packed suffix prefill counts the request's share of
        the shared forward (by tokens), not the wait for the other arrivals (like the wait for the turn, TTFT
        leaves it out). The prompt's K/V are computed in the lease's buffer (:meth:`Lease.prompt_buffer`)."""
        t0 = time.perf_counter() - timings.fetch_s  # TTFT counts the store fetch, not the wait for the turn
        pace = Pace(self.runner.piece_budget_s, self.model.device, self.runner.scheduler.preparing_cancelled)
        # Only methods whose repair recomputes context run in pieces (full, relaxkv, hybrid, auto): a reuse
        # method's whole prepare (assemble + a question-sized prefill) is a few decode steps, and cutting it into
        # half-step pieces let a burst's arrivals join the batch several times later.
        long_repair = type(m).fuse_pieces is not FusionMethod.fuse_pieces
        buf = lease.prompt_buffer(self.spec, plan.positions, self.model.dtype, self.model.device)
        keys: list[str] | list[None]
        if fetched is not None:
            keys = fetched[0]
            pieces, counts, new = yield from self._complete(plan, fetched[0], fetched[1], timings, pace)
            t0 = time.perf_counter() - timings.fetch_s - timings.compute_misses_s  # not the steps between pieces
            computed.extend(new)
            t = time.perf_counter()
            inp = assemble(self.model, self.rope, self.spec, pieces, plan.suffix.token_ids, buffer=buf,
                           chunk_prefix_ids=self.chunk_prefix_ids, canonical=m.reads_canonical_keys)
            timings.assemble_s = time.perf_counter() - t
            if plan.inexact_chunks and plan.prompt_ids:  # what a computation of the whole prompt runs over
                import torch

                inp.prompt_ids = torch.tensor(plan.prompt_ids, dtype=torch.long)
        else:  # e.g. full prefill: the stale KV is never read, so it is neither fetched nor assembled
            counts = dict.fromkeys(("chunk_hits", "chunk_misses", "other_hits", "other_misses", "reused_tokens"), 0)
            keys = [None] * len(plan.context)
            inp = context_only_input(self.model, self.rope, self.spec, plan.context, plan.suffix.token_ids,
                                     buffer=buf)
        t, paused = time.perf_counter(), pace.paused_s  # paused_s: other requests' steps between pieces
        out = yield from m.fuse_pieces(inp, pace)
        timings.repair_s = time.perf_counter() - t - (pace.paused_s - paused)
        t, repair_paused = time.perf_counter(), pace.paused_s - paused
        if out.last_logits is None and not long_repair and self.runner.parks_at_suffix:
            # parks here: the runner prefills the suffix (alone, or with other arrivals' when packing them)
            got, length = hf_cache.buffer_of(out.cache)
            buf.put(got, length)  # no copy when the method repaired in place; else its K/V into the request's buffer
            ids = tuple(inp.suffix_ids.tolist())
            parked = time.perf_counter()
            last, timings.suffix_prefill_s = yield SuffixPrefill(batched.Row(buf, length), ids)
            t0 += time.perf_counter() - parked - timings.suffix_prefill_s  # waiting for others: like the turn
            cache = buf.as_cache(length + len(ids))
        else:
            if out.last_logits is None:  # the suffix in pieces too after a long repair
                logits, cache = yield from forward_pieces(self.model, inp.suffix_ids, out.cache,
                                                          start=inp.context_len,
                                                          pace=pace if long_repair else Pace(None))
                last = logits[-1]
            else:
                cache, last = out.cache, out.last_logits
            timings.suffix_prefill_s = time.perf_counter() - t - (pace.paused_s - paused - repair_paused)
        t0 += pace.paused_s - paused
        spliced = plan
        if out.prompt_tokenized:  # the whole prompt recomputed over its own ids: the request's ids are those
            plan = plan.as_prompt_tokenized()
        # the method's time to first token without computing missing caches: what `auto` learns from
        m.observe(Observation(self.model, plan.context_len, len(plan.suffix.token_ids), timings.fetch_s
                              + timings.assemble_s + timings.repair_s + timings.suffix_prefill_s, out.stats))
        found = plan.found
        stats = Stats(
            context_tokens=plan.context_len,
            suffix_tokens=len(plan.suffix.token_ids),
            chunk_tokens=spliced.chunk_tokens,
            chunks_registered=plan.registered,
            chunks_found=found,
            inexact_chunks=spliced.inexact_chunks,
            chunk_hits=counts["chunk_hits"],
            chunk_misses=counts["chunk_misses"],
            other_hits=counts["other_hits"],
            other_misses=counts["other_misses"],
            reused_tokens=out.reused(counts["reused_tokens"]),
            hit_rate=(counts["chunk_hits"] / plan.registered) if plan.registered else 0.0,
            method_stats=out.stats,
        )
        chunk_keys = [k for s, k in zip(spliced.context, keys, strict=True) if s.kind == "chunk" and k]
        return Prepared(plan, m, cache, last, timings, stats, chunk_keys, t0, kv_lease=lease)

    def stream(self, prepared: Prepared, gen: GenerationConfig | None = None) -> Iterator[str]:
        """Decode from a prepared request, yielding text deltas; fills ``prepared.timings`` as it goes.

        The request joins the engine's decode batch when the generator starts and leaves it when the answer ends,
        the generator is closed or garbage-collected, or the :class:`~kvrag.engine.runner.CancelToken` in effect
        is cancelled (then the generator raises :class:`~kvrag.errors.RequestCancelledError`). Tokens are
        computed by the runner thread, not under the consumer, so the consumer may pause, or resume in another
        thread. A Prepared is streamed once.

        Raises:
            ConfigError: ``prepared`` is already streaming or was streamed, or ``gen.max_new_tokens`` exceeds the
                ``reserve`` it was prepared with.
        """
        gen = gen or GenerationConfig()
        timings = prepared.timings
        tokens = prepared.token_ids

        def first() -> None:
            timings.ttft_s = time.perf_counter() - prepared.t0

        t = time.perf_counter()
        req = self.runner.submit(prepared, gen, self._eos_ids(), first, prompt_ids=prepared.plan.token_ids)
        token = current_token()
        remove = token.on_cancel(lambda: self.runner.cancel(req)) if token is not None else (lambda: None)
        try:
            for tok, delta in self.runner.iterate(req):
                if tok >= 0:
                    tokens.append(tok)
                if delta:
                    yield delta
        finally:
            remove()
            self.runner.cancel(req)  # leave the batch if the consumer stopped early (no-op once finished)
        if timings.ttft_s is None:
            timings.ttft_s = time.perf_counter() - prepared.t0
        timings.decode_s = time.perf_counter() - t
        timings.total_s = time.perf_counter() - prepared.t0
        prepared.stats.generated_tokens = len(tokens)
        prepared.stats.decode_forwards = req.spec.decode_forwards
        prepared.stats.drafted_tokens = req.spec.drafted_tokens
        prepared.stats.accepted_tokens = req.spec.accepted_tokens
        prepared.stats.finish_reason = getattr(req.state, "reason", None)
        keep_answered(self.conversations, prepared)  # the next turn of this conversation reuses it

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; let those in flight finish (``cancel``: cancel them; ``timeout``: cancel what is
        left after that many seconds); join the runner thread. Later requests raise
        :class:`~kvrag.errors.EngineClosedError`. Idempotent."""
        self.runner.close(cancel=cancel, timeout=timeout)

    def __enter__(self) -> KVRAGEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        """Answer a fully rendered prompt; ``chunks`` are the registered chunk texts to find and reuse; generation
        settings as ``gen`` or as keywords (:meth:`GenerationConfig.of`)."""
        return self.answer_plan(self.plan(prompt, chunks), method, GenerationConfig.of(gen, **gen_kwargs))

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """Render one user turn with the tokenizer's chat template (plus the generation prompt)."""
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return render_chat(self.tokenizer, msgs)
